"""mxtrain.GroupedLinear on CUDA: the grouped bf16 GEMM path (MX) and the per-expert FP8 GEMMs against a loop
of mxtrain.Linear (close, not bit for bit: the grouped GEMM accumulates in another order)."""

import importlib
import warnings

import pytest
import torch

import mxtrain

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


def _pair(bias: bool):
    """A GroupedLinear(8, 512, 384) on CUDA in bf16 and 8 Linears holding its weights (and biases)."""
    torch.manual_seed(0)
    grouped = mxtrain.GroupedLinear(8, 512, 384, bias=bias).cuda().bfloat16()
    linears = [mxtrain.Linear(512, 384, bias=bias).cuda().bfloat16() for _ in range(8)]
    with torch.no_grad():
        for e, lin in enumerate(linears):
            lin.weight.copy_(getattr(grouped, f"weight{e}"))
            if bias:
                lin.bias.copy_(getattr(grouped, f"bias{e}"))
    return grouped, linears


@pytest.mark.parametrize("splits", list(SPLITS))
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_matches_loop_of_linears_on_cuda(recipe, bias, splits, monkeypatch):
    grouped_calls = []
    real = gl_module._grouped_mm_fn
    monkeypatch.setattr(gl_module, "_grouped_mm_fn", lambda a, b, **kw: grouped_calls.append(1) or real(a, b, **kw))
    splits = SPLITS[splits]
    grouped, linears = _pair(bias)
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


def test_delayed_scaling_grouped_casts_follow_the_loop_over_steps(monkeypatch):
    """DelayedScaling, aligned counts: from the second step the grouped casts (slot scales, amaxes recorded) run;
    every step stays close to the loop of Linears and the histories of the experts with tokens agree."""
    from mxtrain.kernels import registry
    grouped_casts, real_run = [], registry.run
    monkeypatch.setattr(registry, "run", lambda op, *a, **k: (op == "grouped_float8_cast" and grouped_casts.append(op))
                        or real_run(op, *a, **k))
    splits = SPLITS["aligned"]
    grouped, linears = _pair(bias=False)
    recipe = mxtrain.DelayedScaling(amax_history_len=4)
    for step in range(3):
        x = torch.randn(sum(splits), 512, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(sum(splits), 384, device="cuda", dtype=torch.bfloat16)
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        with mxtrain.mx_autocast(recipe=recipe):
            y1 = grouped(x1, splits)
            y2 = torch.cat([lin(xe) for lin, xe in zip(linears, x2.split(splits))])
        y1.backward(dy)
        y2.backward(dy)
        assert _rel(y1, y2) < 1e-2 and _rel(x1.grad, x2.grad) < 1e-2, step
    assert len(grouped_casts) == 2 * 3  # steps 2 and 3: the weights, x, dy
    state = grouped.recipe_state
    for e, (lin, n) in enumerate(zip(linears, splits)):
        if n:
            i, j = state.slots[f"expert{e}.input"], lin.recipe_state.slots["input"]
            torch.testing.assert_close(state.amax_history[:, i], lin.recipe_state.amax_history[:, j])


def test_swiglu_records_its_maxima_for_the_fp8_casts_around_it(monkeypatch):
    """fc1 -> mxtrain.gated_activation -> fc2 under Float8CurrentScaling with 32-aligned counts: the SwiGLU's CUDA
    kernels record the row maxima of its output and of its input gradient, fc2's input cast and fc1's output-gradient
    cast take them (no amax pass over those tensors), and every result equals the run with the records dropped,
    bit for bit."""
    from mxtrain.kernels import registry
    from mxtrain.modules import activations

    casts, real_run = [], registry.run
    monkeypatch.setattr(registry, "run", lambda op, call, *a, **k: (
        op == "grouped_float8_cast" and casts.append((tuple(call.x.shape), call.row_amax is not None)))
        or real_run(op, call, *a, **k))
    splits = SPLITS["aligned"]
    torch.manual_seed(0)
    fc1 = mxtrain.GroupedLinear(8, 512, 2 * 384, bias=False).cuda().bfloat16()
    fc2 = mxtrain.GroupedLinear(8, 384, 512, bias=False).cuda().bfloat16()
    x = torch.randn(sum(splits), 512, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(sum(splits), 512, device="cuda", dtype=torch.bfloat16)

    def run():
        xi = x.clone().requires_grad_()
        with mxtrain.mx_autocast(recipe=mxtrain.Float8CurrentScaling()):
            y = fc2(mxtrain.gated_activation(fc1(xi, splits), "swiglu"), splits)
        y.backward(dy)
        out = [y.detach(), xi.grad] + [p.grad.clone() for p in (*fc1.parameters(), *fc2.parameters())]
        for p in (*fc1.parameters(), *fc2.parameters()):
            p.grad = None
        return out

    with_records = run()
    assert [c for c in casts if c[1]] == [((sum(splits), 384), True), ((sum(splits), 768), True)]
    casts.clear()
    monkeypatch.setattr(activations, "record_row_maxima", lambda t, m: None)  # nothing recorded
    without = run()
    assert not any(c[1] for c in casts)
    assert all(torch.equal(a, b) for a, b in zip(with_records, without))
