"""mxtrain.Linear / LayerNormLinear / LayerNormMLP under the FP8 recipes against hand-written references.

The references fake-quantize every GEMM operand with tests/float8/reference.py
(ml_dtypes casts, hand-computed scales, the delayed-scaling history as a Python
list) and run the GEMMs as fp32 torch matmuls; norms and activations are plain
torch autograd.
"""

import copy
import io

import pytest
import torch
import torch.nn.functional as F

import mxtrain
from mxtrain.recipes import DelayedScaling, Float8BlockScaling, Float8CurrentScaling

from .reference import RefQuantizer, rel_err

RECIPES = {
    "current": Float8CurrentScaling(),
    "current_e4m3_pow2": Float8CurrentScaling(fp8_format="e4m3", power_of_2_scales=True),
    "delayed": DelayedScaling(amax_history_len=3),
    "delayed_recent_margin": DelayedScaling(amax_compute_algo="most_recent", margin=1, amax_history_len=2),
    "block": Float8BlockScaling(),
    "block_hybrid_fp32_scales": Float8BlockScaling(fp8_format="hybrid", power_of_2_scales=False),
}
TOL = 1e-5


def run(module, x, dy, recipe):
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    with mxtrain.mx_autocast(enabled=recipe is not None, recipe=recipe):
        y = module(x)
    y.backward(dy)
    grads = {"x": x.grad}
    grads.update((n, p.grad) for n, p in module.named_parameters())
    return y, grads


def assert_close(actual, expected, what, tol=TOL):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    err = rel_err(actual, expected)
    assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.0e}"


def ref_linear(q, x2d, w, b, dy2d, prefix=""):
    """(y, dx, dw) in fp32 with the three GEMMs on fake-quantized operands (slots prefix + tensor)."""
    y = q(x2d, prefix + "input", 1) @ q(w, prefix + "weight", 1).t()
    if b is not None:
        y = y + b.detach().float()
    return y


def ref_linear_backward(q, x2d, w, dy2d, prefix=""):
    dx = q(dy2d, prefix + "grad_output", 1) @ q(w, prefix + "weight", 0)
    dw = q(dy2d, prefix + "grad_output", 0).t() @ q(x2d, prefix + "input", 0)
    return dx, dw


def ref_act(h, name):
    if name == "swiglu":
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(h)


def vjp(fn, inputs, grad):
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) for t in inputs]
        return torch.autograd.grad(fn(*leaves), leaves, grad)


