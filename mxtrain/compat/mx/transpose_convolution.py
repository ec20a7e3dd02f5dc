"""MX ``ConvTranspose2d`` with microxcaling's semantics (MX steps at ``round="nearest"``, forward formats)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mxtrain.compat.mx.convolution import (_backward_operands, _input_and_bias_grads, _round_bias_and_save,
                                           conv_weight)
from mxtrain.compat.mx.elemwise_ops import quantize_elemwise_op
from mxtrain.compat.mx.mx_ops import quantize_mx_op
from mxtrain.compat.mx.specs import MxSpecsModule, apply_mx_specs, get_backwards_mx_specs, mx_assert_test

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
        output = quantize_elemwise_op(output, mx_specs=mx_specs, round=mx_specs["round_output"])
        ctx.mx_specs = get_backwards_mx_specs(mx_specs)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        specs, input, weight, grad_output, qex_input, qex_grad_output = _backward_operands(ctx, grad_output)
        grad_weight = conv_weight(qex_grad_output, weight.shape, qex_input, stride=ctx.stride, padding=ctx.padding,
                                  dilation=ctx.dilation, groups=ctx.groups)
        grad_weight = quantize_elemwise_op(grad_weight, mx_specs=specs, round=specs["round_grad_weight"])
        qod_weight = quantize_mx_op(weight, specs, elem_format=specs["w_elem_format"], axes=[1])
        qod_grad_output = quantize_mx_op(grad_output, specs, elem_format=specs["a_elem_format"], axes=[1])
        grad_input = torch.conv2d(qod_grad_output, qod_weight, bias=None, stride=ctx.stride, padding=ctx.padding,
                                  dilation=ctx.dilation, groups=ctx.groups)
        return _input_and_bias_grads(ctx, specs, grad_input, grad_weight, grad_output) + (None,) * 7


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
