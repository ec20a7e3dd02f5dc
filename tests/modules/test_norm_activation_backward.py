"""The fused modules' norm and activation backward (explicit formulas, no autograd graph) against torch's autograd
of the same forward, bit for bit; and their registered ops (used while compiling) under torch.library.opcheck."""

import itertools

import pytest
import torch

from mxtrain.activations import ACTIVATIONS, activation, activation_backward, is_gated
from mxtrain.modules.normalization import norm_backward, norm_forward, norm_forward_stats

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _autograd(fn, inputs, grad):
    leaves = [t.clone().requires_grad_() if t is not None else None for t in inputs]
    out = fn(*leaves)
    given = [t for t in leaves if t is not None]
    got = iter(torch.autograd.grad(out, given, grad))
    return [next(got) if t is not None else None for t in leaves]


def _assert_bitwise(got, want, names):
    for name, a, e in zip(names, got, want):
        assert (a is None) == (e is None), name
        if a is not None:
            assert a.dtype == e.dtype and a.shape == e.shape, name
            assert torch.equal(a.isnan(), e.isnan()), name
            assert torch.equal(a.nan_to_num(), e.nan_to_num()), (name, (a.float() - e.float()).abs().max())


@pytest.mark.parametrize("shape", [(37, 96), (3, 5, 64), (48,)], ids=["2d", "3d", "1d"])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("kind,affine", [  # fp32_weight: RMSNorm only (torch's LayerNorm takes the input's dtype)
    *itertools.product(["LayerNorm", "RMSNorm"], ["plain", "zero_centered", "no_weight"]), ("RMSNorm", "fp32_weight")])
def test_norm_backward_is_autograds(kind, affine, dtype, shape):
    """dx, dweight, dbias of norm_backward (with the forward's statistics and without) are autograd's bits."""
    dtype = DTYPES[dtype]
    g = torch.Generator().manual_seed(3)
    k = shape[-1]
    x = (torch.randn(shape, generator=g) * 4 + 2).to(dtype)
    wdtype = torch.float32 if affine == "fp32_weight" else dtype
    w = None if affine == "no_weight" else (torch.randn(k, generator=g) * 0.5).to(wdtype)
    b = torch.randn(k, generator=g).to(dtype) if kind == "LayerNorm" and w is not None else None
    zc = affine == "zero_centered"
    out = norm_forward(x, w, b, kind, 1e-5, zc)
    dy = torch.randn(out.shape, generator=g).to(out.dtype)
    want = _autograd(lambda x_, w_, b_: norm_forward(x_, w_, b_, kind, 1e-5, zc), (x, w, b), dy)
    stats = norm_forward_stats(x, w, b, kind, 1e-5, zc)[1]
    for st in (stats, None):
        _assert_bitwise(norm_backward(x, w, b, dy, kind, 1e-5, zc, (True, w is not None, b is not None), st),
                        want, ("dx", "dweight", "dbias"))
    # only some gradients asked for: the others are None, the asked ones unchanged
    got = norm_backward(x, w, b, dy, kind, 1e-5, zc, (False, w is not None, False), stats)
    assert got[0] is None and got[2] is None and (got[1] is None) == (w is None)
    if w is not None:
        assert torch.equal(got[1], want[1])


def _activation_input(shape, dtype, gated, g):
    h = (torch.randn(shape, generator=g) * 3).to(dtype)
    rows = h.view(-1, shape[-1])
    specials = torch.tensor([0.0, -0.0, float("nan"), float("inf"), float("-inf"), 1e-30]).to(dtype)
    rows[0, : len(specials)] = specials  # in the gate (gated) or anywhere
    if gated:  # and in the up half
        rows[1, shape[-1] // 2: shape[-1] // 2 + len(specials)] = specials
    return h


@pytest.mark.parametrize("shape", [(37, 96), (3, 5, 64)], ids=["2d", "3d"])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_activation_backward_is_autograds(act, dtype, shape):
    """Every activation's backward (gated ones too) is autograd's of ``activation``, special values included."""
    g = torch.Generator().manual_seed(1)
    h = _activation_input(shape, DTYPES[dtype], is_gated(act), g)
    out = activation(h, act)
    grad = torch.randn(out.shape, generator=g).to(out.dtype)
    want = _autograd(lambda h_: activation(h_, act), (h,), grad)
    _assert_bitwise([activation_backward(h, grad, act)], want, ("dh",))
    # a gradient of another dtype is cast to h's first, as autograd casts a root gradient
    _assert_bitwise([activation_backward(h, grad.float(), act)], _autograd(lambda h_: activation(h_, act), (h,),
                                                                           grad.float().to(h.dtype)), ("dh",))


def test_activation_backward_names_a_wrong_gradient_shape():
    h = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"grad must have act\(h\)'s shape \[4, 4\]"):
        activation_backward(h, torch.randn(4, 8), "swiglu")
    with pytest.raises(ValueError, match="unknown activation 'tanh'"):
        activation_backward(h, torch.randn(4, 8), "tanh")


@pytest.mark.parametrize("case", ["LayerNorm", "RMSNorm", "RMSNorm_no_weight"])
def test_norm_ops_opcheck(case):
    kind = case.split("_")[0]
    x = torch.randn(6, 32)
    w = None if case.endswith("no_weight") else torch.randn(32)
    b = torch.randn(32) if kind == "LayerNorm" else None
    torch.library.opcheck(torch.ops.mxtrain.norm_forward_stats.default, (x, w, b, kind, 1e-5, False))
    out, mean, rstd = torch.ops.mxtrain.norm_forward_stats(x, w, b, kind, 1e-5, False)
    for needs in ([True, True, True], [False, True, False]):
        torch.library.opcheck(torch.ops.mxtrain.norm_backward.default,
                              (x, w, b, torch.randn(6, 32), kind, 1e-5, True, needs,
                               mean if mean.numel() else None, rstd if rstd.numel() else None))


@pytest.mark.parametrize("act", ["gelu", "squared_relu", "swiglu", "reglu"])
def test_activation_ops_opcheck(act):
    h = torch.randn(6, 32)
    torch.library.opcheck(torch.ops.mxtrain.activation.default, (h, act))
    grad = torch.randn(6, 16 if is_gated(act) else 32)
    torch.library.opcheck(torch.ops.mxtrain.activation_backward.default, (h, grad, act))
