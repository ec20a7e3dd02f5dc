"""MX ``bmm``: both operands are activations (``a_elem_format``), blocked along the reduction dim."""

from __future__ import annotations

import torch

from mxtrain.compat.mx.elemwise_ops import quantize_elemwise_op
from mxtrain.compat.mx.mx_ops import quantize_mx_op
from mxtrain.compat.mx.specs import apply_mx_specs, get_backwards_mx_specs, mx_assert_test

__all__ = ["BMMFunction", "bmm"]

torch_bmm = torch.bmm


class BMMFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, in1, in2, mx_specs, name):
        bf_in1 = quantize_elemwise_op(in1, mx_specs=mx_specs, round=mx_specs["round_output"])
        bf_in2 = quantize_elemwise_op(in2, mx_specs=mx_specs, round=mx_specs["round_output"])
        if mx_specs["quantize_backprop"]:
            ctx.save_for_backward(bf_in1, bf_in2)
        else:
            ctx.save_for_backward(in1, in2)
        qin1 = quantize_mx_op(bf_in1, mx_specs, elem_format=mx_specs["a_elem_format"], axes=[-1],
                              round=mx_specs["round_mx_output"])
        qin2 = quantize_mx_op(bf_in2, mx_specs, elem_format=mx_specs["a_elem_format"], axes=[-2],
                              round=mx_specs["round_mx_output"])
        out = quantize_elemwise_op(torch_bmm(qin1, qin2), mx_specs=mx_specs, round=mx_specs["round_output"])
        ctx.mx_specs = get_backwards_mx_specs(mx_specs)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        specs = ctx.mx_specs
        in1, in2 = ctx.saved_tensors
        grad_out = quantize_elemwise_op(grad_out, mx_specs=specs, round=specs["round_grad_input"])
        qin1 = quantize_mx_op(in1, specs, elem_format=specs["a_elem_format_bp"], axes=[-2],
                              round=specs["round_mx_input_grad_input"])
        qin2 = quantize_mx_op(in2, specs, elem_format=specs["a_elem_format_bp"], axes=[-1],
                              round=specs["round_mx_input_grad_input"])
        qgrad_out1 = quantize_mx_op(grad_out, specs, elem_format=specs["a_elem_format_bp_os"], axes=[-1],
                                    round=specs["round_mx_grad_output_grad_input"])
        qgrad_out2 = quantize_mx_op(grad_out, specs, elem_format=specs["a_elem_format_bp_os"], axes=[-2],
                                    round=specs["round_mx_grad_output_grad_input"])
        grad_in1 = quantize_elemwise_op(torch_bmm(qgrad_out1, qin2.transpose(-1, -2)), mx_specs=specs,
                                        round=specs["round_grad_input"])
        grad_in2 = quantize_elemwise_op(torch_bmm(qin1.transpose(-1, -2), qgrad_out2), mx_specs=specs,
                                        round=specs["round_grad_input"])
        return grad_in1, grad_in2, None, None


def bmm(in1, in2, mx_specs=None, name=None):
    """``torch.bmm`` with MX operands per ``mx_specs`` (plain ``torch.bmm`` when None)."""
    mx_assert_test(mx_specs)
    if mx_specs is None:
        return torch_bmm(in1, in2)
    mx_specs = apply_mx_specs(mx_specs)
    return BMMFunction.apply(in1, in2, mx_specs, name)
