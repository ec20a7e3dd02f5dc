"""Quantizers: the planes each makes, one cast per tensor, built once per module and recipe, DelayedScaling binding."""

import copy
import pickle

import pytest
import torch

import mxtrain
from mxtrain.kernels.dispatch import quantize, quantize_float8
from mxtrain.modules._common import recipe_generator
from mxtrain.modules._quantizer import TENSOR_ROLES, Quantizer, delayed_slots, make_quantizers
from mxtrain.quantization import MXTensor
from mxtrain.quantization.float8 import Float8Tensor
from mxtrain.recipes import ROLE_NAMES


def _mx_equal(a: MXTensor, b: MXTensor, axis: int) -> bool:
    pa, pb = a.plane(axis), b.plane(axis)
    return torch.equal(pa.data, pb.data) and torch.equal(pa.scale, pb.scale)


def test_mx_quantizer_makes_the_planes_asked_for():
    recipe = mxtrain.MXFP8Recipe()
    q, spec = make_quantizers(recipe)[""].input, recipe.role("fprop_input")
    x = torch.randn(48, 96)
    ref = quantize(x, spec.fmt, block_size=spec.block_size, axis=(1, 0), scale_mode=spec.scale_mode)
    row, col = q.quantize(x)
    assert isinstance(row, MXTensor) and isinstance(col, MXTensor)
    assert len(row.planes) == 1 and len(col.planes) == 1  # each use holds only its own plane
    assert _mx_equal(row, ref, 1) and _mx_equal(col, ref, 0)
    for axis in (1, 0):  # the one cast of both planes gives what a cast per plane gives
        alone = quantize(x, spec.fmt, block_size=spec.block_size, axis=(axis,), scale_mode=spec.scale_mode)
        assert _mx_equal(ref, alone, axis)
    only_row = q.quantize(x, True, False)
    assert only_row[1] is None and _mx_equal(only_row[0], ref, 1)
    only_col = q.quantize(x, False, True)
    assert only_col[0] is None and _mx_equal(only_col[1], ref, 0)
    assert q.quantize(x, False, False) == (None, None)


def test_high_precision_use_is_the_tensor_itself():
    q = make_quantizers(mxtrain.MXFP8Recipe(quantize_backward=False))[""].input
    x = torch.randn(32, 64)
    row, col = q.quantize(x)
    assert isinstance(row, MXTensor) and col is x
    assert not q.one_spec and not q.shared


@pytest.mark.parametrize("recipe", [mxtrain.Float8CurrentScaling(), mxtrain.Float8BlockScaling()])
def test_float8_quantizer_one_cast_for_both_planes(recipe, monkeypatch):
    q = make_quantizers(recipe)[""].weight
    w = torch.randn(256, 128)
    spec = recipe.role("fprop_weight")
    ref = quantize_float8(w, spec.fmt, axes=(1, 0), block=spec.block, power_of_2_scales=spec.power_of_2_scales)
    calls = []
    import mxtrain.modules._quantizer as qmod

    real = qmod.quantize_float8
    monkeypatch.setattr(qmod, "quantize_float8", lambda *a, **k: calls.append(k["axes"]) or real(*a, **k))
    row, col = q.quantize(w)
    assert calls == [(1, 0)]  # one spec serves both uses: one cast writes both planes
    assert isinstance(row, Float8Tensor) and isinstance(col, Float8Tensor)
    for got, axis in ((row, 1), (col, 0)):
        assert torch.equal(got.plane(axis).data, ref.plane(axis).data)
        assert torch.equal(got.plane(axis).scale_inv, ref.plane(axis).scale_inv)
    assert q.dgrad_in_forward and q.keeps_dgrad_plane(torch.nn.Parameter(w))
    assert q.weight_planes(w, need_dgrad=False)[1] is None
    assert q.weight_planes(w, need_dgrad=True)[1] is not None


def test_mx_weight_dgrad_plane_is_cast_in_backward():
    q = make_quantizers(mxtrain.MXFP8Recipe())[""].weight
    w = torch.randn(64, 64)
    row, col = q.weight_planes(w, need_dgrad=True)
    assert isinstance(row, MXTensor) and col is None and not q.dgrad_in_forward


def test_stochastic_rounding_casts_each_use_alone():
    recipe = mxtrain.MXFP8Recipe(rounding="stochastic", seed=5)
    q = make_quantizers(recipe, generator=recipe_generator(recipe, torch.device("cpu")))[""].input
    assert q.one_spec and not q.shared and not q.cacheable
    assert q.generator is recipe_generator(recipe, torch.device("cpu"))


