"""mxtrain.Linear / mx_linear: tight checks against the fake-quantized torch reference."""

import pytest
import torch
from torch import nn

import mxtrain

from .reference import (
    RECIPES, TIGHT_TOL, assert_backward_uses_forward_recipe, assert_close_rel, compare_grads, ref_linear,
    run_module,
)

# (input shape, in_features, out_features): 2-D, 3-D, and K, N and tokens all ragged (not multiples of 32)
SHAPES = {
    "2d": ((48, 64), 64, 96),
    "3d": ((2, 24, 64), 64, 32),
    "ragged": ((2, 5, 40), 40, 24),
}


def _make(in_f, out_f, bias=True, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return mxtrain.Linear(in_f, out_f, bias=bias).to(dtype)


def _data(shape, out_f, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype)
    dy = torch.randn(*shape[:-1], out_f, generator=g).to(dtype)
    return x, dy


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("recipe", list(RECIPES), ids=list(RECIPES))
def test_matches_fake_quant_reference(recipe, shape, bias):
    recipe = RECIPES[recipe]
    x_shape, in_f, out_f = SHAPES[shape]
    m = _make(in_f, out_f, bias)
    x, dy = _data(x_shape, out_f)
    y, grads = run_module(m, x, dy, recipe)
    y_ref, g_ref = ref_linear(x, m.weight, m.bias, dy, recipe)
    assert y.shape == y_ref.shape and y.dtype == torch.float32
    assert_close_rel(y, y_ref, 1e-5, "forward")
    compare_grads(grads, g_ref, 1e-5, f"{recipe!r}")


def test_quantize_backward_false_is_high_precision_backward():
    """quantize_backward=False: grads are those of nn.Linear (the backward does not depend on the forward)."""
    m = _make(64, 48)
    x, dy = _data((40, 64), 48)
    _, grads = run_module(m, x, dy, mxtrain.MXFP8Recipe(quantize_backward=False))
    _, hp = run_module(m, x, dy, None)
    for name in hp:
        assert_close_rel(grads[name], hp[name], 1e-6, name)


def test_functional_mx_linear_matches_module():
    m = _make(64, 32)
    x, _ = _data((16, 64), 32)
    r = mxtrain.MXFP4Recipe()
    with mxtrain.mx_autocast(recipe=r):
        assert torch.equal(mxtrain.mx_linear(x, m.weight, m.bias), m(x))
    assert torch.equal(mxtrain.mx_linear(x, m.weight, m.bias), nn.functional.linear(x, m.weight, m.bias))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("recipe", ["mxfp8", "mixed"])
def test_low_precision_params_and_inputs(dtype, recipe):
    recipe = RECIPES[recipe]
    m = _make(40, 24, dtype=dtype)
    x, dy = _data((2, 5, 40), 24, dtype=dtype)
    y, grads = run_module(m, x, dy, recipe)
    assert y.dtype == dtype
    assert all(g.dtype == dtype for g in grads.values())
    y_ref, g_ref = ref_linear(x, m.weight, m.bias, dy, recipe)
    assert_close_rel(y, y_ref, TIGHT_TOL[dtype], "forward")
    compare_grads(grads, g_ref, TIGHT_TOL[dtype], str(dtype))


def test_input_dtype_differs_from_param_dtype():
    """bf16 activations into fp32 weights: output and input grad in bf16, weight grads in fp32."""
    m = _make(64, 32)
    x, dy = _data((24, 64), 32, dtype=torch.bfloat16)
    y, grads = run_module(m, x, dy, RECIPES["mxfp8"])
    assert y.dtype == torch.bfloat16 and grads["x"].dtype == torch.bfloat16
    assert grads["weight"].dtype == torch.float32 and grads["bias"].dtype == torch.float32
    y_ref, g_ref = ref_linear(x, m.weight, m.bias, dy, RECIPES["mxfp8"])
    assert_close_rel(y, y_ref, TIGHT_TOL[torch.bfloat16], "forward")
    compare_grads(grads, g_ref, TIGHT_TOL[torch.bfloat16], "mixed dtypes")


def test_one_dimensional_input():
    m = _make(64, 32)
    x, dy = _data((64,), 32)
    y, grads = run_module(m, x, dy, RECIPES["mxfp8"])
    y_ref, g_ref = ref_linear(x, m.weight, m.bias, dy, RECIPES["mxfp8"])
    assert y.shape == (32,)
    assert_close_rel(y, y_ref, 1e-5, "forward")
    compare_grads(grads, g_ref, 1e-5, "1-D")


def test_frozen_weight_and_input_without_grad():
    """Only the gradients that are needed are computed (and they still match)."""
    recipe = RECIPES["mxfp8"]
    m = _make(64, 32)
    x, dy = _data((24, 64), 32)
    _, g_ref = ref_linear(x, m.weight, m.bias, dy, recipe)
    m.weight.requires_grad_(False)
    _, grads = run_module(m, x, dy, recipe)
    assert grads["weight"] is None
    assert_close_rel(grads["x"], g_ref["x"], 1e-5, "dx")
    assert_close_rel(grads["bias"], g_ref["bias"], 1e-5, "dbias")
    m.weight.requires_grad_(True)
    with mxtrain.mx_autocast(recipe=recipe):
        y = m(x)  # x does not require grad
    y.backward(dy)
    assert_close_rel(m.weight.grad, g_ref["weight"], 1e-5, "dweight")


def test_outside_autocast_is_nn_linear():
    torch.manual_seed(0)
    ref = nn.Linear(40, 24)
    m = mxtrain.Linear(40, 24)
    m.load_state_dict(ref.state_dict())
    x, dy = _data((3, 7, 40), 24)
    y, grads = run_module(m, x, dy, None)
    y_ref, g_ref = run_module(ref, x, dy, None)
    assert torch.equal(y, y_ref)
    for name in g_ref:
        assert torch.equal(grads[name], g_ref[name]), name


def test_state_dict_round_trip_with_nn_linear():
    torch.manual_seed(0)
    ref = nn.Linear(64, 48)
    m = mxtrain.Linear(64, 48)
    assert set(m.state_dict()) == set(ref.state_dict()) == {"weight", "bias"}
    m.load_state_dict(ref.state_dict())
    x = torch.randn(5, 64)
    assert torch.equal(m(x), ref(x))
    with torch.no_grad():
        m.weight.mul_(2)
    back = nn.Linear(64, 48)
    back.load_state_dict(m.state_dict())
    assert torch.equal(back(x), m(x))
    nobias = nn.Linear(64, 48, bias=False)
    m2 = mxtrain.Linear(64, 48, bias=False)
    m2.load_state_dict(nobias.state_dict())
    assert torch.equal(m2(x), nobias(x))


def test_backward_uses_forward_recipe():
    m = _make(64, 48)
    x, dy = _data((2, 16, 64), 48)
    assert_backward_uses_forward_recipe(m, x, dy, mxtrain.MXFP8Recipe(), mxtrain.MXFP4Recipe())


@pytest.mark.parametrize("autocast", [False, True], ids=["plain", "mx"])
def test_bad_inputs_raise_clear_errors(autocast):
    m = _make(64, 32)
    with mxtrain.mx_autocast(enabled=autocast):
        with pytest.raises(ValueError, match=r"\[\.\.\., 64\].*\[4, 63\]"):
            m(torch.randn(4, 63))
        with pytest.raises(TypeError, match="int64"):
            m(torch.ones(4, 64, dtype=torch.long))
        with pytest.raises(TypeError, match="float64"):
            m(torch.randn(4, 64, dtype=torch.float64))
        with pytest.raises(TypeError, match="Tensor"):
            m([[0.0] * 64])


def test_module_is_a_drop_in_nn_linear():
    m = mxtrain.Linear(40, 24, bias=False)
    assert isinstance(m, nn.Linear)
    assert m.bias is None and m.weight.shape == (24, 40)


@pytest.mark.parametrize("make", [lambda: mxtrain.Linear(64, 32), lambda: mxtrain.LayerNormLinear(64, 32),
                                  lambda: mxtrain.LayerNormMLP(64, 32)], ids=["Linear", "LayerNormLinear",
                                                                             "LayerNormMLP"])
def test_second_backward_with_retain_graph_raises_clear_error(make):
    """MX operands are released after backward (memory); a retained-graph second backward says so."""
    m = make()
    x = torch.randn(8, 64, requires_grad=True)
    with mxtrain.mx_autocast(recipe=RECIPES["mxfp8"]):
        y = m(x)
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"backward through an mxtrain \w+ a second time"):
        y.sum().backward()


