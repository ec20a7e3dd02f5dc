"""MX block quantization against an independent float64 reference (``oracles.mx_reference``).

The reference takes the shared exponent from ``frexp`` of the float64 amax (rceil:
``d`` from a numpy fp32 multiply, then an exact ceil(log2 d)), rounds every
scaled element by brute-force grid search and multiplies back by 2**X.
Scale bytes, codes and dequantized values must agree bit for bit on adversarial
blocks: amax one ulp under a power of two, ties at every grid point, element
subnormals, fp32 subnormals, saturation, zero / -0.0 / NaN / Inf blocks and the
ends of the E8M0 range.
"""

import zlib

import numpy as np
import pytest
import torch

from mxtrain.formats import MX_FORMAT_NAMES, parse_format
from mxtrain.quantization import fake_quantize_mx, quantize_mx, shared_exponent_bytes

import quant_oracles as O

SCALE_MODES = ("floor", "rceil", "even")
BS = 32


def _t(a):
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))


def _block(rng, amax, others, bs=BS):
    """A block whose largest magnitude is ``amax`` (placed at a random slot, random sign)."""
    row = np.asarray(others, dtype=np.float64)[:bs - 1]
    row = np.concatenate([row, np.zeros(bs - 1 - row.size)])
    row = np.insert(row, rng.integers(0, bs), amax * (1 if rng.random() < 0.5 else -1))
    return O.f32(row)


def _signs(rng, n):
    return np.where(rng.random(n) < 0.5, -1.0, 1.0)


def adversarial_blocks(name: str, rng: np.random.Generator) -> np.ndarray:
    """[nblocks, 32] fp32 blocks built to hit every edge of the contract for ``name``."""
    g = O.grid(name)
    m, emax = g.max_norm, g.emax
    rows = []

    def rand_below(a, n=BS - 1):
        return _signs(rng, n) * a * rng.random(n)

    # 1. amax at, one ulp under and one ulp over a power of two, over the whole fp32 range
    for k in list(range(-149, 128, 7)) + [-127, -126, -125, 0, 1, 126, 127]:
        p = O.f32(2.0**k)
        for a in (O.next_down(p), p, O.next_up(p)):
            if 0 < a < np.inf:
                rows.append(_block(rng, a, rand_below(a)))
    # 2. scale-mode boundaries: even-mode rounding point and rceil's amax = max_norm * 2**k
    for k in (-140, -127, -126, -60, -3, 0, 2, 9, 60, 100, 126 - emax):
        for a in (2.0**k * (2 - 2.0**-(g.mbits + 1)), m * 2.0**k, 2.0**k * 1.5):
            a = O.f32(a)
            for b in (O.next_down(a), a, O.next_up(a)):
                if 0 < b < np.inf:
                    rows.append(_block(rng, b, rand_below(b)))
    # 3. ties at every grid point after scaling, +-1 ulp, for a spread of shared exponents
    mids = (g.mags[:-1] + g.mags[1:]) / 2
    for X in (-127, -120, -10, 0, 7, 100, 127 - emax):
        scale = 2.0**X
        anchor = O.f32(2.0**emax * scale)  # makes floor-mode X exactly X
        cand = O.f32(np.concatenate([mids, g.mags]) * scale)
        cand = np.concatenate([cand, O.next_up(cand), O.next_down(cand)])
        cand = cand[np.isfinite(cand) & (cand > 0) & (cand <= anchor)]
        rng.shuffle(cand)
        for start in range(0, cand.size, BS - 1):
            chunk = cand[start:start + BS - 1]
            rows.append(_block(rng, anchor, _signs(rng, chunk.size) * chunk))
    # 4. element subnormals (and everything below the smallest one)
    for X in (-127, -50, 0, 90):
        anchor = O.f32(2.0**emax * 2.0**X)
        small = np.concatenate([g.mags[: 2 ** max(g.mbits, 1) + 1], mids[: 2 ** max(g.mbits, 1)],
                                [g.min_positive / 2, g.min_positive / 4, g.min_positive * 0.26]]) * 2.0**X
        small = O.f32(small)
        rows.append(_block(rng, anchor, _signs(rng, small.size) * small))
    # 5. fp32 subnormal inputs: all-subnormal blocks, and subnormals beside normals
    for top in (1, 2, 0x3F, 0x400000, 0x400001, 0x7FFFFF):
        bits = rng.integers(0, top + 1, BS).astype(np.uint32)
        bits[rng.integers(0, BS)] = top
        rows.append(O.f32_from_bits(bits) * O.f32(_signs(rng, BS)))
    rows.append(O.f32_from_bits(np.full(BS, 1, np.uint32)))
    sub = O.f32_from_bits(rng.integers(1, 0x800000, BS - 1).astype(np.uint32))
    rows.append(_block(rng, O.f32(2.0**-120), sub))
    rows.append(_block(rng, O.f32(2.0**-126), sub))
    # 6. saturation in floor mode: amax mantissa near 2
    for k in (-130, -100, -1, 0, 50, 127):
        for a in (O.next_down(O.f32(2.0 ** (k + 1))), O.f32(2.0**k * 1.99), O.f32(2.0**k * 1.76)):
            rows.append(_block(rng, a, rand_below(a)))
    # 7. zero and signed-zero blocks
    rows.append(np.zeros(BS, np.float32))
    rows.append(np.full(BS, -0.0, np.float32))
    z = np.zeros(BS, np.float32)
    z[::3] = -0.0
    z[5] = O.f32(2.0**-149)
    rows.append(z)
    # 8. scale-range edges: fp32 max, tiny amaxes (X clamped at -127), X reaching 127
    fmax = np.finfo(np.float32).max
    for a in (fmax, O.next_down(fmax), O.f32(2.0**127), O.f32(2.0**126 * m), O.f32(2.0**-127 * m),
              O.f32(2.0**-127), O.f32(2.0**-149)):
        if 0 < a < np.inf:
            rows.append(_block(rng, a, rand_below(a)))
            rows.append(_block(rng, a, np.full(BS - 1, a)))
    # 9. random blocks across the whole fp32 range, and with wide dynamic range inside a block
    for _ in range(40):
        k = rng.integers(-150, 128)
        vals = _signs(rng, BS) * np.exp2(k - rng.uniform(0, 30, BS)) * (1 + rng.random(BS))
        rows.append(O.f32(vals))
    bits = rng.integers(0, 0x7F800000, (20, BS)).astype(np.uint32)
    rows.extend(O.f32_from_bits(bits) * O.f32(_signs(rng, (20, BS))))
    x = np.stack(rows).astype(np.float32)
    x[x == np.inf] = np.finfo(np.float32).max  # overflowed constructions: keep them finite here
    x[x == -np.inf] = -np.finfo(np.float32).max
    return x


