"""Convolutions (1-3 spatial dims, plain and transposed) with MX GEMM operands per the recipe's roles.

A convolution is a GEMM whose reduction runs over the input channels of a group
(and the kernel window); its dgrad runs over the output channels of a group.
Blocks run along the channel axis, as in microxcaling, but never across a group
boundary: with ``groups > 1`` each group's channels are blocked on their own
(with ``groups=1``, or channels per group a multiple of the block size, this is
the same as blocking the whole channel axis).

| GEMM | ``ConvNd`` operands, block axis | ``ConvTransposeNd`` operands, block axis |
|---|---|---|
| fprop | x along C_in (1), w ``[C_out, C_in/g, k...]`` along axis 1 | x along C_in (1), w ``[C_in, C_out/g, k...]`` along axis 0 |
| dgrad | dy along C_out (1), w along axis 0 | dy along C_out (1), w along axis 1 |
| wgrad | x and dy along the batch (axis 0) | x and dy along the batch (axis 0) |

with the roles ``fprop_input``/``fprop_weight``, ``dgrad_grad_output``/``dgrad_weight``
and ``wgrad_input``/``wgrad_grad_output``. Products and sums run in fp32 on the
dequantized operands (exact fake quantization); the result has the input's dtype.
Stride, dilation, groups, ``output_padding`` / ``output_size``, string padding
(``'same'``, ``'valid'``), every ``padding_mode`` of ``ConvNd`` (the padding is
applied before the MX GEMM) and unbatched inputs are supported. Outside
``mx_autocast`` these modules are exactly their ``torch.nn`` parents; parameters
and state-dict keys are theirs. FP8 recipes (``Float8Recipe``) are not supported
here: a conv under one raises ``NotImplementedError``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mxtrain.autocast import get_recipe
from mxtrain.modules._common import once_differentiable, recipe_generator
from mxtrain.recipes.recipe import MXRecipeBase, RoleSpec

__all__ = ["Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d", "mx_conv",
           "mx_conv_transpose", "fake_quantize_role", "unsupported_recipe"]

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def unsupported_recipe(recipe) -> str | None:
    """Why the MX convolutions cannot run ``recipe`` (None: they can)."""
    if not isinstance(recipe, MXRecipeBase):
        return (f"MX convolutions take MX recipes (MXFP8Recipe, MXRecipe...), not {type(recipe).__name__}; "
                f"FP8 recipes are supported by Linear/LayerNormLinear/LayerNormMLP only")
    return None


def fake_quantize_role(t: torch.Tensor, spec, axis: int, generator, groups: int = 1) -> torch.Tensor:
    """``t`` fake-quantized per a recipe RoleSpec along ``axis`` (fp32 result), or ``t.float()`` when the role is off.

    ``groups > 1``: ``axis`` is split into ``groups`` equal parts and no block crosses a part.
    """
    if spec is None or spec.fmt is None or t.numel() == 0:  # an empty batch has no blocks to quantize
        return t.float()
    if not isinstance(spec, RoleSpec):
        raise NotImplementedError(f"MX convolutions take MX role specs, got {type(spec).__name__} (FP8 recipes "
                                  "are supported by Linear/LayerNormLinear/LayerNormMLP only)")
    if groups > 1:
        axis %= t.ndim
        shape = t.shape
        split = t.reshape(*shape[:axis], groups, shape[axis] // groups, *shape[axis + 1:])
        return fake_quantize_role(split, spec, axis + 1, generator).reshape(shape)
    from mxtrain.emulation.rounding import FAST_ROUNDINGS, fake_quantize_mx_floor
    from mxtrain.formats import parse_format
    from mxtrain.quantization import fake_quantize_mx
    t = t.float()
    if spec.scale_mode == "floor" and spec.rounding in FAST_ROUNDINGS:
        q = fake_quantize_mx_floor(t, parse_format(spec.fmt), spec.block_size, axis, spec.rounding)
    else:
        q = fake_quantize_mx(t, spec.fmt, block_size=spec.block_size, axis=axis, scale_mode=spec.scale_mode,
                             rounding=spec.rounding, seed=generator)
    # one memory layout whatever the quantizer returned: torch's conv picks its algorithm (and
    # so its fp32 summation order) by the operands' strides
    return q.contiguous()


def _tuple(v, dims: int) -> list[int]:
    return list(v) if isinstance(v, (tuple, list)) else [int(v)] * dims


class _MXConvFn(torch.autograd.Function):
    """cfg = (dims, transposed, stride, padding, dilation, output_padding, groups), all lists but dims/groups."""

    @staticmethod
    def forward(ctx, x, weight, bias, cfg, recipe):
        dims, transposed, stride, padding, dilation, output_padding, groups = cfg
        gen = recipe_generator(recipe, x.device)
        xq = fake_quantize_role(x, recipe.role("fprop_input"), 1, gen, groups)
        b = None if bias is None else bias.float()
        if transposed:  # weight [C_in, C_out/g, k...]: the reduction runs along axis 0 within each group
            wq = fake_quantize_role(weight, recipe.role("fprop_weight"), 0, gen, groups)
            y = _CONV_T[dims](xq, wq, b, stride, padding, output_padding, groups, dilation)
        else:  # weight [C_out, C_in/g, k...]: axis 1 holds one group's input channels
            wq = fake_quantize_role(weight, recipe.role("fprop_weight"), 1, gen)
            y = _CONV[dims](xq, wq, b, stride, padding, dilation, groups)
        ctx.save_for_backward(x, weight)
        ctx.cfg, ctx.recipe, ctx.gen = cfg, recipe, gen
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y.to(x.dtype)

    @staticmethod
    @once_differentiable("convolution")
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dims, transposed, stride, padding, dilation, output_padding, groups = ctx.cfg
        recipe, gen = ctx.recipe, ctx.gen
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dx = dw = db = None

        def conv_backward(dyq, xq, wq, mask):
            return torch.ops.aten.convolution_backward(dyq, xq, wq, None, stride, padding, dilation, transposed,
                                                       output_padding, groups, mask)

        if need_x:
            dyq = fake_quantize_role(dy, recipe.role("dgrad_grad_output"), 1, gen, groups)
            if transposed:  # dgrad reduces over one group's output channels: weight axis 1
                wq = fake_quantize_role(weight, recipe.role("dgrad_weight"), 1, gen)
            else:
                wq = fake_quantize_role(weight, recipe.role("dgrad_weight"), 0, gen, groups)
            shape_only = dyq.new_empty(1).expand(x.shape)
            dx = conv_backward(dyq, shape_only, wq, (True, False, False))[0].to(ctx.dtypes[0])
        if need_w:
            dyq = fake_quantize_role(dy, recipe.role("wgrad_grad_output"), 0, gen)
            xq = fake_quantize_role(x, recipe.role("wgrad_input"), 0, gen)
            shape_only = dyq.new_empty(1).expand(weight.shape)
            dw = conv_backward(dyq, xq, shape_only, (False, True, False))[1].to(ctx.dtypes[1])
        if need_b:
            db = dy.float().sum([0] + list(range(2, dy.ndim))).to(ctx.dtypes[2])
        return dx, dw, db, None, None


def _check(x: torch.Tensor, weight: torch.Tensor, what: str) -> int:
    dims = x.ndim - 2
    if dims not in _CONV or weight.ndim != x.ndim:
        raise ValueError(f"{what} takes batched inputs (N, C, L), (N, C, H, W) or (N, C, D, H, W) with a weight of "
                         f"the same rank; got input {list(x.shape)}, weight {list(weight.shape)}")
    return dims


def _mx_conv_nd(x, weight, bias, dims, transposed, stride, padding, dilation, output_padding, groups, recipe):
    reason = unsupported_recipe(recipe)
    if reason:
        raise NotImplementedError(reason)
    cfg = (dims, transposed, _tuple(stride, dims), _tuple(padding, dims), _tuple(dilation, dims),
           _tuple(output_padding, dims), int(groups))
    return _MXConvFn.apply(x, weight, bias, cfg, recipe)


def mx_conv(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """Functional MX convolution (1-3 spatial dims by ``x``'s rank): MX GEMMs under ``mx_autocast``, plain outside."""
    dims = _check(x, weight, "mx_conv")
    recipe = get_recipe()
    if recipe is None:
        return _CONV[dims](x, weight, bias, stride, padding, dilation, groups)
    if isinstance(padding, str):
        raise ValueError(f"MX convolution needs numeric padding, got padding={padding!r}")
    return _mx_conv_nd(x, weight, bias, dims, False, stride, padding, dilation, 0, groups, recipe)


def mx_conv_transpose(x, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1):
    """Functional MX transposed convolution (``F.conv_transposeNd``'s arguments), plain outside ``mx_autocast``."""
    dims = _check(x, weight, "mx_conv_transpose")
    recipe = get_recipe()
    if recipe is None:
        return _CONV_T[dims](x, weight, bias, stride, padding, output_padding, groups, dilation)
    return _mx_conv_nd(x, weight, bias, dims, True, stride, padding, dilation, output_padding, groups, recipe)


def _batched(module, x: torch.Tensor, dims: int, run):
    if x.ndim == dims + 1:  # unbatched (C, *spatial), as torch accepts
        return run(x.unsqueeze(0)).squeeze(0)
    if x.ndim != dims + 2:
        raise ValueError(f"{type(module).__name__} expects a {dims + 1}-D (unbatched) or {dims + 2}-D (batched) "
                         f"input, got shape {list(x.shape)}")
    return run(x)


class _MXConvMixin:
    _dims = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        recipe = get_recipe()
        if recipe is None:
            return super().forward(x)
        if self.padding_mode != "zeros" or isinstance(self.padding, str):  # 'same'/'valid' or non-zero padding
            mode = "constant" if self.padding_mode == "zeros" else self.padding_mode
            padding = 0
        else:
            mode, padding = None, self.padding

        def run(xb):
            if mode is not None:
                xb = F.pad(xb, self._reversed_padding_repeated_twice, mode=mode)
            return _mx_conv_nd(xb, self.weight, self.bias, self._dims, False, self.stride, padding, self.dilation,
                               0, self.groups, recipe)

        return _batched(self, x, self._dims, run)


class _MXConvTransposeMixin:
    _dims = 0

    def forward(self, x: torch.Tensor, output_size=None) -> torch.Tensor:
        recipe = get_recipe()
        if recipe is None:
            return super().forward(x, output_size)
        if self.padding_mode != "zeros":
            raise ValueError(f"Only `zeros` padding mode is supported for {type(self).__name__}")
        output_padding = self._output_padding(x, output_size, self.stride, self.padding, self.kernel_size,
                                              self._dims, self.dilation)

        def run(xb):
            return _mx_conv_nd(xb, self.weight, self.bias, self._dims, True, self.stride, self.padding,
                               self.dilation, output_padding, self.groups, recipe)

        return _batched(self, x, self._dims, run)


def _drop_in(mixin, base, dims):
    """``base`` (a torch conv class) with ``mixin``'s MX forward: same name, constructor and parameters."""
    doc = (f"Drop-in ``torch.nn.{base.__name__}`` with MX GEMM operands under ``mx_autocast`` "
           "(see the module docstring).")
    cls = type(base.__name__, (mixin, base), {"_dims": dims, "__doc__": doc, "__module__": __name__})
    cls.__qualname__ = base.__name__
    return cls


Conv1d, Conv2d, Conv3d = (
    _drop_in(_MXConvMixin, base, d) for d, base in enumerate((nn.Conv1d, nn.Conv2d, nn.Conv3d), 1))
ConvTranspose1d, ConvTranspose2d, ConvTranspose3d = (
    _drop_in(_MXConvTransposeMixin, base, d)
    for d, base in enumerate((nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d), 1))
