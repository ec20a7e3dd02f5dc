"""Activation math of LayerNormMLP in torch ops: forward, and backward from the saved input.

Below the kernels (which compute the same functions in their prologues and fall back to these);
:mod:`mxtrain.modules.activations` adds the gated kernels on CUDA."""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
    if name in GATED:
        gate, up = h.chunk(2, dim=-1)
        return GATED[name](gate) * up
    return PLAIN[name](h)


# The backward ops autograd itself runs for these (same kernels, same bits), called directly: the
# activation is not recomputed first (a full read and write of an ffn-wide tensor saved)
_DIRECT_BACKWARD = {
    "gelu": lambda h, g: torch.ops.aten.gelu_backward(g, h, approximate="none"),
    "gelu_tanh": lambda h, g: torch.ops.aten.gelu_backward(g, h, approximate="tanh"),
    "silu": lambda h, g: torch.ops.aten.silu_backward(g, h),
}


def activation_backward(h: torch.Tensor, grad: torch.Tensor, name: str) -> torch.Tensor:
    """d act(h) / dh applied to ``grad`` (from ``h``: elementwise)."""
    direct = _DIRECT_BACKWARD.get(name)
    if direct is not None and grad.dtype == h.dtype and grad.shape == h.shape:
        return direct(h, grad)
    with torch.enable_grad():
        h_ = h.detach().requires_grad_(True)
        (dh,) = torch.autograd.grad(activation(h_, name), h_, grad)
    return dh
