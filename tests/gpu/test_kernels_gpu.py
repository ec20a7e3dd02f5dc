"""GPU checks of the Triton kernels: bit-exact against the reference at large and ragged shapes.

Skipped without CUDA (and under TRITON_INTERPRET=1, which would interpret the
kernels on CUDA tensors). The reference runs on the GPU too (pure PyTorch).
"""

import importlib.util
import os
import pathlib

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") == "1",
                                 reason="TRITON_INTERPRET=1 would interpret the kernels")]

triton = pytest.importorskip("triton", reason="triton is not installed")

import mxtrain  # noqa: E402
from mxtrain.formats import MX_FORMAT_NAMES  # noqa: E402
from mxtrain.kernels import cast, dequantize as dq  # noqa: E402
from mxtrain.kernels import dispatch  # noqa: E402
from mxtrain.modules import _quantizer  # noqa: E402
from mxtrain.quantization import quantize_mx  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "kernel_helpers_gpu", pathlib.Path(__file__).parents[1] / "kernels" / "helpers.py")
helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(helpers)

DEV = torch.device("cuda")
# the quick tier (scripts/run_gpu_tests.sh --quick) keeps these formats of each sweep; the full tier runs every one
QUICK_FORMATS = ("fp8_e4m3", "fp4_e2m1")


def sweep(values, quick):
    """``values`` as parametrize cases, those outside ``quick`` marked exhaustive (full tier only)."""
    return [v if v in quick else pytest.param(v, marks=pytest.mark.exhaustive) for v in values]


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(cast, "POISON_OUTPUTS", True)
    monkeypatch.setattr(dq, "POISON_OUTPUTS", True)


