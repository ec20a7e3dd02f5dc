"""Shared forward/backward of BatchNorm, LayerNorm and GroupNorm, every step rounded (microxcaling's order).

Forward: ``mean = sum(x)/n``; ``shift = x - mean``; ``var = sum(shift*shift)/n``;
``std_inv = 1/sqrt(var + eps)``; ``norm = shift*std_inv``; ``out = w*norm + b``,
each operation rounded to the elementwise precision. Backward follows the same
three-term formula as microxcaling (and, for LayerNorm, DeepSpeed's variant).
"""

from __future__ import annotations

from mxtrain.emulation.vector_ops import (vec_add, vec_div, vec_mul, vec_quantize, vec_recip, vec_reduce_mean,
                                          vec_reduce_sum, vec_sqrt, vec_sub)

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


def _weighted_grad(grad_output, axes, weight, prec, groups, weight_axis):
    """``(axes, dx_norm, orig_shape)``: ``grad_output * weight`` rounded and viewed in groups, the axes to
    reduce over, and the shape to view the input gradient back to (None without groups)."""
    axes = _axes_list(axes)
    w_shape = _w_shape(grad_output, weight_axis)
    orig_shape = None
    if groups:
        orig_shape, grouped_shape = _group_shape(grad_output, axes[0], groups)
        axes = [a + 1 for a in axes]
    if w_shape is not None:
        weight = weight.view(w_shape)
    dx_norm = vec_mul(grad_output, weight, prec=prec)
    if groups:
        dx_norm = dx_norm.view(grouped_shape)
    return axes, dx_norm, orig_shape


def _norm_backward(grad_output, axes, weight, x_shift, x_std_inv, prec, groups=None, weight_axis=None):
    """Gradient with respect to the input of BatchNorm / GroupNorm."""
    axes, dx_norm, orig_shape = _weighted_grad(grad_output, axes, weight, prec, groups, weight_axis)
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
    return dx if orig_shape is None else dx.view(orig_shape)


def _norm_backward_LN(grad_output, axes, weight, x_norm, x_var, prec, groups=None, weight_axis=None):
    """Gradient with respect to the input of LayerNorm (from the normalized x and var + eps)."""
    axes, dx_norm, orig_shape = _weighted_grad(grad_output, axes, weight, prec, groups, weight_axis)
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
    return dx if orig_shape is None else dx.view(orig_shape)


def _rounded_affine_inputs(x, weight, bias, prec):
    """``x``, ``weight`` and ``bias`` rounded to ``prec`` (in that order)."""
    return vec_quantize(x, prec=prec), vec_quantize(weight, prec=prec), vec_quantize(bias, prec=prec)


def _affine_grads(grad_output, x_norm, sum_axes, prec):
    """``(g, grad_weight, grad_bias)``: ``g`` the gradient rounded to ``prec``, ``grad_bias = sum(g)`` and
    ``grad_weight = sum(g * x_norm)`` over ``sum_axes``, each step rounded."""
    grad_output = vec_quantize(grad_output, prec=prec)
    grad_bias = vec_reduce_sum(grad_output, sum_axes, prec=prec)
    grad_weight = vec_reduce_sum(vec_mul(grad_output, x_norm, prec=prec), sum_axes, prec=prec)
    return grad_output, grad_weight, grad_bias


def _channel_norm_grads(ctx, grad_output, norm_axes, groups=None):
    """``(dx, dweight, dbias)`` of BatchNorm / GroupNorm (channels on axis 1) from what their forward kept:
    ``x_shift, x_norm, x_std_inv, weight`` and the backward precision."""
    sum_axes = [0] + list(range(2, grad_output.ndim))
    (x_shift, x_norm, x_std_inv, weight), specs = ctx.saved_tensors, ctx.prec
    grad_output, grad_weight, grad_bias = _affine_grads(grad_output, x_norm, sum_axes, specs)
    grad_input = _norm_backward(grad_output, norm_axes, weight, x_shift, x_std_inv, specs, groups=groups,
                                weight_axis=1)
    return grad_input, grad_weight, grad_bias
