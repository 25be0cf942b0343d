"""helpers.bfloat16: on a CPU without bfloat16 instructions, bfloat16 products computed in float32
and rounded once. Each expected value is the exact product (float64, whose sums of these products
are exact to far below a bfloat16 step) rounded to bfloat16, or PyTorch's own kernel."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

import helpers.bfloat16 as bfloat16
from helpers import run
from helpers.reference import seeded_randn

pytestmark = pytest.mark.numerical

BF16 = torch.bfloat16


@contextlib.contextmanager
def kernels(ours: bool):
    """This process with the float32-computed kernels (ours) or PyTorch's, then as it was."""
    was = bfloat16.installed()
    bfloat16.uninstall()
    if ours:
        bfloat16.install(force=True)
    try:
        yield
    finally:
        bfloat16.uninstall()
        if was:
            bfloat16.install(force=True)


def operands(*shapes, dtype=BF16):
    return [seeded_randn(index, *shape).to(dtype) for index, shape in enumerate(shapes)]


def exact(compute, *values):
    """The product in float64, rounded once to bfloat16: what the hardware's kernels return, but
    for a tie broken by a float32 sum's last bit."""
    return compute(*(value.double() for value in values)).to(BF16)


def assert_one_rounding(actual, expected):
    """Equal, or one bfloat16 step apart where the float32 sum fell on the other side of a
    rounding boundary: a step is 2^-7 of the value at most (8 significant bits)."""
    assert actual.dtype == BF16
    torch.testing.assert_close(actual.double(), expected.double(), rtol=2 ** -7, atol=1e-30)


PRODUCTS = {
    "mm": (torch.mm, ((48, 96), (96, 40))),
    "bmm": (torch.bmm, ((3, 32, 64), (3, 64, 24))),
    "addmm": (lambda bias, left, right: torch.addmm(bias, left, right, beta=0.5, alpha=2.0),
              ((40,), (48, 96), (96, 40))),
}


@pytest.mark.parametrize("name", sorted(PRODUCTS))
def test_a_bfloat16_product_is_the_exact_one_rounded_once(name):
    compute, shapes = PRODUCTS[name]
    values = operands(*shapes)
    with kernels(ours=True):
        actual = compute(*values)
    assert_one_rounding(actual, exact(compute, *values))
    # and almost always the very same bits: a tie is rare
    assert (actual == exact(compute, *values)).float().mean() > 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
@pytest.mark.parametrize("name", sorted(PRODUCTS))
def test_other_dtypes_get_pytorchs_own_kernel_bit_for_bit(name, dtype):
    compute, shapes = PRODUCTS[name]
    values = [value.round() if not dtype.is_floating_point else value
              for value in operands(*shapes, dtype=torch.float64)]
    values = [value.to(dtype) for value in values]
    with kernels(ours=False):
        theirs = compute(*values)
    with kernels(ours=True):
        ours = compute(*values)
    assert ours.dtype == dtype and ours.shape == theirs.shape
    assert torch.equal(ours, theirs)


@pytest.mark.once
def test_errors_are_pytorchs_own():
    left, right = operands((4, 5), (6, 3))
    messages = []
    for ours in (False, True):
        with kernels(ours=ours), pytest.raises(RuntimeError) as raised:
            torch.mm(left, right)
        messages.append(str(raised.value))
    assert messages[0] == messages[1]


def test_gradients_and_autocast_are_the_exact_ones_rounded():
    """Autograd is untouched: a linear layer under CPU autocast, forward and backward, equals the
    float64 products each rounded once, as native bfloat16 kernels would give them."""
    x, weight, bias = operands((16, 32), (24, 32), (24,), dtype=torch.float32)
    upstream = seeded_randn(9, 16, 24)
    with kernels(ours=True):
        x.requires_grad_(), weight.requires_grad_()
        with torch.autocast("cpu", BF16):
            y = F.linear(x, weight, bias)
        y.backward(upstream.to(BF16))
    xb, wb = x.detach().to(BF16), weight.detach().to(BF16)
    assert_one_rounding(y, exact(lambda a, w, b: F.linear(a, w, b), xb, wb, bias.to(BF16)))
    grad_x = exact(torch.mm, upstream.to(BF16), wb)  # autocast's backward: bfloat16, then
    assert_one_rounding(x.grad.to(BF16), grad_x)  # accumulated into float32's .grad
    assert_one_rounding(weight.grad.to(BF16), exact(torch.mm, upstream.to(BF16).T, xb))


@pytest.mark.once
def test_it_is_on_exactly_where_pytorch_has_no_fast_bfloat16():
    assert bfloat16.installed() == (not bfloat16.native())


def installed_worker(rank, world_size):
    return bfloat16.installed()


@pytest.mark.once
def test_every_rank_multiplies_as_the_kernel_does():
    assert run(installed_worker, 2, show_output=False).results == [bfloat16.installed()] * 2
