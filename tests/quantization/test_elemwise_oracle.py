"""Element casts against oracles nobody here wrote (ml_dtypes, torch casts) and brute-force grids.

* ml_dtypes (float8_e4m3fn, float8_e5m2, float6_e2m3fn, float6_e3m2fn,
  float4_e2m1fn), rounding "even": values and codes, on every code value, every
  midpoint (ties), one fp32 ulp either side, random data, fp32 subnormals, -0.0.
* torch's own ``.to(bfloat16/float16)`` (and numpy float16, ml_dtypes.bfloat16)
  over the whole fp32 range: subnormals, ties, overflow to Inf.
* every format and deterministic rounding mode against a nearest-grid-point
  search over a grid enumerated in ``oracles.py`` from the bit layout alone.
"""

import zlib

import ml_dtypes
import numpy as np
import pytest
import torch

from mxtrain.formats import ELEMENT_FORMATS, E8M0, MX_FORMAT_NAMES, parse_elemwise_format, parse_format
from mxtrain.quantization import code_table, decode_codes, element_codes, quantize_elemwise

import quant_oracles as O

ML_DTYPES = {
    "fp8_e4m3": ml_dtypes.float8_e4m3fn,
    "fp8_e5m2": ml_dtypes.float8_e5m2,
    "fp6_e2m3": ml_dtypes.float6_e2m3fn,
    "fp6_e3m2": ml_dtypes.float6_e3m2fn,
    "fp4_e2m1": ml_dtypes.float4_e2m1fn,
}


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))


def _np(t: torch.Tensor) -> np.ndarray:
    return t.float().numpy()


def _assert_same(x, got, want):
    assert O.same_bits(got, want), O.mismatch_report(x, got, want)


# ---------------------------------------------------------------------------------------------
# format tables


@pytest.mark.parametrize("name", MX_FORMAT_NAMES)
def test_format_parameters_match_the_spec(name):
    fmt = ELEMENT_FORMATS[name]
    g = O.grid(name)
    assert fmt.max_norm == O.DOC_MAX_NORM[name] == g.max_norm
    assert fmt.bits == g.bits
    assert fmt.mbits == g.mbits
    assert fmt.min_subnorm == g.min_positive
    if fmt.is_float:
        assert fmt.emax == O.DOC_EMAX[name] == g.emax
        assert fmt.min_norm == g.min_normal
    assert fmt.max_code_magnitude == g.codes[-1]


@pytest.mark.parametrize("name", MX_FORMAT_NAMES)
def test_code_table_is_the_grid(name):
    """Every code decodes to the grid value the bit layout says; unused codes are the only extras."""
    fmt = parse_format(name)
    g = O.grid(name)
    table = code_table(fmt).numpy().astype(np.float64)
    assert table.shape == (2**g.bits,)
    pos = g.signed_code(np.arange(len(g.mags)), np.zeros(len(g.mags), bool))
    neg = g.signed_code(np.arange(len(g.mags)), np.ones(len(g.mags), bool))
    np.testing.assert_array_equal(table[pos], g.mags)
    np.testing.assert_array_equal(table[neg], -g.mags)
    if fmt.is_float:
        assert np.all(np.signbit(table[neg]))  # code with sign bit and zero magnitude is -0.0
    used = set(pos.tolist()) | set(neg.tolist())
    unused = [c for c in range(2**g.bits) if c not in used]
    if name == "fp8_e4m3":
        assert unused == [0x7F, 0xFF] and np.isnan(table[unused]).all()
    elif name == "fp8_e5m2":
        assert sorted(unused) == [0x7C, 0x7D, 0x7E, 0x7F, 0xFC, 0xFD, 0xFE, 0xFF]
        assert table[0x7C] == np.inf and table[0xFC] == -np.inf
        assert np.isnan(table[[0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF]]).all()
    elif fmt.is_int:
        assert unused == [2 ** (g.bits - 1)]  # the most negative two's complement code
    else:
        assert unused == []
    codes = torch.arange(2**g.bits, dtype=torch.uint8)
    assert torch.equal(decode_codes(codes, fmt).view(torch.int32), code_table(fmt).view(torch.int32))


def test_e8m0_constants():
    assert (E8M0.bias, E8M0.min_exp, E8M0.max_exp, E8M0.nan_code, E8M0.bits) == (127, -127, 127, 0xFF, 8)


