"""``softmax`` / ``Softmax`` with every step rounded (``softmax_exp2``: ``2**x`` instead of ``e**x``).

``y = exp(x - max) / sum(exp(x - max))``: the input, the difference, the
exponential, the sum and the quotient are each rounded to the elementwise
precision with ``mx_specs['round']``. Backward: ``y * (g - sum(g * y))`` with each
step rounded (times ln 2 in bfloat16, 0.69140625, under ``softmax_exp2``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mxtrain.emulation.specs import apply_mx_specs, get_backwards_mx_specs, mx_assert_test
from mxtrain.emulation.vector_ops import vec_div, vec_exp, vec_exp2, vec_mul, vec_quantize, vec_reduce_sum, vec_sub

__all__ = ["SoftmaxFunction", "softmax", "Softmax", "LN_2_BF16"]

LN_2_BF16 = 0.69140625  # ln(2) rounded to bfloat16


class SoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, dim=None, mx_specs=None, name=None):
        if dim is None:
            raise ValueError("softmax needs dim")
        dim = dim + input.ndim if dim < 0 else dim
        ctx.dim = dim
        r = mx_specs["round"]
        input = vec_quantize(input, mx_specs=mx_specs)
        max_data, _ = input.max(dim, keepdim=True)
        input = vec_sub(input, max_data, mx_specs=mx_specs, round=r)
        exp = vec_exp2 if mx_specs.get("softmax_exp2", False) else vec_exp
        output = exp(input, mx_specs=mx_specs, round=r)
        output_sum = vec_reduce_sum(output, dim, keepdim=True, mx_specs=mx_specs, round=r)
        output = vec_div(output, output_sum, mx_specs=mx_specs, round=r)
        ctx.save_for_backward(output)
        ctx.mx_specs = get_backwards_mx_specs(mx_specs)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (output,) = ctx.saved_tensors
        specs = ctx.mx_specs
        r = specs["round"]
        grad_output = vec_quantize(grad_output, mx_specs=specs, round=r)
        grad_input = vec_mul(grad_output, output, mx_specs=specs, round=r)
        grad_input = vec_reduce_sum(grad_input, ctx.dim, keepdim=True, mx_specs=specs, round=r)
        grad_input = vec_sub(grad_output, grad_input, mx_specs=specs, round=r)
        grad_input = vec_mul(output, grad_input, mx_specs=specs, round=r)
        if specs.get("softmax_exp2", False):
            grad_input = vec_mul(grad_input, LN_2_BF16, mx_specs=specs, round=r)
        return grad_input, None, None, None


def softmax(input, dim=-1, mx_specs=None, name=None):
    """``F.softmax(input, dim)`` rounded per ``mx_specs`` (plain when None)."""
    mx_assert_test(mx_specs)
    if mx_specs is None:
        return F.softmax(input, dim=dim)
    mx_specs = apply_mx_specs(mx_specs)
    return SoftmaxFunction.apply(input, dim, mx_specs, name)


class Softmax(torch.nn.Softmax):
    """``torch.nn.Softmax`` taking ``mx_specs`` (None: plain)."""

    def __init__(self, dim=None, mx_specs=None, name=None):
        mx_assert_test(mx_specs)
        self.mx_none = mx_specs is None
        self.name = name
        self.mx_specs = apply_mx_specs(mx_specs)
        super().__init__(dim)

    def apply_mx_specs(self, mx_specs):
        self.mx_none = mx_specs is None
        self.mx_specs = apply_mx_specs(mx_specs)

    def append_name(self, postfix):
        self.name += postfix

    def forward(self, input):
        if self.mx_none:
            return super().forward(input)
        return SoftmaxFunction.apply(input, self.dim, self.mx_specs, self.name)
