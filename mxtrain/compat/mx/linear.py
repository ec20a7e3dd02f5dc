"""MX ``linear`` / ``Linear``: microxcaling's operand roles, rounding points and backward, exact quantizers.

Forward: input, weight and bias rounded elementwise (``round_output`` /
``round_weight``), then input and weight MX-quantized along the input features
(``a_elem_format`` / ``w_elem_format``, ``round_mx_output``); the fp32 product is
rounded elementwise, the bias added and rounded again. Backward (per
``get_backwards_mx_specs``): dW from dY and X blocked along the token axis (-2)
with ``a_elem_format_bp_ex`` / ``a_elem_format_bp``; dX from dY along the output
features (``a_elem_format_bp_os``) and W along the output features
(``w_elem_format_bp``); each result rounded elementwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mxtrain.compat.mx._cache import cached
from mxtrain.compat.mx.elemwise_ops import quantize_elemwise_op
from mxtrain.compat.mx.mx_ops import quantize_mx_op
from mxtrain.compat.mx.specs import apply_mx_specs, get_backwards_mx_specs, mx_assert_test

__all__ = ["LinearFunction", "linear", "Linear"]

f_linear = F.linear


def _weight_key(specs, *extra):
    """What a cached weight rounding depends on besides the weight itself."""
    return tuple(specs[k] for k in ("bfloat", "fp", "bfloat_subnorms", "block_size", "scale_bits",
                                    "shared_exp_method", "mx_flush_fp32_subnorms", "custom_cuda")) + extra


class LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias=None, mx_specs=None, prequantized_weights=False, name=None):
        bf_in = quantize_elemwise_op(input, mx_specs=mx_specs, round=mx_specs["round_output"])
        wkey = _weight_key(mx_specs, mx_specs["round_weight"])
        if prequantized_weights:
            bf_weight = weight
        else:
            bf_weight = cached(weight, ("elem",) + wkey, lambda: quantize_elemwise_op(
                weight, mx_specs=mx_specs, round=mx_specs["round_weight"]))
        ctx.has_bias = bias is not None
        bf_bias = None
        if bias is not None:
            bf_bias = bias if prequantized_weights else quantize_elemwise_op(
                bias, mx_specs=mx_specs, round=mx_specs["round_weight"])
        if mx_specs["quantize_backprop"]:
            ctx.save_for_backward(bf_in, bf_weight)
        else:
            ctx.save_for_backward(input, weight)
        ctx.weight_src, ctx.weight_version = weight, weight._version
        ctx.weight_is_bf = bool(mx_specs["quantize_backprop"])
        qis_input = quantize_mx_op(bf_in, mx_specs, elem_format=mx_specs["a_elem_format"], axes=[-1],
                                   round=mx_specs["round_mx_output"])
        qis_weight = cached(weight, ("mx_fwd", mx_specs["w_elem_format"], mx_specs["round_mx_output"]) + wkey,
                            lambda: quantize_mx_op(bf_weight, mx_specs, elem_format=mx_specs["w_elem_format"],
                                                   axes=[-1], round=mx_specs["round_mx_output"]))
        if qis_weight.dtype != qis_input.dtype:
            qis_weight = qis_weight.to(qis_input.dtype)
        output = f_linear(qis_input, qis_weight)
        output = quantize_elemwise_op(output, mx_specs=mx_specs, round=mx_specs["round_output"])
        if bias is not None:
            output = quantize_elemwise_op(output + bf_bias, mx_specs=mx_specs, round=mx_specs["round_output"])
        ctx.mx_specs = get_backwards_mx_specs(mx_specs)
        ctx.wkey = wkey
        ctx.prequantized_weights = prequantized_weights
        ctx.name = name
        return output

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.prequantized_weights:
            raise RuntimeError("Cannot use prequantized weights when training!")
        specs = ctx.mx_specs
        input, weight = ctx.saved_tensors
        out_dim, in_dim = weight.shape[0], weight.shape[1]
        grad_output = quantize_elemwise_op(grad_output, mx_specs=specs, round=specs["round_grad_input"])

        qex_input = quantize_mx_op(input, specs, elem_format=specs["a_elem_format_bp"], axes=[-2],
                                   round=specs["round_mx_input_grad_weight"])
        qex_grad_output = quantize_mx_op(grad_output, specs, elem_format=specs["a_elem_format_bp_ex"], axes=[-2],
                                         round=specs["round_mx_grad_output_grad_weight"])
        qex_grad_output = qex_grad_output.reshape(-1, out_dim)
        qex_input = qex_input.reshape(-1, in_dim)
        grad_weight = torch.matmul(qex_grad_output.transpose(0, 1), qex_input)
        grad_weight = quantize_elemwise_op(grad_weight, mx_specs=specs, round=specs["round_grad_weight"])

        def weight_columns():
            return quantize_mx_op(weight, specs, elem_format=specs["w_elem_format_bp"], axes=[0],
                                  round=specs["round_mx_weight_grad_input"])

        if ctx.weight_is_bf:  # the saved weight is the (cached) rounded parameter: cache its columnwise plane too
            key = ("mx_bwd", specs["w_elem_format_bp"], specs["round_mx_weight_grad_input"],
                   specs["block_size"], specs["quantize_backprop"]) + ctx.wkey
            qos_weight = cached(ctx.weight_src, key, weight_columns, version=ctx.weight_version)
        else:
            qos_weight = weight_columns()
        ctx.weight_src = None
        qos_grad_output = quantize_mx_op(grad_output, specs, elem_format=specs["a_elem_format_bp_os"], axes=[-1],
                                         round=specs["round_mx_grad_output_grad_input"])
        grad_input = torch.matmul(qos_grad_output, qos_weight)
        grad_input = quantize_elemwise_op(grad_input, mx_specs=specs, round=specs["round_grad_input"])

        grad_bias = None
        if ctx.has_bias:
            grad_bias = grad_output.reshape(-1, out_dim).sum(0)
            grad_bias = quantize_elemwise_op(grad_bias, mx_specs=specs, round=specs["round_grad_weight"])
        return grad_input, grad_weight, grad_bias, None, None, None


def linear(input, weight, bias=None, mx_specs=None, prequantized_weights=False, name=None):
    """``F.linear`` with MX operands per ``mx_specs`` (plain ``F.linear`` when ``mx_specs`` is None)."""
    mx_assert_test(mx_specs)
    if mx_specs is None:
        return f_linear(input, weight, bias=bias)
    mx_specs = apply_mx_specs(mx_specs)
    return LinearFunction.apply(input, weight, bias, mx_specs, prequantized_weights, name)


class Linear(torch.nn.Linear):
    """``torch.nn.Linear`` taking ``mx_specs`` (None: a plain linear layer)."""

    def __init__(self, in_features, out_features, bias=True, mx_specs=None, name=None, device=None, dtype=None):
        mx_assert_test(mx_specs)
        self.mx_none = mx_specs is None
        self.name = name
        self.prequantized_weights = False
        self.mx_specs = apply_mx_specs(mx_specs)
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)

    def apply_mx_specs(self, mx_specs):
        mx_assert_test(mx_specs)
        self.mx_none = mx_specs is None
        self.mx_specs = apply_mx_specs(mx_specs)

    def append_name(self, postfix):
        self.name += postfix

    def prequantize_weights(self):
        """Store the weights rounded to bfloat16 (inference only), as microxcaling does."""
        if self.mx_none:
            return
        if self.mx_specs["round"] != "even" or not self.mx_specs["bfloat_subnorms"] or self.mx_specs["bfloat"] != 16:
            raise ValueError("prequantize_weights needs round='even', bfloat_subnorms=True and bfloat=16")
        with torch.no_grad():
            self.weight.data = quantize_elemwise_op(self.weight.data, mx_specs=self.mx_specs,
                                                    round=self.mx_specs["round_weight"]).to(torch.bfloat16)
            if self.bias is not None:
                self.bias.data = quantize_elemwise_op(self.bias.data, mx_specs=self.mx_specs,
                                                      round=self.mx_specs["round_weight"]).to(torch.bfloat16)
        self.prequantized_weights = True

    def forward(self, inputs):
        if self.mx_none:
            return super().forward(inputs)
        if self.prequantized_weights and self.training:
            raise RuntimeError("Cannot use prequantized weights when training!")
        return linear(inputs, self.weight, self.bias, mx_specs=self.mx_specs,
                      prequantized_weights=self.prequantized_weights, name=self.name)
