"""Shared forward/backward of BatchNorm, LayerNorm and GroupNorm, every step rounded (microxcaling's order).

Forward: ``mean = sum(x)/n``; ``shift = x - mean``; ``var = sum(shift*shift)/n``;
``std_inv = 1/sqrt(var + eps)``; ``norm = shift*std_inv``; ``out = w*norm + b``,
each operation rounded to the elementwise precision. Backward follows the same
three-term formula as microxcaling (and, for LayerNorm, DeepSpeed's variant).
"""

from __future__ import annotations

from mxtrain.emulation.vector_ops import (vec_add, vec_div, vec_mul, vec_quantize, vec_recip, vec_reduce_mean,
                                          vec_sqrt, vec_sub)

__all__ = ["_norm_forward", "_norm_backward", "_norm_backward_LN"]


def _group_shape(x, axis, groups):
    """(N, C, ...) -> (N, groups, C // groups, ...)."""
    h = x.shape[axis]
    if h % groups:
        raise ValueError(f"{h} channels are not divisible into {groups} groups")
    orig, grouped = list(x.shape), list(x.shape)
    grouped[axis] = groups
    grouped.insert(axis + 1, h // groups)
    return orig, grouped


def _axes_list(axes):
    if isinstance(axes, int):
        return [axes]
    return list(axes)


def _w_shape(t, weight_axis):
    if weight_axis is None:
        return None
    shape = [1] * t.ndim
    shape[weight_axis] = t.shape[weight_axis]
    return shape


def _norm_forward(x, axes, weight, bias, eps, prec, groups=None, weight_axis=None, use_running_stats=False,
                  running_mean=None, running_var=None):
    """Returns ``(output, x_shift, x_norm, x_std_inv, x_mean, x_vare)``; weight and bias already rounded."""
    axes = _axes_list(axes)
    w_shape = _w_shape(x, weight_axis)
    if groups:
        orig_shape, grouped_shape = _group_shape(x, axes[0], groups)
        x = x.view(grouped_shape)
        axes = [a + 1 for a in axes]
    reduced_shape = list(x.shape)
    reduced_shape[0] = 1
    for i in axes:
        reduced_shape[i] = 1
    if not use_running_stats:
        x_mean = vec_reduce_mean(x, axes, keepdim=True, prec=prec)
        x_shift = vec_sub(x, x_mean, prec=prec)
        x_shift_pow2 = vec_mul(x_shift, x_shift, prec=prec)
        x_var = vec_reduce_mean(x_shift_pow2, axes, keepdim=True, prec=prec)
    else:
        if running_mean is None or running_var is None:
            raise ValueError("running_mean and running_var are needed to normalize with running statistics")
        x_mean = vec_quantize(running_mean, prec=prec).view(reduced_shape)
        x_shift = vec_sub(x, x_mean, prec=prec)
        x_var = vec_quantize(running_var, prec=prec).view(reduced_shape)
    x_vare = vec_add(x_var, eps, prec=prec)
    x_std = vec_sqrt(x_vare, prec=prec)
    x_std_inv = vec_recip(x_std, prec=prec)
    x_norm = vec_mul(x_shift, x_std_inv, prec=prec)
    if groups:
        x_norm = x_norm.view(orig_shape)
    if w_shape is not None:
        weight = weight.view(w_shape)
        bias = bias.view(w_shape)
    x_scale = vec_mul(weight, x_norm, prec=prec)
    output = vec_add(x_scale, bias, prec=prec)
    return output, x_shift, x_norm, x_std_inv, x_mean, x_vare


def _norm_backward(grad_output, axes, weight, x_shift, x_std_inv, prec, groups=None, weight_axis=None):
    """Gradient with respect to the input of BatchNorm / GroupNorm."""
    axes = _axes_list(axes)
    w_shape = _w_shape(grad_output, weight_axis)
    if groups:
        orig_shape, grouped_shape = _group_shape(grad_output, axes[0], groups)
        axes = [a + 1 for a in axes]
    if w_shape is not None:
        weight = weight.view(w_shape)
    dx_norm = vec_mul(grad_output, weight, prec=prec)
    if groups:
        dx_norm = dx_norm.view(grouped_shape)
    dx_shift = vec_mul(dx_norm, x_std_inv, prec=prec)
    dx_mean = vec_reduce_mean(-dx_shift, axes, keepdim=True, prec=prec)
    dx_std = vec_mul(dx_norm, x_shift, prec=prec)
    dx_std = vec_reduce_mean(dx_std, axes, keepdim=True, prec=prec)
    x_vare_inv = vec_mul(x_std_inv, x_std_inv, prec=prec)
    dx_std = vec_mul(dx_std, x_vare_inv, prec=prec)
    dx_std = vec_mul(dx_std, x_std_inv, prec=prec)
    dx_shift2 = vec_mul(-dx_std, x_shift, prec=prec)
    dx = vec_add(dx_shift, dx_shift2, prec=prec)
    dx = vec_add(dx, dx_mean, prec=prec)
    if groups:
        dx = dx.view(orig_shape)
    return dx


def _norm_backward_LN(grad_output, axes, weight, x_norm, x_var, prec, groups=None, weight_axis=None):
    """Gradient with respect to the input of LayerNorm (from the normalized x and var + eps)."""
    axes = _axes_list(axes)
    w_shape = _w_shape(grad_output, weight_axis)
    if groups:
        orig_shape, grouped_shape = _group_shape(grad_output, axes[0], groups)
        axes = [a + 1 for a in axes]
    if w_shape is not None:
        weight = weight.view(w_shape)
    dx_norm = vec_mul(grad_output, weight, prec=prec)
    if groups:
        dx_norm = dx_norm.view(grouped_shape)
    x_std = vec_sqrt(x_var, prec=prec)
    x_std_inv = vec_div(1.0, x_std, prec=prec)
    dx_shift = vec_mul(dx_norm, x_std_inv, prec=prec)
    dx_std_tmp = vec_mul(dx_norm, x_norm, prec=prec)
    dx_std_tmp = vec_mul(dx_std_tmp, x_std, prec=prec)
    dx_std_tmp = vec_reduce_mean(dx_std_tmp, axes, keepdim=True, prec=prec)
    x_vare_inv = vec_div(1.0, x_var, prec=prec)
    dx_std_tmp = vec_mul(dx_std_tmp, x_vare_inv, prec=prec)
    dx_shift2 = vec_mul(-dx_std_tmp, x_norm, prec=prec)
    dx = vec_add(dx_shift, dx_shift2, prec=prec)
    dx_mean = vec_reduce_mean(dx, axes, keepdim=True, prec=prec)
    dx = vec_add(dx, -dx_mean, prec=prec)
    if groups:
        dx = dx.view(orig_shape)
    return dx
