"""MX ``conv1d/2d/3d`` and ``Conv1d/2d/3d`` with microxcaling's semantics.

Forward: input, weight, bias rounded elementwise; input and weight MX-quantized
along the input channels (axis 1); the conv (bias inside) rounded elementwise.
Backward: dW from input and dY blocked along the batch axis, dX from dY along
the output channels and W along its output channels (axis 0). As in
microxcaling, the conv's MX steps use ``round="nearest"`` whatever the specs
say, and the backward pass uses the forward formats (``a_elem_format``,
``w_elem_format``), not the ``*_bp`` ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn import grad as nn_grad

from mxtrain.compat.mx._cache import cached
from mxtrain.compat.mx.elemwise_ops import quantize_elemwise_op
from mxtrain.compat.mx.mx_ops import quantize_mx_op
from mxtrain.compat.mx.specs import MxSpecsModule, apply_mx_specs, get_backwards_mx_specs, mx_assert_test

__all__ = ["ConvFunction", "conv1d", "conv2d", "conv3d", "Conv1d", "Conv2d", "Conv3d", "conv_weight"]

_FWD = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_GRAD_INPUT = {1: nn_grad.conv1d_input, 2: nn_grad.conv2d_input, 3: nn_grad.conv3d_input}
_GRAD_WEIGHT = {1: nn_grad.conv1d_weight, 2: nn_grad.conv2d_weight, 3: nn_grad.conv3d_weight}


def conv_weight(input, weight_shape, grad_output, stride=1, padding=0, dilation=1, groups=1):
    """Gradient of a conv with respect to its weight."""
    dims = input.ndim - 2
    if dims not in _GRAD_WEIGHT:
        raise ValueError(f"conv_weight works on 1-3 spatial dims, got input with ndim={input.ndim}")
    return _GRAD_WEIGHT[dims](input, weight_shape, grad_output, stride=stride, padding=padding, dilation=dilation,
                              groups=groups)


def _specs_key(specs):
    return tuple(specs[k] for k in ("bfloat", "fp", "bfloat_subnorms", "round_weight", "w_elem_format",
                                    "block_size", "scale_bits", "shared_exp_method", "mx_flush_fp32_subnorms"))


def _round_bias_and_save(ctx, input, weight, bias, bf_in, bf_weight, mx_specs):
    """Saves what backward needs (input and weight, rounded when ``quantize_backprop``); returns the bias
    rounded at ``round_weight`` (None without one)."""
    bf_bias = None
    if bias is not None:
        bf_bias = quantize_elemwise_op(bias, mx_specs=mx_specs, round=mx_specs["round_weight"])
    if mx_specs["quantize_backprop"]:
        ctx.save_for_backward(bf_in, bf_weight)
    else:
        ctx.save_for_backward(input, weight)
    return bf_bias


def _rounded_output(ctx, output, mx_specs):
    """The conv's output rounded at ``round_output``; keeps the backward specs on ``ctx``."""
    output = quantize_elemwise_op(output, mx_specs=mx_specs, round=mx_specs["round_output"])
    ctx.mx_specs = get_backwards_mx_specs(mx_specs)
    return output


def _conv_grads(ctx, grad_output, weight_grad, weight_axis, input_grad):
    """``(dX, dW, db)`` of a conv or transposed conv, each rounded as microxcaling does.

    dY is rounded first; ``dW = weight_grad(input, weight_shape, dY)`` on input and dY MX-quantized along the
    batch axis; ``dX = input_grad(input_shape, W, dY)`` on W blocked along ``weight_axis`` and dY along its
    channels; db (None without a bias) is dY summed over all but the channel axis. The callables get the conv's
    stride, padding, dilation and groups as keywords.
    """
    specs = ctx.mx_specs
    kw = dict(stride=ctx.stride, padding=ctx.padding, dilation=ctx.dilation, groups=ctx.groups)
    input, weight = ctx.saved_tensors
    grad_output = quantize_elemwise_op(grad_output, mx_specs=specs, round=specs["round_grad_input"])
    qex_input = quantize_mx_op(input, specs, elem_format=specs["a_elem_format"], axes=[0])
    qex_grad_output = quantize_mx_op(grad_output, specs, elem_format=specs["a_elem_format"], axes=[0])
    grad_weight = weight_grad(qex_input, weight.shape, qex_grad_output, **kw)
    grad_weight = quantize_elemwise_op(grad_weight, mx_specs=specs, round=specs["round_grad_weight"])
    qod_weight = quantize_mx_op(weight, specs, elem_format=specs["w_elem_format"], axes=[weight_axis])
    qod_grad_output = quantize_mx_op(grad_output, specs, elem_format=specs["a_elem_format"], axes=[1])
    grad_input = input_grad(input.shape, qod_weight, qod_grad_output, **kw)
    grad_input = quantize_elemwise_op(grad_input, mx_specs=specs, round=specs["round_grad_input"])
    grad_bias = None
    if ctx.has_bias:
        grad_bias = grad_output.sum([0] + list(range(2, grad_output.ndim)))
        grad_bias = quantize_elemwise_op(grad_bias, mx_specs=specs, round=specs["round_grad_weight"])
    return grad_input, grad_weight, grad_bias


class ConvFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, mx_specs=None, name=None):
        ctx.has_bias = bias is not None
        ctx.stride, ctx.padding, ctx.dilation, ctx.groups, ctx.name = stride, padding, dilation, groups, name
        dims = input.ndim - 2
        if dims not in _FWD:
            raise ValueError(f"MX conv takes inputs with 1-3 spatial dims, got ndim={input.ndim}")
        if input.shape[1] % groups:
            raise ValueError(f"input channels {input.shape[1]} are not divisible by groups={groups}")
        ctx.conv_input = _GRAD_INPUT[dims]
        key = _specs_key(mx_specs)
        bf_in = quantize_elemwise_op(input, mx_specs=mx_specs, round=mx_specs["round_output"])
        bf_weight = cached(weight, ("conv_elem",) + key,
                           lambda: quantize_elemwise_op(weight, mx_specs=mx_specs, round=mx_specs["round_weight"]))
        bf_bias = _round_bias_and_save(ctx, input, weight, bias, bf_in, bf_weight, mx_specs)
        qid_input = quantize_mx_op(bf_in, mx_specs, elem_format=mx_specs["a_elem_format"], axes=[1])
        qid_weight = cached(weight, ("conv_mx_fwd",) + key,
                            lambda: quantize_mx_op(bf_weight, mx_specs, elem_format=mx_specs["w_elem_format"], axes=[1]))
        output = _FWD[dims](qid_input, qid_weight, bf_bias, stride, padding, dilation, groups)
        return _rounded_output(ctx, output, mx_specs)

    @staticmethod
    def backward(ctx, grad_output):
        return _conv_grads(ctx, grad_output, conv_weight, 0, ctx.conv_input) + (None,) * 6


def _conv(dims):
    def conv(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, mx_specs=None, name=None):
        mx_assert_test(mx_specs)
        if mx_specs is None:
            return _FWD[dims](input, weight, bias=bias, stride=stride, padding=padding, dilation=dilation,
                              groups=groups)
        mx_specs = apply_mx_specs(mx_specs)
        return ConvFunction.apply(input, weight, bias, stride, padding, dilation, groups, mx_specs, name)
    conv.__name__ = conv.__qualname__ = f"conv{dims}d"
    conv.__doc__ = f"``F.conv{dims}d`` with MX operands per ``mx_specs`` (plain when None)."
    return conv


conv1d, conv2d, conv3d = _conv(1), _conv(2), _conv(3)


class _MXConvMixin(MxSpecsModule):
    def forward(self, inputs):
        if self.mx_none:
            return self._conv_forward(inputs, self.weight, self.bias)
        if self.padding_mode != "zeros":
            raise NotImplementedError(f"MX conv supports padding_mode='zeros' only, got {self.padding_mode!r}")
        return ConvFunction.apply(inputs, self.weight, self.bias, self.stride, self.padding, self.dilation,
                                  self.groups, self.mx_specs, self.name)


def _module(base, dims):
    class MXConv(_MXConvMixin, base):
        def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                     bias=True, mx_specs=None, name=None, padding_mode="zeros", device=None, dtype=None):
            self._init_mx(mx_specs, name)
            base.__init__(self, in_channels, out_channels, kernel_size, stride=stride, padding=padding,
                          dilation=dilation, groups=groups, bias=bias, padding_mode=padding_mode, device=device,
                          dtype=dtype)

    MXConv.__name__ = MXConv.__qualname__ = base.__name__
    MXConv.__doc__ = f"``torch.nn.{base.__name__}`` taking ``mx_specs`` (None: a plain conv)."
    return MXConv


Conv1d = _module(torch.nn.Conv1d, 1)
Conv2d = _module(torch.nn.Conv2d, 2)
Conv3d = _module(torch.nn.Conv3d, 3)