# --- Linear ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(RECIPES))
def test_linear_matches_reference_over_steps(name):
    recipe = RECIPES[name]
    torch.manual_seed(0)
    k, n, tokens = (160, 144, 136) if recipe.scaling == "block" else (64, 48, 40)
    m = mxtrain.Linear(k, n)
    q = RefQuantizer(recipe)
    g = torch.Generator().manual_seed(1)
    for step in range(3):  # delayed scaling: scales of step s come from steps < s
        x = torch.randn(2, tokens // 2, k, generator=g) * (1 + 10 * step)
        dy = torch.randn(2, tokens // 2, n, generator=g)
        y, grads = run(m, x, dy, recipe)
        q.begin_step()
        x2d, dy2d = x.reshape(-1, k), dy.reshape(-1, n)
        y_ref = ref_linear(q, x2d, m.weight, m.bias, dy2d).reshape(y.shape)
        dx, dw = ref_linear_backward(q, x2d, m.weight, dy2d)
        assert_close(y, y_ref, f"{name} step {step} forward")
        assert_close(grads["x"], dx.reshape(x.shape), f"{name} step {step} dx")
        assert_close(grads["weight"], dw, f"{name} step {step} dw")
        assert_close(grads["bias"], dy2d.sum(0), f"{name} step {step} db")


@pytest.mark.parametrize("name", ["current", "block"])
def test_layernorm_linear_matches_reference(name):
    recipe = RECIPES[name]
    torch.manual_seed(0)
    m = mxtrain.LayerNormLinear(160, 144, normalization="RMSNorm")
    with torch.no_grad():
        m.layer_norm_weight.uniform_(0.5, 1.5)
    g = torch.Generator().manual_seed(2)
    x, dy = torch.randn(136, 160, generator=g), torch.randn(136, 144, generator=g)
    y, grads = run(m, x, dy, recipe)
    q = RefQuantizer(recipe)
    ln = F.rms_norm(x, (160,), m.layer_norm_weight.detach(), m.eps)
    assert_close(y, ref_linear(q, ln, m.weight, m.bias, dy), "forward")
    dln, dw = ref_linear_backward(q, ln, m.weight, dy)
    dx, dg = vjp(lambda a, w: F.rms_norm(a, (160,), w, m.eps), [x, m.layer_norm_weight], dln)
    assert_close(grads["x"], dx, "dx")
    assert_close(grads["layer_norm_weight"], dg, "dgamma", tol=1e-4)
    assert_close(grads["weight"], dw, "dw")


# --- LayerNormMLP ----------------------------------------------------------------------------

def ref_mlp(q, m, x, dy, act):
    """LayerNormMLP by hand: fc1 and fc2 tensors in their own slots (fc1.input, fc2.grad_output...)."""
    ln_w, ln_b = m.layer_norm_weight.detach(), m.layer_norm_bias.detach()
    ln = F.layer_norm(x, (x.shape[-1],), ln_w, ln_b, m.eps)
    h = ref_linear(q, ln, m.fc1_weight, m.fc1_bias, None, "fc1.")
    a = ref_act(h, act)
    y = ref_linear(q, a, m.fc2_weight, m.fc2_bias, None, "fc2.")
    da, dw2 = ref_linear_backward(q, a, m.fc2_weight, dy, "fc2.")
    (dh,) = vjp(lambda t: ref_act(t, act), [h], da)
    dln, dw1 = ref_linear_backward(q, ln, m.fc1_weight, dh, "fc1.")
    dx, dg, dbeta = vjp(lambda t, w, b: F.layer_norm(t, (t.shape[-1],), w, b, m.eps), [x, ln_w, ln_b], dln)
    return y, {"x": dx, "layer_norm_weight": dg, "layer_norm_bias": dbeta, "fc1_weight": dw1,
               "fc1_bias": dh.sum(0), "fc2_weight": dw2, "fc2_bias": dy.sum(0)}


@pytest.mark.parametrize("act", ["gelu", "swiglu"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_layernorm_mlp_matches_reference_over_steps(name, act):
    recipe = RECIPES[name]
    torch.manual_seed(0)
    hidden, ffn, tokens = (160, 256, 136) if recipe.scaling == "block" else (64, 96, 48)
    m = mxtrain.LayerNormMLP(hidden, ffn, activation=act)
    q = RefQuantizer(recipe)
    g = torch.Generator().manual_seed(3)
    steps = 3 if recipe.scaling == "delayed" else 1
    for step in range(steps):
        x = torch.randn(tokens, hidden, generator=g) * (1 + step)
        dy = torch.randn(tokens, hidden, generator=g) * 10 ** -step
        y, grads = run(m, x, dy, recipe)
        q.begin_step()
        y_ref, g_ref = ref_mlp(q, m, x, dy, act)
        assert_close(y, y_ref, f"{name} step {step} forward")
        for key, e in g_ref.items():
            # the norm parameters' grads are sums over tokens of products: a looser bound
            assert_close(grads[key], e, f"{name} step {step} grad {key}",
                         tol=1e-4 if key.startswith("layer_norm") else TOL)


@pytest.mark.parametrize("name", ["current", "delayed", "block"])
def test_bf16_modules_run_close_to_bf16_torch(name):
    torch.manual_seed(0)
    m = mxtrain.LayerNormMLP(256, 384).to(torch.bfloat16)
    x = torch.randn(128, 256, dtype=torch.bfloat16)
    dy = torch.randn(128, 256, dtype=torch.bfloat16)
    y, grads = run(m, x, dy, RECIPES[name])
    y_hp, grads_hp = run(m, x, dy, None)
    assert y.dtype == torch.bfloat16 and all(v.dtype == torch.bfloat16 for v in grads.values())
    assert rel_err(y, y_hp) < 0.1
    for key in ("x", "fc1_weight", "fc2_weight"):
        assert rel_err(grads[key], grads_hp[key]) < 0.15, key


# --- state -----------------------------------------------------------------------------------

def _train(m, batches, recipe, opt_state=None):
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    outs = []
    for x, dy in batches:
        y, _ = run(m, x, dy, recipe)
        opt.step()
        outs.append(y.detach())
    return outs, opt.state_dict()


@pytest.mark.parametrize("module", ["Linear", "LayerNormMLP"])
def test_delayed_scaling_state_dict_resumes_exactly(module):
    recipe = DelayedScaling(amax_history_len=4)
    torch.manual_seed(0)
    make = (lambda: mxtrain.Linear(64, 48)) if module == "Linear" else (lambda: mxtrain.LayerNormMLP(64, 96))
    out_dim = 48 if module == "Linear" else 64
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(32, 64, generator=g) * (1 + i), torch.randn(32, out_dim, generator=g))
               for i in range(6)]
    base = make()
    first = copy.deepcopy(base)
    uninterrupted, _ = _train(base, batches, recipe)

    ys, opt_state = _train(first, batches[:3], recipe)
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt_state}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    assert "_extra_state" in ckpt["model"]
    torch.manual_seed(123)
    resumed = make()  # other initial values: everything must come from the checkpoint
    assert resumed.recipe_state is None
    resumed.load_state_dict(ckpt["model"])
    ys_after, _ = _train(resumed, batches[3:], recipe, ckpt["opt"])
    for i, (a, b) in enumerate(zip(ys + ys_after, uninterrupted)):
        assert torch.equal(a, b), f"step {i} differs after resuming"
    for k, v in base.state_dict()["_extra_state"].items():
        w = resumed.state_dict()["_extra_state"][k]
        assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, k
    # and the state really moved: the histories hold the amaxes, the scales left 1
    st = base.recipe_state
    assert st.updates == 5 and (st.scale != 1).all()
    # a fresh module without the checkpoint's state would have cast step 4 with scale 1
    assert not torch.equal(_train(make(), batches[3:4], recipe)[0][0], uninterrupted[3])


def test_stateless_recipes_leave_state_dict_keys_alone():
    m = mxtrain.LayerNormMLP(64, 96)
    for r in (mxtrain.MXFP8Recipe(), Float8CurrentScaling(), Float8BlockScaling()):
        run(m, torch.randn(8, 64), torch.randn(8, 64), r)
    assert "_extra_state" not in m.state_dict() and m.recipe_state is None
    lin = mxtrain.Linear(64, 32)
    assert lin.load_state_dict(torch.nn.Linear(64, 32).state_dict(), strict=True)
    run(lin, torch.randn(8, 64), torch.randn(8, 32), DelayedScaling())
    assert "_extra_state" in lin.state_dict() and lin.recipe_state is not None
    lin.reset_recipe_state()
    assert "_extra_state" not in lin.state_dict()


def test_bad_extra_state_is_reported():
    lin = mxtrain.Linear(8, 8)
    sd = dict(lin.state_dict(), _extra_state={"kind": "nope"})
    with pytest.raises(RuntimeError, match="not an mxtrain recipe state"):
        lin.load_state_dict(sd)


def test_functional_linear_refuses_delayed_scaling():
    w = torch.randn(16, 32)
    with mxtrain.mx_autocast(recipe=DelayedScaling()):
        with pytest.raises(RuntimeError, match="DelayedScaling keeps amax histories per module"):
            mxtrain.mx_linear(torch.randn(4, 32), w)
    with mxtrain.mx_autocast(recipe=Float8CurrentScaling()):
        assert mxtrain.mx_linear(torch.randn(4, 32), w).shape == (4, 16)


def test_backward_uses_the_forward_recipe():
    torch.manual_seed(0)
    m = mxtrain.Linear(64, 48)
    x, dy = torch.randn(40, 64), torch.randn(40, 48)
    _, expected = run(m, x, dy, Float8CurrentScaling())
    m.zero_grad(set_to_none=True)
    xg = x.clone().requires_grad_(True)
    with mxtrain.mx_autocast(recipe=Float8CurrentScaling()):
        y = m(xg)
    with mxtrain.mx_autocast(recipe=mxtrain.MXFP4Recipe()):
        y.backward(dy)
    assert torch.equal(xg.grad, expected["x"]) and torch.equal(m.weight.grad, expected["weight"])


def test_quantize_backward_false_runs_high_precision_backward():
    torch.manual_seed(0)
    m = mxtrain.Linear(64, 48)
    x, dy = torch.randn(40, 64), torch.randn(40, 48)
    _, g8 = run(m, x, dy, Float8CurrentScaling(quantize_backward=False))
    _, ghp = run(m, x, dy, None)
    assert rel_err(g8["weight"], ghp["weight"]) < 1e-6 and rel_err(g8["x"], ghp["x"]) < 1e-6
