"""MX ``ConvTranspose2d`` with microxcaling's semantics (MX steps at ``round="nearest"``, forward formats)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mxtrain.compat.mx.convolution import conv_weight
from mxtrain.compat.mx.elemwise_ops import quantize_elemwise_op
from mxtrain.compat.mx.mx_ops import quantize_mx_op
from mxtrain.compat.mx.specs import apply_mx_specs, get_backwards_mx_specs, mx_assert_test

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
        bf_bias = None
        if bias is not None:
            bf_bias = quantize_elemwise_op(bias, mx_specs=mx_specs, round=mx_specs["round_weight"])
        if mx_specs["quantize_backprop"]:
            ctx.save_for_backward(bf_in, bf_weight)
        else:
            ctx.save_for_backward(input, weight)
        # weight is (in_channels, out_channels/groups, kH, kW): the reduction runs along axis 0
        qid_input = quantize_mx_op(bf_in, mx_specs, elem_format=mx_specs["a_elem_format"], axes=[1])
        qid_weight = quantize_mx_op(bf_weight, mx_specs, elem_format=mx_specs["w_elem_format"], axes=[0])
        output = F.conv_transpose2d(qid_input, qid_weight, bf_bias, stride, padding, output_padding, groups,
                                    dilation)
        output = quantize_elemwise_op(output, mx_specs=mx_specs, round=mx_specs["round_output"])
        ctx.mx_specs = get_backwards_mx_specs(mx_specs)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        specs = ctx.mx_specs
        input, weight = ctx.saved_tensors
        grad_output = quantize_elemwise_op(grad_output, mx_specs=specs, round=specs["round_grad_input"])
        qex_input = quantize_mx_op(input, specs, elem_format=specs["a_elem_format"], axes=[0])
        qex_grad_output = quantize_mx_op(grad_output, specs, elem_format=specs["a_elem_format"], axes=[0])
        grad_weight = conv_weight(qex_grad_output, weight.shape, qex_input, stride=ctx.stride, padding=ctx.padding,
                                  dilation=ctx.dilation, groups=ctx.groups)
        grad_weight = quantize_elemwise_op(grad_weight, mx_specs=specs, round=specs["round_grad_weight"])
        qod_weight = quantize_mx_op(weight, specs, elem_format=specs["w_elem_format"], axes=[1])
        qod_grad_output = quantize_mx_op(grad_output, specs, elem_format=specs["a_elem_format"], axes=[1])
        grad_input = torch.conv2d(qod_grad_output, qod_weight, bias=None, stride=ctx.stride, padding=ctx.padding,
                                  dilation=ctx.dilation, groups=ctx.groups)
        grad_input = quantize_elemwise_op(grad_input, mx_specs=specs, round=specs["round_grad_input"])
        grad_bias = None
        if ctx.has_bias:
            grad_bias = quantize_elemwise_op(grad_output.sum(dim=(3, 2, 0)), mx_specs=specs,
                                             round=specs["round_grad_weight"])
        return (grad_input, grad_weight, grad_bias) + (None,) * 7


class ConvTranspose2d(torch.nn.ConvTranspose2d):
    """``torch.nn.ConvTranspose2d`` taking ``mx_specs`` (None: plain); zero padding only."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, output_padding=0, dilation=1,
                 groups=1, bias=True, mx_specs=None, name=None, device=None, dtype=None):
        mx_assert_test(mx_specs)
        self.mx_none = mx_specs is None
        self.name = name
        self.mx_specs = apply_mx_specs(mx_specs)
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=padding,
                         output_padding=output_padding, dilation=dilation, groups=groups, bias=bias,
                         device=device, dtype=dtype)

    def apply_mx_specs(self, mx_specs):
        self.mx_none = mx_specs is None
        self.mx_specs = apply_mx_specs(mx_specs)

    def append_name(self, postfix):
        self.name += postfix

    def forward(self, inputs, output_size=None):
        if self.mx_none:
            return super().forward(inputs, output_size=output_size)
        output_padding = self._output_padding(inputs, output_size, self.stride, self.padding, self.kernel_size,
                                              2, self.dilation)
        return ConvTranspose2dFunction.apply(inputs, self.weight, self.bias, self.stride, self.padding,
                                             output_padding, self.groups, self.dilation, self.mx_specs, self.name)
