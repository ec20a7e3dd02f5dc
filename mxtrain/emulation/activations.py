"""Activations with every basic step rounded to the elementwise precision of mx_specs (microxcaling's formulas).

* ``sigmoid(x) = 1 / (1 + exp(-x))``; backward ``y (1 - y) g``.
* ``tanh``; backward ``(1 - y*y) g``.
* ``relu`` / ``relu6``: the output rounded, backward masks (then rounds).
* ``leaky_relu``: input and output rounded; backward ``g`` or ``slope * g``.
* ``silu(x) = x * sigmoid(x)``; backward ``s + y (1 - s)`` times ``g``.
* ``gelu``: with mx_specs, ``x * sigmoid(1.59375 * (x + 0.044677734 * x**3))`` (the tanh
  approximation with bfloat16 constants; ``first_order_gelu``: ``x * sigmoid(1.703125 x)``).
  Without mx_specs it is ``F.gelu(x, approximate="tanh")``: microxcaling's baseline.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mxtrain.emulation.specs import apply_mx_specs, get_backwards_mx_specs, mx_assert_test
from mxtrain.emulation.vector_ops import vec_add, vec_exp, vec_mul, vec_quantize, vec_recip, vec_sub, vec_tanh

__all__ = ["sigmoid", "tanh", "relu", "relu6", "leaky_relu", "silu", "gelu", "Sigmoid", "Tanh", "ReLU", "ReLU6",
           "LeakyReLU", "SiLU", "GELU", "SigmoidFunction", "TanhFunction", "ReLUFunction", "ReLU6Function",
           "LeakyReLUFunction", "SiLUFunction", "GELUFunction"]


class SigmoidFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, mx_specs=None, name=None):
        ctx.name = name
        input = vec_quantize(input, mx_specs=mx_specs)
        exp_nx = vec_exp(-input, mx_specs=mx_specs)
        output = vec_recip(vec_add(exp_nx, 1.0, mx_specs=mx_specs), mx_specs=mx_specs)
        ctx.save_for_backward(output)
        ctx.mx_specs = get_backwards_mx_specs(mx_specs)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (output,) = ctx.saved_tensors
        specs = ctx.mx_specs
        grad_output = vec_quantize(grad_output, mx_specs=specs)
        grad_sigmoid = vec_mul(output, vec_sub(1, output, mx_specs=specs), mx_specs=specs)
        return vec_mul(grad_sigmoid, grad_output, mx_specs=specs), None, None


class TanhFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, mx_specs=None, name=None):
        ctx.name = name
        output = vec_tanh(vec_quantize(input, mx_specs=mx_specs), mx_specs=mx_specs)
        ctx.save_for_backward(output)
        ctx.mx_specs = get_backwards_mx_specs(mx_specs)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (output,) = ctx.saved_tensors
        specs = ctx.mx_specs
        grad_output = vec_quantize(grad_output, mx_specs=specs)
        grad_tanh = vec_sub(1, vec_mul(output, output, mx_specs=specs), mx_specs=specs)
        return vec_mul(grad_tanh, grad_output, mx_specs=specs), None, None


def _masked_backward(ctx, grad_output):
    (mask,) = ctx.saved_tensors
    zero = torch.zeros([1], dtype=grad_output.dtype, device=grad_output.device)
    return vec_quantize(torch.where(mask, grad_output, zero), mx_specs=ctx.mx_specs), None, None, None


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
    def forward(ctx, input, inplace=False, mx_specs=None, name=None):
        ctx.name = name
        if inplace:
            ctx.mark_dirty(input)
            input = torch.relu_(input)
            input.copy_(vec_quantize(input, mx_specs=mx_specs))
            output = input
        else:
            output = vec_quantize(torch.relu(input), mx_specs=mx_specs)
        ctx.save_for_backward(torch.sign(output))  # 1 where output > 0, else 0 (NaN where NaN)
        ctx.mx_specs = get_backwards_mx_specs(mx_specs)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (out_sign,) = ctx.saved_tensors
        return vec_quantize(_relu_grad(grad_output, out_sign), mx_specs=ctx.mx_specs), None, None, None


class ReLU6Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, inplace=False, mx_specs=None, name=None):
        ctx.name = name
        if inplace:
            ctx.mark_dirty(input)
            input = F.relu6(input, inplace=True)
            input.copy_(vec_quantize(input, mx_specs=mx_specs))
            output = input
        else:
            output = vec_quantize(F.relu6(input), mx_specs=mx_specs)
        ctx.save_for_backward(torch.logical_and(output > 0, output < 6))
        ctx.mx_specs = get_backwards_mx_specs(mx_specs)
        return output

    backward = staticmethod(_masked_backward)


class LeakyReLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, negative_slope=0.01, inplace=False, mx_specs=None, name=None):
        ctx.negative_slope, ctx.name = negative_slope, name
        output = vec_quantize(F.leaky_relu(vec_quantize(input, mx_specs=mx_specs), negative_slope=negative_slope),
                              mx_specs=mx_specs)
        if inplace:
            ctx.mark_dirty(input)
            input.copy_(output)
            output = input
        ctx.save_for_backward(output > 0)
        ctx.mx_specs = get_backwards_mx_specs(mx_specs)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (mask,) = ctx.saved_tensors
        grad_output = vec_quantize(grad_output, mx_specs=ctx.mx_specs)
        grad_neg = vec_mul(grad_output, ctx.negative_slope, mx_specs=ctx.mx_specs)
        return torch.where(mask, grad_output, grad_neg), None, None, None, None


class SiLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, inplace=False, mx_specs=None, name=None):
        ctx.name = name
        q_in = vec_quantize(input, mx_specs=mx_specs)
        exp_nx = vec_exp(-q_in, mx_specs=mx_specs)
        sig_x = vec_recip(vec_add(exp_nx, 1.0, mx_specs=mx_specs), mx_specs=mx_specs)
        output = vec_mul(q_in, sig_x, mx_specs=mx_specs)
        if inplace:
            ctx.mark_dirty(input)
            input.copy_(output)
            output = input
        ctx.save_for_backward(output, sig_x)
        ctx.mx_specs = get_backwards_mx_specs(mx_specs)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        y, sig_x = ctx.saved_tensors
        specs = ctx.mx_specs
        grad_output = vec_quantize(grad_output, mx_specs=specs)
        temp = vec_mul(y, vec_sub(1.0, sig_x, mx_specs=specs), mx_specs=specs)
        grad_silu = vec_add(sig_x, temp, mx_specs=specs)
        return vec_mul(grad_silu, grad_output, mx_specs=specs), None, None, None


class GELUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, mx_specs=None, first_order_gelu=False, name=None):
        ctx.first_order_gelu, ctx.name = first_order_gelu, name
        q_in = vec_quantize(input, mx_specs=mx_specs)
        if first_order_gelu:
            sigmoid_input = vec_mul(1.703125, q_in, mx_specs=mx_specs)
        else:
            cube = vec_mul(vec_mul(q_in, q_in, mx_specs=mx_specs), q_in, mx_specs=mx_specs)
            inner = vec_add(vec_mul(0.044677734, cube, mx_specs=mx_specs), q_in, mx_specs=mx_specs)
            sigmoid_input = vec_mul(1.59375, inner, mx_specs=mx_specs)
        phi = vec_exp(-sigmoid_input, mx_specs=mx_specs)
        phi = vec_recip(vec_add(phi, 1.0, mx_specs=mx_specs), mx_specs=mx_specs)
        ctx.save_for_backward(q_in if mx_specs["quantize_backprop"] else input, phi)
        ctx.mx_specs = get_backwards_mx_specs(mx_specs)
        return vec_mul(q_in, phi, mx_specs=mx_specs)

    @staticmethod
    def backward(ctx, grad_output):
        input, phi = ctx.saved_tensors
        specs = ctx.mx_specs
        grad_output = vec_quantize(grad_output, mx_specs=specs)
        dphi = vec_mul(phi, vec_sub(1, phi, mx_specs=specs), mx_specs=specs)
        if ctx.first_order_gelu:
            dphi = vec_mul(1.703125, dphi, mx_specs=specs)
        else:
            dy = vec_mul(0.21386719, vec_mul(input, input, mx_specs=specs), mx_specs=specs)
            dy = vec_add(1.59375, dy, mx_specs=specs)
            dphi = vec_mul(dy, dphi, mx_specs=specs)
        x_dphi = vec_mul(input, dphi, mx_specs=specs)
        grad_gelu = vec_add(phi, x_dphi, mx_specs=specs)
        return vec_mul(grad_gelu, grad_output, mx_specs=specs), None, None, None


def sigmoid(input, mx_specs=None, name=None):
    mx_assert_test(mx_specs)
    if mx_specs is None:
        return torch.sigmoid(input)
    return SigmoidFunction.apply(input, apply_mx_specs(mx_specs), name)


def tanh(input, mx_specs=None, name=None):
    mx_assert_test(mx_specs)
    if mx_specs is None:
        return torch.tanh(input)
    return TanhFunction.apply(input, apply_mx_specs(mx_specs), name)


def relu(input, inplace=False, mx_specs=None, name=None):
    mx_assert_test(mx_specs)
    if mx_specs is None:
        return F.relu(input, inplace=inplace)
    return ReLUFunction.apply(input, inplace, apply_mx_specs(mx_specs), name)


def relu6(input, inplace=False, mx_specs=None, name=None):
    mx_assert_test(mx_specs)
    if mx_specs is None:
        return F.relu6(input, inplace=inplace)
    return ReLU6Function.apply(input, inplace, apply_mx_specs(mx_specs), name)


def leaky_relu(input, negative_slope=0.01, inplace=False, mx_specs=None, name=None):
    mx_assert_test(mx_specs)
    if mx_specs is None:
        return F.leaky_relu(input, negative_slope=negative_slope, inplace=inplace)
    return LeakyReLUFunction.apply(input, negative_slope, inplace, apply_mx_specs(mx_specs), name)


def silu(input, inplace=False, mx_specs=None, name=None):
    mx_assert_test(mx_specs)
    if mx_specs is None:
        return F.silu(input, inplace=inplace)
    return SiLUFunction.apply(input, inplace, apply_mx_specs(mx_specs), name)


def gelu(input, mx_specs=None, first_order_gelu=False, approximate=None, name=None):
    """GELU; ``approximate`` is accepted for torch's signature and ignored, as in microxcaling."""
    mx_assert_test(mx_specs)
    if mx_specs is None and not first_order_gelu:
        return F.gelu(input, approximate="tanh")
    return GELUFunction.apply(input, apply_mx_specs(mx_specs), first_order_gelu, name)


