"""DelayedScaling's first step: a slot without history takes its scale from the tensor it casts.

With a scale of 1 there (Transformer Engine's start), small gradients underflow in E5M2; the zero gradient
then flows to the layers below, which record an amax of 0, and only one more layer trains per step."""

import pytest
import torch
import torch.nn as nn

import mxtrain
from mxtrain.modules._recipe_state import recipe_states


def _stack(depth=5, width=64, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[mxtrain.Linear(width, width, bias=False) for _ in range(depth)])


def _step(model, recipe, x, scale=1e-7):
    with mxtrain.mx_autocast(recipe=recipe):
        y = model(x)
    (y.float().sum() * scale).backward()  # gradients far below E5M2's smallest subnormal at scale 1


@pytest.mark.parametrize("module", ["Linear", "LayerNormMLP"])
def test_every_layer_gets_a_gradient_on_the_first_step(module):
    torch.manual_seed(0)
    if module == "Linear":
        model = _stack()
    else:
        model = nn.Sequential(*[mxtrain.LayerNormMLP(64, 128, normalization="RMSNorm") for _ in range(4)])
    x = torch.randn(32, 64, requires_grad=True)
    _step(model, mxtrain.DelayedScaling(), x)
    grads = [p.grad for p in model.parameters() if p.dim() == 2]
    assert all(g is not None and g.abs().max() > 0 for g in grads), [float(g.abs().max()) for g in grads]
    assert x.grad.abs().max() > 0


def test_first_step_scales_equal_current_scaling_and_later_steps_are_delayed():
    recipe = mxtrain.DelayedScaling(amax_history_len=4)
    m_d, m_c = _stack(depth=2), _stack(depth=2)
    x = torch.randn(16, 64)
    _step(m_d, recipe, x.clone().requires_grad_(True))
    _step(m_c, mxtrain.Float8CurrentScaling(), x.clone().requires_grad_(True))
    for pd, pc in zip(m_d.parameters(), m_c.parameters()):  # step 0: the same casts as current scaling
        torch.testing.assert_close(pd.grad, pc.grad, rtol=0, atol=0)
    state = m_d[0].recipe_state
    # the second forward updates the histories: now every slot has one and casts with its delayed scale
    with mxtrain.mx_autocast(recipe=recipe):
        m_d(x)
    assert not any(state.fresh(s) for s in state.slots)
    states = recipe_states(m_d)
    assert all(d["seasoned"] == d["slots"] for d in states.values())


def test_seasoned_slots_survive_a_checkpoint_and_old_checkpoints_load():
    recipe = mxtrain.DelayedScaling(amax_history_len=4)
    model, x = _stack(depth=2), torch.randn(8, 64, requires_grad=True)
    for _ in range(2):
        _step(model, recipe, x)
    d = model[0].recipe_state.state_dict()
    fresh = type(model[0].recipe_state).from_state_dict(d)
    assert fresh._seasoned == model[0].recipe_state._seasoned == set(d["slots"])
    d.pop("seasoned")  # a checkpoint from before the key: the slots with a history count as seasoned
    old = type(model[0].recipe_state).from_state_dict(d)
    assert old._seasoned == set(d["slots"])


def test_update_after_a_history_length_change_keeps_the_recorded_amax():
    """The history is reallocated when amax_history_len changes; the update writes the new one."""
    state = mxtrain.DelayedScaling(amax_history_len=2).make_state()
    state.ensure_slots([("input", "fp8_e4m3")], torch.device("cpu"))
    state.record("input", torch.tensor(3.0))
    state.update(mxtrain.DelayedScaling(amax_history_len=2))
    state.record("input", torch.tensor(5.0))
    state.update(mxtrain.DelayedScaling(amax_history_len=8))
    assert state.amax_history.shape[0] == 8
    assert state.amax_history[:2, 0].tolist() == [5.0, 3.0]
    assert torch.equal(state.scale, torch.tensor([448.0 / 5.0]))


def test_compiled_module_under_torch_checkpoint_updates_once_per_step():
    """torch.utils.checkpoint recomputes a compiled DelayedScaling module in backward: the recompute must not
    run the state update again (one update a step, as eager)."""
    from torch.utils.checkpoint import checkpoint

    recipe = mxtrain.DelayedScaling(amax_history_len=4)

    def run(compiled):
        torch.manual_seed(0)
        m = mxtrain.Linear(32, 16)
        fn = torch.compile(m, backend="aot_eager") if compiled else m
        counts = []
        def block(f, x):  # mx_autocast inside the checkpointed function, so that the recompute has it too
            with mxtrain.mx_autocast(recipe=recipe):
                return f(x)
        for step in range(3):
            x = torch.randn(8, 32, requires_grad=True)
            # the first step eager, as compiled DelayedScaling wants
            y = checkpoint(block, fn if step else m, x, use_reentrant=False)
            y.sum().backward()
            counts.append(m.recipe_state.updates)
        return counts, m.recipe_state.amax_history.clone()

    torch._dynamo.reset()
    if torch.cuda.is_available():
        # dynamo saves the CUDA RNG state around a trace, which initialises CUDA: inside a checkpoint's forward
        # torch.utils.checkpoint refuses that (CPU tensors on a machine with a GPU)
        torch.cuda.init()
    eager, compiled = run(False), run(True)
    assert compiled[0] == eager[0] == [0, 1, 2]
    assert torch.equal(compiled[1], eager[1])


def test_evaluation_before_any_update_takes_the_recipes_margin():
    """A fresh slot's scale follows the recipe (margin, power-of-2) also in an evaluation before training."""
    recipe = mxtrain.DelayedScaling(margin=2)
    torch.manual_seed(0)
    m, x = mxtrain.Linear(32, 16), torch.randn(8, 32)
    with torch.no_grad(), mxtrain.mx_autocast(recipe=recipe):
        y = m(x)
    with mxtrain.mx_autocast(recipe=recipe):
        y_train = m(x)  # the training forward's first step casts with the same first-step scales
    assert torch.equal(y, y_train.detach())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_state_made_by_a_gather_is_laid_out_as_a_forwards(device):
    """FSDP2's pre-all-gather may be the first to make a module's state (module.gather_quantizers): it must be
    where the parameters are, with every GEMM's slots, as a training forward makes it (a CPU state made
    there broke NCCL's amax all-reduce in the update)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    recipe = mxtrain.DelayedScaling(amax_history_len=4)
    gathered, forward = (mxtrain.LayerNormMLP(64, 128, normalization="RMSNorm").to(device) for _ in range(2))
    forward.load_state_dict(gathered.state_dict())
    gathered.gather_quantizers(recipe, "fc1")
    x = torch.randn(8, 64, device=device)
    with mxtrain.mx_autocast(recipe=recipe):
        forward(x)
    made, ref = gathered.recipe_state, forward.recipe_state
    assert made.scale.device.type == ref.scale.device.type == device
    assert list(made.slots) == list(ref.slots), (list(made.slots), list(ref.slots))
