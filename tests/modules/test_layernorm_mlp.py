"""mxtrain.LayerNormMLP: norm -> fc1 -> activation -> fc2, against the fake-quantized torch reference."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mxtrain

from .reference import (
    ACTIVATION_NAMES, GATED_ACTIVATIONS, RECIPES, TIGHT_TOL, assert_backward_uses_forward_recipe,
    assert_close_rel, compare_grads, module_params, ref_activation, ref_layernorm_mlp, run_module,
)


def _make(hidden, ffn, dtype=torch.float32, seed=0, **kwargs):
    torch.manual_seed(seed)
    m = mxtrain.LayerNormMLP(hidden, ffn, **kwargs).to(dtype)
    with torch.no_grad():  # non-trivial norm parameters
        m.layer_norm_weight.add_(0.3 * torch.randn_like(m.layer_norm_weight))
        if m.layer_norm_bias is not None:
            m.layer_norm_bias.add_(0.2 * torch.randn_like(m.layer_norm_bias))
    return m


def _data(shape, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 2 + 0.5).to(dtype)
    dy = torch.randn(shape, generator=g).to(dtype)
    return x, dy


def _check(m, x, dy, recipe, tol):
    out, grads = run_module(m, x, dy, recipe)
    y_ref, g_ref = ref_layernorm_mlp(x, module_params(m), dy, recipe, m.activation, m.normalization, m.eps,
                                     m.zero_centered_gamma, include_fc2_bias=not m.return_bias)
    if m.return_bias:
        assert isinstance(out, tuple) and len(out) == 2
        y, b = out
        assert b is m.fc2_bias
        g_ref.pop("fc2_bias", None)  # the caller adds the returned bias: no gradient through the module
    else:
        assert isinstance(out, torch.Tensor)
        y = out
    assert y.shape == x.shape and y.dtype == x.dtype
    assert_close_rel(y, y_ref, tol, "forward")
    compare_grads(grads, g_ref, tol, f"{m.activation} {recipe!r}")


@pytest.mark.parametrize("activation", ACTIVATION_NAMES)
@pytest.mark.parametrize("recipe", list(RECIPES), ids=list(RECIPES))
def test_matches_fake_quant_reference(recipe, activation):
    m = _make(64, 96, activation=activation)
    x, dy = _data((2, 20, 64))
    _check(m, x, dy, RECIPES[recipe], 1e-5)


@pytest.mark.parametrize("return_bias", [False, True], ids=["bias_added", "return_bias"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("recipe", ["mxfp8", "mixed"])
def test_bias_options(recipe, activation, bias, return_bias):
    m = _make(64, 64, activation=activation, bias=bias, return_bias=return_bias)
    x, dy = _data((40, 64))
    _check(m, x, dy, RECIPES[recipe], 1e-5)


@pytest.mark.parametrize("zc", [False, True], ids=["gamma", "zc_gamma"])
@pytest.mark.parametrize("activation", ["squared_relu", "geglu"])
@pytest.mark.parametrize("recipe", ["mxfp8_hybrid", "mxfp4"])
def test_rmsnorm(recipe, activation, zc):
    m = _make(64, 64, activation=activation, normalization="RMSNorm", zero_centered_gamma=zc)
    x, dy = _data((2, 12, 64))
    _check(m, x, dy, RECIPES[recipe], 1e-5)


@pytest.mark.parametrize("activation", ["gelu", "reglu"])
@pytest.mark.parametrize("recipe", ["mxfp8", "mxint8", "mixed"])
def test_ragged_sizes(recipe, activation):
    """hidden, ffn and token counts not multiples of the block size (the last block is zero-padded)."""
    m = _make(40, 24, activation=activation)
    x, dy = _data((3, 7, 40))
    _check(m, x, dy, RECIPES[recipe], 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_low_precision_params_and_inputs(dtype, activation):
    m = _make(40, 48, dtype=dtype, activation=activation)
    x, dy = _data((2, 9, 40), dtype=dtype)
    _check(m, x, dy, RECIPES["mxfp8"], TIGHT_TOL[dtype])
    _, grads = run_module(m, x, dy, RECIPES["mxfp8"])
    assert all(g.dtype == dtype for g in grads.values())


def test_quantize_backward_false_is_high_precision_backward():
    """quantize_backward=False: backward = torch autograd of the chain, evaluated at the MX forward's fc1 output."""
    recipe = mxtrain.MXFP8Recipe(quantize_backward=False)
    m = _make(64, 96, activation="swiglu")
    x, dy = _data((32, 64))
    _, grads = run_module(m, x, dy, recipe)
    # torch autograd with the fc1 GEMM's result replaced by the MX forward's (a constant shift keeps
    # the high-precision derivatives while reproducing h exactly)
    from .reference import fq, ref_norm
    with torch.enable_grad():
        xr = x.clone().requires_grad_(True)
        p = {n: q.detach().clone().requires_grad_(True) for n, q in module_params(m).items()}
        ln = ref_norm(xr, p["layer_norm_weight"], p["layer_norm_bias"], "LayerNorm", m.eps, False)
        h_hp = F.linear(ln, p["fc1_weight"], p["fc1_bias"])
        h_mx = (fq(ln, recipe, "fprop_input", 1) @ fq(p["fc1_weight"], recipe, "fprop_weight", 1).t()
                + p["fc1_bias"].detach())
        h = h_hp + (h_mx - h_hp).detach()
        y = F.linear(ref_activation(h, "swiglu"), p["fc2_weight"], p["fc2_bias"])
        y.backward(dy)
    assert_close_rel(grads["x"], xr.grad, 1e-5, "x")
    for n, q in p.items():
        assert_close_rel(grads[n], q.grad, 1e-5, n)


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_parameter_names_and_shapes(activation):
    m = mxtrain.LayerNormMLP(64, 96, activation=activation)
    fc1_out = 192 if activation in GATED_ACTIVATIONS else 96
    shapes = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    assert shapes == {"layer_norm_weight": (64,), "layer_norm_bias": (64,), "fc1_weight": (fc1_out, 64),
                      "fc1_bias": (fc1_out,), "fc2_weight": (64, 96), "fc2_bias": (64,)}
    rms = mxtrain.LayerNormMLP(64, 96, normalization="RMSNorm", bias=False)
    assert list(rms.state_dict()) == ["layer_norm_weight", "fc1_weight", "fc2_weight"]


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("activation", ACTIVATION_NAMES)
def test_copying_torch_chain_reproduces_it_outside_autocast(activation, normalization):
    torch.manual_seed(0)
    hidden, ffn = 48, 40
    gated = activation in GATED_ACTIVATIONS
    norm = nn.LayerNorm(hidden) if normalization == "LayerNorm" else nn.RMSNorm(hidden, eps=1e-5)
    fc1 = nn.Linear(hidden, 2 * ffn if gated else ffn)
    fc2 = nn.Linear(ffn, hidden)
    with torch.no_grad():
        norm.weight.normal_(1, 0.2)
    m = mxtrain.LayerNormMLP(hidden, ffn, activation=activation, normalization=normalization, eps=1e-5)
    state = {"layer_norm_weight": norm.weight, "fc1_weight": fc1.weight, "fc1_bias": fc1.bias,
             "fc2_weight": fc2.weight, "fc2_bias": fc2.bias}
    if normalization == "LayerNorm":
        state["layer_norm_bias"] = norm.bias
    m.load_state_dict(state)
    x, dy = _data((2, 5, hidden))
    xr = x.clone().requires_grad_(True)
    y_ref = fc2(ref_activation(fc1(norm(xr)), activation))
    y_ref.backward(dy)
    y, grads = run_module(m, x, dy, None)
    assert torch.equal(y, y_ref)
    assert torch.equal(grads["x"], xr.grad)
    assert torch.equal(grads["fc1_weight"], fc1.weight.grad)
    assert torch.equal(grads["fc2_weight"], fc2.weight.grad)
    assert torch.equal(grads["layer_norm_weight"], norm.weight.grad)


