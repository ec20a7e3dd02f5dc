"""mxtrain.GroupedLinear on CUDA: the grouped bf16 GEMM path (MX) and the per-expert FP8 GEMMs against a loop
of mxtrain.Linear (close, not bit for bit: the grouped GEMM accumulates in another order)."""

import importlib
import warnings

import pytest
import torch

import mxtrain
from mxtrain import config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

gl_module = importlib.import_module("mxtrain.modules.grouped_linear")
# MXFP4 with deterministic gradients (its default rounds them stochastically): the grouped cast and the loop draw
# different random bits
RECIPES = {"mxfp8": mxtrain.MXFP8Recipe, "mxfp4": lambda: mxtrain.MXFP4Recipe(grad_rounding=None),
           "fp8_current": mxtrain.Float8CurrentScaling, "fp8_delayed": mxtrain.DelayedScaling, "fp8_block": mxtrain.Float8BlockScaling}


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


# ragged: MX casts and GEMMs per expert, as the loop; aligned (multiples of 32): one cast a tensor, grouped GEMMs
SPLITS = {"ragged": [0, 700, 37, 0, 1290, 128, 5, 900], "aligned": [0, 704, 64, 0, 1280, 128, 32, 896]}


@pytest.mark.parametrize("splits", list(SPLITS))
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_matches_loop_of_linears_on_cuda(recipe, bias, splits, monkeypatch):
    grouped_calls = []
    real = gl_module._grouped_mm_fn
    monkeypatch.setattr(gl_module, "_grouped_mm_fn", lambda a, b, **kw: grouped_calls.append(1) or real(a, b, **kw))
    splits = SPLITS[splits]
    torch.manual_seed(0)
    grouped = mxtrain.GroupedLinear(8, 512, 384, bias=bias).cuda().bfloat16()
    linears = [mxtrain.Linear(512, 384, bias=bias).cuda().bfloat16() for _ in splits]
    with torch.no_grad():
        for e, lin in enumerate(linears):
            lin.weight.copy_(getattr(grouped, f"weight{e}"))
            if bias:
                lin.bias.copy_(getattr(grouped, f"bias{e}"))
    x = torch.randn(sum(splits), 512, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(sum(splits), 384, device="cuda", dtype=torch.bfloat16)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the grouped GEMM must not fall back
        with mxtrain.mx_autocast(recipe=RECIPES[recipe]()):
            y1 = grouped(x1, splits)
            y2 = torch.cat([lin(xe) for lin, xe, n in zip(linears, x2.split(splits), splits) if n])
        y1.backward(dy)
        y2.backward(dy)
    assert not gl_module._GROUPED_MM_FAILED
    aligned_mx = all(n % 32 == 0 for n in splits) and recipe.startswith("mx")
    assert len(grouped_calls) == (3 if aligned_mx else 0)  # fprop, dgrad, wgrad
    assert _rel(y1, y2) < 1e-2 and _rel(x1.grad, x2.grad) < 1e-2
    for e, (lin, n) in enumerate(zip(linears, splits)):
        got = getattr(grouped, f"weight{e}").grad
        if n == 0:
            assert torch.count_nonzero(got) == 0
        else:
            assert _rel(got, lin.weight.grad) < 1e-2


FP8_SPLITS = {"aligned16": [0, 704, 64, 0, 1280, 128, 32, 896], "ragged": [0, 700, 37, 0, 1290, 128, 5, 900]}


@pytest.mark.parametrize("splits", list(FP8_SPLITS))
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("recipe_name", ["fp8_current", "fp8_delayed"])
def test_float8_grouped_gemm_matches_per_expert_loop(recipe_name, fmt, splits, monkeypatch):
    """Per-tensor FP8 on sm_90: the grouped casts and torch._scaled_grouped_mm (fprop; dgrad with E4M3 gradients;
    wgrad with E4M3 gradients and token counts multiples of 16) against the same module's per-expert scaled_mm
    loop (MXTRAIN_GROUPED_MM=0), step after step (DelayedScaling: its histories too)."""
    if torch.cuda.get_device_capability() != (9, 0) or gl_module._scaled_grouped_mm_fn is None:
        pytest.skip("torch._scaled_grouped_mm's FP8 row-wise kernels run on sm_90")
    calls = []
    real = gl_module._scaled_grouped_mm_fn
    monkeypatch.setattr(gl_module, "_scaled_grouped_mm_fn",
                        lambda *a, **kw: calls.append(a[1].ndim) or real(*a, **kw))
    splits = FP8_SPLITS[splits]
    make = {"fp8_current": mxtrain.Float8CurrentScaling, "fp8_delayed": mxtrain.DelayedScaling}[recipe_name]
    torch.manual_seed(0)
    fast = mxtrain.GroupedLinear(8, 512, 384).cuda().bfloat16()
    loop = mxtrain.GroupedLinear(8, 512, 384).cuda().bfloat16()
    loop.load_state_dict(fast.state_dict())
    for step in range(3):
        x = torch.randn(sum(splits), 512, device="cuda", dtype=torch.bfloat16) * (1 + step)
        dy = torch.randn(sum(splits), 384, device="cuda", dtype=torch.bfloat16)
        outs = []
        for module, grouped_mm in ((fast, "auto"), (loop, "0")):
            xi = x.clone().requires_grad_()
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # the grouped FP8 GEMM must not fall back
                with config.override(grouped_mm=grouped_mm, grouped_fp8_casts=True), \
                        mxtrain.mx_autocast(recipe=make(fp8_format=fmt)):
                    y = module(xi, splits)
                    y.backward(dy)
            outs.append((y, xi.grad, [w.grad.clone() for w in module.weights], [b.grad.clone() for b in module.biases]))
            module.zero_grad()
        (y1, dx1, dw1, db1), (y2, dx2, dw2, db2) = outs
        assert _rel(y1, y2) < 1e-2 and _rel(dx1, dx2) < 1e-2
        for e, n in enumerate(splits):
            assert (_rel(dw1[e], dw2[e]) < 1e-2) if n else torch.count_nonzero(dw1[e]) == 0
            torch.testing.assert_close(db1[e], db2[e], rtol=1e-2, atol=1e-2)
    assert not gl_module._SCALED_GROUPED_FAILED
    e4m3, aligned = fmt == "e4m3", splits == FP8_SPLITS["aligned16"]
    # DelayedScaling's first step casts each expert alone (fresh slots): its GEMMs are per expert too
    steps = 2 if recipe_name == "fp8_delayed" else 3
    # a step: fprop; with E4M3 gradients dgrad (both: a 3-D mat_b) and, counts multiples of 16, wgrad (2-D mat_b)
    assert calls.count(3) == steps * (2 if e4m3 else 1), calls
    assert calls.count(2) == (steps if e4m3 and aligned else 0), calls
    if recipe_name == "fp8_delayed":
        s1, s2 = fast.recipe_state, loop.recipe_state
        assert s1.slots == s2.slots
        torch.testing.assert_close(s1.scale, s2.scale, rtol=0, atol=0)
