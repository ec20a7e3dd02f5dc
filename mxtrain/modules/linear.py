"""Linear: ``nn.Linear`` whose three GEMMs run in MX under ``mx_autocast``.

Operands per GEMM (DESIGN.md): fprop ``X W^T`` with X and W blocked along K;
dgrad ``dY W`` with dY along N and W along N (columnwise); wgrad ``dY^T X``
with dY and X along tokens (columnwise). Forward quantizes W once (both planes)
and X once (both planes); backward keeps only MX bytes of X and W.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mxtrain.autocast import get_recipe
from mxtrain.kernels.dispatch import bias_grad, mx_gemm
from mxtrain.modules._common import (
    apply_module_fn, autocast_boundary, check_input, check_mx_operands, empty_batch_backward, empty_batch_forward,
    once_differentiable, recipe_generator, release_mx_operands, save_for_backward, saved_tensors,
)
from mxtrain.modules._quantizer import make_quantizers
from mxtrain.modules._recipe_state import RecipeStateMixin


def mx_linear_forward(x2d, weight, bias, q, needs_wgrad: bool, needs_dgrad: bool = False,
                      x_operands=None, w_operands=None, out=None):
    """Forward GEMM of a linear layer with the GEMM's quantizers ``q`` (``GemmQuantizers``); returns
    ``(y, x_for_wgrad, w_for_dgrad)``.

    ``x_operands``: ``(fprop, wgrad)`` operands of the input already made (by a fused norm + cast);
    ``x2d`` is then only the input's stand-in for its dtype. ``w_operands``: ``(fprop, dgrad | None)``
    operands of the weight already made (GroupedLinear casts all experts' weights at once). ``out``: where
    ``y`` is written (GroupedLinear: the expert's rows of the layer's output; see :func:`mx_gemm`).

    MX recipes: only W's rowwise plane is made here (``w_for_dgrad`` is None);
    backward quantizes W columnwise from the (saved, version-checked) parameter,
    so no weight plane is held between the passes, and under FSDP2 each phase
    gathers just the plane it needs. FP8 recipes whose fprop and dgrad weight
    specs agree cast both planes here at once and keep the dgrad one
    (:meth:`~mxtrain.modules._quantizer.Quantizer.weight_planes`).
    """
    x_row, x_col = x_operands if x_operands is not None else q.input.quantize(x2d, True, needs_wgrad)
    w_row, w_col = w_operands if w_operands is not None else q.weight.weight_planes(weight, needs_dgrad)
    y = mx_gemm(x_row, w_row, a_axis=1, b_axis=1, out_dtype=x2d.dtype, bias=bias, out=out)
    return y, (x_col if needs_wgrad else None), w_col


def mx_linear_backward(dy2d, x_col, weight, q, needs_dgrad: bool, needs_wgrad: bool,
                       dx_dtype: torch.dtype = torch.float32, dw_dtype: torch.dtype = torch.float32, *,
                       w_col=None, bias_dtype: torch.dtype | None = None, dy_operands=None, dx_out=None):
    """dgrad and wgrad GEMMs of a linear layer: ``(dx | None, dw | None, db | None)``.

    ``w_col``: the dgrad weight plane if forward kept it (else cast here from ``weight``).
    ``dy_operands``: ``(dgrad, wgrad)`` operands of ``dy2d`` already made (GroupedLinear).
    ``bias_dtype``: also return the bias gradient (sum of ``dy`` over tokens) in that dtype;
    FP8 recipes on the GPU take it from the pass that casts ``dy``. ``dx_out``: where ``dx`` is written.
    """
    fused = None if dy_operands is not None else q.grad_output.quantize_fused(
        dy2d, needs_dgrad, needs_wgrad, dbias=bias_dtype is not None)
    if dy_operands is not None:
        dy_row, dy_col = dy_operands
        db = bias_grad(dy2d) if bias_dtype is not None else None
    elif fused is not None:
        (dy_row, dy_col), db = fused
    else:
        dy_row, dy_col = q.grad_output.quantize(dy2d, needs_dgrad, needs_wgrad, at_once=True)
        db = bias_grad(dy2d) if bias_dtype is not None else None
    dx = dw = None
    if needs_dgrad:
        if w_col is None:
            w_col = q.weight.quantize(weight, False, True)[1]
        dx = mx_gemm(dy_row, w_col, a_axis=1, b_axis=0, out_dtype=dx_dtype, out=dx_out)
    if needs_wgrad:
        dw = mx_gemm(dy_col, x_col, a_axis=0, b_axis=0, out_dtype=dw_dtype)
    return dx, dw, (db.to(bias_dtype) if db is not None else None)


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, quantizers):
        if x.numel() == 0:  # zero tokens: nn.Linear's empty result
            return empty_batch_forward(ctx, (x, weight, bias), x.new_empty(*x.shape[:-1], weight.shape[0]))
        x2d = x.reshape(-1, x.shape[-1])
        q = quantizers[""]
        y, x_col, w_col = mx_linear_forward(x2d, weight, bias, q, ctx.needs_input_grad[1], ctx.needs_input_grad[0])
        # a high-precision wgrad operand (role fmt None) is the input itself: save it, so that
        # autograd version-checks it as it does nn.Linear's input; MX planes are snapshots
        x_hp = x if isinstance(x_col, torch.Tensor) else None
        save_for_backward(ctx, weight, x_hp, x_col=None if x_hp is not None else x_col, w_col=w_col)
        ctx.q = q
        ctx.x_shape, ctx.dtypes = x.shape, (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @once_differentiable("Linear")
    def backward(ctx, dy):
        if (grads := empty_batch_backward(ctx)) is not None:
            return *grads, None
        check_mx_operands(ctx, "Linear")
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dy2d = dy.reshape(-1, dy.shape[-1])
        (weight, x_hp), ops = saved_tensors(ctx)
        x_col = ops["x_col"] if x_hp is None else x_hp.reshape(-1, x_hp.shape[-1])
        dx, dw, db = mx_linear_backward(dy2d, x_col, weight, ctx.q, need_x, need_w,
                                        ctx.dtypes[0], ctx.dtypes[1], w_col=ops["w_col"],
                                        bias_dtype=ctx.dtypes[2] if need_b else None)
        release_mx_operands(ctx)
        dx = dx.reshape(ctx.x_shape) if dx is not None else None
        return dx, dw, db, None


def mx_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Functional form: MX GEMMs under ``mx_autocast``, ``F.linear`` outside it."""
    recipe = get_recipe()
    if recipe is None:
        return F.linear(x, weight, bias)
    x, no_autocast = autocast_boundary(x)
    with no_autocast:
        return _LinearFn.apply(x, weight, bias, _functional_quantizers(recipe, x.device))


_FUNCTIONAL: list = [None]  # the quantizers mx_linear built last (recipe and generator alike: reused)


def _functional_quantizers(recipe, device: torch.device):
    """The one-GEMM quantizers of the functional forms (``mx_linear``, ``mx_grouped_linear``) for ``recipe``:
    no module keeps them (nor a DelayedScaling state, which the cast then asks for)."""
    gen = recipe_generator(recipe, device)
    if torch.compiler.is_compiling():
        return make_quantizers(recipe, None, ("",), gen)
    kept = _FUNCTIONAL[0]
    if kept is None or kept.recipe is not recipe or kept.generator is not gen:
        kept = _FUNCTIONAL[0] = make_quantizers(recipe, None, ("",), gen)
    return kept


class Linear(RecipeStateMixin, nn.Linear):
    """Drop-in ``nn.Linear`` (same parameters, init and state-dict keys) with MX GEMMs under ``mx_autocast``.

    Inputs ``[..., in_features]`` of any rank; fp32/bf16/fp16. ``in_features`` or
    ``out_features`` that are not multiples of the block size are handled by
    zero-padding the last block (the reference pads; the padding never reaches the result).
    A recipe with per-module state (DelayedScaling) keeps it here (see ``_recipe_state``).
    """

    # the GEMM weights that may arrive all-gathered by FSDP2 as quantized planes (mxtrain.distributed)
    quantized_all_gather_weights = ("weight",)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_input(x, self.in_features, "Linear")
        recipe = get_recipe()
        if recipe is None:
            return F.linear(x, self.weight, self.bias)
        x, no_autocast = autocast_boundary(x)
        with no_autocast:
            return apply_module_fn(_LinearFn, (self.weight,), x, self.weight, self.bias,
                                   self.forward_quantizers(recipe, x.device))


def init_linear_(weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """``nn.Linear``'s default initialization, for fused modules that own raw weights."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        bound = 1 / math.sqrt(weight.shape[1]) if weight.shape[1] > 0 else 0
        nn.init.uniform_(bias, -bound, bound)
