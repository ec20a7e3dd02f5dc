"""microxcaling's ``mx.vector_ops``: :mod:`mxtrain.emulation.vector_ops` taking ``mx_specs``.

Each op translates ``mx_specs`` (and ``round``, which overrides ``mx_specs['round']``)
into an :class:`~mxtrain.emulation.precision.ElementwisePrecision` and calls the engine.
"""

from __future__ import annotations

from mxtrain.compat.mx.precision import precision_of
from mxtrain.emulation import vector_ops as _v
from mxtrain.emulation.vector_ops import LN_2_EXACT, LOG2_E_BF16

__all__ = ["vec_quantize", "vec_add", "vec_sub", "vec_mul", "vec_div", "vec_exp", "vec_exp2", "vec_recip",
           "vec_sqrt", "vec_tanh", "vec_reduce_sum", "vec_reduce_mean", "LOG2_E_BF16", "LN_2_EXACT"]


def vec_quantize(input, mx_specs=None, round=None):
    return _v.vec_quantize(input, precision_of(mx_specs, round))


def vec_add(a, b, mx_specs=None, round=None):
    return _v.vec_add(a, b, precision_of(mx_specs, round))


def vec_sub(a, b, mx_specs=None, round=None):
    return _v.vec_sub(a, b, precision_of(mx_specs, round))


def vec_mul(a, b, mx_specs=None, round=None):
    return _v.vec_mul(a, b, precision_of(mx_specs, round))


def vec_div(a, b, mx_specs=None, round=None):
    return _v.vec_div(a, b, precision_of(mx_specs, round))


def vec_exp(input, mx_specs=None, round=None):
    return _v.vec_exp(input, precision_of(mx_specs, round))


def vec_exp2(input, mx_specs=None, round=None):
    return _v.vec_exp2(input, precision_of(mx_specs, round))


def vec_recip(input, mx_specs=None, round=None):
    return _v.vec_recip(input, precision_of(mx_specs, round))


def vec_sqrt(input, mx_specs=None, round=None):
    return _v.vec_sqrt(input, precision_of(mx_specs, round))


def vec_tanh(input, mx_specs=None, round=None):
    return _v.vec_tanh(input, precision_of(mx_specs, round))


def vec_reduce_sum(input, dim, keepdim=False, mx_specs=None, round=None):
    return _v.vec_reduce_sum(input, dim, keepdim, precision_of(mx_specs, round))


def vec_reduce_mean(input, dim, keepdim=False, mx_specs=None, round=None):
    return _v.vec_reduce_mean(input, dim, keepdim, precision_of(mx_specs, round))
