"""The lookup-table CPU path (``mxtrain.quantization.lut``) against the reference chunk functions.

``lut.USE_LOOKUP_TABLES = False`` runs the reference (``element_codes`` etc.); the
tables must give the same codes, scale bytes and values bit for bit. The oracle
suites (test_mx_oracle.py, ...) run the table path against independent float64
oracles as well, since it is the default on the CPU.
"""

import itertools

import numpy as np
import pytest
import torch

from mxtrain.formats import MX_FORMAT_NAMES, parse_format
from mxtrain.quantization import (
    MXPlane, MXTensor, _memory, decode_codes, element_codes, fake_quantize_mx, lut, mx, pack_codes, quantize_mx,
    unpack_codes,
)
from mxtrain.quantization.rounding import grid_value, round_to_grid

import quant_oracles as O

ROUNDINGS = ("even", "nearest", "floor")
SCALE_MODES = ("floor", "rceil", "even")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns of a float tensor (NaN canonicalised: payloads need not survive)."""
    t = t.float()
    return torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t).view(torch.int32)


def _assert_same_values(a: torch.Tensor, b: torch.Tensor):
    assert a.dtype == b.dtype and a.shape == b.shape
    ba, bb = _bits(a), _bits(b)
    bad = (ba != bb).nonzero()
    assert bad.numel() == 0, [(tuple(i.tolist()), float(a[tuple(i)]), float(b[tuple(i)])) for i in bad[:8]]


def _assert_same_mx(a: MXTensor, b: MXTensor):
    assert len(a.planes) == len(b.planes)
    for pa, pb in zip(a.planes, b.planes):
        assert pa.axis == pb.axis and pa.packed == pb.packed
        assert torch.equal(pa.scale, pb.scale)
        assert torch.equal(pa.data, pb.data)


@pytest.fixture
def reference(monkeypatch):
    """A context that runs the reference path (no tables)."""

    class _Ref:
        def __enter__(self):
            monkeypatch.setattr(lut, "USE_LOOKUP_TABLES", False)

        def __exit__(self, *exc):
            monkeypatch.setattr(lut, "USE_LOOKUP_TABLES", True)

    return _Ref()


# ---------------------------------------------------------------------------------------------
# the claim behind the encode tables: codes depend on y_bits >> k (and, for even, on a sticky bit)


def _low_bit_variants(k: int, rng: np.random.Generator) -> list[int]:
    half = 1 << (k - 1)
    fixed = [0, 1, 2, half - 1, half, half + 1, (1 << k) - 2, (1 << k) - 1]
    return fixed + [int(v) for v in rng.integers(0, 1 << k, 4)]


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("name", MX_FORMAT_NAMES)
def test_every_index_with_varied_low_bits_matches_element_codes(name, rounding):
    """Every finite y of every table index (12 settings of the bits below it) encodes as the reference does."""
    fmt = parse_format(name)
    k = lut.index_shift(fmt)
    rng = np.random.default_rng(zlib_seed(name, rounding))
    hi = torch.arange(1 << (32 - k), dtype=torch.int64) << k
    enc = lut.encode_table(fmt, rounding, torch.device("cpu"))
    fake = lut.fake_table(fmt, rounding, torch.device("cpu"))
    for low in _low_bit_variants(k, rng):
        y = (hi | low).to(torch.int32).view(torch.float32)
        finite = torch.isfinite(y)
        y = y[finite]
        idx = lut.table_index(y, fmt, rounding)
        assert idx.dtype == torch.int32 and int(idx.min()) >= 0 and int(idx.max()) < enc.numel()
        ref = element_codes(y, fmt, rounding, None).to(torch.uint8)
        got = enc[idx.long()]
        bad = (got != ref).nonzero().squeeze(1)
        assert bad.numel() == 0, [(float(y[i]), int(got[i]), int(ref[i])) for i in bad[:8]]
        q, step_inv = round_to_grid(y, fmt, rounding, None)
        ref_vals = torch.copysign(grid_value(q, step_inv, fmt).clamp_(max=fmt.max_norm), y)
        if fmt.is_int:
            ref_vals.add_(0.0)
        _assert_same_values(fake[idx.long()], ref_vals)


def zlib_seed(*parts) -> int:
    import zlib

    return zlib.crc32("/".join(map(str, parts)).encode())


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("name", MX_FORMAT_NAMES)
def test_nonfinite_indices_encode_to_zero(name, rounding):
    """NaN-block elements (y = x * NaN) get code 0 and fake value 0 (the NaN scale makes it NaN)."""
    fmt = parse_format(name)
    y = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf")])
    y = torch.cat([y, torch.tensor([0x7F800001, 0x7FFFFFFF, -1, -0x7FFFFF], dtype=torch.int32).view(torch.float32)])
    idx = lut.table_index(y, fmt, rounding).long()
    assert torch.all(lut.encode_table(fmt, rounding, y.device)[idx] == 0)
    assert torch.all(lut.fake_table(fmt, rounding, y.device)[idx] == 0)


@pytest.mark.parametrize("name", MX_FORMAT_NAMES)
def test_scale_table_matches_shared_exponent_bytes_on_every_amax_pattern(name):
    fmt = parse_format(name)
    tables = lut.scale_table(fmt, "floor", torch.device("cpu"))
    if fmt.is_int:
        assert tables is None  # a zero block and an fp32-subnormal amax differ (2**-126 vs 2**-127)
        return
    for mode in ("rceil", "even"):
        assert lut.scale_table(fmt, mode, torch.device("cpu")) is None
    rng = np.random.default_rng(zlib_seed(name))
    bits = np.concatenate([np.arange(0, 0x7F800000 + 2, 0x400000 - 1), [0, 1, 0x7FFFFF, 0x800000, 0x7F7FFFFF,
                                                                        0x7F800000, 0x7FC00000, 0x7FFFFFFF],
                           rng.integers(0, 0x80000000, 50000)])
    amax = torch.from_numpy(bits.astype(np.int64)).to(torch.int32)
    e = (amax >> 23).long()
    ref = mx.shared_exponent_bytes(amax, fmt, "floor")
    assert torch.equal(tables[0][e], ref)
    _assert_same_values(tables[1][e], mx._inverse_scale_values(ref))


# ---------------------------------------------------------------------------------------------
# decoding and packing


@pytest.mark.parametrize("name", MX_FORMAT_NAMES)
@pytest.mark.parametrize("packed", [True, False])
def test_decode_tables_on_every_byte_and_byte_pair(name, packed):
    """Every byte (and every byte pair, as one uint16) decodes to the reference's code values."""
    fmt = parse_format(name)
    if not packed and fmt.bits != 8:
        data = torch.arange(1 << fmt.bits, dtype=torch.uint8)  # unpacked codes
        data = torch.stack(torch.meshgrid(data, data, indexing="ij"), -1).reshape(1, -1)
    elif packed and fmt.bits == 6:
        data = torch.randint(0, 256, (1, 3 * 4096), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    else:
        b = torch.arange(256, dtype=torch.uint8)
        data = torch.stack(torch.meshgrid(b, b, indexing="ij"), -1).reshape(1, -1)  # every pair
    codes = unpack_codes(data, fmt) if packed else data
    n = codes.shape[-1]
    for bs in (2, 4, n):
        if n % bs or (packed and (bs * fmt.bits) % 8):
            continue
        nblocks = n // bs
        scale = torch.randint(0, 256, (1, nblocks), dtype=torch.uint8, generator=torch.Generator().manual_seed(bs))
        ref = decode_codes(codes, fmt).view(1, nblocks, bs) * mx.scale_values(scale).unsqueeze(-1)
        for offset in (0, 1):  # an odd byte offset cannot be read as uint16
            src = torch.cat([torch.zeros(1, offset, dtype=torch.uint8), data], 1)[:, offset:]
            assert src.storage_offset() == offset
            out = mx.dequantize_plane(src, scale, fmt, packed)
            _assert_same_values(out, ref.reshape(1, n))
            out16 = mx.dequantize_plane(src, scale, fmt, packed, length=n - bs // 2, dtype=torch.bfloat16)
            _assert_same_values(out16, ref.reshape(1, n)[:, : n - bs // 2].to(torch.bfloat16))


@pytest.mark.parametrize("name", [n for n in MX_FORMAT_NAMES if parse_format(n).bits in (2, 4)])
def test_pack_into_equals_pack_codes(name):
    fmt = parse_format(name)
    codes = torch.randint(0, 1 << fmt.bits, (7, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    codes[0, : 1 << fmt.bits] = torch.arange(1 << fmt.bits)
    codes[1] = (1 << fmt.bits) - 1
    if not lut.can_pack(fmt):
        pytest.skip("big-endian machine: pack_codes is used")
    out = torch.empty(7, 64 * fmt.bits // 8, dtype=torch.uint8)
    lut.pack_into(codes, fmt, out)
    assert torch.equal(out, pack_codes(codes, fmt))


# ---------------------------------------------------------------------------------------------
# the whole path against the reference on adversarial tensors


def _adversarial(name: str, rng: np.random.Generator, rows: int = 24, length: int = 96) -> torch.Tensor:
    """fp32 ``[rows, length]`` mixing ties on the grid (+-1 ulp) at many scales, element and fp32
    subnormals, amaxes one ulp around powers of two, saturation, zero / -0.0 / NaN / Inf blocks and
    random bit patterns."""
    g = O.grid(name)
    mids = (g.mags[:-1] + g.mags[1:]) / 2
    pts = np.concatenate([g.mags, mids])
    out = np.empty((rows, length), np.float64)
    for r in range(rows):
        X = int(rng.choice([-127, -126, -100, -7, 0, 3, 60, 127 - g.emax]))
        cand = O.f32(pts * 2.0**X)
        cand = np.concatenate([cand, O.next_up(cand), O.next_down(cand)])
        row = rng.choice(cand, length) * np.where(rng.random(length) < 0.5, -1.0, 1.0)
        kind = r % 6
        if kind == 1:  # amax just under / at / over a power of two
            k = int(rng.integers(-140, 127))
            p = O.f32(2.0**k)
            row[:: 7] = rng.choice([O.next_down(p), p, O.next_up(p)], row[::7].size)
        elif kind == 2:  # fp32 subnormals and wide dynamic range
            row = O.f32_from_bits(rng.integers(0, 0x900000, length).astype(np.uint32)).astype(np.float64)
        elif kind == 3:
            row = O.f32_from_bits(rng.integers(0, 0x7F800000, length).astype(np.uint32)).astype(np.float64)
            row *= np.where(rng.random(length) < 0.5, -1.0, 1.0)
        elif kind == 4:  # signed zeros, a NaN, an Inf
            row[: length // 3] = -0.0
            row[length // 3] = np.nan
            row[length // 2 + 1] = -np.inf if r % 12 == 4 else np.inf
        elif kind == 5:  # saturation: amax with the mantissa near 2
            row[::5] = O.f32(2.0 ** (g.emax + int(rng.integers(-30, 30))) * 1.999)
        out[r] = row
    x = O.f32(out)
    x = np.where(np.isfinite(x) | np.isnan(out), x, np.copysign(np.finfo(np.float32).max, x))
    x = np.where(np.isinf(out), out, x).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(x))


def _compare(x, name, reference, **kw):
    with reference:
        ref = quantize_mx(x, name, **kw)
        ref_deq = [ref.dequantize(axis=p.axis) for p in ref.planes]
        ref_deq16 = [ref.dequantize(torch.bfloat16, axis=p.axis) for p in ref.planes]
        ref_fake = None
        if not isinstance(kw.get("axis", -1), tuple):
            ref_fake = fake_quantize_mx(x, name, **{k: v for k, v in kw.items() if k != "pack"})
    got = quantize_mx(x, name, **kw)
    _assert_same_mx(got, ref)
    for p, d, d16 in zip(got.planes, ref_deq, ref_deq16):
        _assert_same_values(got.dequantize(axis=p.axis), d)
        _assert_same_values(got.dequantize(torch.bfloat16, axis=p.axis), d16)
        # dequantizing the reference's planes with the tables
        _assert_same_values(ref.dequantize(axis=p.axis), d)
    if ref_fake is not None:
        _assert_same_values(fake_quantize_mx(x, name, **{k: v for k, v in kw.items() if k != "pack"}), ref_fake)


@pytest.mark.parametrize("scale_mode", SCALE_MODES)
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("name", MX_FORMAT_NAMES)
def test_adversarial_tensors_match_the_reference(name, rounding, scale_mode, reference, monkeypatch):
    # small chunks: several per call, and a ragged last one
    monkeypatch.setattr(lut, "LUT_CHUNK_ELEMENTS", 5 * 96)
    rng = np.random.default_rng(zlib_seed(name, rounding, scale_mode))
    x = _adversarial(name, rng)
    kw = dict(rounding=rounding, scale_mode=scale_mode)
    _compare(x, name, reference, block_size=32, axis=-1, **kw)
    _compare(x, name, reference, block_size=32, axis=(-1, 0), **kw)  # columnwise: strided rows
    _compare(x, name, reference, block_size=8, axis=-1, pack=False, **kw)
    _compare(x[:, :90], name, reference, block_size=32, axis=-1, **kw)  # ragged last block
    _compare(x, name, reference, block_size=0, axis=0, **kw)  # one block per column
    _compare(x.reshape(4, 6, 96).transpose(0, 1), name, reference, block_size=12, axis=1, **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["fp8_e4m3", "fp4_e2m1", "fp6_e3m2", "int8"])
def test_half_inputs_match_the_reference(name, dtype, reference):
    x = _adversarial(name, np.random.default_rng(zlib_seed(name, dtype)))
    x = torch.where(torch.isfinite(x), x.clamp(-6e4, 6e4), x).to(dtype)
    for rounding in ROUNDINGS:
        _compare(x, name, reference, block_size=32, axis=-1, rounding=rounding)
        _compare(x[:, :50], name, reference, block_size=16, axis=0, rounding=rounding)


@pytest.mark.parametrize("shape", [(0, 64), (3, 0), (1, 1), (5, 31), (2, 3, 33)])
def test_degenerate_shapes(shape, reference):
    x = torch.randn(shape)
    for name, bs in itertools.product(["fp8_e4m3", "fp4_e2m1", "fp6_e2m3", "int2"], (32, 0, 4)):
        try:
            with reference:
                quantize_mx(x, name, block_size=bs)
        except (ValueError, RuntimeError) as exc:  # not packable, or no rows: both paths raise
            with pytest.raises(type(exc)):
                quantize_mx(x, name, block_size=bs)
            continue
        _compare(x, name, reference, block_size=bs, axis=-1)


def test_stochastic_rounding_stays_on_the_reference(reference):
    x = torch.randn(64, 64)
    a = quantize_mx(x, "fp4_e2m1", rounding="stochastic", seed=7)
    with reference:
        b = quantize_mx(x, "fp4_e2m1", rounding="stochastic", seed=7)
    _assert_same_mx(a, b)


def test_large_output_with_and_without_huge_pages(monkeypatch):
    """A 32 MiB dequantized output (advised to use huge pages on Linux) holds the same values."""
    x = torch.randn(2048, 4096, generator=torch.Generator().manual_seed(5))
    q = quantize_mx(x, "fp8_e4m3")
    a = q.dequantize()
    monkeypatch.setattr(_memory, "ENABLED", False)
    b = q.dequantize()
    _assert_same_values(a, b)
    assert a.is_contiguous() and a.shape == x.shape
    e = _memory.empty((3, 5), torch.int16, torch.device("cpu"))
    assert e.shape == (3, 5) and e.dtype == torch.int16


def test_planes_with_odd_offsets_and_strides_dequantize(reference):
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(9))
    for name in ("fp8_e4m3", "fp4_e2m1"):
        q = quantize_mx(x, name)
        p = q.planes[0]
        shifted = torch.cat([torch.zeros(1, dtype=torch.uint8), p.data.reshape(-1)])[1:].view(p.data.shape)
        strided = torch.stack([p.data, p.data], -1)[..., 0]
        for data in (shifted, strided):
            q2 = MXTensor(planes=(MXPlane(data=data, scale=p.scale, axis=p.axis, packed=p.packed),),
                          fmt=q.fmt, block_size=q.block_size, shape=q.shape, dtype=q.dtype)
            with reference:
                ref = q.dequantize()
            _assert_same_values(q2.dequantize(), ref)


def test_inputs_that_require_grad(reference):
    """quantize_mx gives the same planes; fake_quantize_mx records a graph as the reference does."""
    w = torch.randn(8, 64, requires_grad=True)
    with reference:
        ref = quantize_mx(w, "fp4_e2m1")
        ref_fake = fake_quantize_mx(w, "fp8_e4m3")
    _assert_same_mx(quantize_mx(w, "fp4_e2m1"), ref)
    fake = fake_quantize_mx(w, "fp8_e4m3")
    assert fake.requires_grad == ref_fake.requires_grad
    _assert_same_values(fake.detach(), ref_fake.detach())
    with torch.no_grad():
        _assert_same_values(fake_quantize_mx(w, "fp8_e4m3"), ref_fake.detach())


@pytest.mark.parametrize("name", MX_FORMAT_NAMES)
def test_one_row_chunks_of_planes_with_odd_row_strides(name, reference, monkeypatch):
    """Rows of a plane one byte apart from a packed neighbour: every one-row chunk is contiguous at an
    odd byte offset (the byte-pair lookup reads a copy there), the whole plane is not contiguous."""
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(11))
    for rounding in ROUNDINGS:
        q = quantize_mx(x, name, rounding=rounding)
        p = q.planes[0]
        monkeypatch.setattr(lut, "LUT_CHUNK_ELEMENTS", 64)  # one row per chunk
        wide = torch.zeros(p.data.shape[0], p.data.shape[1] + 1, dtype=torch.uint8)
        wide[:, :-1] = p.data
        q2 = MXTensor(planes=(MXPlane(data=wide[:, :-1], scale=p.scale, axis=p.axis, packed=p.packed),),
                      fmt=q.fmt, block_size=q.block_size, shape=q.shape, dtype=q.dtype)
        with reference:
            ref = quantize_mx(x, name, rounding=rounding)
            ref_deq = ref.dequantize()
            ref_deq16 = ref.dequantize(torch.bfloat16)
        _assert_same_mx(q, ref)
        _assert_same_values(q2.dequantize(), ref_deq)
        _assert_same_values(q2.dequantize(torch.bfloat16), ref_deq16)


def test_scratch_views_follow_a_regrown_buffer():
    """A buffer seen through several dtypes and shapes: after it grows, every view is of the new one."""
    s = lut.Scratch(torch.device("cpu"))
    small = s.get("b", 4, torch.int32)
    assert s.get("b", 4, torch.int32) is small  # a kept view: no new view op
    s.get("b", 4, torch.float32, (2, 2)).fill_(1.5)
    assert small.view(torch.float32).tolist() == [1.5] * 4  # one buffer through two dtypes
    s.get("b", 64, torch.float32).fill_(2.0)  # grows
    again = s.get("b", 4, torch.int32)
    assert again is not small and again.data_ptr() == s.get("b", 64, torch.float32).data_ptr()
    assert again.view(torch.float32).tolist() == [2.0] * 4
    assert s.get("b", 4, torch.float32, (4, 1)).shape == (4, 1)


def test_cached_constants_ignore_the_default_device():
    """The CPU quantizer's cached constants and tables are CPU tensors even when a call runs under another default
    device (a meta-device model build, torch.set_default_device): that call may fail, later CPU calls must not."""
    import importlib

    from mxtrain.quantization import quantize_mx

    lut = importlib.import_module("mxtrain.quantization.lut")
    x = torch.randn(64, 64)
    want = quantize_mx(x, "fp8_e4m3").dequantize()
    lut._CONSTS.clear()
    with torch.device("meta"):
        try:
            quantize_mx(x, "fp8_e4m3").dequantize()
        except (RuntimeError, NotImplementedError):
            pass
    got = quantize_mx(x, "fp8_e4m3").dequantize()
    assert got.device.type == "cpu" and torch.equal(got, want)
