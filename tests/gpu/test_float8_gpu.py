"""FP8 recipes on the GPU (skipped without CUDA).

* Triton casts bit-identical to the CPU reference at large and ragged shapes.
* GEMMs (torch._scaled_mm for per-tensor scales, the Triton 128-block kernel)
  against a float64 matmul of the dequantized operands.
* Modules under each FP8 recipe against the same modules on the reference path
  (MXTRAIN_BACKEND=reference: reference casts, fp32 GEMM of dequantized operands).
"""

import copy

import pytest
import torch

import mxtrain
from mxtrain.kernels.dispatch import mx_gemm, quantize_float8
from mxtrain.quantization.float8 import quantize_float8 as reference_quantize_float8
from mxtrain.recipes import DelayedScaling, Float8BlockScaling, Float8CurrentScaling

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _same(got, want, what):
    for pg, pw in zip(got.planes, want.planes):
        assert pg.axis == pw.axis and pg.block == pw.block, what
        assert torch.equal(pg.data.view(torch.uint8).cpu(), pw.data.view(torch.uint8)), f"{what} data {pg.axis}"
        assert torch.equal(pg.scale_inv.cpu().view(torch.int32), pw.scale_inv.view(torch.int32)), what
    if want.amax is not None:
        assert torch.equal(got.amax.cpu().reshape(()), want.amax.reshape(())), f"{what} amax"


@pytest.mark.parametrize("shape", [(2048, 8192), (1000, 3000), (33, 4100)])
@pytest.mark.parametrize("kind", ["current", "delayed", "block_1x128", "block_128x128"])
def test_casts_bit_identical_to_reference(shape, kind):
    torch.manual_seed(0)
    x = (torch.randn(shape, device="cuda") * torch.logspace(-3, 3, shape[1], device="cuda")).to(torch.bfloat16)
    kw = {"axes": (1, 0)}
    if kind == "delayed":
        kw["scale"] = torch.tensor(0.731, device="cuda")
    elif kind.startswith("block"):
        kw["block"] = (1, 128) if kind == "block_1x128" else (128, 128)
        kw["power_of_2_scales"] = shape[0] != 1000
    for fmt in ("fp8_e4m3", "fp8_e5m2"):
        got = quantize_float8(x, fmt, **kw)
        want = reference_quantize_float8(x.cpu(), fmt, **{k: (v.cpu() if torch.is_tensor(v) else v)
                                                          for k, v in kw.items()})
        _same(got, want, f"{kind} {fmt} {shape}")


# 8192^3 runs in the full tier only (scripts/run_gpu_tests.sh --full); the quick tier keeps the model-sized shape
GEMM_SHAPES = [pytest.param(8192, 8192, 8192, marks=pytest.mark.exhaustive), (4096, 14336, 4096), (1000, 3000, 1760),
               (33, 64, 96)]


def _operands(m, n, k, block: bool, hybrid: bool):
    torch.manual_seed(1)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 1e-3
    kw = lambda blk: {"axes": (1, 0), "block": blk} if block else {"axes": (1, 0)}  # noqa: E731
    return (quantize_float8(x, "fp8_e4m3", **kw((1, 128))), quantize_float8(w, "fp8_e4m3", **kw((128, 128))),
            quantize_float8(dy, "fp8_e5m2" if hybrid else "fp8_e4m3", **kw((1, 128))))


def _three_gemms(xq, wq, dyq, **kw):
    deq = lambda t, ax: t.dequantize_blocked(torch.float64, ax)  # noqa: E731  (reduction axis last)
    return {
        "fprop": (mx_gemm(xq, wq, a_axis=1, b_axis=1, **kw), deq(xq, 1) @ deq(wq, 1).T),
        "dgrad": (mx_gemm(dyq, wq, a_axis=1, b_axis=0, **kw), deq(dyq, 1) @ deq(wq, 0).T),
        "wgrad": (mx_gemm(dyq, xq, a_axis=0, b_axis=0, **kw), deq(dyq, 0) @ deq(xq, 0).T),
    }


# Hopper's FP8 tensor cores do not accumulate in full fp32 inside an MMA chain: against float64
# on the dequantized operands, cuBLAS with its split (precise) accumulator and the Triton kernel
# promoting every 128 K both measured 1.0e-4 .. 1.3e-4 relative error at K = 4096 .. 8192 (H200,
# 2026-11-21), where an fp32 GEMM of the same operands stays below 1e-6. Fast accumulation was
# not measured separately (its bound below is a guess).
PRECISE_TOL, FAST_TOL = 5e-4, 1e-2


