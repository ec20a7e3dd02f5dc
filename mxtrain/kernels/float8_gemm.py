"""FP8 GEMMs on Hopper: per-tensor scales through ``torch._scaled_mm`` (cuBLASLt), 128-block scales in Triton.

``mx_gemm`` sends :class:`~mxtrain.quantization.float8.Float8Tensor` operands here (on CUDA): ``A`` is
``[M, K]`` and ``B`` ``[N, K]``, both row-major (the cast wrote the transposes; cuBLASLt's FP8 GEMM is
TN-only). The result is the product of the dequantized operands, up to the tensor cores' accumulation;
sizes the kernels refuse are zero-padded (:func:`pad_plane`), and cases without a kernel
(e5m2 x e5m2, mixed operands) run the fp32 fallback. Design: docs/kernels.md; accuracy: benchmarks/NOTES_float8.md.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from mxtrain import config
from mxtrain.kernels import registry
from mxtrain.kernels.calls import GemmCall
from mxtrain.kernels.dispatch import reference_gemm
from mxtrain.quantization.float8 import Float8Plane, Float8Tensor

__all__ = ["float8_gemm", "scaled_mm_gemm", "block_fp8_gemm", "cublas_block_gemm", "fallback_gemm", "pad_plane"]


# FP8 / high-precision mixes and shapes the tensor cores do not take: the fp32 GEMM of the dequantized operands
fallback_gemm = reference_gemm


def _fast_accum(a_axis: int, b_axis: int) -> bool:
    mode = config.current().fp8_fast_accum
    if mode == "all":
        return True
    if mode == "none":
        return False
    return a_axis % 2 == 1 and b_axis % 2 == 1  # fprop: X (rowwise) times W (rowwise)


def scaled_mm_gemm(a: Float8Tensor, b: Float8Tensor, *, a_axis: int, b_axis: int, out_dtype: torch.dtype,
                   bias: torch.Tensor | None = None, use_fast_accum: bool | None = None) -> torch.Tensor:
    """Per-tensor-scaled ``A @ Bᵀ`` through ``torch._scaled_mm`` (requires K, N % 16 == 0, not e5m2 x e5m2)."""
    fast = _fast_accum(a_axis, b_axis) if use_fast_accum is None else use_fast_accum
    return _scaled_mm_planes(a.plane(a_axis), b.plane(b_axis), fast=fast, out_dtype=out_dtype, bias=bias)


def _aligned_scale(s: torch.Tensor) -> torch.Tensor:
    """``s`` where cuBLASLt can read it: a scale that is an element of a larger tensor (FSDP2's gathers compute
    a unit's scales in one tensor) has an address cuBLASLt refuses (CUBLAS_STATUS_NOT_SUPPORTED).

    Traced (this GEMM inside a compiled graph) the address is not known: the scales there are the casts'
    own outputs, each its own allocation, and FSDP2's gathered planes carry the cast's scale (or, from
    ``_fp8_scales``, one on a 16-byte boundary); a misaligned one would make cuBLASLt raise, not miscompute."""
    if torch.compiler.is_compiling():
        return s
    return s if s.data_ptr() % 16 == 0 else s.clone()


def _scaled_mm_planes(pa, pb, *, fast: bool, out_dtype: torch.dtype, bias: torch.Tensor | None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """``torch._scaled_mm`` of two planes; written into ``out`` (``[M, N]``, ``out_dtype``) where one is given and
    the bias (if any) is added in the GEMM's epilogue, else a new tensor."""
    epilogue_bias = bias is not None and out_dtype in (torch.bfloat16, torch.float16) and bias.dtype == out_dtype
    direct = {"out": out} if out is not None and (bias is None or epilogue_bias) else {}
    out = torch._scaled_mm(pa.data, pb.data.t(), _aligned_scale(pa.scale_inv), _aligned_scale(pb.scale_inv),
                           bias=bias if epilogue_bias else None,
                           out_dtype=out_dtype if (bias is None or epilogue_bias) else torch.float32,
                           use_fast_accum=fast, **direct)
    if bias is not None and not epilogue_bias:
        out = out.add_(bias.float()).to(out_dtype)
    return out


@triton.jit
def _block_gemm_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, K, stride_am, stride_bn, stride_cm,
                       stride_sa, stride_sb, A_BR: tl.constexpr, B_BR: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BM)
    grid_n = tl.cdiv(N, BN)
    width = GROUP_M * grid_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_ptrs = a_ptr + rm[:, None].to(tl.int64) * stride_am + rk[None, :]
    b_ptrs = b_ptr + rn[None, :].to(tl.int64) * stride_bn + rk[:, None]
    sa_ptrs = sa_ptr + (rm // A_BR) * stride_sa
    sb_ptrs = sb_ptr + (rn // B_BR) * stride_sb
    mm, mn = rm < M, rn < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BK)):
        kmask = rk + kb * BK < K
        a = tl.load(a_ptrs, mask=mm[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=kmask[:, None] & mn[None, :], other=0.0)
        part = tl.dot(a, b)  # this K slice in the tensor cores, fp32 out
        sa = tl.load(sa_ptrs + kb, mask=mm, other=0.0)
        sb = tl.load(sb_ptrs + kb, mask=mn, other=0.0)
        acc += part * sa[:, None] * sb[None, :]  # promoted: scaled and summed in fp32
        a_ptrs += BK
        b_ptrs += BK
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=mn, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mm[:, None] & mn[None, :])


