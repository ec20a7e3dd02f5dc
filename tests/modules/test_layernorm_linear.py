"""mxtrain.LayerNormLinear: norm -> MX linear, against the fake-quantized torch reference."""

import pytest
import torch
from torch import nn

import mxtrain

from .reference import (
    RECIPES, TIGHT_TOL, assert_backward_uses_forward_recipe, assert_close_rel, compare_grads,
    ref_layernorm_linear, run_module,
)


def _make(in_f, out_f, dtype=torch.float32, seed=0, perturb=True, **kwargs):
    torch.manual_seed(seed)
    m = mxtrain.LayerNormLinear(in_f, out_f, **kwargs).to(dtype)
    if perturb:  # non-trivial norm parameters, so their gradients and use are checked
        with torch.no_grad():
            m.layer_norm_weight.add_(0.3 * torch.randn_like(m.layer_norm_weight))
            if m.layer_norm_bias is not None:
                m.layer_norm_bias.add_(0.2 * torch.randn_like(m.layer_norm_bias))
    return m


def _data(shape, out_f, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 2 + 0.5).to(dtype)
    dy = torch.randn(*shape[:-1], out_f, generator=g).to(dtype)
    dln = torch.randn(shape, generator=g).to(dtype)
    return x, dy, dln


def _check(m, x, dy, dln, recipe, tol):
    return_ln = m.return_layernorm_output
    out, grads = run_module(m, x, dy, recipe, extra_grads=(dln,) if return_ln else ())
    y_ref, ln_ref, g_ref = ref_layernorm_linear(
        x, m.layer_norm_weight, m.layer_norm_bias, m.weight, m.bias, dy, recipe, m.normalization, m.eps,
        m.zero_centered_gamma, dln_out=dln if return_ln else None)
    if return_ln:
        assert isinstance(out, tuple) and len(out) == 2
        y, ln = out
        assert ln.shape == x.shape and ln.dtype == x.dtype
        assert_close_rel(ln, ln_ref, tol, "layernorm output")
    else:
        assert isinstance(out, torch.Tensor)
        y = out
    assert y.dtype == x.dtype
    assert_close_rel(y, y_ref, tol, "forward")
    compare_grads(grads, g_ref, tol, f"{recipe!r}")


