"""Norm + cast and activation + cast kernels: codes bit-exact vs the reference cast of the kernel's own
output, the output itself close to torch's op (see the tolerance notes in the kernel modules)."""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from kernel_helpers import planes_equal  # noqa: E402

from mxtrain.kernels.activation_cast import (  # noqa: E402
    ACTIVATION_IDS, GRAD_FUSED, activation_backward_cast, activation_cast, torch_activation,
)
from mxtrain.modules.activations import activation_backward  # noqa: E402
from mxtrain.kernels.norm_cast import norm_cast, torch_norm  # noqa: E402
from mxtrain.quantization import quantize_mx  # noqa: E402

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2**-7, atol=1e-5),
       torch.float16: dict(rtol=2**-9, atol=1e-5)}


def assert_codes_match_own_output(mxt, out, fmt, **kw):
    ref = quantize_mx(out.cpu(), fmt, **kw)
    problems = planes_equal(mxt, ref)
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("kind", ("LayerNorm", "RMSNorm"))
def test_norm_cast(kdevice, kind, dtype):
    g = torch.Generator().manual_seed(0)
    for (m, k), fmt, zc in (((64, 96), "fp8_e4m3", False), ((40, 600), "fp4_e2m1", True)):
        x = (torch.randn(m, k, generator=g) * 2 + 0.5).to(dtype).to(kdevice)
        w = (torch.randn(k, generator=g) * 0.5 + (0 if zc else 1)).to(dtype).to(kdevice)
        b = (torch.randn(k, generator=g) * 0.2).to(dtype).to(kdevice) if kind == "LayerNorm" else None
        for axis, mode in (((-1, 0), "floor"), (-1, "rceil"), (0, "even")):
            r = norm_cast(x, w, b, kind=kind, eps=1e-5, zero_centered_gamma=zc, fmt=fmt, axis=axis, scale_mode=mode,
                          return_output=True)
            assert_codes_match_own_output(r.mx, r.out, fmt, axis=axis, scale_mode=mode)
            want = torch_norm(x.cpu(), w.cpu(), None if b is None else b.cpu(), kind, 1e-5, zc)
            torch.testing.assert_close(r.out.cpu().float(), want.float(), **TOL[dtype])
            xf = x.cpu().float()
            if kind == "LayerNorm":
                var, mean = torch.var_mean(xf, -1, unbiased=False)
                torch.testing.assert_close(r.mean.cpu(), mean, rtol=1e-5, atol=1e-6)
            else:
                var = xf.square().mean(-1)
                assert r.mean is None
            torch.testing.assert_close(r.rstd.cpu(), torch.rsqrt(var + 1e-5), rtol=1e-5, atol=0)
    # without return_output the planes are the same
    r2 = norm_cast(x, w, b, kind=kind, zero_centered_gamma=zc, fmt="fp4_e2m1", axis=0, scale_mode="even")
    assert not planes_equal(r2.mx, r.mx) and r2.out is None