# ---------------------------------------------------------------------------------------------
# ml_dtypes


def _ml_bits(x: np.ndarray, name: str) -> np.ndarray:
    """ml_dtypes bit pattern as the low ``bits`` bits of a byte (fp6/fp4 are stored one per byte)."""
    return x.astype(ML_DTYPES[name]).view(np.uint8).astype(np.int64)


@pytest.mark.parametrize("name", list(ML_DTYPES))
def test_ml_dtypes_stores_sub_byte_codes_in_low_bits(name):
    """The layout assumption the comparisons below rely on: sign at bit ``bits-1``, nothing above."""
    g = O.grid(name)
    table = code_table(parse_format(name)).numpy()
    finite = np.isfinite(table)
    codes = np.arange(2**g.bits)[finite]
    bits = _ml_bits(table[finite], name)
    np.testing.assert_array_equal(bits, codes)


@pytest.mark.parametrize("name", list(ML_DTYPES))
def test_cast_matches_ml_dtypes(name):
    rng = np.random.default_rng(1234)
    fmt = parse_format(name)
    x = O.adversarial_elements(name, rng, n_random=4000)
    if name == "fp8_e4m3":
        # ml_dtypes turns e4m3fn overflow into NaN, we saturate: compare in range only
        x = x[np.abs(x) <= fmt.max_norm]
    want = x.astype(ML_DTYPES[name]).astype(np.float32)
    got = _np(quantize_elemwise(_t(x), name, "even"))
    _assert_same(x, got, want)
    # codes: element_codes saturates (MX element semantics), so compare where ml_dtypes is finite
    finite = np.isfinite(want)
    got_codes = element_codes(_t(x[finite]), fmt, "even", None).numpy()
    want_codes = _ml_bits(x[finite], name)
    bad = np.flatnonzero(got_codes != want_codes)
    assert bad.size == 0, [(float(x[finite][i]), int(got_codes[i]), int(want_codes[i])) for i in bad[:8]]


@pytest.mark.parametrize("name", list(ML_DTYPES))
def test_every_code_value_round_trips(name):
    fmt = parse_format(name)
    table = code_table(fmt).numpy()
    codes = np.arange(len(table))
    finite = np.isfinite(table)
    got = element_codes(_t(table[finite]), fmt, "even", None).numpy()
    np.testing.assert_array_equal(got, codes[finite])
    np.testing.assert_array_equal(got, _ml_bits(table[finite], name))


@pytest.mark.parametrize("name", list(ML_DTYPES))
def test_fp32_subnormals_and_signed_zero(name):
    fmt = parse_format(name)
    bits = np.concatenate([np.arange(1, 64), np.arange(0x7FFFC0, 0x800000), [0x400000, 0x1234]]).astype(np.uint32)
    x = O.f32_from_bits(bits)
    x = np.concatenate([x, -x, O.f32([0.0, -0.0])])
    want = x.astype(ML_DTYPES[name]).astype(np.float32)
    got = _np(quantize_elemwise(_t(x), name, "even"))
    _assert_same(x, got, want)  # every one is +-0.0 with the input's sign
    assert np.all(got == 0) and np.array_equal(np.signbit(got), np.signbit(x))
    np.testing.assert_array_equal(element_codes(_t(x), fmt, "even", None).numpy(), _ml_bits(x, name))
    assert element_codes(_t(O.f32([-0.0])), fmt, "even", None).item() == 1 << (fmt.bits - 1)


def test_e4m3_saturates_where_ml_dtypes_gives_nan():
    fmt = parse_format("fp8_e4m3")
    x = O.f32([448.0, 449.0, 463.99997, 464.0, 464.00003, 480.0, 1e6, 3.4e38])
    x = np.concatenate([x, -x])
    ml = x.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert np.all(ml[np.abs(x) <= 464] == np.copysign(448, x[np.abs(x) <= 464]))
    assert np.isnan(ml[np.abs(x) > 464]).all()  # the documented difference
    got = _np(quantize_elemwise(_t(x), "fp8_e4m3", "even"))
    np.testing.assert_array_equal(got, np.copysign(448.0, x))
    codes = element_codes(_t(x), fmt, "even", None).numpy()
    np.testing.assert_array_equal(codes, np.where(x > 0, 0x7E, 0xFE))


