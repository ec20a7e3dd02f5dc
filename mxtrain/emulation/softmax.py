"""Softmax with every step rounded (``prec.softmax_exp2``: ``2**x`` instead of ``e**x``).

``y = exp(x - max) / sum(exp(x - max))``: the input, the difference, the
exponential, the sum and the quotient are each rounded to ``prec``. Backward: ``y * (g - sum(g * y))`` with each
step rounded (times ln 2 in bfloat16, 0.69140625, under ``softmax_exp2``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mxtrain.emulation.saved import keep_for_backward, saved_and_grad
from mxtrain.emulation.vector_ops import vec_div, vec_exp, vec_exp2, vec_mul, vec_quantize, vec_reduce_sum, vec_sub

__all__ = ["SoftmaxFunction", "LN_2_BF16"]

LN_2_BF16 = 0.69140625  # ln(2) rounded to bfloat16


class SoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, dim=None, prec=None, name=None):
        if dim is None:
            raise ValueError("softmax needs dim")
        dim = dim + input.ndim if dim < 0 else dim
        ctx.dim = dim
        input = vec_quantize(input, prec=prec)
        max_data, _ = input.max(dim, keepdim=True)
        input = vec_sub(input, max_data, prec=prec)
        exp = vec_exp2 if prec.softmax_exp2 else vec_exp
        output = exp(input, prec=prec)
        output_sum = vec_reduce_sum(output, dim, keepdim=True, prec=prec)
        output = vec_div(output, output_sum, prec=prec)
        keep_for_backward(ctx, prec, output)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (output,), specs, grad_output = saved_and_grad(ctx, grad_output)
        grad_input = vec_mul(grad_output, output, prec=specs)
        grad_input = vec_reduce_sum(grad_input, ctx.dim, keepdim=True, prec=specs)
        grad_input = vec_sub(grad_output, grad_input, prec=specs)
        grad_input = vec_mul(output, grad_input, prec=specs)
        if specs.softmax_exp2:
            grad_input = vec_mul(grad_input, LN_2_BF16, prec=specs)
        return grad_input, None, None, None