def _check_against_reference(x, name, scale_mode, rounding, block_size=BS, axis=-1, pack=True):
    ref = O.mx_reference(x, name, block_size, axis, scale_mode, rounding)
    xt = _t(x)
    m = quantize_mx(xt, name, block_size=block_size, axis=axis, scale_mode=scale_mode, rounding=rounding,
                    pack=pack)
    ax = axis % x.ndim
    plane = m.plane(ax)
    scale = plane.scale.numpy()
    assert scale.shape == ref.scale.shape
    bad = np.argwhere(scale != ref.scale)
    assert bad.size == 0, [(tuple(i), int(scale[tuple(i)]), int(ref.scale[tuple(i)])) for i in bad[:8]]
    codes = m.codes(ax).numpy().astype(np.int64)
    assert codes.shape == ref.codes.shape
    bad = np.argwhere(codes != ref.codes)
    assert bad.size == 0, [(tuple(i), int(codes[tuple(i)]), int(ref.codes[tuple(i)])) for i in bad[:8]]
    deq = m.dequantize(axis=ax).numpy()
    assert O.same_bits(deq, ref.values), O.mismatch_report(x, deq, ref.values)
    fake = fake_quantize_mx(xt, name, block_size=block_size, axis=axis, scale_mode=scale_mode,
                            rounding=rounding).numpy()
    assert O.same_bits(fake, ref.values), O.mismatch_report(x, fake, ref.values)
    return m, ref


@pytest.mark.parametrize("rounding", O.DETERMINISTIC_ROUNDINGS)
@pytest.mark.parametrize("scale_mode", SCALE_MODES)
@pytest.mark.parametrize("name", MX_FORMAT_NAMES)
def test_adversarial_blocks(name, scale_mode, rounding):
    rng = np.random.default_rng(zlib.crc32(f"{name}/{scale_mode}/{rounding}".encode()))
    x = adversarial_blocks(name, rng)
    _check_against_reference(x, name, scale_mode, rounding)


