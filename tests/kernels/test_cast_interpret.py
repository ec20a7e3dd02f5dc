"""The Triton MX cast against the reference quantize_mx: bit-exact codes and scale bytes.

Runs on Triton's CPU interpreter where there is no CUDA (conftest sets
TRITON_INTERPRET=1), compiled on the GPU otherwise. Shapes stay small: the
interpreter is slow. Large shapes are in tests/gpu/test_kernels_gpu.py.
"""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from kernel_helpers import adversarial_matrix, as_dtype, planes_equal  # noqa: E402

from mxtrain.formats import MX_FORMAT_NAMES, parse_format  # noqa: E402
from mxtrain.kernels import cast  # noqa: E402
from mxtrain.kernels.dispatch import quantize  # noqa: E402
from mxtrain.quantization import quantize_mx  # noqa: E402

DETERMINISTIC = ("even", "nearest", "floor")


def check(x, fmt, **kw):
    got = cast.triton_quantize(x, fmt, **kw)
    want = quantize_mx(x.cpu(), fmt, **kw)
    problems = planes_equal(got, want)
    assert not problems, f"{fmt} {kw}: " + "; ".join(problems)
    return got


@pytest.mark.parametrize("fmt", MX_FORMAT_NAMES)
@pytest.mark.parametrize("scale_mode", ("floor", "rceil", "even"))
def test_both_planes_adversarial_fp32(kdevice, fmt, scale_mode):
    """64x96 adversarial fp32 (subnormals, ties, NaN/Inf/zero blocks, saturation), every deterministic rounding."""
    x = adversarial_matrix(64, 96, seed=1).to(kdevice)
    for rounding in DETERMINISTIC:
        check(x, fmt, block_size=32, axis=(-1, 0), scale_mode=scale_mode, rounding=rounding)


@pytest.mark.parametrize("fmt", MX_FORMAT_NAMES)
def test_ragged_both_planes(kdevice, fmt):
    """40x72: ragged last block in both orientations (zero-padded, the padding stored)."""
    x = adversarial_matrix(40, 72, seed=2).to(kdevice)
    for scale_mode, rounding in (("floor", "even"), ("rceil", "nearest"), ("even", "floor")):
        got = check(x, fmt, block_size=32, axis=(1, 0), scale_mode=scale_mode, rounding=rounding)
    assert [p.axis for p in got.planes] == [1, 0]


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("fmt", ("fp8_e4m3", "fp8_e5m2", "fp6_e2m3", "fp4_e2m1", "int8", "int2"))
def test_half_inputs(kdevice, fmt, dtype):
    x = as_dtype(adversarial_matrix(40, 72, seed=3), dtype).to(kdevice)
    check(x, fmt, block_size=32, axis=(-1, 0), scale_mode="floor", rounding="even")
    check(x, fmt, block_size=32, axis=(-1, 0), scale_mode="rceil", rounding="nearest")


def test_special_blocks(kdevice):
    """NaN/Inf blocks: scale 0xFF and codes 0; zero block: the 2**-126 rule; -0.0 keeps its sign bit."""
    x = torch.zeros(32, 64)
    x[0, 0] = float("nan")
    x[1, 33] = float("-inf")
    x[2, :32] = -0.0
    x[3, :32] = 2.0**-149  # smallest fp32 subnormal
    x[4, :32] = torch.linspace(-1e-40, 1e-40, 32)
    x = x.to(kdevice)
    for fmt in MX_FORMAT_NAMES:
        got = check(x, fmt, block_size=32, axis=(-1, 0))
        row = got.rowwise
        assert row.scale[0, 0].item() == 0xFF and row.scale[1, 1].item() == 0xFF
    got = cast.triton_quantize(x, "fp8_e4m3", axis=-1)
    assert got.rowwise.data[2, :32].eq(0x80).all()
    assert got.rowwise.data[0, :32].eq(0).all()


@pytest.mark.parametrize("bs", (2, 4, 8, 16, 64, 128))
def test_block_sizes(kdevice, bs):
    x = adversarial_matrix(40, 136, seed=bs, block=min(bs, 32)).to(kdevice)
    for fmt in ("fp8_e4m3", "fp4_e2m1", "int2") + (("fp6_e3m2",) if bs >= 4 else ()):
        check(x, fmt, block_size=bs, axis=(-1, 0), scale_mode="floor", rounding="nearest")


