"""Triton FP8 casts: per-tensor (rowwise + transpose, amax pass) and 128-block casts, with fused sources.

Bit-identical to the reference :func:`mxtrain.quantization.float8.quantize_float8` (but for the sign of a
NaN on the GPU): :func:`tensor_cast_float8` writes the rowwise FP8 data, its transpose when the GEMMs need
it, and the scale-inverse from one read (delayed scaling also returns the amax; current scaling runs an amax
pass first); :func:`block_cast_float8` writes 128x128 or 1x128 blocks. The source may be ``act(x)`` or
``grad * act'(x)`` with its column sums. How: docs/kernels.md.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from mxtrain import config
from mxtrain.kernels._triton_utils import bf16_bits, interpret_mode
from mxtrain.kernels.cast import _act_bwd, _activation, _round_to_dtype, _store_out, _widen
from mxtrain.kernels import registry
from mxtrain.kernels.calls import BlockCastCall, Float8QuantizeCall
from mxtrain.kernels.ids import ACTIVATION_IDS, DTYPE_IDS, PLAIN_ACTIVATION_IDS, Prologue
from mxtrain.oplib import opaque_op
from mxtrain.quantization.float8 import (
    FP8_DTYPES, FP8_MAX, Float8Plane, Float8Tensor, all_reduce_amax, compute_scale, fp8_format_name,
)

__all__ = ["triton_quantize_float8", "tensor_cast_float8", "block_cast_float8", "FUSED_ACTIVATIONS",
           "FUSED_ACTIVATION_GRADS"]

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
def _scaled(v, s):
    """``v * s``, NaN where ``v`` is +-Inf: a non-finite source value stays non-finite (NaN) in FP8,
    where saturation would hide it (the reference's ``cast_to_fp8``)."""
    return tl.where(tl.abs(v) == float("inf"), float("nan"), v * s)


@triton.jit
def _saturate(v, FMAX: tl.constexpr):
    return tl.where(v != v, v, tl.minimum(tl.maximum(v, -FMAX), FMAX))


@triton.jit
def _fp8_bytes(v, FMAX: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, GPU: tl.constexpr):
    """FP8 bytes (uint8) of fp32 ``v``, saturated to +-FMAX, rounded to nearest even. On the GPU the
    hardware conversion (``cvt.rn.satfinite``: one instruction per two values; the integer emulation
    made the casts compute-bound); in the interpreter ``_fp8_code`` (its own float8 cast rounds
    differently). Same bytes but for the sign of a NaN."""
    if GPU:
        if MBITS == 3:
            return _saturate(v, FMAX).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            return _saturate(v, FMAX).to(tl.float8e5).to(tl.uint8, bitcast=True)
    else:
        return _fp8_code(_saturate(v, FMAX), MBITS, EMIN).to(tl.uint8)


@triton.jit
def _store_bits(ptr, bits, mask):
    """Store FP8 bytes (uint8, ``_fp8_bytes``) through ``ptr``: a uint8 pointer (the interpreter) or an FP8
    one (the GPU: the planes are passed as they are, no dtype view, so a compiled graph launches the kernel
    on its own buffers)."""
    tl.store(ptr, bits.to(ptr.dtype.element_ty, bitcast=True), mask=mask)


@triton.jit
def _load_f32(ptr, offs, mask, BF16_BITS: tl.constexpr):
    """fp32 of a tile (bf16 arrives as int16 bits: see ``mxtrain.kernels.cast._widen``)."""
    return _widen(tl.load(ptr + offs, mask=mask, other=0), BF16_BITS)


@triton.jit
def _source_tile(x_ptr, g_ptr, rm, rn, mask, stride_xm, stride_gm, PRE: tl.constexpr, ACT: tl.constexpr,
                 X_BF16: tl.constexpr, G_BF16: tl.constexpr, OUT_KIND: tl.constexpr, GPU: tl.constexpr):
    """The fp32 tile that is cast. PRE 0: ``x``; 1: ``act(x)``; 2: ``g * act'(x)``; the last two rounded
    to the source dtype (OUT_KIND: its id in ``ids.DTYPE_IDS``) as the unfused torch ops round their outputs.
    Out-of-range lanes are 0."""
    x = _load_f32(x_ptr, rm[:, None].to(tl.int64) * stride_xm + rn[None, :], mask, X_BF16)
    if PRE == 0:
        return x
    if PRE == 1:
        v = _activation(x, ACT, GPU)
    else:
        g = _load_f32(g_ptr, rm[:, None].to(tl.int64) * stride_gm + rn[None, :], mask, G_BF16)
        v = _act_bwd(x, g, ACT, GPU)
    v = _round_to_dtype(v, OUT_KIND)
    return tl.where(mask, v, 0.0)


@triton.jit
def _program_source_tile(x_ptr, g_ptr, out_ptr, M, N, stride_xm, stride_gm, PRE: tl.constexpr, ACT: tl.constexpr,
                         X_BF16: tl.constexpr, G_BF16: tl.constexpr, OUT_KIND: tl.constexpr, GPU: tl.constexpr,
                         STORE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """This program's BM x BN tile of a 2-D grid: ``(rm, rn, mask, v)`` with ``v`` the cast source
    (``_source_tile``); STORE also writes ``v`` to ``out`` ([M, N] contiguous, its dtype)."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    v = _source_tile(x_ptr, g_ptr, rm, rn, mask, stride_xm, stride_gm, PRE, ACT, X_BF16, G_BF16, OUT_KIND, GPU)
    if STORE:
        _store_out(out_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], v, mask, OUT_KIND)
    return rm, rn, mask, v


@triton.jit
def _tensor_amax_kernel(x_ptr, g_ptr, part_ptr, out_ptr, M, N, stride_xm, stride_gm,
                        PRE: tl.constexpr, ACT: tl.constexpr, X_BF16: tl.constexpr, G_BF16: tl.constexpr,
                        OUT_KIND: tl.constexpr, GPU: tl.constexpr, STORE: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr):
    """max |v| of the cast source (NaN counts as +Inf) over the BM x BN tiles this program takes (every
    ``num_programs``-th, row-major) into ``part[program]``: at most ``AMAX_PROGRAMS`` partial maxima, which the
    cast kernel reduces as it loads them (one atomic max per tile on one address serializes; a reduction
    between the passes is one more launch). STORE also writes the source ([M, N], contiguous, its dtype; bf16 as
    int16 bits): the cast pass then reads it instead of computing the prologue a second time (erf / exp make
    these passes compute-bound)."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BN)
    tiles = tl.cdiv(M, BM) * tiles_n
    acc = tl.zeros([BM, BN], tl.float32)
    for t in range(pid, tiles, tl.num_programs(0)):
        rm = (t // tiles_n) * BM + tl.arange(0, BM)
        rn = (t % tiles_n) * BN + tl.arange(0, BN)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        v = _source_tile(x_ptr, g_ptr, rm, rn, mask, stride_xm, stride_gm, PRE, ACT, X_BF16, G_BF16, OUT_KIND,
                         GPU)
        if STORE:
            _store_out(out_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], v, mask, OUT_KIND)
        acc = tl.maximum(acc, tl.where(v == v, tl.abs(v), float("inf")))
    lanes = tl.arange(0, BN)
    tile_max = tl.zeros([BN], tl.float32) + tl.max(tl.max(acc, axis=1), axis=0)
    tl.store(part_ptr + pid + lanes * 0, tile_max, mask=lanes == 0)


@triton.jit
def _tensor_cast_kernel(x_ptr, g_ptr, row_ptr, col_ptr, scale_ptr, amax_ptr, sinv_ptr, dbias_ptr, part_ptr, n_parts,
                        M, N, stride_xm, stride_gm,
                        FMAX: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, EPS: tl.constexpr,
                        POW2: tl.constexpr, MODE: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr,
                        PRE: tl.constexpr, ACT: tl.constexpr, X_BF16: tl.constexpr, G_BF16: tl.constexpr,
                        OUT_KIND: tl.constexpr, GPU: tl.constexpr, DBIAS: tl.constexpr, PARTS: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr):
    """One BM x BN tile of a per-tensor cast of the source tile (see ``_source_tile``).

    MODE 0: ``scale`` given (delayed scaling), each program's amax written to ``amax[program]``;
    1: the scale computed from the fp32 ``amax`` given (current scaling, all-reduced when sharded);
    2: current scaling from the amax pass's ``n_parts`` partial maxima (``part``, at most PARTS: one block size
    whatever the tensor's, so sizes share a compiled kernel), which every
    program reduces as it loads them (max is exact in any order); the first program writes the amax to ``amax``.
    The first program writes ``scale_inv``. ROW writes the FP8 bytes [M, N], COL their transpose
    [N, M]; DBIAS writes the tile's fp32 column sums to ``dbias[pid_m, :]`` (summed after)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    lanes = tl.arange(0, BN)
    first = (lanes + pid_m + pid_n) == 0  # lane 0 of the first program
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    v = _source_tile(x_ptr, g_ptr, rm, rn, mask, stride_xm, stride_gm, PRE, ACT, X_BF16, G_BF16, OUT_KIND,
                     GPU)
    zero = tl.zeros([BN], tl.float32)  # scalars are broadcast to [BN] vectors: vector math only
    if MODE == 0:  # one partial amax per program (no atomics on one address: they serialize), reduced after
        a = tl.where(v == v, tl.abs(v), float("inf"))
        tile_max = zero + tl.max(tl.max(a, axis=1), axis=0)
        tl.store(amax_ptr + (pid_m * tl.num_programs(1) + pid_n) + lanes * 0, tile_max, mask=lanes == 0)
        s = zero + tl.load(scale_ptr)
    elif MODE == 1:
        s = _block_scale(zero + tl.load(amax_ptr), FMAX, EPS, POW2)
    else:
        p = tl.arange(0, PARTS)
        amax = zero + tl.max(tl.load(part_ptr + p, mask=p < n_parts, other=0.0), axis=0)
        tl.store(amax_ptr + lanes * 0, amax, mask=first)
        s = _block_scale(amax, FMAX, EPS, POW2)
    tl.store(sinv_ptr + lanes * 0, tl.math.div_rn(zero + 1.0, s), mask=first)
    q = _fp8_bytes(_scaled(v, s[None, :]), FMAX, MBITS, EMIN, GPU)
    if ROW:
        _store_bits(row_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], q, mask)
    if COL:
        mask_t = (rn[:, None] < N) & (rm[None, :] < M)
        _store_bits(col_ptr + rn[:, None].to(tl.int64) * M + rm[None, :], tl.trans(q), mask_t)
    if DBIAS:
        tl.store(dbias_ptr + pid_m.to(tl.int64) * N + rn, tl.sum(v, axis=0), mask=rn < N)


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
def _block_cast_kernel(x_ptr, g_ptr, row_ptr, rsi_ptr, col_ptr, csi_ptr, dbias_ptr, out_ptr, M, N, stride_xm, stride_gm,
                       NB_N, NB_M, FMAX: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, EPS: tl.constexpr,
                       POW2: tl.constexpr, SQUARE: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr,
                       PRE: tl.constexpr, ACT: tl.constexpr, X_BF16: tl.constexpr, G_BF16: tl.constexpr,
                       OUT_KIND: tl.constexpr, GPU: tl.constexpr, DBIAS: tl.constexpr, STORE: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr):
    """One BM x BN tile of the cast source (see ``_source_tile``); blocks are 128 long. SQUARE
    (BM = BN = 128): one scale for the tile (row plane scales [M/128, N/128], col plane the
    transpose); else 1x128 blocks: per-row scales for the row plane [M, N/128] (BN = 128),
    per-column scales for the col plane [N, M/128] (stored transposed; BM = 128). DBIAS: the
    tile's fp32 column sums into ``dbias[pid_m, :]``. STORE: the source tile is also written to
    ``out`` ([M, N] contiguous, its dtype; bf16 as int16 bits) for a second pass to read."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm, rn, mask, x = _program_source_tile(x_ptr, g_ptr, out_ptr, M, N, stride_xm, stride_gm, PRE, ACT, X_BF16,
                                           G_BF16, OUT_KIND, GPU, STORE, BM, BN)
    if DBIAS:
        tl.store(dbias_ptr + pid_m.to(tl.int64) * N + rn, tl.sum(x, axis=0), mask=rn < N)
    a = tl.where(x == x, tl.abs(x), float("inf"))
    mask_t = (rn[:, None] < N) & (rm[None, :] < M)
    if SQUARE:
        # the tile's amax, broadcast to a [B] vector (every lane equal): vector math only, no 0-d tensors
        lanes = tl.arange(0, BM)
        amax = tl.zeros([BM], tl.float32) + tl.max(tl.max(a, axis=1), axis=0)
        s = _block_scale(amax, FMAX, EPS, POW2)
        q = _fp8_bytes(_scaled(x, s[:, None]), FMAX, MBITS, EMIN, GPU)
        si = tl.math.div_rn(tl.full([BM], 1.0, tl.float32), s)
        if ROW:
            _store_bits(row_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], q, mask)
            tl.store(rsi_ptr + pid_m * NB_N + pid_n + lanes * 0, si, mask=lanes == 0)
        if COL:
            _store_bits(col_ptr + rn[:, None].to(tl.int64) * M + rm[None, :], tl.trans(q), mask_t)
            tl.store(csi_ptr + pid_n * NB_M + pid_m + lanes * 0, si, mask=lanes == 0)
    else:
        if ROW:
            s = _block_scale(tl.max(a, axis=1), FMAX, EPS, POW2)  # [B]: one per row
            q = _fp8_bytes(_scaled(x, s[:, None]), FMAX, MBITS, EMIN, GPU)
            _store_bits(row_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], q, mask)
            tl.store(rsi_ptr + rm * NB_N + pid_n, tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s),
                     mask=rm < M)
        if COL:
            s = _block_scale(tl.max(a, axis=0), FMAX, EPS, POW2)  # [B]: one per column
            q = _fp8_bytes(_scaled(x, s[None, :]), FMAX, MBITS, EMIN, GPU)
            _store_bits(col_ptr + rn[:, None].to(tl.int64) * M + rm[None, :], tl.trans(q), mask_t)
            tl.store(csi_ptr + rn * NB_M + pid_m, tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s),
                     mask=rn < N)


