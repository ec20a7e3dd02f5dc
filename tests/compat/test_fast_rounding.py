"""The fast CPU rounding paths give the reference quantizers' exact bits, on random and adversarial values."""

import math

import pytest
import torch

from mxtrain.elementwise import rounding as fast_rounding
from mxtrain.elementwise import fake_quantize_mx_floor, round_elemwise
from mxtrain.formats import parse_format
from mxtrain.quantization import fake_quantize_mx, lut, quantize_elemwise


def adversarial(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-40, 40, (n,), generator=g).float())
    k = n // 4  # random bit patterns: subnormals, NaN payloads, huge values
    x[:k] = torch.randint(-2**31, 2**31 - 1, (k,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    # values one ulp around powers of two and around ties of a 7- and 3-bit mantissa
    m = k // 4
    p = torch.exp2(torch.randint(-20, 20, (m,), generator=g).float())
    x[k:k + m] = torch.nextafter(p, torch.zeros_like(p))
    t = (1 + (2 * torch.randint(0, 64, (m,), generator=g).float() + 1) / 256) * p
    x[k + m:k + 2 * m] = torch.nextafter(t, torch.zeros_like(t))
    x[-10:] = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45, -1e-40, 65519.0, 65520.0, -3.4e38])
    return x


def bits_equal(a, b):
    nan = a.isnan() | b.isnan()
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.view(torch.int32)[~nan], b.view(torch.int32)[~nan])


@pytest.fixture(params=["branch", "select"])
def mode(request, monkeypatch):
    """The CPU's data-dependent branches, and the GPU's sync-free selects (forced on the CPU)."""
    monkeypatch.setattr(fast_rounding, "FORCE_SELECT", request.param == "select")
    return request.param


@pytest.mark.parametrize("rounding", ["even", "nearest", "floor"])
@pytest.mark.parametrize("fmt", ["bfloat16", "bfloat12", "bfloat10", "fp16", "fp12", "fp10", "fp8", "fp7", "fp24",
                                 "fp32"])
def test_elemwise_bits(fmt, rounding, mode):
    x = adversarial(40000)
    assert bits_equal(round_elemwise(x, fmt, rounding), quantize_elemwise(x, fmt, rounding))


def test_elemwise_fallbacks():
    x = adversarial(4000)
    assert bits_equal(round_elemwise(x, "bfloat16", "nearest", subnormals=False),
                      quantize_elemwise(x, "bfloat16", "nearest", subnormals=False))
    xh = x.to(torch.float16)
    assert torch.equal(round_elemwise(xh, "fp10", "even").isnan(), quantize_elemwise(xh, "fp10", "even").isnan())


GEOMETRIES = [((64, 100), -1, 32), ((8, 16, 5, 5), 1, 32), ((8, 70, 3), 1, 32), ((8, 64, 3), 0, 32),
              ((5, 33), -1, 0), ((6, 7, 8), 1, 4), ((3, 40), 1, 1)]


def _reference_fake_quantize(x, fmt, bs, axis, rounding, monkeypatch):
    """fake_quantize_mx on the reference's own chunk functions (the CPU lookup tables off)."""
    with monkeypatch.context() as m:
        m.setattr(lut, "USE_LOOKUP_TABLES", False)
        return fake_quantize_mx(x, fmt, bs, axis, "floor", rounding)


@pytest.mark.parametrize("rounding", ["even", "nearest", "floor"])
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2", "fp6_e3m2", "fp6_e2m3", "fp4_e2m1", "int8", "int4", "int2"])
def test_mx_bits(fmt, rounding, monkeypatch):
    """The one CPU path (the lookup tables behind fake_quantize_mx) against the reference, in every geometry."""
    for shape, axis, bs in GEOMETRIES:
        for scale in (1.0, 1e-38, 1e30):
            x = adversarial(math.prod(shape), seed=len(shape)).view(shape) * scale
            ours = fake_quantize_mx_floor(x, parse_format(fmt), bs, axis, rounding)
            ref = _reference_fake_quantize(x, fmt, bs, axis, rounding, monkeypatch)
            assert bits_equal(ours, ref), (fmt, rounding, shape, axis, bs, scale)


@pytest.mark.parametrize("rounding", ["even", "nearest", "floor"])
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp6_e2m3", "fp4_e2m1", "int8", "int2"])
def test_mx_microxcaling_scale_options_round_as_the_reference(fmt, rounding, monkeypatch):
    """With scale_bits / flush on, blocks those options leave alone get the reference's bits."""
    x = adversarial(64 * 96).view(64, 96)
    x[0] = torch.linspace(-1e-39, 1e-39, 96)  # fp32 subnormal blocks: flushed
    ref = _reference_fake_quantize(x, fmt, 32, -1, rounding, monkeypatch)
    flushed = fake_quantize_mx_floor(x, parse_format(fmt), 32, -1, rounding, flush_fp32_subnorms=True)
    assert torch.all(flushed[0] == 0) and bits_equal(flushed[1:], ref[1:])
    y = torch.randn(16, 64) * 4  # shared exponents well inside [-15, 15]
    assert bits_equal(fake_quantize_mx_floor(y, parse_format(fmt), 32, -1, rounding, scale_bits=5),
                      _reference_fake_quantize(y, fmt, 32, -1, rounding, monkeypatch))


def test_mx_low_precision_inputs_and_stochastic():
    x = torch.randn(8, 64)
    for dtype in (torch.bfloat16, torch.float16):
        xd = x.to(dtype)
        assert torch.equal(fake_quantize_mx_floor(xd, parse_format("fp8_e4m3"), 32, -1, "even"),
                           fake_quantize_mx(xd, "fp8_e4m3", 32, -1, "floor", "even"))
    a = fake_quantize_mx_floor(x, parse_format("int8"), 32, -1, "stochastic")
    assert a.shape == x.shape


def test_mx_scale_bits_and_flush():
    x = torch.randn(4, 32) * torch.tensor([[1e-40], [1.0], [1e10], [1e-20]])
    fmt = parse_format("fp8_e4m3")
    flushed = fake_quantize_mx_floor(x, fmt, 32, -1, "nearest", flush_fp32_subnorms=True)
    assert torch.all(flushed[0] == 0) and torch.equal(flushed[1:], fake_quantize_mx_floor(x, fmt, 32, -1, "nearest")[1:])
    small = fake_quantize_mx_floor(x, fmt, 32, -1, "nearest", scale_bits=5)  # exponents in [-15, 15]
    assert torch.isnan(small[2]).all()  # 1e10 needs 2**25: NaN, as microxcaling
    assert (small[3].abs() <= 448 * 2.0**-15).all()
