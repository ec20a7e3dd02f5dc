"""MX ``ConvTranspose2d`` with microxcaling's semantics (MX steps at ``round="nearest"``, forward formats)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mxtrain.compat.mx.convolution import _conv_grads, _round_bias_and_save, _rounded_output, conv_weight
from mxtrain.compat.mx.elemwise_ops import quantize_elemwise_op
from mxtrain.compat.mx.mx_ops import quantize_mx_op
from mxtrain.compat.mx.specs import MxSpecsModule

__all__ = ["ConvTranspose2dFunction", "ConvTranspose2d"]


class ConvTranspose2dFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1,
                mx_specs=None, name=None):
        ctx.has_bias = bias is not None
        ctx.stride, ctx.padding, ctx.dilation, ctx.groups, ctx.name = stride, padding, dilation, groups, name
        if input.shape[1] % groups:
            raise ValueError(f"input channels {input.shape[1]} are not divisible by groups={groups}")
        bf_in = quantize_elemwise_op(input, mx_specs=mx_specs, round=mx_specs["round_output"])
        bf_weight = quantize_elemwise_op(weight, mx_specs=mx_specs, round=mx_specs["round_weight"])
        bf_bias = _round_bias_and_save(ctx, input, weight, bias, bf_in, bf_weight, mx_specs)
        # weight is (in_channels, out_channels/groups, kH, kW): the reduction runs along axis 0
        qid_input = quantize_mx_op(bf_in, mx_specs, elem_format=mx_specs["a_elem_format"], axes=[1])
        qid_weight = quantize_mx_op(bf_weight, mx_specs, elem_format=mx_specs["w_elem_format"], axes=[0])
        output = F.conv_transpose2d(qid_input, qid_weight, bf_bias, stride, padding, output_padding, groups,
                                    dilation)
        return _rounded_output(ctx, output, mx_specs)

    @staticmethod
    def backward(ctx, grad_output):
        # the transposed conv's weight gradient swaps the roles of input and dY; its dX is a plain conv of dY
        return _conv_grads(ctx, grad_output, lambda x, w_shape, dy, **kw: conv_weight(dy, w_shape, x, **kw), 1,
                           lambda x_shape, w, dy, **kw: torch.conv2d(dy, w, bias=None, **kw)) + (None,) * 7


class ConvTranspose2d(MxSpecsModule, torch.nn.ConvTranspose2d):
    """``torch.nn.ConvTranspose2d`` taking ``mx_specs`` (None: plain); zero padding only."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, output_padding=0, dilation=1,
                 groups=1, bias=True, mx_specs=None, name=None, device=None, dtype=None):
        self._init_mx(mx_specs, name)
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=padding,
                         output_padding=output_padding, dilation=dilation, groups=groups, bias=bias,
                         device=device, dtype=dtype)

    def forward(self, inputs, output_size=None):
        if self.mx_none:
            return super().forward(inputs, output_size=output_size)
        output_padding = self._output_padding(inputs, output_size, self.stride, self.padding, self.kernel_size,
                                              2, self.dilation)
        return ConvTranspose2dFunction.apply(inputs, self.weight, self.bias, self.stride, self.padding,
                                             output_padding, self.groups, self.dilation, self.mx_specs, self.name)
