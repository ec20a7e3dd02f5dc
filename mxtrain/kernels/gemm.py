"""MX GEMM on GPUs without block-scaled tensor cores (Hopper): exact bf16 operands into cuBLAS.

Every MX value is exact in bf16 (but below bf16's smallest subnormal), so the operands are dequantized to
bf16 (or taken from ``MXTensor.values``) and cuBLAS multiplies them with fp32 accumulation: the reference's
product up to the order of accumulation. On sm_100+ MXFP8 codes go to ``torch._scaled_mm`` with E8M0 scales
(:func:`scaled_mm_mx_gemm`). Design: docs/kernels.md; speed: benchmarks/NOTES_gemm.md.
"""

from __future__ import annotations

import functools

import torch

from mxtrain import config
from mxtrain.kernels import registry
from mxtrain.kernels.calls import GemmCall
from mxtrain.kernels.dispatch import dequantize
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


# ---- sm_100+ (Blackwell): block-scaled tensor cores through torch._scaled_mm ------------------------
# Untested here (the lent GPUs are Hopper): tests/kernels/test_gemm_scaled_mm.py checks the argument
# preparation against an emulation of cuBLAS's documented semantics. MXTRAIN_MX_SCALED_MM=0 turns it off.
_FP8_DTYPES = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
_SCALED_MM_BROKEN: dict[int, str] = {}  # device index -> why torch._scaled_mm failed there once


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def native_mx_gemm(device: torch.device) -> bool:
    """Whether MXFP8 GEMMs on ``device`` go to block-scaled tensor cores (sm_100+ through
    ``torch._scaled_mm``): then the casts keep codes for every plane (no bf16 values are needed)."""
    if not config.current().mx_scaled_mm or device.type != "cuda" or not hasattr(torch, "float8_e8m0fnu"):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    # traced: torch's own call (dynamo warns on every lru_cache it traces through, and reads the capability anyway)
    capability = torch.cuda.get_device_capability(index) if torch.compiler.is_compiling() else _capability(index)
    return index not in _SCALED_MM_BROKEN and capability >= (10, 0)