@pytest.mark.parametrize("scale_mode", SCALE_MODES)
@pytest.mark.parametrize("name", MX_FORMAT_NAMES)
def test_nan_and_inf_blocks(name, scale_mode):
    rng = np.random.default_rng(11)
    x = O.f32(rng.standard_normal((6, 3 * BS)))
    x[0, 3] = np.nan
    x[1, BS + 7] = np.inf
    x[2, 2 * BS] = -np.inf
    x[3, :BS] = np.nan
    x[4, 5], x[4, BS + 5], x[4, 2 * BS + 5] = np.inf, -np.inf, np.nan
    m, ref = _check_against_reference(x, name, scale_mode, "even")
    scale = m.plane().scale.numpy()
    nan_block = np.zeros((6, 3), bool)
    nan_block[0, 0] = nan_block[1, 1] = nan_block[2, 2] = nan_block[3, 0] = True
    nan_block[4, :] = True
    np.testing.assert_array_equal(scale == 0xFF, nan_block)
    deq = m.dequantize().numpy().reshape(6, 3, BS)
    assert np.isnan(deq[nan_block]).all()
    assert np.isfinite(deq[~nan_block]).all()
    assert (m.codes().numpy().reshape(6, 3, BS)[nan_block] == 0).all()
    # the other blocks are exactly what they are without the specials
    clean = quantize_mx(_t(np.where(np.isfinite(x), x, 0)), name, scale_mode=scale_mode).dequantize().numpy()
    assert O.same_bits(deq[~nan_block], clean.reshape(6, 3, BS)[~nan_block])


# ---------------------------------------------------------------------------------------------
# hand-worked cases: the rule, written out


def test_one_ulp_under_a_power_of_two_separates_the_scale_modes():
    a = O.next_down(O.f32(1.0))  # 0.99999994
    x = _t(np.array([a], np.float32))
    got = {mode: quantize_mx(x, "fp8_e4m3", block_size=1, scale_mode=mode) for mode in SCALE_MODES}
    # floor: X = floor(log2 a) - 8 = -9; a * 2**9 = 511.99997 saturates to 448
    assert got["floor"].plane().scale.item() == 127 - 9
    assert got["floor"].dequantize().item() == 448 * 2.0**-9
    # rceil: d = a * fp32(1/448) < 2**-8 -> X = -8 -> a * 2**8 = 255.99998 rounds to 256
    assert got["rceil"].plane().scale.item() == 127 - 8
    assert got["rceil"].dequantize().item() == 1.0
    # even: a rounded to 3 mantissa bits is 1.0 -> X = 0 - 8 = -8
    assert got["even"].plane().scale.item() == 127 - 8
    assert got["even"].dequantize().item() == 1.0


@pytest.mark.parametrize("name", MX_FORMAT_NAMES)
def test_zero_block_scale_follows_the_rule(name):
    emax = O.DOC_EMAX[name]
    x = torch.zeros(2, BS)
    x[1] = -0.0
    floor = quantize_mx(x, name, scale_mode="floor")
    # amax := 2**-126, X = -126 - emax clamped to -127
    assert floor.plane().scale.tolist() == [[127 + max(-126 - emax, -127)]] * 2
    assert quantize_mx(x, name, scale_mode="even").plane().scale.tolist() == [[127 + max(-126 - emax, -127)]] * 2
    # rceil: d = 0, ceil(log2 0) clamps to -127
    assert quantize_mx(x, name, scale_mode="rceil").plane().scale.tolist() == [[0]] * 2
    deq = floor.dequantize()
    assert torch.equal(deq, x) and (deq == 0).all()
    negative_zero_kept = torch.signbit(deq[1]).all().item()
    assert negative_zero_kept == parse_format(name).is_float  # ints have no -0


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
def test_scale_reaches_127(name):
    fmax = float(np.finfo(np.float32).max)
    x = torch.tensor([[fmax, -2.0**127, 1.0, 0.0]])
    m = quantize_mx(x, name, block_size=4, scale_mode="floor")
    assert m.plane().scale.item() == 254  # floor(log2) - emax = 127 - 0
    if name == "int2":
        r = quantize_mx(x, name, block_size=4, scale_mode="rceil")
        assert r.plane().scale.item() == 254  # ceil(log2 fmax) = 128 clamps to 127: saturates
        assert r.dequantize()[0, :2].tolist() == [2.0**127, -2.0**127]


@pytest.mark.parametrize("name", MX_FORMAT_NAMES)
def test_scale_clamps_at_minus_127(name):
    x = torch.tensor([[2.0**-149, 2.0**-140, -(2.0**-130), 0.0]])
    for mode in SCALE_MODES:
        assert quantize_mx(x, name, block_size=4, scale_mode=mode).plane().scale.item() == 0


