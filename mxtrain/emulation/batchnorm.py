"""Batch norm with every step at an elementwise precision ``prec`` (microxcaling's ``BatchNorm``).

Training normalizes with the batch statistics and updates the running ones
(``(1 - momentum) * running + momentum * batch``, rounded); evaluation uses
the running statistics. The channel axis is 1 (NC...).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mxtrain.emulation.norm_utils import _channel_norm_grads, _norm_forward, _rounded_affine_inputs
from mxtrain.emulation.saved import keep_for_backward
from mxtrain.emulation.vector_ops import vec_add, vec_mul

__all__ = ["BatchNormFunction"]


class BatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, running_mean, running_var, weight, bias, is_training=False, momentum=0.1, eps=1e-5,
                prec=None):
        if not is_training and (running_mean is None or running_var is None):
            raise ValueError("batch_norm in evaluation needs running_mean and running_var")
        ctx.is_training, ctx.momentum, ctx.eps = is_training, momentum, eps
        x, bf_weight, bf_bias = _rounded_affine_inputs(x, weight, bias, prec)
        h = x.shape[1]
        sum_axes = [0] + list(range(2, x.ndim))
        output, x_shift, x_norm, x_std_inv, x_mean, x_var = _norm_forward(
            x, sum_axes, bf_weight, bf_bias, eps, prec, weight_axis=1, use_running_stats=not is_training,
            running_mean=running_mean, running_var=running_var)
        if is_training and running_mean is not None:
            t = vec_add(vec_mul((1 - momentum), running_mean, prec=prec),
                        vec_mul(momentum, x_mean.view(h), prec=prec), prec=prec)
            running_mean.copy_(t)
        if is_training and running_var is not None:
            t = vec_add(vec_mul((1 - momentum), running_var, prec=prec),
                        vec_mul(momentum, x_var.view(h), prec=prec), prec=prec)
            running_var.copy_(t)
        keep_for_backward(ctx, prec, x_shift, x_norm, x_std_inv, bf_weight if prec.quantize_backward else weight)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        grad_input, grad_weight, grad_bias = _channel_norm_grads(ctx, grad_output,
                                                                 [0] + list(range(2, grad_output.ndim)))
        return grad_input, None, None, grad_weight, grad_bias, None, None, None, None
