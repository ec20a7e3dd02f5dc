"""Bit packing of sub-byte MX element codes along the last axis.

Layouts (``c[i]`` is the code of element ``i`` along the packed axis; bit 0 is
the least significant bit of a byte):

* 4-bit (``fp4_e2m1``, ``int4``): byte ``i`` = ``c[2i] | c[2i+1] << 4``: element
  ``2i`` in the low nibble, as ``torch.float4_e2m1fn_x2`` and torchao/TE.
* 2-bit (``int2``): byte ``i`` = ``c[4i] | c[4i+1] << 2 | c[4i+2] << 4 | c[4i+3] << 6``.
* 6-bit (``fp6_e3m2``, ``fp6_e2m3``), four codes in three bytes, split 4+2 as in
  FP6-LLM / torchao PR 1810 so that every byte holds whole fields::

      byte 3i+0 = lo4(c[4i+0]) | lo4(c[4i+1]) << 4
      byte 3i+1 = lo4(c[4i+2]) | lo4(c[4i+3]) << 4
      byte 3i+2 = hi2(c[4i+0]) | hi2(c[4i+1]) << 2 | hi2(c[4i+2]) << 4 | hi2(c[4i+3]) << 6

  with ``lo4(c) = c & 0xF`` and ``hi2(c) = c >> 4`` (the sign and top exponent
  bit). A GPU thread unpacking 4 values reads one 2-byte nibble word and one
  byte, with no field straddling a byte boundary: two shifts and a mask each.

The packed axis length must be a multiple of the group (2, 4 or 4 codes).
"""

from __future__ import annotations

import torch

from mxtrain.formats import PACK_GROUP, ElemFormat, parse_format

_GROUP = PACK_GROUP  # codes per packing group, by element bits
_GROUP_BYTES = {4: 1, 2: 1, 6: 3}


def packed_length(length: int, fmt: "str | ElemFormat") -> int:
    """Bytes along the packed axis for ``length`` codes of ``fmt`` (raises if not packable)."""
    fmt = parse_format(fmt)
    if fmt.bits == 8:
        return length
    group = _GROUP[fmt.bits]
    if length % group:
        raise ValueError(f"packing {fmt.name} needs the packed axis length to be a multiple of {group}, got "
                         f"{length}; pick a block_size that is a multiple of {group} or pass pack=False")
    return length // group * _GROUP_BYTES[fmt.bits]


def _uint8_format(t: torch.Tensor, fmt: "str | ElemFormat", what: str) -> ElemFormat:
    """``fmt`` parsed, after checking that ``t`` (``what``) is uint8."""
    fmt = parse_format(fmt)
    if t.dtype != torch.uint8:
        raise TypeError(f"{what} must be uint8, got {t.dtype}")
    return fmt


def pack_codes(codes: torch.Tensor, fmt: "str | ElemFormat") -> torch.Tensor:
    """Pack uint8 codes (one per element, ``fmt.bits`` wide) along the last axis."""
    fmt = _uint8_format(codes, fmt, "codes (one code per element)")
    if fmt.bits == 8:
        return codes
    if codes.ndim == 0:
        raise ValueError("cannot pack a 0-d tensor")
    packed_length(codes.shape[-1], fmt)
    group = _GROUP[fmt.bits]
    c = codes.reshape(*codes.shape[:-1], -1, group)
    if fmt.bits == 4:
        out = c[..., 0] | (c[..., 1] << 4)
    elif fmt.bits == 2:
        out = c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)
    else:
        lo = c & 0xF
        hi = c >> 4
        out = torch.stack(
            (lo[..., 0] | (lo[..., 1] << 4), lo[..., 2] | (lo[..., 3] << 4),
             hi[..., 0] | (hi[..., 1] << 2) | (hi[..., 2] << 4) | (hi[..., 3] << 6)), dim=-1)
    return out.reshape(*codes.shape[:-1], -1)


def unpack_codes(packed: torch.Tensor, fmt: "str | ElemFormat") -> torch.Tensor:
    """Inverse of :func:`pack_codes`: one uint8 code per element along the last axis."""
    fmt = _uint8_format(packed, fmt, "packed codes")
    if fmt.bits == 8:
        return packed
    if fmt.bits == 4:
        out = torch.stack((packed & 0xF, packed >> 4), dim=-1)
    elif fmt.bits == 2:
        out = torch.stack([(packed >> s) & 0x3 for s in (0, 2, 4, 6)], dim=-1)
    else:
        if packed.shape[-1] % 3:
            raise ValueError(f"packed fp6 data must have a last axis that is a multiple of 3 bytes, "
                             f"got {packed.shape[-1]}")
        b = packed.reshape(*packed.shape[:-1], -1, 3)
        nib, hi = b[..., :2], b[..., 2:3]
        lo = torch.stack((nib & 0xF, nib >> 4), dim=-1).reshape(*nib.shape[:-1], 4)
        hi = torch.cat([(hi >> s) & 0x3 for s in (0, 2, 4, 6)], dim=-1)
        out = lo | (hi << 4)
    return out.reshape(*packed.shape[:-1], -1)
