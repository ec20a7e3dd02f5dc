"""Bad input and edge cases (issue 25, item 3): zero-token batches, double backward, fake_quantize_mx's
gradient, recipe block sizes, dequantize dtypes, MXTensor validation, seeded elementwise rounding."""

import dataclasses

import pytest
import torch

import mxtrain
from mxtrain.formats import MAX_BLOCK_SIZE, MX_FORMAT_NAMES, pack_group
from mxtrain.modules import Conv2d, GroupNorm
from mxtrain.quantization import MXTensor, fake_quantize_mx, quantize_mx
from mxtrain.recipes import MXRecipe

RECIPES = [mxtrain.MXFP8Recipe(), mxtrain.MXFP4Recipe(), mxtrain.MXFP8Recipe(elemwise_format="bfloat16"),
           mxtrain.Float8CurrentScaling(), mxtrain.DelayedScaling(), mxtrain.Float8BlockScaling()]
MODULES = {
    "Linear": lambda: mxtrain.Linear(64, 32),
    "LayerNormLinear": lambda: mxtrain.LayerNormLinear(64, 32, return_layernorm_output=True),
    "LayerNormMLP": lambda: mxtrain.LayerNormMLP(64, 96, activation="swiglu", normalization="RMSNorm"),
    "LayerNorm": lambda: mxtrain.LayerNorm(64),
    "RMSNorm": lambda: mxtrain.RMSNorm(64),
}


def _torch_twin(name, m):
    """The torch computation of the same module outside mx_autocast (what a zero-token batch must match)."""
    twin = MODULES[name]()
    twin.load_state_dict(m.state_dict())
    return twin


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: repr(r))
@pytest.mark.parametrize("name", list(MODULES))
def test_zero_token_batch_matches_torch(name, recipe):
    m = MODULES[name]()
    x = torch.randn(2, 0, 64, requires_grad=True)
    with mxtrain.mx_autocast(recipe=recipe):
        out = m(x)
    twin = _torch_twin(name, m)
    x_ref = x.detach().clone().requires_grad_()
    want = twin(x_ref)
    outs, wants = (out, want) if isinstance(out, tuple) else ((out,), (want,))
    for o, w in zip(outs, wants):
        assert o.shape == w.shape and o.dtype == w.dtype
    sum(o.sum() for o in outs).backward()
    sum(w.sum() for w in wants).backward()
    assert x.grad.shape == x.shape
    for (pn, p), q in zip(m.named_parameters(), twin.parameters()):
        assert p.grad is not None and p.grad.shape == p.shape and p.grad.dtype == p.dtype, pn
        assert torch.equal(p.grad, q.grad), pn  # zeros, as torch


def test_zero_token_batch_bf16_and_functional():
    m = mxtrain.Linear(64, 32).bfloat16()
    x = torch.randn(0, 64, dtype=torch.bfloat16, requires_grad=True)
    with mxtrain.mx_autocast(recipe=mxtrain.MXFP8Recipe()):
        y = m(x)
        z = mxtrain.mx_linear(x, m.weight)
    assert y.shape == (0, 32) and y.dtype == torch.bfloat16 and z.shape == (0, 32)
    (y.sum() + z.sum()).backward()
    assert m.weight.grad.dtype == torch.bfloat16 and not m.weight.grad.any()
    assert m.bias.grad.shape == (32,) and not m.bias.grad.any()


def test_zero_token_batch_records_no_amax_under_delayed_scaling():
    torch.manual_seed(0)
    x = torch.randn(8, 32)
    recipe = mxtrain.DelayedScaling(amax_history_len=4)
    plain, mixed = mxtrain.Linear(32, 16), mxtrain.Linear(32, 16)
    mixed.load_state_dict(plain.state_dict())
    with mxtrain.mx_autocast(recipe=recipe):
        for _ in range(2):
            plain(x)
        mixed(x)
        mixed(torch.randn(0, 32))  # must not push a zero amax into the history
        mixed(x)
        plain(x), mixed(x)  # the update that would show it
    torch.testing.assert_close(mixed.recipe_state.amax_history, plain.recipe_state.amax_history, rtol=0, atol=0)
    torch.testing.assert_close(mixed.recipe_state.scale, plain.recipe_state.scale, rtol=0, atol=0)


