"""Differentiable elementwise ops at the elementwise precision of mx_specs (microxcaling's ``simd_*``).

Each rounds its inputs and its result; backward rounds the incoming gradient and
every step (a broadcast input's gradient is summed over the broadcast dims and
rounded). With ``mx_specs=None`` they are the plain torch ops.
"""

from __future__ import annotations

import math

import torch

from mxtrain.emulation.specs import apply_mx_specs, get_backwards_mx_specs, mx_assert_test
from mxtrain.emulation.vector_ops import (vec_add, vec_div, vec_exp, vec_mul, vec_quantize, vec_reduce_sum, vec_sqrt,
                                          vec_sub)

__all__ = ["simd_add", "simd_sub", "simd_mul", "simd_div", "simd_split", "simd_square", "simd_sqrt", "simd_exp",
           "simd_log", "simd_reduce_sum", "simd_reduce_mean", "simd_norm"]


def _broadcast_gradient(grad_out, in_shape, mx_specs):
    """Gradient of ``broadcast_to(x, grad_out.shape)`` for an ``x`` of ``in_shape``."""
    if list(grad_out.shape) == list(in_shape):
        return grad_out
    reduce_dims = []
    for i in range(grad_out.ndim):
        if i + 1 > len(in_shape):
            reduce_dims.append(-1 - i)
            continue
        dout, din = grad_out.shape[-1 - i], in_shape[-1 - i]
        if dout == din:
            continue
        if din == 1:
            reduce_dims.append(-1 - i)
        else:
            raise ValueError(f"gradient of shape {list(grad_out.shape)} cannot be reduced to input shape {in_shape}")
    if reduce_dims:
        grad_in = torch.sum(vec_quantize(grad_out, mx_specs=mx_specs), dim=reduce_dims)
        return vec_quantize(grad_in, mx_specs=mx_specs).view(in_shape)
    return grad_out.view(in_shape)


class _Binary(torch.autograd.Function):
    op = None

    @classmethod
    def _prepare(cls, ctx, in1, in2, mx_specs):
        ctx.mx_specs = get_backwards_mx_specs(mx_specs)
        if not isinstance(in1, torch.Tensor):
            raise TypeError(f"the first operand must be a tensor, got {type(in1).__name__}")
        qin1 = vec_quantize(in1, mx_specs=mx_specs)
        ctx.in2_const = not isinstance(in2, torch.Tensor)
        if ctx.in2_const:
            return qin1, in2
        ctx.in1_shape, ctx.in2_shape = list(in1.shape), list(in2.shape)
        return qin1, vec_quantize(in2, mx_specs=mx_specs)


class SIMDAdd(_Binary):
    @staticmethod
    def forward(ctx, in1, in2, mx_specs=None):
        qin1, qin2 = SIMDAdd._prepare(ctx, in1, in2, mx_specs)
        return vec_add(qin1, qin2, mx_specs=mx_specs)

    @staticmethod
    def backward(ctx, g):
        g = vec_quantize(g, mx_specs=ctx.mx_specs)
        if ctx.in2_const:
            return g, None, None
        return (_broadcast_gradient(g, ctx.in1_shape, ctx.mx_specs),
                _broadcast_gradient(g, ctx.in2_shape, ctx.mx_specs), None)


class SIMDSub(_Binary):
    @staticmethod
    def forward(ctx, in1, in2, mx_specs=None):
        qin1, qin2 = SIMDSub._prepare(ctx, in1, in2, mx_specs)
        return vec_sub(qin1, qin2, mx_specs=mx_specs)

    @staticmethod
    def backward(ctx, g):
        if ctx.in2_const:
            return g, None, None
        n_g = vec_quantize(-g, mx_specs=ctx.mx_specs)
        return (_broadcast_gradient(g, ctx.in1_shape, ctx.mx_specs),
                _broadcast_gradient(n_g, ctx.in2_shape, ctx.mx_specs), None)


