"""``LayerNorm``, ``RMSNorm`` and ``layer_norm`` with every step at the elementwise precision of mx_specs.

As in microxcaling: ``LayerNorm(hidden_size, eps=1e-12, mx_specs=None)`` (eps
inside the square root; plain ``torch.nn.LayerNorm`` when ``mx_specs`` is None);
``RMSNorm`` has a weight and a bias (``out = w * x / sqrt(mean(x*x) + eps) + b``)
and always runs its own function (unrounded without specs). The arithmetic is
:mod:`mxtrain.emulation.layernorm`'s; the ``*Function`` classes take ``mx_specs`` in
place of its precision (:func:`mxtrain.compat.mx.precision.translating_function`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mxtrain.compat.mx.precision import translating_function
from mxtrain.compat.mx.specs import MxSpecsModule, apply_mx_specs, mx_assert_test
from mxtrain.emulation import layernorm as _e

__all__ = ["LayerNormFunction", "LayerNorm", "RMSNormFunction", "RMSNorm", "layer_norm"]

torch_layer_norm = F.layer_norm

LayerNormFunction, RMSNormFunction = map(translating_function, (_e.LayerNormFunction, _e.RMSNormFunction))


class LayerNorm(MxSpecsModule, torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` over the last dim taking ``mx_specs`` (default eps 1e-12, as microxcaling)."""

    def __init__(self, hidden_size, eps=1e-12, mx_specs=None, name=None, elementwise_affine=True, bias=True,
                 device=None, dtype=None):
        self._init_mx(mx_specs, name)
        super().__init__(normalized_shape=hidden_size, eps=eps, elementwise_affine=elementwise_affine, bias=bias,
                         device=device, dtype=dtype)

    def forward(self, x):
        if self.mx_none:
            return super().forward(x)
        if len(self.normalized_shape) != 1 or self.weight is None or self.bias is None:
            raise NotImplementedError("MX LayerNorm normalizes the last dim with an affine weight and bias")
        return LayerNormFunction.apply(x, self.weight, self.bias, self.eps, self.mx_specs, self.name)


class RMSNorm(MxSpecsModule, torch.nn.LayerNorm):
    """RMSNorm with weight and bias (microxcaling's); rounded per ``mx_specs``."""

    def __init__(self, hidden_size, eps=1e-12, mx_specs=None, name=None, device=None, dtype=None):
        self._init_mx(mx_specs, name)
        super().__init__(normalized_shape=hidden_size, eps=eps, device=device, dtype=dtype)

    def forward(self, x):
        return RMSNormFunction.apply(x, self.weight, self.bias, self.eps, self.mx_specs, self.name)


def layer_norm(input, normalized_shape, weight, bias, eps=1e-12, mx_specs=None, name=None):
    """``F.layer_norm`` over the last dim, rounded per ``mx_specs`` (plain when None)."""
    mx_assert_test(mx_specs)
    if mx_specs is None:
        return torch_layer_norm(input, normalized_shape, weight, bias, eps)
    mx_specs = apply_mx_specs(mx_specs)
    if tuple(normalized_shape if not isinstance(normalized_shape, int) else (normalized_shape,)) != tuple(weight.shape):
        raise ValueError(f"normalized_shape {normalized_shape} must equal the weight's shape {tuple(weight.shape)}")
    return LayerNormFunction.apply(input, weight, bias, eps, mx_specs, name)
