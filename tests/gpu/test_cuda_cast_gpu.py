"""GPU checks of the CUDA C++ MXFP8 cast (mxtrain/csrc/mx_cast.cu): bit-exact against the reference.

Skipped without CUDA or without a CUDA compiler (the extension builds on first use). Codes, scale
bytes and dequantized values are compared bit for bit with ``quantize_mx`` (and the values with
``MXTensor.dequantize``) at large, ragged and adversarial inputs, every dtype, format, scale mode
and plane selection; casts the kernel does not take must come back from the Triton cast unchanged.
"""

import dataclasses
import importlib.util
import os
import pathlib
import warnings

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") == "1",
                                 reason="TRITON_INTERPRET=1 would interpret the kernels")]

if torch.cuda.is_available():
    from mxtrain.kernels import cuda_cast  # noqa: E402

    if cuda_cast.toolchain_problem() is not None:
        pytest.skip(f"CUDA extension cannot build here: {cuda_cast.toolchain_problem()}", allow_module_level=True)

from mxtrain.kernels import cast, dispatch  # noqa: E402
from mxtrain.formats import parse_format  # noqa: E402
from mxtrain.quantization import quantize_mx  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "kernel_helpers_cuda", pathlib.Path(__file__).parents[1] / "kernels" / "helpers.py")
helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(helpers)

DEV = torch.device("cuda")
FP8 = ("fp8_e4m3", "fp8_e5m2")
MODES = ("floor", "rceil", "even")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(cast, "POISON_OUTPUTS", True)


@pytest.fixture(scope="module", autouse=True)
def _built():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed build must fail these tests, not fall back quietly
        assert cuda_cast.library() is not None, cuda_cast.extension_error()


def adversarial(rows, cols, dtype, seed=0):
    return helpers.as_dtype(helpers.adversarial_matrix(rows, cols, seed=seed), dtype).to(DEV)


def check(x, fmt, **kw):
    got = cuda_cast.cuda_quantize(x, fmt, **kw)
    ref_kw = {k: v for k, v in kw.items() if k not in ("dequantized", "dequantized_dtype", "keep_codes")}
    want = ref = quantize_mx(x, fmt, **ref_kw)
    keep = kw.get("keep_codes")
    if keep is not None:
        keep = tuple(a % x.ndim for a in (keep if isinstance(keep, tuple) else (keep,)))
        assert tuple(p.axis for p in got.planes) == tuple(p.axis for p in want.planes if p.axis in keep)
        if keep:
            want = dataclasses.replace(want, planes=tuple(p for p in want.planes if p.axis in keep))
    if got.planes:
        problems = helpers.planes_equal(got, want)
        assert not problems, f"{fmt} {kw} {list(x.shape)} {x.dtype}: " + "; ".join(problems)
    deq = kw.get("dequantized", ())
    for a in (deq if isinstance(deq, tuple) else (deq,)):
        v = got.dequantized_values(a)
        assert helpers.values_equal(v, ref.dequantize(torch.bfloat16, a)), f"values of axis {a} differ"
    return got


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", FP8)
def test_both_planes_adversarial(fmt, mode, dtype):
    """NaN/Inf blocks, zeros, -0, subnormals, ties, one-ulp-under-powers-of-two, huge values."""
    x = adversarial(200, 328, dtype, seed=3)
    check(x, fmt, block_size=32, axis=(-1, 0), scale_mode=mode)


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("shape", [(8192, 8192), (4096 + 17, 1000), (33, 4104), (1, 8), (64, 128), (7, 40)])
def test_shapes_bf16(fmt, shape):
    """Large and ragged shapes (M not a multiple of 32/64, K a multiple of 8 only), both planes."""
    g = torch.Generator(device=DEV).manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g, device=DEV)
    x *= torch.exp2(torch.randint(-30, 31, (shape[0], 1), generator=g, device=DEV).float())
    x = x.to(torch.bfloat16)
    check(x, fmt, block_size=32, axis=(-1, 0), scale_mode="floor")
    check(x, fmt, block_size=32, axis=(-1, 0), scale_mode="rceil")