class SIMDMul(_Binary):
    @staticmethod
    def forward(ctx, in1, in2, mx_specs=None):
        qin1, qin2 = SIMDMul._prepare(ctx, in1, in2, mx_specs)
        keep = mx_specs["quantize_backprop"]
        if ctx.in2_const:
            ctx.in2 = in2
            ctx.save_for_backward(qin1 if keep else in1)
        else:
            ctx.save_for_backward(qin1 if keep else in1, qin2 if keep else in2)
        return vec_mul(qin1, qin2, mx_specs=mx_specs)

    @staticmethod
    def backward(ctx, g):
        specs = ctx.mx_specs
        g = vec_quantize(g, mx_specs=specs)
        if ctx.in2_const:
            return vec_mul(g, ctx.in2, mx_specs=specs), None, None
        in1, in2 = ctx.saved_tensors
        g1 = _broadcast_gradient(vec_mul(g, in2, mx_specs=specs), ctx.in1_shape, specs)
        g2 = _broadcast_gradient(vec_mul(g, in1, mx_specs=specs), ctx.in2_shape, specs)
        return g1, g2, None


class SIMDDiv(_Binary):
    @staticmethod
    def forward(ctx, in1, in2, mx_specs=None):
        qin1, qin2 = SIMDDiv._prepare(ctx, in1, in2, mx_specs)
        keep = mx_specs["quantize_backprop"]
        out = vec_div(qin1, qin2, mx_specs=mx_specs)
        if ctx.in2_const:
            ctx.in2 = in2
            ctx.save_for_backward(qin1 if keep else in1)
        else:
            ctx.save_for_backward(out, qin2 if keep else in2)
        return out

    @staticmethod
    def backward(ctx, g):
        specs = ctx.mx_specs
        g = vec_quantize(g, mx_specs=specs)
        if ctx.in2_const:
            return vec_div(g, ctx.in2, mx_specs=specs), None, None
        out, in2 = ctx.saved_tensors
        g1 = vec_div(g, in2, mx_specs=specs)
        g2 = vec_mul(g, vec_div(-out, in2, mx_specs=specs), mx_specs=specs)
        return (_broadcast_gradient(g1, ctx.in1_shape, specs), _broadcast_gradient(g2, ctx.in2_shape, specs), None)


class SIMDSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, in1, mx_specs=None):
        ctx.mx_specs = get_backwards_mx_specs(mx_specs)
        ctx.set_materialize_grads(False)
        return in1.clone(), in1.clone()

    @staticmethod
    def backward(ctx, g1, g2):
        if g1 is None:
            return g2, None
        if g2 is None:
            return g1, None
        specs = ctx.mx_specs
        return vec_add(vec_quantize(g1, mx_specs=specs), vec_quantize(g2, mx_specs=specs), mx_specs=specs), None


class SIMDSquare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, in1, mx_specs=None):
        ctx.mx_specs = get_backwards_mx_specs(mx_specs)
        qin1 = vec_quantize(in1, mx_specs=mx_specs)
        ctx.save_for_backward(qin1 if mx_specs["quantize_backprop"] else in1)
        return vec_quantize(qin1**2, mx_specs=mx_specs)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        specs = ctx.mx_specs
        g = vec_quantize(g, mx_specs=specs)
        return vec_mul(g, vec_mul(x, 2, mx_specs=specs), mx_specs=specs), None


class SIMDSqrt(torch.autograd.Function):
    @staticmethod
    def forward(ctx, in1, mx_specs=None):
        ctx.mx_specs = get_backwards_mx_specs(mx_specs)
        out = vec_sqrt(vec_quantize(in1, mx_specs=mx_specs), mx_specs=mx_specs)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        (sqrt_x,) = ctx.saved_tensors
        specs = ctx.mx_specs
        g = vec_mul(vec_quantize(g, mx_specs=specs), 0.5, mx_specs=specs)
        return vec_div(g, sqrt_x, mx_specs=specs), None


class SIMDExp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, in1, mx_specs=None):
        ctx.mx_specs = get_backwards_mx_specs(mx_specs)
        out = vec_exp(vec_quantize(in1, mx_specs=mx_specs), mx_specs=mx_specs)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        (exp_x,) = ctx.saved_tensors
        specs = ctx.mx_specs
        return vec_mul(vec_quantize(g, mx_specs=specs), exp_x, mx_specs=specs), None


class SIMDLog(torch.autograd.Function):
    @staticmethod
    def forward(ctx, in1, mx_specs=None):
        ctx.mx_specs = get_backwards_mx_specs(mx_specs)
        qin1 = vec_quantize(in1, mx_specs=mx_specs)
        out = vec_quantize(torch.log(qin1), mx_specs=mx_specs)
        ctx.save_for_backward(qin1 if mx_specs["quantize_backprop"] else in1)
        return out

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        specs = ctx.mx_specs
        return vec_div(vec_quantize(g, mx_specs=specs), x, mx_specs=specs), None


class SIMDReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, in1, dim, keepdim=False, mx_specs=None):
        ctx.mx_specs = get_backwards_mx_specs(mx_specs)
        dim = [dim] if isinstance(dim, int) else list(dim)
        ctx.dim, ctx.keepdim, ctx.input_shape = dim, keepdim, list(in1.shape)
        return vec_reduce_sum(vec_quantize(in1, mx_specs=mx_specs), dim, keepdim=keepdim, mx_specs=mx_specs)

    @staticmethod
    def backward(ctx, g):
        ndim = len(ctx.input_shape)
        dim = [i + ndim if i < 0 else i for i in ctx.dim]
        g = vec_quantize(g, mx_specs=ctx.mx_specs)
        if not ctx.keepdim:
            for i in sorted(dim):
                g = g.unsqueeze(i)
        sizes = [-1] * ndim
        for i in dim:
            sizes[i] = ctx.input_shape[i]
        return g.expand(sizes), None, None, None


def simd_add(in1, in2, mx_specs=None):
    mx_assert_test(mx_specs)
    return in1 + in2 if mx_specs is None else SIMDAdd.apply(in1, in2, apply_mx_specs(mx_specs))


def simd_sub(in1, in2, mx_specs=None):
    mx_assert_test(mx_specs)
    return in1 - in2 if mx_specs is None else SIMDSub.apply(in1, in2, apply_mx_specs(mx_specs))


def simd_mul(in1, in2, mx_specs=None):
    mx_assert_test(mx_specs)
    return in1 * in2 if mx_specs is None else SIMDMul.apply(in1, in2, apply_mx_specs(mx_specs))


def simd_div(in1, in2, mx_specs=None):
    mx_assert_test(mx_specs)
    return in1 / in2 if mx_specs is None else SIMDDiv.apply(in1, in2, apply_mx_specs(mx_specs))


def simd_split(in1, mx_specs=None):
    mx_assert_test(mx_specs)
    return (in1, in1) if mx_specs is None else SIMDSplit.apply(in1, apply_mx_specs(mx_specs))


def simd_square(in1, mx_specs=None):
    mx_assert_test(mx_specs)
    return torch.square(in1) if mx_specs is None else SIMDSquare.apply(in1, apply_mx_specs(mx_specs))


def simd_sqrt(in1, mx_specs=None):
    mx_assert_test(mx_specs)
    return torch.sqrt(in1) if mx_specs is None else SIMDSqrt.apply(in1, apply_mx_specs(mx_specs))


def simd_exp(in1, mx_specs=None):
    mx_assert_test(mx_specs)
    return torch.exp(in1) if mx_specs is None else SIMDExp.apply(in1, apply_mx_specs(mx_specs))


def simd_log(in1, mx_specs=None):
    mx_assert_test(mx_specs)
    return torch.log(in1) if mx_specs is None else SIMDLog.apply(in1, apply_mx_specs(mx_specs))


def simd_reduce_sum(in1, dim=None, keepdim=False, mx_specs=None):
    mx_assert_test(mx_specs)
    if dim is None:
        dim = list(range(in1.ndim))
    if mx_specs is None:
        return torch.sum(in1, dim, keepdim=keepdim)
    return SIMDReduceSum.apply(in1, dim, keepdim, apply_mx_specs(mx_specs))


def simd_reduce_mean(in1, dim=None, keepdim=False, mx_specs=None):
    mx_assert_test(mx_specs)
    if dim is None:
        dim = list(range(in1.ndim))
    if mx_specs is None:
        return torch.mean(in1, dim, keepdim=keepdim)
    mx_specs = apply_mx_specs(mx_specs)
    dim = list(dim) if isinstance(dim, (list, tuple)) else [dim]
    denom = math.prod(in1.shape[i] for i in dim)
    s = SIMDReduceSum.apply(in1, dim, keepdim, mx_specs)
    return SIMDMul.apply(s, 1 / denom, mx_specs)


def simd_norm(in1, keepdim=False, mx_specs=None):
    """Frobenius norm ``sqrt(sum(in1**2))``, every step rounded."""
    mx_assert_test(mx_specs)
    if mx_specs is None:
        return torch.linalg.norm(in1, keepdim=keepdim)
    mx_specs = apply_mx_specs(mx_specs)
    sq = SIMDSquare.apply(in1, mx_specs)
    s = SIMDReduceSum.apply(sq, list(range(sq.ndim)), keepdim, mx_specs)
    return SIMDSqrt.apply(s, mx_specs)
