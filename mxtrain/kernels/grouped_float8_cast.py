"""Per-tensor FP8 casts of all experts at once: one scale per expert segment of a stacked tensor.

A Mixture-of-Experts layer casts each expert's rows of the stacked input (and grad-output, and weights) with
a scale of its own. Cast one expert at a time, that is an amax pass and a cast launch per expert and tensor
(48 launches a Mixtral layer step). Here, for ``x [T, K]`` whose rows are the experts' segments (ends in a
device tensor: no host sync; empty segments allowed) or ``E`` segments of equal length (stacked weights):

* current scaling: one amax pass writes each tile's per-expert maxima, reduced by one ``amax(0)``; the cast
  pass computes each row's scale from its expert's amax (``compute_scale``: epsilon, power of two). Where the
  kernel that wrote ``x`` recorded its row maxima (``row_amax [T, P]``, ``mxtrain.modules.amax_hints``), the
  amax pass reads those instead of ``x``;
* delayed scaling: the given per-expert scales; the amaxes come back from the cast pass.

The cast writes the rowwise codes ``[T, K]``, the per-expert ``scale_inv [E]`` and ``amax [E]``, and on
request the columnwise plane: each expert's segment transposed, ``[K, m_e]`` contiguous one after the other
(``col_layout="expert"``: what the per-expert ``scaled_mm`` reads) or the whole ``[K, T]`` transpose
(``"stacked"``: what a grouped GEMM over the token axis reads). Every expert's codes, scale_inv and amax are
bit for bit :func:`mxtrain.quantization.float8.quantize_float8` of its segment (the reference
implementation registered here is that loop).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from mxtrain.kernels import registry
from mxtrain.kernels._triton_utils import bf16_bits, device_supported, interpret_mode
from mxtrain.kernels.calls import GroupedFloat8CastCall
from mxtrain.kernels.float8_cast import (
    _FP8_BITS, _block_scale, _bytes, _fp8_bytes, _load_f32, _scaled,
)
from mxtrain.quantization.float8 import (
    FP8_DTYPES, FP8_MAX, Float8Plane, Float8Tensor, all_reduce_amax, fp8_format_name,
    quantize_float8 as reference_quantize_float8,
)

__all__ = ["GroupedFloat8Tensor", "grouped_cast_float8", "MAX_EXPERTS", "COL_LAYOUTS"]

MAX_EXPERTS = 1024  # experts the kernels take (a tile compares its rows against every expert's end)
COL_LAYOUTS = ("expert", "stacked")
_SINV_STRIDE = 4  # scale_inv[e] at 16-byte steps: each expert's 0-d scale is where cuBLASLt reads it uncopied
# (BM, BN, warps) of the amax pass and of the cast pass (both planes or one). Timed on an H100 (tile sweep at the
# Mixtral expert layer's shapes, a [16544, 14336] bf16 tensor in 32-row-aligned segments): amax + cast 0.73 ms with
# 32 x 256 tiles against 0.85 ms with the 16 x 256 ones (16 x 128: 0.82); the stacked weights [8 x 4096, 14336]
# 1.35 ms with 32 x 256 or 64 x 128 tiles. Other amax tiles were within 4% (either way)
AMAX_TILE = (32, 128, 4)
CAST_TILE = (32, 128, 4)
# segments of multiples of 16 / 32 / 64 rows: tiles of that many rows, each in one expert (the SEG16 branch)
SEGMENT_TILES = {64: (64, 128, 4), 32: (32, 256, 4), 16: (16, 128, 4)}
# (BM, warps) of the pass over recorded row maxima [T, P] (BN: P's power of two, <= 128); 32 rows where there are
# over 64 experts (each tile holds a [BM, experts] comparison)
ROW_AMAX_TILE = (128, 4)


@triton.jit
def _row_experts(ends_ptr, rm, T, E, SEG, UNIFORM: tl.constexpr, BLOCK_E: tl.constexpr):
    """``(expert, start, count)`` of each row ``rm`` ([BM]; rows past ``T`` get expert ``E - 1``)."""
    if UNIFORM:
        ex = tl.minimum(rm // SEG, E - 1)
        start = ex * SEG
        count = start * 0 + SEG
    else:
        eidx = tl.arange(0, BLOCK_E)
        ends = tl.load(ends_ptr + eidx, mask=eidx < E, other=2147483647).to(tl.int32)
        ex = tl.sum((ends[None, :] <= rm[:, None]).to(tl.int32), axis=1)  # experts ending at or before the row
        ex = tl.minimum(ex, E - 1)
        start = tl.load(ends_ptr + ex - 1, mask=ex > 0, other=0).to(tl.int32)
        count = tl.load(ends_ptr + ex).to(tl.int32) - start
    return ex, start, count


@triton.jit
def _tile_expert(ends_ptr, row0, E, SEG, UNIFORM: tl.constexpr, BLOCK_E: tl.constexpr):
    """``(expert, start, count)`` of row ``row0`` as scalars (a tile that lies in one expert)."""
    ex, start, count = _row_experts(ends_ptr, row0 + tl.zeros([2], tl.int32), 0, E, SEG, UNIFORM, BLOCK_E)
    return tl.max(ex, axis=0), tl.max(start, axis=0), tl.max(count, axis=0)


@triton.jit
def _expert_maxima(a, ex, BLOCK_E: tl.constexpr):
    """``[BLOCK_E]``: the max of ``a`` ([BM, BN], >= 0) over each expert's rows (0 for an expert without rows here)."""
    eidx = tl.arange(0, BLOCK_E)
    rowmax = tl.max(a, axis=1)
    return tl.max(tl.where(ex[:, None] == eidx[None, :], rowmax[:, None], 0.0), axis=0)