def _plane_arg(t: torch.Tensor | None, dummy: torch.Tensor, gpu: bool) -> torch.Tensor:
    """An FP8 plane as the per-tensor and block kernels take it (``_store_bits``): as it is on the GPU, a uint8
    view in the interpreter (no FP8 there); ``dummy`` stands in for an unused plane."""
    return dummy if t is None else (t if gpu else t.view(torch.uint8))


def _bytes(t: torch.Tensor | None, dummy: torch.Tensor) -> torch.Tensor:
    """A plane as a uint8 view on every device (the grouped cast's kernels store the bytes as they are)."""
    return _plane_arg(t, dummy, gpu=False)


def _source_arg(t: torch.Tensor, gpu: bool) -> torch.Tensor:
    """A source tensor as the kernels load it: bf16 as its int16 bits in the interpreter (no bf16 there), else
    as it is (a view of another dtype would make a compiled graph copy it before the launch)."""
    return t if gpu else bf16_bits(t)


def _bits_flag(t: torch.Tensor, gpu: bool) -> bool:
    """The kernels' ``*_BF16`` flag of a source passed by ``_source_arg`` (int16 bits to widen)."""
    return t.dtype == torch.bfloat16 and not gpu


# Tile shapes (BM, BN, num_warps) of the per-tensor cast by (rowwise, columnwise) planes written,
# and of the amax pass; speed: benchmarks/NOTES_float8.md
TENSOR_CAST_TILES = {(True, False): (32, 128, 4), (False, True): (64, 64, 4), (True, True): (32, 128, 4)}
# both planes of a tensor of at least TALL_ROWS rows: 64-row tiles (H100, amax pass included: [8192, 8192] 0.231
# against 0.264 ms, [28672, 4096] 8% faster; [2048, 8192] 10% slower, hence the rows bound)
TALL_ROWS, TALL_CAST_TILE = 4096, (64, 128, 4)
AMAX_TILE = (32, 128, 4)
# programs of the amax pass at most (each takes every AMAX_PROGRAMS-th tile): the cast kernel loads all their
# partial maxima in each program and reduces them itself, with no reduction launched in between
AMAX_PROGRAMS = 512
BLOCK_CAST_WARPS = 8  # warps of a 128x128-tile block cast
# 1x128 blocks, both planes: one 128x128-tile pass (False) or a pass per plane with narrow tiles (True);
# (rows, warps) of the rowwise pass's [rows, 128] tiles, (cols, warps) of the columnwise pass's [128, cols]
BLOCK_CAST_SPLIT = True
BLOCK_ROW_TILE = (32, 4)
BLOCK_COL_TILE = (64, 4)
# CUDA tensors take the CUDA C++ block cast (mxtrain/csrc/fp8_block_cast.cu, built on first use) where it
# applies (_cuda_block_supports): one 128x128-tile pass writes both planes and the bias sums
# (MXTRAIN_FP8_BLOCK_CAST=triton: off); the registry walks on to the Triton cast elsewhere


