"""microxcaling's ``mx.simd_ops``: the differentiable elementwise ops on :mod:`mxtrain.emulation.simd_ops`.

``mx_specs`` is translated into an :class:`~mxtrain.emulation.precision.ElementwisePrecision`
(:func:`mxtrain.compat.mx.precision.precision_of`) where it enters; the ``*Function``
classes take ``mx_specs`` in place of the engine's precision, as microxcaling's do.
"""

from __future__ import annotations

import math

import torch

from mxtrain.compat.mx.precision import translating_function
from mxtrain.compat.mx.specs import apply_mx_specs, mx_assert_test
from mxtrain.emulation import simd_ops as _e

__all__ = ["simd_add", "simd_sub", "simd_mul", "simd_div", "simd_split", "simd_square", "simd_sqrt", "simd_exp",
           "simd_log", "simd_reduce_sum", "simd_reduce_mean", "simd_norm"]


SIMDAdd = translating_function(_e.SIMDAdd)
SIMDSub = translating_function(_e.SIMDSub)
SIMDMul = translating_function(_e.SIMDMul)
SIMDDiv = translating_function(_e.SIMDDiv)
SIMDSplit = translating_function(_e.SIMDSplit)
SIMDSquare = translating_function(_e.SIMDSquare)
SIMDSqrt = translating_function(_e.SIMDSqrt)
SIMDExp = translating_function(_e.SIMDExp)
SIMDLog = translating_function(_e.SIMDLog)
SIMDReduceSum = translating_function(_e.SIMDReduceSum)


def simd_add(in1, in2, mx_specs=None):
    mx_assert_test(mx_specs)
    return in1 + in2 if mx_specs is None else SIMDAdd.apply(in1, in2, apply_mx_specs(mx_specs))


def simd_sub(in1, in2, mx_specs=None):
    mx_assert_test(mx_specs)
    return in1 - in2 if mx_specs is None else SIMDSub.apply(in1, in2, apply_mx_specs(mx_specs))


def simd_mul(in1, in2, mx_specs=None):
    mx_assert_test(mx_specs)
    return in1 * in2 if mx_specs is None else SIMDMul.apply(in1, in2, apply_mx_specs(mx_specs))


def simd_div(in1, in2, mx_specs=None):
    mx_assert_test(mx_specs)
    return in1 / in2 if mx_specs is None else SIMDDiv.apply(in1, in2, apply_mx_specs(mx_specs))


def simd_split(in1, mx_specs=None):
    mx_assert_test(mx_specs)
    return (in1, in1) if mx_specs is None else SIMDSplit.apply(in1, apply_mx_specs(mx_specs))


def simd_square(in1, mx_specs=None):
    mx_assert_test(mx_specs)
    return torch.square(in1) if mx_specs is None else SIMDSquare.apply(in1, apply_mx_specs(mx_specs))


def simd_sqrt(in1, mx_specs=None):
    mx_assert_test(mx_specs)
    return torch.sqrt(in1) if mx_specs is None else SIMDSqrt.apply(in1, apply_mx_specs(mx_specs))


def simd_exp(in1, mx_specs=None):
    mx_assert_test(mx_specs)
    return torch.exp(in1) if mx_specs is None else SIMDExp.apply(in1, apply_mx_specs(mx_specs))


def simd_log(in1, mx_specs=None):
    mx_assert_test(mx_specs)
    return torch.log(in1) if mx_specs is None else SIMDLog.apply(in1, apply_mx_specs(mx_specs))


def simd_reduce_sum(in1, dim=None, keepdim=False, mx_specs=None):
    mx_assert_test(mx_specs)
    if dim is None:
        dim = list(range(in1.ndim))
    if mx_specs is None:
        return torch.sum(in1, dim, keepdim=keepdim)
    return SIMDReduceSum.apply(in1, dim, keepdim, apply_mx_specs(mx_specs))


def simd_reduce_mean(in1, dim=None, keepdim=False, mx_specs=None):
    mx_assert_test(mx_specs)
    if dim is None:
        dim = list(range(in1.ndim))
    if mx_specs is None:
        return torch.mean(in1, dim, keepdim=keepdim)
    mx_specs = apply_mx_specs(mx_specs)
    dim = list(dim) if isinstance(dim, (list, tuple)) else [dim]
    denom = math.prod(in1.shape[i] for i in dim)
    s = SIMDReduceSum.apply(in1, dim, keepdim, mx_specs)
    return SIMDMul.apply(s, 1 / denom, mx_specs)


def simd_norm(in1, keepdim=False, mx_specs=None):
    """Frobenius norm ``sqrt(sum(in1**2))``, every step rounded."""
    mx_assert_test(mx_specs)
    if mx_specs is None:
        return torch.linalg.norm(in1, keepdim=keepdim)
    mx_specs = apply_mx_specs(mx_specs)
    sq = SIMDSquare.apply(in1, mx_specs)
    s = SIMDReduceSum.apply(sq, list(range(sq.ndim)), keepdim, mx_specs)
    return SIMDSqrt.apply(s, mx_specs)
