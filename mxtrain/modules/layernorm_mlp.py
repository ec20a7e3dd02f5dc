"""LayerNormMLP: norm -> fc1 -> activation -> fc2 with MX GEMMs, in one autograd function.

What backward keeps (per token, hidden H, ffn F; MXFP8 about 1.03 bytes/element):
the block input, the norm's row statistics (mean / rstd: its backward recomputes
nothing), the MX columnwise plane of the norm output (fc1's wgrad operand) and the
fc1 output ``h`` in the input dtype (the activation derivative needs it; backward
frees it once the activation gradient is cast). Weights are quantized rowwise in forward and
columnwise in backward, from the parameters, so no weight plane is held between
the passes (under FSDP2 each phase gathers only the plane it needs).
The activation output is *not* kept: backward recomputes ``act(h)`` and its
columnwise MX plane, which is bit-identical to quantizing the forward value.
On CUDA under MX recipes the norm, the activation and the activation's gradient are
computed inside the casts of their outputs (``norm_cast``, ``activation_cast``,
``activation_backward_cast``: those outputs are never written) and the operands a GEMM
uses at once come as bf16 values (docs/modules.md, "On the GPU").
Under the FP8 recipes on the GPU the activation is computed inside its FP8 cast
(``mxtrain.kernels.float8_cast``), which writes fc2's wgrad plane in the same pass:
that plane (1 byte per ffn element) is kept instead, and backward recomputes
nothing; the activation gradient and both bias gradients come out of the gradient
casts the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mxtrain.autocast import get_recipe
from mxtrain.kernels.activation_cast import activation_backward_cast, activation_cast
from mxtrain.kernels.dispatch import bias_grad, mx_gemm
from mxtrain.kernels.norm_cast import norm_cast
from mxtrain.modules._common import (
    apply_module_fn, autocast_boundary, check_input, check_mx_operands, empty_batch_backward, empty_batch_forward, free_operand,
    free_saved, once_differentiable, release_mx_operands, round_elemwise, save_for_backward, saved_tensors,
)
from mxtrain.modules._recipe_state import RecipeStateMixin
from mxtrain.modules.activations import activation, activation_backward, check_activation, is_gated
from mxtrain.modules.linear import init_linear_
from mxtrain.modules.normalization import (
    check_sizes_and_eps, init_norm_, norm_backward, norm_forward, norm_forward_stats,
)


def _activation_operands(h, act, q, recipe, rowwise: bool, columnwise: bool, at_once=False):
    """The operands of ``act(h)`` (quantizer ``q``): on CUDA from the activation + cast kernel (``act(h)``
    never written), else the activation, rounded to the recipe's elementwise precision, then quantized."""
    like = h if not is_gated(act) else h[:, : h.shape[1] // 2]
    fused = q.quantize_source(like, lambda **cast_args: activation_cast(h, act, **cast_args), rowwise, columnwise,
                              at_once)
    if fused is not None:
        return fused
    a = round_elemwise(activation(h, act), recipe)
    return q.quantize(a, rowwise, columnwise, at_once)


def _activation_grad_operands(h, da, act, q, recipe, rowwise: bool, columnwise: bool, need_bias: bool):
    """The operands of ``dh = da * act'(h)`` and, if asked, its fp32 sum over tokens (fc1's bias gradient):
    on CUDA from one pass of the gradient cast kernel (``dh`` never written), else torch's backward,
    rounded to the recipe's elementwise precision, then quantized."""
    sums = []

    def cast(**cast_args):
        # da is this backward's own temporary: dh's rowwise values take its memory (one [tokens, ffn]
        # tensor less at the backward's peak)
        r = activation_backward_cast(h, da, act, **cast_args, dbias=need_bias, reuse_grad=True)
        sums.append(r.dbias)
        return r.mx
    fused = q.quantize_source(h, cast, rowwise, columnwise, at_once=True)
    if fused is not None:
        return fused, sums[0]
    dh = round_elemwise(activation_backward(h, da, act), recipe)
    return q.quantize(dh, rowwise, columnwise, at_once=True), (bias_grad(dh) if need_bias else None)


class _LayerNormMLPFn(torch.autograd.Function):
    # Written out GEMM by GEMM (not through mx_linear_forward/backward) so that every
    # temporary (bf16 activations, MX planes) is dropped right after its last use:
    # a tensor the caller still names cannot be freed inside a callee.
    @staticmethod
    def forward(ctx, x, ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias, cfg, quantizers):
        normalization, eps, zc, act = cfg
        if x.numel() == 0:  # zero tokens: the block's empty result
            return empty_batch_forward(ctx, (x, ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias),
                                       x.new_empty(*x.shape[:-1], fc2_weight.shape[0]))
        # each GEMM's own quantizers: a recipe with per-module state keeps fc1's and fc2's tensors apart
        q1, q2, recipe = quantizers["fc1"], quantizers["fc2"], quantizers.recipe
        x2d = x.reshape(-1, x.shape[-1])
        need_ln_col = ctx.needs_input_grad[3]
        # on CUDA the norm runs inside the cast (its output is never written; fc1's operand comes as values)
        stats = None  # the norm's mean / rstd, for its backward (which then recomputes nothing)

        def ln_cast(**cast_args):
            nonlocal stats
            r = norm_cast(x2d, ln_weight, ln_bias, kind=normalization, eps=eps, zero_centered_gamma=zc, **cast_args)
            stats = (r.mean, r.rstd)
            return r.mx
        fused_ln = q1.input.quantize_source(x2d, ln_cast, True, need_ln_col)
        if fused_ln is not None:
            ln_row, ln_col = fused_ln
        else:
            ln_out, stats = norm_forward_stats(x2d, ln_weight, ln_bias, normalization, eps, zc)
            ln_row, ln_col = q1.input.quantize(round_elemwise(ln_out, recipe), True, need_ln_col)
            del ln_out
        # FP8 recipes: one cast writes the weight's fprop plane and its transpose for dgrad (same spec),
        # kept for backward (1 byte per weight element) instead of a second amax pass and cast there
        # fc1's dgrad feeds the norm's gradients; fc2's dgrad feeds those and fc1's
        w1_row, w1_col = q1.weight.weight_planes(fc1_weight, any(ctx.needs_input_grad[:3]))
        h = mx_gemm(ln_row, w1_row, a_axis=1, b_axis=1, out_dtype=x2d.dtype, bias=fc1_bias)
        del ln_row, w1_row
        # FP8 recipes on the GPU: act(h) is computed inside its cast (per-tensor scales: with its amax,
        # then cast), which also writes fc2's wgrad plane now; backward then recomputes nothing
        fuse = quantizers.fuse
        fused = q2.input.quantize_fused(h, True, ctx.needs_input_grad[5], act=act) if fuse else None
        if fused is not None:
            (a_row, a_col), _ = fused
        elif (fuse and ctx.needs_input_grad[5] and q2.input.float8
              and q2.input.col_quantized):  # quantize_backward=False: recompute, not keep bf16
            # FP8 recipes (gated activations): both planes from one act(h) and one amax, as the fused cast
            # does, rather than recomputing act(h) in backward
            a_row, a_col = _activation_operands(h, act, q2.input, recipe, True, True, at_once=True)
        else:
            a_row = _activation_operands(h, act, q2.input, recipe, True, False)[0]
            a_col = None
        w2_row, w2_col = q2.weight.weight_planes(fc2_weight, any(ctx.needs_input_grad[:5]))
        y = mx_gemm(a_row, w2_row, a_axis=1, b_axis=1, out_dtype=x2d.dtype, bias=fc2_bias)
        del a_row, w2_row
        save_for_backward(ctx, x2d, ln_weight, ln_bias, h, fc1_weight, fc2_weight, *(stats or ()),
                          ln_col=ln_col, a_col=a_col, w1_col=w1_col, w2_col=w2_col)
        ctx.cfg, ctx.quantizers, ctx.fuse = cfg, quantizers, fuse
        ctx.x_shape = x.shape
        ctx.dtypes = tuple(None if p is None else p.dtype for p in (fc1_weight, fc1_bias, fc2_weight, fc2_bias))
        return y.reshape(*x.shape[:-1], fc2_weight.shape[0])

    @staticmethod
    @once_differentiable("LayerNormMLP")
    def backward(ctx, dy):
        if (grads := empty_batch_backward(ctx)) is not None:
            return *grads, None, None
        check_mx_operands(ctx, "LayerNormMLP")
        (x2d, ln_weight, ln_bias, h, fc1_weight, fc2_weight, *stats), ops = saved_tensors(ctx)
        ln_col, w1_col, w2_col = ops.pop("ln_col"), ops.pop("w1_col"), ops.pop("w2_col")
        release_mx_operands(ctx)  # a second backward through this graph is refused from here on
        normalization, eps, zc, act = ctx.cfg
        recipe, q1, q2 = ctx.quantizers.recipe, ctx.quantizers["fc1"], ctx.quantizers["fc2"]
        need_x, need_lnw, need_lnb, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[:7]
        need_ln = need_x or need_lnw or need_lnb
        need_h = need_ln or need_w1 or need_b1
        d1, d1b, d2, d2b = ctx.dtypes
        dy2d = dy.reshape(-1, dy.shape[-1])
        fused = q2.grad_output.quantize_fused(dy2d, need_h, need_w2, dbias=need_b2) if ctx.fuse else None
        if fused is not None:  # the fc2 bias gradient comes from the cast's pass
            (dy_row, dy_col), db2 = fused
            db2 = db2.to(d2b) if need_b2 else None
        else:
            dy_row, dy_col = q2.grad_output.quantize(dy2d, need_h, need_w2, at_once=True)
            db2 = bias_grad(dy2d).to(d2b) if need_b2 else None

        dw2 = da = None
        if need_w2:  # recompute act(h) and its wgrad plane instead of having kept it (unless fused)
            a_col = ops.pop("a_col")
            if a_col is None:
                a_col = _activation_operands(h, act, q2.input, recipe, False, True, at_once=True)[1]
            dw2 = mx_gemm(dy_col, a_col, a_axis=0, b_axis=0, out_dtype=d2)
            free_operand(a_col)
            del a_col
        del dy_col
        if need_h:
            if w2_col is None:
                w2_col = q2.weight.quantize(fc2_weight, False, True)[1]
            da = mx_gemm(dy_row, w2_col, a_axis=1, b_axis=0, out_dtype=h.dtype)
            del w2_col
        del dy_row

        dx = dlnw = dlnb = dw1 = db1 = None
        if need_h:
            # FP8 per-tensor: dh = da * act'(h) and the fc1 bias gradient inside the cast, dh never written
            fused = (q1.grad_output.quantize_fused(h, need_ln, need_w1, act=act, grad=da, dbias=need_b1)
                     if ctx.fuse else None)
            if fused is not None:
                (dh_row, dh_col), db1 = fused
                db1 = db1.to(d1b) if need_b1 else None
            else:
                dh_ops, db1 = _activation_grad_operands(h, da, act, q1.grad_output, recipe, need_ln, need_w1, need_b1)
                dh_row, dh_col = dh_ops
                db1 = db1.to(d1b) if need_b1 else None
            del da
            free_saved(h)  # its last use: the fc1 wgrad and dgrad GEMMs that follow run without it
            if need_w1:
                dw1 = mx_gemm(dh_col, ln_col, a_axis=0, b_axis=0, out_dtype=d1)
            del dh_col
            free_operand(ln_col)
            ln_col = None
            if need_ln:
                if w1_col is None:
                    w1_col = q1.weight.quantize(fc1_weight, False, True)[1]
                dln = mx_gemm(dh_row, w1_col, a_axis=1, b_axis=0, out_dtype=x2d.dtype)
                del dh_row, w1_col
                dx, dlnw, dlnb = norm_backward(x2d, ln_weight, ln_bias, dln, normalization, eps, zc,
                                               (need_x, need_lnw, need_lnb), stats or None)
                if dx is not None:
                    dx = round_elemwise(dx, recipe).reshape(ctx.x_shape)
        return dx, dlnw, dlnb, dw1, db1, dw2, db2, None, None


class LayerNormMLP(RecipeStateMixin, nn.Module):
    """``norm -> fc1 -> activation -> fc2`` with MX GEMMs under ``mx_autocast``.

    Parameters (Transformer Engine's names): ``layer_norm_weight``,
    ``layer_norm_bias`` (LayerNorm only), ``fc1_weight`` ``[ffn, hidden]``
    (``[2*ffn, hidden]`` for gated activations: the first half is the gate),
    ``fc1_bias``, ``fc2_weight`` ``[hidden, ffn]``, ``fc2_bias``.

    Args:
        hidden_size, ffn_hidden_size: widths.
        bias: give fc1 and fc2 biases.
        normalization: ``"LayerNorm"`` or ``"RMSNorm"``.
        activation: gelu, gelu_tanh, relu, squared_relu, silu, swiglu, geglu, reglu, geglu_tanh.
        eps, zero_centered_gamma: as in :class:`LayerNormLinear`.
        return_bias: return ``(output_without_fc2_bias, fc2_bias)`` so the caller can fuse the bias add.
    """

    quantized_all_gather_weights = ("fc1_weight", "fc2_weight")  # as Linear's

    def __init__(self, hidden_size: int, ffn_hidden_size: int, bias: bool = True, normalization: str = "LayerNorm",
                 activation: str = "gelu", eps: float = 1e-5, zero_centered_gamma: bool = False,
                 return_bias: bool = False, device=None, dtype=None):
        super().__init__()
        check_sizes_and_eps(eps, hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size)
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        init_norm_(self, hidden_size, normalization, eps, zero_centered_gamma, device, dtype)
        self.activation = check_activation(activation)
        self.return_bias = bool(return_bias)
        f = {"device": device, "dtype": dtype}
        fc1_out = 2 * ffn_hidden_size if is_gated(self.activation) else ffn_hidden_size
        self.fc1_weight = nn.Parameter(torch.empty(fc1_out, hidden_size, **f))
        self.fc1_bias = nn.Parameter(torch.empty(fc1_out, **f)) if bias else None
        self.fc2_weight = nn.Parameter(torch.empty(hidden_size, ffn_hidden_size, **f))
        self.fc2_bias = nn.Parameter(torch.empty(hidden_size, **f)) if bias else None
        init_linear_(self.fc1_weight, self.fc1_bias)
        init_linear_(self.fc2_weight, self.fc2_bias)

    def forward(self, x: torch.Tensor):
        check_input(x, self.hidden_size, "LayerNormMLP")
        recipe = get_recipe()
        fc2_bias = None if self.return_bias else self.fc2_bias
        if recipe is None:
            ln_out = norm_forward(x, self.layer_norm_weight, self.layer_norm_bias, self.normalization, self.eps,
                                  self.zero_centered_gamma)
            y = F.linear(activation(F.linear(ln_out, self.fc1_weight, self.fc1_bias), self.activation),
                         self.fc2_weight, fc2_bias)
        else:
            cfg = (self.normalization, self.eps, self.zero_centered_gamma, self.activation)
            x, no_autocast = autocast_boundary(x)
            with no_autocast:
                y = apply_module_fn(_LayerNormMLPFn, (self.fc1_weight, self.fc2_weight), x, self.layer_norm_weight,
                                    self.layer_norm_bias, self.fc1_weight, self.fc1_bias, self.fc2_weight, fc2_bias,
                                    cfg, self.forward_quantizers(recipe, x.device))
        return (y, self.fc2_bias) if self.return_bias else y

    def extra_repr(self) -> str:
        return (f"{self.hidden_size}, {self.ffn_hidden_size}, activation={self.activation}, "
                f"normalization={self.normalization}, bias={self.fc1_bias is not None}")