@pytest.mark.parametrize("return_ln", [False, True], ids=["y", "y+ln"])
@pytest.mark.parametrize("zc", [False, True], ids=["gamma", "zc_gamma"])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("recipe", list(RECIPES), ids=list(RECIPES))
def test_matches_fake_quant_reference(recipe, normalization, zc, return_ln):
    m = _make(64, 48, normalization=normalization, zero_centered_gamma=zc, return_layernorm_output=return_ln)
    x, dy, dln = _data((2, 20, 64), 48)
    _check(m, x, dy, dln, RECIPES[recipe], 1e-5)


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp4"])
def test_ragged_sizes_and_2d_input_no_bias(recipe, normalization):
    """in, out and token counts that are not multiples of the block size; no linear bias."""
    m = _make(40, 24, normalization=normalization, bias=False)
    x, dy, dln = _data((37, 40), 24)
    _check(m, x, dy, dln, RECIPES[recipe], 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_low_precision_params_and_inputs(dtype, normalization):
    m = _make(40, 24, dtype=dtype, normalization=normalization, return_layernorm_output=True)
    x, dy, dln = _data((2, 9, 40), 24, dtype=dtype)
    _check(m, x, dy, dln, RECIPES["mxfp8"], TIGHT_TOL[dtype])
    _, grads = run_module(m, x, dy, RECIPES["mxfp8"])
    assert all(g.dtype == dtype for g in grads.values())


def test_quantize_backward_false_is_high_precision_backward():
    """quantize_backward=False: backward equals torch autograd through norm -> linear at the same norm output."""
    m = _make(64, 32)
    x, dy, _ = _data((30, 64), 32)
    _, grads = run_module(m, x, dy, mxtrain.MXFP8Recipe(quantize_backward=False))
    _, hp = run_module(m, x, dy, None)  # the backward does not depend on the (quantized) forward GEMM
    for name in hp:
        assert_close_rel(grads[name], hp[name], 1e-5, name)


def test_parameter_names_and_init():
    m = mxtrain.LayerNormLinear(64, 32)
    assert list(m.state_dict()) == ["layer_norm_weight", "layer_norm_bias", "weight", "bias"]
    assert torch.equal(m.layer_norm_weight, torch.ones(64)) and torch.equal(m.layer_norm_bias, torch.zeros(64))
    rms = mxtrain.LayerNormLinear(64, 32, normalization="RMSNorm", bias=False)
    assert list(rms.state_dict()) == ["layer_norm_weight", "weight"]
    zc = mxtrain.LayerNormLinear(64, 32, zero_centered_gamma=True)
    assert torch.equal(zc.layer_norm_weight, torch.zeros(64))
    assert mxtrain.LayerNormLinear(8, 8, normalization="rmsnorm").normalization == "RMSNorm"


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_copying_torch_chain_reproduces_it_outside_autocast(normalization):
    torch.manual_seed(0)
    norm = nn.LayerNorm(64, eps=1e-5) if normalization == "LayerNorm" else nn.RMSNorm(64, eps=1e-5)
    lin = nn.Linear(64, 40)
    with torch.no_grad():
        norm.weight.normal_(1, 0.2)
        if normalization == "LayerNorm":
            norm.bias.normal_(0, 0.2)
    m = mxtrain.LayerNormLinear(64, 40, normalization=normalization, eps=1e-5)
    state = {"layer_norm_weight": norm.weight, "weight": lin.weight, "bias": lin.bias}
    if normalization == "LayerNorm":
        state["layer_norm_bias"] = norm.bias
    m.load_state_dict(state)
    x = torch.randn(3, 7, 64)
    dy = torch.randn(3, 7, 40)
    xr = x.clone().requires_grad_(True)
    y_ref = lin(norm(xr))
    y_ref.backward(dy)
    y, grads = run_module(m, x, dy, None)
    assert torch.equal(y, y_ref)
    assert torch.equal(grads["x"], xr.grad)
    assert torch.equal(grads["weight"], lin.weight.grad)
    assert torch.equal(grads["layer_norm_weight"], norm.weight.grad)


def test_backward_uses_forward_recipe():
    m = _make(64, 48, return_layernorm_output=True)
    x, dy, _ = _data((2, 16, 64), 48)
    assert_backward_uses_forward_recipe(m, x, dy, mxtrain.MXFP8Recipe(), mxtrain.MXINT8Recipe())


@pytest.mark.parametrize("autocast", [False, True], ids=["plain", "mx"])
def test_bad_inputs_raise_clear_errors(autocast):
    m = _make(64, 32)
    with mxtrain.mx_autocast(enabled=autocast):
        with pytest.raises(ValueError, match=r"LayerNormLinear.*\[\.\.\., 64\]"):
            m(torch.randn(2, 4, 65))
        with pytest.raises(TypeError, match="int32"):
            m(torch.ones(4, 64, dtype=torch.int32))
        with pytest.raises(TypeError, match="float64"):
            m(torch.randn(4, 64, dtype=torch.float64))


def test_bad_constructor_args():
    with pytest.raises(ValueError, match="allowed: LayerNorm, RMSNorm"):
        mxtrain.LayerNormLinear(64, 32, normalization="BatchNorm")
    with pytest.raises(ValueError, match="in_features"):
        mxtrain.LayerNormLinear(0, 32)
    with pytest.raises(ValueError, match="out_features"):
        mxtrain.LayerNormLinear(64, 2.5)
    with pytest.raises(ValueError, match="eps"):
        mxtrain.LayerNormLinear(64, 32, eps=0)
