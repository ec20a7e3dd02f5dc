"""Differentiable elementwise ops at an elementwise precision ``prec`` (microxcaling's ``simd_*``).

Each rounds its inputs and its result; backward rounds the incoming gradient and
every step to ``prec.backward()`` (a broadcast input's gradient is summed over the
broadcast dims and rounded).
"""

from __future__ import annotations

import math

import torch

from mxtrain.emulation.saved import keep_for_backward, saved_and_grad
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

    @staticmethod
    def _backward(ctx, g, op, grads):
        """Rounds ``g``, then returns ``op(g, in2)`` for a constant in2, else ``grads(g, *saved, prec)``."""
        saved, specs, g = saved_and_grad(ctx, g)
        if ctx.in2_const:
            return op(g, ctx.in2, prec=specs), None, None
        return (*grads(g, *saved, specs), None)

    @staticmethod
    def _save(ctx, prec, in1, qin1, in2, qin2, first=None):
        """Saves what backward needs: in1 when in2 is a constant (kept on ctx), else ``first``
        (default in1) and in2; inputs rounded when ``prec.quantize_backward``."""
        keep = prec.quantize_backward
        kin1 = qin1 if keep else in1
        if ctx.in2_const:
            ctx.in2 = in2
            ctx.save_for_backward(kin1)
        else:
            ctx.save_for_backward(kin1 if first is None else first, qin2 if keep else in2)


def _add_or_sub(name, subtract):
    class Function(_Binary):
        @staticmethod
        def forward(ctx, in1, in2, prec=None):
            qin1, qin2 = Function._prepare(ctx, in1, in2, prec)
            return (vec_sub if subtract else vec_add)(qin1, qin2, prec=prec)

        @staticmethod
        def backward(ctx, g):
            # as microxcaling: a sum rounds its gradient, a difference passes g on to in1 unrounded
            g1 = g if subtract else vec_quantize(g, prec=ctx.prec)
            if ctx.in2_const:
                return g1, None, None
            g2 = vec_quantize(-g, prec=ctx.prec) if subtract else g1
            return (_broadcast_gradient(g1, ctx.in1_shape, ctx.prec),
                    _broadcast_gradient(g2, ctx.in2_shape, ctx.prec), None)

    Function.__name__ = Function.__qualname__ = name
    return Function


SIMDAdd = _add_or_sub("SIMDAdd", subtract=False)
SIMDSub = _add_or_sub("SIMDSub", subtract=True)


class SIMDMul(_Binary):
    @staticmethod
    def forward(ctx, in1, in2, prec=None):
        qin1, qin2 = SIMDMul._prepare(ctx, in1, in2, prec)
        SIMDMul._save(ctx, prec, in1, qin1, in2, qin2)
        return vec_mul(qin1, qin2, prec=prec)

    @staticmethod
    def backward(ctx, g):
        return SIMDMul._backward(ctx, g, vec_mul, lambda g, in1, in2, specs: (
            _broadcast_gradient(vec_mul(g, in2, prec=specs), ctx.in1_shape, specs),
            _broadcast_gradient(vec_mul(g, in1, prec=specs), ctx.in2_shape, specs)))


class SIMDDiv(_Binary):
    @staticmethod
    def forward(ctx, in1, in2, prec=None):
        qin1, qin2 = SIMDDiv._prepare(ctx, in1, in2, prec)
        out = vec_div(qin1, qin2, prec=prec)
        SIMDDiv._save(ctx, prec, in1, qin1, in2, qin2, first=out)
        return out

    @staticmethod
    def backward(ctx, g):
        def grads(g, out, in2, specs):
            g1 = vec_div(g, in2, prec=specs)  # before g2: stochastic rounding draws in this order
            g2 = vec_mul(g, vec_div(-out, in2, prec=specs), prec=specs)
            return _broadcast_gradient(g1, ctx.in1_shape, specs), _broadcast_gradient(g2, ctx.in2_shape, specs)
        return SIMDDiv._backward(ctx, g, vec_div, grads)


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


def _unary(name, op, keep, grad):
    """An autograd Function ``y = op(round(x))`` whose backward is ``grad(round(g), saved, prec)``.

    ``keep`` says what backward needs: ``"output"`` (y) or ``"input"`` (x, rounded when
    ``prec.quantize_backward``).
    """

    class Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, in1, prec=None):
            qin1 = vec_quantize(in1, prec=prec)
            out = op(qin1, prec)
            keep_for_backward(ctx, prec, out if keep == "output" else (qin1 if prec.quantize_backward else in1))
            return out

        @staticmethod
        def backward(ctx, g):
            (saved,), specs, g = saved_and_grad(ctx, g)
            return grad(g, saved, specs), None

    Function.__name__ = Function.__qualname__ = name
    return Function


SIMDSquare = _unary("SIMDSquare", lambda x, prec: vec_quantize(x**2, prec=prec), "input",
                    lambda g, x, prec: vec_mul(g, vec_mul(x, 2, prec=prec), prec=prec))
SIMDSqrt = _unary("SIMDSqrt", lambda x, prec: vec_sqrt(x, prec=prec), "output",
                  lambda g, sqrt_x, prec: vec_div(vec_mul(g, 0.5, prec=prec), sqrt_x, prec=prec))
SIMDExp = _unary("SIMDExp", lambda x, prec: vec_exp(x, prec=prec), "output",
                 lambda g, exp_x, prec: vec_mul(g, exp_x, prec=prec))
SIMDLog = _unary("SIMDLog", lambda x, prec: vec_quantize(torch.log(x), prec=prec), "input",
                 lambda g, x, prec: vec_div(g, x, prec=prec))


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
