"""ElementwisePrecision: the typed input of the emulation engine, and its two sources (recipe, mx_specs)."""

import ast
import pathlib

import pytest
import torch

import mxtrain
from mxtrain.compat import mx
from mxtrain.compat.mx.precision import precision_of
from mxtrain.elementwise.modules import elementwise_precision
from mxtrain.emulation import ElementwisePrecision, round_to
from mxtrain.formats import bfloat, fp
from mxtrain.quantization import quantize_elemwise


def test_fields_are_checked_and_fp32_rounds_nothing():
    assert ElementwisePrecision("bfloat16").fmt == bfloat(16)
    assert ElementwisePrecision("bfloat32").fmt is None
    with pytest.raises(ValueError, match="bfloatN"):
        ElementwisePrecision("fp8_e4m3")
    with pytest.raises(ValueError, match="rounding"):
        ElementwisePrecision("fp8", rounding="dither")
    with pytest.raises(TypeError, match="subnormals"):
        ElementwisePrecision("fp8", subnormals=1)


def test_backward_is_unrounded_without_quantize_backward():
    p = ElementwisePrecision(fp(10), rounding="floor", quantize_backward=False, div_as_recip=True)
    assert p.backward().fmt is None and p.backward().div_as_recip
    q = ElementwisePrecision(fp(10))
    assert q.backward() is q


def test_recipe_and_mx_specs_give_the_same_precision():
    recipe = mxtrain.MXRecipe(elemwise_format="fp12", elemwise_subnormals=False, quantize_backward=False)
    specs = mx.MxSpecs()
    specs["fp"], specs["round"], specs["bfloat_subnorms"], specs["quantize_backprop"] = 12, "even", False, False
    assert elementwise_precision(recipe) == precision_of(mx.finalize_mx_specs(specs))
    assert elementwise_precision(mxtrain.MXRecipe()) is None
    assert precision_of(specs, round="dither").rounding == "stochastic"


def test_round_to_is_the_reference_rounding():
    x = torch.randn(1000) * 100
    p = ElementwisePrecision("bfloat12", rounding="nearest")
    assert torch.equal(round_to(x, p), quantize_elemwise(x, "bfloat12", rounding="nearest"))
    assert round_to(x, None) is x


def test_the_engine_takes_no_mx_specs():
    """Nothing under mxtrain/emulation names microxcaling's dict: compat/mx translates it before the engine."""
    root = pathlib.Path(mxtrain.__file__).parent / "emulation"
    for path in root.glob("*.py"):
        tree = ast.parse(path.read_text())
        names = {n.arg for n in ast.walk(tree) if isinstance(n, ast.arg)}
        names |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        assert not {n for n in names if "mx_specs" in n}, path.name


def test_the_norm_engine_unrounded_is_the_plain_formula_and_compat_translates_into_it():
    """emulation.layernorm at fmt=None computes layer/RMS norm as torch does; compat/mx's Functions are it."""
    from mxtrain.compat.mx import layernorm as compat_ln
    from mxtrain.emulation import layernorm as engine
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, dtype=torch.float64, requires_grad=True)
    b = torch.randn(16, dtype=torch.float64, requires_grad=True)
    plain = ElementwisePrecision(None)
    rms = lambda x, w, b: w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) + b  # noqa: E731
    for fn, ref in ((engine.LayerNormFunction, lambda x, w, b: torch.nn.functional.layer_norm(x, (16,), w, b, 1e-6)),
                    (engine.RMSNormFunction, rms)):
        g = torch.randn(3, 5, 16, dtype=torch.float64)
        ours = torch.autograd.grad(fn.apply(x, w, b, 1e-6, plain), (x, w, b), g)
        theirs = torch.autograd.grad(ref(x, w, b), (x, w, b), g)
        for a, t in zip(ours, theirs):
            torch.testing.assert_close(a, t)
        out = fn.apply(x.float(), w.float(), b.float(), 1e-6, ElementwisePrecision("bfloat16"))
        assert torch.equal(out, out.bfloat16().float())  # every step rounded, the output too
    assert issubclass(compat_ln.LayerNormFunction, engine.LayerNormFunction)
    assert issubclass(compat_ln.RMSNormFunction, engine.RMSNormFunction)
