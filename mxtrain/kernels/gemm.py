"""MX GEMM on GPUs without block-scaled tensor cores (Hopper): exact bf16 operands into cuBLAS.

Every MX value ``code * 2**X`` is exact in bf16 (at most 8 significant bits; the
only exception is a scale so small that the value falls below bf16's smallest
subnormal, 2**-133), so the fused unpack + dequantize kernel writes the operand
in bf16 and cuBLAS multiplies it with fp32 accumulation: the result is the
fp32-accumulated product of the dequantized operands, as the reference computes
it, up to the order of accumulation. An operand whose cast already wrote its
dequantized bf16 values (``MXTensor.values``) skips the dequantize pass. A columnwise plane is dequantized in the
logical layout and handed over as a transposed view (cuBLAS takes either).

Measured figures for this path and for the alternatives are in
benchmarks/RESULTS.md and benchmarks/NOTES_gemm.md.
"""

from __future__ import annotations

import torch

from mxtrain.kernels.dispatch import dequantize, register_gemm
from mxtrain.quantization import MXTensor


def _operand(t: "MXTensor | torch.Tensor", axis: int, dtype: torch.dtype) -> torch.Tensor:
    """The 2-D operand with its reduction axis last (a view where a transpose is needed).

    An MXTensor that carries the dequantized values of this plane (written by the
    cast, see ``MXTensor.values``) hands them over as they are when their dtype is
    the GEMM's: they are ``dequantize(dtype, axis)`` bit for bit, so no pass runs.
    In another dtype the codes are dequantized, or, where only values were kept,
    the values are cast (exact for fp32 values and for bf16 values of a bf16 input).
    """
    if isinstance(t, MXTensor):
        carried = t.dequantized_values(axis)
        if carried is not None and carried.dtype == dtype:
            logical = carried
        else:
            logical = dequantize(t, dtype, axis)  # a values-only plane: MXTensor.dequantize casts them
    else:
        logical = t.to(dtype)
    return logical if axis % 2 == 1 else logical.t()


def _mm(a: torch.Tensor, b_t: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    if out_dtype == a.dtype:
        if bias is not None:
            return torch.addmm(bias.to(out_dtype), a, b_t)  # cuBLASLt bias epilogue, one rounding
        return a @ b_t
    out = torch.mm(a, b_t, out_dtype=out_dtype)  # fp32 accumulation, fp32 result
    return out if bias is None else out.add_(bias.to(out_dtype))


def cublas_mx_gemm(a, b, *, a_axis: int = 1, b_axis: int = 1, out_dtype: torch.dtype = torch.float32,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """``A @ B.T (+ bias)`` for MX or plain CUDA operands through bf16 cuBLAS with fp32 accumulation."""
    plain = [t for t in (a, b) if not isinstance(t, MXTensor)]
    # an fp32 high-precision operand keeps the GEMM in fp32 (nothing may be rounded away)
    dtype = torch.float32 if any(t.dtype == torch.float32 for t in plain) else torch.bfloat16
    if any(t.dtype == torch.float16 for t in plain):
        dtype = torch.float32
    av, bv = _operand(a, a_axis, dtype), _operand(b, b_axis, dtype)
    if av.shape[1] != bv.shape[1]:
        raise ValueError(f"GEMM reduction sizes differ: {av.shape[1]} vs {bv.shape[1]}")
    return _mm(av, bv.t(), bias, out_dtype)


register_gemm("cuda", cublas_mx_gemm)