def test_norm_cast_3d_rowwise_and_fallback(kdevice):
    x = torch.randn(2, 20, 64).to(kdevice)
    w = torch.rand(64).to(kdevice) + 0.5
    r = norm_cast(x, w, None, kind="RMSNorm", fmt="int8", axis=-1, return_output=True)
    assert r.mx.shape == (2, 20, 64)
    assert_codes_match_own_output(r.mx, r.out, "int8", axis=-1)
    r = norm_cast(x, w, None, kind="RMSNorm", fmt="int8", block_size=0, axis=-1, return_output=True)  # fallback
    assert_codes_match_own_output(r.mx, r.out, "int8", block_size=0, axis=-1)
    with pytest.raises(ValueError):
        norm_cast(x, w, w, kind="RMSNorm")


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("act", tuple(ACTIVATION_IDS))
def test_activation_cast(kdevice, act, dtype):
    g = torch.Generator().manual_seed(1)
    gated = ACTIVATION_IDS[act] >= 6
    h = (torch.randn(40, 144 if gated else 72, generator=g) * 3).to(dtype)
    h[3, 5] = float("nan")
    h = h.to(kdevice)
    for fmt, axis, rounding in (("fp8_e4m3", (-1, 0), "even"), ("fp6_e3m2", (0, 1), "nearest")):
        mxt, out = activation_cast(h, act, fmt, axis=axis, rounding=rounding, return_output=True)
        assert out.shape == (40, 72) and mxt.shape == (40, 72)
        assert_codes_match_own_output(mxt, out, fmt, axis=axis, rounding=rounding)
        want = torch_activation(h.cpu(), act)
        # erf/exp differ from torch's by fp32 ulps of the *input* scale (cancellation near gelu(x) ~ 0)
        tol = dict(TOL[dtype], atol=2e-5) if dtype == torch.float32 else TOL[dtype]
        if gated and dtype != torch.float32:  # act(gate) rounded to the dtype, then the product: two ulps
            tol = dict(tol, rtol=2 * tol["rtol"])
        torch.testing.assert_close(out.cpu().float(), want.float(), equal_nan=True, **tol)
        if act in ("relu", "squared_relu", "reglu"):  # exact ops: bit-identical to torch
            assert torch.equal(out.cpu().nan_to_num(), want.nan_to_num())
    mxt2 = activation_cast(h, act, "fp6_e3m2", axis=(0, 1), rounding="nearest")
    assert not planes_equal(mxt2, mxt)


def test_activation_cast_nd_and_errors(kdevice):
    h = torch.randn(2, 10, 64).to(kdevice)
    mxt, out = activation_cast(h, "swiglu", "fp4_e2m1", axis=-1, return_output=True)
    assert mxt.shape == (2, 10, 32)
    assert_codes_match_own_output(mxt, out, "fp4_e2m1", axis=-1)
    mxt, out = activation_cast(h, "gelu", "fp4_e2m1", axis=(-1, 0), return_output=True)  # 3-D both: fallback
    assert_codes_match_own_output(mxt, out, "fp4_e2m1", axis=(-1, 0))
    with pytest.raises(ValueError):
        activation_cast(torch.randn(4, 7).to(kdevice), "swiglu", "fp8_e4m3")
    with pytest.raises(ValueError):
        activation_cast(h, "tanh", "fp8_e4m3")


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("act", tuple(ACTIVATION_IDS))
def test_activation_backward_cast(kdevice, monkeypatch, act, dtype):
    """dh = grad * act'(h), every activation in the kernel (gated: [d_gate, d_up] over 2N columns, a
    columnwise tile straddling the halves): codes bit-exact vs the reference cast of the kernel's own dh,
    dh within an ulp of torch's backward, the fused bias sum that dh's, and values = codes dequantized."""
    import mxtrain.modules.activations as acts

    assert act in GRAD_FUSED
    monkeypatch.setattr(acts, "activation_backward", lambda *a: pytest.fail("fell back to torch's backward"))
    gated = ACTIVATION_IDS[act] >= 6
    g = torch.Generator().manual_seed(5)
    h = (torch.randn(70, 96, generator=g) * 3).to(dtype)  # 70 rows: a ragged columnwise block
    grad = torch.randn(70, 48 if gated else 96, generator=g).to(dtype)
    h[3, 5], h[7, 0], grad[9, 9] = float("nan"), 0.0, float("inf")
    h[11, 40], h[11, 88], h[12, 0] = -0.0, 2.5, -0.0  # gated: gate -0 in row 11 (its up at 88), relu's -0
    h, grad = h.to(kdevice), grad.to(kdevice)
    want = activation_backward(h.cpu(), grad.cpu(), act)
    for fmt, axis, mode in (("fp8_e4m3", (-1, 0), "rceil"), ("fp4_e2m1", (0, 1), "floor")):
        r = activation_backward_cast(h, grad, act, fmt, axis=axis, scale_mode=mode, return_output=True, dbias=True)
        assert r.out.shape == h.shape and r.dbias.shape == (96,) and r.dbias.dtype == torch.float32
        assert_codes_match_own_output(r.mx, r.out, fmt, axis=axis, scale_mode=mode)
        tol = dict(TOL[dtype], atol=2e-5) if dtype == torch.float32 else TOL[dtype]
        torch.testing.assert_close(r.out.cpu().float(), want.float(), equal_nan=True, **tol)
        if act == "relu":  # an exact op: bit-identical to torch
            assert torch.equal(r.out.cpu().nan_to_num(), want.nan_to_num())
        torch.testing.assert_close(r.dbias.cpu(), r.out.cpu().float().sum(0), rtol=1e-5, atol=1e-5, equal_nan=True)
    # values and codes from one pass: the values are the codes dequantized
    r = activation_backward_cast(h, grad, act, "fp8_e5m2", axis=(-1, 0), dequantized=(-1, 0), keep_codes=0)
    ref = activation_backward_cast(h, grad, act, "fp8_e5m2", axis=(-1, 0))
    assert [p.axis for p in r.mx.planes] == [0] and r.dbias is None and r.out is None
    for axis in (1, 0):
        assert torch.equal(r.mx.dequantized_values(axis).cpu().float().nan_to_num(),
                           ref.mx.dequantize(torch.bfloat16, axis).cpu().float().nan_to_num())


