"""LayerNormMLP's activations (:mod:`mxtrain.activations`), with the gated ones in one Triton pass each on CUDA
where no autograd graph is being built."""

from __future__ import annotations

import torch

from mxtrain import activations as _torch_ops
from mxtrain.activations import ACTIVATIONS, GATED, PLAIN, check_activation, is_gated
from mxtrain.kernels.gated_activation import gated_activation, gated_activation_backward
from mxtrain.kernels.gated_activation import supports as gated_kernel_supports

__all__ = ["ACTIVATIONS", "GATED", "PLAIN", "activation", "activation_backward", "check_activation", "is_gated"]


def activation(h: torch.Tensor, name: str) -> torch.Tensor:
    if name in GATED and h.is_cuda and not (h.requires_grad and torch.is_grad_enabled()) \
            and gated_kernel_supports(h, name) is None:
        return gated_activation(h, name)  # one pass over h instead of two strided kernels (no autograd graph)
    return _torch_ops.activation(h, name)


def activation_backward(h: torch.Tensor, grad: torch.Tensor, name: str) -> torch.Tensor:
    """d act(h) / dh applied to ``grad`` (from ``h``: elementwise)."""
    if name in GATED and h.is_cuda and gated_kernel_supports(h, name, grad) is None:
        return gated_activation_backward(h, grad, name)  # one pass instead of recomputing through autograd
    return _torch_ops.activation_backward(h, grad, name)
