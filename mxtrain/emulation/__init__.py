"""Elementwise-precision emulation: bfloatN / fpN rounding, vector ops, and norms, softmax and
activations with every step rounded (microxcaling's formulas, driven by an ``mx_specs`` dict).

It sits under the kernels (it needs only :mod:`mxtrain.formats` and :mod:`mxtrain.quantization`);
:mod:`mxtrain.elementwise`, the norm modules and :mod:`mxtrain.compat.mx` build on it.
"""
