"""helpers.bfloat16: on a CPU without bfloat16 instructions, bfloat16 products computed in float32
and rounded once. Each expected value is the exact product (float64, whose sums of these products
are exact to far below a bfloat16 step) rounded to bfloat16, or PyTorch's own kernel."""

import pytest
import torch
import torch.nn.functional as F

import helpers.bfloat16 as bfloat16
from helpers import run
from helpers.reference import seeded_randn

pytestmark = pytest.mark.numerical

BF16 = torch.bfloat16


def operands(*shapes, dtype=BF16):
    return [seeded_randn(index, *shape).to(dtype) for index, shape in enumerate(shapes)]


def exact(compute, *values):
    """The product in float64 (exact to far below a bfloat16 step), rounded once to bfloat16."""
    return compute(*(value.double() for value in values)).to(BF16)


def assert_one_rounding(actual, expected, inner: int, largest: float):
    """Equal within one bfloat16 step (2^-7 of the value at most: 8 significant bits), plus the
    bound on a float32 sum's own error, inner x float32 epsilon x the largest product of two
    entries: a float32 sum near a rounding boundary can fall on its other side, and a result
    near zero, where cancellation leaves the float32 sum's error larger than a step of it."""
    assert actual.dtype == BF16
    atol = inner * torch.finfo(torch.float32).eps * largest
    torch.testing.assert_close(actual.double(), expected.double(), rtol=2 ** -7, atol=atol)


def bound(*values):
    """The largest |left entry| x |right entry| of a product's two matrices (its last two
    operands)."""
    left, right = values[-2:]
    return left.abs().max().item() * right.abs().max().item()


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
    with bfloat16.kernels(ours=True):
        actual = compute(*values)
    inner = values[-2].shape[-1]
    # addmm's alpha = 2 doubles each product; its bias adds no error of the sum's
    assert_one_rounding(actual, exact(compute, *values), inner, 2 * bound(*values))
    # and almost always the very same bits: a float32 sum lands near a rounding boundary rarely
    # (about inner x float32 epsilon / a bfloat16 step of the entries, under 1e-3 here)
    assert (actual == exact(compute, *values)).float().mean() > 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
@pytest.mark.parametrize("name", sorted(PRODUCTS))
def test_other_dtypes_get_pytorchs_own_kernel_bit_for_bit(name, dtype):
    compute, shapes = PRODUCTS[name]
    values = [value.round() if not dtype.is_floating_point else value
              for value in operands(*shapes, dtype=torch.float64)]
    values = [value.to(dtype) for value in values]
    with bfloat16.kernels(ours=False):
        theirs = compute(*values)
    with bfloat16.kernels(ours=True):
        ours = compute(*values)
    assert ours.dtype == dtype and ours.shape == theirs.shape
    assert torch.equal(ours, theirs)


@pytest.mark.once
def test_errors_are_pytorchs_own():
    left, right = operands((4, 5), (6, 3))
    messages = []
    for ours in (False, True):
        with bfloat16.kernels(ours=ours), pytest.raises(RuntimeError) as raised:
            torch.mm(left, right)
        messages.append(str(raised.value))
    assert messages[0] == messages[1]


def test_gradients_and_autocast_are_the_exact_ones_rounded():
    """Autograd is untouched: a linear layer under CPU autocast, forward and backward, equals the
    float64 products each rounded once, as native bfloat16 kernels would give them."""
    x, weight, bias = operands((16, 32), (24, 32), (24,), dtype=torch.float32)
    upstream = seeded_randn(9, 16, 24)
    with bfloat16.kernels(ours=True):
        x.requires_grad_(), weight.requires_grad_()
        with torch.autocast("cpu", BF16):
            y = F.linear(x, weight, bias)
        y.backward(upstream.to(BF16))
    xb, wb, ub = x.detach().to(BF16), weight.detach().to(BF16), upstream.to(BF16)
    assert_one_rounding(y, exact(lambda a, w, b: F.linear(a, w, b), xb, wb, bias.to(BF16)),
                        32, bound(xb, wb))
    # autocast's backward: bfloat16 products, then accumulated into float32's .grad
    assert_one_rounding(x.grad.to(BF16), exact(torch.mm, ub, wb), 24, bound(ub, wb))
    assert_one_rounding(weight.grad.to(BF16), exact(torch.mm, ub.T, xb), 16, bound(ub, xb))


def copies_to_float32(compute, *values) -> int:
    """How many conversions the profiler saw inside `compute(*values)`."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        compute(*values)
    return sum(event.count for event in profile.key_averages() if event.key == "aten::_to_copy")


@pytest.mark.once
@pytest.mark.parametrize("name", sorted(PRODUCTS))
def test_the_products_go_through_this_modules_kernels_only_when_installed(name):
    """The numbers cannot tell the kernels apart (both round the exact sum once): what each
    does can. Ours converts the operands to float32 and the result back."""
    compute, shapes = PRODUCTS[name]
    values = operands(*shapes)
    with bfloat16.kernels(ours=True):
        assert copies_to_float32(compute, *values) == len(values) + 1
        assert copies_to_float32(compute, *(value.float() for value in values)) == 0
    with bfloat16.kernels(ours=False):
        assert copies_to_float32(compute, *values) == 0


@pytest.mark.once
def test_it_is_on_exactly_where_pytorch_has_no_fast_bfloat16():
    assert bfloat16.installed() == (not bfloat16.native())


def installed_worker(rank, world_size):
    return bfloat16.installed()


@pytest.mark.once
def test_every_rank_multiplies_as_the_kernel_does():
    assert run(installed_worker, 2, show_output=False).results == [bfloat16.installed()] * 2
