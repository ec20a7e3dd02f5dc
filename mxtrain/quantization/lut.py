"""Lookup-table MX quantize / dequantize on the CPU: the reference's exact bits in a few passes over memory.

Encoding. Once a block is divided by its scale (``y = x * 2**-X``, exact), the
code of an element depends on the fp32 bits of ``y`` only through

* ``y_bits >> k`` with ``k = 22 - mbits``: the sign, the 8 exponent bits, the
  top ``mbits`` mantissa bits and the next (round) bit; and,
* for ties-to-even only, whether any of the ``k`` bits below are set (sticky).

Why: in the element-normal range the grid keeps ``mbits`` mantissa bits, so
floor needs none below them, ties-away needs the round bit, ties-to-even the
round bit and the sticky bit. In the element-subnormal range the grid is
coarser (it keeps fewer mantissa bits, its round bit lies inside the index and
its sticky bits straddle it), below half the smallest subnormal everything
rounds to zero, and from ``2**(emax + 1)`` up everything saturates. Integer
formats are the same with ``mbits`` fractional bits (``|y| < 2``, or saturated).
So the code is one table lookup on a ``10 + mbits`` (+1 for even) bit index,
and the table is *built by running the reference* (:func:`element_codes`) on
one representative ``y`` per index: it encodes the specification instead of
re-deriving it. ``tests/quantization/test_lut.py`` checks the claim for every
index with the low bits varied, for every format and rounding, and the whole
path against the reference on adversarial tensors.

Decoding: a table from a byte, or from a pair of bytes read as one uint16, to
the values of its codes (one 4-, 8- or 16-byte word per entry, copied as bits),
then one multiply by the scale per block.

Per cache-sized chunk the encoder makes: ``|x|`` bits, the block amax (scale
bytes and ``2**-X`` from a 256-entry table on its exponent for ``"floor"``),
``y`` (over the ``|x|`` buffer), the index (two integer passes, three more for
ties-to-even) and the gather; 4-bit codes are then packed two to a byte from an
int16 view. Chunk buffers are reused (a fresh page costs a fault on first
write). Stochastic rounding and non-CPU tensors stay on the reference path.

The chunks of a large call run on :mod:`mxtrain.quantization._workers` threads, one
torch thread each (torch's per-op thread teams collapse when another process holds
a core); each thread has its own chunk buffers.
"""

from __future__ import annotations

import sys

import torch

from mxtrain.formats import E8M0, ElemFormat
from mxtrain.quantization import _workers
from mxtrain.quantization.rounding import (
    FP32_ABS_MASK, FP32_EXP_MASK, FP32_MANT_BITS, code_table, element_codes, grid_value, round_to_grid,
)
from mxtrain.quantization.scale import _inverse_scale_values, _tables_for, shared_exponent_bytes

ROUNDINGS = ("even", "nearest", "floor")
_LITTLE_ENDIAN = sys.byteorder == "little"

# On the CPU, quantize_mx, fake_quantize_mx and dequantize run on these tables, built from the
# reference functions: the same bits in far fewer passes. The reference chunk functions of
# mxtrain.quantization.mx stay the specification (and run on other devices and for stochastic
# rounding); tests set this False to compare the two.
USE_LOOKUP_TABLES = True
LUT_CHUNK_ELEMENTS = 1 << 18  # elements per chunk of the table path (its buffers reuse one allocation)


def use_tables(device: torch.device, rounding: str | None = None) -> bool:
    """Whether the table path serves a call on ``device`` with ``rounding`` (None: a dequantize)."""
    return USE_LOOKUP_TABLES and device.type == "cpu" and (rounding is None or rounding in ROUNDINGS)


def index_shift(fmt: ElemFormat) -> int:
    """``k``: the bits of ``y`` below the round bit (the table index is ``y_bits >> k``)."""
    return 22 - fmt.mbits


