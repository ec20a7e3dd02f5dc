"""GroupNorm: a drop-in ``nn.GroupNorm`` that honours the recipe's elementwise precision.

With a recipe whose ``elemwise_format`` is set (the innermost ``mx_autocast``'s, or
the one :func:`mxtrain.convert` pinned), every basic operation of the norm (mean,
shift, variance, ``1/sqrt``, scale, shift; and the backward pass's, unless
``quantize_backward=False``) is rounded to that precision with the recipe's
``rounding`` and ``elemwise_subnormals``: microxcaling's ``GroupNorm``
(:mod:`mxtrain.emulation.groupnorm`), computed in fp32 and returned in the
input's dtype. This is finer-grained than :class:`mxtrain.LayerNorm`, which
rounds only the norm's output (and input gradient). Without such a recipe it is
exactly ``nn.GroupNorm``; parameters and state-dict keys are its own.
"""

from __future__ import annotations

import torch
from torch import nn

from mxtrain.autocast import get_recipe

__all__ = ["GroupNorm", "affine_params", "norm_precision"]


def norm_precision():
    """The elementwise precision of the active recipe (None: plain torch)."""
    from mxtrain.elementwise.modules import elementwise_precision
    return elementwise_precision(get_recipe())


def affine_params(module, channels: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The module's weight and bias in fp32, or ones and zeros when it has none (``affine=False``)."""
    w, b = module.weight, module.bias
    w = torch.ones(channels, device=device) if w is None else w.float()
    b = torch.zeros(channels, device=device) if b is None else b.float()
    return w, b


class GroupNorm(nn.GroupNorm):
    """``nn.GroupNorm`` with microxcaling's elementwise rounding under a recipe (see the module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        prec = norm_precision()
        if prec is None:
            return super().forward(x)
        from mxtrain.emulation.groupnorm import GroupNormFunction
        if x.ndim < 2 or x.shape[1] != self.num_channels:
            raise ValueError(f"GroupNorm({self.num_groups}, {self.num_channels}) expects inputs of shape "
                             f"(N, {self.num_channels}, *), got {list(x.shape)}")
        weight, bias = affine_params(self, self.num_channels, x.device)
        return GroupNormFunction.apply(x.float(), self.num_groups, weight, bias, self.eps, prec, None).to(x.dtype)