@pytest.mark.parametrize("m,n,k", GEMM_SHAPES)
@pytest.mark.parametrize("hybrid", [False, True])
def test_per_tensor_gemms_match_float64(m, n, k, hybrid, mx_config):
    xq, wq, dyq = _operands(m, n, k, block=False, hybrid=hybrid)
    errors = {}
    for mode, tol in (("none", PRECISE_TOL), ("all", FAST_TOL)):  # split accumulator; cuBLAS fast accumulation
        mx_config(fp8_fast_accum=mode)
        for name, (got, ref) in _three_gemms(xq, wq, dyq).items():
            assert got.dtype == torch.float32
            errors[f"{name} fast_accum={mode}"] = (_rel(got, ref), tol)
    assert all(err <= tol for err, tol in errors.values()), errors


@pytest.mark.parametrize("m,n,k", GEMM_SHAPES)
@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_block_gemms_match_float64(m, n, k, backend, mx_config):
    """Both block GEMMs: the Triton kernel, and cuBLAS's block scaling where torch and the GPU have it."""
    from mxtrain.kernels import registry
    mx_config(fp8_block_gemm=backend)
    xq, wq, dyq = _operands(m, n, k, block=True, hybrid=False)
    errors = {name: _rel(got, ref) for name, (got, ref) in _three_gemms(xq, wq, dyq).items()}
    assert all(err <= PRECISE_TOL for err in errors.values()), (errors, registry._BROKEN)


@pytest.mark.parametrize("block", [False, True])
def test_bias_and_bf16_output(block):
    xq, wq, _ = _operands(512, 768, 1024, block=block, hybrid=False)
    bias = torch.randn(768, device="cuda", dtype=torch.bfloat16)
    got = mx_gemm(xq, wq, out_dtype=torch.bfloat16, bias=bias)
    ref = xq.dequantize_blocked(torch.float64, 1) @ wq.dequantize_blocked(torch.float64, 1).T + bias.double()
    assert got.dtype == torch.bfloat16 and _rel(got, ref) <= 4e-3


def test_unaligned_shapes_run_padded_on_the_tensor_cores(monkeypatch):
    from mxtrain.kernels import float8_gemm

    def no_fallback(*a, **k):
        raise AssertionError("an unaligned FP8 GEMM fell back to the fp32 GEMM of dequantized operands")
    monkeypatch.setattr(float8_gemm, "fallback_gemm", no_fallback)
    torch.manual_seed(2)
    x, w = torch.randn(40, 72, device="cuda"), torch.randn(20, 72, device="cuda")  # N = 20: not a multiple of 16
    xq, wq = quantize_float8(x, "fp8_e4m3"), quantize_float8(w, "fp8_e4m3")
    got = mx_gemm(xq, wq)
    ref = xq.dequantize(torch.float64) @ wq.dequantize(torch.float64).T
    assert got.shape == (40, 20) and _rel(got, ref) <= FAST_TOL  # axes (1, 1): cuBLAS's fast accumulation


@pytest.mark.parametrize("k", [256, 72])  # 72: K padded to 16, the product copied into out
@pytest.mark.parametrize("bias", [False, True])
def test_per_tensor_gemm_writes_out_in_place(k, bias, monkeypatch):
    """``mx_gemm(out=)``: cuBLAS writes the rows of a larger output itself (GroupedLinear's experts), the same bits
    as without ``out``; a padded GEMM's product is copied there."""
    torch.manual_seed(3)
    x, w = torch.randn(48, k, device="cuda"), torch.randn(64, k, device="cuda")
    xq, wq = quantize_float8(x, "fp8_e4m3"), quantize_float8(w, "fp8_e4m3")
    b = torch.randn(64, device="cuda", dtype=torch.bfloat16) if bias else None
    want = mx_gemm(xq, wq, out_dtype=torch.bfloat16, bias=b)
    big = torch.zeros(100, 64, device="cuda", dtype=torch.bfloat16)
    copies = []
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda t, src, *a, **kw: copies.append(t.shape) or
                        real_copy(t, src, *a, **kw))
    got = mx_gemm(xq, wq, out_dtype=torch.bfloat16, bias=b, out=big[16:64])
    monkeypatch.undo()
    assert got.data_ptr() == big[16:64].data_ptr() and torch.equal(big[16:64], want)
    assert not big[:16].any() and not big[64:].any()
    assert (copies == []) == (k % 16 == 0), copies  # in place unless padded


