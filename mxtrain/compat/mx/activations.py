"""microxcaling's ``mx.activations``: the activations on :mod:`mxtrain.emulation.activations`.

``mx_specs`` is translated into an :class:`~mxtrain.emulation.precision.ElementwisePrecision`
(:func:`mxtrain.compat.mx.precision.precision_of`) where it enters; the ``*Function``
classes take ``mx_specs`` in place of the engine's precision, as microxcaling's do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mxtrain.compat.mx.precision import translating_function
from mxtrain.compat.mx.specs import apply_mx_specs, mx_assert_test
from mxtrain.emulation import activations as _e

__all__ = ["sigmoid", "tanh", "relu", "relu6", "leaky_relu", "silu", "gelu", "Sigmoid", "Tanh", "ReLU", "ReLU6",
           "LeakyReLU", "SiLU", "GELU", "SigmoidFunction", "TanhFunction", "ReLUFunction", "ReLU6Function",
           "LeakyReLUFunction", "SiLUFunction", "GELUFunction"]


(SigmoidFunction, TanhFunction, ReLUFunction, ReLU6Function, LeakyReLUFunction, SiLUFunction, GELUFunction) = map(
    translating_function, (_e.SigmoidFunction, _e.TanhFunction, _e.ReLUFunction, _e.ReLU6Function,
                           _e.LeakyReLUFunction, _e.SiLUFunction, _e.GELUFunction))


def sigmoid(input, mx_specs=None, name=None):
    mx_assert_test(mx_specs)
    if mx_specs is None:
        return torch.sigmoid(input)
    return SigmoidFunction.apply(input, apply_mx_specs(mx_specs), name)


def tanh(input, mx_specs=None, name=None):
    mx_assert_test(mx_specs)
    if mx_specs is None:
        return torch.tanh(input)
    return TanhFunction.apply(input, apply_mx_specs(mx_specs), name)


def relu(input, inplace=False, mx_specs=None, name=None):
    mx_assert_test(mx_specs)
    if mx_specs is None:
        return F.relu(input, inplace=inplace)
    return ReLUFunction.apply(input, inplace, apply_mx_specs(mx_specs), name)


def relu6(input, inplace=False, mx_specs=None, name=None):
    mx_assert_test(mx_specs)
    if mx_specs is None:
        return F.relu6(input, inplace=inplace)
    return ReLU6Function.apply(input, inplace, apply_mx_specs(mx_specs), name)


def leaky_relu(input, negative_slope=0.01, inplace=False, mx_specs=None, name=None):
    mx_assert_test(mx_specs)
    if mx_specs is None:
        return F.leaky_relu(input, negative_slope=negative_slope, inplace=inplace)
    return LeakyReLUFunction.apply(input, negative_slope, inplace, apply_mx_specs(mx_specs), name)


def silu(input, inplace=False, mx_specs=None, name=None):
    mx_assert_test(mx_specs)
    if mx_specs is None:
        return F.silu(input, inplace=inplace)
    return SiLUFunction.apply(input, inplace, apply_mx_specs(mx_specs), name)


def gelu(input, mx_specs=None, first_order_gelu=False, approximate=None, name=None):
    """GELU; ``approximate`` is accepted for torch's signature and ignored, as in microxcaling."""
    mx_assert_test(mx_specs)
    if mx_specs is None and not first_order_gelu:
        return F.gelu(input, approximate="tanh")
    return GELUFunction.apply(input, apply_mx_specs(mx_specs), first_order_gelu, name)


def _activation_module(base, function, doc, init_args=()):
    """A torch activation module taking ``mx_specs`` (None: the torch module itself)."""

    class Module(base):
        def __init__(self, *args, mx_specs=None, name=None, **kwargs):
            super().__init__(*args, **kwargs)
            mx_assert_test(mx_specs)
            self.mx_none = mx_specs is None
            self.mx_specs = apply_mx_specs(mx_specs)
            self.name = name

        def apply_mx_specs(self, mx_specs):
            self.mx_none = mx_specs is None
            self.mx_specs = apply_mx_specs(mx_specs)

        def forward(self, input):
            if self.mx_none:
                return super().forward(input)
            return function(self, input)

    Module.__name__ = Module.__qualname__ = base.__name__
    Module.__doc__ = doc
    return Module


Sigmoid = _activation_module(torch.nn.Sigmoid, lambda m, x: SigmoidFunction.apply(x, m.mx_specs, m.name),
                             "``torch.nn.Sigmoid`` taking ``mx_specs``.")
Tanh = _activation_module(torch.nn.Tanh, lambda m, x: TanhFunction.apply(x, m.mx_specs, m.name),
                          "``torch.nn.Tanh`` taking ``mx_specs``.")
ReLU = _activation_module(torch.nn.ReLU, lambda m, x: ReLUFunction.apply(x, m.inplace, m.mx_specs, m.name),
                          "``torch.nn.ReLU(inplace=False, mx_specs=None)``.")
ReLU6 = _activation_module(torch.nn.ReLU6, lambda m, x: ReLU6Function.apply(x, m.inplace, m.mx_specs, m.name),
                           "``torch.nn.ReLU6(inplace=False, mx_specs=None)``.")
LeakyReLU = _activation_module(
    torch.nn.LeakyReLU, lambda m, x: LeakyReLUFunction.apply(x, m.negative_slope, m.inplace, m.mx_specs, m.name),
    "``torch.nn.LeakyReLU(negative_slope=0.01, inplace=False, mx_specs=None)``.")
SiLU = _activation_module(torch.nn.SiLU, lambda m, x: SiLUFunction.apply(x, m.inplace, m.mx_specs, m.name),
                          "``torch.nn.SiLU(inplace=False, mx_specs=None)``.")


class GELU(torch.nn.GELU):
    """``torch.nn.GELU`` taking ``mx_specs``; the baseline is the tanh approximation (microxcaling's)."""

    def __init__(self, mx_specs=None, first_order_gelu=False, approximate=None, name=None):
        super().__init__(approximate="tanh")
        mx_assert_test(mx_specs)
        self.mx_none = mx_specs is None and not first_order_gelu
        self.mx_specs = apply_mx_specs(mx_specs)
        self.first_order_gelu = first_order_gelu
        self.name = name

    def forward(self, input):
        if self.mx_none:
            return super().forward(input)
        return GELUFunction.apply(input, self.mx_specs, self.first_order_gelu, self.name)
