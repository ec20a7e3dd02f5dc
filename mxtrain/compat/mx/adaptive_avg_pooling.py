"""``adaptive_avg_pool2d`` / ``AdaptiveAvgPool2d``: each window's mean rounded (sum, then divide)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mxtrain.compat.mx.specs import apply_mx_specs, get_backwards_mx_specs, mx_assert_test
from mxtrain.compat.mx.vector_ops import vec_add, vec_reduce_mean

__all__ = ["adaptive_avg_pool2d", "AdaptiveAvgPool2d", "AdaptiveAvgPool2dFunction"]


def _window(i, out_size, in_size):
    return math.floor(i * in_size / out_size), math.ceil((i + 1) * in_size / out_size)


def _output_size(output_size, ih, iw):
    if isinstance(output_size, (tuple, list)) and len(output_size) == 2:
        return output_size[0] or ih, output_size[1] or iw
    if isinstance(output_size, int):
        return output_size, output_size
    if output_size is None:
        return ih, iw
    raise ValueError(f"expected 1D or 2D output_size (got {output_size!r})")


class AdaptiveAvgPool2dFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, output_size, mx_specs=None, name=None):
        if input.dim() != 4:
            raise ValueError(f"expected 4D input (got {input.dim()}D input)")
        b, d, ih, iw = input.shape
        oh, ow = _output_size(output_size, ih, iw)
        output = torch.zeros(b, d, oh, ow, device=input.device, dtype=input.dtype)
        for i in range(oh):
            h0, h1 = _window(i, oh, ih)
            for j in range(ow):
                w0, w1 = _window(j, ow, iw)
                output[:, :, i, j] = vec_reduce_mean(input[:, :, h0:h1, w0:w1], [2, 3], keepdim=False,
                                                     mx_specs=mx_specs)
        ctx.sizes = (oh, ow, b, d, ih, iw)
        ctx.mx_specs = get_backwards_mx_specs(mx_specs)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        oh, ow, b, d, ih, iw = ctx.sizes
        grad_input = torch.zeros(b, d, ih, iw, device=grad_output.device, dtype=grad_output.dtype)
        for i in range(oh):
            h0, h1 = _window(i, oh, ih)
            for j in range(ow):
                w0, w1 = _window(j, ow, iw)
                delta = (grad_output[:, :, i, j] / (h1 - h0) / (w1 - w0))[:, :, None, None]
                grad_input[:, :, h0:h1, w0:w1] = vec_add(grad_input[:, :, h0:h1, w0:w1],
                                                         delta.expand(b, d, h1 - h0, w1 - w0), mx_specs=ctx.mx_specs)
        return grad_input, None, None, None


def adaptive_avg_pool2d(input, output_size, mx_specs=None, name=None):
    mx_assert_test(mx_specs)
    if mx_specs is None:
        return F.adaptive_avg_pool2d(input, output_size)
    return AdaptiveAvgPool2dFunction.apply(input, output_size, apply_mx_specs(mx_specs), name)


class AdaptiveAvgPool2d(torch.nn.Module):
    def __init__(self, output_size, mx_specs=None, name=None):
        super().__init__()
        mx_assert_test(mx_specs)
        self.mx_none = mx_specs is None
        self.output_size = output_size
        self.mx_specs = apply_mx_specs(mx_specs)
        self.name = name

    def forward(self, inputs):
        if self.mx_none:
            return F.adaptive_avg_pool2d(inputs, self.output_size)
        return AdaptiveAvgPool2dFunction.apply(inputs, self.output_size, self.mx_specs, self.name)