@pytest.mark.parametrize("scale_mode", SCALE_MODES)
@pytest.mark.parametrize("name", MX_FORMAT_NAMES)
def test_shared_exponent_bytes_on_every_exponent(name, scale_mode):
    """The public scale function on amaxes at, under and over every power of two and mantissa edge."""
    fmt = parse_format(name)
    g = O.grid(name)
    p = O.f32(np.exp2(np.arange(-149, 128, dtype=np.float64)))
    edge = O.f32(p * (2 - 2.0**-(g.mbits + 1)))
    with np.errstate(over="ignore"):
        amax = np.concatenate([p, O.next_down(p), O.next_up(p), edge, O.next_down(edge), O.next_up(edge),
                               p * O.f32(g.max_norm), [0.0, np.finfo(np.float32).max]])
    amax = O.f32(amax[np.isfinite(amax)])
    got = shared_exponent_bytes(torch.from_numpy(amax.view(np.int32).copy()), fmt, scale_mode).numpy()
    want = np.clip(O.shared_exponent(amax.astype(np.float64), name, scale_mode), -127, 127) + 127
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, [(float(amax[i]), int(got[i]), int(want[i])) for i in bad[:8]]
    specials = O.f32([np.inf, np.nan]).view(np.int32)
    assert shared_exponent_bytes(torch.from_numpy(specials.copy()), fmt, scale_mode).tolist() == [255, 255]


# ---------------------------------------------------------------------------------------------
# layout: block sizes, ragged blocks, every axis, several planes, half-precision inputs


def _mixed(rng, shape):
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-40, 40, shape))
    x[rng.random(shape) < 0.05] = 0.0
    return O.f32(x)


@pytest.mark.parametrize("block_size,length", [(1, 12), (2, 12), (32, 96), (0, 40), (8, 37), (32, 5),
                                               (4, 12), (6, 12), (16, 20)])
@pytest.mark.parametrize("name", MX_FORMAT_NAMES)
def test_block_sizes_and_ragged_blocks(name, block_size, length):
    rng = np.random.default_rng(block_size * 1000 + length)
    x = _mixed(rng, (3, length))
    x[1, -1] = np.nan
    bs = block_size or length
    padded = -(-length // bs) * bs
    group = {4: 2, 2: 4, 6: 4}.get(parse_format(name).bits, 1)
    pack = padded % group == 0
    for mode, rounding in (("floor", "even"), ("rceil", "nearest"), ("even", "floor")):
        m, ref = _check_against_reference(x, name, mode, rounding, block_size=block_size, pack=pack)
        assert m.plane().scale.shape == (3, -(-length // bs))
        assert m.codes().shape == (3, padded)
        assert (m.codes().numpy()[:, length:] == 0).all()  # the zero padding is stored as code 0


@pytest.mark.parametrize("name", MX_FORMAT_NAMES)
def test_every_axis_of_a_3d_tensor(name):
    rng = np.random.default_rng(42)
    x = _mixed(rng, (5, 6, 8))
    x[2, 3, 4] = -np.inf
    for axis in (0, 1, 2, -1, -2, -3):
        _check_against_reference(x, name, "floor", "even", block_size=4, axis=axis, pack=name[:3] != "fp6"
                                 or x.shape[axis] % 4 == 0)
        _check_against_reference(x, name, "rceil", "nearest", block_size=3, axis=axis, pack=False)
    m = quantize_mx(_t(x), name, block_size=4, axis=(0, 1, 2), pack=False)
    for axis in range(3):
        ref = O.mx_reference(x, name, 4, axis)
        assert np.array_equal(m.plane(axis).scale.numpy(), ref.scale)
        assert O.same_bits(m.dequantize(axis=axis).numpy(), ref.values)
        assert m.plane(axis).data.shape[:-1] == np.moveaxis(x, axis, -1).shape[:-1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale_mode", SCALE_MODES)
@pytest.mark.parametrize("name", MX_FORMAT_NAMES)
def test_half_inputs_equal_their_fp32_upcast(name, scale_mode, dtype):
    rng = np.random.default_rng(8)
    x = _t(rng.standard_normal((4, 64)) * np.exp2(rng.integers(-30, 16, (4, 1)))).to(dtype)
    x[0, 3] = float("nan")
    x[1, :32] = 0.0
    x[2, 5] = -0.0
    m = quantize_mx(x, name, scale_mode=scale_mode)
    m32 = quantize_mx(x.float(), name, scale_mode=scale_mode)
    assert torch.equal(m.plane().scale, m32.plane().scale)
    assert torch.equal(m.plane().data, m32.plane().data)
    deq = m.dequantize()
    assert deq.dtype == dtype
    want = m32.dequantize().to(dtype)
    assert O.same_bits(deq.float().numpy(), want.float().numpy())
    fake = fake_quantize_mx(x, name, scale_mode=scale_mode)
    assert fake.dtype == dtype and O.same_bits(fake.float().numpy(), want.float().numpy())
