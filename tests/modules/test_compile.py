"""torch.compile (default inductor backend, CPU) of the MX modules under mx_autocast matches eager.

Kept small: compiling is slow on a 2-core machine. Graph breaks are allowed; the
count is printed (pytest -s) and recorded in docs/modules.md.
"""

import pytest
import torch

import mxtrain

from .reference import run_module

MODULES = {
    "Linear": (lambda: mxtrain.Linear(64, 40), (2, 16, 64)),
    "LayerNormLinear": (lambda: mxtrain.LayerNormLinear(64, 40, normalization="RMSNorm",
                                                        return_layernorm_output=True), (2, 16, 64)),
    "LayerNormMLP": (lambda: mxtrain.LayerNormMLP(64, 48, activation="swiglu"), (2, 16, 64)),
}


def _assert_match(out_c, grads_c, out_e, grads_e):
    outs_c = out_c if isinstance(out_c, tuple) else (out_c,)
    outs_e = out_e if isinstance(out_e, tuple) else (out_e,)
    for a, b in zip(outs_c, outs_e):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    grads_c = {k.removeprefix("_orig_mod."): v for k, v in grads_c.items()}
    assert grads_c.keys() == grads_e.keys()
    for name, g in grads_e.items():
        torch.testing.assert_close(grads_c[name], g, rtol=1e-6, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("name", list(MODULES))
def test_compiled_module_matches_eager(name):
    make, shape = MODULES[name]
    torch.manual_seed(0)
    m = make()
    x = torch.randn(shape)
    recipe = mxtrain.MXFP8Recipe()
    with torch.no_grad():
        y = m(x)
    dy = torch.randn_like(y[0] if isinstance(y, tuple) else y)
    out_e, grads_e = run_module(m, x, dy, recipe)

    torch._dynamo.reset()
    with mxtrain.mx_autocast(recipe=recipe):
        explanation = torch._dynamo.explain(m)(x)
    print(f"\n{name}: {explanation.graph_count} graph(s), {explanation.graph_break_count} graph break(s)"
          + "".join(f"\n  break: {b.reason}" for b in explanation.break_reasons))
    torch._dynamo.reset()

    compiled = torch.compile(m)
    out_c, grads_c = run_module(compiled, x, dy, recipe)
    _assert_match(out_c, grads_c, out_e, grads_e)


def test_compiled_module_follows_the_active_recipe():
    """The compiled code is guarded on the autocast state: switching recipe (or leaving autocast) recompiles."""
    torch.manual_seed(0)
    m = mxtrain.Linear(64, 32)
    x = torch.randn(8, 64)
    torch._dynamo.reset()
    compiled = torch.compile(m)
    with torch.no_grad():
        for recipe in (mxtrain.MXFP8Recipe(), None, mxtrain.MXFP4Recipe()):
            with mxtrain.mx_autocast(enabled=recipe is not None, recipe=recipe):
                torch.testing.assert_close(compiled(x), m(x), rtol=1e-6, atol=1e-6)
