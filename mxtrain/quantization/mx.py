"""MX block quantization: shared E8M0 exponents and element codes, exact, in pure PyTorch.

Layout of a quantized plane: the block axis is moved last and zero-padded to
``nblocks * block_size``; codes are one unsigned integer per element
(``fmt.bits`` wide, in a uint8) and, with ``pack=True``, sub-byte codes are
packed along that last axis (see :mod:`mxtrain.quantization.packing`). Scale
bytes have shape ``[..., nblocks]`` with the same leading dims.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mxtrain.formats import E8M0, ElemFormat, parse_format
from mxtrain.quantization import _memory, lut
from mxtrain.quantization._validate import (
    ROUNDINGS, SCALE_MODES, check_block_size, check_choice, check_float_tensor, make_generator,
    normalize_axes, normalize_axis,
)
from mxtrain.quantization.dequantize import (  # noqa: F401  (dequantize_plane*: re-exported)
    _no_dynamo, _row_chunks, dequantize_plane, dequantize_plane_values,
)
from mxtrain.quantization.rounding import (
    FP32_ABS_MASK, element_codes, grid_value, round_to_grid,
)
from mxtrain.quantization.scale import (  # noqa: F401  (re-exported: the scale rules' home is scale.py)
    _inverse_scale_values, scale_values, shared_exponent_bytes,
)


def _rows(x: torch.Tensor, axis: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``x`` with ``axis`` moved last and the other dims flattened: ``[rows, length]`` and the leading shape."""
    moved = x.movedim(axis, -1)
    return moved.reshape(-1, moved.shape[-1]), tuple(moved.shape[:-1])


