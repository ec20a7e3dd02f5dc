"""Gated MLP activations ``act(h[:, :F]) * h[:, F:]`` and their gradient, one Triton pass each.

Eager torch runs the gate's activation and the product as separate kernels over strided halves of
``h`` (non-vectorised), and its backward recomputes the activation and runs four more; these read
``h`` (and the gradient) once and write the result once. The roundings are torch's: the activation
is rounded to ``h``'s dtype before the product, as are ``g * up`` and ``g * act(gate)`` before the
activation's derivative; the fp32 formulas are :mod:`mxtrain.kernels.cast`'s (torch's CUDA ones on
the GPU), so results are torch's up to an ulp where CUDA's libm differs.

``row_amax=True`` also returns the maxima of ``|result|`` over each program's piece of a row, ``[tokens, P]``
fp32 (NaN counts as +Inf, as the FP8 amax passes count it): a per-tensor FP8 cast of the result that takes
them (GroupedLinear's grouped cast under current scaling: the next GEMM's input, or in backward the previous
GEMM's output gradient) reduces these instead of reading the whole result once more for its amax (see
:mod:`mxtrain.modules.amax_hints`).
"""

from __future__ import annotations

import torch

from mxtrain.activations import GATED
from mxtrain.kernels.ids import DTYPE_IDS, gate_activation_id
from mxtrain.kernels._triton_utils import (HAVE_TRITON, bf16_bits, device_supported, interpret_mode, launch_options,
                                            tl, triton)

__all__ = ["GATE_IDS", "gated_activation", "gated_activation_backward", "supports"]

# gated activation -> the gate's activation id in cast._activation / cast._act_bwd
GATE_IDS = {name: gate_activation_id(name) for name in GATED}
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

if HAVE_TRITON:
    from mxtrain.kernels.cast import _BF16, _act_bwd, _activation, _round_to_dtype, _store_out, _widen

    @triton.jit
    def _abs_max(v, mask):
        """max |v| of each row of a [ROWS, BLOCK] tile over the masked lanes, NaN counted as +Inf (0 where no
        lane is in)."""
        a = tl.where(v == v, tl.abs(v), float("inf"))
        return tl.max(tl.where(mask, a, 0.0), axis=1)

    @triton.jit
    def _tile(M, F, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        """This program's rows ``[ROWS]`` (int64), columns ``[BLOCK]`` and ``[ROWS, BLOCK]`` mask."""
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        return rows, cols, (rows[:, None] < M) & (cols[None, :] < F)

    @triton.jit
    def _gated_forward_kernel(h_ptr, y_ptr, amax_ptr, M, F, stride_h, stride_y, ACT: tl.constexpr,
                              OUT_KIND: tl.constexpr, GPU: tl.constexpr, ROW_AMAX: tl.constexpr,
                              ROWS: tl.constexpr, BLOCK: tl.constexpr):
        rows, cols, mask = _tile(M, F, ROWS, BLOCK)
        hp = h_ptr + rows[:, None] * stride_h + cols[None, :]
        gate = _widen(tl.load(hp, mask=mask, other=0), OUT_KIND == _BF16)
        up = _widen(tl.load(hp + F, mask=mask, other=0), OUT_KIND == _BF16)
        a = _round_to_dtype(_activation(gate, ACT, GPU), OUT_KIND)
        y = _round_to_dtype(a * up, OUT_KIND)
        _store_out(y_ptr + rows[:, None] * stride_y + cols[None, :], y, mask, OUT_KIND)
        if ROW_AMAX:  # amax[row, program_id(1)]
            tl.store(amax_ptr + rows * tl.num_programs(1) + tl.program_id(1), _abs_max(y, mask), mask=rows < M)

    @triton.jit
    def _gated_backward_kernel(h_ptr, g_ptr, dh_ptr, amax_ptr, M, F, stride_h, stride_g, stride_dh,
                               ACT: tl.constexpr, OUT_KIND: tl.constexpr, GPU: tl.constexpr, ROW_AMAX: tl.constexpr,
                               ROWS: tl.constexpr, BLOCK: tl.constexpr):
        rows, cols, mask = _tile(M, F, ROWS, BLOCK)
        hp = h_ptr + rows[:, None] * stride_h + cols[None, :]
        gate = _widen(tl.load(hp, mask=mask, other=0), OUT_KIND == _BF16)
        up = _widen(tl.load(hp + F, mask=mask, other=0), OUT_KIND == _BF16)
        g = _widen(tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0), OUT_KIND == _BF16)
        a = _round_to_dtype(_activation(gate, ACT, GPU), OUT_KIND)
        d_up = _round_to_dtype(g * a, OUT_KIND)
        d_gate = _round_to_dtype(_act_bwd(gate, _round_to_dtype(g * up, OUT_KIND), ACT, GPU), OUT_KIND)
        dp = dh_ptr + rows[:, None] * stride_dh + cols[None, :]
        _store_out(dp, d_gate, mask, OUT_KIND)
        _store_out(dp + F, d_up, mask, OUT_KIND)
        if ROW_AMAX:
            tl.store(amax_ptr + rows * tl.num_programs(1) + tl.program_id(1),
                     tl.maximum(_abs_max(d_gate, mask), _abs_max(d_up, mask)), mask=rows < M)


