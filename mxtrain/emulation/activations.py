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

from mxtrain.emulation.saved import keep_for_backward, saved_and_grad
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
        keep_for_backward(ctx, prec, output)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (output,), specs, grad_output = saved_and_grad(ctx, grad_output)
        grad_sigmoid = vec_mul(output, vec_sub(1, output, prec=specs), prec=specs)
        return vec_mul(grad_sigmoid, grad_output, prec=specs), None, None


class TanhFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, prec=None, name=None):
        ctx.name = name
        output = vec_tanh(vec_quantize(input, prec=prec), prec=prec)
        keep_for_backward(ctx, prec, output)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (output,), specs, grad_output = saved_and_grad(ctx, grad_output)
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


def _rounded_clamp(ctx, input, inplace, prec, clamp, clamp_):
    """``clamp(input)`` (relu or relu6) rounded to ``prec``, written into ``input`` by ``clamp_`` when ``inplace``.

    ReLU passes ``torch.relu``, not ``F.relu``, which ``compat.mx.inject_pyt_ops`` replaces.
    """
    if inplace:
        ctx.mark_dirty(input)
        input = clamp_(input)
        input.copy_(vec_quantize(input, prec=prec))
        return input
    return vec_quantize(clamp(input), prec=prec)


class ReLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, inplace=False, prec=None, name=None):
        ctx.name = name
        output = _rounded_clamp(ctx, input, inplace, prec, torch.relu, torch.relu_)
        keep_for_backward(ctx, prec, torch.sign(output))  # 1 where output > 0, else 0 (NaN where NaN)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (out_sign,) = ctx.saved_tensors
        return vec_quantize(_relu_grad(grad_output, out_sign), prec=ctx.prec), None, None, None


class ReLU6Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, inplace=False, prec=None, name=None):
        ctx.name = name
        output = _rounded_clamp(ctx, input, inplace, prec, F.relu6,
                                lambda x: F.relu6(x, inplace=True))
        keep_for_backward(ctx, prec, torch.logical_and(output > 0, output < 6))
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
        keep_for_backward(ctx, prec, output > 0)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (mask,), _, grad_output = saved_and_grad(ctx, grad_output)
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
        keep_for_backward(ctx, prec, output, sig_x)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (y, sig_x), specs, grad_output = saved_and_grad(ctx, grad_output)
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
        keep_for_backward(ctx, prec, q_in if prec.quantize_backward else input, phi)
        return vec_mul(q_in, phi, prec=prec)

    @staticmethod
    def backward(ctx, grad_output):
        (input, phi), specs, grad_output = saved_and_grad(ctx, grad_output)
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