def test_unpacked_codes(kdevice):
    x = adversarial_matrix(40, 72, seed=5).to(kdevice)
    for fmt in ("fp6_e3m2", "fp4_e2m1", "int4", "int2"):
        check(x, fmt, block_size=32, axis=(-1, 0), pack=False)


def test_single_planes_and_nd(kdevice):
    x2 = adversarial_matrix(40, 72, seed=6).to(kdevice)
    check(x2, "fp8_e4m3", axis=0)                   # columnwise only
    check(x2, "fp4_e2m1", axis=-1)                  # rowwise only
    check(x2, "int8", axis=(0, 1))                  # plane order follows the axes
    x3 = adversarial_matrix(24, 96, seed=7).reshape(4, 6, 96).to(kdevice)
    check(x3, "fp6_e2m3", axis=-1)                  # ND rowwise: leading dims flattened
    check(x3, "fp8_e5m2", axis=(2, 0))              # ND: last axis and first axis
    x1 = adversarial_matrix(1, 200, seed=8).reshape(200).to(kdevice)
    check(x1, "fp4_e2m1", axis=0)                   # 1-D
    xt = adversarial_matrix(72, 40, seed=9).to(kdevice).t()  # non-contiguous input
    check(xt, "fp8_e4m3", axis=(-1, 0))


def test_fallbacks_match_reference(kdevice):
    """Cases the kernel does not take go to the reference (same bits, by construction)."""
    x = adversarial_matrix(8, 48, seed=10).to(kdevice)
    assert cast._fallback_reason(x, parse_format("fp8_e4m3"), 0, (1,), True) is not None
    assert cast._fallback_reason(x, parse_format("fp8_e4m3"), 32, (1,), True) is None
    check(x, "fp8_e4m3", block_size=0, axis=-1)     # whole axis
    check(x, "fp8_e4m3", block_size=24, axis=-1)    # not a power of two
    x3 = adversarial_matrix(24, 32, seed=11).reshape(4, 6, 32).to(kdevice)
    check(x3, "int4", axis=1)                       # middle axis


def test_dispatch_backend_triton(kdevice):
    x = adversarial_matrix(40, 72, seed=12).to(kdevice)
    got = quantize(x, "fp8_e4m3", axis=(-1, 0), backend="triton")
    want = quantize(x.cpu(), "fp8_e4m3", axis=(-1, 0), backend="reference")
    assert not planes_equal(got, want)


def test_argument_errors_match_reference(kdevice):
    x = torch.randn(8, 32, device=kdevice)
    with pytest.raises(ValueError):
        cast.triton_quantize(x, "fp9")
    with pytest.raises(ValueError):
        cast.triton_quantize(x, "fp8_e4m3", rounding="up")
    with pytest.raises(TypeError):
        cast.triton_quantize(x.double(), "fp8_e4m3")
    with pytest.raises(ValueError):
        cast.triton_quantize(x, "fp8_e4m3", axis=(1, 1))


# ---------------------------------------------------------------- stochastic rounding (statistical)

