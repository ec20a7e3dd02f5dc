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
from mxtrain.quantization import _memory
from mxtrain.quantization._validate import (
    ROUNDINGS, SCALE_MODES, check_block_size, check_choice, check_float_tensor, make_generator,
    normalize_axes, normalize_axis,
)
from mxtrain.quantization.rounding import (
    FP32_ABS_MASK, FP32_BIAS, FP32_EXP_MASK, FP32_MANT_BITS, decode_codes_fast, element_codes, grid_value,
    round_to_grid,
)

FP32_MIN_NORMAL_EXP = -126

# Dynamo stays out of the quantizers: they are chunked Python loops, and inductor
# has miscompiled their dtype-bitcast views inside fused chains (NaN where eager is
# exact). Compiled models call them as opaque, exact functions (one graph break each).
_no_dynamo = torch.compiler.disable(recursive=True)


def _scale_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(2**(b-127), 2**(127-b))`` for every scale byte b, NaN at 0xFF (exact, subnormal 2**-127 included)."""
    b = torch.arange(256, dtype=torch.float64)
    up = torch.exp2(b - E8M0.bias)
    down = torch.exp2(E8M0.bias - b)
    up[E8M0.nan_code] = float("nan")
    down[E8M0.nan_code] = float("nan")
    return up.to(torch.float32).to(device), down.to(torch.float32).to(device)


_SCALE_TABLES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _tables_for(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    tables = _SCALE_TABLES.get(device)
    if tables is None:
        tables = _SCALE_TABLES[device] = _scale_tables(device)
    return tables


def scale_values(scale_bytes: torch.Tensor) -> torch.Tensor:
    """fp32 ``2**(byte - 127)`` of E8M0 scale bytes (0xFF -> NaN)."""
    return _tables_for(scale_bytes.device)[0][scale_bytes.long()]


def _inverse_scale_values(scale_bytes: torch.Tensor) -> torch.Tensor:
    """fp32 ``2**(127 - byte)``: multiplying by it divides by the scale, exactly."""
    return _tables_for(scale_bytes.device)[1][scale_bytes.long()]


def shared_exponent_bytes(amax_bits: torch.Tensor, fmt: ElemFormat, scale_mode: str) -> torch.Tensor:
    """E8M0 scale bytes from the fp32 bit patterns of block amaxes (int32, sign clear).

    ``floor``: ``floor(log2 amax) - emax``, an all-zero block taking amax = 2**-126
    (microxcaling/OCP). ``even``: amax first rounded (half up) to ``mbits``
    mantissa bits (torchao's EVEN). ``rceil``: ``ceil(log2(amax * fp32(1/max_norm)))``
    with the product in fp32 (Transformer Engine / cuBLAS). All clamp to
    [-127, 127]; a NaN or Inf amax gives 0xFF.
    """
    nonfinite = amax_bits >= FP32_EXP_MASK
    if scale_mode == "rceil":
        d = amax_bits.view(torch.float32) * torch.tensor(1.0 / fmt.max_norm, dtype=torch.float32)
        d_bits = d.view(torch.int32)
        biased = d_bits >> FP32_MANT_BITS
        mant = d_bits & ((1 << FP32_MANT_BITS) - 1)
        # subnormal d: 2**-127 < d < 2**-126 rounds up to -126, anything smaller to -127
        round_up = torch.where(biased == 0, mant > (1 << (FP32_MANT_BITS - 1)), mant != 0)
        exp = biased - FP32_BIAS + round_up.to(torch.int32)
    else:
        bits = amax_bits
        if scale_mode == "even":
            bits = bits + (1 << (FP32_MANT_BITS - 1 - fmt.mbits))
        biased = bits >> FP32_MANT_BITS
        # zero block: amax := 2**-126; fp32-subnormal amax: floor(log2) <= -127
        exp = torch.where(biased == 0, torch.where(amax_bits == 0, FP32_MIN_NORMAL_EXP, -FP32_BIAS),
                          biased - FP32_BIAS) - fmt.emax
    scale = exp.clamp_(E8M0.min_exp, E8M0.max_exp) + E8M0.bias
    return torch.where(nonfinite, E8M0.nan_code, scale).to(torch.uint8)


CHUNK_ELEMENTS = 1 << 18  # ~1 MiB of fp32 per chunk: every pass stays in cache

# On the CPU, quantize_mx, fake_quantize_mx and dequantize run on lookup tables built
# from the reference functions (see :mod:`mxtrain.quantization.lut`): the same bits in
# far fewer passes. The reference chunk functions here stay the specification (and run
# on other devices and for stochastic rounding); tests set this False to compare the two.
USE_LOOKUP_TABLES = True
LUT_CHUNK_ELEMENTS = 1 << 18  # elements per chunk of the table path (its buffers reuse one allocation)


def _use_tables(device: torch.device, rounding: str | None = None) -> bool:
    from mxtrain.quantization import lut

    return USE_LOOKUP_TABLES and device.type == "cpu" and (rounding is None or rounding in lut.ROUNDINGS)


def _rows(x: torch.Tensor, axis: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``x`` with ``axis`` moved last and the other dims flattened: ``[rows, length]`` and the leading shape."""
    moved = x.movedim(axis, -1)
    return moved.reshape(-1, moved.shape[-1]), tuple(moved.shape[:-1])


def _geometry(length: int, block_size: int) -> tuple[int, int]:
    """(block size, number of blocks) along an axis of ``length``; block_size 0 = whole axis."""
    bs = block_size if block_size > 0 else max(length, 1)
    return bs, -(-length // bs)


def _row_chunks(rows: int, length: int, elements: int = CHUNK_ELEMENTS):
    step = max(1, elements // max(length, 1))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


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
    tables = _use_tables(x.device, rounding)
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
            from mxtrain.quantization import lut

            # codes and scales are integers: no graph to record
            lut.quantize_rows(rows.detach(), bs, nblocks, fmt, scale_mode, rounding, pack, codes, scale,
                              LUT_CHUNK_ELEMENTS)
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
    if _use_tables(x.device, rounding):
        from mxtrain.quantization import lut

        lut.fake_quantize_rows(rows, bs, nblocks, fmt, scale_mode, rounding, out, LUT_CHUNK_ELEMENTS)
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


@_no_dynamo
def dequantize_plane_values(codes: torch.Tensor, scale: torch.Tensor, fmt: ElemFormat,
                            length: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values ``code * 2**X`` of unpacked codes ``[..., nblocks*bs]`` with scales ``[..., nblocks]``.

    Cropped to ``length`` along the last axis (default: no crop), cast to ``dtype``.
    """
    return dequantize_plane(codes, scale, fmt, False, length, dtype)


def _unpacked_length(nbytes: int, fmt: ElemFormat, packed: bool) -> int:
    return nbytes if not packed or fmt.bits == 8 else nbytes * 8 // fmt.bits


@_no_dynamo
def dequantize_plane(data: torch.Tensor, scale: torch.Tensor, fmt: ElemFormat, packed: bool,
                     length: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values ``code * 2**X`` of a plane's codes ``[..., bytes]`` (packed or not) with scales ``[..., nblocks]``.

    Cropped to ``length`` along the last axis (default: the padded length), cast to ``dtype``.
    """
    from mxtrain.quantization import lut
    from mxtrain.quantization.packing import unpack_codes

    nblocks = scale.shape[-1]
    padded = _unpacked_length(data.shape[-1], fmt, packed)
    length = padded if length is None else length
    lead = data.shape[:-1]
    data2, scale2 = data.reshape(-1, data.shape[-1]), scale.reshape(-1, nblocks)
    out = _memory.empty((data2.shape[0], length), dtype, data.device)
    if _use_tables(data.device):
        lut.dequantize_rows(data2, scale2, fmt, packed, padded, out, LUT_CHUNK_ELEMENTS)
        return out.reshape(*lead, length)
    codes2 = unpack_codes(data2, fmt) if packed else data2
    for lo, hi in _row_chunks(codes2.shape[0], padded):
        values = decode_codes_fast(codes2[lo:hi], fmt).reshape(hi - lo, nblocks, -1)
        values.mul_(scale_values(scale2[lo:hi]).unsqueeze(-1))
        out[lo:hi] = values.reshape(hi - lo, padded)[:, :length]
    return out.reshape(*lead, length)