def test_activation_backward_cast_reuses_the_gradient(kdevice):
    """reuse_grad: dh's rowwise values overwrite grad (the caller's temporary), same bits as a fresh buffer."""
    g = torch.Generator().manual_seed(6)
    h = (torch.randn(96, 128, generator=g) * 3).to(torch.bfloat16).to(kdevice)
    grad = torch.randn(96, 128, generator=g).to(torch.bfloat16).to(kdevice)
    kw = dict(axis=(-1, 0), dequantized=(-1, 0), keep_codes=(), dbias=True)
    ref = activation_backward_cast(h, grad.clone(), "gelu", "fp8_e4m3", **kw)
    g2 = grad.clone()
    r = activation_backward_cast(h, g2, "gelu", "fp8_e4m3", reuse_grad=True, **kw)
    row = r.mx.dequantized_values(1)
    assert row.data_ptr() == g2.data_ptr()  # the values live in the gradient's memory
    for axis in (1, 0):
        got, want = r.mx.dequantized_values(axis), ref.mx.dequantized_values(axis)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert torch.equal(r.dbias, ref.dbias)
    # nothing to reuse when the rowwise plane is not asked for as values: grad is left alone
    g3 = grad.clone()
    activation_backward_cast(h, g3, "gelu", "fp8_e4m3", axis=0, dequantized=0, reuse_grad=True)
    assert torch.equal(g3, grad)


def test_activation_backward_cast_nd_and_errors(kdevice):
    h, grad = torch.randn(2, 10, 64).to(kdevice), torch.randn(2, 10, 64).to(kdevice)
    r = activation_backward_cast(h, grad, "silu", "fp6_e2m3", axis=-1, return_output=True, dbias=True)
    assert r.mx.shape == (2, 10, 64)
    assert_codes_match_own_output(r.mx, r.out, "fp6_e2m3", axis=-1)
    torch.testing.assert_close(r.dbias.cpu(), r.out.cpu().reshape(-1, 64).sum(0), rtol=1e-5, atol=1e-5)
    assert set(GRAD_FUSED) <= set(ACTIVATION_IDS)
    with pytest.raises(ValueError, match="grad must match act"):
        activation_backward_cast(h, grad[:, :5], "gelu", "fp8_e4m3")
    with pytest.raises(ValueError, match="grad must match act"):
        activation_backward_cast(h, grad.double(), "gelu", "fp8_e4m3")
    with pytest.raises(ValueError, match="unknown activation"):
        activation_backward_cast(h, grad, "tanh", "fp8_e4m3")