def test_role_view_and_bad_role():
    recipe = mxtrain.MXFP6Recipe()
    g = make_quantizers(recipe)[""]
    for name in ROLE_NAMES:
        assert g.role(name) == recipe.role(name)
    for tensor, (row, col) in TENSOR_ROLES.items():
        assert isinstance(getattr(g, tensor), Quantizer)
        assert getattr(g, tensor).row_spec == recipe.role(row) and getattr(g, tensor).col_spec == recipe.role(col)
    with pytest.raises(ValueError, match="unknown GEMM operand role 'fprop_bias'"):
        g.role("fprop_bias")


def _kept(module):
    return module.__dict__.get("_mxtrain_quantizers")


def test_built_once_per_module_and_recipe():
    m = mxtrain.Linear(32, 16)
    x = torch.randn(4, 32)
    recipe = mxtrain.MXFP8Recipe()
    with mxtrain.mx_autocast(recipe=recipe):
        m(x).sum().backward()
        first = _kept(m)
        m(x).sum().backward()
    assert first is not None and _kept(m) is first and first.recipe is recipe
    assert m.forward_quantizers(recipe, x.device) is first
    other = mxtrain.MXFP4Recipe()
    with mxtrain.mx_autocast(recipe=other):
        m(x)
    assert _kept(m) is not first and _kept(m).recipe is other  # a new recipe: built anew
    assert _kept(m)[""].input.row_spec.fmt == "fp4_e2m1"
    m2 = mxtrain.Linear(32, 16)
    assert m2.forward_quantizers(other, x.device) is not _kept(m)  # per module


def test_rebuilt_when_the_generator_is_new():
    from mxtrain.modules import _common

    recipe = mxtrain.MXFP8Recipe(rounding="stochastic", seed=11)
    m = mxtrain.Linear(32, 16)
    first = m.forward_quantizers(recipe, torch.device("cpu"))
    assert m.forward_quantizers(recipe, torch.device("cpu")) is first
    _common._GENERATORS.pop((11, torch.device("cpu")))  # a fresh run's generator: the quantizers follow it
    again = m.forward_quantizers(recipe, torch.device("cpu"))
    assert again is not first and again[""].input.generator is _common._GENERATORS[(11, torch.device("cpu"))]
    copy.deepcopy(m)  # the kept quantizers (and their generator) are not part of a copy or a pickle
    assert "_mxtrain_quantizers" not in pickle.loads(pickle.dumps(m)).__dict__


def _trained(module, recipe, x):
    with mxtrain.mx_autocast(recipe=recipe):
        module(x).sum().backward()
    return _kept(module)


def test_delayed_scaling_binds_the_module_state():
    m = mxtrain.LayerNormMLP(32, 64)
    recipe = mxtrain.DelayedScaling()
    x = torch.randn(4, 32)
    qs = _trained(m, recipe, x)
    state = m.recipe_state
    assert qs.state is state and set(qs.gemms) == {"fc1", "fc2"}
    for gemm in ("fc1", "fc2"):
        for tensor in TENSOR_ROLES:
            q = getattr(qs[gemm], tensor)
            assert q.row_spec.state is state and q.row_spec.slot == f"{gemm}.{tensor}"
            assert q.col_spec == q.row_spec and q.shared and not q.cacheable
    assert qs["fc1"].input.row_spec != qs["fc2"].input.row_spec  # fc1's and fc2's tensors kept apart
    assert [s for s, _ in delayed_slots(recipe, "fc1")] == ["fc1.input", "fc1.weight", "fc1.grad_output"]
    assert _trained(m, recipe, x) is qs  # the same state: the same quantizers
    with torch.no_grad():  # evaluation: bound to a frozen view (nothing recorded), built for that forward only
        frozen = m.forward_quantizers(recipe, x.device)
        m(x)
    assert frozen is not qs and frozen.state is not state and frozen.state.state is state and _kept(m) is qs
    other = _trained(mxtrain.LayerNormMLP(32, 64), recipe, x)
    assert other["fc1"].input.row_spec != qs["fc1"].input.row_spec  # another module, another state


def test_reset_and_load_rebuild_the_binding():
    m = mxtrain.Linear(32, 16)
    recipe = mxtrain.DelayedScaling()
    x = torch.randn(4, 32)
    first = _trained(m, recipe, x)
    sd = m.state_dict()
    m.reset_recipe_state()
    assert _kept(m) is None
    m.load_state_dict(sd)
    qs = _trained(m, recipe, x)
    assert qs is not first and qs.state is m.recipe_state and qs[""].input.row_spec.slot == "input"


def test_functional_form_refuses_delayed_scaling():
    with mxtrain.mx_autocast(recipe=mxtrain.DelayedScaling()), pytest.raises(RuntimeError, match="per module"):
        mxtrain.mx_linear(torch.randn(4, 32), torch.randn(16, 32))
