"""bfloat16 matrix products at float32's speed on a CPU without bfloat16 instructions.

PyTorch multiplies bfloat16 matrices on the CPU with oneDNN where the CPU has AVX-512 (or Arm's
BF16 extension). Elsewhere, as on an x86 CPU with AVX2 but not AVX-512, it falls back to a
generic loop, tens of times slower than float32's product: `python benchmarks/bfloat16.py`
measures both on yours, and benchmarks/README.md shows a run (1.3 GFLOP/s against float32's 140
for 512 x 512, on a 2-core AMD EPYC with AVX2; lesson 14's model trained 5.6x slower with it
than with this module's kernels).

The arithmetic is the same either way: the bfloat16 inputs, whose float32 values are exact,
multiplied and summed in float32, and the result rounded once to bfloat16. So on such a CPU,
`install()` (which `import helpers` calls) gives aten's `mm`, `addmm` and `bmm` CPU kernels that
do exactly that through float32's own kernels; results differ from the generic loop's only by the
order of the float32 sums. Other dtypes, other devices, autograd and what autograd saves for
backward (bfloat16 tensors, as before) are untouched; a CPU with oneDNN's bfloat16 keeps
PyTorch's kernels.
"""

from __future__ import annotations

import warnings

import torch

PRODUCTS = ("mm", "addmm", "bmm")  # the aten operators given float32-computed kernels

_library = None  # the torch.library registration while installed


def native() -> bool:
    """Whether PyTorch multiplies bfloat16 matrices on this CPU with oneDNN (AVX-512, Arm BF16)."""
    return bool(torch.backends.mkldnn.is_available()
                and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def installed() -> bool:
    """Whether this process's bfloat16 products are computed in float32 (`install`)."""
    return _library is not None


def describe() -> str:
    """How this process multiplies bfloat16 matrices on the CPU, in words."""
    if installed():
        return ("float32 products of the bfloat16 values, rounded to bfloat16 "
                "(this CPU has no bfloat16 instructions: helpers.bfloat16)")
    return "PyTorch's own bfloat16 kernels"


def _result(inputs, compute):
    """`compute(*operands, out=)` in float32 for bfloat16 inputs, rounded to bfloat16; in the
    inputs' own dtype otherwise, through the out= overload (whose kernel is PyTorch's)."""
    if all(value.dtype == torch.bfloat16 for value in inputs):
        out = torch.empty(0, dtype=torch.float32, device=inputs[0].device)
        compute(*(value.float() for value in inputs), out=out)
        return out.to(torch.bfloat16)
    # any dtype but bfloat16: PyTorch's kernel, whose checks of shapes and dtypes raise as before
    out = torch.empty(0, dtype=inputs[0].dtype, device=inputs[0].device)
    compute(*inputs, out=out)
    return out


def _mm(self, mat2):
    return _result((self, mat2), torch.mm)


def _bmm(self, mat2):
    return _result((self, mat2), torch.bmm)


def _addmm(self, mat1, mat2, *, beta=1, alpha=1):
    return _result((self, mat1, mat2),
                   lambda bias, left, right, out: torch.addmm(bias, left, right, beta=beta,
                                                              alpha=alpha, out=out))


def install(force: bool = False) -> bool:
    """Compute this process's CPU bfloat16 products in float32 if PyTorch has no fast bfloat16
    kernel here (or `force`). Processes forked later inherit it. Returns whether it is on."""
    global _library
    if _library is None and (force or not native()):
        library = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # "Overriding a previously registered kernel": on purpose
            warnings.simplefilter("ignore")
            for name, kernel in zip(PRODUCTS, (_mm, _addmm, _bmm)):
                library.impl(name, kernel, "CPU")
        _library = library
    return installed()


def uninstall() -> None:
    """PyTorch's own kernels again."""
    global _library
    if _library is not None:
        _library._destroy()
        _library = None