# activations the prologue computes (forward) and differentiates (backward), with their ids
FUSED_ACTIVATIONS = PLAIN_ACTIVATION_IDS
FUSED_ACTIVATION_GRADS = {name: ACTIVATION_IDS[name] for name in ("gelu", "relu", "silu")}


def _prologue(who: str, x, rowwise, columnwise, act, grad):
    """Validate a fused cast's source arguments; returns ``(x, g, x bits, g bits, kernel constexprs)``."""
    if x.ndim != 2 or x.dtype not in DTYPE_IDS:
        raise ValueError(f"{who} takes a 2-D fp32/bf16/fp16 tensor, got {x.dtype} {list(x.shape)}")
    if not (rowwise or columnwise):
        raise ValueError(f"{who}: ask for the rowwise and/or the columnwise plane")
    if grad is not None and act is None:
        raise ValueError(f"{who}: grad= needs act= (the source is grad * act'(x))")
    if act is not None:
        table = FUSED_ACTIVATIONS if grad is None else FUSED_ACTIVATION_GRADS
        if act not in table:
            raise ValueError(f"{who}: activation {act!r} is not fused "
                             f"{'backward' if grad is not None else 'forward'}; fused: {', '.join(table)}")
    if grad is not None and (grad.shape != x.shape or grad.dtype != x.dtype or grad.device != x.device):
        raise ValueError(f"{who}: grad must match x (shape, dtype, device), got {grad.dtype} "
                         f"{list(grad.shape)} for {x.dtype} {list(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if grad is not None and grad.stride(1) != 1:
        grad = grad.contiguous()
    pre = Prologue.of(act, grad)
    g = grad if grad is not None else x
    gpu = not interpret_mode()
    src = dict(PRE=int(pre), ACT=0 if act is None else (FUSED_ACTIVATIONS if pre == Prologue.ACTIVATION
                                                        else FUSED_ACTIVATION_GRADS)[act],
               X_BF16=_bits_flag(x, gpu), G_BF16=_bits_flag(g, gpu), OUT_KIND=DTYPE_IDS[x.dtype], GPU=gpu)
    return x, g, _source_arg(x, gpu), _source_arg(g, gpu), src


def block_cast_float8(x: torch.Tensor, fmt="fp8_e4m3", block=(1, 128), *, rowwise: bool = True,
                      columnwise: bool = False, act: str | None = None, grad: torch.Tensor | None = None,
                      power_of_2_scales: bool = False, amax_epsilon: float = 0.0,
                      dbias: bool = False) -> tuple[Float8Tensor, torch.Tensor | None]:
    """128-block FP8 cast of a 2-D source (``x``, ``act(x)`` or ``grad * act'(x)``, as
    :func:`tensor_cast_float8`), with the optional fp32 column sums of the source (``dbias``).
    128x128 blocks: one read of each 128x128 tile writes both planes. 1x128 blocks: a pass per
    plane with narrow tiles (``BLOCK_CAST_SPLIT``; with a prologue and both planes the rowwise
    pass computes it once and writes the source for the columnwise pass), or one 128x128-tile pass. ``block``: ``(1, 128)`` (each plane
    blocked along its own reduction axis) or ``(128, 128)``. Returns ``(Float8Tensor, dbias or None)``.
    Under ``torch.compile`` it is one registered op (``mxtrain::block_cast_float8``), the same bits."""
    fmt = fp8_format_name(fmt)
    if tuple(block) not in ((1, 128), (128, 128)):
        raise ValueError(f"block_cast_float8: block must be (1, 128) or (128, 128), got {block!r}")
    if torch.compiler.is_compiling():
        _prologue("block_cast_float8", x, rowwise, columnwise, act, grad)  # its checks
        parts = torch.ops.mxtrain.block_cast_float8(x, fmt, list(block), bool(rowwise), bool(columnwise), act, grad,
                                                    bool(power_of_2_scales), float(amax_epsilon), bool(dbias))
        row, rsi = (parts[0], parts[1]) if rowwise else (None, None)
        col, csi = (parts[2 * rowwise], parts[2 * rowwise + 1]) if columnwise else (None, None)
        planes = ([Float8Plane(row, rsi, 1, tuple(block))] if rowwise else []) + \
            ([Float8Plane(col, csi, 0, tuple(block))] if columnwise else [])
        return Float8Tensor(tuple(planes), fmt, tuple(x.shape), x.dtype, None), (parts[-1] if dbias else None)
    x, g, _, _, _ = _prologue("block_cast_float8", x, rowwise, columnwise, act, grad)
    call = BlockCastCall(x, g if grad is not None else None, fmt, block, rowwise, columnwise, act, power_of_2_scales,
                         amax_epsilon, dbias)
    return registry.run_from("float8_block_cast", call, x.device, "cuda")


def _block_outputs(call: BlockCastCall):
    """``(row, rsi, col, csi)``: the planes and block scale-inverses a block cast writes (None: not asked)."""
    x, (M, N) = call.x, call.x.shape
    f32 = {"dtype": torch.float32, "device": x.device}
    dtype = FP8_DTYPES[call.fmt]
    nb_m, nb_n = triton.cdiv(M, 128), triton.cdiv(N, 128)
    square = call.block == (128, 128)
    row = torch.empty((M, N), dtype=dtype, device=x.device) if call.rowwise else None
    col = torch.empty((N, M), dtype=dtype, device=x.device) if call.columnwise else None
    rsi = (torch.empty((nb_m, nb_n), **f32) if square else torch.empty((M, nb_n), **f32)) if call.rowwise else None
    csi = (torch.empty((nb_n, nb_m), **f32) if square else torch.empty((N, nb_m), **f32)) if call.columnwise else None
    return row, rsi, col, csi


def _cuda_block_supports(call: BlockCastCall) -> str | None:
    from mxtrain.kernels import cuda_cast

    settings = config.current()
    if settings.fp8_block_cast == "triton":
        return "off (MXTRAIN_FP8_BLOCK_CAST=triton)"
    if not settings.cuda_kernels:
        return "off (MXTRAIN_CUDA_KERNELS=0)"
    reason = cuda_cast.fp8_block_unsupported(call.x, call.grad, call.columnwise)
    if reason is not None:
        return reason
    acts = cuda_cast.FP8_BLOCK_ACTIVATIONS[0 if call.grad is None else 1]
    if call.act is not None and call.act not in acts:
        return f"activation {call.act!r} {'backward ' if call.grad is not None else ''}(the CUDA block cast " \
               f"fuses {', '.join(acts)})"
    if cuda_cast.library() is None:
        return f"the CUDA extension is unavailable ({cuda_cast.extension_error()})"
    return None


def _cuda_block_cast(call: BlockCastCall) -> tuple[Float8Tensor, torch.Tensor | None]:
    """The registered CUDA C++ implementation of ``float8_block_cast`` (mxtrain/csrc/fp8_block_cast.cu)."""
    from mxtrain.kernels import cuda_cast

    row, rsi, col, csi = _block_outputs(call)
    M, N = call.x.shape
    db = torch.empty((triton.cdiv(M, 128), N), dtype=torch.float32, device=call.x.device) if call.dbias else None
    if not cuda_cast.fp8_block_cast(call.x, call.grad, call.fmt, call.block == (128, 128), call.act, row, rsi, col,
                                    csi, db, call.power_of_2_scales, call.amax_epsilon):
        raise registry.KernelUnavailable("the CUDA block cast refused a call its supports() accepted")
    return _block_result(row, rsi, col, csi, call.block, call.fmt, call.x, db)


def _triton_block_cast(call: BlockCastCall) -> tuple[Float8Tensor, torch.Tensor | None]:
    """The registered Triton implementation of ``float8_block_cast``."""
    x, g, xb, gb, src = _prologue("block_cast_float8", call.x, call.rowwise, call.columnwise, call.act, call.grad)
    gpu = src["GPU"]
    fmt, block, rowwise, columnwise, dbias = call.fmt, call.block, call.rowwise, call.columnwise, call.dbias
    M, N = x.shape
    f32 = {"dtype": torch.float32, "device": x.device}
    mbits, emin = _FP8_BITS[fmt]
    B = 128
    square = tuple(block) == (128, 128)
    nb_m, nb_n = triton.cdiv(M, B), triton.cdiv(N, B)
    row, rsi, col, csi = _block_outputs(call)
    dummy = rsi if rsi is not None else csi
    consts = dict(FMAX=FP8_MAX[fmt], MBITS=mbits, EMIN=emin, EPS=float(call.amax_epsilon),
                  POW2=bool(call.power_of_2_scales), SQUARE=square)

    def launch(src_x, src_g, csts, row_, col_, db_, bm, bn, warps, out=None):
        grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))  # dbias partial sums: one row per grid row
        _block_cast_kernel[grid](
            src_x, src_g, _plane_arg(row_, dummy, gpu), rsi if row_ is not None else dummy,
            _plane_arg(col_, dummy, gpu),
            csi if col_ is not None else dummy, db_ if db_ is not None else dummy,
            dummy if out is None else _source_arg(out, gpu), M, N, src_x.stride(0), src_g.stride(0), nb_n, nb_m,
            ROW=row_ is not None, COL=col_ is not None, DBIAS=db_ is not None, STORE=out is not None,
            BM=bm, BN=bn, num_warps=warps, **consts, **csts)

    db = None
    if square or (rowwise and columnwise and not BLOCK_CAST_SPLIT):  # one 128x128 tile writes both planes
        db = torch.empty((nb_m, N), **f32) if dbias else None
        launch(xb, gb, src, row, col, db, B, B, BLOCK_CAST_WARPS)
    else:
        # a pass per plane with narrow tiles (speed: benchmarks/NOTES_float8.md); with both planes, the
        # rowwise pass computes a prologue once and writes the source, which the columnwise pass reads
        both = src["PRE"] and rowwise and columnwise
        keep = torch.empty((M, N), dtype=x.dtype, device=x.device) if both else None
        if rowwise:
            bm, wr = BLOCK_ROW_TILE
            db = torch.empty((triton.cdiv(M, bm), N), **f32) if dbias else None
            launch(xb, gb, src, row, None, db, bm, B, wr, out=keep)
        if keep is not None:
            xb = gb = _source_arg(keep, gpu)
            src = dict(src, PRE=0, ACT=0, X_BF16=_bits_flag(keep, gpu), G_BF16=_bits_flag(keep, gpu))
        if columnwise:
            bn, wc = BLOCK_COL_TILE
            db_c = torch.empty((nb_m, N), **f32) if dbias and db is None else None
            launch(xb, gb, src, None, col, db_c, B, bn, wc)
            db = db if db is not None else db_c
    return _block_result(row, rsi, col, csi, block, fmt, x, db)


