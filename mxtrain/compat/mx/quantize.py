"""``quantize_bfloat``: differentiable elementwise rounding (forward and backward rounded)."""

from __future__ import annotations

import torch

from mxtrain.compat.mx.elemwise_ops import quantize_elemwise_op
from mxtrain.compat.mx.specs import apply_mx_specs, get_backwards_mx_specs, mx_assert_test

__all__ = ["quantize_bfloat", "QuantizeBfloatFunction"]


class QuantizeBfloatFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mx_specs, round=None):
        round = mx_specs["round"] if round is None else round
        ctx.mx_specs, ctx.round = get_backwards_mx_specs(mx_specs), round
        return quantize_elemwise_op(x, mx_specs=mx_specs, round=round)

    @staticmethod
    def backward(ctx, grad_output):
        return quantize_elemwise_op(grad_output, mx_specs=ctx.mx_specs, round=ctx.round), None, None


def quantize_bfloat(x, mx_specs, round=None):
    """Round ``x`` to the specs' bfloatN/fpN; its gradient is rounded the same way."""
    mx_assert_test(mx_specs)
    if mx_specs is None:
        return x
    mx_specs = apply_mx_specs(mx_specs)
    return QuantizeBfloatFunction.apply(x, mx_specs, mx_specs["round"] if round is None else round)