def test_backward_uses_forward_recipe():
    m = _make(64, 64, activation="swiglu")
    x, dy = _data((2, 16, 64))
    assert_backward_uses_forward_recipe(m, x, dy, mxtrain.MXFP8Recipe(), mxtrain.MXFP6Recipe())


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_saved_for_backward_under_mxfp8(activation):
    """Backward keeps the block input, the norm parameters, the norm's per-row mean and rstd (its backward
    then recomputes nothing), h (the one high-precision fc1-output tensor), the two weight parameters
    (quantized columnwise in backward, not held as planes) and one single-plane (columnwise) MXFP8 tensor:
    ln_out, fc1's wgrad operand, whose codes and scales are saved tensors too (so activation
    checkpointing frees them)."""
    from mxtrain.modules._common import saved_tensors

    tokens, hidden, ffn = 96, 64, 128
    fc1_out = 2 * ffn if activation in GATED_ACTIVATIONS else ffn
    m = _make(hidden, ffn, activation=activation)
    x = torch.randn(2, tokens // 2, hidden, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with mxtrain.mx_autocast(recipe=mxtrain.MXFP8Recipe()):
            y = m(x)
    ctx = y.grad_fn
    _, ops = saved_tensors(ctx)
    t = ops["ln_col"]
    assert isinstance(t, mxtrain.MXTensor) and t.fmt == "fp8_e4m3" and tuple(t.shape) == (tokens, hidden)
    assert [p.axis for p in t.planes] == [0]
    assert t.nbytes == tokens * hidden + tokens * hidden // 32
    assert ops["a_col"] is None and ops["w1_col"] is None and ops["w2_col"] is None
    plane = t.planes[0]
    shapes = sorted(tuple(t.shape) for t in saved)
    assert shapes == sorted([(tokens, hidden), (hidden,), (hidden,), (tokens, fc1_out), (fc1_out, hidden),
                             (hidden, ffn), (tokens, 1), (tokens, 1), tuple(plane.data.shape),
                             tuple(plane.scale.shape)]), shapes
    params = {id(p) for p in m.parameters()}
    activations = [t for t in saved if id(t) not in params and t.is_floating_point()]
    high_precision_ffn = [t for t in activations if t.dim() == 2 and t.shape[1] in (ffn, fc1_out)]
    assert len(high_precision_ffn) == 1  # h; act(h) is recomputed in backward, not kept
    assert not [k for k, v in vars(ctx).items() if isinstance(v, (torch.Tensor, mxtrain.MXTensor))]
    y.sum().backward()
    assert plane.data.untyped_storage().nbytes() == 0  # freed after its last use in backward


@pytest.mark.parametrize("autocast", [False, True], ids=["plain", "mx"])
def test_bad_inputs_raise_clear_errors(autocast):
    m = _make(64, 32)
    with mxtrain.mx_autocast(enabled=autocast):
        with pytest.raises(ValueError, match=r"LayerNormMLP.*\[\.\.\., 64\].*\[4, 32\]"):
            m(torch.randn(4, 32))
        with pytest.raises(TypeError, match="int64"):
            m(torch.ones(4, 64, dtype=torch.long))
        with pytest.raises(TypeError, match="float64"):
            m(torch.randn(4, 64, dtype=torch.float64))


def test_bad_constructor_args():
    with pytest.raises(ValueError, match="allowed: " + ", ".join(ACTIVATION_NAMES)):
        mxtrain.LayerNormMLP(64, 32, activation="tanh")
    with pytest.raises(ValueError, match="allowed: LayerNorm, RMSNorm"):
        mxtrain.LayerNormMLP(64, 32, normalization="GroupNorm")
    with pytest.raises(ValueError, match="ffn_hidden_size"):
        mxtrain.LayerNormMLP(64, -1)
    with pytest.raises(ValueError, match="hidden_size"):
        mxtrain.LayerNormMLP(True, 32)
    assert mxtrain.LayerNormMLP(8, 8, activation="SwiGLU").activation == "swiglu"


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8_hybrid"])
def test_gemm_operands_are_the_roles_in_their_block_directions(recipe):
    """Bit-exact operands of the six GEMMs that come straight from inputs, weights or the norm
    (fc1's X and W, fc2's W and dY), on values wide enough that MXFP8 shows a wrong block direction."""
    from .reference import find_gemm, fq, record_gemm_operands, ref_norm, wide_range

    recipe = RECIPES[recipe]
    m = _make(64, 96, activation="swiglu")
    with torch.no_grad():
        m.fc1_weight.copy_(wide_range(m.fc1_weight, seed=3))
        m.fc2_weight.copy_(wide_range(m.fc2_weight, seed=4))
    x, dy = _data((40, 64))
    x, dy = wide_range(x, binades=16, seed=5), wide_range(dy, binades=16, seed=6)
    w1, w2 = m.fc1_weight.detach(), m.fc2_weight.detach()
    ln = ref_norm(x, m.layer_norm_weight.detach(), m.layer_norm_bias.detach(), "LayerNorm", m.eps, False)
    for t, role in ((ln, "fprop_input"), (w1, "fprop_weight"), (w2, "dgrad_weight"), (dy, "dgrad_grad_output"),
                    (dy, "wgrad_grad_output"), (ln, "wgrad_input")):
        assert not torch.equal(fq(t, recipe, role, 0), fq(t, recipe, role, 1)), role
    with record_gemm_operands() as gemms:
        run_module(m, x, dy, recipe)
    assert len(gemms) == 6
    assert find_gemm(gemms, fq(ln, recipe, "fprop_input", 1), fq(w1, recipe, "fprop_weight", 1)), "fc1 fprop"
    assert find_gemm(gemms, None, fq(w2, recipe, "fprop_weight", 1)), "fc2 fprop"
    assert find_gemm(gemms, fq(dy, recipe, "dgrad_grad_output", 1), fq(w2, recipe, "dgrad_weight", 0).t()), \
        "fc2 dgrad"
    assert find_gemm(gemms, fq(dy, recipe, "wgrad_grad_output", 0).t(), None), "fc2 wgrad"
    assert find_gemm(gemms, None, fq(w1, recipe, "dgrad_weight", 0).t()), "fc1 dgrad"
    assert find_gemm(gemms, None, fq(ln, recipe, "wgrad_input", 0).t()), "fc1 wgrad"


def test_backward_frees_the_fc1_output_after_its_last_use():
    """h (the saved fc1 output, the largest tensor backward keeps) is freed once the activation gradient is
    cast, before the fc1 GEMMs: its storage is empty after backward, and the gradients are unchanged, also
    through activation checkpointing (whose recomputed h is the one freed)."""
    from torch.utils.checkpoint import checkpoint

    m = _make(64, 128)
    x = torch.randn(48, 64)
    recipe = mxtrain.MXFP8Recipe()
    saved = []
    grads = []
    for mode in ("hooks", "checkpoint"):
        m.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        if mode == "hooks":
            with mxtrain.mx_autocast(recipe=recipe), torch.autograd.graph.saved_tensors_hooks(
                    lambda t: saved.append(t) or t, lambda t: t):
                y = m(xi)
        else:  # the recompute must see the recipe: mx_autocast inside the checkpointed function
            y = checkpoint(lambda t: _under(recipe, m, t), xi, use_reentrant=False)
        y.square().sum().backward()
        grads.append([xi.grad] + [p.grad for p in m.parameters()])
    (h,) = [t for t in saved if tuple(t.shape) == (48, 128)]
    assert h.untyped_storage().nbytes() == 0
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def _under(recipe, m, x):
    with mxtrain.mx_autocast(recipe=recipe):
        return m(x)