def _activation_module(base, function, doc, init_args=()):
    """A torch activation module taking ``mx_specs`` (None: the torch module itself)."""

    class Module(base):
        def __init__(self, *args, mx_specs=None, name=None, **kwargs):
            super().__init__(*args, **kwargs)
            mx_assert_test(mx_specs)
            self.mx_none = mx_specs is None
            self.mx_specs = apply_mx_specs(mx_specs)
            self.name = name

        def apply_mx_specs(self, mx_specs):
            self.mx_none = mx_specs is None
            self.mx_specs = apply_mx_specs(mx_specs)

        def forward(self, input):
            if self.mx_none:
                return super().forward(input)
            return function(self, input)

    Module.__name__ = Module.__qualname__ = base.__name__
    Module.__doc__ = doc
    return Module


Sigmoid = _activation_module(torch.nn.Sigmoid, lambda m, x: SigmoidFunction.apply(x, m.mx_specs, m.name),
                             "``torch.nn.Sigmoid`` taking ``mx_specs``.")
Tanh = _activation_module(torch.nn.Tanh, lambda m, x: TanhFunction.apply(x, m.mx_specs, m.name),
                          "``torch.nn.Tanh`` taking ``mx_specs``.")
ReLU = _activation_module(torch.nn.ReLU, lambda m, x: ReLUFunction.apply(x, m.inplace, m.mx_specs, m.name),
                          "``torch.nn.ReLU(inplace=False, mx_specs=None)``.")