def _block_result(row, rsi, col, csi, block, fmt, x, db) -> tuple[Float8Tensor, torch.Tensor | None]:
    planes = []
    if row is not None:
        planes.append(Float8Plane(row, rsi, 1, tuple(block)))
    if col is not None:
        planes.append(Float8Plane(col, csi, 0, tuple(block)))
    return Float8Tensor(tuple(planes), fmt, tuple(x.shape), x.dtype, None), (None if db is None else db.sum(0))


def tensor_cast_float8(x: torch.Tensor, fmt="fp8_e4m3", *, rowwise: bool = True, columnwise: bool = False,
                       act: str | None = None, grad: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                       amax: torch.Tensor | None = None, power_of_2_scales: bool = False, amax_epsilon: float = 0.0,
                       amax_reduction_group=None, dbias: bool = False) -> tuple[Float8Tensor, torch.Tensor | None]:
    """Per-tensor FP8 cast of a 2-D ``source``, with an optional elementwise prologue and bias gradient.

    ``source`` is ``x`` itself; with ``act``, ``act(x)`` rounded to ``x``'s dtype; with ``act``
    and ``grad``, ``grad * act'(x)`` rounded to that dtype: what torch's unfused activation
    (or its backward) would write, computed here without writing it. Rowwise (``[M, N]``)
    and columnwise (the transpose, ``[N, M]``) FP8 planes come from one read.

    Scaling: ``scale`` given = delayed scaling (the amax of the source comes back from the
    same pass); else current scaling from ``amax`` if given (it must be the source's, e.g.
    kept from a forward cast of the same values), or from an amax pass over the source
    (all-reduced over ``amax_reduction_group``). ``dbias=True`` also returns the fp32 column
    sums of the source (a bias gradient), from the same pass.

    Returns ``(Float8Tensor, dbias or None)``. With no prologue the bytes equal
    :func:`~mxtrain.quantization.float8.quantize_float8`'s; with one they equal the reference
    cast of the kernel's own source (see :mod:`mxtrain.kernels.activation_cast` on how that
    source can differ from torch's by an ulp of the dtype). Under ``torch.compile`` it is one
    registered op (``mxtrain::tensor_cast_float8``), the same bits.
    """
    fmt = fp8_format_name(fmt)
    if torch.compiler.is_compiling():
        if amax_reduction_group is not None:  # a process group cannot enter a registered op
            raise NotImplementedError("tensor_cast_float8: an amax_reduction_group (current scaling with the amax "
                                      "all-reduced over a group) cannot be compiled yet; run it eagerly")
        _prologue("tensor_cast_float8", x, rowwise, columnwise, act, grad)  # its checks
        args = (x, fmt, bool(rowwise), bool(columnwise), act, grad, scale, amax, bool(power_of_2_scales),
                float(amax_epsilon), bool(dbias))
        n = bool(rowwise) + bool(columnwise)
        if x.device.type == "cuda" and not interpret_mode():
            # the kernels as graph nodes (torch.library.triton_op): inductor launches them itself, with no
            # Python per call on the host (an FSDP2 step outside a CUDA graph waited on it)
            parts = torch.ops.mxtrain.tensor_cast_float8_triton(*args)
            if amax is not None:  # not returned: the amax given (an output may not alias an input)
                parts = [*parts[:n + 1], amax.to(torch.float32).reshape(()), *parts[n + 1:]]
            if dbias:  # the per-tile column sums, added outside the graph's own reductions (eager's bits)
                from mxtrain.kernels.dispatch import bias_grad

                parts = [*parts[:-1], bias_grad(parts[-1])]
        else:  # the interpreter (CPU): an opaque op (a traced interpreted kernel would read fake tensors)
            parts = torch.ops.mxtrain.tensor_cast_float8(*args)
        scale_inv, amax_out = parts[n], parts[n + 1]
        planes = ([Float8Plane(parts[0], scale_inv, 1)] if rowwise else []) + \
            ([Float8Plane(parts[n - 1], scale_inv, 0)] if columnwise else [])
        return (Float8Tensor(tuple(planes), fmt, tuple(x.shape), x.dtype, amax_out),
                parts[n + 2] if dbias else None)
    return _tensor_cast_impl(x, fmt, rowwise, columnwise, act, grad, scale, amax, power_of_2_scales, amax_epsilon,
                             amax_reduction_group, dbias)