@pytest.mark.parametrize("make, shape", [(lambda: Conv2d(32, 16, 3, padding=1), (0, 32, 5, 5)),
                                         (lambda: GroupNorm(4, 32), (0, 32, 6))])
def test_zero_batch_conv_and_groupnorm(make, shape):
    m = make()
    x = torch.randn(*shape, requires_grad=True)
    with mxtrain.mx_autocast(recipe=mxtrain.MXFP8Recipe(elemwise_format="bfloat16")):
        y = m(x)
    with torch.no_grad():
        want = type(m).__mro__[1].forward(m, x)  # the torch parent's forward: the shape torch gives
    assert y.shape == want.shape and y.dtype == want.dtype
    y.sum().backward()
    assert x.grad.shape == x.shape
    for p in m.parameters():
        assert p.grad is not None and p.grad.shape == p.shape and not p.grad.any()


@pytest.mark.parametrize("name", ["Linear", "LayerNormLinear", "LayerNormMLP"])
@pytest.mark.parametrize("recipe", [mxtrain.MXFP8Recipe(), mxtrain.Float8CurrentScaling()], ids=repr)
def test_double_backward_raises_a_clear_error(name, recipe):
    torch.manual_seed(0)
    m = MODULES[name]()
    x = torch.randn(4, 64, requires_grad=True)
    with mxtrain.mx_autocast(recipe=recipe):
        out = m(x)
    y = out[0] if isinstance(out, tuple) else out
    (g,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    with mxtrain.mx_autocast(recipe=recipe):
        out2 = m(x)
    y2 = out2[0] if isinstance(out2, tuple) else out2
    (g_plain,) = torch.autograd.grad(y2.square().sum(), x)
    assert torch.equal(g, g_plain)  # first order: the usual gradient
    with pytest.raises(RuntimeError, match=f"double backward through mxtrain {name} is not supported"):
        g.sum().backward()


def test_fake_quantize_mx_has_a_straight_through_gradient():
    x = torch.randn(4, 64, requires_grad=True)
    y = fake_quantize_mx(x, "fp4_e2m1", block_size=32)
    assert torch.equal(y, fake_quantize_mx(x.detach(), "fp4_e2m1", block_size=32))  # same bits
    g = torch.randn(4, 64)
    y.backward(g)
    assert torch.equal(x.grad, g)


@pytest.mark.parametrize("fmt", MX_FORMAT_NAMES)
def test_recipes_refuse_block_sizes_their_format_cannot_pack(fmt):
    group = pack_group(fmt)
    for bs in range(1, 9):
        if bs % group:
            with pytest.raises(ValueError, match=f"cannot be packed for {fmt}.*multiple of {group}"):
                MXRecipe.uniform(fmt, block_size=bs)
        else:
            recipe = MXRecipe.uniform(fmt, block_size=bs)
            m = mxtrain.Linear(24, 8)
            with mxtrain.mx_autocast(recipe=recipe):  # every accepted size runs
                m(torch.randn(3, 24)).sum().backward()
    with pytest.raises(ValueError, match="MXFP6Recipe.block_size=7 cannot be packed"):
        mxtrain.MXFP6Recipe(block_size=7)
    assert MXRecipe.uniform(fmt, block_size=0).block_size == 0


def test_block_sizes_are_bounded():
    with pytest.raises(ValueError, match=rf"block_size must be an int in \[0, {MAX_BLOCK_SIZE}\]"):
        mxtrain.MXFP8Recipe(block_size=2**40)
    with pytest.raises(ValueError, match=rf"block_size must be in \[0, {MAX_BLOCK_SIZE}\]"):
        quantize_mx(torch.randn(2, 4), "fp8_e4m3", block_size=2**40)
    with pytest.raises(ValueError, match=rf"block_size must be in \[0, {MAX_BLOCK_SIZE}\]"):
        fake_quantize_mx(torch.randn(2, 4), "fp8_e4m3", block_size=MAX_BLOCK_SIZE + 1)
    assert mxtrain.MXFP8Recipe(block_size=MAX_BLOCK_SIZE).block_size == MAX_BLOCK_SIZE


@pytest.mark.parametrize("dtype", [torch.int32, torch.uint8, torch.bool, torch.float8_e4m3fn])
def test_dequantize_takes_floating_dtypes_only(dtype):
    q = quantize_mx(torch.randn(4, 64), "fp8_e4m3")
    with pytest.raises(TypeError, match="dequantize gives floating-point values"):
        q.dequantize(dtype=dtype)
    with pytest.raises(TypeError, match="dequantize gives floating-point values"):
        q.dequantize_blocked(dtype=dtype)
    f8 = mxtrain.quantization.float8.quantize_float8(torch.randn(4, 64))
    with pytest.raises(TypeError, match="dequantize gives floating-point values"):
        f8.dequantize(dtype=dtype)
    assert q.dequantize(torch.float64).dtype == torch.float64


def test_mxtensor_validates_its_fields():
    q = quantize_mx(torch.randn(4, 64), "fp4_e2m1", axis=(1, 0))
    p = q.planes[0]
    bad = [
        (dict(fmt="fp9"), ValueError, "MXTensor.fmt must name an MX element format"),
        (dict(block_size=0), ValueError, "block_size must be a positive int"),
        (dict(block_size=True), ValueError, "block_size must be a positive int"),
        (dict(dtype=torch.int32), TypeError, "MXTensor.dtype"),
        (dict(shape=(4, 65)), ValueError, r"needs data \[4, 48\] and scale \[4, 3\]"),
        (dict(scale_mode="up"), ValueError, "scale_mode must be one of"),
        (dict(planes=(dataclasses.replace(p, data=p.data.float()),)), TypeError, "integer element codes"),
        (dict(planes=(dataclasses.replace(p, data=p.data.to(torch.int32)),)), TypeError, "integer element codes"),
        (dict(planes=(dataclasses.replace(p, scale=p.scale.float()),)), TypeError, "E8M0 scale bytes"),
        (dict(planes=(dataclasses.replace(p, axis=2),)), ValueError, r"MXPlane.axis must be an int in \[0, 1\]"),
        (dict(planes=(dataclasses.replace(p, scale=p.scale[:, :1]),)), ValueError, "needs data"),
        (dict(planes=("codes",)), TypeError, "must hold MXPlane objects"),
    ]
    for change, err, match in bad:
        with pytest.raises(err, match=match):
            dataclasses.replace(q, **change)
    assert dataclasses.replace(q, fmt="mxfp4").fmt == "fp4_e2m1"  # aliases are stored canonically
    assert torch.equal(q.to("cpu").dequantize(), q.dequantize())  # a valid tensor passes
    # the kernels' unchecked constructor skips the checks (the hot path)
    assert MXTensor._unchecked(q.planes, "fp4_e2m1", 32, q.shape, q.dtype).fmt == "fp4_e2m1"


def test_elementwise_stochastic_rounding_uses_the_recipe_seed():
    from mxtrain.modules import _common

    def run(seed):
        _common._GENERATORS.clear()  # a fresh run: each seed's generator starts from the seed
        recipe = mxtrain.MXFP8Recipe(elemwise_format="bfloat10", rounding="stochastic", seed=seed)
        m = mxtrain.LayerNorm(64)
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
        with mxtrain.mx_autocast(recipe=recipe):
            return m(x)

    torch.manual_seed(123)
    a = run(0)
    torch.manual_seed(456)  # torch's global RNG must not matter
    b = run(0)
    c = run(1)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