@triton.jit
def _load_tile(x_ptr, T, K, stride_xm, X_BF16: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """This program's ``(pid_m, pid_n, rows, cols, mask, values as fp32)`` of ``x``."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    mask = (rm[:, None] < T) & (rn[None, :] < K)
    v = _load_f32(x_ptr, rm[:, None].to(tl.int64) * stride_xm + rn[None, :], mask, X_BF16)
    return pid_m, pid_n, rm, rn, mask, v


@triton.jit
def _store_tile_maxima(part_ptr, v, ex, E, pid_m, pid_n, BLOCK_E: tl.constexpr):
    """This tile's max |v| per expert (NaN counts as +Inf) into ``part[program, :E]``."""
    a = tl.where(v == v, tl.abs(v), float("inf"))
    eidx = tl.arange(0, BLOCK_E)
    prog = (pid_m * tl.num_programs(1) + pid_n).to(tl.int64)
    tl.store(part_ptr + prog * E + eidx, _expert_maxima(a, ex, BLOCK_E), mask=eidx < E)


@triton.jit
def _grouped_amax_kernel(x_ptr, ends_ptr, part_ptr, T, K, E, stride_xm, SEG, UNIFORM: tl.constexpr,
                         X_BF16: tl.constexpr, BLOCK_E: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """This tile's max |x| per expert (NaN counts as +Inf) into ``part[program, :E]``, reduced after."""
    pid_m, pid_n, rm, rn, mask, v = _load_tile(x_ptr, T, K, stride_xm, X_BF16, BM, BN)
    ex, _, _ = _row_experts(ends_ptr, rm, T, E, SEG, UNIFORM, BLOCK_E)
    _store_tile_maxima(part_ptr, v, ex, E, pid_m, pid_n, BLOCK_E)


@triton.jit
def _grouped_cast_kernel(x_ptr, ends_ptr, row_ptr, col_ptr, scale_ptr, amax_ptr, sinv_ptr, part_ptr, T, K, E,
                         stride_xm, SEG, stride_scale, FMAX: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr,
                         EPS: tl.constexpr, POW2: tl.constexpr, MODE: tl.constexpr, ROW: tl.constexpr,
                         COL: tl.constexpr, COL_STACKED: tl.constexpr, UNIFORM: tl.constexpr, X_BF16: tl.constexpr,
                         GPU: tl.constexpr, SINV_STRIDE: tl.constexpr, BLOCK_E: tl.constexpr, SEG16: tl.constexpr,
                         SMALL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """One BM x BN tile, each row cast with its expert's scale.

    MODE 0: ``scale[e * stride_scale]`` given (delayed scaling), the tile's per-expert maxima written to
    ``part[program, :E]``; 1: the scale computed from ``amax[e]`` (current scaling). The first program writes
    every expert's ``scale_inv``. ROW: the codes ``[T, K]``; COL: each expert's transpose, ``[K, m_e]`` at
    element ``K * start_e`` (or, COL_STACKED, the ``[K, T]`` transpose of the whole tensor).

    SEG16 (every segment's rows a multiple of BM, 16 or more): each tile lies in one expert, whose start
    and count are then scalars known to be multiples of 16, so the transposed rows are stored 16 bytes at a time
    (with per-row counts the compiler stores them byte by byte: 4x slower on an H100). The tile's expert comes
    from its row by scalar arithmetic where the segments are uniform; where they end at ``ends``, from a reduction
    over the ends. SMALL (``(T + BM) * (K + BN) < 2**31``, masked lanes included): the transposed offsets inside an
    expert in 32 bits (64-bit ones made the pass 20% slower on an H100 with ``ends``, [8 x 28672, 4096] bf16 both
    planes)."""
    pid_m, pid_n, rm, rn, mask, v = _load_tile(x_ptr, T, K, stride_xm, X_BF16, BM, BN)
    if SEG16:
        if UNIFORM:  # scalars the compiler sees through (the reduction's made the pass 20% slower on an H100)
            ex0 = (pid_m * BM) // SEG
            start0 = tl.multiple_of(ex0 * SEG, 16)
            count0 = SEG
        else:
            ex0, start0, count0 = _tile_expert(ends_ptr, pid_m * BM, E, SEG, UNIFORM, BLOCK_E)
            start0 = tl.multiple_of(start0, 16)
            count0 = tl.multiple_of(count0, 16)
        ex = ex0 + tl.zeros([BM], tl.int32)
    else:
        ex, start, count = _row_experts(ends_ptr, rm, T, E, SEG, UNIFORM, BLOCK_E)
    eidx = tl.arange(0, BLOCK_E)
    first = (eidx < E) & ((eidx * 0 + pid_m + pid_n) == 0)  # vector math only
    # SEG16: the tile's one scale, broadcast along its columns (as the per-tensor kernel's), not one per row
    lanes = tl.zeros([BN], tl.float32)
    if MODE == 0:
        _store_tile_maxima(part_ptr, v, ex, E, pid_m, pid_n, BLOCK_E)
        if SEG16:
            s = lanes + tl.load(scale_ptr + ex0 * stride_scale)
        else:
            s = tl.load(scale_ptr + ex * stride_scale, mask=rm < T, other=1.0)
        s_all = tl.load(scale_ptr + eidx * stride_scale, mask=eidx < E, other=1.0)
    else:
        if SEG16:
            s = _block_scale(lanes + tl.load(amax_ptr + ex0), FMAX, EPS, POW2)
        else:
            s = _block_scale(tl.load(amax_ptr + ex, mask=rm < T, other=0.0), FMAX, EPS, POW2)
        s_all = _block_scale(tl.load(amax_ptr + eidx, mask=eidx < E, other=0.0), FMAX, EPS, POW2)
    tl.store(sinv_ptr + eidx * SINV_STRIDE, tl.math.div_rn(tl.full([BLOCK_E], 1.0, tl.float32), s_all), mask=first)
    if SEG16:
        q = _fp8_bytes(_scaled(v, s[None, :]), FMAX, MBITS, EMIN, GPU)
    else:
        q = _fp8_bytes(_scaled(v, s[:, None]), FMAX, MBITS, EMIN, GPU)
    if ROW:
        tl.store(row_ptr + rm[:, None].to(tl.int64) * K + rn[None, :], q, mask=mask)
    if COL:
        mask_t = (rn[:, None] < K) & (rm[None, :] < T)
        if COL_STACKED:
            offs = rn[:, None].to(tl.int64) * T + rm[None, :]
        elif SEG16 and SMALL:
            offs = start0.to(tl.int64) * K + (rn[:, None] * count0 + (rm - start0)[None, :])
        elif SEG16:
            offs = (start0.to(tl.int64) * K + rn[:, None].to(tl.int64) * count0 + (rm - start0)[None, :])
        else:
            start64 = start.to(tl.int64)
            offs = (start64[None, :] * K + rn[:, None].to(tl.int64) * count[None, :]
                    + (rm - start)[None, :])
        tl.store(col_ptr + offs, tl.trans(q), mask=mask_t)


@dataclasses.dataclass(frozen=True)
class GroupedFloat8Tensor:
    """The per-tensor FP8 casts of ``E`` expert segments of one stacked ``[T, K]`` tensor.

    ``row``: the codes ``[T, K]`` (or None); ``col``: the columnwise plane, ``[K * T]`` holding each expert's
    ``[K, m_e]`` transpose after the previous one (``col_layout="expert"``) or the ``[K, T]`` transpose
    (``"stacked"``), or None; ``scale_inv``, ``amax``: ``[E]`` fp32. :meth:`expert` is one expert's
    :class:`Float8Tensor`, as :func:`quantize_float8` of its rows makes it.
    """

    row: torch.Tensor | None
    col: torch.Tensor | None
    col_layout: str
    scale_inv: torch.Tensor
    amax: torch.Tensor
    fmt: str
    shape: tuple[int, int]
    dtype: torch.dtype

    def expert(self, e: int, start: int, n: int, axes=(1,)) -> Float8Tensor:
        """Expert ``e``'s rows ``[start, start + n)`` (host ints) as a Float8Tensor with the planes of ``axes``
        (1: rowwise, 0: columnwise, as ``quantize_float8``'s ``axes``): views of this cast's buffers (a copy
        of the columns of a ``"stacked"`` columnwise plane)."""
        planes = tuple(self._plane(a, start, n, self.scale_inv[e]) for a in axes)
        return Float8Tensor(planes, self.fmt, (n, self.shape[1]), self.dtype, self.amax[e])

    def _plane(self, axis: int, start: int, n: int, scale_inv, piece=None) -> Float8Plane:
        """The plane of ``axis`` of rows ``[start, start + n)``; ``piece``: those rows' part of the plane's buffer
        where the caller already cut it (None: cut here)."""
        K = self.shape[1]
        if axis % 2 == 1:
            return Float8Plane(self.row[start:start + n] if piece is None else piece, scale_inv, 1)
        if self.col_layout == "expert":
            piece = self.col[K * start:K * (start + n)] if piece is None else piece
            return Float8Plane(piece.view(K, n), scale_inv, 0)
        # a copy: the per-expert GEMM reads [K, n] row-major
        return Float8Plane(self.col[:, start:start + n].contiguous(), scale_inv, 0)

    def experts(self, splits: list[int], axes=(1,)) -> list[dict | None]:
        """Every expert's :meth:`expert` at once, for segments of ``splits`` rows (host ints) in order: for each
        expert ``{axis: Float8Tensor of that plane alone}`` for the ``axes`` asked for, None for an expert without
        rows. (One ``split`` / ``unbind`` per buffer instead of E slicings of each: a MoE step makes 80 of these.)"""
        K = self.shape[1]
        sinv, amax = self.scale_inv.unbind(0), self.amax.unbind(0)
        pieces = {1: self.row.split(splits) if 1 in axes else None,
                  0: self.col.split([K * n for n in splits]) if 0 in axes and self.col_layout == "expert" else None}
        out, start = [], 0
        for e, n in enumerate(splits):
            if n == 0:
                out.append(None)
                continue
            ops = {}
            for a in axes:
                cut = pieces[a % 2]
                plane = self._plane(a, start, n, sinv[e], None if cut is None else cut[e])
                ops[a] = Float8Tensor((plane,), self.fmt, (n, K), self.dtype, amax[e])
            out.append(ops)
            start += n
        return out


def _outputs(call: GroupedFloat8CastCall):
    x, (T, K), E = call.x, call.x.shape, call.num_experts
    dtype, dev = FP8_DTYPES[call.fmt], x.device
    row = torch.empty((T, K), dtype=dtype, device=dev) if call.rowwise else None
    col = None
    if call.columnwise:
        col = torch.empty((K * T,) if call.col_layout == "expert" else (K, T), dtype=dtype, device=dev)
    sinv = torch.empty((E, _SINV_STRIDE), dtype=torch.float32, device=dev)[:, 0]
    return row, col, sinv


def _check(call: GroupedFloat8CastCall) -> None:
    x, E = call.x, call.num_experts
    if x.ndim != 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"grouped_cast_float8 takes a 2-D fp32/bf16/fp16 tensor, got {x.dtype} {list(x.shape)}")
    if isinstance(E, bool) or not isinstance(E, int) or E < 1:
        raise ValueError(f"grouped_cast_float8: num_experts must be a positive int, got {E!r}")
    if (call.ends is None) == (call.rows_per_expert is None):
        raise ValueError("grouped_cast_float8: give the segments as ends= (a device tensor) or rows_per_expert=")
    if call.ends is not None and (call.ends.shape != (E,) or call.ends.dtype not in (torch.int32, torch.int64)
                                  or call.ends.device != x.device):
        raise ValueError(f"grouped_cast_float8: ends must be an int32/int64 tensor of {E} segment ends on "
                         f"{x.device}, got {call.ends.dtype} {list(call.ends.shape)} on {call.ends.device}")
    if call.rows_per_expert is not None and call.rows_per_expert * E != x.shape[0]:
        raise ValueError(f"grouped_cast_float8: {E} experts of {call.rows_per_expert} rows are not the "
                         f"{x.shape[0]} rows of x")
    if not (call.rowwise or call.columnwise):
        raise ValueError("grouped_cast_float8: ask for the rowwise and/or the columnwise plane")
    if call.col_layout not in COL_LAYOUTS:
        raise ValueError(f"grouped_cast_float8: col_layout must be one of {COL_LAYOUTS}, got {call.col_layout!r}")
    m = call.segment_multiple
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"grouped_cast_float8: segment_multiple must be a positive int, got {m!r}")
    if call.rows_per_expert is not None and call.rows_per_expert % m:
        raise ValueError(f"grouped_cast_float8: segments of {call.rows_per_expert} rows are not multiples of "
                         f"segment_multiple={m}")
    if call.scale is not None and (call.scale.shape != (E,) or call.scale.device != x.device):
        raise ValueError(f"grouped_cast_float8: scale must hold the {E} experts' scales on {x.device}, got "
                         f"{list(call.scale.shape)} on {call.scale.device}")
    r = call.row_amax
    if r is not None:
        if call.scale is not None:
            raise ValueError("grouped_cast_float8: row_amax serves current scaling; with a scale given (delayed "
                             "scaling) the amaxes come from the cast pass")
        if r.ndim != 2 or r.shape[0] != x.shape[0] or r.shape[1] < 1 or r.dtype != torch.float32 \
                or r.device != x.device:
            raise ValueError(f"grouped_cast_float8: row_amax must be a float32 [{x.shape[0]}, P] tensor (P >= 1) on "
                             f"{x.device}, got {r.dtype} {list(r.shape)} on {r.device}")


def grouped_cast_float8(x: torch.Tensor, fmt="fp8_e4m3", *, ends: torch.Tensor | None = None,
                        rows_per_expert: int | None = None, num_experts: int | None = None, rowwise: bool = True,
                        columnwise: bool = False, col_layout: str = "expert", scale: torch.Tensor | None = None,
                        power_of_2_scales: bool = False, amax_epsilon: float = 0.0, amax_reduction_group=None,
                        segment_multiple: int = 1, row_amax: torch.Tensor | None = None,
                        backend: str | None = None) -> GroupedFloat8Tensor:
    """Per-tensor FP8 cast of each expert segment of ``x`` (see the module doc), through the registry.

    ``x``: ``[T, K]``, or stacked weights ``[E, N, K]`` (then ``rows_per_expert = N``). Segments: ``ends`` (int
    device tensor, expert ``e``'s rows end at ``ends[e]``) or ``rows_per_expert``. ``scale [E]`` given:
    delayed scaling, else current scaling (``power_of_2_scales``, ``amax_epsilon``; amaxes all-reduced over
    ``amax_reduction_group``, one call for all experts). ``segment_multiple``: every segment's row count is a
    multiple of it, as the caller knows (the Triton kernel takes it on trust, the reference checks it; 16 and
    its multiples store the columnwise plane faster). ``row_amax [T, P]`` (current scaling): the maxima of ``|x|``
    over pieces of each row, as the kernel that wrote ``x`` recorded them: the Triton kernel reduces these
    instead of reading ``x`` for the amaxes (taken on trust; the reference computes the amaxes from ``x``).
    """
    if x.ndim == 3:
        num_experts = x.shape[0] if num_experts is None else num_experts
        rows_per_expert = x.shape[1] if rows_per_expert is None and ends is None else rows_per_expert
        x = x.reshape(-1, x.shape[-1])
    if num_experts is None:
        num_experts = None if ends is None else ends.shape[0]
    call = GroupedFloat8CastCall(x, ends, rows_per_expert, num_experts, fp8_format_name(fmt), bool(rowwise),
                                 bool(columnwise), col_layout, scale, bool(power_of_2_scales), float(amax_epsilon),
                                 amax_reduction_group, segment_multiple, row_amax)
    _check(call)
    return registry.run("grouped_float8_cast", call, x.device, backend)


def triton_supports(call: GroupedFloat8CastCall) -> str | None:
    x = call.x
    if not device_supported(x.device):
        return f"a tensor on {x.device} (Triton runs CUDA tensors, or CPU tensors under TRITON_INTERPRET=1)"
    if x.numel() == 0:
        return f"an empty tensor {list(x.shape)} (nothing to launch)"
    if call.num_experts > MAX_EXPERTS:
        return f"{call.num_experts} experts (the kernels take up to {MAX_EXPERTS})"
    if x.shape[0] * max(x.shape[1], 1) >= 2 ** 31 and not x.is_cuda:
        return "more than 2**31 elements"
    return None


def _triton_grouped_cast(call: GroupedFloat8CastCall) -> GroupedFloat8Tensor:
    """The registered Triton implementation of ``grouped_float8_cast``: an amax pass (current scaling) and one
    cast pass over all experts."""
    x = call.x if call.x.stride(1) == 1 else call.x.contiguous()
    (T, K), E, fmt = x.shape, call.num_experts, call.fmt
    f32 = {"dtype": torch.float32, "device": x.device}
    mbits, emin = _FP8_BITS[fmt]
    uniform = call.ends is None
    xb = bf16_bits(x)
    ends = xb if uniform else call.ends  # an unused pointer where the segments are uniform
    seg = call.rows_per_expert if uniform else 0
    block_e = triton.next_power_of_2(E)
    common = dict(UNIFORM=uniform, X_BF16=x.dtype == torch.bfloat16, BLOCK_E=block_e)
    if call.scale is None:  # current scaling: the amax pass (over x, or over the row maxima recorded with it)
        src, P = (xb, K) if call.row_amax is None else (call.row_amax.contiguous(), call.row_amax.shape[1])
        if call.row_amax is None:
            BM, BN, warps = AMAX_TILE
        else:
            (BM, warps), BN = ROW_AMAX_TILE, min(128, triton.next_power_of_2(P))
            BM = BM if block_e <= 64 else 32
        grid = (triton.cdiv(T, BM), triton.cdiv(P, BN))
        part = torch.empty((grid[0] * grid[1], E), **f32)
        _grouped_amax_kernel[grid](src, ends, part, T, P, E, src.stride(0), seg, BM=BM, BN=BN, num_warps=warps,
                                   **dict(common, X_BF16=common["X_BF16"] and call.row_amax is None))
        amax = all_reduce_amax(part.amax(0), call.amax_reduction_group)
        mode, scale, stride_scale = 1, amax, 0
    else:
        mode, scale = 0, call.scale if call.scale.dtype == torch.float32 else call.scale.float()
        stride_scale = scale.stride(0)
    row, col, sinv = _outputs(call)
    multiple = call.rows_per_expert if uniform else call.segment_multiple
    seg16 = multiple % 16 == 0
    BM, BN, warps = next((t for m, t in SEGMENT_TILES.items() if multiple % m == 0), CAST_TILE)
    grid = (triton.cdiv(T, BM), triton.cdiv(K, BN))
    part = torch.empty((grid[0] * grid[1], E), **f32) if mode == 0 else sinv
    dummy = row if row is not None else col
    _grouped_cast_kernel[grid](xb, ends, _bytes(row, dummy), _bytes(col, dummy), scale, amax if mode else sinv,
                               sinv, part, T, K, E, x.stride(0), seg, stride_scale,
                               FMAX=FP8_MAX[fmt], MBITS=mbits, EMIN=emin, EPS=float(call.amax_epsilon),
                               POW2=call.power_of_2_scales, MODE=mode, ROW=row is not None, COL=col is not None,
                               COL_STACKED=call.col_layout == "stacked", GPU=not interpret_mode(),
                               SINV_STRIDE=_SINV_STRIDE, SEG16=seg16, SMALL=(T + BM) * (K + BN) < 2 ** 31, BM=BM, BN=BN,
                               num_warps=warps, **common)
    if mode == 0:
        amax = part.amax(0)
    return GroupedFloat8Tensor(row, col, call.col_layout, sinv, amax, fmt, (T, K), x.dtype)


def _reference_grouped_cast(call: GroupedFloat8CastCall) -> GroupedFloat8Tensor:
    """The reference: :func:`~mxtrain.quantization.float8.quantize_float8` of each expert's segment (reads the
    segment ends on the host; computes the amaxes from ``x``, whatever ``row_amax`` says)."""
    x, E = call.x, call.num_experts
    T, K = x.shape
    if call.ends is None:
        ends = [(e + 1) * call.rows_per_expert for e in range(E)]
    else:
        ends = [int(v) for v in call.ends.tolist()]
        counts = [b - a for a, b in zip([0] + ends[:-1], ends)]
        if any(n % call.segment_multiple for n in counts):
            raise ValueError(f"grouped_cast_float8: segments of {counts} rows, not all multiples of "
                             f"segment_multiple={call.segment_multiple}")
    row, col, sinv = _outputs(call)
    amax = torch.empty(E, dtype=torch.float32, device=x.device)
    axes = tuple(a for a, want in ((1, call.rowwise), (0, call.columnwise)) if want)
    start = 0
    for e, end in enumerate(ends):
        seg = x[start:end]
        q = reference_quantize_float8(seg, call.fmt, axes=axes, scale=None if call.scale is None else call.scale[e],
                            power_of_2_scales=call.power_of_2_scales, amax_epsilon=call.amax_epsilon,
                            amax_reduction_group=call.amax_reduction_group)
        sinv[e], amax[e] = q.scale_inv, q.amax
        if call.rowwise:
            row[start:end] = q.plane(1).data
        if call.columnwise:
            if call.col_layout == "expert":
                col[K * start:K * end] = q.plane(0).data.reshape(-1)
            else:
                col[:, start:end] = q.plane(0).data
        start = end
    return GroupedFloat8Tensor(row, col, call.col_layout, sinv, amax, call.fmt, (T, K), x.dtype)


def _make_call(*, x, fmt="fp8_e4m3", ends=None, rows_per_expert=None, num_experts=None, rowwise=True,
               columnwise=False, col_layout="expert", scale=None, power_of_2_scales=False, amax_epsilon=0.0,
               segment_multiple=1, row_amax=None):
    if num_experts is None and ends is not None:
        num_experts = ends.shape[0]
    return GroupedFloat8CastCall(x, ends, rows_per_expert, num_experts, fp8_format_name(fmt), rowwise, columnwise,
                                 col_layout, scale, power_of_2_scales, amax_epsilon, None, segment_multiple, row_amax)


registry.define(registry.Operation("grouped_float8_cast", _make_call, GroupedFloat8CastCall.key))
registry.register("grouped_float8_cast", "triton", _triton_grouped_cast, supports=triton_supports)
registry.register("grouped_float8_cast", "reference", _reference_grouped_cast)
