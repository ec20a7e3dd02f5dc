"""microxcaling's ``mx.groupnorm``: group norm on :mod:`mxtrain.emulation.groupnorm`.

``mx_specs`` is translated into an :class:`~mxtrain.emulation.precision.ElementwisePrecision`
(:func:`mxtrain.compat.mx.precision.precision_of`) where it enters; the ``*Function``
classes take ``mx_specs`` in place of the engine's precision, as microxcaling's do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mxtrain.compat.mx.precision import translating_function
from mxtrain.compat.mx.specs import apply_mx_specs, mx_assert_test
from mxtrain.emulation import groupnorm as _e

__all__ = ["GroupNormFunction", "GroupNorm", "group_norm"]


GroupNormFunction = translating_function(_e.GroupNormFunction)


def group_norm(x, num_groups, weight, bias, eps=1e-5, mx_specs=None):
    mx_assert_test(mx_specs)
    if mx_specs is None:
        return F.group_norm(x, num_groups, weight=weight, bias=bias, eps=eps)
    mx_specs = apply_mx_specs(mx_specs)
    return GroupNormFunction.apply(x, num_groups, weight, bias, eps, mx_specs)


class GroupNorm(torch.nn.GroupNorm):
    """``torch.nn.GroupNorm`` taking ``mx_specs`` (None: plain)."""

    def __init__(self, num_groups, num_channels, mx_specs=None, name=None, **kwargs):
        super().__init__(num_groups, num_channels, **kwargs)
        mx_assert_test(mx_specs)
        self.mx_none = mx_specs is None
        self.name = name
        self.mx_specs = apply_mx_specs(mx_specs)

    def forward(self, input):
        if self.mx_none:
            return super().forward(input)
        if not self.affine:
            raise NotImplementedError("MX GroupNorm needs affine=True")
        return group_norm(input, self.num_groups, self.weight, self.bias, self.eps, self.mx_specs)
