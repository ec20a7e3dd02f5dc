"""``GroupNorm`` / ``group_norm`` with every step at the elementwise precision of mx_specs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mxtrain.emulation.norm_utils import _norm_backward, _norm_forward
from mxtrain.emulation.specs import apply_mx_specs, get_backwards_mx_specs, mx_assert_test
from mxtrain.emulation.vector_ops import vec_mul, vec_quantize, vec_reduce_sum

__all__ = ["GroupNormFunction", "GroupNorm", "group_norm"]


class GroupNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, num_groups, weight, bias, eps, mx_specs=None, name=None):
        ctx.num_groups, ctx.eps, ctx.name = num_groups, eps, name
        x = vec_quantize(x, mx_specs=mx_specs)
        bf_weight = vec_quantize(weight, mx_specs=mx_specs)
        bf_bias = vec_quantize(bias, mx_specs=mx_specs)
        output, x_shift, x_norm, x_std_inv, _, _ = _norm_forward(
            x, list(range(1, x.ndim)), bf_weight, bf_bias, eps, mx_specs, groups=num_groups, weight_axis=1)
        ctx.save_for_backward(x_shift, x_norm, x_std_inv, bf_weight if mx_specs["quantize_backprop"] else weight)
        ctx.mx_specs = get_backwards_mx_specs(mx_specs)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        specs = ctx.mx_specs
        sum_axes = [0] + list(range(2, grad_output.ndim))
        x_shift, x_norm, x_std_inv, weight = ctx.saved_tensors
        grad_output = vec_quantize(grad_output, mx_specs=specs)
        grad_bias = vec_reduce_sum(grad_output, sum_axes, mx_specs=specs)
        grad_weight = vec_reduce_sum(vec_mul(grad_output, x_norm, mx_specs=specs), sum_axes, mx_specs=specs)
        grad_input = _norm_backward(grad_output, list(range(1, grad_output.ndim)), weight, x_shift, x_std_inv, specs,
                                    groups=ctx.num_groups, weight_axis=1)
        return grad_input, None, grad_weight, grad_bias, None, None, None


def group_norm(x, num_groups, weight, bias, eps=1e-5, mx_specs=None):
    mx_assert_test(mx_specs)
    if mx_specs is None:
        return F.group_norm(x, num_groups, weight=weight, bias=bias, eps=eps)
    mx_specs = apply_mx_specs(mx_specs)
    return GroupNormFunction.apply(x, num_groups, weight, bias, eps, mx_specs)


class GroupNorm(torch.nn.GroupNorm):
    """``torch.nn.GroupNorm`` taking ``mx_specs`` (None: plain)."""

    def __init__(self, num_groups, num_channels, mx_specs=None, name=None, **kwargs):
        super().__init__(num_groups, num_channels, **kwargs)
        mx_assert_test(mx_specs)
        self.mx_none = mx_specs is None
        self.name = name
        self.mx_specs = apply_mx_specs(mx_specs)

    def forward(self, input):
        if self.mx_none:
            return super().forward(input)
        if not self.affine:
            raise NotImplementedError("MX GroupNorm needs affine=True")
        return group_norm(input, self.num_groups, self.weight, self.bias, self.eps, self.mx_specs)
