"""LayerNormMLP's activations (:mod:`mxtrain.activations`), with the gated ones in one Triton pass each on CUDA
where no autograd graph is being built; :func:`gated_activation`, the same as a differentiable function."""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from mxtrain import activations as _torch_ops
from mxtrain.activations import ACTIVATIONS, GATED, PLAIN, check_activation, is_gated
from mxtrain.kernels.gated_activation import gated_activation as gated_kernel
from mxtrain.kernels.gated_activation import gated_activation_backward as gated_backward_kernel
from mxtrain.kernels.gated_activation import supports as gated_kernel_supports
from mxtrain.modules.amax_hints import record_row_maxima

__all__ = ["ACTIVATIONS", "GATED", "PLAIN", "activation", "activation_backward", "check_activation", "gated_activation",
           "is_gated"]


def activation(h: torch.Tensor, name: str) -> torch.Tensor:
    if name in GATED and h.is_cuda and not (h.requires_grad and torch.is_grad_enabled()) \
            and gated_kernel_supports(h, name) is None:
        return gated_kernel(h, name)  # one pass over h instead of two strided kernels (no autograd graph)
    return _torch_ops.activation(h, name)


def activation_backward(h: torch.Tensor, grad: torch.Tensor, name: str) -> torch.Tensor:
    """d act(h) / dh applied to ``grad`` (from ``h``: elementwise)."""
    if name in GATED and h.is_cuda and gated_kernel_supports(h, name, grad) is None:
        return gated_backward_kernel(h, grad, name)  # one pass instead of recomputing through autograd
    return _torch_ops.activation_backward(h, grad, name)


class _GatedActivationFn(torch.autograd.Function):
    # on CUDA each kernel also records its output's row maxima (mxtrain.modules.amax_hints): a per-tensor FP8
    # cast of that output (GroupedLinear's) then skips its amax pass
    @staticmethod
    def forward(ctx, h, name):
        ctx.save_for_backward(h)
        ctx.name = name
        if torch.compiler.is_compiling():  # the opaque op (eager's bits); the Triton launch is not traced
            return _torch_ops.activation(h, name)
        if h.is_cuda and gated_kernel_supports(h, name) is None:
            y, maxima = gated_kernel(h, name, row_amax=True)
            record_row_maxima(y, maxima)
            return y
        return activation(h, name)

    @staticmethod
    @once_differentiable  # the kernel's gradient has no graph: a second derivative raises rather than comes out wrong
    def backward(ctx, grad):
        (h,) = ctx.saved_tensors
        if torch.compiler.is_compiling():
            return _torch_ops.activation_backward(h, grad, ctx.name), None
        grad = grad.contiguous()
        if h.is_cuda and gated_kernel_supports(h, ctx.name, grad) is None:
            dh, maxima = gated_backward_kernel(h, grad, ctx.name, row_amax=True)
            record_row_maxima(dh, maxima)
            return dh, None
        return activation_backward(h, grad, ctx.name), None


def gated_activation(h: torch.Tensor, name: str = "swiglu") -> torch.Tensor:
    """``act(h[..., :F]) * h[..., F:]`` (``swiglu``, ``geglu``, ``geglu_tanh``, ``reglu``), differentiable.

    What ``F.silu(gate) * up`` (etc.) computes, with the same roundings; on CUDA the forward and the backward
    are one Triton pass each over ``h`` (eager torch runs two strided kernels forward and five backward, and
    the ``chunk``'s concatenation: a MoE expert layer's SwiGLU took 3.9 ms of an H100 step that way, the
    kernels 1.3 ms). Elsewhere, and while compiling, torch's ops. Results equal torch's, up to one ulp of
    ``h``'s dtype where CUDA's libm differs from the kernel's ``exp``. On CUDA the kernels also record the row
    maxima of the output and of ``dh`` (:mod:`mxtrain.modules.amax_hints`): a GroupedLinear's per-tensor FP8
    cast of either then skips its amax pass.
    First derivatives only: a second derivative (``create_graph=True``) raises.
    """
    name = check_activation(name)
    if name not in GATED:
        raise ValueError(f"gated_activation takes a gated activation ({', '.join(GATED)}), got {name!r}")
    if not isinstance(h, torch.Tensor) or not h.is_floating_point() or h.ndim < 1 or h.shape[-1] % 2:
        raise ValueError(f"gated_activation takes a floating tensor whose last dimension is even (gate and up "
                         f"halves), got {type(h).__name__} {list(getattr(h, 'shape', []))}")
    shape = h.shape
    if h.ndim == 2:  # the output itself (a reshape would be another tensor, without its recorded row maxima)
        return _GatedActivationFn.apply(h, name)
    y = _GatedActivationFn.apply(h.reshape(-1, shape[-1]), name)
    return y.reshape(*shape[:-1], shape[-1] // 2)