BLOCK_GEMM_CONFIG = dict(BM=128, BN=128, num_warps=8, num_stages=4)


def block_fp8_gemm(a: Float8Tensor, b: Float8Tensor, *, a_axis: int, b_axis: int, out_dtype: torch.dtype,
                   bias: torch.Tensor | None = None, BM: int | None = None, BN: int | None = None) -> torch.Tensor:
    """``A @ Bᵀ`` for 128-block-scaled operands: the Triton kernel promoting every 128 K (see module doc)."""
    return _block_fp8_planes(a.plane(a_axis), b.plane(b_axis), out_dtype=out_dtype, bias=bias, BM=BM, BN=BN)


def _block_fp8_planes(pa, pb, *, out_dtype: torch.dtype, bias: torch.Tensor | None, BM: int | None = None,
                      BN: int | None = None) -> torch.Tensor:
    if pa.block is None or pb.block is None or pa.block[1] != 128 or pb.block[1] != 128 or pa.block[0] != 1:
        raise ValueError(f"block_fp8_gemm takes A with 1x128 blocks and B with 1x128 or 128x128 blocks, "
                         f"got {pa.block} and {pb.block}")
    (M, K), (N, Kb) = pa.data.shape, pb.data.shape
    if K != Kb:
        raise ValueError(f"GEMM reduction sizes differ: {K} vs {Kb}")
    cfg = dict(BLOCK_GEMM_CONFIG)
    cfg["BM"], cfg["BN"] = BM or cfg["BM"], BN or cfg["BN"]
    out = torch.empty((M, N), dtype=out_dtype, device=pa.data.device)
    grid = (triton.cdiv(M, cfg["BM"]) * triton.cdiv(N, cfg["BN"]),)
    sa, sb = pa.scale_inv.contiguous(), pb.scale_inv.contiguous()
    _block_gemm_kernel[grid](
        pa.data, pb.data, out, sa, sb, bias if bias is not None else out, M, N, K,
        pa.data.stride(0), pb.data.stride(0), out.stride(0), sa.stride(0), sb.stride(0),
        A_BR=pa.block[0], B_BR=pb.block[0], HAS_BIAS=bias is not None, BK=128, GROUP_M=8, **cfg)
    return out


# Block-scaled GEMMs through cuBLASLt (CUDA >= 12.9 on sm_90: DeepSeek-style 1x128 / 128x128 scales,
# promoted inside cuBLAS) when torch exposes them (torch.nn.functional.scaled_mm), else the Triton
# kernel above. MXTRAIN_FP8_BLOCK_GEMM=triton|cublas|auto (default auto: cuBLAS where it runs).
# (a failure at run time raises KernelUnavailable: the registry then walks past cuBLAS on that device)


_BIAS_IN_EPILOGUE: dict[torch.dtype, bool] = {}  # output dtype -> whether scaled_mm took a blockwise bias


def _outer_major(scale_inv: torch.Tensor) -> torch.Tensor:
    """``[rows, K/128]`` scales stored K-block-major (stride ``(1, rows)``), the layout cuBLAS reads for 1x128."""
    return scale_inv.t().contiguous().t()


