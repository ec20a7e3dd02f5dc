"""What the emulation's autograd functions keep between forward and backward.

Every function saves some tensors and the backward precision ``prec.backward()``,
and its backward starts by rounding the incoming gradient to that precision.
"""

from __future__ import annotations

from mxtrain.emulation.vector_ops import vec_quantize

__all__ = ["keep_for_backward", "saved_and_grad"]


def keep_for_backward(ctx, prec, *tensors):
    """Saves ``tensors`` on ``ctx`` and records ``prec.backward()`` as ``ctx.prec``."""
    ctx.save_for_backward(*tensors)
    ctx.prec = prec.backward()


def saved_and_grad(ctx, grad_output):
    """``(saved tensors, backward precision, grad_output rounded to it)``."""
    return ctx.saved_tensors, ctx.prec, vec_quantize(grad_output, prec=ctx.prec)
