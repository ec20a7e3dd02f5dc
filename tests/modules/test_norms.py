"""mxtrain.LayerNorm / mxtrain.RMSNorm: drop-in torch norms that honour the recipe's elementwise precision."""

import pytest
import torch
from torch import nn

import mxtrain
from mxtrain.modules.normalization import norm_backward, norm_forward, norm_forward_stats

from .reference import elem, ref_norm, run_module

NORMS = {"LayerNorm": (mxtrain.LayerNorm, nn.LayerNorm), "RMSNorm": (mxtrain.RMSNorm, nn.RMSNorm)}


def _pair(kind, n=48, eps=1e-5, dtype=torch.float32, **kwargs):
    mx_cls, torch_cls = NORMS[kind]
    ref = torch_cls(n, eps=eps, **kwargs).to(dtype)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.3 * torch.randn_like(p))
    m = mx_cls(n, eps=eps, **kwargs).to(dtype)
    m.load_state_dict(ref.state_dict())
    return m, ref


def _data(shape, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3 + 1).to(dtype), torch.randn(shape, generator=g).to(dtype)


@pytest.mark.parametrize("recipe", [None, mxtrain.MXFP8Recipe()], ids=["plain", "mxfp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("kind", list(NORMS))
def test_equals_torch_norm(kind, dtype, recipe):
    """Without elementwise precision in the recipe, the norms are torch's, inside autocast or not."""
    torch.manual_seed(0)
    m, ref = _pair(kind, dtype=dtype)
    x, dy = _data((3, 5, 48), dtype)
    y, grads = run_module(m, x, dy, recipe)
    y_ref, g_ref = run_module(ref, x, dy, None)
    assert y.dtype == dtype
    assert torch.equal(y, y_ref)
    for name in g_ref:
        assert torch.equal(grads[name], g_ref[name]), name


@pytest.mark.parametrize("elemwise", ["bfloat16", "fp8"])
@pytest.mark.parametrize("kind", list(NORMS))
def test_elementwise_precision(kind, elemwise):
    """Output and input gradient rounded to the recipe's elementwise format; parameter grads are not."""
    torch.manual_seed(0)
    recipe = mxtrain.MXRecipe(elemwise_format=elemwise)
    m, ref = _pair(kind)
    x, dy = _data((2, 6, 48))
    y, grads = run_module(m, x, dy, recipe)
    xr = x.clone().requires_grad_(True)
    out = ref(xr)
    out.backward(dy)
    assert torch.equal(y, elem(out.detach(), recipe))
    assert not torch.equal(y, out)
    assert torch.equal(grads["x"], elem(xr.grad, recipe))
    for name, p in ref.named_parameters():
        assert torch.equal(grads[name], p.grad), name


@pytest.mark.parametrize("kwargs", [{}, {"bias": False}, {"elementwise_affine": False}],
                         ids=["affine", "nobias", "noaffine"])
def test_layernorm_state_dict_round_trip(kwargs):
    torch.manual_seed(0)
    m, ref = _pair("LayerNorm", **kwargs)
    assert list(m.state_dict()) == list(ref.state_dict())
    x, _ = _data((4, 48))
    assert torch.equal(m(x), ref(x))
    back = nn.LayerNorm(48, **kwargs)
    back.load_state_dict(m.state_dict())
    assert torch.equal(back(x), m(x))


@pytest.mark.parametrize("affine", [True, False])
def test_rmsnorm_state_dict_round_trip(affine):
    torch.manual_seed(0)
    m, ref = _pair("RMSNorm", elementwise_affine=affine)
    assert list(m.state_dict()) == list(ref.state_dict()) == (["weight"] if affine else [])
    x, _ = _data((4, 48))
    assert torch.equal(m(x), ref(x))
    back = nn.RMSNorm(48, eps=1e-5, elementwise_affine=affine)
    back.load_state_dict(m.state_dict())
    assert torch.equal(back(x), m(x))


@pytest.mark.parametrize("kind", list(NORMS))
def test_zero_centered_gamma(kind):
    mx_cls, _ = NORMS[kind]
    m = mx_cls(32, eps=1e-5, zero_centered_gamma=True)
    assert torch.equal(m.weight, torch.zeros(32))
    with torch.no_grad():
        m.weight.normal_()
    x, _ = _data((4, 32))
    bias = m.bias.detach() if kind == "LayerNorm" else None
    expected = ref_norm(x, m.weight.detach(), bias, kind, 1e-5, True)
    assert torch.equal(m(x), expected)


def test_accepts_one_element_shape_and_rejects_more():
    assert mxtrain.LayerNorm([16]).normalized_shape == (16,)
    with pytest.raises(ValueError, match="last dimension only"):
        mxtrain.LayerNorm((4, 16))
    with pytest.raises(ValueError, match="positive int"):
        mxtrain.RMSNorm(0)
    with pytest.raises(ValueError, match="eps"):
        mxtrain.LayerNorm(16, eps=-1.0)


@pytest.mark.parametrize("kind", list(NORMS))
@pytest.mark.parametrize("autocast", [False, True], ids=["plain", "mx"])
def test_bad_inputs_raise_clear_errors(kind, autocast):
    m = NORMS[kind][0](16)
    with mxtrain.mx_autocast(enabled=autocast, recipe=mxtrain.MXRecipe(elemwise_format="bfloat16")):
        with pytest.raises(ValueError, match=rf"{kind}.*\[\.\.\., 16\]"):
            m(torch.randn(3, 17))
        with pytest.raises(TypeError, match="int64"):
            m(torch.ones(3, 16, dtype=torch.long))
        with pytest.raises(TypeError, match="float64"):
            m(torch.randn(3, 16, dtype=torch.float64))


@pytest.mark.parametrize("shape", [(37, 96), (3, 5, 64)], ids=["2d", "3d"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("affine", ["plain", "zero_centered", "no_weight"])
@pytest.mark.parametrize("kind", list(NORMS))
def test_backward_from_saved_stats_matches_recompute(kind, affine, dtype, shape):
    """norm_backward on the forward's saved (mean, rstd) gives the bits of recomputing the forward under
    autograd (the same native kernels), where the device has a fused backward; else it recomputes."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(shape, generator=g) * 4 + 2).to(dtype)
    k = shape[-1]
    w = None if affine == "no_weight" else (torch.randn(k, generator=g) * 0.5).to(dtype)
    b = (torch.randn(k, generator=g).to(dtype) if kind == "LayerNorm" and w is not None else None)
    zc = affine == "zero_centered"
    out, stats = norm_forward_stats(x, w, b, kind, 1e-5, zc)
    assert torch.equal(out, norm_forward(x, w, b, kind, 1e-5, zc))
    if kind == "LayerNorm":  # RMSNorm on the CPU: torch has no fused backward, so backward recomputes
        assert stats is not None and stats[1].shape == (*shape[:-1], 1)
    dy = torch.randn(shape, generator=g).to(dtype)
    needs = (True, w is not None, b is not None)
    got = norm_backward(x, w, b, dy, kind, 1e-5, zc, needs, stats)
    want = norm_backward(x, w, b, dy, kind, 1e-5, zc, needs)
    for name, a, e in zip(("dx", "dweight", "dbias"), got, want):
        assert (a is None) == (e is None), name
        if a is not None:
            assert a.dtype == e.dtype and torch.equal(a, e), name