def _tensor_cast_impl(x, fmt, rowwise, columnwise, act, grad, scale, amax, power_of_2_scales, amax_epsilon,
                      amax_reduction_group, dbias, traced=False) -> tuple[Float8Tensor, torch.Tensor | None]:
    """The per-tensor cast's kernels. ``traced``: launched through ``wrap_triton`` (the body of the
    ``mxtrain::tensor_cast_float8_triton`` op, traced into a compiled graph), and ``dbias`` comes back as
    the per-tile column sums (summed by the caller)."""
    x, g, xb, gb, src = _prologue("tensor_cast_float8", x, rowwise, columnwise, act, grad)
    gpu = src["GPU"]
    launch = wrap_triton if traced and gpu else _direct  # (interpreted kernels are never traced: launched as they are)
    M, N = x.shape
    dev = x.device
    f32 = {"dtype": torch.float32, "device": dev}
    if M == 0 or N == 0:  # nothing to launch: the reference's result (amax 0; scale from it, or the one given)
        return _empty_tensor_cast(x, fmt, rowwise, columnwise, scale, amax, power_of_2_scales, amax_epsilon,
                                  amax_reduction_group, dbias, traced)
    mbits, emin = _FP8_BITS[fmt]
    pre = src["PRE"]
    part, n_parts = None, 0
    if scale is None and amax is None:  # current scaling: the amax pass first
        BM, BN, warps = AMAX_TILE
        programs = min(triton.cdiv(M, BM) * triton.cdiv(N, BN), AMAX_PROGRAMS)
        part = torch.empty(programs, **f32)
        out = torch.empty((M, N), dtype=x.dtype, device=dev) if pre else None  # the source, for the cast pass
        launch(_tensor_amax_kernel)[(programs,)](xb, gb, part, part if out is None else _source_arg(out, gpu), M, N,
                                                 x.stride(0), g.stride(0), STORE=out is not None, BM=BM, BN=BN,
                                                 num_warps=warps, **src)
        if amax_reduction_group is not None:  # all-reduced first: the cast takes the amax
            amax, part = all_reduce_amax(part.amax(), amax_reduction_group), None
        else:  # the cast kernel reduces the partial maxima itself
            n_parts = programs
        if out is not None:  # the cast pass reads the written source: no prologue
            x, xb, g, gb = out, _source_arg(out, gpu), out, _source_arg(out, gpu)
            src = dict(src, PRE=0, ACT=0, X_BF16=_bits_flag(out, gpu), G_BF16=_bits_flag(out, gpu))
    BM, BN, warps = (TALL_CAST_TILE if rowwise and columnwise and M >= TALL_ROWS
                     else TENSOR_CAST_TILES[(bool(rowwise), bool(columnwise))])
    grid = (triton.cdiv(M, BM), triton.cdiv(N, BN))
    if scale is not None:  # delayed: the given scale; the amax comes from the same pass
        mode, amax = 0, torch.empty(grid[0] * grid[1], **f32)  # per-tile maxima, reduced below
        scale = scale.to(**f32).reshape(())
    elif part is not None:  # current: the amax written by the cast kernel from the partial maxima
        mode, amax = 2, torch.empty(1, **f32)  # (1 element, viewed as 0-d after the launch: see below)
        scale = part  # (no scale in MODE 2: the partial maxima fill both pointer arguments)
    else:
        mode, amax, scale = 1, amax.to(**f32).reshape(()), amax
    dtype = FP8_DTYPES[fmt]
    row = torch.empty((M, N), dtype=dtype, device=dev) if rowwise else None
    col = torch.empty((N, M), dtype=dtype, device=dev) if columnwise else None
    # written by the kernel: 1-element tensors, viewed as 0-d after the launch (inductor fills an empty 0-d tensor of
    # a traced graph with a kernel of its own, a launch each; an empty 1-D one it only allocates)
    scale_inv = torch.empty(1, **f32)
    db = torch.empty((grid[0], N), **f32) if dbias else None
    dummy = row if row is not None else col
    launch(_tensor_cast_kernel)[grid](xb, gb, _plane_arg(row, dummy, gpu), _plane_arg(col, dummy, gpu), scale,
                                      amax, scale_inv, db if dbias else scale_inv, scale,
                                      n_parts, M, N, x.stride(0), g.stride(0),
                                      FMAX=FP8_MAX[fmt], MBITS=mbits, EMIN=emin, EPS=float(amax_epsilon),
                                      POW2=bool(power_of_2_scales), MODE=mode, ROW=bool(rowwise),
                                      COL=bool(columnwise), DBIAS=bool(dbias),
                                      PARTS=triton.next_power_of_2(AMAX_PROGRAMS) if mode == 2 else 1, BM=BM, BN=BN,
                                      num_warps=warps,
                                      **src)
    amax = amax.amax() if mode == 0 else amax.view(())
    scale_inv = scale_inv.view(())
    planes = []
    if rowwise:
        planes.append(Float8Plane(row, scale_inv, 1))
    if columnwise:
        planes.append(Float8Plane(col, scale_inv, 0))
    bias = None if not dbias else db if traced else db.sum(0)
    return Float8Tensor(tuple(planes), fmt, (M, N), x.dtype, amax), bias


