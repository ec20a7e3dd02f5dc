"""Elementwise precision: exact fast rounding to bfloatN / fpN and MX fake quantization on the CPU,
and elementwise-precision modules (activations, softmax, norms) for :func:`mxtrain.convert`."""

from mxtrain.emulation import rounding  # noqa: F401  (mxtrain.elementwise.rounding, its earlier home)
from mxtrain.emulation.rounding import FAST_ROUNDINGS, fake_quantize_mx_floor, round_elemwise

__all__ = ["round_elemwise", "fake_quantize_mx_floor", "FAST_ROUNDINGS"]
