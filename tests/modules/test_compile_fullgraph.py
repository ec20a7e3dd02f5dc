"""torch.compile(fullgraph=True) on the CPU of a module with mx_autocast inside the compiled function: no graph
break, and the output and every gradient equal eager's bit for bit (the quantizers are registered ops)."""

import pytest
import torch

import mxtrain


def _step(recipe):
    def step(module, x):
        with mxtrain.mx_autocast(recipe=recipe):
            return module(x)
    return step


def _run(fn, module, x, dy):
    xx = x.clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    y = fn(module, xx)
    y.backward(dy)
    return y.detach(), xx.grad, {k: p.grad.clone() for k, p in module.named_parameters()}


@pytest.mark.parametrize("recipe", [mxtrain.MXFP8Recipe(), mxtrain.Float8CurrentScaling()], ids=lambda r: type(r).__name__)
def test_linear_fullgraph_matches_eager_bitwise(recipe):
    torch.manual_seed(0)
    m, x = mxtrain.Linear(64, 40), torch.randn(2, 16, 64)
    dy = torch.randn(2, 16, 40)
    y_e, dx_e, g_e = _run(_step(recipe), m, x, dy)
    torch._dynamo.reset()
    y_c, dx_c, g_c = _run(torch.compile(_step(recipe), fullgraph=True), m, x, dy)
    assert torch.equal(y_c, y_e) and torch.equal(dx_c, dx_e)
    assert g_c.keys() == g_e.keys() and all(torch.equal(g_c[k], g_e[k]) for k in g_e)


def test_generator_seed_names_what_cannot_compile():
    """A seeded MX recipe's stochastic rounding draws from a torch.Generator, which no registered op takes:
    compiling it raises an error naming it (never a silent eager fallback)."""
    recipe = mxtrain.MXRecipe(rounding="stochastic", seed=1)
    m = mxtrain.Linear(32, 16)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="stochastic rounding with a torch.Generator"):
        torch.compile(_step(recipe), fullgraph=True)(m, torch.randn(4, 32))


def test_delayed_scaling_reduction_group_names_what_cannot_compile():
    # DelayedScaling itself compiles (tests/modules/test_compile_delayed.py); its cross-rank amax all-reduce does not
    m = mxtrain.Linear(32, 16)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="DelayedScaling with an amax_reduction_group .* cannot be compiled"):
        torch.compile(_step(mxtrain.DelayedScaling(amax_reduction_group=object())), fullgraph=True)(m, torch.randn(4, 32))
