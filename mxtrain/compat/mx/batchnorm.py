"""microxcaling's ``mx.batchnorm``: batch norm on :mod:`mxtrain.emulation.batchnorm`.

``mx_specs`` is translated into an :class:`~mxtrain.emulation.precision.ElementwisePrecision`
(:func:`mxtrain.compat.mx.precision.precision_of`) where it enters; the ``*Function``
classes take ``mx_specs`` in place of the engine's precision, as microxcaling's do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mxtrain.compat.mx.precision import translating_function
from mxtrain.compat.mx.specs import apply_mx_specs, mx_assert_test
from mxtrain.emulation import batchnorm as _e

__all__ = ["BatchNormFunction", "batch_norm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d"]


BatchNormFunction = translating_function(_e.BatchNormFunction)


def batch_norm(x, running_mean, running_var, weight, bias, is_training=False, momentum=0.1, eps=1e-5,
               mx_specs=None):
    mx_assert_test(mx_specs)
    if mx_specs is None:
        return F.batch_norm(x, running_mean, running_var, weight, bias, is_training, momentum, eps)
    mx_specs = apply_mx_specs(mx_specs)
    return BatchNormFunction.apply(x, running_mean, running_var, weight, bias, is_training, momentum, eps, mx_specs)


class _BatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    _ndims: tuple = ()

    def __init__(self, num_features, mx_specs=None, name=None, **kwargs):
        super().__init__(num_features, **kwargs)
        mx_assert_test(mx_specs)
        self.mx_none = mx_specs is None
        self.mx_specs = apply_mx_specs(mx_specs)
        self.name = name

    def _check_input_dim(self, input):
        if input.dim() not in self._ndims:
            raise ValueError(f"expected {' or '.join(f'{d}D' for d in self._ndims)} input (got {input.dim()}D input)")

    def forward(self, input):
        if self.mx_none:
            return super().forward(input)
        if not self.affine:
            raise NotImplementedError("MX BatchNorm needs affine=True")
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked += 1
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        bn_training = True if self.training else (self.running_mean is None and self.running_var is None)
        use_buffers = not self.training or self.track_running_stats
        return batch_norm(input, self.running_mean if use_buffers else None,
                          self.running_var if use_buffers else None, self.weight, self.bias,
                          is_training=bn_training, momentum=factor, eps=self.eps, mx_specs=self.mx_specs)


class BatchNorm1d(_BatchNorm):
    _ndims = (2, 3)


class BatchNorm2d(_BatchNorm):
    _ndims = (4,)


class BatchNorm3d(_BatchNorm):
    _ndims = (5,)
