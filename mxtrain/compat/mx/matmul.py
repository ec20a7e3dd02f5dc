"""MX ``matmul`` with microxcaling's operand modes: ``"aa"`` (act x act), ``"aw"`` and ``"wa"``.

``in1 (..., rows, K) @ in2 (..., K, cols)`` (or ``in2 (K, cols)``): in1 blocked
along K (its last axis), in2 along K (its second-to-last axis), with
``a_elem_format`` or ``w_elem_format`` per mode letter. Backward: ``dIn1 = dY in2ᵀ``
with dY along cols and in2 along cols; ``dIn2 = in1ᵀ dY`` with in1 and dY along
rows; backward formats ``a_elem_format_bp`` / ``w_elem_format_bp`` and
``a_elem_format_bp_os`` for dY. Without mx_specs: ``torch.matmul`` (``addmm`` with a bias).
"""

from __future__ import annotations

import math

import torch

from mxtrain.compat.mx.elemwise_ops import quantize_elemwise_op
from mxtrain.compat.mx.mx_ops import quantize_mx_op
from mxtrain.compat.mx.specs import apply_mx_specs, get_backwards_mx_specs, mx_assert_test

__all__ = ["MatMulFunction", "matmul"]

torch_matmul = torch.matmul
torch_addmm = torch.addmm
MODES = ("aa", "aw", "wa")


class MatMulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, in1, in2, bias, mx_specs, name, mode_config="aa"):
        if mode_config not in MODES:
            raise ValueError(f"mode_config must be one of {MODES} (a = activation, w = weight), got {mode_config!r}")
        ctx.mode_config = mode_config
        fmt1 = mx_specs["a_elem_format" if mode_config[0] == "a" else "w_elem_format"]
        fmt2 = mx_specs["a_elem_format" if mode_config[1] == "a" else "w_elem_format"]
        bf_in1 = quantize_elemwise_op(in1, mx_specs=mx_specs, round=mx_specs["round_output"])
        bf_in2 = quantize_elemwise_op(in2, mx_specs=mx_specs, round=mx_specs["round_output"])
        bf_bias = None
        ctx.bias_shape = None
        if bias is not None:
            bf_bias = quantize_elemwise_op(bias, mx_specs=mx_specs, round=mx_specs["round_weight"])
            ctx.bias_shape = list(bias.shape)
        if mx_specs["quantize_backprop"]:
            ctx.save_for_backward(bf_in1, bf_in2)
        else:
            ctx.save_for_backward(in1, in2)
        qin1 = quantize_mx_op(bf_in1, mx_specs, elem_format=fmt1, axes=[-1], round=mx_specs["round_mx_output"])
        qin2 = quantize_mx_op(bf_in2, mx_specs, elem_format=fmt2, axes=[-2], round=mx_specs["round_mx_output"])
        out = torch_matmul(qin1, qin2)
        out = quantize_elemwise_op(out, mx_specs=mx_specs, round=mx_specs["round_output"])
        if bias is not None:
            out = quantize_elemwise_op(out + bf_bias, mx_specs=mx_specs, round=mx_specs["round_output"])
        ctx.mx_specs = get_backwards_mx_specs(mx_specs)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        specs = ctx.mx_specs
        fmt1 = specs["a_elem_format_bp" if ctx.mode_config[0] == "a" else "w_elem_format_bp"]
        fmt2 = specs["a_elem_format_bp" if ctx.mode_config[1] == "a" else "w_elem_format_bp"]
        in1, in2 = ctx.saved_tensors
        grad_out = quantize_elemwise_op(grad_out, mx_specs=specs, round=specs["round_grad_input"])
        qin1 = quantize_mx_op(in1, specs, elem_format=fmt1, axes=[-2], round=specs["round_mx_input_grad_input"])
        qin2 = quantize_mx_op(in2, specs, elem_format=fmt2, axes=[-1], round=specs["round_mx_input_grad_input"])
        qgrad_out1 = quantize_mx_op(grad_out, specs, elem_format=specs["a_elem_format_bp_os"], axes=[-1],
                                    round=specs["round_mx_grad_output_grad_input"])
        qgrad_out2 = quantize_mx_op(grad_out, specs, elem_format=specs["a_elem_format_bp_os"], axes=[-2],
                                    round=specs["round_mx_grad_output_grad_input"])
        grad_in1 = torch_matmul(qgrad_out1, qin2.transpose(-1, -2))
        grad_in2 = torch_matmul(qin1.transpose(-1, -2), qgrad_out2)
        grad_in1 = quantize_elemwise_op(grad_in1, mx_specs=specs, round=specs["round_grad_input"])
        grad_in2 = quantize_elemwise_op(grad_in2, mx_specs=specs, round=specs["round_grad_input"])
        grad_bias = None
        if ctx.bias_shape is not None:
            inner = grad_out.shape[-1]
            if math.prod(ctx.bias_shape) != inner:
                raise RuntimeError(f"bias of shape {ctx.bias_shape} does not match the output's last dim {inner}")
            grad_bias = grad_out.reshape(-1, inner).sum(0).reshape(ctx.bias_shape)
            grad_bias = quantize_elemwise_op(grad_bias, mx_specs=specs, round=specs["round_grad_weight"])
        return grad_in1, grad_in2, grad_bias, None, None, None


def matmul(in1, in2, bias=None, mx_specs=None, name=None, mode_config="aa"):
    """``torch.matmul(in1, in2) (+ bias)`` with MX operands per ``mx_specs`` and ``mode_config``."""
    mx_assert_test(mx_specs)
    if mx_specs is None:
        return torch_matmul(in1, in2) if bias is None else torch_addmm(bias, in1, in2)
    mx_specs = apply_mx_specs(mx_specs)
    return MatMulFunction.apply(in1, in2, bias, mx_specs, name, mode_config)