def supports(h: torch.Tensor, name: str, grad: torch.Tensor | None = None) -> str | None:
    """None where the kernels take ``h`` (and ``grad``), else why not."""
    if name not in GATE_IDS:
        return f"{name!r} is not a gated activation"
    if not HAVE_TRITON or not device_supported(h.device):
        return f"no Triton kernels for {h.device.type} tensors here"
    if h.ndim != 2 or h.shape[1] % 2 or h.stride(1) != 1 or h.dtype not in _DTYPES:
        return "h must be a row-contiguous [tokens, 2 * ffn] float32/bfloat16/float16 tensor"
    if grad is not None and (grad.shape != (h.shape[0], h.shape[1] // 2) or grad.dtype != h.dtype
                             or grad.stride(1) != 1):
        return "grad must be a row-contiguous [tokens, ffn] tensor of h's dtype"
    return None


# (rows, columns) of a program's tile. Timed on an H100 at the Mixtral expert layer's SwiGLU ([16544, 2 x 14336]
# bf16; forward / backward, ms): one row of 1024 columns 0.575 / 0.976, with the row maxima (row_amax) 0.623 /
# 0.992; 4 rows of 512 columns 0.569 / 0.914, with the row maxima 0.582 / 0.928
TILE = (4, 512)


def _tile_shape(f: int) -> tuple[int, int]:
    rows, block = TILE
    return rows, min(block, triton.next_power_of_2(max(f, 1)))


def _grid(m: int, f: int, rows: int, block: int):
    return triton.cdiv(m, rows), triton.cdiv(f, block)


def _row_amax_buffer(h: torch.Tensor, f: int, block: int, want: bool) -> torch.Tensor | None:
    return torch.empty(h.shape[0], triton.cdiv(f, block), dtype=torch.float32, device=h.device) if want else None


def gated_activation(h: torch.Tensor, name: str, row_amax: bool = False):
    """``act(h[:, :F]) * h[:, F:]`` for a gated activation ``name`` (see :data:`GATE_IDS`); with ``row_amax``
    the pair ``(y, maxima)``, ``maxima [tokens, P]`` the max ``|y|`` of each row's P pieces (module doc)."""
    why = supports(h, name)
    if why is not None:
        raise ValueError(f"gated_activation: {why}")
    f = h.shape[1] // 2
    y = torch.empty(h.shape[0], f, dtype=h.dtype, device=h.device)
    rows, block = _tile_shape(f)
    part = _row_amax_buffer(h, f, block, row_amax)
    if y.numel():
        _gated_forward_kernel[_grid(h.shape[0], f, rows, block)](
            bf16_bits(h), bf16_bits(y), y if part is None else part, h.shape[0], f, h.stride(0), y.stride(0),
            ACT=GATE_IDS[name], OUT_KIND=DTYPE_IDS[h.dtype], GPU=not interpret_mode(), ROW_AMAX=part is not None,
            ROWS=rows, BLOCK=block, **launch_options())
    return (y, part) if row_amax else y


def gated_activation_backward(h: torch.Tensor, grad: torch.Tensor, name: str, row_amax: bool = False):
    """``dh`` of :func:`gated_activation` for the output gradient ``grad``: ``[tokens, 2 * F]``, h's dtype; with
    ``row_amax`` the pair ``(dh, maxima)``, ``maxima [tokens, P]`` the max ``|dh|`` of each row's P pieces (each
    piece: a block of the gate's columns and the same block of the up columns)."""
    why = supports(h, name, grad)
    if why is not None:
        raise ValueError(f"gated_activation_backward: {why}")
    f = h.shape[1] // 2
    dh = torch.empty_like(h, memory_format=torch.contiguous_format)
    rows, block = _tile_shape(f)
    part = _row_amax_buffer(h, f, block, row_amax)
    if dh.numel():
        _gated_backward_kernel[_grid(h.shape[0], f, rows, block)](
            bf16_bits(h), bf16_bits(grad), bf16_bits(dh), dh if part is None else part, h.shape[0], f, h.stride(0),
            grad.stride(0), dh.stride(0), ACT=GATE_IDS[name], OUT_KIND=DTYPE_IDS[h.dtype], GPU=not interpret_mode(),
            ROW_AMAX=part is not None, ROWS=rows, BLOCK=block, **launch_options())
    return (dh, part) if row_amax else dh
