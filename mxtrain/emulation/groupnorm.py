"""Group norm with every step at an elementwise precision ``prec`` (microxcaling's ``GroupNorm``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mxtrain.emulation.norm_utils import _channel_norm_grads, _norm_forward, _rounded_affine_inputs
from mxtrain.emulation.saved import keep_for_backward

__all__ = ["GroupNormFunction"]


class GroupNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, num_groups, weight, bias, eps, prec=None, name=None):
        ctx.num_groups, ctx.eps, ctx.name = num_groups, eps, name
        x, bf_weight, bf_bias = _rounded_affine_inputs(x, weight, bias, prec)
        output, x_shift, x_norm, x_std_inv, _, _ = _norm_forward(
            x, list(range(1, x.ndim)), bf_weight, bf_bias, eps, prec, groups=num_groups, weight_axis=1)
        keep_for_backward(ctx, prec, x_shift, x_norm, x_std_inv, bf_weight if prec.quantize_backward else weight)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        grad_input, grad_weight, grad_bias = _channel_norm_grads(ctx, grad_output, list(range(1, grad_output.ndim)),
                                                                 groups=ctx.num_groups)
        return grad_input, None, grad_weight, grad_bias, None, None, None