def blocked_scales(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 scale bytes ``[rows, nblocks]`` (uint8) in cuBLAS's block-scaling-factor layout, as
    ``torch._scaled_mm`` takes them for 1x32 blocks: zero-padded to 128-row x 4-block tiles, tiles
    row-major, and inside a tile the scale of (row r, block c) at ``(r % 32) * 16 + (r // 32) * 4 + c``.
    Returned flat, viewed as ``torch.float8_e8m0fnu``."""
    if scale.dtype != torch.uint8 or scale.ndim != 2:
        raise ValueError(f"blocked_scales takes 2-D uint8 E8M0 bytes, got {scale.dtype} of shape {list(scale.shape)}")
    rows, cols = scale.shape
    nr, nc = -(-rows // 128), -(-cols // 4)
    padded = scale
    if (rows, cols) != (nr * 128, nc * 4):
        padded = scale.new_zeros(nr * 128, nc * 4)
        padded[:rows, :cols] = scale
    tiles = padded.view(nr, 128, nc, 4).permute(0, 2, 1, 3)           # [tile row, tile col, r, c]
    inner = tiles.reshape(nr * nc, 4, 32, 4).transpose(1, 2)          # r = 32 * i + j -> [j, i, c]
    return inner.reshape(-1).view(torch.float8_e8m0fnu)


def _codes_plane(t: MXTensor, axis: int):
    return next((p for p in t.planes if p.axis == axis % len(t.shape)), None)


def scaled_mm_unsupported(a, b, a_axis: int, b_axis: int) -> str | None:
    """Why :func:`scaled_mm_mx_gemm` does not take these operands, or None."""
    if not (isinstance(a, MXTensor) and isinstance(b, MXTensor)):
        return "both operands must be MXTensors"
    if a.fmt not in _FP8_DTYPES or b.fmt not in _FP8_DTYPES or a.fmt == b.fmt == "fp8_e5m2":
        return f"formats {a.fmt} x {b.fmt} (block-scaled MMA: MXFP8, not e5m2 x e5m2)"
    if a.block_size != 32 or b.block_size != 32 or len(a.shape) != 2 or len(b.shape) != 2:
        return "2-D operands with block size 32 only"
    pa, pb = _codes_plane(a, a_axis), _codes_plane(b, b_axis)
    if pa is None or pb is None:
        return "an operand carries no codes for its GEMM axis"
    if pa.data.shape[1] != pb.data.shape[1] or pa.data.shape[0] % 16 or pb.data.shape[0] % 16:
        return f"plane shapes {list(pa.data.shape)} x {list(pb.data.shape)} (same padded K, rows % 16 == 0)"
    return None


def scaled_mm_mx_gemm(a: MXTensor, b: MXTensor, *, a_axis: int = 1, b_axis: int = 1,
                      out_dtype: torch.dtype = torch.float32, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``A @ B.T (+ bias)`` of two MXFP8 planes on block-scaled tensor cores (``torch._scaled_mm``).

    The planes are used as stored: codes ``[rows, K padded to 32]`` viewed as fp8 (the zero
    padding contributes nothing), their E8M0 bytes rearranged by :func:`blocked_scales`.
    """
    reason = scaled_mm_unsupported(a, b, a_axis, b_axis)
    if reason is not None:
        raise ValueError(f"scaled_mm_mx_gemm: {reason}")
    pa, pb = a.plane(a_axis), b.plane(b_axis)
    da = pa.data.view(getattr(torch, _FP8_DTYPES[a.fmt]))
    db = pb.data.view(getattr(torch, _FP8_DTYPES[b.fmt]))
    out = torch._scaled_mm(da, db.t(), blocked_scales(pa.scale), blocked_scales(pb.scale), out_dtype=out_dtype)
    return out if bias is None else out.add_(bias.to(out_dtype))


def mx_gemm_cuda(a, b, *, a_axis: int = 1, b_axis: int = 1, out_dtype: torch.dtype = torch.float32,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """The CUDA MX GEMM: the registry walked from the CUDA GEMMs on: block-scaled tensor cores where the
    device has them (sm_100+) and the operands are MXFP8 codes, else exact bf16 operands into cuBLAS."""
    call = GemmCall(a, b, a_axis, b_axis, out_dtype, bias)
    return registry.run_from("gemm", call, call.device, "cuda")


def _scaled_mm_supports(call: GemmCall) -> str | None:
    if not native_mx_gemm(call.device):
        return "no block-scaled MX tensor cores here (sm_100+ with torch._scaled_mm; MXTRAIN_MX_SCALED_MM=0 " \
               "turns them off)"
    return scaled_mm_unsupported(call.a, call.b, call.a_axis, call.b_axis)


def _scaled_mm(call: GemmCall) -> torch.Tensor:
    try:
        return scaled_mm_mx_gemm(call.a, call.b, **call.kwargs())
    except (RuntimeError, NotImplementedError) as e:  # no kernel for this case here: remember, walk on
        device = call.device
        _SCALED_MM_BROKEN[device.index if device.index is not None else torch.cuda.current_device()] = \
            f"{type(e).__name__}: {e}"
        raise registry.KernelUnavailable(f"torch._scaled_mm: {type(e).__name__}: {e}") from e


def _cublas_supports(call: GemmCall) -> str | None:
    if call.device.type != "cuda":
        return f"operands on {call.device}"
    return None


def _cublas(call: GemmCall) -> torch.Tensor:
    return cublas_mx_gemm(call.a, call.b, **call.kwargs())


registry.register("gemm", "cuda", _scaled_mm, supports=_scaled_mm_supports, name="scaled_mm")
registry.register("gemm", "cuda", _cublas, supports=_cublas_supports, name="cublas_bf16")
