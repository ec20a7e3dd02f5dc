"""Activation functions of LayerNormMLP (forward; backward through autograd on the saved input)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

GATED = {"swiglu": F.silu, "geglu": F.gelu, "reglu": F.relu}
PLAIN = {
    "gelu": F.gelu,
    "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
    "relu": F.relu,
    "squared_relu": lambda h: torch.square(F.relu(h)),
    "silu": F.silu,
}
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


def activation_backward(h: torch.Tensor, grad: torch.Tensor, name: str) -> torch.Tensor:
    """d act(h) / dh applied to ``grad``, recomputed from ``h`` (cheap, elementwise)."""
    with torch.enable_grad():
        h_ = h.detach().requires_grad_(True)
        (dh,) = torch.autograd.grad(activation(h_, name), h_, grad)
    return dh
