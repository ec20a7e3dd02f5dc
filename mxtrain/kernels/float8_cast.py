"""Triton FP8 casts: per-tensor (rowwise + transpose in one pass, amax on the side) and 128-block casts.

Bit-identical to the reference :func:`mxtrain.quantization.float8.quantize_float8`
(tests/float8/test_float8_kernels_interpret.py, tests/gpu/test_float8_gpu.py):

* Per-tensor: one read of the source writes the rowwise FP8 data and, when the
  GEMMs need it, its transpose (Hopper's FP8 GEMM is TN-only), and the
  scale-inverse. Delayed scaling casts with the given scale and gets the
  tensor's amax from the same pass (per-tile maxima, then one tiny reduction;
  a single atomic max from every tile serialized: 2.33 ms for the casts of one
  H200 LayerNormMLP step against 1.70 ms without amax); current scaling runs one
  reduction first (``torch.aminmax``) and the cast kernel turns it into the amax,
  the scale (IEEE division, as the reference) and the scale-inverse: two
  launches per cast.
* Blocks: one read of a 128-row tile writes the 1x128-block rowwise plane, the
  1x128-block columnwise plane (blocks along the tokens, stored transposed) or
  the 128x128-block plane and its transpose, each with its scale-inverses.
  Block scales are computed in the kernel with an IEEE division (``div_rn``).

The FP8 bytes are computed with integer operations on the fp32 bits (round to
nearest, ties to even, FP8 subnormals kept, -0.0 kept; NaN becomes the NaN code,
its sign is not preserved on the GPU) and stored through a uint8 view: the same bytes on the GPU and
under ``TRITON_INTERPRET=1`` (whose own float8 conversion rounds differently and
turns NaN into a finite value).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mxtrain.kernels.dispatch import register_float8_quantize
from mxtrain.quantization.float8 import (
    FP8_DTYPES, FP8_MAX, Float8Plane, Float8Tensor, all_reduce_amax, fp8_format_name,
    quantize_float8 as quantize_float8_reference, tensor_amax,
)

__all__ = ["triton_quantize_float8"]

_FP8_BITS = {"fp8_e4m3": (3, -6), "fp8_e5m2": (2, -14)}  # mantissa bits, smallest normal exponent
_FP32_MAX = 3.4028234663852886e38


@triton.jit
def _fp8_code(v, MBITS: tl.constexpr, EMIN: tl.constexpr):
    """The FP8 byte (as int32) of ``v`` (fp32, |v| <= max_fp8, or NaN), rounded to nearest, ties to even.

    Integer arithmetic on the fp32 bits, not a float8 conversion: the same bits on the GPU
    and in the interpreter, and the sign of zero and NaN kept as torch's casts keep it.
    """
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    exp = mag >> 23
    SH: tl.constexpr = 23 - MBITS
    # FP8 normal range: drop mantissa bits (a carry moves into the exponent, as it should)
    rounded = (mag + ((1 << (SH - 1)) - 1) + ((mag >> SH) & 1)) >> SH
    normal = rounded - ((127 + EMIN - 1) << MBITS)
    # FP8 subnormal range: count quanta of 2**(EMIN - MBITS) (2**MBITS quanta is the smallest normal)
    m = tl.where(exp > 0, (mag & 0x7FFFFF) | 0x800000, mag & 0x7FFFFF)
    shift = (EMIN - MBITS + 23 + 127) - tl.maximum(exp, 1)
    shift = tl.minimum(tl.maximum(shift, 1), 31)
    quanta = (m + ((1 << (shift - 1)) - 1) + ((m >> shift) & 1)) >> shift
    code = tl.where(exp < EMIN + 127, quanta, normal)
    code = tl.where(v != v, 0x7F, code)
    return code | sign


@triton.jit
def _saturate(v, FMAX: tl.constexpr):
    return tl.where(v != v, v, tl.minimum(tl.maximum(v, -FMAX), FMAX))


@triton.jit
def _tensor_cast_kernel(x_ptr, row_ptr, col_ptr, scale_ptr, amax_ptr, lo_ptr, hi_ptr, sinv_ptr, M, N, stride_xm,
                        FMAX: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, EPS: tl.constexpr,
                        POW2: tl.constexpr, MODE: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr):
    """One BM x BN tile of a per-tensor cast. MODE 0: ``scale`` given (delayed scaling), each program's
    amax written to ``amax[program]``; 1: scale from the fp32 ``amax`` given (all-reduced); 2: scale from torch.aminmax's
    ``lo``/``hi`` (and the amax written). The first program writes ``scale_inv`` (and the amax)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    lanes = tl.arange(0, BN)
    first = (lanes + pid_m + pid_n) == 0  # lane 0 of the first program
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    zero = tl.zeros([BN], tl.float32)  # scalars are broadcast to [BN] vectors: vector math only
    if MODE == 0:  # one partial amax per program (no atomics on one address: they serialize), reduced after
        a = tl.where(x == x, tl.abs(x), float("inf"))
        tile_max = zero + tl.max(tl.max(a, axis=1), axis=0)
        tl.store(amax_ptr + (pid_m * tl.num_programs(1) + pid_n) + lanes * 0, tile_max, mask=lanes == 0)
        s = zero + tl.load(scale_ptr)
    else:
        if MODE == 1:
            amax = zero + tl.load(amax_ptr)
        else:
            hi = zero + tl.load(hi_ptr).to(tl.float32)
            lo = zero + tl.load(lo_ptr).to(tl.float32)
            amax = tl.where((hi != hi) | (lo != lo), float("inf"), tl.abs(tl.maximum(hi, -lo)))
            tl.store(amax_ptr + lanes * 0, amax, mask=first)
        s = _block_scale(amax, FMAX, EPS, POW2)
    tl.store(sinv_ptr + lanes * 0, tl.math.div_rn(zero + 1.0, s), mask=first)
    q = _fp8_code(_saturate(x * s[None, :], FMAX), MBITS, EMIN).to(tl.uint8)
    if ROW:
        tl.store(row_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], q, mask=mask)
    if COL:
        mask_t = (rn[:, None] < N) & (rm[None, :] < M)
        tl.store(col_ptr + rn[:, None].to(tl.int64) * M + rm[None, :], tl.trans(q), mask=mask_t)