def _direct(kernel):
    return kernel


def _empty_tensor_cast(x, fmt, rowwise, columnwise, scale, amax, power_of_2_scales, amax_epsilon,
                       amax_reduction_group, dbias, traced) -> tuple[Float8Tensor, torch.Tensor | None]:
    """``tensor_cast_float8`` of a source with no element, as the reference casts one: empty planes, amax 0
    (all-reduced as any amax), scale_inv of the given scale or of that amax."""
    M, N = x.shape
    f32 = {"dtype": torch.float32, "device": x.device}
    if scale is not None:
        amax_out = torch.zeros((), **f32)
        scale_inv = torch.ones((), **f32) / scale.to(**f32).reshape(())
    else:
        amax_out = (all_reduce_amax(torch.zeros((), **f32), amax_reduction_group) if amax is None
                    else amax.to(**f32).reshape(()))
        scale_inv = torch.ones((), **f32) / compute_scale(amax_out, FP8_MAX[fmt], power_of_2=bool(power_of_2_scales),
                                                         epsilon=float(amax_epsilon))
    dtype = FP8_DTYPES[fmt]
    planes = ([Float8Plane(torch.empty((M, N), dtype=dtype, device=x.device), scale_inv, 1)] if rowwise else []) + \
        ([Float8Plane(torch.empty((N, M), dtype=dtype, device=x.device), scale_inv, 0)] if columnwise else [])
    bias = None if not dbias else torch.zeros((0, N) if traced else (N,), **f32)
    return Float8Tensor(tuple(planes), fmt, (M, N), x.dtype, amax_out), bias