def _geometry(length: int, block_size: int) -> tuple[int, int]:
    """(block size, number of blocks) along an axis of ``length``; block_size 0 = whole axis."""
    bs = block_size if block_size > 0 else max(length, 1)
    return bs, -(-length // bs)


def _blocks_of(chunk: torch.Tensor, bs: int, nblocks: int) -> torch.Tensor:
    """fp32 ``[r, nblocks, bs]`` of a ``[r, length]`` chunk, zero-padding the ragged last block."""
    xf = chunk.float()
    pad = nblocks * bs - xf.shape[-1]
    if pad:
        xf = F.pad(xf, (0, pad))
    return xf.reshape(xf.shape[0], nblocks, bs)


def _scaled_blocks(blocks: torch.Tensor, fmt: ElemFormat, scale_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale bytes and the block values divided by their scale (exact: a power of two)."""
    amax_bits = (blocks.view(torch.int32) & FP32_ABS_MASK).amax(dim=-1)
    scale = shared_exponent_bytes(amax_bits, fmt, scale_mode)
    y = blocks * _inverse_scale_values(scale).unsqueeze(-1)
    return scale, y


def _quantize_blocks(blocks, fmt, scale_mode, rounding, generator):
    scale, y = _scaled_blocks(blocks, fmt, scale_mode)
    codes = element_codes(y, fmt, rounding, generator)
    nan_blocks = (scale == E8M0.nan_code).unsqueeze(-1)
    codes = codes.masked_fill_(nan_blocks, 0)  # a NaN block's codes are 0; its scale says NaN
    return codes.to(torch.uint8), scale


def _check_common(x, fmt, block_size, scale_mode, rounding):
    check_float_tensor(x)
    fmt = parse_format(fmt)
    block_size = check_block_size(block_size)
    scale_mode = check_choice(scale_mode, SCALE_MODES, "scale_mode")
    rounding = check_choice(rounding, ROUNDINGS, "rounding")
    return fmt, block_size, scale_mode, rounding


@_no_dynamo
def quantize_mx(x: torch.Tensor, fmt: "str | ElemFormat", block_size: int = 32, axis: "int | tuple[int, ...]" = -1,
                scale_mode: str = "floor", rounding: str = "even",
                seed: "int | torch.Generator | None" = None, pack: bool = True):
    """Quantize ``x`` to MX: element codes plus one E8M0 scale per block, as an :class:`MXTensor`.

    Args:
        x: float32, bfloat16 or float16 tensor, on any device.
        fmt: element format name or alias (``"fp8_e4m3"``, ``"mxfp4"``, ``"int8"``...).
        block_size: elements per block along ``axis``; 0 = one block for the whole
            axis. A ragged last block is zero-padded (the padding is stored).
        axis: block axis, or a tuple of axes to get one plane per axis (e.g.
            ``(-1, 0)`` for the rowwise and columnwise planes of a 2-D tensor).
        scale_mode: ``"floor"`` (OCP/microxcaling, elements saturate), ``"rceil"``
            (Transformer Engine/cuBLAS, never saturates) or ``"even"`` (torchao EVEN).
        rounding: ``"even"``, ``"nearest"`` (ties away), ``"floor"`` (toward zero), ``"stochastic"``.
        seed: stochastic rounding: int seed or Generator (None: torch's global RNG).
        pack: pack sub-byte codes (fp6 4-in-3 bytes, fp4/int4 two per byte, int2 four per byte).

    A block holding NaN or +-Inf gets scale 0xFF (NaN) and dequantizes to all NaN.
    """
    from mxtrain.quantization.mxtensor import MXPlane, MXTensor
    from mxtrain.quantization.packing import pack_codes, packed_length

    fmt, block_size, scale_mode, rounding = _check_common(x, fmt, block_size, scale_mode, rounding)
    axes = normalize_axes(axis, x.ndim)
    generator = make_generator(seed, x.device) if rounding == "stochastic" else None
    tables = lut.use_tables(x.device, rounding)
    planes = []
    for ax in axes:
        rows, lead = _rows(x, ax)
        bs, nblocks = _geometry(rows.shape[1], block_size)
        padded = nblocks * bs
        if pack:
            packed_length(padded, fmt)  # fail before any work
        codes = _memory.empty((rows.shape[0], packed_length(padded, fmt) if pack else padded), torch.uint8,
                              x.device)
        scale = torch.empty(rows.shape[0], nblocks, dtype=torch.uint8, device=x.device)
        if tables:
        
            # codes and scales are integers: no graph to record
            lut.quantize_rows(rows.detach(), bs, nblocks, fmt, scale_mode, rounding, pack, codes, scale,
                              lut.LUT_CHUNK_ELEMENTS)
        else:
            for lo, hi in _row_chunks(*rows.shape):
                c, s = _quantize_blocks(_blocks_of(rows[lo:hi], bs, nblocks), fmt, scale_mode, rounding, generator)
                c = c.reshape(hi - lo, padded)
                codes[lo:hi] = pack_codes(c, fmt) if pack else c
                scale[lo:hi] = s
        planes.append(MXPlane(data=codes.reshape(*lead, -1), scale=scale.reshape(*lead, nblocks), axis=ax,
                              packed=pack))
    return MXTensor(planes=tuple(planes), fmt=fmt.name, block_size=block_size or bs,
                    shape=tuple(x.shape), dtype=x.dtype, scale_mode=scale_mode, rounding=rounding,
                    whole_axis=block_size == 0)


@_no_dynamo
def fake_quantize_mx(x: torch.Tensor, fmt: "str | ElemFormat", block_size: int = 32, axis: int = -1,
                     scale_mode: str = "floor", rounding: str = "even",
                     seed: "int | torch.Generator | None" = None) -> torch.Tensor:
    """``quantize_mx(...).dequantize()`` in one pass, same shape and dtype as ``x``.

    Bit-identical to the two-step path; it skips materialising codes. Used by the
    CPU emulation of MX GEMM operands. Differentiable with a straight-through
    gradient (``d out / d x`` = identity, as torchao's ``to_mx`` and QAT fake
    quantizers): the gradient of ``x`` is the gradient of the result, unchanged.
    """
    fmt, block_size, scale_mode, rounding = _check_common(x, fmt, block_size, scale_mode, rounding)
    ax = normalize_axis(axis, x.ndim)
    if x.requires_grad and torch.is_grad_enabled():
        return _StraightThrough.apply(x, fmt, block_size, ax, scale_mode, rounding, seed)
    generator = make_generator(seed, x.device) if rounding == "stochastic" else None
    rows, lead = _rows(x, ax)
    length = rows.shape[1]
    bs, nblocks = _geometry(length, block_size)
    out = _memory.empty(rows.shape, x.dtype, x.device)
    if lut.use_tables(x.device, rounding):
    
        lut.fake_quantize_rows(rows, bs, nblocks, fmt, scale_mode, rounding, out, lut.LUT_CHUNK_ELEMENTS)
        return out.reshape(*lead, length).movedim(-1, ax)
    for lo, hi in _row_chunks(*rows.shape):
        scale, y = _scaled_blocks(_blocks_of(rows[lo:hi], bs, nblocks), fmt, scale_mode)
        q, step_inv = round_to_grid(y, fmt, rounding, generator)
        vals = torch.copysign(grid_value(q, step_inv, fmt).clamp_(max=fmt.max_norm), y)
        if fmt.is_int:
            vals.add_(0.0)  # two's complement has no -0: -0.0 + 0.0 == +0.0
        vals.mul_(scale_values(scale).unsqueeze(-1))
        out[lo:hi] = vals.reshape(hi - lo, -1)[:, :length]
    return out.reshape(*lead, length).movedim(-1, ax)


class _StraightThrough(torch.autograd.Function):
    """:func:`fake_quantize_mx` with the straight-through estimator: the gradient passes unchanged."""

    @staticmethod
    def forward(ctx, x, fmt, block_size, axis, scale_mode, rounding, seed):
        return fake_quantize_mx(x.detach(), fmt, block_size, axis, scale_mode, rounding, seed)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None, None, None, None
