"""Differentiable elementwise ops at an elementwise precision ``prec`` (microxcaling's ``simd_*``).

Each rounds its inputs and its result; backward rounds the incoming gradient and
every step to ``prec.backward()`` (a broadcast input's gradient is summed over the
broadcast dims and rounded).
"""

from __future__ import annotations

import math

import torch

from mxtrain.emulation.vector_ops import (vec_add, vec_div, vec_exp, vec_mul, vec_quantize, vec_reduce_sum, vec_sqrt,
                                          vec_sub)

__all__ = ["SIMDAdd", "SIMDSub", "SIMDMul", "SIMDDiv", "SIMDSplit", "SIMDSquare", "SIMDSqrt", "SIMDExp",
           "SIMDLog", "SIMDReduceSum"]


def _broadcast_gradient(grad_out, in_shape, prec):
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
        grad_in = torch.sum(vec_quantize(grad_out, prec=prec), dim=reduce_dims)
        return vec_quantize(grad_in, prec=prec).view(in_shape)
    return grad_out.view(in_shape)


class _Binary(torch.autograd.Function):
    op = None

    @classmethod
    def _prepare(cls, ctx, in1, in2, prec):
        ctx.prec = prec.backward()
        if not isinstance(in1, torch.Tensor):
            raise TypeError(f"the first operand must be a tensor, got {type(in1).__name__}")
        qin1 = vec_quantize(in1, prec=prec)
        ctx.in2_const = not isinstance(in2, torch.Tensor)
        if ctx.in2_const:
            return qin1, in2
        ctx.in1_shape, ctx.in2_shape = list(in1.shape), list(in2.shape)
        return qin1, vec_quantize(in2, prec=prec)


class SIMDAdd(_Binary):
    @staticmethod
    def forward(ctx, in1, in2, prec=None):
        qin1, qin2 = SIMDAdd._prepare(ctx, in1, in2, prec)
        return vec_add(qin1, qin2, prec=prec)

    @staticmethod
    def backward(ctx, g):
        g = vec_quantize(g, prec=ctx.prec)
        if ctx.in2_const:
            return g, None, None
        return (_broadcast_gradient(g, ctx.in1_shape, ctx.prec),
                _broadcast_gradient(g, ctx.in2_shape, ctx.prec), None)


class SIMDSub(_Binary):
    @staticmethod
    def forward(ctx, in1, in2, prec=None):
        qin1, qin2 = SIMDSub._prepare(ctx, in1, in2, prec)
        return vec_sub(qin1, qin2, prec=prec)

    @staticmethod
    def backward(ctx, g):
        if ctx.in2_const:
            return g, None, None
        n_g = vec_quantize(-g, prec=ctx.prec)
        return (_broadcast_gradient(g, ctx.in1_shape, ctx.prec),
                _broadcast_gradient(n_g, ctx.in2_shape, ctx.prec), None)


class SIMDMul(_Binary):
    @staticmethod
    def forward(ctx, in1, in2, prec=None):
        qin1, qin2 = SIMDMul._prepare(ctx, in1, in2, prec)
        keep = prec.quantize_backward
        if ctx.in2_const:
            ctx.in2 = in2
            ctx.save_for_backward(qin1 if keep else in1)
        else:
            ctx.save_for_backward(qin1 if keep else in1, qin2 if keep else in2)
        return vec_mul(qin1, qin2, prec=prec)

    @staticmethod
    def backward(ctx, g):
        specs = ctx.prec
        g = vec_quantize(g, prec=specs)
        if ctx.in2_const:
            return vec_mul(g, ctx.in2, prec=specs), None, None
        in1, in2 = ctx.saved_tensors
        g1 = _broadcast_gradient(vec_mul(g, in2, prec=specs), ctx.in1_shape, specs)
        g2 = _broadcast_gradient(vec_mul(g, in1, prec=specs), ctx.in2_shape, specs)
        return g1, g2, None