# Under torch.compile the fused FP8 casts are registered ops of plain tensors (no graph break); inside, the
# implementation is chosen at run time as in eager, so compiled and eager results are the same bits.


@opaque_op("mxtrain::tensor_cast_float8")
def _tensor_cast_float8_op(x: torch.Tensor, fmt: str, rowwise: bool, columnwise: bool, act: str | None,
                           grad: torch.Tensor | None, scale: torch.Tensor | None, amax: torch.Tensor | None,
                           power_of_2_scales: bool, amax_epsilon: float, dbias: bool) -> list[torch.Tensor]:
    """``[rowwise data?, columnwise data?, scale_inv, amax, dbias?]`` of :func:`tensor_cast_float8`."""
    from mxtrain.kernels.dispatch import _distinct

    q, db = _tensor_cast_impl(x, fmt, rowwise, columnwise, act, grad, scale, amax, power_of_2_scales, amax_epsilon,
                              None, dbias)
    out = [q.plane(a).data for a in (1, 0) if (rowwise, columnwise)[1 - a]]
    out += [q.planes[0].scale_inv, q.amax] + ([db] if dbias else [])
    return _distinct(out, x, grad, scale, amax)


@_tensor_cast_float8_op.register_fake
def _(x, fmt, rowwise, columnwise, act, grad, scale, amax, power_of_2_scales, amax_epsilon, dbias):
    M, N = x.shape
    fp8 = FP8_DTYPES[fmt]
    out = [x.new_empty((M, N), dtype=fp8)] if rowwise else []
    out += [x.new_empty((N, M), dtype=fp8)] if columnwise else []
    out += [x.new_empty((), dtype=torch.float32), x.new_empty((), dtype=torch.float32)]
    return out + ([x.new_empty(N, dtype=torch.float32)] if dbias else [])


@triton_op("mxtrain::tensor_cast_float8_triton", mutates_args=())
def _tensor_cast_float8_triton(x: torch.Tensor, fmt: str, rowwise: bool, columnwise: bool, act: str | None,
                               grad: torch.Tensor | None, scale: torch.Tensor | None, amax: torch.Tensor | None,
                               power_of_2_scales: bool, amax_epsilon: float, dbias: bool) -> list[torch.Tensor]:
    """``[rowwise data?, columnwise data?, scale_inv, amax (only when not given), per-tile dbias?]`` of
    :func:`tensor_cast_float8` on CUDA, its kernels traced into the graph (``wrap_triton``): a compiled
    step launches them from inductor's code, the same kernels and bits as eager."""
    q, db = _tensor_cast_impl(x, fmt, rowwise, columnwise, act, grad, scale, amax, power_of_2_scales, amax_epsilon,
                              None, dbias, traced=True)
    out = [q.plane(a).data for a in (1, 0) if (rowwise, columnwise)[1 - a]] + [q.planes[0].scale_inv]
    return out + ([q.amax] if amax is None else []) + ([db] if dbias else [])


@opaque_op("mxtrain::block_cast_float8")
def _block_cast_float8_op(x: torch.Tensor, fmt: str, block: list[int], rowwise: bool, columnwise: bool,
                          act: str | None, grad: torch.Tensor | None, power_of_2_scales: bool, amax_epsilon: float,
                          dbias: bool) -> list[torch.Tensor]:
    """``[rowwise data, its scale_inv]?, [columnwise data, its scale_inv]?, dbias?`` of :func:`block_cast_float8`."""
    from mxtrain.kernels.dispatch import _distinct

    q, db = block_cast_float8(x, fmt, tuple(block), rowwise=rowwise, columnwise=columnwise, act=act, grad=grad,
                              power_of_2_scales=power_of_2_scales, amax_epsilon=amax_epsilon, dbias=dbias)
    out = []
    for a in (1, 0):
        if (rowwise, columnwise)[1 - a]:
            p = q.plane(a)
            out += [p.data.contiguous(), p.scale_inv.contiguous()]
    return _distinct(out + ([db] if dbias else []), x, grad)


