"""Vector ops whose every result is rounded to the elementwise precision of ``mx_specs``.

Each basic operation (add, sub, mul, div, exp, exp2, reciprocal, sqrt, tanh, sum,
mean) computes in fp32 and rounds its result once to ``bfloat=N`` / ``fp=N`` with
the given rounding mode (``round=None``: ``mx_specs['round']``), exactly as
microxcaling's ``vector_ops`` do; with ``mx_specs=None`` or both widths 0 they are
plain fp32 ops. ``vec_use_exp2`` computes ``e**x`` as ``2**(x * 1.4453125)``
(log2(e) in bfloat16) and ``vec_use_recip`` computes ``a / b`` as ``a * (1/b)``,
each step rounded. These are not differentiable: the autograd functions of the
norms, softmax and activations are built from them.
"""

from __future__ import annotations

import math

import torch

from mxtrain.emulation.elemwise_ops import quantize_elemwise_op

__all__ = ["vec_quantize", "vec_add", "vec_sub", "vec_mul", "vec_div", "vec_exp", "vec_exp2", "vec_recip",
           "vec_sqrt", "vec_tanh", "vec_reduce_sum", "vec_reduce_mean", "LOG2_E_BF16", "LN_2_EXACT"]

LN_2_EXACT = 0.69314718056
LOG2_E_BF16 = 1.4453125  # log2(e) rounded to bfloat16: 1 + 2**-2 + 2**-3 + 2**-4 + 2**-7


def vec_quantize(input, mx_specs=None, round=None):
    return quantize_elemwise_op(input, mx_specs=mx_specs, round=round)


def vec_add(a, b, mx_specs=None, round=None):
    return quantize_elemwise_op(a + b, mx_specs=mx_specs, round=round)


def vec_sub(a, b, mx_specs=None, round=None):
    return quantize_elemwise_op(a - b, mx_specs=mx_specs, round=round)


def vec_mul(a, b, mx_specs=None, round=None):
    return quantize_elemwise_op(a * b, mx_specs=mx_specs, round=round)


def vec_div(a, b, mx_specs=None, round=None):
    if mx_specs and mx_specs["vec_use_recip"]:
        return vec_mul(a, vec_recip(b, mx_specs=mx_specs, round=round), mx_specs=mx_specs, round=round)
    return quantize_elemwise_op(a / b, mx_specs=mx_specs, round=round)


def vec_exp(input, mx_specs=None, round=None):
    if mx_specs and mx_specs["vec_use_exp2"]:
        phi = quantize_elemwise_op(LOG2_E_BF16 * input, mx_specs=mx_specs, round=round)
        return vec_exp2(phi, mx_specs=mx_specs, round=round)
    return quantize_elemwise_op(torch.exp(input), mx_specs=mx_specs, round=round)


def vec_exp2(input, mx_specs=None, round=None):
    return quantize_elemwise_op(torch.exp2(input), mx_specs=mx_specs, round=round)


def vec_recip(input, mx_specs=None, round=None):
    return quantize_elemwise_op(1.0 / input, mx_specs=mx_specs, round=round)


def vec_sqrt(input, mx_specs=None, round=None):
    if not isinstance(input, torch.Tensor):
        return quantize_elemwise_op(math.sqrt(input), mx_specs=mx_specs, round=round)
    return quantize_elemwise_op(torch.sqrt(input), mx_specs=mx_specs, round=round)


def vec_tanh(input, mx_specs=None, round=None):
    return quantize_elemwise_op(torch.tanh(input), mx_specs=mx_specs, round=round)


def vec_reduce_sum(input, dim, keepdim=False, mx_specs=None, round=None):
    return quantize_elemwise_op(input.sum(dim, keepdim=keepdim), mx_specs=mx_specs, round=round)


def vec_reduce_mean(input, dim, keepdim=False, mx_specs=None, round=None):
    dim = list(dim) if isinstance(dim, (list, tuple)) else [dim]
    denom = math.prod(input.shape[i] for i in dim)
    s = vec_reduce_sum(input, dim, keepdim=keepdim, mx_specs=mx_specs, round=round)
    return vec_div(s, denom, mx_specs=mx_specs, round=round)
