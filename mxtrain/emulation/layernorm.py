"""Layer norm and RMS norm over the last dim with every step at an elementwise precision ``prec``
(microxcaling's ``LayerNormFunction`` / ``RMSNormFunction``).

LayerNorm puts eps inside the square root and uses DeepSpeed's backward
(:func:`~mxtrain.emulation.norm_utils._norm_backward_LN`). RMSNorm has a weight and
a bias: ``out = w * x / sqrt(mean(x*x) + eps) + b``.
"""

from __future__ import annotations

import torch

from mxtrain.emulation.norm_utils import _affine_grads, _norm_backward_LN, _norm_forward, _rounded_affine_inputs
from mxtrain.emulation.saved import keep_for_backward
from mxtrain.emulation.vector_ops import vec_add, vec_mul, vec_quantize, vec_recip, vec_reduce_mean, vec_sqrt, vec_sub

__all__ = ["LayerNormFunction", "RMSNormFunction"]


def _saved_and_affine_grads(ctx, grad_output):
    """``(saved tensors, backward precision, g, dweight, dbias)`` of a norm over the last dim that kept
    ``x_norm`` first: g rounded, the weight and bias gradients summed over the leading dims."""
    saved, specs = ctx.saved_tensors, ctx.prec
    grad_output, grad_weight, grad_bias = _affine_grads(grad_output, saved[0], list(range(grad_output.ndim - 1)),
                                                        specs)
    return saved, specs, grad_output, grad_weight, grad_bias


class LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, prec=None, name=None):
        ctx.eps, ctx.name = eps, name
        x, bf_weight, bf_bias = _rounded_affine_inputs(x, weight, bias, prec)
        output, _, x_norm, _, _, x_vare = _norm_forward(x, -1, bf_weight, bf_bias, eps, prec)
        keep_for_backward(ctx, prec, x_norm, x_vare, bf_weight if prec.quantize_backward else weight)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (x_norm, x_vare, weight), specs, grad_output, grad_weight, grad_bias = _saved_and_affine_grads(ctx, grad_output)
        grad_input = _norm_backward_LN(grad_output, -1, weight, x_norm, x_vare, specs)
        return grad_input, grad_weight, grad_bias, None, None, None


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, prec=None, name=None):
        ctx.eps, ctx.name = eps, name
        x = vec_quantize(x, prec=prec)
        x_ms = vec_reduce_mean(vec_mul(x, x, prec=prec), -1, keepdim=True, prec=prec)
        x_rms = vec_sqrt(vec_add(x_ms, eps, prec=prec), prec=prec)
        x_rms_inv = vec_recip(x_rms, prec=prec)
        x_norm = vec_mul(x, x_rms_inv, prec=prec)
        # weight and bias are rounded after x's statistics: stochastic rounding draws in this order
        bf_weight = vec_quantize(weight, prec=prec)
        bf_bias = vec_quantize(bias, prec=prec)
        output = vec_add(vec_mul(bf_weight, x_norm, prec=prec), bf_bias, prec=prec)
        keep_for_backward(ctx, prec, x_norm, x_rms_inv, bf_weight if prec.quantize_backward else weight)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        saved, specs, grad_output, grad_weight, grad_bias = _saved_and_affine_grads(ctx, grad_output)
        x_norm, x_rms_inv, weight = saved
        dx1 = vec_mul(vec_mul(grad_output, weight, prec=specs), x_rms_inv, prec=specs)
        dx_norm2 = vec_reduce_mean(vec_mul(dx1, x_norm, prec=specs), -1, keepdim=True, prec=specs)
        dx_norm3 = vec_mul(x_norm, dx_norm2, prec=specs)
        grad_input = vec_sub(dx1, dx_norm3)  # microxcaling leaves this last step unrounded
        return grad_input, grad_weight, grad_bias, None, None, None
