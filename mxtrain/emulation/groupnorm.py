"""Group norm with every step at an elementwise precision ``prec`` (microxcaling's ``GroupNorm``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mxtrain.emulation.norm_utils import _norm_backward, _norm_forward
from mxtrain.emulation.vector_ops import vec_mul, vec_quantize, vec_reduce_sum

__all__ = ["GroupNormFunction"]


class GroupNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, num_groups, weight, bias, eps, prec=None, name=None):
        ctx.num_groups, ctx.eps, ctx.name = num_groups, eps, name
        x = vec_quantize(x, prec=prec)
        bf_weight = vec_quantize(weight, prec=prec)
        bf_bias = vec_quantize(bias, prec=prec)
        output, x_shift, x_norm, x_std_inv, _, _ = _norm_forward(
            x, list(range(1, x.ndim)), bf_weight, bf_bias, eps, prec, groups=num_groups, weight_axis=1)
        ctx.save_for_backward(x_shift, x_norm, x_std_inv, bf_weight if prec.quantize_backward else weight)
        ctx.prec = prec.backward()
        return output

    @staticmethod
    def backward(ctx, grad_output):
        specs = ctx.prec
        sum_axes = [0] + list(range(2, grad_output.ndim))
        x_shift, x_norm, x_std_inv, weight = ctx.saved_tensors
        grad_output = vec_quantize(grad_output, prec=specs)
        grad_bias = vec_reduce_sum(grad_output, sum_axes, prec=specs)
        grad_weight = vec_reduce_sum(vec_mul(grad_output, x_norm, prec=specs), sum_axes, prec=specs)
        grad_input = _norm_backward(grad_output, list(range(1, grad_output.ndim)), weight, x_shift, x_std_inv, specs,
                                    groups=ctx.num_groups, weight_axis=1)
        return grad_input, None, grad_weight, grad_bias, None, None, None
