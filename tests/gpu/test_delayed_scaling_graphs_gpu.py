"""DelayedScaling on CUDA: a Linear training step captured with mxtrain.make_graphed_step replays equal to eager
steps bit for bit, its state update reads nothing on the host (set_sync_debug_mode("error")), and the compiled
step (fullgraph) equals eager."""

import pytest
import torch

import mxtrain

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _training(recipe):
    torch.manual_seed(0)
    f = dict(device="cuda", dtype=torch.bfloat16)
    model = mxtrain.Linear(256, 128, **f)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
    x = torch.empty(64, 256, **f)

    def step():
        with mxtrain.mx_autocast(recipe=recipe):
            loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss
    return model, x, step


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_graphed_delayed_linear_equals_eager(algo):
    recipe = mxtrain.DelayedScaling(amax_history_len=4, amax_compute_algo=algo)
    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [torch.randn(64, 256, device="cuda", generator=g).bfloat16() for _ in range(6)]
    warmup = 2
    model_e, x_e, step_e = _training(recipe)
    losses_e = []
    for b in [batches[0]] * (warmup - 1) + batches:
        x_e.copy_(b)
        losses_e.append(step_e().clone())

    model_g, x_g, step_g = _training(recipe)
    x_g.copy_(batches[0])
    replay = mxtrain.make_graphed_step(step_g, warmup=warmup)
    losses_g = []
    for b in batches[1:]:
        x_g.copy_(b)
        losses_g.append(replay().clone())
    torch.cuda.synchronize()
    for i, (lg, le) in enumerate(zip(losses_g, losses_e[warmup:]), 1):
        assert torch.equal(lg, le), (i, lg, le)
    assert torch.equal(model_e.weight, model_g.weight)
    se, sg = model_e.recipe_state, model_g.recipe_state
    for a, b in zip(se.tensors(), sg.tensors()):
        assert torch.equal(a, b)
    assert (sg.scale != 1).all()


def test_update_and_record_do_not_synchronise():
    recipe = mxtrain.DelayedScaling(amax_history_len=4)
    model, x, step = _training(recipe)
    x.normal_()
    step()
    step()
    state = model.recipe_state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        state.update(recipe)  # the fused kernel
        state.record("input", torch.ones((), device="cuda"))
        state.record("grad_output", torch.ones((), device="cuda"))
        torch.ops.mxtrain.delayed_scaling_update(state.amax_history, state.scale, state.gen, state.fwd_amax,
                                                 state.fwd_stamp, state.grad_amax, state.grad_stamp, state.fp8_max,
                                                 0, False, False)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_compiled_delayed_linear_equals_eager():
    recipe = mxtrain.DelayedScaling(amax_history_len=4)

    def step(m, x):
        with mxtrain.mx_autocast(recipe=recipe):
            return m(x)

    results = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        torch.manual_seed(0)
        m = mxtrain.Linear(256, 128, device="cuda", dtype=torch.bfloat16)
        g = torch.Generator(device="cuda").manual_seed(2)
        out = []
        for i in range(4):
            x = torch.randn(64, 256, device="cuda", generator=g).bfloat16().requires_grad_()
            # the first step eager on both sides: eager casts slots without history with their own amax's scale
            y = (step if i == 0 else fn)(m, x)
            y.backward(torch.randn(y.shape, device="cuda", generator=g).bfloat16())
            out += [y.detach(), x.grad, m.weight.grad.clone(), m.recipe_state.amax_history.clone(),
                    m.recipe_state.scale.clone()]
            m.zero_grad(set_to_none=True)
        results.append(out)
    for i, (a, b) in enumerate(zip(*results)):
        assert torch.equal(a, b), i
