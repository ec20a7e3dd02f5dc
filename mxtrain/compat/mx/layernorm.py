"""``LayerNorm``, ``RMSNorm`` and ``layer_norm`` with every step at the elementwise precision of mx_specs.

As in microxcaling: ``LayerNorm(hidden_size, eps=1e-12, mx_specs=None)`` (eps
inside the square root; plain ``torch.nn.LayerNorm`` when ``mx_specs`` is None);
``RMSNorm`` has a weight and a bias (``out = w * x / sqrt(mean(x*x) + eps) + b``)
and always runs its own function (unrounded without specs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mxtrain.compat.mx.norm_utils import _norm_backward_LN, _norm_forward
from mxtrain.compat.mx.specs import apply_mx_specs, get_backwards_mx_specs, mx_assert_test
from mxtrain.compat.mx.vector_ops import (vec_add, vec_mul, vec_quantize, vec_recip, vec_reduce_mean,
                                          vec_reduce_sum, vec_sqrt, vec_sub)

__all__ = ["LayerNormFunction", "LayerNorm", "RMSNormFunction", "RMSNorm", "layer_norm"]

torch_layer_norm = F.layer_norm


class LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, mx_specs=None, name=None):
        ctx.eps, ctx.name = eps, name
        x = vec_quantize(x, mx_specs=mx_specs)
        bf_weight = vec_quantize(weight, mx_specs=mx_specs)
        bf_bias = vec_quantize(bias, mx_specs=mx_specs)
        output, _, x_norm, _, _, x_vare = _norm_forward(x, -1, bf_weight, bf_bias, eps, mx_specs)
        ctx.save_for_backward(x_norm, x_vare, bf_weight if mx_specs["quantize_backprop"] else weight)
        ctx.mx_specs = get_backwards_mx_specs(mx_specs)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        sum_axes = list(range(grad_output.ndim - 1))
        x_norm, x_vare, weight = ctx.saved_tensors
        specs = ctx.mx_specs
        grad_output = vec_quantize(grad_output, mx_specs=specs)
        grad_bias = vec_reduce_sum(grad_output, sum_axes, mx_specs=specs)
        grad_weight = vec_reduce_sum(vec_mul(grad_output, x_norm, mx_specs=specs), sum_axes, mx_specs=specs)
        grad_input = _norm_backward_LN(grad_output, -1, weight, x_norm, x_vare, specs)
        return grad_input, grad_weight, grad_bias, None, None, None


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` over the last dim taking ``mx_specs`` (default eps 1e-12, as microxcaling)."""

    def __init__(self, hidden_size, eps=1e-12, mx_specs=None, name=None, elementwise_affine=True, bias=True,
                 device=None, dtype=None):
        mx_assert_test(mx_specs)
        self.mx_none = mx_specs is None
        self.name = name
        self.mx_specs = apply_mx_specs(mx_specs)
        super().__init__(normalized_shape=hidden_size, eps=eps, elementwise_affine=elementwise_affine, bias=bias,
                         device=device, dtype=dtype)

    def apply_mx_specs(self, mx_specs):
        self.mx_none = mx_specs is None
        self.mx_specs = apply_mx_specs(mx_specs)

    def append_name(self, postfix):
        self.name += postfix

    def forward(self, x):
        if self.mx_none:
            return super().forward(x)
        if len(self.normalized_shape) != 1 or self.weight is None or self.bias is None:
            raise NotImplementedError("MX LayerNorm normalizes the last dim with an affine weight and bias")
        return LayerNormFunction.apply(x, self.weight, self.bias, self.eps, self.mx_specs, self.name)


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, mx_specs=None, name=None):
        ctx.eps, ctx.name = eps, name
        x = vec_quantize(x, mx_specs=mx_specs)
        x2 = vec_mul(x, x, mx_specs=mx_specs)
        x_ms = vec_reduce_mean(x2, -1, keepdim=True, mx_specs=mx_specs)
        x_mse = vec_add(x_ms, eps, mx_specs=mx_specs)
        x_rms = vec_sqrt(x_mse, mx_specs=mx_specs)
        x_rms_inv = vec_recip(x_rms, mx_specs=mx_specs)
        x_norm = vec_mul(x, x_rms_inv, mx_specs=mx_specs)
        bf_weight = vec_quantize(weight, mx_specs=mx_specs)
        bf_bias = vec_quantize(bias, mx_specs=mx_specs)
        output = vec_add(vec_mul(bf_weight, x_norm, mx_specs=mx_specs), bf_bias, mx_specs=mx_specs)
        ctx.save_for_backward(x_norm, x_rms_inv, bf_weight if mx_specs["quantize_backprop"] else weight)
        ctx.mx_specs = get_backwards_mx_specs(mx_specs)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        sum_axes = list(range(grad_output.ndim - 1))
        x_norm, x_rms_inv, weight = ctx.saved_tensors
        specs = ctx.mx_specs
        grad_output = vec_quantize(grad_output, mx_specs=specs)
        grad_bias = vec_reduce_sum(grad_output, sum_axes, mx_specs=specs)
        grad_weight = vec_reduce_sum(vec_mul(grad_output, x_norm, mx_specs=specs), sum_axes, mx_specs=specs)
        dx_norm = vec_mul(grad_output, weight, mx_specs=specs)
        dx1 = vec_mul(dx_norm, x_rms_inv, mx_specs=specs)
        dx_norm2 = vec_reduce_mean(vec_mul(dx1, x_norm, mx_specs=specs), -1, keepdim=True, mx_specs=specs)
        dx_norm3 = vec_mul(x_norm, dx_norm2, mx_specs=specs)
        grad_input = vec_sub(dx1, dx_norm3)  # microxcaling leaves this last step unrounded
        return grad_input, grad_weight, grad_bias, None, None, None


class RMSNorm(torch.nn.LayerNorm):
    """RMSNorm with weight and bias (microxcaling's); rounded per ``mx_specs``."""

    def __init__(self, hidden_size, eps=1e-12, mx_specs=None, name=None, device=None, dtype=None):
        mx_assert_test(mx_specs)
        self.name = name
        self.mx_none = mx_specs is None
        self.mx_specs = apply_mx_specs(mx_specs)
        super().__init__(normalized_shape=hidden_size, eps=eps, device=device, dtype=dtype)

    def apply_mx_specs(self, mx_specs):
        self.mx_none = mx_specs is None
        self.mx_specs = apply_mx_specs(mx_specs)

    def append_name(self, postfix):
        self.name += postfix

    def forward(self, x):
        return RMSNormFunction.apply(x, self.weight, self.bias, self.eps, self.mx_specs, self.name)


def layer_norm(input, normalized_shape, weight, bias, eps=1e-12, mx_specs=None, name=None):
    """``F.layer_norm`` over the last dim, rounded per ``mx_specs`` (plain when None)."""
    mx_assert_test(mx_specs)
    if mx_specs is None:
        return torch_layer_norm(input, normalized_shape, weight, bias, eps)
    mx_specs = apply_mx_specs(mx_specs)
    if tuple(normalized_shape if not isinstance(normalized_shape, int) else (normalized_shape,)) != tuple(weight.shape):
        raise ValueError(f"normalized_shape {normalized_shape} must equal the weight's shape {tuple(weight.shape)}")
    return LayerNormFunction.apply(input, weight, bias, eps, mx_specs, name)
