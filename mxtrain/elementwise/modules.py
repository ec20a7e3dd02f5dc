"""Activations and softmax whose every basic operation is rounded to the recipe's elementwise precision.

Drop-in subclasses of the torch modules (same constructor arguments, no
parameters). The precision is the recipe's ``elemwise_format`` (``bfloatN`` /
``fpN``), rounded with its ``rounding``, subnormals per ``elemwise_subnormals``, the
backward pass rounded too unless ``quantize_backward=False``: the recipe of the
innermost ``mx_autocast``, or the one :func:`mxtrain.convert` pinned on the module.
With no recipe, or one without ``elemwise_format``, each module is exactly its
torch parent. The formulas are microxcaling's (``mxtrain.emulation.activations``
and ``softmax``): e.g. GELU becomes ``x * sigmoid(1.59375 (x + 0.044677734 x**3))``,
its tanh approximation in bfloat16 constants, and softmax ``exp(x - max) / sum``.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from mxtrain.autocast import get_recipe
from mxtrain.emulation import activations as _act
from mxtrain.emulation.precision import ElementwisePrecision
from mxtrain.emulation.softmax import SoftmaxFunction

__all__ = ["elementwise_precision", "ReLU", "ReLU6", "LeakyReLU", "GELU", "SiLU", "Sigmoid", "Tanh", "Softmax",
           "ELEMENTWISE_MODULES"]

@functools.lru_cache(maxsize=64)
def elementwise_precision(recipe) -> ElementwisePrecision | None:
    """The precision that rounds every elementwise op per ``recipe`` (None: no recipe or no ``elemwise_format``)."""
    if recipe is None or recipe.elemwise_format is None:
        return None
    return ElementwisePrecision(recipe.elemwise_format, rounding=recipe.elemwise_rounding,
                                subnormals=recipe.elemwise_subnormals, quantize_backward=recipe.quantize_backward)


def _precision(module):
    return elementwise_precision(module.__dict__.get("_mx_recipe") or get_recipe())


def _module(base, emulate, doc=None):
    """``base`` (a torch activation module) whose forward is ``emulate(module, x, prec)`` while an elementwise
    precision is set, else ``base``'s own."""
    def forward(self, x):
        s = _precision(self)
        return base.forward(self, x) if s is None else emulate(self, x, s)

    return type(base.__name__, (base,), {"forward": forward, "__doc__": doc, "__module__": __name__,
                                         "__qualname__": base.__name__})


ReLU = _module(nn.ReLU, lambda m, x, s: _act.ReLUFunction.apply(x, m.inplace, s, None))
ReLU6 = _module(nn.ReLU6, lambda m, x, s: _act.ReLU6Function.apply(x, m.inplace, s, None))
LeakyReLU = _module(nn.LeakyReLU,
                    lambda m, x, s: _act.LeakyReLUFunction.apply(x, m.negative_slope, m.inplace, s, None))
GELU = _module(nn.GELU, lambda m, x, s: _act.GELUFunction.apply(x, s, False, None),
               "With elementwise precision on: microxcaling's sigmoid form of the tanh approximation (either "
               "``approximate``).")
SiLU = _module(nn.SiLU, lambda m, x, s: _act.SiLUFunction.apply(x, m.inplace, s, None))
Sigmoid = _module(nn.Sigmoid, lambda m, x, s: _act.SigmoidFunction.apply(x, s, None))
Tanh = _module(nn.Tanh, lambda m, x, s: _act.TanhFunction.apply(x, s, None))


class Softmax(nn.Softmax):
    def forward(self, x):
        s = _precision(self)
        if s is None:
            return super().forward(x)
        dim = self.dim
        if dim is None:  # torch's legacy implicit dim
            dim = 0 if x.ndim in (0, 1, 3) else 1
        return SoftmaxFunction.apply(x, dim, s, None)


# torch module type -> its elementwise-precision replacement
ELEMENTWISE_MODULES = {nn.ReLU: ReLU, nn.ReLU6: ReLU6, nn.LeakyReLU: LeakyReLU, nn.GELU: GELU, nn.SiLU: SiLU,
                       nn.Sigmoid: Sigmoid, nn.Tanh: Tanh, nn.Softmax: Softmax}
