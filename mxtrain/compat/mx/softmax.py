"""microxcaling's ``mx.softmax``: softmax on :mod:`mxtrain.emulation.softmax`.

``mx_specs`` is translated into an :class:`~mxtrain.emulation.precision.ElementwisePrecision`
(:func:`mxtrain.compat.mx.precision.precision_of`) where it enters; the ``*Function``
classes take ``mx_specs`` in place of the engine's precision, as microxcaling's do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mxtrain.compat.mx.precision import translating_function
from mxtrain.compat.mx.specs import MxSpecsModule, apply_mx_specs, mx_assert_test
from mxtrain.emulation import softmax as _e

__all__ = ["SoftmaxFunction", "softmax", "Softmax", "LN_2_BF16"]


SoftmaxFunction = translating_function(_e.SoftmaxFunction)
LN_2_BF16 = _e.LN_2_BF16


def softmax(input, dim=-1, mx_specs=None, name=None):
    """``F.softmax(input, dim)`` rounded per ``mx_specs`` (plain when None)."""
    mx_assert_test(mx_specs)
    if mx_specs is None:
        return F.softmax(input, dim=dim)
    mx_specs = apply_mx_specs(mx_specs)
    return SoftmaxFunction.apply(input, dim, mx_specs, name)


class Softmax(MxSpecsModule, torch.nn.Softmax):
    """``torch.nn.Softmax`` taking ``mx_specs`` (None: plain)."""

    def __init__(self, dim=None, mx_specs=None, name=None):
        self._init_mx(mx_specs, name)
        super().__init__(dim)

    def forward(self, input):
        if self.mx_none:
            return super().forward(input)
        return SoftmaxFunction.apply(input, self.dim, self.mx_specs, self.name)
