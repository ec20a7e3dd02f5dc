"""Activation checkpointing of mxtrain modules: the recompute leaves recipe state alone, the MX / FP8
operands saved for backward are freed, and ``mxtrain.checkpoint`` recomputes exactly what its forward did."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import mxtrain
from mxtrain.modules._common import set_generator_states

DELAYED = "fp8_delayed:amax_history_len=8"


class Block(torch.nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.qkv = mxtrain.LayerNormLinear(d, d)
        self.proj = mxtrain.Linear(d, d)
        self.mlp = mxtrain.LayerNormMLP(d, 2 * d)

    def forward(self, x):
        x = x + self.proj(torch.relu(self.qkv(x)))
        return x + self.mlp(x)


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


def _block(seed=0, device="cpu"):
    torch.manual_seed(seed)
    return Block().to(device)


def _x(step, tokens=64, d=64, device="cpu"):
    return torch.randn(tokens, d, generator=torch.Generator().manual_seed(step)).to(device)


def _inside(recipe, block, x):  # mx_autocast inside the checkpointed function, as docs/distributed.md says
    with mxtrain.mx_autocast(recipe=recipe):
        return block(x)


def _step(block, recipe, x, mode):
    if mode == "none":
        with mxtrain.mx_autocast(recipe=recipe):
            y = block(x)
    elif mode == "torch":
        y = torch_checkpoint(_inside, recipe, block, x, use_reentrant=False)
    else:
        with mxtrain.mx_autocast(recipe=recipe):  # mxtrain.checkpoint carries the recipe into the recompute
            y = mxtrain.checkpoint(block, x)
    loss = y.square().mean()
    loss.backward()
    grads = [p.grad.clone() for p in block.parameters()]
    block.zero_grad(set_to_none=True)
    return loss.item(), grads


def _states(block):
    return {n: m.recipe_state.state_dict() for n, m in block.named_modules() if getattr(m, "recipe_state", None)}


def _same_states(a, b):
    assert a.keys() == b.keys()
    for name in a:
        for k, v in a[name].items():
            assert (torch.equal(v, b[name][k]) if isinstance(v, torch.Tensor) else v == b[name][k]), (name, k)


@pytest.mark.parametrize("mode", ["torch", "mxtrain"])
def test_recompute_leaves_delayed_scaling_state_untouched(mode):
    """4 steps under DelayedScaling: 3 updates per module (not 7), after every step the same state (histories,
    scales, amaxes recorded by forward and backward) and bit-identical losses and gradients as without
    checkpointing."""
    recipe = mxtrain.recipe_from_string(DELAYED)
    ref, ck = _block(), _block()
    for step in range(4):
        x = _x(step)
        want = _step(ref, recipe, x, "none")
        got = _step(ck, recipe, x, mode)
        assert got[0] == want[0]
        assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
        _same_states(_states(ref), _states(ck))
    assert ck.mlp.recipe_state.updates == 3


def _checkpointed(block, recipe, x):
    with mxtrain.mx_autocast(recipe=recipe):
        return mxtrain.checkpoint(block, x)


def test_no_grad_forward_leaves_state_untouched():
    """Evaluation forwards (no_grad) neither update the amax histories nor record amaxes (Transformer Engine
    also skips the update without grad): training with evaluations in between is bit-identical."""
    recipe = mxtrain.recipe_from_string(DELAYED)
    plain, evaluated = _block(), _block()
    with torch.no_grad(), mxtrain.mx_autocast(recipe=recipe):
        evaluated(_x(99) * 100)  # before any training step: no state is kept
    assert all(getattr(m, "recipe_state", None) is None for m in evaluated.modules())
    for step in range(3):
        want = _step(plain, recipe, _x(step), "none")
        before = _states(evaluated)
        with torch.no_grad(), mxtrain.mx_autocast(recipe=recipe):
            evaluated(_x(100 + step) * 100)  # large amaxes that would change the next scales
        _same_states(before, _states(evaluated))
        got = _step(evaluated, recipe, _x(step), "none")
        assert got[0] == want[0] and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    _same_states(_states(plain), _states(evaluated))


class _Allocations(TorchDispatchMode):
    """Weak references to every tensor an op returns inside the block."""

    def __init__(self):
        super().__init__()
        self.refs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.refs += [weakref.ref(t) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out

    def kept_bytes(self, exclude) -> int:
        """Bytes of the storages made inside the block that are still alive (those of ``exclude`` left out)."""
        gc.collect()
        skip = {t.untyped_storage().data_ptr() for t in exclude}
        storages = {}
        for ref in self.refs:
            t = ref()
            if t is not None and t.untyped_storage().data_ptr() not in skip:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(storages.values())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", ["mxfp8", DELAYED])
def test_checkpointed_block_frees_quantized_operands(spec, device):
    """Bytes kept from a block's forward to its backward: without checkpointing the MX / FP8 operands (codes
    and scales) and activations; with it, nothing beyond the output (the operands used to ride on the autograd
    ctx, out of checkpointing's reach). Gradients are the same either way."""
    recipe = mxtrain.recipe_from_string(spec)
    x = _x(0, tokens=256, device=device).requires_grad_(True)
    kept, grads = {}, {}
    for mode in ("none", "mxtrain", "torch"):
        block = _block(device=device)  # each mode's first step (DelayedScaling: scale 1, then 1 byte per element)
        allocations = _Allocations()
        with allocations:
            if mode == "none":
                with mxtrain.mx_autocast(recipe=recipe):
                    y = block(x)
            elif mode == "torch":
                y = torch_checkpoint(_inside, recipe, block, x, use_reentrant=False)
            else:
                y = _checkpointed(block, recipe, x)
        # the output and the modules' recipe state (amax histories, scales) are not kept for backward
        state = [t for m in block.modules() if getattr(m, "recipe_state", None) is not None
                 for t in m.recipe_state.tensors()]
        kept[mode] = allocations.kept_bytes(exclude=[y, *state])
        y.square().mean().backward()
        grads[mode] = [x.grad.clone()] + [p.grad.clone() for p in block.parameters()]
        x.grad = None
    # without checkpointing: at least the 1-byte codes of the three wgrad inputs (qkv, proj, fc1: 256 x 64 each)
    assert kept["none"] >= 3 * 256 * 64
    if device == "cpu":
        assert kept["torch"] == 0, kept
        # mxtrain.checkpoint keeps only DelayedScaling's scale snapshot (4 bytes per slot, made at the forward's start)
        snapshots = sum(4 * len(m.recipe_state.slots) for m in block.modules()
                        if getattr(m, "recipe_state", None) is not None)
        assert kept["mxtrain"] == snapshots, kept
        for mode in ("mxtrain", "torch"):
            assert all(torch.equal(a, b) for a, b in zip(grads[mode], grads["none"])), mode
    else:  # CUDA: fused casts and GEMMs (whose reductions may be ordered differently run to run)
        assert kept["torch"] <= kept["none"] // 100 and kept["mxtrain"] <= kept["none"] // 100, kept
        for mode in ("mxtrain", "torch"):
            for a, b in zip(grads[mode], grads["none"]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    print(f"\n{spec}: bytes kept for backward: {kept['none']} without checkpointing, {kept['mxtrain']} with")


def test_mxtrain_checkpoint_carries_the_recipe():
    """An mx_autocast around the call is gone when backward recomputes: mxtrain.checkpoint still recomputes in
    MX (gradients equal the uncheckpointed run's), torch's checkpoint alone recomputes in high precision."""
    recipe = mxtrain.MXFP8Recipe()
    block = _block()
    x = _x(1)
    want = _step(block, recipe, x, "none")
    got = _step(block, recipe, x, "mxtrain")
    assert got[0] == want[0] and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    with mxtrain.mx_autocast(recipe=recipe):
        y = torch_checkpoint(block, x, use_reentrant=False)
    with pytest.raises(RuntimeError):  # the recompute saves other tensors than the forward did
        y.square().mean().backward()


def test_mxtrain_checkpoint_stochastic_rounding_recomputes_the_same_bits():
    """Stochastic rounding in the forward: the recompute draws the bits its forward drew, and the generator
    goes on afterwards as if nothing was recomputed (two steps: the second starts where the first left it)."""
    recipe = mxtrain.recipe_from_string("mxfp4:rounding=stochastic,seed=7")
    results = {}
    for mode in ("none", "mxtrain"):
        set_generator_states([])
        block = _block()
        results[mode] = [_step(block, recipe, _x(s), mode) for s in range(2)]
    for (la, ga), (lb, gb) in zip(results["none"], results["mxtrain"]):
        assert la == lb and all(torch.equal(a, b) for a, b in zip(ga, gb))


def test_mxtrain_checkpoint_replays_the_forward_scales():
    """A module run twice in a step (its second forward updates the DelayedScaling scales): the recompute of
    the first call still casts with the scales the first call used."""
    recipe = mxtrain.recipe_from_string(DELAYED)

    def run(mode):
        torch.manual_seed(0)
        lin = mxtrain.Linear(64, 64)
        out = []
        for step in range(3):
            x = _x(step)
            with mxtrain.mx_autocast(recipe=recipe):
                h = mxtrain.checkpoint(lin, x) if mode == "mxtrain" else lin(x)
                y = lin(torch.relu(h) * 3)
            y.square().mean().backward()
            out.append(lin.weight.grad.clone())
            lin.zero_grad(set_to_none=True)
        return out

    assert all(torch.equal(a, b) for a, b in zip(run("mxtrain"), run("none")))


def test_mxtrain_checkpoint_arguments():
    """Keyword arguments reach ``fn``; a first argument that is not callable is refused with the reason."""
    recipe = mxtrain.MXFP8Recipe()
    lin = mxtrain.Linear(64, 64)
    x = _x(2).requires_grad_(True)

    def scaled(t, *, factor):
        return lin(t) * factor

    with mxtrain.mx_autocast(recipe=recipe):
        y = mxtrain.checkpoint(scaled, x, factor=3.0)
        want = lin(x) * 3.0
    assert torch.equal(y, want)
    y.sum().backward()
    assert x.grad is not None
    with pytest.raises(TypeError, match="callable"):
        mxtrain.checkpoint(x, lin)


class _Checkpointed(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return mxtrain.checkpoint(self.inner, x)


def _checkpointed_step(recipe, compile_kwargs=None):
    block = _Checkpointed(_block(3))
    fn = block if compile_kwargs is None else torch.compile(block, **compile_kwargs)
    torch.manual_seed(4)
    x = torch.randn(2, 8, 64, requires_grad=True)
    with mxtrain.mx_autocast(enabled=recipe is not None, recipe=recipe):
        y = fn(x)
    y.float().square().mean().backward()
    return [y.detach(), x.grad] + [p.grad for p in block.parameters()]


@pytest.mark.parametrize("recipe", [None, "mxfp8", "fp8_current", "fp8_block"])
def test_checkpoint_inside_a_compiled_fullgraph_block_gives_eagers_bits(recipe):
    # mxtrain.checkpoint gave torch's checkpoint a context_fn of its own, which dynamo refuses (it failed every
    # compile of a block using it, whatever the recipe); traced, the compiled backward recomputes from the
    # forward's graph values
    recipe = None if recipe is None else mxtrain.recipe_from_string(recipe)
    eager = _checkpointed_step(recipe)
    torch._dynamo.reset()
    compiled = _checkpointed_step(recipe, dict(fullgraph=True, backend="aot_eager"))
    for i, (c, e) in enumerate(zip(compiled, eager)):
        assert torch.equal(c, e), i


def test_delayed_scaling_checkpoint_in_a_compiled_block_runs_eagerly():
    # its amax records are side effects a traced checkpoint region refuses: the region runs eagerly (one graph
    # break) with mxtrain.checkpoint's contexts; fullgraph=True refuses the break
    recipe = mxtrain.recipe_from_string(DELAYED)
    eager = _checkpointed_step(recipe)
    torch._dynamo.reset()
    compiled = _checkpointed_step(recipe, dict(backend="aot_eager"))
    for i, (c, e) in enumerate(zip(compiled, eager)):
        assert torch.equal(c, e), i
    torch._dynamo.reset()
    with pytest.raises(Exception, match="disable"):
        _checkpointed_step(recipe, dict(fullgraph=True, backend="aot_eager"))
