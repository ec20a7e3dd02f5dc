"""BatchNorm1d/2d/3d: drop-in torch batch norms that honour the recipe's elementwise precision.

With a recipe whose ``elemwise_format`` is set, the normalization rounds every
basic operation to that precision (microxcaling's ``BatchNorm``,
:mod:`mxtrain.emulation.batchnorm`, in fp32, result in the input's dtype), as
:class:`mxtrain.modules.groupnorm.GroupNorm` does. Two things differ from
microxcaling, to keep torch's contract:

* the running statistics are updated exactly as torch does (the same
  ``F.batch_norm`` call on the same input: unbiased variance, ``momentum``, or the
  cumulative average when ``momentum=None``; ``num_batches_tracked``), not with
  microxcaling's rounded update of the biased variance plus ``eps``;
* in evaluation (running statistics) the backward pass treats the statistics as
  constants, ``dx = dy * w / sqrt(running_var + eps)`` (each product rounded), as
  torch does; microxcaling differentiates through batch statistics there too.

``train()``/``eval()``, ``track_running_stats=False`` and ``affine=False`` behave as
in torch. Without such a recipe these are exactly the torch modules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mxtrain.modules.groupnorm import affine_params, norm_precision

__all__ = ["BatchNorm1d", "BatchNorm2d", "BatchNorm3d"]


class _BatchNormEvalFunction(torch.autograd.Function):
    """Batch norm with fixed (running) statistics, every step rounded to ``prec``."""

    @staticmethod
    def forward(ctx, x, running_mean, running_var, weight, bias, eps, prec):
        from mxtrain.emulation.norm_utils import _norm_forward
        from mxtrain.emulation.vector_ops import vec_quantize
        x = vec_quantize(x, prec=prec)
        bf_weight = vec_quantize(weight, prec=prec)
        bf_bias = vec_quantize(bias, prec=prec)
        sum_axes = [0] + list(range(2, x.ndim))
        output, _, x_norm, x_std_inv, _, _ = _norm_forward(
            x, sum_axes, bf_weight, bf_bias, eps, prec, weight_axis=1, use_running_stats=True,
            running_mean=running_mean.float(), running_var=running_var.float())
        ctx.save_for_backward(x_norm, x_std_inv, bf_weight if prec.quantize_backward else weight)
        ctx.prec = prec.backward()
        return output

    @staticmethod
    def backward(ctx, grad_output):
        from mxtrain.emulation.vector_ops import vec_mul, vec_quantize, vec_reduce_sum
        prec = ctx.prec
        x_norm, x_std_inv, weight = ctx.saved_tensors
        sum_axes = [0] + list(range(2, grad_output.ndim))
        grad_output = vec_quantize(grad_output, prec=prec)
        grad_bias = vec_reduce_sum(grad_output, sum_axes, prec=prec)
        grad_weight = vec_reduce_sum(vec_mul(grad_output, x_norm, prec=prec), sum_axes, prec=prec)
        w_shape = [1] * grad_output.ndim
        w_shape[1] = grad_output.shape[1]
        dx_norm = vec_mul(grad_output, weight.view(w_shape), prec=prec)
        grad_input = vec_mul(dx_norm, x_std_inv, prec=prec)
        return grad_input, None, None, grad_weight, grad_bias, None, None


class _BatchNormMixin:
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        prec = norm_precision()
        if prec is None:
            return super().forward(x)
        from mxtrain.emulation.batchnorm import BatchNormFunction
        self._check_input_dim(x)
        # torch's bookkeeping, step for step (nn.modules.batchnorm._BatchNorm.forward)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        bn_training = True if self.training else (self.running_mean is None and self.running_var is None)
        use_buffers = not self.training or self.track_running_stats
        running_mean = self.running_mean if use_buffers else None
        running_var = self.running_var if use_buffers else None
        weight, bias = affine_params(self, x.shape[1], x.device)
        if bn_training:
            if x.numel() // x.shape[1] == 1:
                raise ValueError(f"Expected more than 1 value per channel when training, got input size "
                                 f"{x.size()}")
            if running_mean is not None or running_var is not None:
                with torch.no_grad():  # torch's own update of the running statistics
                    F.batch_norm(x.detach(), running_mean, running_var, None, None, True, factor, self.eps)
            y = BatchNormFunction.apply(x.float(), None, None, weight, bias, True, factor, self.eps, prec)
        else:
            y = _BatchNormEvalFunction.apply(x.float(), running_mean, running_var, weight, bias, self.eps, prec)
        return y.to(x.dtype)


class BatchNorm1d(_BatchNormMixin, nn.BatchNorm1d):
    """Drop-in ``nn.BatchNorm1d`` with elementwise rounding under a recipe (see the module docstring)."""


class BatchNorm2d(_BatchNormMixin, nn.BatchNorm2d):
    """Drop-in ``nn.BatchNorm2d`` with elementwise rounding under a recipe (see the module docstring)."""


class BatchNorm3d(_BatchNormMixin, nn.BatchNorm3d):
    """Drop-in ``nn.BatchNorm3d`` with elementwise rounding under a recipe (see the module docstring)."""