@pytest.mark.parametrize("axis", [-1, 0, (0, -1)], ids=["rows", "cols", "cols_rows"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
def test_single_planes_and_order(axis, dtype):
    x = adversarial(96, 264, dtype, seed=5)
    check(x, "fp8_e4m3", block_size=32, axis=axis, scale_mode="rceil")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("request_", [
    dict(axis=(1, 0), dequantized=(1,), keep_codes=(0,)),    # what LayerNormMLP asks for its input
    dict(axis=(1, 0), dequantized=(1, 0), keep_codes=()),    # weights: both as values
    dict(axis=(1, 0), dequantized=(0,)),                      # values and codes of a plane
    dict(axis=1, dequantized=(1,), keep_codes=()),
    dict(axis=0, dequantized=(0,), keep_codes=()),
], ids=["row_vals_col_codes", "both_vals", "col_vals_all_codes", "row_vals", "col_vals"])
def test_values_outputs(request_, mode):
    x = adversarial(130, 200, torch.bfloat16, seed=7)
    check(x, "fp8_e4m3", block_size=32, scale_mode=mode, **request_)
    check(x, "fp8_e5m2", block_size=32, scale_mode=mode, **request_)


def test_nd_tensors():
    x = adversarial(48, 96, torch.bfloat16, seed=9).reshape(6, 8, 96)
    check(x, "fp8_e4m3", block_size=32, axis=-1)
    check(x, "fp8_e4m3", block_size=32, axis=(-1, 0))  # two launches: rows of [48, 96], columns of [6, 768]


def test_strided_rows():
    base = adversarial(64, 272, torch.bfloat16, seed=11)
    x = base[:, :256]  # row stride 272: rows still 16-byte aligned, so the kernel takes it
    assert cuda_cast.unsupported_reason(x, parse_format("fp8_e4m3"), 32, (1, 0), "floor", "even", (),
                                        torch.bfloat16) is None
    check(x, "fp8_e4m3", block_size=32, axis=(-1, 0))


@pytest.mark.parametrize("case", [
    dict(fmt="fp6_e2m3"), dict(fmt="fp4_e2m1"), dict(fmt="int8"), dict(rounding="nearest"),
    dict(rounding="stochastic", seed=3), dict(block_size=16), dict(shape=(64, 36)),
    dict(values_dtype=torch.float32),
], ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_unsupported_goes_to_triton(monkeypatch, case):
    """Casts the CUDA kernel does not take: handed to the Triton cast, same bits as it and the reference."""
    calls = []
    real = cuda_cast._launch
    monkeypatch.setattr(cuda_cast, "_launch", lambda *a, **k: calls.append(1) or real(*a, **k))
    shape = case.get("shape", (64, 96))
    x = adversarial(*shape, torch.bfloat16, seed=13)
    fmt = case.get("fmt", "fp8_e4m3")
    kw = dict(block_size=case.get("block_size", 32), axis=(-1, 0), rounding=case.get("rounding", "even"),
              seed=case.get("seed"))
    if "values_dtype" in case:
        kw.update(dequantized=(1,), dequantized_dtype=case["values_dtype"])
    got = cuda_cast.cuda_quantize(x, fmt, **kw)
    assert not calls, "the CUDA kernel took a cast it does not support"
    assert cuda_cast.unsupported_reason(x, parse_format(fmt), kw["block_size"], (1, 0), "floor", kw["rounding"],
                                        kw.get("dequantized", ()), kw.get("dequantized_dtype", torch.bfloat16))
    want = cast.triton_quantize(x, fmt, **kw)
    assert not helpers.planes_equal(got, want)


def test_dispatch_prefers_cuda_and_forced_backends_agree():
    x = adversarial(256, 512, torch.bfloat16, seed=17)
    assert dispatch._resolve(None, x.device, dispatch._QUANTIZE_IMPLS) == "cuda"
    kw = dict(block_size=32, axis=(-1, 0), scale_mode="rceil")
    by = {b: dispatch.quantize(x, "fp8_e4m3", backend=b, **kw) for b in ("cuda", "triton", "reference")}
    assert not helpers.planes_equal(by["cuda"], by["reference"])
    assert not helpers.planes_equal(by["triton"], by["reference"])


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_modules_on_cuda_cast_equal_triton(mx_config, bias):
    """LayerNormMLP forward+backward under MXFP8 on the CUDA cast equals the Triton cast bit for bit: the
    output and every fc gradient. The norm's own gradients (dx, d gamma, d beta) run torch's native backward
    on the statistics each backend's norm + cast kernel computed; the two kernels sum a row in different
    orders, so those fp32 statistics may differ in their last bits and a gradient element by one ulp of
    its dtype where its fp32 value sits next to a rounding boundary."""
    import mxtrain

    torch.manual_seed(0)
    # without biases the activation gradient is cast by the CUDA kernel too (with them, Triton sums fc1's)
    mlp = mxtrain.LayerNormMLP(256, 512, activation="gelu", bias=bias).to(DEV, torch.bfloat16)
    x = torch.randn(128, 256, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    outs = {}
    for backend in ("cuda", "triton"):
        mx_config(backend=backend)
        x.grad = None
        mlp.zero_grad()
        with mxtrain.mx_autocast(recipe=mxtrain.MXFP8Recipe()):
            y = mlp(x)
        y.float().square().sum().backward()
        outs[backend] = {"y": y.detach(), "x.grad": x.grad.clone(),
                         **{n: p.grad.clone() for n, p in mlp.named_parameters()}}
    for name, a in outs["cuda"].items():
        b = outs["triton"][name]
        if name in ("x.grad", "layer_norm_weight", "layer_norm_bias"):
            # one ulp at each element (bf16: at most 2^-7 relative), plus the fp32 statistics' own difference
            # carried through the backward's cancellations (~1e-7 of the largest terms; 1e-4 is the bound here)
            tol = torch.finfo(b.dtype).eps * b.float().abs() + 1e-4 * b.float().abs().max()
            assert ((a.float() - b.float()).abs() <= tol).all(), name
            assert (a != b).float().mean() < 0.05, name  # the odd element, not a systematic difference
        else:
            assert torch.equal(a, b), name


# ---------------------------------------------------------------- norm + cast, activation + cast on the CUDA kernel

@pytest.fixture
def fused_sources(mx_config):
    mx_config(cuda_fused_sources=True)  # the default (MXTRAIN_CUDA_FUSED_SOURCES=0 turns it off)


def _spy(monkeypatch, name):
    calls = []
    real = getattr(cuda_cast, name)
    monkeypatch.setattr(cuda_cast, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
def test_norm_cast_cuda(monkeypatch, fused_sources, dtype, kind, zero_centered):
    from mxtrain.kernels.norm_cast import norm_cast, torch_norm

    calls = _spy(monkeypatch, "_launch")
    g = torch.Generator(device=DEV).manual_seed(21)
    x = (torch.randn(300, 1032, generator=g, device=DEV) * 2 + 0.5).to(dtype)  # ragged rows and columns
    w = (torch.randn(1032, generator=g, device=DEV) * 0.5 + (0 if zero_centered else 1)).to(dtype)
    b = (torch.randn(1032, generator=g, device=DEV) * 0.2).to(dtype) if kind == "LayerNorm" else None
    r = norm_cast(x, w, b, kind=kind, fmt="fp8_e4m3", axis=(-1, 0), scale_mode="rceil", return_output=True,
                  zero_centered_gamma=zero_centered)
    assert bool(calls) == (dtype != torch.float32), "fused sources run on the CUDA kernel for bf16 / fp16 only"
    want = quantize_mx(r.out, "fp8_e4m3", axis=(-1, 0), scale_mode="rceil")
    assert not helpers.planes_equal(r.mx, want)  # the codes of the kernel's own output, bit for bit
    tol = {torch.float32: dict(rtol=1e-5, atol=2e-5), torch.bfloat16: dict(rtol=2**-7, atol=1e-5),
           torch.float16: dict(rtol=2**-9, atol=1e-5)}[dtype]
    torch.testing.assert_close(r.out.float(), torch_norm(x, w, b, kind, zero_centered_gamma=zero_centered).float(),
                               **tol)
    xf = x.float()
    var = xf.var(-1, unbiased=False) if kind == "LayerNorm" else xf.square().mean(-1)
    torch.testing.assert_close(r.rstd, torch.rsqrt(var + 1e-5), rtol=1e-5, atol=0)
    if kind == "LayerNorm":
        torch.testing.assert_close(r.mean, xf.mean(-1), rtol=1e-5, atol=1e-5)
    r2 = norm_cast(x, w, b, kind=kind, fmt="fp8_e4m3", axis=(-1, 0), scale_mode="rceil",
                   zero_centered_gamma=zero_centered)  # without the output: the same bytes
    assert r2.out is None and not helpers.planes_equal(r2.mx, r.mx)


@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_norm_cast_bf16_gamma_as_fp32(monkeypatch, fused_sources, kind, offset):
    """bf16 gamma / beta go into the kernel as they are (widened there, no conversion pass): the same
    bytes as the same parameters given in fp32, with 16-byte aligned (vector loads) and 2-byte aligned
    (scalar loads) parameters."""
    from mxtrain.kernels.norm_cast import norm_cast

    g = torch.Generator(device=DEV).manual_seed(5)
    x = (torch.randn(260, 1056, generator=g, device=DEV) * 3 - 1).to(torch.bfloat16)
    store = torch.randn(2, 1056 + 1, generator=g, device=DEV).to(torch.bfloat16)
    w, b = store[0, offset:offset + 1056], store[1, offset:offset + 1056]  # offset 1: 2-byte aligned views
    b = b if kind == "LayerNorm" else None
    args = dict(kind=kind, fmt="fp8_e4m3", axis=(-1, 0), return_output=True, dequantized=(1,), keep_codes=(0, 1))
    seen = []
    real = cuda_cast._launch
    monkeypatch.setattr(cuda_cast, "_launch", lambda *a, **k: seen.append(k.get("gamma_bf16")) or real(*a, **k))
    r16 = norm_cast(x, w, b, **args)
    r32 = norm_cast(x, w.float(), None if b is None else b.float(), **args)
    assert seen == [True, False]
    assert torch.equal(r16.out, r32.out) and torch.equal(r16.rstd, r32.rstd)
    assert kind == "RMSNorm" or torch.equal(r16.mean, r32.mean)
    assert not helpers.planes_equal(r16.mx, r32.mx)
    assert torch.equal(r16.mx.dequantized_values(1), r32.mx.dequantized_values(1))


def test_norm_cast_3d_rowwise_and_triton_switch(monkeypatch, fused_sources, mx_config):
    from mxtrain.kernels.norm_cast import norm_cast

    x = torch.randn(4, 64, 256, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(256, device=DEV, dtype=torch.bfloat16)
    r = norm_cast(x, w, None, kind="RMSNorm", fmt="fp8_e5m2", axis=-1, return_output=True)
    assert not helpers.planes_equal(r.mx, quantize_mx(r.out, "fp8_e5m2", axis=-1))
    calls = _spy(monkeypatch, "_launch")
    mx_config(backend="triton")
    r = norm_cast(x, w, None, kind="RMSNorm", fmt="fp8_e5m2", axis=-1, return_output=True)
    assert not calls  # MXTRAIN_BACKEND=triton keeps the Triton kernel
    assert not helpers.planes_equal(r.mx, quantize_mx(r.out, "fp8_e5m2", axis=-1))


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "relu", "squared_relu", "silu"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
def test_activation_cast_cuda(monkeypatch, fused_sources, act, dtype):
    from mxtrain.kernels.activation_cast import activation_cast, torch_activation

    calls = _spy(monkeypatch, "_launch")
    g = torch.Generator(device=DEV).manual_seed(22)
    h = (torch.randn(200, 1032, generator=g, device=DEV) * 3).to(dtype)
    mxt, out = activation_cast(h, act, "fp8_e4m3", axis=(-1, 0), return_output=True)
    assert bool(calls) == (dtype != torch.float32), "fused sources run on the CUDA kernel for bf16 / fp16 only"
    assert not helpers.planes_equal(mxt, quantize_mx(out, "fp8_e4m3", axis=(-1, 0)))
    tol = {torch.float32: dict(rtol=1e-5, atol=2e-5), torch.bfloat16: dict(rtol=2**-7, atol=1e-5),
           torch.float16: dict(rtol=2**-9, atol=1e-5)}[dtype]
    torch.testing.assert_close(out.float(), torch_activation(h, act).float(), **tol)
    if act in ("relu", "squared_relu"):
        assert torch.equal(out, torch_activation(h, act))
    assert not helpers.planes_equal(activation_cast(h, act, "fp8_e4m3", axis=(-1, 0)), mxt)


def test_fused_sources_switch_off(monkeypatch, mx_config):
    from mxtrain.kernels.activation_cast import activation_cast

    mx_config(cuda_fused_sources=False)  # what MXTRAIN_CUDA_FUSED_SOURCES=0 sets
    calls = _spy(monkeypatch, "_launch")
    activation_cast(torch.randn(64, 256, device=DEV, dtype=torch.bfloat16), "gelu", "fp8_e4m3", axis=(-1, 0))
    assert not calls


def _ulp_diff_bf16(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in bf16 ulps (monotone integer order of the bit patterns), NaNs equal to NaNs."""
    def order(t):
        i = t.view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -32768 - i, i)
    d = (order(a) - order(b)).abs()
    both_nan = a.isnan() & b.isnan()
    return torch.where(both_nan, torch.zeros_like(d), d)


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "silu"])
def test_activation_table_every_bf16_input(fused_sources, act):
    """bf16 gelu / gelu_tanh / silu read most values from a table of the kernel's own function: every one
    of the 65536 bf16 inputs (both signs, zeros, subnormals, Inf, NaN; in and outside the table's range)
    against torch, and the codes against the reference cast of the kernel's output."""
    from mxtrain.kernels.activation_cast import activation_cast, torch_activation

    h = torch.arange(-32768, 32768, dtype=torch.int32, device=DEV).to(torch.int16).view(torch.bfloat16)
    h = h.reshape(256, 256)
    mxt, out = activation_cast(h, act, "fp8_e4m3", axis=(-1, 0), return_output=True)
    ref = torch_activation(h, act)
    assert torch.equal(out.isnan(), ref.isnan())
    assert _ulp_diff_bf16(out, ref).max().item() <= 1
    assert (_ulp_diff_bf16(out, ref) == 0).float().mean().item() > 0.99
    assert bool((out[ref == 0] == 0).all())
    assert not helpers.planes_equal(mxt, quantize_mx(out, "fp8_e4m3", axis=(-1, 0)))
    # the same values in a ragged, shuffled layout: the table does not depend on where a value sits
    perm = torch.randperm(h.numel(), device=DEV, generator=torch.Generator(device=DEV).manual_seed(3))
    h2 = h.reshape(-1)[perm][: 200 * 320].reshape(200, 320)
    _, out2 = activation_cast(h2, act, "fp8_e4m3", axis=(-1, 0), return_output=True)
    assert torch.equal(out2.view(torch.int16), out.reshape(-1)[perm][: 200 * 320].reshape(200, 320).view(torch.int16))


@pytest.mark.parametrize("case", ["offset", "tiny_spread", "shift_outliers", "lane_outliers", "narrow"])
def test_layernorm_statistics_adversarial(fused_sources, case):
    """LayerNorm's statistics use per-lane shifted sums (the shift: the mean of the lane's first 8 values).
    Rows built against that: a mean 1000 standard deviations away, a spread of 1e-3 around 1, outliers
    exactly where every lane takes its shift, outliers at each lane's first value, and rows narrower than
    a warp's 256 values. Mean and variance against float64."""
    from mxtrain.kernels.norm_cast import norm_cast

    g = torch.Generator(device=DEV).manual_seed(41)
    k = 136 if case == "narrow" else 8192
    x = torch.randn(64, k, generator=g, device=DEV)
    if case == "offset":
        x = x + 1000.0
    elif case == "tiny_spread":
        x = x * 1e-3 + 1.0
    elif case == "shift_outliers":
        x[:, :256] = 1000.0  # the first 8 values of every lane: every shift is 1000
    elif case == "lane_outliers":
        x[:, 0::8] = -3000.0
    x = x.to(torch.bfloat16)
    w = torch.ones(k, device=DEV, dtype=torch.bfloat16)
    r = norm_cast(x, w, torch.zeros_like(w), kind="LayerNorm", fmt="fp8_e4m3", axis=(-1, 0), return_output=True)
    xd = x.double()
    var = xd.var(-1, unbiased=False)
    torch.testing.assert_close(r.rstd.double(), torch.rsqrt(var + 1e-5), rtol=1e-5, atol=0)
    torch.testing.assert_close(r.mean.double(), xd.mean(-1), rtol=1e-6, atol=1e-6 * var.sqrt().max().item())


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_norm_cast_special_rows(fused_sources, kind, dtype):
    """Rows holding a NaN, +Inf or -Inf follow torch: LayerNorm makes the whole row NaN; RMSNorm makes a
    NaN row NaN and an Inf row 0 (rstd 0) but NaN where the Inf was. Every NaN written is T's canonical
    NaN 0x7FFF (the kernel rounds fp32 results a pair at a time); rstd as torch computes it; the codes
    and scale bytes those of the reference cast of the output; the other rows untouched."""
    from mxtrain.kernels.norm_cast import norm_cast, torch_norm

    g = torch.Generator(device=DEV).manual_seed(43)
    x = torch.randn(96, 520, generator=g, device=DEV).to(dtype)
    x[3, 17], x[40, 0], x[77, 519] = float("nan"), float("inf"), float("-inf")
    w = (torch.randn(520, generator=g, device=DEV) * 0.5 + 1).to(dtype)
    b = (torch.randn(520, generator=g, device=DEV) * 0.2).to(dtype) if kind == "LayerNorm" else None
    r = norm_cast(x, w, b, kind=kind, fmt="fp8_e4m3", axis=(-1, 0), return_output=True)
    ref = torch_norm(x, w, b, kind)
    assert torch.equal(r.out.isnan(), ref.isnan())
    # LayerNorm: the 3 rows; RMSNorm: the NaN row and the places of the two Infs
    assert int(r.out.isnan().sum()) == (520 + 2 if kind == "RMSNorm" else 3 * 520)
    assert bool((r.out[r.out.isnan()].view(torch.int16) == 0x7FFF).all())
    torch.testing.assert_close(r.out.float(), ref.float(), rtol=2**-7 if dtype == torch.bfloat16 else 2**-9,
                               atol=1e-5, equal_nan=True)
    xf = x.float()
    var = xf.var(-1, unbiased=False) if kind == "LayerNorm" else xf.square().mean(-1)
    torch.testing.assert_close(r.rstd, torch.rsqrt(var + 1e-5), rtol=1e-5, atol=0, equal_nan=True)
    assert not helpers.planes_equal(r.mx, quantize_mx(r.out, "fp8_e4m3", axis=(-1, 0)))


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_norm_statistics_in_kernel_many_bands(mx_config, fused_sources, kind):
    """The norm's statistics are work items of the same kernel, run ahead of the tiles that wait on them:
    many bands, a ragged last band, any lookahead, rowwise-only: the same statistics and bytes."""
    from mxtrain.kernels.norm_cast import norm_cast

    g = torch.Generator(device=DEV).manual_seed(31)
    x = (torch.randn(2000, 4104, generator=g, device=DEV) * 3 + 1.5).to(torch.bfloat16)
    w = (torch.randn(4104, generator=g, device=DEV) * 0.5 + 1).to(torch.bfloat16)
    b = (torch.randn(4104, generator=g, device=DEV) * 0.2).to(torch.bfloat16) if kind == "LayerNorm" else None
    results = []
    for lookahead in (1, 6, 1000):
        mx_config(norm_lookahead=lookahead)
        results.append(norm_cast(x, w, b, kind=kind, fmt="fp8_e4m3", axis=(-1, 0), return_output=True))
    r = results[0]
    for other in results[1:]:
        assert not helpers.planes_equal(other.mx, r.mx)
        assert torch.equal(other.rstd, r.rstd) and torch.equal(other.out, r.out)
        if kind == "LayerNorm":
            assert torch.equal(other.mean, r.mean)
    xf = x.float()
    var = xf.var(-1, unbiased=False) if kind == "LayerNorm" else xf.square().mean(-1)
    torch.testing.assert_close(r.rstd, torch.rsqrt(var + 1e-5), rtol=1e-5, atol=0)
    if kind == "LayerNorm":
        torch.testing.assert_close(r.mean, xf.mean(-1), rtol=1e-5, atol=1e-5)
    assert not helpers.planes_equal(r.mx, quantize_mx(r.out, "fp8_e4m3", axis=(-1, 0)))
    rows_only = norm_cast(x, w, b, kind=kind, fmt="fp8_e4m3", axis=-1)
    assert not helpers.planes_equal(rows_only.mx, quantize_mx(r.out, "fp8_e4m3", axis=-1))
    assert torch.equal(rows_only.rstd, r.rstd)


# ---- the CUDA MXFP8 dequantize (mxtrain/csrc/mx_dequantize.cu) ------------------------------------

def _every_code_plane(fmt, rows, length, seed):
    """An MXTensor [rows, length] (rowwise) and one [length, rows] (columnwise) whose planes hold every
    code byte and the scale bytes 0, 1, 126, 127, 128, 254, 255 among random ones."""
    from mxtrain.quantization import MXTensor
    from mxtrain.quantization.mxtensor import MXPlane

    g = torch.Generator().manual_seed(seed)
    data = torch.arange(rows * length, dtype=torch.int64).remainder(256).to(torch.uint8).view(rows, length)
    data = data[torch.randperm(rows, generator=g)]
    scale = torch.randint(0, 256, (rows, length // 32), generator=g, dtype=torch.uint8)
    scale.view(-1)[:7] = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    plane_r = MXPlane(data=data.to(DEV), scale=scale.to(DEV), axis=1, packed=False)
    plane_c = MXPlane(data=data.to(DEV), scale=scale.to(DEV), axis=0, packed=False)
    return (MXTensor(planes=(plane_r,), fmt=fmt, block_size=32, shape=(rows, length), dtype=torch.bfloat16),
            MXTensor(planes=(plane_c,), fmt=fmt, block_size=32, shape=(length, rows), dtype=torch.bfloat16))


def _taken(monkeypatch) -> list[bool]:
    """Whether each call of the CUDA dequantize ran its kernel (True) or left the call to Triton (False)."""
    taken = []
    real = cuda_cast.dequantize_fp8
    monkeypatch.setattr(cuda_cast, "dequantize_fp8", lambda *a, **k: taken.append(real(*a, **k)) or taken[-1])
    return taken


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_cuda_dequantize_every_code_and_scale(monkeypatch, fmt):
    """Every code byte with extreme scale bytes (2^-127 subnormal scale, NaN scale), both orientations,
    through the CUDA kernel (spied): the reference's values bit for bit."""
    from mxtrain.kernels import dequantize as dq

    calls = _taken(monkeypatch)
    for mxt in _every_code_plane(fmt, 96, 512, seed=3):
        axis = mxt.planes[0].axis
        got = dq.triton_dequantize(mxt, torch.bfloat16, axis)
        assert helpers.values_equal(got, mxt.dequantize(torch.bfloat16, axis)), (fmt, axis)
    assert calls == [True, True]


def _as_gather_buffer(shards):
    """The shards' one-plane codes and scales laid out as an FSDP2 all-gather buffer ([count, per-rank
    bytes]: each rank's data, then its scales) and the first shard's MXTensor viewing rank 0's chunk."""
    buf = torch.stack([torch.cat([s.planes[0].data.reshape(-1), s.planes[0].scale.reshape(-1)]) for s in shards])
    p0 = shards[0].planes[0]
    nd = p0.data.numel()
    first = dataclasses.replace(shards[0], planes=(dataclasses.replace(
        p0, data=buf[0, :nd].view(p0.data.shape), scale=buf[0, nd:].view(p0.scale.shape)),))
    return first, buf


@pytest.mark.parametrize("axis", [1, 0])
def test_cuda_dequantize_shards(monkeypatch, axis):
    """An FSDP2 gather's rank chunks in one CUDA launch: each shard equals its own reference dequantize."""
    from mxtrain.kernels import dequantize as dq

    calls = _taken(monkeypatch)
    count, rows, cols = 3, 64, 256
    x = adversarial(count * rows, cols, torch.bfloat16, seed=9)
    shards = [quantize_mx(x[i * rows:(i + 1) * rows], "fp8_e4m3", axis=axis, scale_mode="rceil") for i in range(count)]
    first, buf = _as_gather_buffer(shards)
    out = torch.full((count * rows, cols), -7.75, dtype=torch.bfloat16, device=DEV)
    dq.triton_dequantize_shards(first, count, buf.stride(0), buf.stride(0), out, axis)
    want = torch.cat([s.dequantize(torch.bfloat16, axis) for s in shards])
    assert helpers.values_equal(out, want)
    assert calls == [True]  # one launch for every shard, on the CUDA kernel


@pytest.mark.parametrize("shape", [(272, 200), (528, 72), (16, 968), (1040, 40), (1008, 1032)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("axis", [1, 0])
def test_cuda_dequantize_ragged_tiles(monkeypatch, shape, axis):
    """Planes that end inside the kernels' units (a block of 32 codes a thread; the transposed kernel's 128 x 64
    tiles): rows and lengths that are multiples of 8 but not of 32, 64 or 128, alone and as two shards; the
    output around the plane is left as it was."""
    from mxtrain.kernels import dequantize as dq

    calls = _taken(monkeypatch)
    x = adversarial(*shape, torch.bfloat16, seed=sum(shape) + axis)
    mxt = quantize_mx(x, "fp8_e4m3", axis=axis)
    got = dq.triton_dequantize(mxt, torch.bfloat16, axis)
    assert helpers.values_equal(got, mxt.dequantize(torch.bfloat16, axis)), (shape, axis)
    # two shards of half the rows each, in one launch, into a buffer with a guard row on each side
    rows, cols = shape[0] // 2, shape[1]
    if rows % 8 == 0:
        halves = [quantize_mx(x[i * rows:(i + 1) * rows], "fp8_e4m3", axis=axis) for i in range(2)]
        first, buf = _as_gather_buffer(halves)
        guarded = torch.full((2 * rows + 16, cols), -7.75, dtype=torch.bfloat16, device=DEV)
        dq.triton_dequantize_shards(first, 2, buf.stride(0), buf.stride(0), guarded[8:8 + 2 * rows], axis)
        want = torch.cat([h.dequantize(torch.bfloat16, axis) for h in halves])
        assert helpers.values_equal(guarded[8:8 + 2 * rows], want), (shape, axis)
        assert bool((guarded[:8] == -7.75).all()) and bool((guarded[8 + 2 * rows:] == -7.75).all())
    assert calls and all(calls)  # every launch on the CUDA kernel


def test_cuda_dequantize_layouts_it_leaves_to_triton(monkeypatch, mx_config):
    """A transposed plane whose row count is not a multiple of 8, fp16 output, other formats, and
    MXTRAIN_BACKEND=triton take the Triton kernel; the values are the reference's either way."""
    from mxtrain.kernels import dequantize as dq

    taken = _taken(monkeypatch)
    odd = quantize_mx(adversarial(200, 1020, torch.bfloat16, seed=4), "fp8_e4m3", axis=0)  # plane rows 1020
    mxt = quantize_mx(adversarial(200, 1024, torch.bfloat16, seed=4), "fp8_e4m3", axis=(-1, 0))
    for t, axis, dtype in ((odd, 0, torch.bfloat16), (mxt, 1, torch.float16), (mxt, 1, torch.bfloat16),
                           (mxt, 0, torch.bfloat16)):
        assert helpers.values_equal(dq.triton_dequantize(t, dtype, axis), t.dequantize(dtype, axis))
    assert taken == [True, True]  # the CUDA kernel's supports() refuses the first two: never launched
    x = adversarial(200, 1024, torch.bfloat16, seed=4)
    fp6 = quantize_mx(x, "fp6_e2m3", axis=-1)
    assert helpers.values_equal(dq.triton_dequantize(fp6, torch.bfloat16, 1), fp6.dequantize(torch.bfloat16, 1))
    assert taken == [True, True]  # fp6: refused by supports(), not launched
    mx_config(backend="triton")
    taken.clear()
    assert helpers.values_equal(dq.triton_dequantize(mxt, torch.bfloat16, 1), mxt.dequantize(torch.bfloat16, 1))
    assert taken == []


# ---- planes written into one buffer (FSDP2's MX all-gather input) ----------------------------------

def _bf16_rounding_edges(rows, cols, seed=0):
    """fp32 values on every kind of bf16 rounding edge: the low 16 bits exactly half an ulp (ties to
    even, both parities), just under and over it, and zero (bf16 values), with random upper halves
    (every exponent but the NaN/Inf one, both signs)."""
    g = torch.Generator().manual_seed(seed)
    upper = torch.randint(0, 1 << 16, (rows, cols), generator=g, dtype=torch.int64)
    upper = torch.where((upper >> 7) & 0xFF == 0xFF, upper & ~(1 << 14), upper)  # no NaN / Inf exponent
    low = torch.tensor([0x8000, 0x7FFF, 0x8001, 0x0000])[torch.randint(0, 4, (rows, cols), generator=g)]
    bits = (upper << 16) | low
    bits = torch.where(bits >= 1 << 31, bits - (1 << 32), bits)
    return bits.to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("axes", [(1,), (0,), (1, 0), (0, 1)], ids=["rows", "cols", "rows_cols", "cols_rows"])
@pytest.mark.parametrize("src", ["fp32_as_bf16", "bf16", "fp32"])
@pytest.mark.parametrize("fmt", FP8)
def test_cast_planes_into_one_buffer(fmt, src, axes):
    """The buffer is torch.cat of the reference planes (codes, then scale bytes, plane by plane in the
    order asked), bit for bit; fp32 rounded to bf16 inside the kernel equals x.to(bf16) then the cast
    (ties, overflow to Inf, subnormals, NaN / Inf blocks), in both orientations."""
    # 256 x 200 (the rowwise plane padded to 224 columns), 250 x 200 (the columnwise one padded to 256 rows too;
    # a second plane would start misaligned there: the kernel declines both planes at once, the caller
    # concatenates), and 250 x 256 (aligned again: 250 x 8 scale bytes)
    adv = helpers.adversarial_matrix(160, 256, seed=3)
    for rows, cols in ((256, 200), (250, 200), (250, 256)):
        x32 = torch.cat([adv[:, :cols], _bf16_rounding_edges(rows - 160, cols, seed=4)]).to(DEV)
        _check_cast_planes_into(x32, fmt, src, axes)


def _check_cast_planes_into(x32, fmt, src, axes):
    x = x32.to(torch.bfloat16) if src == "bf16" else x32
    dtype = torch.float32 if src == "fp32" else torch.bfloat16
    m, k = x.shape
    first_plane = m * -(-k // 32) * 33 if axes[0] == 1 else k * -(-m // 32) * 33  # codes + scale bytes
    aligned = len(axes) == 1 or first_plane % 16 == 0
    for mode in MODES:
        got = cuda_cast.cast_planes_into(x, parse_format(fmt), 32, axes, mode, "even", dtype)
        if not aligned:
            assert got is None, f"{list(x.shape)} {axes}: a misaligned second plane must be declined"
            continue
        assert got is not None, "the CUDA kernel did not take the cast"
        buf, mx = got
        ref = quantize_mx(x.to(dtype), fmt, axis=axes, scale_mode=mode)
        want = torch.cat([t.reshape(-1) for p in ref.planes for t in (p.data, p.scale)])
        assert buf.dtype == torch.uint8 and buf.shape == want.shape
        assert torch.equal(buf, want), f"{fmt} {src} {axes} {mode}: the buffer differs from the reference planes"
        assert mx.dtype == dtype and tuple(p.axis for p in mx.planes) == tuple(p.axis for p in ref.planes)
        problems = helpers.planes_equal(mx, ref)
        assert not problems, "; ".join(problems)
        assert all(p.data.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr() for p in mx.planes)


def test_cast_planes_into_declines_what_it_does_not_cast(mx_config):
    fp8 = parse_format("fp8_e4m3")
    x = torch.randn(64, 64, device=DEV)
    assert cuda_cast.cast_planes_into(x, fp8, 32, (1,), "floor", "even", torch.float16) is None  # fp32 -> fp16
    assert cuda_cast.cast_planes_into(x.half(), fp8, 32, (1,), "floor", "even", torch.bfloat16) is None
    assert cuda_cast.cast_planes_into(x, parse_format("fp4_e2m1"), 32, (1,), "floor", "even", torch.float32) is None
    assert cuda_cast.cast_planes_into(x, fp8, 16, (1,), "floor", "even", torch.float32) is None
    assert cuda_cast.cast_planes_into(x, fp8, 32, (1,), "floor", "stochastic", torch.float32) is None
    assert cuda_cast.cast_planes_into(x.view(4, 16, 64), fp8, 32, (2,), "floor", "even", torch.float32) is None
    assert cuda_cast.cast_planes_into(torch.randn(64, 60, device=DEV), fp8, 32, (1,), "floor", "even",
                                      torch.float32) is None  # rows not a multiple of 8 elements
    assert cuda_cast.cast_planes_into(x, fp8, 32, (), "floor", "even", torch.float32) is None
    mx_config(backend="triton")
    assert cuda_cast.cast_planes_into(x, fp8, 32, (1,), "floor", "even", torch.float32) is None


# ---- activation gradient + cast on the CUDA kernel (pre 11-15) ------------------------------------------

def _fp16_ulp_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    def order(t):
        i = t.view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -32768 - i, i)
    d = (order(a) - order(b)).abs()
    return torch.where(a.isnan() & b.isnan(), torch.zeros_like(d), d)


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "relu", "squared_relu", "silu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_activation_backward_cast_cuda(monkeypatch, fused_sources, act, dtype, mx_config):
    """dh = grad * act'(h) inside the CUDA cast: the codes of the kernel's own dh bit for bit (both planes,
    ragged rows and columns, NaN / Inf / signed zeros), dh within one ulp of torch's backward (relu: equal)
    and of the Triton kernel's, the values and codes of one pass consistent."""
    from mxtrain.kernels.activation_cast import activation_backward_cast
    from mxtrain.modules.activations import activation_backward

    calls = _spy(monkeypatch, "activation_backward_cast")
    g = torch.Generator(device=DEV).manual_seed(31)
    h = (torch.randn(300, 1032, generator=g, device=DEV) * 3).to(dtype)
    grad = torch.randn(300, 1032, generator=g, device=DEV).to(dtype)
    h[3, 5], h[7, 0], grad[9, 9], h[11, 40], h[12, 0] = float("nan"), 0.0, float("inf"), -0.0, float("-inf")
    grad[20, 3], h[21, 7] = float("nan"), 1e4
    want = activation_backward(h, grad, act)
    ulps = _ulp_diff_bf16 if dtype == torch.bfloat16 else _fp16_ulp_diff
    for fmt, mode in (("fp8_e4m3", "rceil"), ("fp8_e5m2", "floor"), ("fp8_e4m3", "even")):
        r = activation_backward_cast(h, grad, act, fmt, axis=(-1, 0), scale_mode=mode, return_output=True)
        assert calls, "the CUDA kernel did not take the cast"
        assert r.dbias is None
        assert not helpers.planes_equal(r.mx, quantize_mx(r.out, fmt, axis=(-1, 0), scale_mode=mode))
        assert torch.equal(r.out.isnan(), want.isnan())
        assert ulps(r.out, want).max().item() <= 1, f"{act}: dh more than an ulp from torch's"
        if act == "relu":
            assert torch.equal(r.out.nan_to_num(), want.nan_to_num())
    # against the Triton kernel (the fused sources switched off): nearly always equal, and close everywhere
    # (Triton's contracted arithmetic, not within an ulp of torch's where gelu's derivative cancels near
    # x = -0.75, is the one further off there)
    mx_config(cuda_fused_sources=False)
    tri = activation_backward_cast(h, grad, act, "fp8_e4m3", axis=(-1, 0), return_output=True)
    mx_config(cuda_fused_sources=True)
    cud = activation_backward_cast(h, grad, act, "fp8_e4m3", axis=(-1, 0), return_output=True)
    assert (ulps(cud.out, tri.out) == 0).float().mean().item() > 0.99
    torch.testing.assert_close(cud.out.float(), tri.out.float(), rtol=2**-6, atol=1e-4, equal_nan=True)
    # values from the same pass: the bf16 rowwise values written over a bf16 grad (reuse_grad), the columnwise
    # codes kept
    g2 = grad.clone()
    r = activation_backward_cast(h, g2, act, "fp8_e4m3", axis=(-1, 0), dequantized=(-1,), keep_codes=(0,),
                                 reuse_grad=True)
    assert (r.mx.dequantized_values(1).data_ptr() == g2.data_ptr()) == (dtype == torch.bfloat16)
    assert torch.equal(r.mx.dequantized_values(1).float().nan_to_num(),
                       cud.mx.dequantize(torch.bfloat16, 1).float().nan_to_num())
    assert [p.axis for p in r.mx.planes] == [0]
    assert torch.equal(r.mx.plane(0).data, cud.mx.plane(0).data) and torch.equal(r.mx.plane(0).scale,
                                                                                  cud.mx.plane(0).scale)
    both = activation_backward_cast(h, grad, act, "fp8_e4m3", axis=(-1, 0), dequantized=(-1, 0), keep_codes=())
    for axis in (1, 0):
        assert torch.equal(both.mx.dequantized_values(axis).float().nan_to_num(),
                           cud.mx.dequantize(torch.bfloat16, axis).float().nan_to_num())


def test_activation_backward_cast_cuda_leaves_to_triton(monkeypatch, fused_sources):
    """The bias gradient, gated activations, fp32 and strided gradients stay with the Triton kernel."""
    from mxtrain.kernels.activation_cast import activation_backward_cast

    launches = _spy(monkeypatch, "_launch")
    h = torch.randn(64, 256, device=DEV, dtype=torch.bfloat16)
    grad = torch.randn(64, 256, device=DEV, dtype=torch.bfloat16)
    r = activation_backward_cast(h, grad, "gelu", "fp8_e4m3", axis=(-1, 0), dbias=True, return_output=True)
    assert r.dbias is not None
    activation_backward_cast(h, grad[:, :128], "swiglu", "fp8_e4m3", axis=(-1, 0))
    activation_backward_cast(h.float(), grad.float(), "gelu", "fp8_e4m3", axis=(-1, 0))
    assert not launches
    wide = torch.randn(64, 512, device=DEV, dtype=torch.bfloat16)[:, 8:264]  # rows 512 apart, 16-byte aligned
    assert cuda_cast.activation_backward_cast(h, wide, "gelu", parse_format("fp8_e4m3"), 32, "floor", "even", True,
                                              True, True, False, {}, False) is not None  # strided rows are read
    odd = torch.randn(64, 257, device=DEV, dtype=torch.bfloat16)[:, 1:]  # 2-byte aligned rows: declined
    assert cuda_cast.activation_backward_cast(h, odd, "gelu", parse_format("fp8_e4m3"), 32, "floor", "even", True,
                                              True, True, False, {}, False) is None