@pytest.mark.parametrize("name", ["fp8_e5m2", "fp6_e3m2", "fp6_e2m3", "fp4_e2m1"])
def test_overflow_like_ml_dtypes(name):
    """fp8_e5m2 elementwise overflows to Inf as ml_dtypes does; fp6/fp4 saturate as ml_dtypes does."""
    fmt = parse_format(name)
    m = fmt.max_norm
    x = O.f32([m, m * 1.0625, m * 1.125, m * 1.1251, m * 1.5, m * 2, 1e30, 3.4e38])
    x = np.concatenate([x, -x])
    want = x.astype(ML_DTYPES[name]).astype(np.float32)
    _assert_same(x, _np(quantize_elemwise(_t(x), name, "even")), want)
    # as an MX element code it saturates in every case
    codes = element_codes(_t(x), fmt, "even", None).numpy()
    np.testing.assert_array_equal(codes, np.where(x > 0, fmt.max_code_magnitude,
                                                  fmt.max_code_magnitude | 1 << (fmt.bits - 1)))


def test_elementwise_fp8_is_1_5_2_like_ml_dtypes_e5m2():
    rng = np.random.default_rng(7)
    x = O.adversarial_elements("fp8_e5m2", rng)
    want = x.astype(ml_dtypes.float8_e5m2).astype(np.float32)
    _assert_same(x, _np(quantize_elemwise(_t(x), "fp8", "even")), want)
    assert parse_elemwise_format("fp8").ebits == 5


# ---------------------------------------------------------------------------------------------
# bfloat16 / float16 against torch's own casts


def _fp32_sweep(rng, n=200_000) -> np.ndarray:
    """Random fp32 bit patterns over the whole range (all exponents, subnormals, +-0)."""
    bits = rng.integers(0, 0x7F800000, n, dtype=np.int64).astype(np.uint32)
    x = O.f32_from_bits(bits)
    sign = rng.random(n) < 0.5
    return np.where(sign, -x, x).astype(np.float32)


def _ties_around(x: np.ndarray, drop_bits: int) -> np.ndarray:
    """fp32 values whose low ``drop_bits`` mantissa bits are exactly half (ties), and +-1 ulp."""
    b = O.f32_bits(x).astype(np.int64)
    half = (b & ~((1 << drop_bits) - 1)) | (1 << (drop_bits - 1))
    vals = np.concatenate([half - 1, half, half + 1])
    vals = vals[(vals & 0x7FFFFFFF) < 0x7F800000].astype(np.uint32)
    return O.f32_from_bits(vals)


@pytest.mark.parametrize("dtype,name", [(torch.bfloat16, "bfloat16"), (torch.float16, "fp16")])
def test_matches_torch_cast(dtype, name):
    rng = np.random.default_rng(99)
    sweep = _fp32_sweep(rng)
    ties = _ties_around(sweep[:20000], 16 if dtype == torch.bfloat16 else 13)
    fmt = parse_elemwise_format(name)
    m = fmt.max_norm
    edges = O.f32([m, np.nextafter(np.float32(m), np.float32(np.inf)), m * (1 + 2.0**-(fmt.mbits + 1)),
                   m * (1 + 2.0**-(fmt.mbits + 2)), 2.0**(fmt.emax + 1), 3.4028235e38,
                   fmt.min_norm, fmt.min_subnorm, fmt.min_subnorm / 2, fmt.min_subnorm * 0.75,
                   fmt.min_subnorm * 1.5, fmt.min_subnorm * 2.5, 0.0, -0.0])
    # fp16 subnormal range: ties between every pair of subnormals
    sub = O.f32((np.arange(0, 2**fmt.mbits + 2) + 0.5) * fmt.min_subnorm)
    x = np.concatenate([sweep, ties, edges, -edges, sub, -sub, O.next_up(sub), O.next_down(sub)])
    want = _t(x).to(dtype).float().numpy()
    got = _np(quantize_elemwise(_t(x), name, "even"))
    _assert_same(x, got, want)
    # a second oracle: numpy / ml_dtypes casts
    with np.errstate(over="ignore"):
        other = x.astype(np.float16 if dtype == torch.float16 else ml_dtypes.bfloat16).astype(np.float32)
    _assert_same(x, got, other)
    assert np.isinf(got).any()  # the sweep really reaches overflow