def _representatives(fmt: ElemFormat, rounding: str) -> torch.Tensor:
    """fp32 ``y`` for every table index: ``i << k`` (and ``(i << k) | 1`` at index ``2i + 1`` for even)."""
    k = index_shift(fmt)
    i = torch.arange(1 << (32 - k), dtype=torch.int64, device="cpu") << k
    if rounding == "even":
        i = torch.stack((i, i | 1), dim=-1).reshape(-1)
    # int64 -> int32 keeps the low 32 bits: the sign bit lands in bit 31
    return i.to(torch.int32).view(torch.float32)


_CONSTS: dict[tuple, torch.Tensor] = {}


def _const(value: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """A 0-d CPU tensor holding ``value``: the operand of the chunks' bitwise ops. A Python int is
    wrapped in a new tensor on every call, host work done while holding the GIL that the chunk
    threads share."""
    key = (value, dtype)
    t = _CONSTS.get(key)
    if t is None:
        t = _CONSTS[key] = torch.tensor(value, dtype=dtype, device="cpu")  # not the default device (meta, cuda)
    return t


_ENCODE: dict[tuple, torch.Tensor] = {}
_FAKE: dict[tuple, torch.Tensor] = {}
_PAIRS: dict[tuple, torch.Tensor] = {}


def _nonfinite(y: torch.Tensor) -> torch.Tensor:
    return (y.view(torch.int32) & FP32_EXP_MASK) == FP32_EXP_MASK


def encode_table(fmt: ElemFormat, rounding: str, device: torch.device) -> torch.Tensor:
    """uint8 code of every table index: :func:`element_codes` of its representative.

    Indices of a NaN or Inf ``y`` get code 0. Only a NaN block has them (``y`` of a
    finite block stays below ``2**(emax + 1)``), and there every ``y`` is NaN
    (``x * NaN``), so its codes come out 0 as the reference masks them.
    """
    key = (fmt.name, rounding, device)
    table = _ENCODE.get(key)
    if table is None:
        y = _representatives(fmt, rounding)
        codes = element_codes(y, fmt, rounding, None).to(torch.uint8)
        table = _ENCODE[key] = codes.masked_fill_(_nonfinite(y), 0).to(device)
    return table


def fake_table(fmt: ElemFormat, rounding: str, device: torch.device) -> torch.Tensor:
    """fp32 grid value of every table index, as ``fake_quantize_mx`` computes it before the scale.

    NaN/Inf indices (NaN blocks only, see :func:`encode_table`) get 0: times the NaN scale, NaN.
    """
    key = (fmt.name, rounding, device)
    table = _FAKE.get(key)
    if table is None:
        y = _representatives(fmt, rounding)
        q, step_inv = round_to_grid(y, fmt, rounding, None)
        vals = torch.copysign(grid_value(q, step_inv, fmt).clamp_(max=fmt.max_norm), y)
        if fmt.is_int:
            vals.add_(0.0)
        table = _FAKE[key] = vals.masked_fill_(_nonfinite(y), 0.0).to(device)
    return table


_SCALES: dict[tuple, tuple[torch.Tensor, torch.Tensor] | None] = {}


def scale_table(fmt: ElemFormat, scale_mode: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(scale byte, fp32 2**-X)`` for every biased exponent ``amax_bits >> 23``, or None.

    Only ``"floor"`` scales are a function of the amax exponent alone (``"even"`` and
    ``"rceil"`` look at its mantissa), apart from a zero amax against an fp32-subnormal
    one, which share a byte when ``emax >= 1`` (both clamp to 2**-127) but not for the
    integer formats: None there, and the caller runs :func:`shared_exponent_bytes`.
    """

    key = (fmt.name, scale_mode, device)
    if key not in _SCALES:
        tables = None
        if scale_mode == "floor":
            e = torch.arange(256, dtype=torch.int32, device="cpu") << FP32_MANT_BITS
            ref = shared_exponent_bytes(e, fmt, scale_mode)
            same = all(torch.equal(ref, shared_exponent_bytes(e | m, fmt, scale_mode)) for m in (1, 0x7FFFFF))
            if same:
                tables = (ref.to(device), _inverse_scale_values(ref).to(device))
        _SCALES[key] = tables
    return _SCALES[key]


def _byte_values(fmt: ElemFormat, packed: bool) -> torch.Tensor:
    """fp32 ``[256, m]``: the values of the codes in one byte (m = 1, or 8 / bits when packed)."""
    values = code_table(fmt)
    b = torch.arange(256, device="cpu")
    if not packed or fmt.bits == 8:
        full = torch.full((256,), float("nan"), device="cpu")  # bytes above the largest code never occur
        full[: values.numel()] = values
        return full[:, None]
    per = 8 // fmt.bits
    mask = (1 << fmt.bits) - 1
    return torch.stack([values[(b >> (fmt.bits * j)) & mask] for j in range(per)], dim=-1)


_WORD = {4: torch.float32, 8: torch.int64, 16: torch.complex128}  # copied as bits, never computed on


def decode_group(fmt: ElemFormat, packed: bool, nbytes: int) -> int | None:
    """Bytes decoded per table entry: 2 when two bytes' values fit one 16-byte word, else 1.

    None when the codes need unpacking first (packed fp6).
    """
    if packed and fmt.bits == 6:
        return None
    per = 1 if not packed or fmt.bits == 8 else 8 // fmt.bits
    return 2 if 8 * per <= 16 and nbytes % 2 == 0 else 1


_DECODE: dict[tuple, torch.Tensor] = {}


def decode_table(fmt: ElemFormat, packed: bool, group: int, device: torch.device) -> torch.Tensor:
    """The values of every byte (``group`` 1) or byte pair (2, read as a native uint16), one word per entry."""
    key = (fmt.name, packed, group, device)
    table = _DECODE.get(key)
    if table is None:
        per_byte = _byte_values(fmt, packed)
        if group == 2:
            v = torch.arange(1 << 16, device="cpu")
            first, second = (v & 0xFF, v >> 8) if _LITTLE_ENDIAN else (v >> 8, v & 0xFF)
            per_byte = torch.cat((per_byte[first], per_byte[second]), dim=-1)
        words = per_byte.contiguous().view(_WORD[per_byte.shape[-1] * 4])
        table = _DECODE[key] = words.reshape(-1).to(device)
    return table


class Scratch:
    """Chunk buffers reused by every chunk of one call: fresh memory costs a page fault per 4 KiB,
    which on some machines takes longer than the pass that first writes it.

    A buffer is raw bytes seen through any dtype and shape; the views are kept, so a chunk of the
    usual size gets its buffers without new view calls (host work done while holding the GIL that
    the chunk threads share).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._bufs: dict[str, torch.Tensor] = {}
        self._views: dict[tuple, torch.Tensor] = {}

    def get(self, name: str, n: int, dtype: torch.dtype, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """``n`` elements of ``dtype`` of buffer ``name`` (contiguous, flat or in ``shape``)."""
        key = (name, n, dtype, shape)
        view = self._views.get(key)
        if view is None:
            nbytes = n * dtype.itemsize
            buf = self._bufs.get(name)
            if buf is None or buf.numel() < nbytes:
                buf = self._bufs[name] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                self._views = {k: v for k, v in self._views.items() if k[0] != name}
            view = buf[:nbytes].view(dtype)
            if shape is not None:
                view = view.view(shape)
            self._views[key] = view
        return view


def table_index(y: torch.Tensor, fmt: ElemFormat, rounding: str, scratch: Scratch | None = None) -> torch.Tensor:
    """int32 table index of every element of contiguous fp32 ``y`` (flat)."""
    scratch = scratch or Scratch(y.device)
    return _index_of_bits(y.view(-1).view(torch.int32), fmt, rounding, scratch)


def _index_of_bits(bits: torch.Tensor, fmt: ElemFormat, rounding: str, scratch: Scratch) -> torch.Tensor:
    """:func:`table_index` of the flat int32 bits of ``y``."""
    n = bits.numel()
    k = index_shift(fmt)
    # an arithmetic shift, then the mask: the logical shift of the bits (int32 has no unsigned shift)
    idx = torch.bitwise_right_shift(bits, _const(k), out=scratch.get("idx", n, torch.int32))
    idx.bitwise_and_(_const((1 << (32 - k)) - 1))
    if rounding == "even":
        sticky = torch.bitwise_and(bits, _const((1 << k) - 1), out=scratch.get("sticky", n, torch.int32))
        idx = sticky.clamp_max_(_const(1)).add_(idx, alpha=2)
    return idx


def _chunk_blocks(chunk: torch.Tensor, bs: int, nblocks: int, scratch: Scratch) -> torch.Tensor:
    """Contiguous fp32 ``[r * nblocks, bs]`` of a ``[r, length]`` chunk (a view when it already is one)."""
    r, length = chunk.shape
    padded = nblocks * bs
    if chunk.dtype == torch.float32 and length == padded and chunk.is_contiguous():
        return chunk.view(r * nblocks, bs)
    buf = scratch.get("x", r * padded, torch.float32, (r, padded))
    buf[:, :length].copy_(chunk)
    if padded > length:
        buf[:, length:].zero_()
    return scratch.get("x", r * padded, torch.float32, (r * nblocks, bs))


def _scaled(blocks: torch.Tensor, fmt: ElemFormat, scale_mode: str, scale_out: torch.Tensor,
            scratch: Scratch) -> torch.Tensor:
    """``y = blocks / scale`` (exact), as the reference's ``_scaled_blocks``, for contiguous fp32 ``blocks``
    ``[nb, bs]``; the scale bytes go to the flat ``scale_out`` ``[nb]``. ``y`` is scratch ``"y"``."""
    nb, bs = blocks.shape
    n = nb * bs
    mag = torch.bitwise_and(blocks.view(torch.int32), _const(FP32_ABS_MASK),
                            out=scratch.get("y", n, torch.int32, (nb, bs)))
    tables = scale_table(fmt, scale_mode, blocks.device)
    if tables is not None:
        e = torch.amax(mag, dim=-1, out=scratch.get("amax", nb, torch.int32))
        e = torch.bitwise_right_shift(e, _const(FP32_MANT_BITS), out=e)  # int32 indices: no widening pass
        torch.index_select(tables[0], 0, e, out=scale_out)
        torch.index_select(tables[1], 0, e, out=scratch.get("inv", nb, torch.float32))
        inv = scratch.get("inv", nb, torch.float32, (nb, 1))
    else:
        scale = shared_exponent_bytes(mag.amax(dim=-1), fmt, scale_mode)
        scale_out.copy_(scale)
        inv = _inverse_scale_values(scale).unsqueeze(-1)
    return torch.mul(blocks, inv, out=scratch.get("y", n, torch.float32, (nb, bs)))


def _scale_values(scale: torch.Tensor, scratch: Scratch) -> torch.Tensor:
    """fp32 ``2**(byte - 127)`` of flat scale bytes ``[nb]``, as ``[nb, 1]`` (as :func:`scale_values`,
    with one int32 copy and a lookup instead of a widening copy and advanced indexing)."""
    nb = scale.numel()
    idx = scratch.get("scale_idx", nb, torch.int32).copy_(scale)
    torch.index_select(_tables_for(scale.device)[0], 0, idx, out=scratch.get("scale_val", nb, torch.float32))
    return scratch.get("scale_val", nb, torch.float32, (nb, 1))


def _chunks(rows: int, padded: int, elements: int):
    step = max(1, elements // max(padded, 1))
    for lo in range(0, rows, step):
        yield lo, min(rows, lo + step)


def quantize_rows(rows: torch.Tensor, bs: int, nblocks: int, fmt: ElemFormat, scale_mode: str, rounding: str,
                  pack: bool, codes: torch.Tensor, scale: torch.Tensor, chunk_elements: int) -> None:
    """Codes (packed if ``pack``) and scale bytes of ``rows`` ``[R, length]`` into contiguous ``codes`` and
    ``scale``."""
    from mxtrain.quantization.packing import pack_codes

    table = encode_table(fmt, rounding, rows.device)
    scale_table(fmt, scale_mode, rows.device)  # cached before the workers look it up
    padded = nblocks * bs
    direct = not pack or fmt.bits == 8
    # whole-call views, sliced per chunk (one op each instead of a slice and reshapes)
    x_blocks = rows.view(-1, bs) if rows.dtype == torch.float32 and rows.shape[1] == padded \
        and rows.is_contiguous() else None
    codes_flat, scale_flat = codes.view(-1), scale.view(-1)

    def chunk(lo: int, hi: int, scratch: Scratch) -> None:
        r = hi - lo
        n = r * padded
        if x_blocks is not None:
            blocks = x_blocks[lo * nblocks:hi * nblocks]
        else:
            blocks = _chunk_blocks(rows[lo:hi], bs, nblocks, scratch)
        _scaled(blocks, fmt, scale_mode, scale_flat[lo * nblocks:hi * nblocks], scratch)
        idx = _index_of_bits(scratch.get("y", n, torch.int32), fmt, rounding, scratch)
        c = codes_flat[lo * padded:hi * padded] if direct else scratch.get("codes", n, torch.uint8)
        torch.index_select(table, 0, idx, out=c)
        if not direct:
            if can_pack(fmt):
                pack_into(c.view(r, padded), fmt, codes[lo:hi], scratch)
            else:
                codes[lo:hi] = pack_codes(c.view(r, padded), fmt)

    _run(chunk, rows.shape[0], padded, chunk_elements, rows.device, (rows, codes, scale))


def fake_quantize_rows(rows: torch.Tensor, bs: int, nblocks: int, fmt: ElemFormat, scale_mode: str,
                       rounding: str, out: torch.Tensor, chunk_elements: int) -> None:
    """``fake_quantize_mx`` of ``rows`` ``[R, length]`` into ``out`` (same shape, any float dtype)."""
    table = fake_table(fmt, rounding, rows.device)
    scale_table(fmt, scale_mode, rows.device)
    _tables_for(rows.device)  # scale_values' table, cached before the workers look it up
    padded = nblocks * bs
    length = rows.shape[1]
    direct = out.dtype == torch.float32 and padded == length and out.is_contiguous()
    scale = torch.empty(rows.shape[0] * nblocks, dtype=torch.uint8, device=rows.device)

    def chunk(lo: int, hi: int, scratch: Scratch) -> None:
        r = hi - lo
        n = r * padded
        s = scale[lo * nblocks:hi * nblocks]
        _scaled(_chunk_blocks(rows[lo:hi], bs, nblocks, scratch), fmt, scale_mode, s, scratch)
        idx = _index_of_bits(scratch.get("y", n, torch.int32), fmt, rounding, scratch)  # int32, taken as it is
        vals = out[lo:hi] if direct else scratch.get("y", n, torch.float32)  # y is dead once indexed
        torch.index_select(table, 0, idx, out=vals.view(-1))
        vals.view(r * nblocks, bs).mul_(_scale_values(s, scratch))
        if not direct:
            out[lo:hi] = vals.view(r, padded)[:, :length]

    _run(chunk, rows.shape[0], padded, chunk_elements, rows.device, (rows, out))


def dequantize_rows(data: torch.Tensor, scale: torch.Tensor, fmt: ElemFormat, packed: bool, padded: int,
                    out: torch.Tensor, chunk_elements: int) -> None:
    """Values of the codes ``data`` ``[R, bytes]`` with scales ``[R, nblocks]`` into ``out`` ``[R, length]``."""
    from mxtrain.quantization.packing import unpack_codes

    nblocks = scale.shape[-1]
    bs = padded // nblocks
    length = out.shape[1]
    nbytes = data.shape[1]
    direct = out.dtype == torch.float32 and padded == length and out.is_contiguous()
    group = decode_group(fmt, packed, nbytes)
    unpack = group is None  # packed fp6: unpack each chunk, then decode codes
    if unpack:
        packed, group = False, decode_group(fmt, False, padded)
    elif group == 2 and data.is_contiguous() and data.storage_offset() % 2:
        group = 1  # a uint16 view needs an even byte offset
    table = decode_table(fmt, packed, group, data.device)
    _tables_for(data.device)  # scale_values' table, cached before the workers look it up
    # whole-call views, sliced per chunk
    data_flat = data.view(-1) if data.is_contiguous() and not unpack else None
    if data_flat is not None and group == 2:
        data_flat = data_flat.view(torch.uint16)
    per_index = nbytes // group if not unpack else padded // group  # table indices per row
    scale_flat = scale.reshape(-1)
    out_words = out.view(-1).view(table.dtype) if direct else None  # one table word per index
    out_blocks = out.view(-1, bs) if direct else None

    def chunk(lo: int, hi: int, scratch: Scratch) -> None:
        r = hi - lo
        if data_flat is not None:
            codes = data_flat[lo * per_index:hi * per_index]
        else:
            codes = (unpack_codes(data[lo:hi], fmt) if unpack else data[lo:hi]).contiguous().view(-1)
            if group == 2:
                # a uint16 view needs an even offset (a one-row chunk of a strided plane is contiguous anywhere)
                codes = (codes.clone() if codes.storage_offset() % 2 else codes).view(torch.uint16)
        m = r * per_index
        idx = scratch.get("idx", m, torch.int32).copy_(codes)
        if direct:
            torch.index_select(table, 0, idx, out=out_words[lo * per_index:hi * per_index])
            vals = out_blocks[lo * nblocks:hi * nblocks]
        else:
            torch.index_select(table, 0, idx, out=scratch.get("vals", m, table.dtype))
            vals = scratch.get("vals", r * padded, torch.float32, (r * nblocks, bs))
        vals.mul_(_scale_values(scale_flat[lo * nblocks:hi * nblocks], scratch))
        if not direct:
            out[lo:hi] = vals.view(r, padded)[:, :length]

    _run(chunk, data.shape[0], padded, chunk_elements, data.device, (data, scale, out))


def _run(chunk, rows: int, padded: int, chunk_elements: int, device: torch.device, tensors) -> None:
    """``chunk(lo, hi, scratch)`` over the row chunks, on single-threaded workers where that pays
    (:mod:`mxtrain.quantization._workers`); every thread reuses its own :class:`Scratch`.

    Work for the workers is cut into at least one chunk per torch thread (a chunk's rows never
    depend on the other rows, so the cut changes no bit)."""
    total = rows * padded
    threads = torch.get_num_threads()
    if threads > 1 and total >= _workers.MIN_ELEMENTS:
        chunk_elements = min(chunk_elements, -(-total // threads))
    _workers.run_chunks(chunk, list(_chunks(rows, padded, chunk_elements)), total, lambda: Scratch(device), tensors)


def can_pack(fmt: ElemFormat) -> bool:
    """Whether :func:`pack_into` packs this format (else use :func:`~mxtrain.quantization.packing.pack_codes`)."""
    return _LITTLE_ENDIAN and fmt.bits in (4, 2)


def pack_into(codes: torch.Tensor, fmt: ElemFormat, out: torch.Tensor, scratch: Scratch | None = None) -> None:
    """Pack contiguous uint8 codes ``[r, n]`` (4- or 2-bit) into ``out`` ``[r, n * bits / 8]``, as ``pack_codes``.

    On a little-endian machine the two codes of a byte pair are the low and high
    byte of one int16 (four codes: of one int32), so the packed byte is the low
    byte of a few shifts and ORs of that word.
    """
    scratch = scratch or Scratch(codes.device)
    wide = torch.int16 if fmt.bits == 4 else torch.int32
    w = codes.view(wide)
    packed = torch.bitwise_right_shift(w, _const(4 if fmt.bits == 4 else 6, wide),
                                       out=scratch.get("pack", w.numel(), wide).view(w.shape))
    packed.bitwise_or_(w)  # 4-bit: low byte c0 | c1 << 4 (codes < 16)
    if fmt.bits == 2:
        packed.bitwise_or_(torch.bitwise_right_shift(w, _const(12, wide))).bitwise_or_(
            torch.bitwise_right_shift(w, _const(18, wide)))
    out.copy_(packed)  # integer narrowing keeps the low byte
