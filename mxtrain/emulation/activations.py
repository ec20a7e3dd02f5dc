"""Activations with every basic step rounded to an elementwise precision ``prec`` (microxcaling's formulas).

* ``sigmoid(x) = 1 / (1 + exp(-x))``; backward ``y (1 - y) g``.
* ``tanh``; backward ``(1 - y*y) g``.
* ``relu`` / ``relu6``: the output rounded, backward masks (then rounds).
* ``leaky_relu``: input and output rounded; backward ``g`` or ``slope * g``.
* ``silu(x) = x * sigmoid(x)``; backward ``s + y (1 - s)`` times ``g``.
* ``gelu``: ``x * sigmoid(1.59375 * (x + 0.044677734 * x**3))`` (the tanh
  approximation with bfloat16 constants; ``first_order_gelu``: ``x * sigmoid(1.703125 x)``).

Each ``*Function`` takes an :class:`~mxtrain.emulation.precision.ElementwisePrecision`
(``fmt=None``: the same formulas unrounded) and rounds its backward pass to ``prec.backward()``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mxtrain.emulation.vector_ops import vec_add, vec_exp, vec_mul, vec_quantize, vec_recip, vec_sub, vec_tanh

__all__ = ["SigmoidFunction", "TanhFunction", "ReLUFunction", "ReLU6Function",
           "LeakyReLUFunction", "SiLUFunction", "GELUFunction"]


class SigmoidFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, prec=None, name=None):
        ctx.name = name
        input = vec_quantize(input, prec=prec)
        exp_nx = vec_exp(-input, prec=prec)
        output = vec_recip(vec_add(exp_nx, 1.0, prec=prec), prec=prec)
        ctx.save_for_backward(output)
        ctx.prec = prec.backward()
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (output,) = ctx.saved_tensors
        specs = ctx.prec
        grad_output = vec_quantize(grad_output, prec=specs)
        grad_sigmoid = vec_mul(output, vec_sub(1, output, prec=specs), prec=specs)
        return vec_mul(grad_sigmoid, grad_output, prec=specs), None, None


class TanhFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, prec=None, name=None):
        ctx.name = name
        output = vec_tanh(vec_quantize(input, prec=prec), prec=prec)
        ctx.save_for_backward(output)
        ctx.prec = prec.backward()
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (output,) = ctx.saved_tensors
        specs = ctx.prec
        grad_output = vec_quantize(grad_output, prec=specs)
        grad_tanh = vec_sub(1, vec_mul(output, output, prec=specs), prec=specs)
        return vec_mul(grad_tanh, grad_output, prec=specs), None, None


def _masked_backward(ctx, grad_output):
    (mask,) = ctx.saved_tensors
    zero = torch.zeros([1], dtype=grad_output.dtype, device=grad_output.device)
    return vec_quantize(torch.where(mask, grad_output, zero), prec=ctx.prec), None, None, None


def _relu_grad(grad_output, out_sign):
    """``where(out > 0, grad, 0)`` from the sign of the ReLU output (0 or 1), without a slow boolean where.

    ``grad * sign`` equals it (up to the sign of zeros) when both are finite, which one
    fused sum checks; otherwise the where itself runs.
    """
    if grad_output.device.type != "cpu":  # a select costs nothing there, a finiteness check a sync
        return torch.where(out_sign > 0, grad_output, torch.zeros([1], dtype=grad_output.dtype,
                                                                   device=grad_output.device))
    g = grad_output * out_sign
    if not torch.isfinite(g.sum()):
        g = torch.where(out_sign > 0, grad_output, torch.zeros([1], dtype=grad_output.dtype,
                                                               device=grad_output.device))
    return g


class ReLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, inplace=False, prec=None, name=None):
        ctx.name = name
        if inplace:
            ctx.mark_dirty(input)
            input = torch.relu_(input)
            input.copy_(vec_quantize(input, prec=prec))
            output = input
        else:
            output = vec_quantize(torch.relu(input), prec=prec)
        ctx.save_for_backward(torch.sign(output))  # 1 where output > 0, else 0 (NaN where NaN)
        ctx.prec = prec.backward()
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (out_sign,) = ctx.saved_tensors
        return vec_quantize(_relu_grad(grad_output, out_sign), prec=ctx.prec), None, None, None


class ReLU6Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, inplace=False, prec=None, name=None):
        ctx.name = name
        if inplace:
            ctx.mark_dirty(input)
            input = F.relu6(input, inplace=True)
            input.copy_(vec_quantize(input, prec=prec))
            output = input
        else:
            output = vec_quantize(F.relu6(input), prec=prec)
        ctx.save_for_backward(torch.logical_and(output > 0, output < 6))
        ctx.prec = prec.backward()
        return output

    backward = staticmethod(_masked_backward)


class LeakyReLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, negative_slope=0.01, inplace=False, prec=None, name=None):
        ctx.negative_slope, ctx.name = negative_slope, name
        output = vec_quantize(F.leaky_relu(vec_quantize(input, prec=prec), negative_slope=negative_slope),
                              prec=prec)
        if inplace:
            ctx.mark_dirty(input)
            input.copy_(output)
            output = input
        ctx.save_for_backward(output > 0)
        ctx.prec = prec.backward()
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (mask,) = ctx.saved_tensors
        grad_output = vec_quantize(grad_output, prec=ctx.prec)
        grad_neg = vec_mul(grad_output, ctx.negative_slope, prec=ctx.prec)
        return torch.where(mask, grad_output, grad_neg), None, None, None, None


class SiLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, inplace=False, prec=None, name=None):
        ctx.name = name
        q_in = vec_quantize(input, prec=prec)
        exp_nx = vec_exp(-q_in, prec=prec)
        sig_x = vec_recip(vec_add(exp_nx, 1.0, prec=prec), prec=prec)
        output = vec_mul(q_in, sig_x, prec=prec)
        if inplace:
            ctx.mark_dirty(input)
            input.copy_(output)
            output = input
        ctx.save_for_backward(output, sig_x)
        ctx.prec = prec.backward()
        return output

    @staticmethod
    def backward(ctx, grad_output):
        y, sig_x = ctx.saved_tensors
        specs = ctx.prec
        grad_output = vec_quantize(grad_output, prec=specs)
        temp = vec_mul(y, vec_sub(1.0, sig_x, prec=specs), prec=specs)
        grad_silu = vec_add(sig_x, temp, prec=specs)
        return vec_mul(grad_silu, grad_output, prec=specs), None, None, None


class GELUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, prec=None, first_order_gelu=False, name=None):
        ctx.first_order_gelu, ctx.name = first_order_gelu, name
        q_in = vec_quantize(input, prec=prec)
        if first_order_gelu:
            sigmoid_input = vec_mul(1.703125, q_in, prec=prec)
        else:
            cube = vec_mul(vec_mul(q_in, q_in, prec=prec), q_in, prec=prec)
            inner = vec_add(vec_mul(0.044677734, cube, prec=prec), q_in, prec=prec)
            sigmoid_input = vec_mul(1.59375, inner, prec=prec)
        phi = vec_exp(-sigmoid_input, prec=prec)
        phi = vec_recip(vec_add(phi, 1.0, prec=prec), prec=prec)
        ctx.save_for_backward(q_in if prec.quantize_backward else input, phi)
        ctx.prec = prec.backward()
        return vec_mul(q_in, phi, prec=prec)

    @staticmethod
    def backward(ctx, grad_output):
        input, phi = ctx.saved_tensors
        specs = ctx.prec
        grad_output = vec_quantize(grad_output, prec=specs)
        dphi = vec_mul(phi, vec_sub(1, phi, prec=specs), prec=specs)
        if ctx.first_order_gelu:
            dphi = vec_mul(1.703125, dphi, prec=specs)
        else:
            dy = vec_mul(0.21386719, vec_mul(input, input, prec=specs), prec=specs)
            dy = vec_add(1.59375, dy, prec=specs)
            dphi = vec_mul(dy, dphi, prec=specs)
        x_dphi = vec_mul(input, dphi, prec=specs)
        grad_gelu = vec_add(phi, x_dphi, prec=specs)
        return vec_mul(grad_gelu, grad_output, prec=specs), None, None, None
