"""bfloat16 matrix products many times faster on a CPU without bfloat16 instructions.

PyTorch multiplies bfloat16 matrices on the CPU with oneDNN where the CPU has AVX-512 (or Arm's
BF16 extension). Elsewhere, as on an x86 CPU with AVX2 but not AVX-512, it falls back to a
generic loop, tens of times slower than float32's product: `python benchmarks/bfloat16.py`
measures both on yours, and benchmarks/README.md shows a run (1.3 GFLOP/s against float32's 140
for 512 x 512, and 73.5 this module's way, on a 2-core AMD EPYC with AVX2; lesson 14's model
trained 5.6x slower with PyTorch's loop than with this module's kernels).

Both multiply the bfloat16 values, whose float32 values are exact, sum the products in float32
and round the result once to bfloat16. So on such a CPU, `install()` (which `import helpers`
calls) registers CPU kernels for aten's `mm`, `addmm` and `bmm` that do exactly that with
PyTorch's own float32 kernels: results differ from the generic loop's only by the order of the
float32 sums. Every other dtype goes straight to PyTorch's kernel (`torch.library.get_kernel`),
at the cost of a Python call (microseconds). Autograd, and what it saves for backward (bfloat16
tensors, as before), are untouched; a product briefly holds float32 copies of its operands and
result. Not covered: other products (`mv`, `dot`, `baddbmm`), calls with `out=`, and
torch.compile's code (which calls `mm` with `out=`). A CPU with oneDNN's bfloat16 keeps PyTorch's
kernels.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

PRODUCTS = ("mm", "addmm", "bmm")  # the aten operators given float32-computed kernels

_library = None  # the torch.library registration while installed


def native() -> bool:
    """Whether PyTorch multiplies bfloat16 matrices on this CPU with oneDNN (AVX-512, Arm BF16)."""
    return bool(torch.backends.mkldnn.is_available()
                and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def installed() -> bool:
    """Whether this process's bfloat16 products are computed in float32 (`install`): this
    module's kernels are registered (tests/test_bfloat16.py checks that they are the ones
    called)."""
    return _library is not None


def describe() -> str:
    """How this process multiplies bfloat16 matrices on the CPU, in words."""
    if installed():
        return ("float32 products of the bfloat16 values, rounded to bfloat16 "
                "(this CPU has no bfloat16 instructions: helpers.bfloat16)")
    return "PyTorch's own bfloat16 kernels"


def _kernel(name: str):
    """aten::`name`'s CPU kernel, computing in float32 for bfloat16 inputs and rounding once, and
    PyTorch's own kernel (called as is) for every other dtype."""
    theirs = torch.library.get_kernel(f"aten::{name}", "CPU")

    def ours(keys, *operands, **options):
        if all(value.dtype == torch.bfloat16 for value in operands):
            product = theirs.call_boxed(keys, *(value.float() for value in operands), **options)
            return product.to(torch.bfloat16)
        return theirs.call_boxed(keys, *operands, **options)

    return ours


def install(force: bool = False) -> bool:
    """Compute this process's CPU bfloat16 products in float32 if PyTorch has no fast bfloat16
    kernel here (or `force`). Processes forked later inherit it. Returns whether it is on."""
    global _library
    if _library is None and (force or not native()):
        library = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # "Overriding a previously registered kernel": on purpose
            warnings.simplefilter("ignore")
            for name in PRODUCTS:
                library.impl(name, _kernel(name), "CPU", with_keyset=True)
        _library = library
    return installed()


def uninstall() -> None:
    """PyTorch's own kernels again."""
    global _library
    if _library is not None:
        _library._destroy()
        _library = None


@contextlib.contextmanager
def kernels(ours: bool):
    """This process with this module's kernels (`ours`) or PyTorch's, then as it was: for
    comparing the two (tests/test_bfloat16.py, benchmarks/bfloat16.py)."""
    was = installed()
    uninstall()
    if ours:
        install(force=True)
    try:
        yield
    finally:
        uninstall()
        if was:
            install(force=True)