RECIPES = {"current": Float8CurrentScaling(), "delayed": DelayedScaling(amax_history_len=4),
           "block": Float8BlockScaling()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", list(RECIPES))
def test_layernorm_mlp_matches_reference_path(name, dtype, mx_config):
    recipe = RECIPES[name]
    torch.manual_seed(3)
    fast = mxtrain.LayerNormMLP(1024, 2048, activation="swiglu").to("cuda", dtype)
    ref = copy.deepcopy(fast)
    # Loose: the FP8 GEMMs accumulate with reduced precision (fprop with cuBLAS fast accumulation),
    # and an ulp of difference in a GEMM output can move an FP8 rounding of the next operand. Measured
    # on an H200 (2026-11-21, first failing quantity per test only; these bounds were set afterwards and
    # not re-run): output y 1.05e-2 (fp32) and 2.6e-2 (bf16) under current scaling, 6.0e-3 (fp32) delayed.
    tol = 4e-2 if dtype == torch.bfloat16 else 2e-2
    errors = {}
    for step in range(3):
        x = torch.randn(2, 512, 1024, device="cuda", dtype=dtype) * (1 + step)
        dy = torch.randn(2, 512, 1024, device="cuda", dtype=dtype)
        results = []
        for module, backend in ((fast, None), (ref, "reference")):
            if backend:
                mx_config(backend=backend)
            else:
                mx_config(backend="auto")
            module.zero_grad(set_to_none=True)
            xg = x.clone().requires_grad_(True)
            with mxtrain.mx_autocast(recipe=recipe):
                y = module(xg)
            y.backward(dy)
            results.append({"y": y, "x": xg.grad, **{n: p.grad for n, p in module.named_parameters()}})
        mx_config(backend="auto")
        for key, want in results[1].items():
            assert results[0][key].dtype == want.dtype, key
            errors[f"step {step} {key}"] = _rel(results[0][key], want)
    assert all(err <= tol for err in errors.values()), errors  # every error in the message, not just the first
    if name == "delayed":
        assert torch.equal(fast.recipe_state.scale.cpu(), ref.recipe_state.scale.cpu()) or \
            _rel(fast.recipe_state.scale, ref.recipe_state.scale) < 1e-2


@pytest.mark.parametrize("how", ["load_state_dict", "load_recipe_states"])
def test_delayed_state_loaded_from_cpu_follows_module_and_resumes_exactly(how):
    """A DelayedScaling state read from a checkpoint (tensors on the CPU) moves to the module's GPU when
    loaded, so the next update runs where the uninterrupted run's does (the fused GPU update): the
    resumed run's outputs and state equal the uninterrupted run's, bit for bit."""
    from mxtrain.modules._recipe_state import load_recipe_states, recipe_states

    recipe = DelayedScaling()
    torch.manual_seed(0)
    module = mxtrain.LayerNormMLP(256, 512).cuda()
    xs = [torch.randn(64, 256, device="cuda") * (1 + i) for i in range(4)]

    def step(m, x):
        with mxtrain.mx_autocast(recipe=recipe):
            y = m(x)
        y.sum().backward()
        return y.detach()

    for x in xs[:2]:
        step(module, x)
    resumed = copy.deepcopy(module)
    resumed.reset_recipe_state()
    if how == "load_state_dict":
        sd = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in module.state_dict().items()}
        sd["_extra_state"] = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in sd["_extra_state"].items()}
        resumed.load_state_dict(sd)
    else:
        states = {name: {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in d.items()}
                  for name, d in recipe_states(module).items()}
        load_recipe_states(resumed, states)
    assert resumed.recipe_state.scale.device.type == "cuda"
    assert resumed.recipe_state.amax_history.device.type == "cuda"
    for x in xs[2:]:
        assert torch.equal(step(module, x), step(resumed, x))
    for k, v in module.recipe_state.state_dict().items():
        assert (torch.equal(v, resumed.recipe_state.state_dict()[k]) if isinstance(v, torch.Tensor)
                else v == resumed.recipe_state.state_dict()[k]), k