def test_stochastic_rounding_statistics(kdevice):
    """Unbiased, always one of the two neighbouring grid points, reproducible per seed.

    The kernel's Philox bits are not the reference's torch.rand bits, so this
    is a statistical test, not a bit-exact one.
    """
    fmt = "fp4_e2m1"
    # each block holds its amax 6.0 (scale 2**0 with floor: 6 -> X = 2 - 2 = 0) and values between grid points
    fracs = torch.tensor([0.125, 0.25, 0.5, 0.75])
    lo = torch.tensor([1.0, 2.0, 3.0, 4.0])  # grid neighbours: 1-1.5 (step .5), 2-3, 3-4, 4-6
    hi = torch.tensor([1.5, 3.0, 4.0, 6.0])
    vals = lo + fracs * (hi - lo)
    x = vals.repeat_interleave(8).repeat(128, 8)  # [128, 256], blocks of 32: 8 of each value
    x[:, ::32] = 6.0
    x = x.to(kdevice)
    a = cast.triton_quantize(x, fmt, axis=-1, rounding="stochastic", seed=1234)
    b = cast.triton_quantize(x, fmt, axis=-1, rounding="stochastic", seed=1234)
    c = cast.triton_quantize(x, fmt, axis=-1, rounding="stochastic", seed=99)
    assert not planes_equal(a, b), "same seed must give the same bits"
    assert planes_equal(a, c), "different seeds should give different bits"
    deq = a.dequantize(torch.float32).cpu()
    xc = x.cpu()
    lo_full, hi_full = [t.repeat_interleave(8).repeat(128, 8) for t in (lo, hi)]
    lo_full[:, ::32] = hi_full[:, ::32] = 6.0
    assert ((deq == lo_full) | (deq == hi_full)).all(), "a value rounded to a non-neighbour grid point"
    # unbiased: the mean of each value class matches the input (binomial std ~ 0.01 relative)
    for i in range(4):
        sel = (xc == vals[i])
        mean = deq[sel].mean().item()
        n = sel.sum().item()
        p = fracs[i].item()
        tol = 5 * (hi[i] - lo[i]).item() * (p * (1 - p) / n) ** 0.5
        assert abs(mean - vals[i].item()) < tol, (i, mean, vals[i].item(), tol)
    # both planes, one call: each plane is a valid stochastic rounding too
    both = cast.triton_quantize(x[:64, :64].contiguous(), "int8", axis=(-1, 0), rounding="stochastic", seed=7)
    ref_floor = quantize_mx(x[:64, :64].cpu(), "int8", axis=(-1, 0), rounding="floor")
    for pk, pf in zip(both.planes, ref_floor.planes):
        assert torch.equal(pk.scale.cpu(), pf.scale)


def test_stochastic_seed_none_and_generator(kdevice):
    x = torch.randn(32, 64).to(kdevice)
    torch.manual_seed(5)
    a = cast.triton_quantize(x, "fp6_e3m2", axis=(-1, 0), rounding="stochastic")
    torch.manual_seed(5)
    b = cast.triton_quantize(x, "fp6_e3m2", axis=(-1, 0), rounding="stochastic")
    assert not planes_equal(a, b)
    g1 = torch.Generator(device=kdevice).manual_seed(3)
    g2 = torch.Generator(device=kdevice).manual_seed(3)
    a = cast.triton_quantize(x, "fp6_e3m2", rounding="stochastic", seed=g1)
    b = cast.triton_quantize(x, "fp6_e3m2", rounding="stochastic", seed=g2)
    assert not planes_equal(a, b)
    with pytest.raises(TypeError):
        cast.triton_quantize(x, "fp6_e3m2", rounding="stochastic", seed=1.5)


# ---------------------------------------------------------------- modules through the kernels

@pytest.mark.parametrize("recipe", ("MXFP8Recipe", "MXFP4Recipe"))
def test_layernorm_mlp_kernel_casts_match_reference(kdevice, monkeypatch, recipe, mx_config):
    """LayerNormMLP forward + backward with every cast on the kernel == with the reference casts, bit for bit.

    ``MXTRAIN_BACKEND=triton`` sends the casts to the kernels; the GEMMs stay on the
    reference (pinned here, so a registered GPU GEMM does not enter the comparison).
    """
    import mxtrain
    from mxtrain.kernels import dispatch

    dispatch._load_kernels()  # register first, then pin the GEMM table (a later import would refill it)
    monkeypatch.setattr(dispatch, "_GEMM_IMPLS", {})
    torch.manual_seed(0)
    m = mxtrain.LayerNormMLP(64, 96, activation="swiglu", normalization="RMSNorm").to(kdevice)
    x = (torch.randn(2, 16, 64) * 2).to(kdevice)
    dy = torch.randn(2, 16, 64).to(kdevice)
    # deterministic gradients (MXFP4Recipe rounds them stochastically by default; the two paths draw differently)
    rec = getattr(mxtrain, recipe)(grad_rounding=None)

    def run(backend):
        mx_config(backend=backend)
        m.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        with mxtrain.mx_autocast(recipe=rec):
            y = m(xi)
        y.backward(dy)
        return y.detach(), xi.grad, {n: p.grad.clone() for n, p in m.named_parameters()}

    y_k, dx_k, g_k = run("triton")
    y_r, dx_r, g_r = run("reference")
    assert torch.equal(y_k, y_r) and torch.equal(dx_k, dx_r)
    for n in g_r:
        assert torch.equal(g_k[n], g_r[n]), n
