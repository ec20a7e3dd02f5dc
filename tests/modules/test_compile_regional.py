"""Regional compile (each layer compiled apart, as torchtitan and bench_e2e.py --fsdp do): identical layers share
their compiled graphs. A per-module guard (the module's id, a state the trace made for one module only) would
recompile once per layer, and past dynamo's recompile_limit (8) run the rest eagerly, silently."""

import copy

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import mxtrain

RECIPES = {"delayed": lambda: mxtrain.DelayedScaling(amax_history_len=4),
           "current": lambda: mxtrain.Float8CurrentScaling(), "mxfp8": lambda: mxtrain.MXFP8Recipe()}


def _train(layers, recipe, steps=3):
    """``steps`` steps of the layers in a row, mx_autocast outside the (compiled) layers; per step the output,
    the input's and every parameter's gradient."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        x = torch.randn(8, 32, generator=g).requires_grad_()
        with mxtrain.mx_autocast(recipe=recipe):
            h = x
            for layer in layers:
                h = layer(h)
        h.backward(torch.randn(h.shape, generator=g))
        out.append([h.detach(), x.grad] + [p.grad.clone() for layer in layers for p in layer.parameters()])
        for layer in layers:
            layer.zero_grad(set_to_none=True)
    return out


def _converted(n):
    """``n`` torch Linear layers converted by mxtrain.convert (built without their class's __init__)."""
    model = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(n)))
    mxtrain.convert(model, keep_output_layer=False)
    return list(model)


def _compiles(n, recipe, make=lambda n: [mxtrain.Linear(32, 32) for _ in range(n)]):
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = make(n)
    plain = copy.deepcopy(eager)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = [torch.compile(m, backend=counter) for m in plain]
    want, got = _train(eager, recipe), _train(compiled, recipe)
    for step, (w, c) in enumerate(zip(want, got)):
        for i, (a, b) in enumerate(zip(w, c)):
            assert torch.equal(a, b), (step, i)
    for e, c in zip(eager, plain):
        if e.recipe_state is not None:
            assert all(torch.equal(a, b) for a, b in zip(e.recipe_state.tensors(), c.recipe_state.tensors()))
    return counter.frame_count


@pytest.mark.parametrize("name", list(RECIPES))
def test_layers_compiled_apart_share_their_graphs(name):
    recipe = RECIPES[name]()
    few, many = _compiles(2, recipe), _compiles(10, recipe)  # 10 > dynamo's recompile_limit of 8
    assert many == few, (few, many)


def test_converted_layers_compiled_apart_share_their_graphs():
    recipe = RECIPES["delayed"]()
    assert _compiles(2, recipe, _converted) == _compiles(10, recipe, _converted)


def _fullgraph_compiles(n, recipe, init: bool):
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = [mxtrain.Linear(32, 32) for _ in range(n)]
    plain = copy.deepcopy(eager)
    if init:
        assert mxtrain.init_recipe_state(torch.nn.ModuleList(plain), recipe) == [str(i) for i in range(n)]
    counter = CompileCounterWithBackend("aot_eager")
    compiled = [torch.compile(m, backend=counter, fullgraph=True) for m in plain]
    for step, (w, c) in enumerate(zip(_train(eager, recipe), _train(compiled, recipe))):
        for i, (a, b) in enumerate(zip(w, c)):
            assert torch.equal(a, b), (step, i)
    return counter.frame_count


def test_init_recipe_state_lets_fullgraph_layers_compiled_apart_share_their_graphs():
    # fullgraph=True leaves no graph break to make a layer's state at: each fresh layer was traced again (past
    # dynamo's recompile_limit an error); states made before the first step share the graphs, same bits
    recipe = RECIPES["delayed"]()
    assert _fullgraph_compiles(6, recipe, init=False) > _fullgraph_compiles(2, recipe, init=False)
    assert _fullgraph_compiles(6, recipe, init=True) == _fullgraph_compiles(2, recipe, init=True)


def test_init_recipe_state_is_a_no_op_for_stateless_recipes_and_needs_a_recipe():
    layers = torch.nn.Sequential(mxtrain.Linear(32, 32), mxtrain.LayerNormMLP(32, 64))
    assert mxtrain.init_recipe_state(layers, mxtrain.Float8CurrentScaling()) == []
    assert all(m.recipe_state is None for m in layers)
    with pytest.raises(ValueError, match="no recipe given"):
        mxtrain.init_recipe_state(layers)
    with mxtrain.mx_autocast(recipe=RECIPES["delayed"]()):
        assert mxtrain.init_recipe_state(layers) == ["0", "1"]
    assert all(m.recipe_state is not None for m in layers)