@pytest.mark.parametrize("name", ["bfloat16", "fp16", "fp8_e4m3", "int8"])
def test_nan_and_inf_pass_through(name):
    x = O.f32([np.nan, np.inf, -np.inf, 1.0])
    got = _np(quantize_elemwise(_t(x), name, "even"))
    assert np.isnan(got[0]) and got[1] == np.inf and got[2] == -np.inf and got[3] == 1.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["fp8_e4m3", "fp6_e2m3", "fp4_e2m1", "bfloat12", "fp12", "int4"])
def test_half_inputs_equal_their_fp32_upcast(dtype, name):
    rng = np.random.default_rng(3)
    x = _t(rng.standard_normal(4000) * np.exp2(rng.integers(-30, 30, 4000))).to(dtype)
    got = quantize_elemwise(x, name, "even")
    assert got.dtype == dtype
    want = quantize_elemwise(x.float(), name, "even").to(dtype)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


# ---------------------------------------------------------------------------------------------
# brute-force grid search: every format, every deterministic rounding mode

GRID_FORMATS = list(MX_FORMAT_NAMES) + ["bfloat10", "bfloat12", "bfloat16", "fp7", "fp8", "fp11", "fp16"]


@pytest.mark.parametrize("rounding", O.DETERMINISTIC_ROUNDINGS)
@pytest.mark.parametrize("name", GRID_FORMATS)
def test_elemwise_matches_grid_search(name, rounding):
    rng = np.random.default_rng(zlib.crc32(f"{name}{rounding}".encode()))
    fmt = parse_elemwise_format(name)
    with np.errstate(over="ignore"):
        x = O.adversarial_elements(name, rng, n_random=1500)
    x = x[np.isfinite(x)]
    want = O.round_values(x, name, rounding, inf_on_overflow=fmt.has_inf)
    got = _np(quantize_elemwise(_t(x), name, rounding))
    if fmt.is_int:
        # elementwise int fake-quant: compare values (a negative input rounding to 0 gives -0.0 there)
        bad = np.flatnonzero(got != want.astype(np.float32))
        assert bad.size == 0, [(float(x[i]), float(got[i]), float(want[i])) for i in bad[:8]]
    else:
        _assert_same(x, got, want)
    if fmt.has_inf:  # and with saturate=True the oracle saturates
        want_sat = O.round_values(x, name, rounding)
        _assert_same(x, _np(quantize_elemwise(_t(x), name, rounding, saturate=True)), want_sat)


@pytest.mark.parametrize("rounding", O.DETERMINISTIC_ROUNDINGS)
@pytest.mark.parametrize("name", MX_FORMAT_NAMES)
def test_element_codes_match_grid_search(name, rounding):
    rng = np.random.default_rng(zlib.crc32(f"{name}{rounding}1".encode()))
    fmt = parse_format(name)
    x = O.adversarial_elements(name, rng, n_random=1500)
    # beyond max_norm too: codes saturate, including far beyond
    x = np.concatenate([x, O.f32([1e3, 1e8, 3e9, 1e20, 3.4e38, -1e8, -3.4e38])])
    got = element_codes(_t(x), fmt, rounding, None).numpy()
    want = O.round_codes(x, name, rounding)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, [(float(x[i]), int(got[i]), int(want[i])) for i in bad[:8]]
    # codes decode to the oracle's values
    vals = decode_codes(torch.from_numpy(got.astype(np.uint8)), fmt).numpy()
    np.testing.assert_array_equal(vals, O.round_values(x, name, rounding).astype(np.float32))


@pytest.mark.parametrize("name", ["bfloat16", "fp16", "fp8_e4m3", "fp6_e3m2", "fp12"])
def test_flush_subnormals(name):
    fmt = parse_elemwise_format(name)
    rng = np.random.default_rng(5)
    x = O.adversarial_elements(name, rng, n_random=500) if O.grid(name).mags.size < 40000 else _fp32_sweep(rng, 5000)
    x = x[np.isfinite(x)]
    flushed = np.where(np.abs(x) < fmt.min_norm, x * np.float32(0.0), x)
    want = O.round_values(flushed, name, "even", inf_on_overflow=fmt.has_inf)
    got = _np(quantize_elemwise(_t(x), name, "even", subnormals=False))
    _assert_same(x, got, want)
