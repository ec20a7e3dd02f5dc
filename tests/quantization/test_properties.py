"""Property tests: idempotence, error bounds and stochastic rounding (hypothesis + statistics)."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from mxtrain.formats import MX_FORMAT_NAMES, parse_format
from mxtrain.quantization import decode_codes, fake_quantize_mx, quantize_elemwise, quantize_mx

import quant_oracles as O

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=True)


@st.composite
def mx_inputs(draw, max_len=70):
    """A 1-D or 2-D fp32 array (wide dynamic range: hypothesis favours edges), a block size, an axis."""
    ndim = draw(st.sampled_from([1, 2]))
    shape = (draw(st.integers(1, max_len)),) if ndim == 1 else (draw(st.integers(1, 4)), draw(st.integers(1, 40)))
    style = draw(st.sampled_from(["any", "scaled"]))
    if style == "any":
        x = draw(hnp.arrays(np.float32, shape, elements=finite_f32))
    else:  # a block-like spread: one exponent, mantissas anywhere
        k = draw(st.integers(-149, 127))
        m = draw(hnp.arrays(np.float32, shape, elements=st.floats(-2, 2, width=32)))
        with np.errstate(over="ignore"):
            x = O.f32(m.astype(np.float64) * 2.0**k)
        x[~np.isfinite(x)] = 0.0
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8, 32, 0]))
    axis = draw(st.integers(-ndim, ndim - 1))
    return x, block_size, axis


def _t(a):
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))


def _zero_blocks(m, axis):
    """Blocks whose every code has zero magnitude (they may legitimately change scale)."""
    fmt = m.format
    codes = m.codes(axis).long()
    mag = codes & ((1 << (fmt.bits - 1)) - 1) if fmt.is_float else codes
    nblocks = m.plane(axis).scale.shape[-1]
    return (mag.reshape(*mag.shape[:-1], nblocks, -1) == 0).all(-1)


def _check_requantize(x, name, bs, axis, scale_mode, rounding, *, same_codes=True, skip_blocks=None):
    m = quantize_mx(_t(x), name, block_size=bs, axis=axis, scale_mode=scale_mode, rounding=rounding, pack=False)
    d = m.dequantize()
    m2 = quantize_mx(d, name, block_size=bs, axis=axis, scale_mode=scale_mode, rounding=rounding, pack=False)
    assert torch.equal(m2.dequantize().view(torch.int32), d.view(torch.int32))
    if not same_codes:
        return
    keep = ~_zero_blocks(m, axis)
    if skip_blocks is not None:
        keep &= ~skip_blocks
    s1, s2 = m.plane(axis).scale, m2.plane(axis).scale
    assert torch.equal(s1[keep], s2[keep])
    c1 = m.codes(axis).reshape(*s1.shape, -1)
    c2 = m2.codes(axis).reshape(*s1.shape, -1)
    assert torch.equal(c1[keep], c2[keep])
    assert torch.equal(c1[~keep], c2[~keep])  # zero blocks keep zero codes (and their signs)


@SETTINGS
@given(mx_inputs(), st.sampled_from(MX_FORMAT_NAMES), st.sampled_from(O.DETERMINISTIC_ROUNDINGS))
def test_floor_scale_requantize_is_identity(inp, name, rounding):
    """Quantizing the dequantized tensor again gives the same codes and scales (floor mode).

    Only a block whose codes are all zero may change its scale byte (e.g. an int
    block with an fp32-subnormal amax that rounds to 0 becomes an all-zero block).
    """
    x, bs, axis = inp
    _check_requantize(x, name, bs, axis, "floor", rounding)


def _subnormal_amax_blocks(x, bs, axis):
    moved = np.moveaxis(np.abs(x.astype(np.float64)), axis, -1)
    n = moved.shape[-1]
    b = bs or n
    nb = -(-n // b)
    padded = np.concatenate([moved, np.zeros(moved.shape[:-1] + (nb * b - n,))], -1)
    return torch.from_numpy(padded.reshape(*moved.shape[:-1], nb, b).max(-1) < 2.0**-126)


@SETTINGS
@given(mx_inputs(), st.sampled_from(MX_FORMAT_NAMES), st.sampled_from(["even", "nearest"]))
def test_even_scale_requantize_is_identity(inp, name, rounding):
    """Same for scale_mode="even" with round-to-nearest elements.

    Excluded: int formats on blocks whose amax is an fp32 subnormal.  The contract's
    bit rule (amax bits + 1 << (22 - mbits)) rounds a subnormal at a fixed absolute
    position, so e.g. int2 amax 2**-127 (exactly representable) becomes 2**-126.
    """
    x, bs, axis = inp
    skip = _subnormal_amax_blocks(x, bs, axis) if parse_format(name).is_int else None
    if skip is not None and skip.all():
        return
    m = quantize_mx(_t(x), name, block_size=bs, axis=axis, scale_mode="even", rounding=rounding, pack=False)
    d = m.dequantize()
    if torch.isinf(d).any():
        # like rceil, "even" may scale an amax near fp32 max so that it rounds to 2**128 (Inf)
        assert np.abs(x).max() > 2.0**127
        return
    m2 = quantize_mx(d, name, block_size=bs, axis=axis, scale_mode="even", rounding=rounding, pack=False)
    keep = ~_zero_blocks(m, axis)
    if skip is not None:
        keep &= ~skip
    s1, s2 = m.plane(axis).scale, m2.plane(axis).scale
    assert torch.equal(s1[keep], s2[keep])
    c1 = m.codes(axis).reshape(*s1.shape, -1)
    c2 = m2.codes(axis).reshape(*s1.shape, -1)
    assert torch.equal(c1[keep], c2[keep])


@SETTINGS
@given(mx_inputs(), st.sampled_from(MX_FORMAT_NAMES), st.sampled_from(["even", "nearest"]))
def test_rceil_fake_quant_is_a_projection(inp, name, rounding):
    """rceil: the dequantized values are a fixpoint (codes need not be: the scale may drop by one
    when the rounded amax falls to half of max_norm * 2**X or below)."""
    x, bs, axis = inp
    d = fake_quantize_mx(_t(x), name, block_size=bs, axis=axis, scale_mode="rceil", rounding=rounding)
    if torch.isinf(d).any():
        # rceil does not saturate: amax near fp32 max may round to 2**128, which dequantizes to Inf
        assert np.abs(x).max() > 2.0**127
        return
    _check_requantize(x, name, bs, axis, "rceil", rounding, same_codes=False)


def test_rceil_requantize_may_lower_the_scale():
    # fp4: amax 3.9 -> d = 0.65 -> X = 0 -> 3.9 rounds to 4; with 0.5: X = -1
    x = torch.tensor([3.9, 0.5])
    m = quantize_mx(x, "fp4_e2m1", block_size=2, scale_mode="rceil")
    assert m.plane().scale.item() == 127 and m.dequantize().tolist() == [4.0, 0.5]
    x2 = torch.tensor([3.2, 0.5])  # d = 0.53 -> X = 0; 3.2 rounds to 3 = max_norm / 2: X drops to -1
    m = quantize_mx(x2, "fp4_e2m1", block_size=2, scale_mode="rceil")
    d = m.dequantize()
    m2 = quantize_mx(d, "fp4_e2m1", block_size=2, scale_mode="rceil")
    assert (m.plane().scale.item(), m2.plane().scale.item()) == (127, 126)
    assert torch.equal(m2.dequantize(), d)


# ---------------------------------------------------------------------------------------------
# error bound after scaling


@SETTINGS
@given(mx_inputs(), st.sampled_from(MX_FORMAT_NAMES), st.sampled_from(["floor", "rceil", "even"]),
       st.sampled_from(O.DETERMINISTIC_ROUNDINGS))
def test_error_after_scaling_is_within_half_a_step(inp, name, scale_mode, rounding):
    x, bs, axis = inp
    g = O.grid(name)
    m = quantize_mx(_t(x), name, block_size=bs, axis=axis, scale_mode=scale_mode, rounding=rounding, pack=False)
    ax = axis % x.ndim
    X = m.plane(ax).scale.numpy().astype(np.int64) - 127
    moved = np.moveaxis(x, ax, -1).astype(np.float64)
    n = moved.shape[-1]
    bsz = bs or n
    Xe = np.repeat(X, bsz, axis=-1)[..., :n]
    y = moved * np.exp2(-Xe.astype(np.float64))
    # the element value from its code (dequantize may overflow to Inf at 2**128: see test_mx_oracle)
    q = decode_codes(m.codes(ax), m.format).numpy().astype(np.float64)[..., :n]
    assert np.all(np.abs(q) <= g.max_norm)
    if scale_mode == "floor":
        assert np.all(np.abs(y) < 2.0 ** (g.emax + 1))  # only saturation, never more than a binade
    if scale_mode == "rceil":
        assert np.all((np.abs(y) <= g.max_norm) | (Xe == 127))  # rceil saturates only at X = 127
    lo, hi = O.neighbours(y, name)
    inside = np.abs(y) <= g.max_norm
    err = np.abs(y - q)  # exact: both on fine dyadic grids within float64's reach
    if rounding == "floor":
        assert np.all(np.abs(q)[inside] == lo[inside])
        assert np.all(err[inside] < np.maximum(hi - lo, 2.0**-300)[inside])
    else:
        assert np.all(err[inside] <= ((hi - lo) / 2)[inside])
    assert np.all(np.abs(q)[~inside] == g.max_norm)
    assert np.all((np.sign(q) == np.sign(y)) | (q == 0))


# ---------------------------------------------------------------------------------------------
# stochastic rounding

STOCH_FORMATS = list(MX_FORMAT_NAMES) + ["bfloat16", "fp12"]


@pytest.mark.parametrize("name", MX_FORMAT_NAMES)
def test_stochastic_mx_is_reproducible_and_seed_dependent(name):
    rng = np.random.default_rng(0)
    x = _t(rng.standard_normal((16, 256)))
    a = quantize_mx(x, name, rounding="stochastic", seed=123)
    b = quantize_mx(x, name, rounding="stochastic", seed=123)
    c = quantize_mx(x, name, rounding="stochastic", seed=124)
    assert torch.equal(a.plane().data, b.plane().data) and torch.equal(a.plane().scale, b.plane().scale)
    assert not torch.equal(a.plane().data, c.plane().data)
    gen1 = torch.Generator().manual_seed(5)
    gen2 = torch.Generator().manual_seed(5)
    assert torch.equal(quantize_mx(x, name, rounding="stochastic", seed=gen1).plane().data,
                       quantize_mx(x, name, rounding="stochastic", seed=gen2).plane().data)
    f1 = fake_quantize_mx(x, name, rounding="stochastic", seed=123)
    f2 = fake_quantize_mx(x, name, rounding="stochastic", seed=123)
    assert torch.equal(f1, f2)
    # the fused path draws the same uniforms as the two-step path
    assert torch.equal(f1.view(torch.int32), a.dequantize().view(torch.int32))


@pytest.mark.parametrize("name", STOCH_FORMATS)
def test_stochastic_elemwise_is_reproducible_and_seed_dependent(name):
    rng = np.random.default_rng(1)
    x = _t(rng.standard_normal(4096) * 3)
    a = quantize_elemwise(x, name, "stochastic", seed=7)
    assert torch.equal(a, quantize_elemwise(x, name, "stochastic", seed=7))
    assert not torch.equal(a, quantize_elemwise(x, name, "stochastic", seed=8))


@pytest.mark.parametrize("name", STOCH_FORMATS)
def test_stochastic_elemwise_gives_a_neighbour(name):
    rng = np.random.default_rng(2)
    g = O.grid(name)
    mids = O.f32((g.mags[:-1] + g.mags[1:]) / 2)
    x = np.concatenate([O.f32(rng.uniform(-g.max_norm, g.max_norm, 3000)), mids, -mids, O.f32(g.mags)])
    got = quantize_elemwise(_t(x), name, "stochastic", seed=3).numpy().astype(np.float64)
    lo, hi = O.neighbours(x, name)
    assert np.all((np.abs(got) == lo) | (np.abs(got) == hi)), name
    assert np.all((np.sign(got) == np.sign(x)) | (got == 0))
    on_grid = np.isin(np.abs(x.astype(np.float64)), g.mags)
    assert np.array_equal(got[on_grid], x[on_grid].astype(np.float64))  # grid points never move


@pytest.mark.parametrize("name", MX_FORMAT_NAMES)
def test_stochastic_mx_gives_a_neighbour(name):
    rng = np.random.default_rng(4)
    x = O.f32(rng.standard_normal((32, 64)) * np.exp2(rng.integers(-20, 20, (32, 1))))
    m = quantize_mx(_t(x), name, block_size=16, rounding="stochastic", seed=9)
    m_even = quantize_mx(_t(x), name, block_size=16)
    assert torch.equal(m.plane().scale, m_even.plane().scale)  # scale does not depend on rounding
    X = np.repeat(m.plane().scale.numpy().astype(np.int64) - 127, 16, axis=-1)
    y = x.astype(np.float64) * np.exp2(-X.astype(np.float64))
    q = m.dequantize().numpy().astype(np.float64) * np.exp2(-X.astype(np.float64))
    lo, hi = O.neighbours(y, name)
    assert np.all((np.abs(q) == lo) | (np.abs(q) == hi))


@pytest.mark.parametrize("name,value", [("fp4_e2m1", 2.3), ("fp4_e2m1", -0.7), ("fp8_e4m3", 1.01),
                                        ("fp8_e5m2", 3e-6), ("fp6_e3m2", 13.0), ("fp6_e2m3", 0.06),
                                        ("int8", 0.3), ("int4", -1.1), ("int2", 0.2),
                                        ("bfloat16", 1 + 2.0**-10), ("fp12", 100.3)])
def test_stochastic_elemwise_is_unbiased(name, value):
    n = 200_000
    v = float(np.float32(value))
    out = quantize_elemwise(torch.full((n,), v), name, "stochastic", seed=11).numpy().astype(np.float64)
    lo, hi = O.neighbours(np.array([v]), name)
    lo, hi = lo[0], hi[0]
    assert lo < abs(v) < hi
    p = (abs(v) - lo) / (hi - lo)
    sigma = (hi - lo) * np.sqrt(p * (1 - p) / n)
    assert abs(out.mean() - v) < 5 * sigma, (out.mean(), v, sigma)
    assert set(np.unique(np.abs(out))) == {lo, hi}


@pytest.mark.parametrize("name", MX_FORMAT_NAMES)
def test_stochastic_mx_is_unbiased(name):
    # blocks of [anchor, v, v, ...]: the anchor fixes X = 0 for floor scaling, v sits between grid points
    g = O.grid(name)
    anchor = 2.0**g.emax
    lo_i = len(g.mags) // 3
    v = float(np.float32(g.mags[lo_i] * 0.7 + g.mags[lo_i + 1] * 0.3))
    nblocks, bs = 4000, 32
    x = torch.full((nblocks, bs), v)
    x[:, 0] = anchor
    m = quantize_mx(x, name, block_size=bs, rounding="stochastic", seed=21)
    assert (m.plane().scale == 127).all()
    vals = m.dequantize()[:, 1:].numpy().astype(np.float64)
    lo, hi = g.mags[lo_i], g.mags[lo_i + 1]
    p = (v - lo) / (hi - lo)
    sigma = (hi - lo) * np.sqrt(p * (1 - p) / vals.size)
    assert abs(vals.mean() - v) < 5 * sigma
    assert set(np.unique(vals)) == {lo, hi}
