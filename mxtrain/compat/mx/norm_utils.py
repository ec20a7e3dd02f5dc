"""microxcaling's ``mx.norm_utils``: :mod:`mxtrain.emulation.norm_utils` taking ``mx_specs``."""

from __future__ import annotations

from mxtrain.compat.mx.precision import precision_of
from mxtrain.emulation import norm_utils as _n

__all__ = ["_norm_forward", "_norm_backward", "_norm_backward_LN"]


def _norm_forward(x, axes, weight, bias, eps, mx_specs, groups=None, weight_axis=None, use_running_stats=False,
                  running_mean=None, running_var=None):
    return _n._norm_forward(x, axes, weight, bias, eps, precision_of(mx_specs), groups, weight_axis,
                            use_running_stats, running_mean, running_var)


def _norm_backward(grad_output, axes, weight, x_shift, x_std_inv, mx_specs, groups=None, weight_axis=None):
    return _n._norm_backward(grad_output, axes, weight, x_shift, x_std_inv, precision_of(mx_specs), groups,
                             weight_axis)


def _norm_backward_LN(grad_output, axes, weight, x_norm, x_var, mx_specs, groups=None, weight_axis=None):
    return _n._norm_backward_LN(grad_output, axes, weight, x_norm, x_var, precision_of(mx_specs), groups,
                                weight_axis)
