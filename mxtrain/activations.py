"""Activation math of LayerNormMLP in torch ops: forward, and backward from the saved input.

Below the kernels (which compute the same functions in their prologues and fall back to these);
:mod:`mxtrain.modules.activations` adds the gated kernels on CUDA."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mxtrain.oplib import opaque_op

PLAIN = {
    "gelu": F.gelu,
    "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
    "relu": F.relu,
    "squared_relu": lambda h: torch.square(F.relu(h)),
    "silu": F.silu,
}
# a gated activation is act(first half) * second half; the act of its gate, by name
GATE_ACTIVATION = {"swiglu": "silu", "geglu": "gelu", "reglu": "relu",
                   "geglu_tanh": "gelu_tanh"}  # Gemma's MLP (gelu_pytorch_tanh)
GATED = {name: PLAIN[gate] for name, gate in GATE_ACTIVATION.items()}
ACTIVATIONS = tuple(PLAIN) + tuple(GATED)


def check_activation(name: str) -> str:
    if not isinstance(name, str) or name.lower() not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; allowed: {', '.join(ACTIVATIONS)}")
    return name.lower()


def is_gated(name: str) -> bool:
    """Gated activations take fc1 outputs of width 2*ffn: ``act(first half) * second half``."""
    return name in GATED


def activation(h: torch.Tensor, name: str) -> torch.Tensor:
    """``act(h)``; a gated one is ``act(first half) * second half``. While compiling (no autograd graph being
    built) it is one opaque op, so the compiled forward computes eager's bits."""
    if torch.compiler.is_compiling() and not (h.requires_grad and torch.is_grad_enabled()):
        return torch.ops.mxtrain.activation(h, name)
    return _activation(h, name)


def _activation(h: torch.Tensor, name: str) -> torch.Tensor:
    if name in GATED:
        gate, up = h.chunk(2, dim=-1)
        return GATED[name](gate) * up
    return PLAIN[name](h)


# The backward op autograd runs for each plain activation, called directly (same kernels, same bits):
# d act(h)/dh applied to the gradient g. relu's derivative reads relu(h) > 0, which is h > 0 (NaN and -0.0
# included); squared_relu is relu then pow(., 2), whose backward is g * (2 * relu(h)) then relu's.
_PLAIN_BACKWARD = {
    "gelu": lambda h, g: torch.ops.aten.gelu_backward(g, h, approximate="none"),
    "gelu_tanh": lambda h, g: torch.ops.aten.gelu_backward(g, h, approximate="tanh"),
    "silu": lambda h, g: torch.ops.aten.silu_backward(g, h),
    "relu": lambda h, g: torch.ops.aten.threshold_backward(g, h, 0),
    "squared_relu": lambda h, g: _squared_relu_backward(h, g),
}


def _squared_relu_backward(h, g):
    r = torch.relu(h)
    return torch.ops.aten.threshold_backward(g * (2.0 * r), r, 0)


def activation_backward(h: torch.Tensor, grad: torch.Tensor, name: str) -> torch.Tensor:
    """d act(h) / dh applied to ``grad`` (elementwise, from ``h``): the bits autograd of :func:`activation` gives.

    Written with the backward ops autograd runs (no graph is built or recomputed): a gated one's gradient is
    ``[act'(gate) applied to grad * up, grad * act(gate)]``. ``grad`` must have ``act(h)``'s shape; another
    floating dtype is cast to ``h``'s first, as autograd does. While compiling it is one opaque op, so the
    compiled backward computes eager's bits."""
    out_shape = (*h.shape[:-1], h.shape[-1] // 2) if name in GATED else tuple(h.shape)
    if tuple(grad.shape) != out_shape:
        raise ValueError(f"activation_backward: grad must have act(h)'s shape {list(out_shape)} "
                         f"({name} of h {list(h.shape)}), got {list(grad.shape)}")
    if name not in PLAIN and name not in GATED:
        raise ValueError(f"unknown activation {name!r}; allowed: {', '.join(ACTIVATIONS)}")
    grad = grad.to(h.dtype)
    if torch.compiler.is_compiling():
        return torch.ops.mxtrain.activation_backward(h, grad, name)
    return _activation_backward(h, grad, name)


def _activation_backward(h: torch.Tensor, grad: torch.Tensor, name: str) -> torch.Tensor:
    if name not in GATED:
        return _PLAIN_BACKWARD[name](h, grad)
    gate, up = h.chunk(2, dim=-1)
    d_up = grad * PLAIN[GATE_ACTIVATION[name]](gate)
    d_gate = _PLAIN_BACKWARD[GATE_ACTIVATION[name]](gate, grad * up)
    return torch.cat([d_gate, d_up], dim=-1)


@opaque_op("mxtrain::activation")
def _activation_op(h: torch.Tensor, name: str) -> torch.Tensor:
    return _activation(h, name)


@_activation_op.register_fake
def _(h, name):
    return h.new_empty((*h.shape[:-1], h.shape[-1] // 2) if name in GATED else h.shape)


@opaque_op("mxtrain::activation_backward")
def _activation_backward_op(h: torch.Tensor, grad: torch.Tensor, name: str) -> torch.Tensor:
    return _activation_backward(h, grad, name)


@_activation_backward_op.register_fake
def _(h, grad, name):
    return torch.empty_like(h, memory_format=torch.contiguous_format)
