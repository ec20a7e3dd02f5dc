"""compat/mx's microxcaling-style functions translate mx_specs into the engine's ElementwisePrecision: each
public op under an MxSpecs equals the emulation engine's Function under ``precision_of`` of those specs, and
rounds (a wrong argument position once made every simd op fail with an IndexError)."""

import pytest
import torch

from mxtrain.compat import mx
from mxtrain.compat.mx import activations as ca, simd_ops as cs
from mxtrain.compat.mx.precision import precision_of, translating_function
from mxtrain.emulation import activations as ea, simd_ops as es


def _specs():
    s = mx.MxSpecs()
    s["bfloat"] = 16
    return mx.finalize_mx_specs(s) if hasattr(mx, "finalize_mx_specs") else s


BINARY = [("simd_add", es.SIMDAdd), ("simd_sub", es.SIMDSub), ("simd_mul", es.SIMDMul), ("simd_div", es.SIMDDiv)]
UNARY = [("simd_square", es.SIMDSquare), ("simd_sqrt", es.SIMDSqrt), ("simd_exp", es.SIMDExp),
         ("simd_log", es.SIMDLog)]


@pytest.mark.parametrize("name,engine", BINARY + UNARY)
def test_simd_ops_equal_the_engine_and_round(name, engine):
    torch.manual_seed(0)
    specs = _specs()
    args = [torch.rand(33) + 0.5 for _ in range(2 if (name, engine) in BINARY else 1)]
    ins = [a.clone().requires_grad_(True) for a in args]
    ref_ins = [a.clone().requires_grad_(True) for a in args]
    y = getattr(cs, name)(*ins, mx_specs=specs)
    want = engine.apply(*ref_ins, precision_of(specs))
    assert torch.equal(y, want)
    assert torch.equal(y, y.bfloat16().float())  # rounded to bfloat16
    y.sum().backward()
    want.sum().backward()
    for a, b in zip(ins, ref_ins):
        assert torch.equal(a.grad, b.grad)


def test_activation_functions_translate():
    x = torch.randn(40)
    specs = _specs()
    assert torch.equal(ca.gelu(x, mx_specs=specs), ea.GELUFunction.apply(x, precision_of(specs)))


def test_translating_function_needs_a_prec_argument():
    class NoPrec(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x

    with pytest.raises(TypeError, match="takes no 'prec' argument"):
        translating_function(NoPrec)
