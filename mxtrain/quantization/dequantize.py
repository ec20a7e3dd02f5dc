"""Dequantize MX planes: ``code * 2**X``, exact, in pure PyTorch (lookup tables on the CPU)."""

from __future__ import annotations

import torch

from mxtrain.formats import ElemFormat, parse_format
from mxtrain.oplib import opaque_op
from mxtrain.quantization import _memory, lut
from mxtrain.quantization.packing import unpack_codes
from mxtrain.quantization.rounding import decode_codes_fast
from mxtrain.quantization.scale import scale_values

# Dynamo stays out of the quantizers: they are chunked Python loops, and inductor
# has miscompiled their dtype-bitcast views inside fused chains (NaN where eager is
# exact). Compiled models call them as opaque, exact functions: registered ops
# (``mxtrain::dequantize_plane``) where a module's path reaches them, else one graph break each.
_no_dynamo = torch.compiler.disable(recursive=True)

CHUNK_ELEMENTS = 1 << 18  # ~1 MiB of fp32 per chunk: every pass stays in cache


def _row_chunks(rows: int, length: int, elements: int = CHUNK_ELEMENTS):
    step = max(1, elements // max(length, 1))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


@_no_dynamo
def dequantize_plane_values(codes: torch.Tensor, scale: torch.Tensor, fmt: ElemFormat,
                            length: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values ``code * 2**X`` of unpacked codes ``[..., nblocks*bs]`` with scales ``[..., nblocks]``.

    Cropped to ``length`` along the last axis (default: no crop), cast to ``dtype``.
    """
    return dequantize_plane(codes, scale, fmt, False, length, dtype)


def _unpacked_length(nbytes: int, fmt: ElemFormat, packed: bool) -> int:
    return nbytes if not packed or fmt.bits == 8 else nbytes * 8 // fmt.bits


def dequantize_plane(data: torch.Tensor, scale: torch.Tensor, fmt: ElemFormat, packed: bool,
                     length: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values ``code * 2**X`` of a plane's codes ``[..., bytes]`` (packed or not) with scales ``[..., nblocks]``.

    Cropped to ``length`` along the last axis (default: the padded length), cast to ``dtype``.
    One opaque op under ``torch.compile`` (``mxtrain::dequantize_plane``).
    """
    padded = _unpacked_length(data.shape[-1], fmt, packed)
    if not torch.compiler.is_compiling():  # eager: the implementation itself
        return _dequantize_plane(data, scale, fmt, packed, padded if length is None else length, dtype)
    return torch.ops.mxtrain.dequantize_plane(data, scale, fmt.name, packed, padded if length is None else length,
                                              dtype)


@opaque_op("mxtrain::dequantize_plane")
def _dequantize_plane_op(data: torch.Tensor, scale: torch.Tensor, fmt: str, packed: bool, length: int,
                         dtype: torch.dtype) -> torch.Tensor:
    return _dequantize_plane(data, scale, parse_format(fmt), packed, length, dtype)


@_dequantize_plane_op.register_fake
def _(data, scale, fmt, packed, length, dtype):
    return data.new_empty((*data.shape[:-1], length), dtype=dtype)


def _dequantize_plane(data: torch.Tensor, scale: torch.Tensor, fmt: ElemFormat, packed: bool, length: int,
                      dtype: torch.dtype) -> torch.Tensor:
    nblocks = scale.shape[-1]
    padded = _unpacked_length(data.shape[-1], fmt, packed)
    lead = data.shape[:-1]
    data2, scale2 = data.reshape(-1, data.shape[-1]), scale.reshape(-1, nblocks)
    out = _memory.empty((data2.shape[0], length), dtype, data.device)
    if lut.use_tables(data.device):
        lut.dequantize_rows(data2, scale2, fmt, packed, padded, out, lut.LUT_CHUNK_ELEMENTS)
        return out.reshape(*lead, length)
    codes2 = unpack_codes(data2, fmt) if packed else data2
    for lo, hi in _row_chunks(codes2.shape[0], padded):
        values = decode_codes_fast(codes2[lo:hi], fmt).reshape(hi - lo, nblocks, -1)
        values.mul_(scale_values(scale2[lo:hi]).unsqueeze(-1))
        out[lo:hi] = values.reshape(hi - lo, padded)[:, :length]
    return out.reshape(*lead, length)