class SIMDDiv(_Binary):
    @staticmethod
    def forward(ctx, in1, in2, prec=None):
        qin1, qin2 = SIMDDiv._prepare(ctx, in1, in2, prec)
        keep = prec.quantize_backward
        out = vec_div(qin1, qin2, prec=prec)
        if ctx.in2_const:
            ctx.in2 = in2
            ctx.save_for_backward(qin1 if keep else in1)
        else:
            ctx.save_for_backward(out, qin2 if keep else in2)
        return out

    @staticmethod
    def backward(ctx, g):
        specs = ctx.prec
        g = vec_quantize(g, prec=specs)
        if ctx.in2_const:
            return vec_div(g, ctx.in2, prec=specs), None, None
        out, in2 = ctx.saved_tensors
        g1 = vec_div(g, in2, prec=specs)
        g2 = vec_mul(g, vec_div(-out, in2, prec=specs), prec=specs)
        return (_broadcast_gradient(g1, ctx.in1_shape, specs), _broadcast_gradient(g2, ctx.in2_shape, specs), None)


class SIMDSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, in1, prec=None):
        ctx.prec = prec.backward()
        ctx.set_materialize_grads(False)
        return in1.clone(), in1.clone()

    @staticmethod
    def backward(ctx, g1, g2):
        if g1 is None:
            return g2, None
        if g2 is None:
            return g1, None
        specs = ctx.prec
        return vec_add(vec_quantize(g1, prec=specs), vec_quantize(g2, prec=specs), prec=specs), None


class SIMDSquare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, in1, prec=None):
        ctx.prec = prec.backward()
        qin1 = vec_quantize(in1, prec=prec)
        ctx.save_for_backward(qin1 if prec.quantize_backward else in1)
        return vec_quantize(qin1**2, prec=prec)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        specs = ctx.prec
        g = vec_quantize(g, prec=specs)
        return vec_mul(g, vec_mul(x, 2, prec=specs), prec=specs), None


class SIMDSqrt(torch.autograd.Function):
    @staticmethod
    def forward(ctx, in1, prec=None):
        ctx.prec = prec.backward()
        out = vec_sqrt(vec_quantize(in1, prec=prec), prec=prec)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        (sqrt_x,) = ctx.saved_tensors
        specs = ctx.prec
        g = vec_mul(vec_quantize(g, prec=specs), 0.5, prec=specs)
        return vec_div(g, sqrt_x, prec=specs), None


class SIMDExp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, in1, prec=None):
        ctx.prec = prec.backward()
        out = vec_exp(vec_quantize(in1, prec=prec), prec=prec)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        (exp_x,) = ctx.saved_tensors
        specs = ctx.prec
        return vec_mul(vec_quantize(g, prec=specs), exp_x, prec=specs), None


class SIMDLog(torch.autograd.Function):
    @staticmethod
    def forward(ctx, in1, prec=None):
        ctx.prec = prec.backward()
        qin1 = vec_quantize(in1, prec=prec)
        out = vec_quantize(torch.log(qin1), prec=prec)
        ctx.save_for_backward(qin1 if prec.quantize_backward else in1)
        return out

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        specs = ctx.prec
        return vec_div(vec_quantize(g, prec=specs), x, prec=specs), None


class SIMDReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, in1, dim, keepdim=False, prec=None):
        ctx.prec = prec.backward()
        dim = [dim] if isinstance(dim, int) else list(dim)
        ctx.dim, ctx.keepdim, ctx.input_shape = dim, keepdim, list(in1.shape)
        return vec_reduce_sum(vec_quantize(in1, prec=prec), dim, keepdim=keepdim, prec=prec)

    @staticmethod
    def backward(ctx, g):
        ndim = len(ctx.input_shape)
        dim = [i + ndim if i < 0 else i for i in ctx.dim]
        g = vec_quantize(g, prec=ctx.prec)
        if not ctx.keepdim:
            for i in sorted(dim):
                g = g.unsqueeze(i)
        sizes = [-1] * ndim
        for i in dim:
            sizes[i] = ctx.input_shape[i]
        return g.expand(sizes), None, None, None