def test_inplace_change_of_input_is_caught_when_backward_needs_it_in_high_precision():
    """With the wgrad input left in high precision, the input itself is needed by backward: modifying it
    in place after forward must raise (as nn.Linear does), never give silently wrong weight gradients."""
    m = _make(64, 32)
    x0 = torch.randn(8, 64, requires_grad=True)
    for recipe in (None, mxtrain.MXFP8Recipe(quantize_backward=False)):
        x = x0 * 1
        with mxtrain.mx_autocast(enabled=recipe is not None, recipe=recipe):
            y = m(x)
        x.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()
    # MX planes are snapshots taken in forward: the gradient is that of the forward's input
    _, g_ref = ref_linear(x0.detach(), m.weight, m.bias, torch.ones(8, 32), RECIPES["mxfp8"])
    m.zero_grad()
    x = x0.detach() * 1
    with mxtrain.mx_autocast(recipe=RECIPES["mxfp8"]):
        y = m(x)
    x.mul_(2)
    y.sum().backward()
    assert_close_rel(m.weight.grad, g_ref["weight"], 1e-5, "dweight")


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8_hybrid", "mixed"])
def test_gemm_operands_are_the_roles_in_their_block_directions(recipe):
    """The operands reaching each GEMM are exactly fq(operand, role, axis) of DESIGN.md's table.

    On randn data MXFP8 rounds each element alike in either block direction (e4m3 keeps
    them all normal), so the output comparisons cannot see a wrong direction; values
    spread over 20-32 binades make every direction show, and operands are compared bit for bit.
    """
    from .reference import find_gemm, fq, record_gemm_operands, wide_range

    recipe = RECIPES[recipe]
    m = _make(64, 96)
    with torch.no_grad():
        m.weight.copy_(wide_range(m.weight, seed=3))
    x, dy = _data((2, 24, 64), 96)
    x2d, w = wide_range(x, seed=4).reshape(-1, 64), m.weight.detach()
    dy2d = wide_range(dy, binades=16, seed=5).reshape(-1, 96)  # e5m2 (hybrid dY) spans 30 binades
    for t, role in ((x2d, "fprop_input"), (w, "fprop_weight"), (dy2d, "dgrad_grad_output"),
                    (dy2d, "wgrad_grad_output"), (w, "dgrad_weight"), (x2d, "wgrad_input")):
        if recipe.role(role).fmt is not None:  # the check has teeth: the other direction differs
            assert not torch.equal(fq(t, recipe, role, 0), fq(t, recipe, role, 1)), role
    with record_gemm_operands() as gemms:
        run_module(m, x2d, dy2d, recipe)
    assert len(gemms) == 3
    assert find_gemm(gemms, fq(x2d, recipe, "fprop_input", 1), fq(w, recipe, "fprop_weight", 1)), "fprop"
    assert find_gemm(gemms, fq(dy2d, recipe, "dgrad_grad_output", 1), fq(w, recipe, "dgrad_weight", 0).t()), \
        "dgrad"
    assert find_gemm(gemms, fq(dy2d, recipe, "wgrad_grad_output", 0).t(), fq(x2d, recipe, "wgrad_input", 0).t()), \
        "wgrad"
