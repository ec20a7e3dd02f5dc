"""microxcaling's ``mx.simd_ops``: the differentiable elementwise ops on :mod:`mxtrain.emulation.simd_ops`.

``mx_specs`` is translated into an :class:`~mxtrain.emulation.precision.ElementwisePrecision`
(:func:`mxtrain.compat.mx.precision.precision_of`) where it enters; the ``*Function``
classes take ``mx_specs`` in place of the engine's precision, as microxcaling's do.
"""

from __future__ import annotations

import math
import operator

import torch

from mxtrain.compat.mx.precision import translating_function
from mxtrain.compat.mx.specs import apply_mx_specs, mx_assert_test
from mxtrain.emulation import simd_ops as _e

__all__ = ["simd_add", "simd_sub", "simd_mul", "simd_div", "simd_split", "simd_square", "simd_sqrt", "simd_exp",
           "simd_log", "simd_reduce_sum", "simd_reduce_mean", "simd_norm"]


(SIMDAdd, SIMDSub, SIMDMul, SIMDDiv, SIMDSplit, SIMDSquare, SIMDSqrt, SIMDExp, SIMDLog, SIMDReduceSum) = map(
    translating_function, (_e.SIMDAdd, _e.SIMDSub, _e.SIMDMul, _e.SIMDDiv, _e.SIMDSplit, _e.SIMDSquare, _e.SIMDSqrt,
                           _e.SIMDExp, _e.SIMDLog, _e.SIMDReduceSum))


def _apply(function, exact, mx_specs, *args):
    """``exact(*args)`` without ``mx_specs``, else ``function`` at its precision."""
    mx_assert_test(mx_specs)
    return exact(*args) if mx_specs is None else function.apply(*args, apply_mx_specs(mx_specs))


def simd_add(in1, in2, mx_specs=None):
    return _apply(SIMDAdd, operator.add, mx_specs, in1, in2)


def simd_sub(in1, in2, mx_specs=None):
    return _apply(SIMDSub, operator.sub, mx_specs, in1, in2)


def simd_mul(in1, in2, mx_specs=None):
    return _apply(SIMDMul, operator.mul, mx_specs, in1, in2)


def simd_div(in1, in2, mx_specs=None):
    return _apply(SIMDDiv, operator.truediv, mx_specs, in1, in2)


def _unary(function, exact):
    """microxcaling's ``simd_<op>(in1, mx_specs=None)``: ``exact(in1)`` without mx_specs, else ``function``."""
    def op(in1, mx_specs=None):
        return _apply(function, exact, mx_specs, in1)
    op.__name__ = op.__qualname__ = "simd_" + function.__name__[len("SIMD"):].lower()
    return op


simd_split, simd_square, simd_sqrt, simd_exp, simd_log = (
    _unary(SIMDSplit, lambda x: (x, x)), _unary(SIMDSquare, torch.square), _unary(SIMDSqrt, torch.sqrt),
    _unary(SIMDExp, torch.exp), _unary(SIMDLog, torch.log))


def simd_reduce_sum(in1, dim=None, keepdim=False, mx_specs=None):
    dim = list(range(in1.ndim)) if dim is None else dim
    return _apply(SIMDReduceSum, lambda x, d, k: torch.sum(x, d, keepdim=k), mx_specs, in1, dim, keepdim)


def simd_reduce_mean(in1, dim=None, keepdim=False, mx_specs=None):
    mx_assert_test(mx_specs)
    dim = list(range(in1.ndim)) if dim is None else dim
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