ReLU6 = _activation_module(torch.nn.ReLU6, lambda m, x: ReLU6Function.apply(x, m.inplace, m.mx_specs, m.name),
                           "``torch.nn.ReLU6(inplace=False, mx_specs=None)``.")
LeakyReLU = _activation_module(
    torch.nn.LeakyReLU, lambda m, x: LeakyReLUFunction.apply(x, m.negative_slope, m.inplace, m.mx_specs, m.name),
    "``torch.nn.LeakyReLU(negative_slope=0.01, inplace=False, mx_specs=None)``.")
SiLU = _activation_module(torch.nn.SiLU, lambda m, x: SiLUFunction.apply(x, m.inplace, m.mx_specs, m.name),
                          "``torch.nn.SiLU(inplace=False, mx_specs=None)``.")


class GELU(torch.nn.GELU):
    """``torch.nn.GELU`` taking ``mx_specs``; the baseline is the tanh approximation (microxcaling's)."""

    def __init__(self, mx_specs=None, first_order_gelu=False, approximate=None, name=None):
        super().__init__(approximate="tanh")
        mx_assert_test(mx_specs)
        self.mx_none = mx_specs is None and not first_order_gelu
        self.mx_specs = apply_mx_specs(mx_specs)
        self.first_order_gelu = first_order_gelu
        self.name = name

    def forward(self, input):
        if self.mx_none:
            return super().forward(input)
        return GELUFunction.apply(input, self.mx_specs, self.first_order_gelu, self.name)