@triton.jit
def _block_scale(amax, FMAX: tl.constexpr, EPS: tl.constexpr, POW2: tl.constexpr):
    """The reference's compute_scale, elementwise: FMAX / max(amax, EPS); 1 for 0 / Inf amax; pow2 floor."""
    if EPS > 0:
        amax = tl.maximum(amax, EPS)
    s = tl.math.div_rn(tl.full(amax.shape, FMAX, tl.float32), amax)
    s = tl.where(s == float("inf"), 3.4028234663852886e38, s)
    s = tl.where((amax == 0.0) | (amax == float("inf")), 1.0, s)
    if POW2:
        s = (s.to(tl.int32, bitcast=True) & -8388608).to(tl.float32, bitcast=True)
    return s


@triton.jit
def _block_cast_kernel(x_ptr, row_ptr, rsi_ptr, col_ptr, csi_ptr, M, N, stride_xm, NB_N, NB_M,
                       FMAX: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, EPS: tl.constexpr,
                       POW2: tl.constexpr, SQUARE: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr,
                       B: tl.constexpr):
    """One B x B tile. SQUARE: one scale for the tile (row plane scales [M/B, N/B], col plane the
    transpose); else 1xB blocks: per-row scales for the row plane [M, N/B], per-column scales for
    the col plane [N, M/B] (stored transposed)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * B + tl.arange(0, B)
    rn = pid_n * B + tl.arange(0, B)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    a = tl.where(x == x, tl.abs(x), float("inf"))
    mask_t = (rn[:, None] < N) & (rm[None, :] < M)
    if SQUARE:
        # the tile's amax, broadcast to a [B] vector (every lane equal): vector math only, no 0-d tensors
        lanes = tl.arange(0, B)
        amax = tl.zeros([B], tl.float32) + tl.max(tl.max(a, axis=1), axis=0)
        s = _block_scale(amax, FMAX, EPS, POW2)
        q = _fp8_code(_saturate(x * s[:, None], FMAX), MBITS, EMIN).to(tl.uint8)
        si = tl.math.div_rn(tl.full([B], 1.0, tl.float32), s)
        if ROW:
            tl.store(row_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], q, mask=mask)
            tl.store(rsi_ptr + pid_m * NB_N + pid_n + lanes * 0, si, mask=lanes == 0)
        if COL:
            tl.store(col_ptr + rn[:, None].to(tl.int64) * M + rm[None, :], tl.trans(q), mask=mask_t)
            tl.store(csi_ptr + pid_n * NB_M + pid_m + lanes * 0, si, mask=lanes == 0)
    else:
        if ROW:
            s = _block_scale(tl.max(a, axis=1), FMAX, EPS, POW2)  # [B]: one per row
            q = _fp8_code(_saturate(x * s[:, None], FMAX), MBITS, EMIN).to(tl.uint8)
            tl.store(row_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], q, mask=mask)
            tl.store(rsi_ptr + rm * NB_N + pid_n, tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s),
                     mask=rm < M)
        if COL:
            s = _block_scale(tl.max(a, axis=0), FMAX, EPS, POW2)  # [B]: one per column
            q = _fp8_code(_saturate(x * s[None, :], FMAX), MBITS, EMIN).to(tl.uint8)
            tl.store(col_ptr + rn[:, None].to(tl.int64) * M + rm[None, :], tl.trans(q), mask=mask_t)
            tl.store(csi_ptr + rn * NB_M + pid_m, tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s),
                     mask=rn < N)


def _bytes(t: torch.Tensor | None, dummy: torch.Tensor) -> torch.Tensor:
    """The kernels write FP8 bytes (see _fp8_code) through a uint8 view; ``dummy`` stands in for an unused plane."""
    return dummy if t is None else t.view(torch.uint8)


def triton_quantize_float8(x: torch.Tensor, fmt="fp8_e4m3", *, axes=-1, scale: torch.Tensor | None = None,
                           block=None, power_of_2_scales: bool = False, amax_epsilon: float = 0.0,
                           amax_reduction_group=None) -> Float8Tensor:
    """:func:`~mxtrain.quantization.float8.quantize_float8` with Triton casts (same arguments, same bits).

    Falls back to the reference for what the kernels do not cover (empty or
    non-2-D-reshapeable tensors, blocks other than (1, 128) / (128, 128)).
    """
    fmt = fp8_format_name(fmt)
    ref = dict(axes=axes, scale=scale, block=block, power_of_2_scales=power_of_2_scales,
               amax_epsilon=amax_epsilon, amax_reduction_group=amax_reduction_group)
    if x.numel() == 0 or x.ndim == 0 or not x.is_floating_point() or x.dtype == torch.float64:
        return quantize_float8_reference(x, fmt, **ref)
    axes_t = (axes,) if isinstance(axes, int) else tuple(axes)
    last = x.ndim - 1
    norm = tuple(dict.fromkeys(a % x.ndim for a in axes_t)) if all(-x.ndim <= a < x.ndim for a in axes_t) else ()
    if not norm or any(a != last and not (x.ndim == 2 and a == 0) for a in norm):
        return quantize_float8_reference(x, fmt, **ref)  # it raises the error
    if block is not None and (x.ndim != 2 or tuple(block) not in ((1, 128), (128, 128))):
        return quantize_float8_reference(x, fmt, **ref)
    x2d = x.reshape(-1, x.shape[-1])
    if x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    M, N = x2d.shape
    mbits, emin = _FP8_BITS[fmt]
    fmax = FP8_MAX[fmt]
    dtype = FP8_DTYPES[fmt]
    want_row, want_col = last in norm, (x.ndim == 2 and 0 in norm)
    row = torch.empty((M, N), dtype=dtype, device=x.device) if want_row else None
    col = torch.empty((N, M), dtype=dtype, device=x.device) if want_col else None
    if block is None:
        f32 = {"dtype": torch.float32, "device": x.device}
        scale_inv = torch.empty((), **f32)
        lo = hi = x2d  # stand-ins for unused pointers
        BM, BN = 64, 64
        grid = (triton.cdiv(M, BM), triton.cdiv(N, BN))
        if scale is not None:  # delayed: the given scale; the amax comes from the same pass
            mode, amax = 0, torch.empty(grid[0] * grid[1], **f32)  # per-tile maxima, reduced below
            scale = scale.to(**f32).reshape(())
        elif amax_reduction_group is not None:  # current, all ranks' amax: reduce it first
            mode, amax, scale = 1, all_reduce_amax(tensor_amax(x2d), amax_reduction_group), x2d
        else:  # current: one reduction pass, then the kernel turns it into amax, scale and scale_inv
            mode, amax, scale = 2, torch.empty((), **f32), x2d
            lo, hi = torch.aminmax(x2d)
        _tensor_cast_kernel[grid](x2d, _bytes(row, x2d), _bytes(col, x2d), scale, amax, lo, hi, scale_inv, M, N,
                                  x2d.stride(0), FMAX=fmax, MBITS=mbits, EMIN=emin, EPS=float(amax_epsilon),
                                  POW2=bool(power_of_2_scales), MODE=mode, ROW=want_row, COL=want_col,
                                  BM=BM, BN=BN, num_warps=4)
        if mode == 0:
            amax = amax.amax()
        planes = []
        for a in norm:
            planes.append(Float8Plane(row.view(x.shape) if a == last else col, scale_inv, a))
        return Float8Tensor(tuple(planes), fmt, tuple(x.shape), x.dtype, amax)
    B = 128
    square = tuple(block) == (128, 128)
    nb_m, nb_n = triton.cdiv(M, B), triton.cdiv(N, B)
    f32 = {"dtype": torch.float32, "device": x.device}
    rsi = (torch.empty((nb_m, nb_n), **f32) if square else torch.empty((M, nb_n), **f32)) if want_row else None
    csi = (torch.empty((nb_n, nb_m), **f32) if square else torch.empty((N, nb_m), **f32)) if want_col else None
    _block_cast_kernel[(nb_m, nb_n)](
        x2d, _bytes(row, x2d), rsi if want_row else x2d, _bytes(col, x2d),
        csi if want_col else x2d, M, N, x2d.stride(0), nb_n, nb_m, FMAX=fmax, MBITS=mbits, EMIN=emin,
        EPS=float(amax_epsilon), POW2=bool(power_of_2_scales), SQUARE=square, ROW=want_row, COL=want_col, B=B,
        num_warps=8)
    planes = []
    for a in norm:
        planes.append(Float8Plane(row, rsi, 1, tuple(block)) if a == 1 else Float8Plane(col, csi, 0, tuple(block)))
    return Float8Tensor(tuple(planes), fmt, tuple(x.shape), x.dtype, None)


register_float8_quantize("triton", triton_quantize_float8)
