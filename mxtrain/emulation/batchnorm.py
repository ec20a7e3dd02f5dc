"""``BatchNorm1d/2d/3d`` and ``batch_norm`` with every step at the elementwise precision of mx_specs.

Training normalizes with the batch statistics and updates the running ones
(``(1 - momentum) * running + momentum * batch``, rounded); evaluation uses
the running statistics. The channel axis is 1 (NC...).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mxtrain.emulation.norm_utils import _norm_backward, _norm_forward
from mxtrain.emulation.specs import apply_mx_specs, get_backwards_mx_specs, mx_assert_test
from mxtrain.emulation.vector_ops import vec_add, vec_mul, vec_quantize, vec_reduce_sum

__all__ = ["BatchNormFunction", "batch_norm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d"]


class BatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, running_mean, running_var, weight, bias, is_training=False, momentum=0.1, eps=1e-5,
                mx_specs=None):
        if not is_training and (running_mean is None or running_var is None):
            raise ValueError("batch_norm in evaluation needs running_mean and running_var")
        ctx.is_training, ctx.momentum, ctx.eps = is_training, momentum, eps
        x = vec_quantize(x, mx_specs=mx_specs)
        bf_weight = vec_quantize(weight, mx_specs=mx_specs)
        bf_bias = vec_quantize(bias, mx_specs=mx_specs)
        h = x.shape[1]
        sum_axes = [0] + list(range(2, x.ndim))
        output, x_shift, x_norm, x_std_inv, x_mean, x_var = _norm_forward(
            x, sum_axes, bf_weight, bf_bias, eps, mx_specs, weight_axis=1, use_running_stats=not is_training,
            running_mean=running_mean, running_var=running_var)
        if is_training and running_mean is not None:
            t = vec_add(vec_mul((1 - momentum), running_mean, mx_specs=mx_specs),
                        vec_mul(momentum, x_mean.view(h), mx_specs=mx_specs), mx_specs=mx_specs)
            running_mean.copy_(t)
        if is_training and running_var is not None:
            t = vec_add(vec_mul((1 - momentum), running_var, mx_specs=mx_specs),
                        vec_mul(momentum, x_var.view(h), mx_specs=mx_specs), mx_specs=mx_specs)
            running_var.copy_(t)
        ctx.save_for_backward(x_shift, x_norm, x_std_inv, bf_weight if mx_specs["quantize_backprop"] else weight)
        ctx.mx_specs = get_backwards_mx_specs(mx_specs)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        specs = ctx.mx_specs
        sum_axes = [0] + list(range(2, grad_output.ndim))
        x_shift, x_norm, x_std_inv, weight = ctx.saved_tensors
        grad_output = vec_quantize(grad_output, mx_specs=specs)
        grad_bias = vec_reduce_sum(grad_output, sum_axes, mx_specs=specs)
        grad_weight = vec_reduce_sum(vec_mul(grad_output, x_norm, mx_specs=specs), sum_axes, mx_specs=specs)
        grad_input = _norm_backward(grad_output, sum_axes, weight, x_shift, x_std_inv, specs, weight_axis=1)
        return grad_input, None, None, grad_weight, grad_bias, None, None, None, None


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