def wide_random(rows, cols, dtype, seed):
    """Random data with a per-row exponent spread (2**-30..2**30) and per-element spread inside blocks."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(rows, cols, generator=g, device=DEV)
    x *= torch.exp2(torch.randint(-30, 31, (rows, 1), generator=g, device=DEV).float())
    x *= torch.exp2(torch.randint(-10, 1, (rows, cols), generator=g, device=DEV).float())
    x[7, 100] = float("nan")
    x[4000 % rows, 33] = float("-inf")
    x[100, :64] = 0.0
    return helpers.as_dtype(x, dtype)


def check_cast(x, fmt, **kw):
    got = cast.triton_quantize(x, fmt, **kw)
    want = quantize_mx(x, fmt, **kw)
    problems = helpers.planes_equal(got, want)
    assert not problems, f"{fmt} {kw} {list(x.shape)} {x.dtype}: " + "; ".join(problems)


STRIP = (8, 16, 64, 4)


@pytest.fixture(params=[None, STRIP], ids=["tile", "strip"])
def kernel_layout(request, mx_config):
    """Both casts of a columnwise plane: the [BM, BK] tile kernel and the strip kernel (cast.STRIP_CONFIG)."""
    mx_config(cast_strip=request.param)
    return request.param


@pytest.mark.parametrize("fmt", MX_FORMAT_NAMES)
def test_cast_8192_bf16_both_planes(fmt, kernel_layout):
    x = wide_random(8192, 8192, torch.bfloat16, seed=1)
    check_cast(x, fmt, block_size=32, axis=(-1, 0), scale_mode="floor", rounding="even")
    check_cast(x, fmt, block_size=32, axis=(-1, 0), scale_mode="rceil", rounding="nearest")


@pytest.mark.parametrize("hw", (True, False), ids=("hw_cvt", "bit_exact_path"))
@pytest.mark.parametrize("fmt", ("fp8_e4m3", "fp8_e5m2"))
def test_cast_fp8_hw_conversion(mx_config, fmt, hw, kernel_layout):
    """The hardware fp32->fp8 path and the integer path both equal the reference (adversarial fp32 too)."""
    mx_config(triton_hw_fp8=hw)
    x = wide_random(8192, 8192, torch.bfloat16, seed=2)
    for mode in ("floor", "rceil", "even"):
        check_cast(x, fmt, block_size=32, axis=(-1, 0), scale_mode=mode, rounding="even")
    adv = helpers.adversarial_matrix(1000, 1504, seed=3).to(DEV)
    for mode in ("floor", "rceil", "even"):
        check_cast(adv, fmt, block_size=32, axis=(-1, 0), scale_mode=mode, rounding="even")


@pytest.mark.parametrize("fmt", sweep(MX_FORMAT_NAMES, QUICK_FORMATS))
def test_cast_ragged_adversarial_all_modes(fmt, kernel_layout):
    """Ragged 1000x1480 adversarial fp32 (subnormals, ties, specials), every scale mode and deterministic rounding."""
    x = helpers.adversarial_matrix(1000, 1480, seed=4).to(DEV)
    for mode in ("floor", "rceil", "even"):
        for rounding in ("even", "nearest", "floor"):
            check_cast(x, fmt, block_size=32, axis=(-1, 0), scale_mode=mode, rounding=rounding)
    for dtype in (torch.float16, torch.bfloat16):
        check_cast(helpers.as_dtype(x, dtype), fmt, block_size=32, axis=(-1, 0))


@pytest.mark.parametrize("bs", (2, 8, 16, 64, 128, 256))
def test_cast_block_sizes(bs, kernel_layout):
    x = helpers.adversarial_matrix(520, 1032, seed=bs, block=min(bs, 32)).to(DEV)
    for fmt in ("fp8_e4m3", "fp6_e3m2", "fp4_e2m1", "int8", "int2"):
        if fmt.startswith("fp6") and bs < 4:
            continue
        check_cast(x, fmt, block_size=bs, axis=(-1, 0), scale_mode="floor", rounding="even")


def test_cast_single_planes_nd_pack_false():
    x = helpers.adversarial_matrix(1000, 1480, seed=5).to(DEV)
    check_cast(x, "fp8_e4m3", axis=0)
    check_cast(x, "fp4_e2m1", axis=-1)
    check_cast(x, "fp6_e2m3", axis=(-1, 0), pack=False)
    x3 = x[:960].reshape(8, 120, 1480)
    check_cast(x3, "int4", axis=-1)
    check_cast(x3, "fp8_e5m2", axis=(2, 0))
    check_cast(x.t(), "fp8_e4m3", axis=(-1, 0))  # strided input


@pytest.mark.parametrize("fmt", ("fp8_e4m3", "fp8_e5m2", "fp4_e2m1", "int8"))
def test_cast_values_8192(fmt, kernel_layout):
    """The cast writing the dequantized operand: values bit-exact vs reference dequantize, codes kept or skipped."""
    x = wide_random(8192, 8192, torch.bfloat16, seed=12)
    want = quantize_mx(x, fmt, block_size=32, axis=(-1, 0))
    deq = {a: want.dequantize(torch.bfloat16, a) for a in (1, 0)}
    full = cast.triton_quantize(x, fmt, axis=(-1, 0), dequantized=(1, 0))
    assert not helpers.planes_equal(dispatch.attach_values(full, (), torch.bfloat16, (1, 0)), want)
    for a in (1, 0):
        assert helpers.values_equal(full.dequantized_values(a), deq[a]), (fmt, a)
    del full
    fwd = cast.triton_quantize(x, fmt, axis=(-1, 0), dequantized=(1,), keep_codes=(0,))  # norm out / dY / dh
    assert fwd.rowwise is None and helpers.values_equal(fwd.dequantized_values(1), deq[1])
    assert torch.equal(fwd.columnwise.data, want.columnwise.data)
    assert torch.equal(fwd.columnwise.scale, want.columnwise.scale)
    del fwd
    col = cast.triton_quantize(x, fmt, axis=0, dequantized=(0,), keep_codes=())  # a weight in backward
    assert col.planes == () and helpers.values_equal(col.dequantized_values(0), deq[0])
    row = cast.triton_quantize(x, fmt, axis=-1, dequantized=(1,), keep_codes=())  # act(h) / a weight in forward
    assert row.planes == () and helpers.values_equal(row.dequantized_values(1), deq[1])


@pytest.mark.exhaustive  # test_cast_ragged_adversarial_all_modes covers the ragged values planes in the quick tier
def test_cast_values_ragged_fp32_every_dtype(kernel_layout):
    x = helpers.adversarial_matrix(1000, 1480, seed=13).to(DEV)
    for fmt in MX_FORMAT_NAMES:
        want = quantize_mx(x, fmt, block_size=32, axis=(-1, 0), scale_mode="rceil")
        for dtype in (torch.bfloat16, torch.float32, torch.float16):
            got = cast.triton_quantize(x, fmt, axis=(-1, 0), scale_mode="rceil", dequantized=(1, 0),
                                       dequantized_dtype=dtype)
            for a in (1, 0):
                assert helpers.values_equal(got.dequantized_values(a), want.dequantize(dtype, a)), (fmt, dtype, a)


def test_stochastic_gpu():
    x = torch.full((1024, 1024), 1.125, device=DEV)  # fp4 grid at scale 2**0 with amax 6: 1.0 / 1.5
    x[:, ::32] = 6.0
    a = cast.triton_quantize(x, "fp4_e2m1", axis=(-1, 0), rounding="stochastic", seed=11)
    b = cast.triton_quantize(x, "fp4_e2m1", axis=(-1, 0), rounding="stochastic", seed=11)
    assert not helpers.planes_equal(a, b)
    for axis in (1, 0):
        d = a.dequantize(torch.float32, axis)
        body = d[:, torch.arange(1024, device=DEV) % 32 != 0] if axis == 1 else d
        body = body[(body != 6.0)]
        assert ((body == 1.0) | (body == 1.5)).all()
        p = (body == 1.5).float().mean().item()
        assert abs(p - 0.25) < 0.01, p


@pytest.mark.parametrize("fmt", MX_FORMAT_NAMES)
def test_dequantize_8192_both_planes(fmt):
    x = wide_random(8192, 8192, torch.bfloat16, seed=6)
    mxt = quantize_mx(x, fmt, block_size=32, axis=(-1, 0))
    for axis in (1, 0):
        for dtype in (torch.bfloat16, torch.float32):
            got = dq.triton_dequantize(mxt, dtype, axis)
            assert helpers.values_equal(got, mxt.dequantize(dtype, axis)), (fmt, axis, dtype)


@pytest.mark.parametrize("fmt", MX_FORMAT_NAMES)
def test_dequantize_ragged_every_dtype(fmt):
    x = helpers.adversarial_matrix(1000, 1480, seed=7).to(DEV)
    for pack in (True, False):
        mxt = quantize_mx(x, fmt, block_size=32, axis=(-1, 0), scale_mode="rceil", pack=pack)
        for axis in (1, 0):
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                got = dq.triton_dequantize(mxt, dtype, axis)
                assert helpers.values_equal(got, mxt.dequantize(dtype, axis)), (fmt, pack, axis, dtype)


def test_dispatch_prefers_triton_on_cuda():
    x = torch.randn(64, 128, device=DEV)
    assert dispatch._resolve(None, x.device, dispatch._QUANTIZE_IMPLS) in ("triton", "cuda")
    assert dispatch._resolve(None, x.device, dispatch._DEQUANTIZE_IMPLS) in ("triton", "cuda")


@pytest.mark.parametrize("recipe", sweep(("MXFP8Recipe", "MXFP6Recipe", "MXFP4Recipe", "MXINT8Recipe"),
                                         ("MXFP8Recipe", "MXFP4Recipe")))
@pytest.mark.parametrize("activation,norm", (("gelu", "LayerNorm"), ("swiglu", "RMSNorm")))
def test_layernorm_mlp_triton_vs_reference_backend(monkeypatch, recipe, activation, norm, mx_config):
    """The module on GPU gives the same output and grads with the kernel casts as with the reference casts
    (norm and activation computed by torch: MXTRAIN_FUSE_SOURCES=0; the fused sources are compared in
    tests/gpu/test_modules_fused_gpu.py)."""
    mx_config(fuse_sources=False)
    torch.manual_seed(0)
    m = mxtrain.LayerNormMLP(256, 512, activation=activation, normalization=norm).to(DEV)
    x = torch.randn(4, 96, 256, device=DEV) * 2
    dy = torch.randn(4, 96, 256, device=DEV)
    # deterministic gradients (MXFP4Recipe rounds them stochastically by default; the two paths draw differently)
    rec = getattr(mxtrain, recipe)(grad_rounding=None)

    # the reference GEMM both times, to isolate the casts: load the kernel modules first (importing
    # mxtrain.kernels.gemm later would register the cuBLAS GEMM into the pinned table)
    dispatch._load_kernels()
    monkeypatch.setattr(dispatch, "_GEMM_IMPLS", {})

    def run(backend):
        if backend == "auto":
            mx_config(backend="auto")  # CUDA tensors take the kernels
        else:
            mx_config(backend=backend)
        m.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        with mxtrain.mx_autocast(recipe=rec):
            y = m(xi)
        y.backward(dy)
        return y.detach(), xi.grad, {n: p.grad.clone() for n, p in m.named_parameters()}

    y_t, dx_t, g_t = run("auto")
    y_r, dx_r, g_r = run("reference")
    assert torch.equal(y_t, y_r)
    assert torch.equal(dx_t, dx_r)
    for n in g_r:
        assert torch.equal(g_t[n], g_r[n]), n


@pytest.mark.parametrize("activation", ("gelu", "swiglu"))
def test_layernorm_mlp_bf16_values_bit_identical(monkeypatch, activation, mx_config):
    """bf16 LayerNormMLP on the cuBLAS path: operands cast straight to bf16 values (a module's Quantizer on CUDA)
    give the same output and grads, bit for bit, as casting codes and dequantizing them; with the
    reference GEMM, the same as the reference casts (norm and activation computed by torch, as the
    reference path does; with the fused sources the values/codes identity is checked too)."""
    mx_config(fuse_sources=False)
    torch.manual_seed(1)
    m = mxtrain.LayerNormMLP(512, 1024, activation=activation, device=DEV, dtype=torch.bfloat16)
    x = torch.randn(4, 96, 512, device=DEV, dtype=torch.bfloat16) * 2
    dy = torch.randn(4, 96, 512, device=DEV, dtype=torch.bfloat16)
    rec = mxtrain.MXFP8Recipe()

    def run():
        m.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        with mxtrain.mx_autocast(recipe=rec):
            y = m(xi)
        y.backward(dy)
        return [y.detach(), xi.grad] + [p.grad.clone() for _, p in m.named_parameters()]

    mx_config(carry_values=True)
    with_values = run()
    seen = []
    orig = dispatch.quantize

    def spy(*a, **kw):
        out = orig(*a, **kw)
        seen.append((bool(out.values), bool(out.planes)))
        return out
    monkeypatch.setattr(_quantizer, "quantize", spy)
    run()
    # operands used at once as values; the wgrad plane forward keeps (ln_out's) as codes
    assert any(v for v, _ in seen) and any(c for _, c in seen)
    monkeypatch.setattr(_quantizer, "quantize", orig)
    mx_config(carry_values=False)
    without = run()
    for a, b in zip(with_values, without):
        assert torch.equal(a, b)
    # norm + cast and activation + cast kernels: values written by the fused cast = its codes dequantized
    mx_config(fuse_sources=True)
    fused_without = run()
    mx_config(carry_values=True)
    fused_with = run()
    for a, b in zip(fused_with, fused_without):
        assert torch.equal(a, b)
    mx_config(fuse_sources=False)
    # the reference GEMM both ways (cast kernels + values vs reference casts)
    dispatch._load_kernels()
    monkeypatch.setattr(dispatch, "_GEMM_IMPLS", {})
    mx_config(carry_values=True)
    kern = run()
    mx_config(backend="reference")
    refr = run()
    for a, b in zip(kern, refr):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- fused norm + cast, activation + cast

HALF_TOL = {torch.float32: dict(rtol=1e-5, atol=2e-5), torch.bfloat16: dict(rtol=2**-7, atol=1e-5),
            torch.float16: dict(rtol=2**-9, atol=1e-5)}


@pytest.mark.parametrize("kind", ("LayerNorm", "RMSNorm"))
@pytest.mark.parametrize("shape,dtype,fmt", (((8192, 8192), torch.bfloat16, "fp8_e4m3"),
                                             ((1000, 1480), torch.float32, "fp4_e2m1"),
                                             ((1000, 1480), torch.float16, "fp6_e2m3")))
def test_norm_cast_gpu(kind, shape, dtype, fmt):
    from mxtrain.kernels.norm_cast import norm_cast, torch_norm

    g = torch.Generator(device=DEV).manual_seed(8)
    x = (torch.randn(*shape, generator=g, device=DEV) * 2 + 0.5).to(dtype)
    w = (torch.randn(shape[1], generator=g, device=DEV) * 0.5 + 1).to(dtype)
    b = (torch.randn(shape[1], generator=g, device=DEV) * 0.2).to(dtype) if kind == "LayerNorm" else None
    r = norm_cast(x, w, b, kind=kind, fmt=fmt, axis=(-1, 0), scale_mode="rceil", return_output=True)
    assert not helpers.planes_equal(r.mx, quantize_mx(r.out, fmt, axis=(-1, 0), scale_mode="rceil"))
    torch.testing.assert_close(r.out.float(), torch_norm(x, w, b, kind).float(), **HALF_TOL[dtype])
    xf = x.float()
    if kind == "LayerNorm":
        var, mean = torch.var_mean(xf, -1, unbiased=False)
        torch.testing.assert_close(r.mean, mean, rtol=1e-5, atol=1e-5)
    else:
        var = xf.square().mean(-1)
    torch.testing.assert_close(r.rstd, torch.rsqrt(var + 1e-5), rtol=1e-5, atol=0)


@pytest.mark.parametrize("act", ("gelu", "gelu_tanh", "relu", "squared_relu", "silu", "swiglu", "geglu", "reglu",
                                 "geglu_tanh"))
def test_activation_cast_gpu(act):
    from mxtrain.kernels.activation_cast import ACTIVATION_IDS, activation_cast, torch_activation

    gated = ACTIVATION_IDS[act] >= 6
    g = torch.Generator(device=DEV).manual_seed(9)
    for shape, dtype, fmt in (((4096, 4096), torch.bfloat16, "fp8_e4m3"), ((1000, 1480), torch.float32, "int8")):
        h = (torch.randn(shape[0], shape[1] * (2 if gated else 1), generator=g, device=DEV) * 3).to(dtype)
        mxt, out = activation_cast(h, act, fmt, axis=(-1, 0), return_output=True)
        assert not helpers.planes_equal(mxt, quantize_mx(out, fmt, axis=(-1, 0)))
        tol = HALF_TOL[dtype]
        if gated and dtype != torch.float32:  # act(gate) rounded, then the product: up to two ulps
            tol = dict(tol, rtol=2 * tol["rtol"])
        torch.testing.assert_close(out.float(), torch_activation(h, act).float(), **tol)
        if act in ("relu", "squared_relu", "reglu"):
            assert torch.equal(out, torch_activation(h, act))