def cublas_block_gemm(a: Float8Tensor, b: Float8Tensor, *, a_axis: int, b_axis: int, out_dtype: torch.dtype,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """``A @ Bᵀ`` for 128-block-scaled operands through ``torch.nn.functional.scaled_mm`` (cuBLASLt).

    ``A``: 1x128 blocks; ``B``: 1x128 or 128x128 blocks; ``K`` a multiple of 128. Raises
    what torch raises where cuBLAS has no kernel (callers fall back to :func:`block_fp8_gemm`).
    """
    return _cublas_block_planes(a.plane(a_axis), b.plane(b_axis), out_dtype=out_dtype, bias=bias)


def _cublas_block_planes(pa, pb, *, out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    from torch.nn.functional import ScalingType, scaled_mm

    if pa.block != (1, 128) or pb.block not in ((1, 128), (128, 128)) or pa.data.shape[1] % 128:
        raise ValueError(f"cublas_block_gemm takes A with 1x128 blocks, B with 1x128 or 128x128 blocks and K % 128 == 0, "
                         f"got {pa.block}, {pb.block}, K = {pa.data.shape[1]}")
    if pb.block == (1, 128):
        sb, recipe_b = _outer_major(pb.scale_inv), ScalingType.BlockWise1x128
    else:  # [N/128, K/128] with K/128 padded to a multiple of 4, given as its transpose
        kb = pb.scale_inv.shape[1]
        sb = torch.nn.functional.pad(pb.scale_inv, (0, (-kb) % 4), value=1.0).t()
        recipe_b = ScalingType.BlockWise128x128
    args = (pa.data, pb.data.t(), _outer_major(pa.scale_inv), ScalingType.BlockWise1x128, sb, recipe_b)
    if bias is not None and _BIAS_IN_EPILOGUE.get(out_dtype, True):
        try:  # the bias in cuBLAS's epilogue: an add over the output afterwards costs a full read and write
            return scaled_mm(*args, bias=bias.to(out_dtype), output_dtype=out_dtype)
        except (RuntimeError, NotImplementedError, ValueError):
            _BIAS_IN_EPILOGUE[out_dtype] = False
    out = scaled_mm(*args, output_dtype=out_dtype)
    if bias is not None:
        out.add_(bias.to(out_dtype))
    return out


def pad_plane(p: Float8Plane, rows: int, cols: int) -> Float8Plane:
    """``p`` with its data zero-padded to ``rows`` x ``cols`` (zero codes add nothing to a product) and, for
    block scales, the blocks the padding adds given scale 1. The GEMM of padded planes, cut back to the
    unpadded output, is the GEMM of the planes."""
    r, c = p.data.shape
    if (r, c) == (rows, cols):
        return p
    if rows < r or cols < c:
        raise ValueError(f"pad_plane pads {r} x {c} data to at least its size, got {rows} x {cols}")
    data = torch.nn.functional.pad(p.data.view(torch.uint8), (0, cols - c, 0, rows - r)).view(p.data.dtype)
    s = p.scale_inv
    if p.block is not None:
        br, bc = p.block
        s = torch.nn.functional.pad(s, (0, -(-cols // bc) - s.shape[1], 0, -(-rows // br) - s.shape[0]), value=1.0)
    return dataclasses.replace(p, data=data, scale_inv=s)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _padded(gemm, pa, pb, m_mult: int, n_mult: int, k_mult: int, out_dtype, bias, **kw) -> torch.Tensor:
    """``gemm`` of the planes zero-padded to multiples of the sizes its kernels take (M, N and the reduction K),
    the output cut back to ``[M, N]`` (tokens per expert or per microbatch are rarely multiples of 16)."""
    (M, K), N = pa.data.shape, pb.data.shape[0]
    Mp, Np, Kp = _round_up(M, m_mult), _round_up(N, n_mult), _round_up(K, k_mult)
    if (Mp, Np, Kp) == (M, N, K):
        return gemm(pa, pb, out_dtype=out_dtype, bias=bias, **kw)
    kw.pop("out", None)  # a padded product is cut back: written where mx_gemm copies it
    if bias is not None and Np != N:
        bias = torch.nn.functional.pad(bias, (0, Np - N))
    out = gemm(pad_plane(pa, Mp, Kp), pad_plane(pb, Np, Kp), out_dtype=out_dtype, bias=bias, **kw)
    return out[:M, :N].contiguous() if (Mp, Np) != (M, N) else out


def float8_gemm(a, b, *, a_axis: int = 1, b_axis: int = 1, out_dtype: torch.dtype = torch.float32,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``A @ Bᵀ (+ bias)`` for FP8 operands on CUDA: the registry walked from the CUDA GEMMs on, i.e. the
    path their scaling calls for (see module doc)."""
    call = GemmCall(a, b, a_axis, b_axis, out_dtype, bias)
    return registry.run_from("float8_gemm", call, call.device, "cuda")


def _planes(call: GemmCall):
    """The two operands' planes for their reduction axes, or a sentence why they are not two FP8 operands."""
    a, b = call.a, call.b
    if not (isinstance(a, Float8Tensor) and isinstance(b, Float8Tensor)):
        return f"operands {type(a).__name__} x {type(b).__name__} (both must be Float8Tensors)"
    if a.device.type != "cuda":
        return f"operands on {a.device}"
    return a.plane(call.a_axis), b.plane(call.b_axis)


def _tensorwise_supports(call: GemmCall) -> str | None:
    planes = _planes(call)
    if isinstance(planes, str):
        return planes
    pa, pb = planes
    if pa.block is not None or pb.block is not None:
        return "block-scaled operands (this GEMM takes per-tensor scales)"
    if call.a.fmt == call.b.fmt == "fp8_e5m2":
        return "e5m2 x e5m2 (torch._scaled_mm has no such kernel)"
    if pa.data.shape[1] != pb.data.shape[1]:
        return f"reduction sizes differ: {pa.data.shape[1]} vs {pb.data.shape[1]}"
    return None


def _tensorwise(call: GemmCall) -> torch.Tensor:
    # torch._scaled_mm takes K, N % 16 == 0: other sizes are zero-padded
    pa, pb = call.a.plane(call.a_axis), call.b.plane(call.b_axis)
    return _padded(_scaled_mm_planes, pa, pb, 1, 16, 16, call.out_dtype, call.bias,
                   fast=_fast_accum(call.a_axis, call.b_axis), out=call.out)


def _block_supports(call: GemmCall) -> str | None:
    planes = _planes(call)
    if isinstance(planes, str):
        return planes
    pa, pb = planes
    if pa.block is None or pb.block is None or pa.block[0] != 1:
        return f"blocks {pa.block} x {pb.block} (A needs 1xN blocks, B blocks)"
    return None


def _block_gemm_mode() -> str:
    want = config.current().fp8_block_gemm
    if want not in ("auto", "triton", "cublas"):
        raise ValueError(f"MXTRAIN_FP8_BLOCK_GEMM must be auto, triton or cublas, got {want!r}")
    return want


def _cublas_block_supports(call: GemmCall) -> str | None:
    reason = _block_supports(call)
    if reason is not None:
        return reason
    want = _block_gemm_mode()
    if want == "triton":
        return "off (MXTRAIN_FP8_BLOCK_GEMM=triton)"
    if not hasattr(torch.nn.functional, "scaled_mm"):
        return "this torch has no torch.nn.functional.scaled_mm"
    dev = call.a.device.index if call.a.device.index is not None else torch.cuda.current_device()
    if torch.cuda.get_device_capability(dev) != (9, 0):
        return "cuBLAS block-scaled FP8 GEMMs run on sm_90"
    pa, pb = call.a.plane(call.a_axis), call.b.plane(call.b_axis)
    if pa.block != (1, 128):
        return f"A blocks {pa.block} (cuBLAS takes 1x128)"
    # ragged sizes too, on zero-padded copies: the masked Triton kernel ran MoE expert GEMMs of ragged token
    # counts 5x slower than cuBLAS on padded ones (bench_moe, H100, 2026-11-25: 203 ms against 41 ms)
    return None


def _cublas_block(call: GemmCall) -> torch.Tensor:
    pa, pb = call.a.plane(call.a_axis), call.b.plane(call.b_axis)
    try:
        return _padded(_cublas_block_planes, pa, pb, 16, 16, 128, call.out_dtype, call.bias)
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, NotImplementedError, ValueError) as e:  # no cuBLAS kernel here: remember, walk on
        if _block_gemm_mode() == "cublas":
            raise
        raise registry.KernelUnavailable(f"cuBLAS block scaling: {type(e).__name__}: {e}") from e


def _triton_block(call: GemmCall) -> torch.Tensor:
    pa, pb = call.a.plane(call.a_axis), call.b.plane(call.b_axis)
    return _block_fp8_planes(pa, pb, out_dtype=call.out_dtype, bias=call.bias)


def _fallback(call: GemmCall) -> torch.Tensor:
    """The reference of the FP8 GEMMs (``fallback_gemm``, looked up when called)."""
    return fallback_gemm(call.a, call.b, **call.kwargs())


if torch.cuda.is_available():
    # torch ops only (pads, torch._scaled_mm, a slice): compiled graphs trace it and call cuBLAS directly
    registry.register("float8_gemm", "cuda", _tensorwise, supports=_tensorwise_supports, name="cublas_tensorwise",
                      traceable=True)
    registry.register("float8_gemm", "cuda", _cublas_block, supports=_cublas_block_supports, name="cublas_blockwise")
    registry.register("float8_gemm", "triton", _triton_block, supports=_block_supports, name="triton_blockwise")
    registry.register("float8_gemm", "reference", _fallback)
