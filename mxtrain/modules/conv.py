"""Conv1d / Conv2d with MX GEMM operands per the recipe's roles, under ``mx_autocast``.

A convolution is a GEMM whose reduction runs over the input channels (and the
kernel window). Blocks run along the channel axis, as in microxcaling:

| GEMM | operands and block axis |
|---|---|
| fprop ``y = conv(x, w)`` | x along C_in (axis 1), w along C_in/groups (axis 1) |
| dgrad ``dx = conv_transpose(dy, w)`` | dy along C_out (axis 1), w along C_out (axis 0) |
| wgrad ``dw = conv_weight(x, dy)`` | x and dy along the batch (axis 0) |

with the roles ``fprop_input``/``fprop_weight``, ``dgrad_grad_output``/``dgrad_weight``
and ``wgrad_input``/``wgrad_grad_output``. Products and sums run in fp32 on the
dequantized operands (exact fake quantization); the result has the input's dtype.
Outside ``mx_autocast`` these are exactly ``torch.nn.Conv1d``/``Conv2d``; parameters
and state-dict keys are theirs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import grad as nn_grad

from mxtrain.autocast import get_recipe
from mxtrain.modules._common import recipe_generator

__all__ = ["Conv1d", "Conv2d", "mx_conv"]

_CONV = {1: F.conv1d, 2: F.conv2d}
_GRAD_INPUT = {1: nn_grad.conv1d_input, 2: nn_grad.conv2d_input}
_GRAD_WEIGHT = {1: nn_grad.conv1d_weight, 2: nn_grad.conv2d_weight}


def fake_quantize_role(t: torch.Tensor, spec, axis: int, generator) -> torch.Tensor:
    """``t`` fake-quantized per a recipe RoleSpec along ``axis`` (fp32 result), or ``t.float()`` when the role is off."""
    if spec is None or spec.fmt is None:
        return t.float()
    from mxtrain.elementwise.rounding import FAST_ROUNDINGS, fake_quantize_mx_floor
    from mxtrain.formats import parse_format
    from mxtrain.quantization import fake_quantize_mx
    t = t.float()
    if spec.scale_mode == "floor" and spec.rounding in FAST_ROUNDINGS:
        return fake_quantize_mx_floor(t, parse_format(spec.fmt), spec.block_size, axis, spec.rounding)
    return fake_quantize_mx(t, spec.fmt, block_size=spec.block_size, axis=axis, scale_mode=spec.scale_mode,
                            rounding=spec.rounding, seed=generator)


class _MXConvFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups, recipe, dims):
        gen = recipe_generator(recipe, x.device)
        xq = fake_quantize_role(x, recipe.role("fprop_input"), 1, gen)
        wq = fake_quantize_role(weight, recipe.role("fprop_weight"), 1, gen)
        y = _CONV[dims](xq, wq, None if bias is None else bias.float(), stride, padding, dilation, groups)
        ctx.save_for_backward(x, weight)
        ctx.cfg = (stride, padding, dilation, groups, dims)
        ctx.recipe, ctx.gen = recipe, gen
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        stride, padding, dilation, groups, dims = ctx.cfg
        recipe, gen = ctx.recipe, ctx.gen
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dx = dw = db = None
        if need_x:
            dyq = fake_quantize_role(dy, recipe.role("dgrad_grad_output"), 1, gen)
            wq = fake_quantize_role(weight, recipe.role("dgrad_weight"), 0, gen)
            dx = _GRAD_INPUT[dims](x.shape, wq, dyq, stride=stride, padding=padding, dilation=dilation,
                                   groups=groups).to(ctx.dtypes[0])
        if need_w:
            dyq = fake_quantize_role(dy, recipe.role("wgrad_grad_output"), 0, gen)
            xq = fake_quantize_role(x, recipe.role("wgrad_input"), 0, gen)
            dw = _GRAD_WEIGHT[dims](xq, weight.shape, dyq, stride=stride, padding=padding, dilation=dilation,
                                    groups=groups).to(ctx.dtypes[1])
        if need_b:
            db = dy.float().sum([0] + list(range(2, dy.ndim))).to(ctx.dtypes[2])
        return dx, dw, db, None, None, None, None, None, None


def mx_conv(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """Functional MX convolution (1-D or 2-D by ``x``'s rank): MX GEMMs under ``mx_autocast``, plain outside."""
    dims = x.ndim - 2
    if dims not in _CONV:
        raise ValueError(f"mx_conv takes (N, C, L) or (N, C, H, W) inputs, got shape {list(x.shape)}")
    recipe = get_recipe()
    if recipe is None:
        return _CONV[dims](x, weight, bias, stride, padding, dilation, groups)
    if isinstance(padding, str):
        raise ValueError(f"MX convolution needs numeric padding, got padding={padding!r}")
    return _MXConvFn.apply(x, weight, bias, stride, padding, dilation, groups, recipe, dims)


class _MXConvMixin:
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if get_recipe() is None:
            return super().forward(x)
        if self.padding_mode != "zeros" or isinstance(self.padding, str):  # 'same'/'valid' or non-zero padding
            mode = "constant" if self.padding_mode == "zeros" else self.padding_mode
            x = F.pad(x, self._reversed_padding_repeated_twice, mode=mode)
            padding = 0
        else:
            padding = self.padding
        return mx_conv(x, self.weight, self.bias, self.stride, padding, self.dilation, self.groups)


class Conv1d(_MXConvMixin, nn.Conv1d):
    """Drop-in ``torch.nn.Conv1d`` with MX GEMM operands under ``mx_autocast`` (see the module docstring)."""


class Conv2d(_MXConvMixin, nn.Conv2d):
    """Drop-in ``torch.nn.Conv2d`` with MX GEMM operands under ``mx_autocast`` (see the module docstring)."""
