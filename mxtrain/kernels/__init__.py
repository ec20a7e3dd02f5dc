"""Fast kernels (Triton here, CUDA C++ in mxtrain/csrc) and the one dispatch point to them.

:mod:`mxtrain.kernels.dispatch` picks, per call, a GPU kernel or the exact
reference in :mod:`mxtrain.quantization`; both produce identical bits.
"""

from mxtrain.kernels.dispatch import gemm_operand, mx_gemm, quantize

__all__ = ["mx_gemm", "gemm_operand", "quantize"]
