"""Elementwise-precision emulation: bfloatN / fpN rounding, vector ops, and norms, softmax and
activations with every step rounded (microxcaling's formulas), driven by an
:class:`ElementwisePrecision`.

It sits under the kernels (it needs only :mod:`mxtrain.formats` and :mod:`mxtrain.quantization`);
:mod:`mxtrain.elementwise` and the norm modules build the precision from a recipe,
:mod:`mxtrain.compat.mx` from microxcaling's ``mx_specs``.
"""

from mxtrain.emulation.precision import ROUNDINGS, ElementwisePrecision, round_to

__all__ = ["ElementwisePrecision", "ROUNDINGS", "round_to"]
