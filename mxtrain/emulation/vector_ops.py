"""Vector ops whose every result is rounded to an :class:`~mxtrain.emulation.precision.ElementwisePrecision`.

Each basic operation (add, sub, mul, div, exp, exp2, reciprocal, sqrt, tanh, sum,
mean) computes in fp32 and rounds its result once to ``prec``, exactly as
microxcaling's ``vector_ops`` do; with ``prec=None`` (or ``prec.fmt=None``) no
rounding happens. ``prec.exp_as_exp2`` computes ``e**x`` as ``2**(x * 1.4453125)``
(log2(e) in bfloat16) and ``prec.div_as_recip`` computes ``a / b`` as ``a * (1/b)``,
each step rounded. These are not differentiable: the autograd functions of the
norms, softmax and activations are built from them.
"""

from __future__ import annotations

import math

import torch

from mxtrain.emulation.precision import ElementwisePrecision, round_to

__all__ = ["vec_quantize", "vec_add", "vec_sub", "vec_mul", "vec_div", "vec_exp", "vec_exp2", "vec_recip",
           "vec_sqrt", "vec_tanh", "vec_reduce_sum", "vec_reduce_mean", "LOG2_E_BF16", "LN_2_EXACT"]

LN_2_EXACT = 0.69314718056
LOG2_E_BF16 = 1.4453125  # log2(e) rounded to bfloat16: 1 + 2**-2 + 2**-3 + 2**-4 + 2**-7

Precision = ElementwisePrecision | None


def vec_quantize(input, prec: Precision = None):
    return round_to(input, prec)


def vec_add(a, b, prec: Precision = None):
    return round_to(a + b, prec)


def vec_sub(a, b, prec: Precision = None):
    return round_to(a - b, prec)


def vec_mul(a, b, prec: Precision = None):
    return round_to(a * b, prec)


def vec_div(a, b, prec: Precision = None):
    if prec is not None and prec.div_as_recip:
        return vec_mul(a, vec_recip(b, prec), prec)
    return round_to(a / b, prec)


def vec_exp(input, prec: Precision = None):
    if prec is not None and prec.exp_as_exp2:
        return vec_exp2(round_to(LOG2_E_BF16 * input, prec), prec)
    return round_to(torch.exp(input), prec)


def vec_exp2(input, prec: Precision = None):
    return round_to(torch.exp2(input), prec)


def vec_recip(input, prec: Precision = None):
    return round_to(1.0 / input, prec)


def vec_sqrt(input, prec: Precision = None):
    if not isinstance(input, torch.Tensor):
        return round_to(math.sqrt(input), prec)
    return round_to(torch.sqrt(input), prec)


def vec_tanh(input, prec: Precision = None):
    return round_to(torch.tanh(input), prec)


def vec_reduce_sum(input, dim, keepdim=False, prec: Precision = None):
    return round_to(input.sum(dim, keepdim=keepdim), prec)


def vec_reduce_mean(input, dim, keepdim=False, prec: Precision = None):
    dim = list(dim) if isinstance(dim, (list, tuple)) else [dim]
    denom = math.prod(input.shape[i] for i in dim)
    return vec_div(vec_reduce_sum(input, dim, keepdim, prec), denom, prec)
