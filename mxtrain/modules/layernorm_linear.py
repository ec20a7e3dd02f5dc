"""LayerNormLinear: a norm (LayerNorm or RMSNorm) followed by an MX linear, fused.

Saves for backward the block input and the norm's row statistics (its backward needs
them, not its output) and the MX
columnwise plane of the norm output (the wgrad operand), not the norm output;
the weight's columnwise plane is made in backward from the parameter.
"""

from __future__ import annotations

import torch
from torch import nn

from mxtrain.autocast import get_recipe
from mxtrain.kernels.norm_cast import norm_cast
from mxtrain.modules._common import (
    apply_module_fn, autocast_boundary, check_input, check_mx_operands, empty_batch_backward, empty_batch_forward,
    once_differentiable, release_mx_operands, round_elemwise, save_for_backward, saved_tensors,
)
from mxtrain.modules._recipe_state import RecipeStateMixin
from mxtrain.modules.linear import init_linear_, mx_linear_backward, mx_linear_forward
from mxtrain.modules.normalization import (
    check_sizes_and_eps, init_norm_, norm_backward, norm_forward, norm_forward_stats,
)


class _LayerNormLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ln_weight, ln_bias, weight, bias, cfg, quantizers):
        normalization, eps, zc, return_ln = cfg
        if x.numel() == 0:  # zero tokens: the norm's and the linear's empty results
            y = empty_batch_forward(ctx, (x, ln_weight, ln_bias, weight, bias),
                                    x.new_empty(*x.shape[:-1], weight.shape[0]))
            return (y, x.new_empty(x.shape)) if return_ln else y
        q, recipe = quantizers[""], quantizers.recipe
        x2d = x.reshape(-1, x.shape[-1])
        needs_wgrad = ctx.needs_input_grad[3]
        ln_out = stats = None

        def cast(**cast_args):  # on CUDA the norm runs inside the cast of its output
            nonlocal ln_out, stats
            r = norm_cast(x2d, ln_weight, ln_bias, kind=normalization, eps=eps, zero_centered_gamma=zc,
                          return_output=return_ln, **cast_args)
            ln_out, stats = r.out, (r.mean, r.rstd)
            return r.mx
        ops = q.input.quantize_source(x2d, cast, True, needs_wgrad)
        if ops is None:
            ln_out, stats = norm_forward_stats(x2d, ln_weight, ln_bias, normalization, eps, zc)
            ln_out = round_elemwise(ln_out, recipe)
        y, ln_col, w_col = mx_linear_forward(ln_out if ln_out is not None else x2d, weight, bias, q,
                                             needs_wgrad, any(ctx.needs_input_grad[:3]), x_operands=ops)
        # the norm's mean / rstd (none saved where backward recomputes them): backward recomputes nothing
        save_for_backward(ctx, x2d, ln_weight, ln_bias, weight, *(stats or ()), ln_col=ln_col, w_col=w_col)
        ctx.cfg, ctx.q, ctx.recipe = cfg, q, recipe
        ctx.x_shape = x.shape
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        y = y.reshape(*x.shape[:-1], weight.shape[0])
        if return_ln:
            return y, ln_out.reshape(x.shape)
        return y

    @staticmethod
    @once_differentiable("LayerNormLinear")
    def backward(ctx, dy, dln_extra=None):
        if (grads := empty_batch_backward(ctx)) is not None:
            return *grads, None, None
        check_mx_operands(ctx, "LayerNormLinear")
        (x2d, ln_weight, ln_bias, weight, *stats), ops = saved_tensors(ctx)
        normalization, eps, zc, _ = ctx.cfg
        need_x, need_lnw, need_lnb, need_w, need_b = ctx.needs_input_grad[:5]
        need_ln = need_x or need_lnw or need_lnb
        dy2d = dy.reshape(-1, dy.shape[-1])
        dln, dw, db = mx_linear_backward(dy2d, ops["ln_col"], weight, ctx.q, need_ln, need_w,
                                         torch.float32, ctx.dtypes[0], w_col=ops["w_col"],
                                         bias_dtype=ctx.dtypes[1] if need_b else None)
        release_mx_operands(ctx)
        del ops
        dx = dlnw = dlnb = None
        if need_ln:
            if dln_extra is not None:
                dln = dln + dln_extra.reshape(dln.shape).float()
            dx, dlnw, dlnb = norm_backward(x2d, ln_weight, ln_bias, dln.to(x2d.dtype), normalization, eps, zc,
                                           (need_x, need_lnw, need_lnb), stats or None)
            if dx is not None:
                dx = round_elemwise(dx, ctx.recipe).reshape(ctx.x_shape)
        return dx, dlnw, dlnb, dw, db, None, None


class LayerNormLinear(RecipeStateMixin, nn.Module):
    """``norm -> linear`` with MX GEMMs under ``mx_autocast``.

    Parameters (Transformer Engine's names): ``layer_norm_weight``,
    ``layer_norm_bias`` (LayerNorm only), ``weight`` ``[out, in]``, ``bias``.

    Args:
        in_features, out_features, bias: as ``nn.Linear``.
        normalization: ``"LayerNorm"`` or ``"RMSNorm"``.
        eps: norm epsilon.
        zero_centered_gamma: the norm scale is ``1 + layer_norm_weight`` (weight initialised to 0).
        return_layernorm_output: also return the norm output (e.g. for a residual).
    """

    quantized_all_gather_weights = ("weight",)  # as Linear's

    def __init__(self, in_features: int, out_features: int, bias: bool = True, normalization: str = "LayerNorm",
                 eps: float = 1e-5, zero_centered_gamma: bool = False, return_layernorm_output: bool = False,
                 device=None, dtype=None):
        super().__init__()
        check_sizes_and_eps(eps, in_features=in_features, out_features=out_features)
        self.in_features, self.out_features = in_features, out_features
        init_norm_(self, in_features, normalization, eps, zero_centered_gamma, device, dtype)
        self.return_layernorm_output = bool(return_layernorm_output)
        f = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **f))
        self.bias = nn.Parameter(torch.empty(out_features, **f)) if bias else None
        init_linear_(self.weight, self.bias)

    def forward(self, x: torch.Tensor):
        check_input(x, self.in_features, "LayerNormLinear")
        recipe = get_recipe()
        if recipe is None:
            ln_out = norm_forward(x, self.layer_norm_weight, self.layer_norm_bias, self.normalization, self.eps,
                                  self.zero_centered_gamma)
            y = torch.nn.functional.linear(ln_out, self.weight, self.bias)
            return (y, ln_out) if self.return_layernorm_output else y
        cfg = (self.normalization, self.eps, self.zero_centered_gamma, self.return_layernorm_output)
        x, no_autocast = autocast_boundary(x)
        with no_autocast:
            return apply_module_fn(_LayerNormLinearFn, (self.weight,), x, self.layer_norm_weight,
                                   self.layer_norm_bias, self.weight, self.bias, cfg,
                                   self.forward_quantizers(recipe, x.device))

    def extra_repr(self) -> str:
        return (f"{self.in_features}, {self.out_features}, bias={self.bias is not None}, "
                f"normalization={self.normalization}, eps={self.eps}")