@_block_cast_float8_op.register_fake
def _(x, fmt, block, rowwise, columnwise, act, grad, power_of_2_scales, amax_epsilon, dbias):
    M, N = x.shape
    fp8 = FP8_DTYPES[fmt]
    nb_m, nb_n = -(-M // 128), -(-N // 128)
    square = tuple(block) == (128, 128)
    out = []
    if rowwise:
        out += [x.new_empty((M, N), dtype=fp8), x.new_empty((nb_m if square else M, nb_n), dtype=torch.float32)]
    if columnwise:
        out += [x.new_empty((N, M), dtype=fp8), x.new_empty((nb_n if square else N, nb_m), dtype=torch.float32)]
    return out + ([x.new_empty(N, dtype=torch.float32)] if dbias else [])


def triton_quantize_float8(x: torch.Tensor, fmt="fp8_e4m3", *, axes=-1, scale: torch.Tensor | None = None,
                           block=None, power_of_2_scales: bool = False, amax_epsilon: float = 0.0,
                           amax_reduction_group=None) -> Float8Tensor:
    """:func:`~mxtrain.quantization.float8.quantize_float8` with Triton casts (same arguments, same bits).

    The registry walks from here on: what the kernels do not cover (:func:`_supports`: empty or
    non-2-D-reshapeable tensors, blocks other than (1, 128) / (128, 128)) runs the reference.
    """
    call = Float8QuantizeCall(x, fmt, axes, scale, block, power_of_2_scales, amax_epsilon, amax_reduction_group)
    return registry.run_from("float8_quantize", call, x.device, "triton")


def _supports(call: Float8QuantizeCall) -> str | None:
    x, axes, block = call.x, call.axes, call.block
    fp8_format_name(call.fmt)  # a bad format raises here, as the reference would
    if x.numel() == 0 or x.ndim == 0 or not x.is_floating_point() or x.dtype == torch.float64:
        return f"{x.dtype} tensor of shape {list(x.shape)} (the kernels cast non-empty fp32 / bf16 / fp16 tensors)"
    axes_t = (axes,) if isinstance(axes, int) else tuple(axes)
    last = x.ndim - 1
    norm = tuple(dict.fromkeys(a % x.ndim for a in axes_t)) if all(-x.ndim <= a < x.ndim for a in axes_t) else ()
    if not norm or any(a != last and not (x.ndim == 2 and a == 0) for a in norm):
        return f"axes {axes} of a {x.ndim}-D tensor (the kernels write the last axis' plane and a 2-D transpose)"
    if block is not None and (x.ndim != 2 or tuple(block) not in ((1, 128), (128, 128))):
        return f"block {block} of a {x.ndim}-D tensor (the kernels cast 2-D tensors in 1x128 / 128x128 blocks)"
    return None


def _planes_of(call: Float8QuantizeCall) -> tuple[torch.Tensor, tuple[int, ...], bool, bool]:
    """``(x as 2-D with contiguous rows, normalized axes, rowwise?, columnwise?)`` of a supported call."""
    x = call.x
    axes_t = (call.axes,) if isinstance(call.axes, int) else tuple(call.axes)
    norm = tuple(dict.fromkeys(a % x.ndim for a in axes_t))
    x2d = x.reshape(-1, x.shape[-1])
    if x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    return x2d, norm, x.ndim - 1 in norm, (x.ndim == 2 and 0 in norm)


def _block_call_of(call: Float8QuantizeCall) -> BlockCastCall:
    x2d, _, want_row, want_col = _planes_of(call)
    return BlockCastCall(x2d, None, fp8_format_name(call.fmt), call.block, want_row, want_col, None,
                         call.power_of_2_scales, call.amax_epsilon, False)


def _cuda_supports(call: Float8QuantizeCall) -> str | None:
    reason = _supports(call)
    if reason is None and call.block is None:
        return "per-tensor scaling (the CUDA C++ FP8 cast is the 128-block one)"
    return reason or _cuda_block_supports(_block_call_of(call))


def _cuda_quantize_float8(call: Float8QuantizeCall) -> Float8Tensor:
    """The registered CUDA C++ implementation of ``float8_quantize`` (128-block scaling)."""
    _, norm, _, _ = _planes_of(call)
    q, _ = _cuda_block_cast(_block_call_of(call))
    return Float8Tensor(tuple(q.plane(a % 2) for a in norm), fp8_format_name(call.fmt), tuple(call.x.shape),
                        call.x.dtype, None)


def _triton_quantize_float8(call: Float8QuantizeCall) -> Float8Tensor:
    """The registered Triton implementation of ``float8_quantize``."""
    if call.block is None:
        return _triton_tensor_quantize_float8(call)
    x2d, norm, want_row, want_col = _planes_of(call)
    q, _ = _triton_block_cast(BlockCastCall(x2d, None, fp8_format_name(call.fmt), call.block, want_row, want_col,
                                            None, call.power_of_2_scales, call.amax_epsilon, False))
    return Float8Tensor(tuple(q.plane(a % 2) for a in norm), fp8_format_name(call.fmt), tuple(call.x.shape),
                        call.x.dtype, None)


def _tensor_supports(call: Float8QuantizeCall) -> str | None:
    return _supports(call) or ("128-block scaling (this kernel casts with one scale per tensor)"
                               if call.block is not None else None)


def _triton_tensor_quantize_float8(call: Float8QuantizeCall) -> Float8Tensor:
    """The registered Triton implementation of per-tensor ``float8_quantize``: :func:`tensor_cast_float8` of
    the tensor's 2-D view, so under ``torch.compile`` it traces into the graph as that cast's op (registered
    ``traceable``)."""
    x = call.x
    fmt = fp8_format_name(call.fmt)
    x2d, norm, want_row, want_col = _planes_of(call)
    last = x.ndim - 1
    q, _ = tensor_cast_float8(x2d, fmt, rowwise=want_row, columnwise=want_col, scale=call.scale,
                              power_of_2_scales=call.power_of_2_scales, amax_epsilon=call.amax_epsilon,
                              amax_reduction_group=call.amax_reduction_group)
    planes = [Float8Plane(q.rowwise.data.view(x.shape), q.scale_inv, last) if a == last else q.columnwise
              for a in norm]
    return Float8Tensor(tuple(planes), fmt, tuple(x.shape), x.dtype, q.amax)


def _make_block_call(*, x, fmt="fp8_e4m3", block=(1, 128), rowwise=True, columnwise=False, act=None, grad=None,
                     power_of_2_scales=False, amax_epsilon=0.0, dbias=False) -> BlockCastCall:
    x, g, _, _, _ = _prologue("block_cast_float8", x, rowwise, columnwise, act, grad)
    return BlockCastCall(x, g if grad is not None else None, fp8_format_name(fmt), block, rowwise, columnwise, act,
                         power_of_2_scales, amax_epsilon, dbias)


registry.define(registry.Operation("float8_block_cast", _make_block_call, BlockCastCall.key, backend_policy="ignore"))
registry.register("float8_block_cast", "triton", _triton_block_cast)
registry.register("float8_quantize", "triton", _triton_tensor_quantize_float8, supports=_tensor_supports,
                  name="tensor", traceable=True)
registry.register("float8_quantize", "triton", _triton_quantize_float8, supports=_supports)
if torch.cuda.is_available():
    registry.register("float8_block_cast", "cuda", _cuda_block_cast, supports=_cuda_block_supports)
    registry.register("float8_quantize", "cuda", _cuda_quantize_float8, supports=_cuda_supports)
