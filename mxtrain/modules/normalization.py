"""LayerNorm and RMSNorm: drop-in torch norms that honour the recipe's elementwise precision.

The fused modules reuse :func:`norm_forward_stats` / :func:`norm_backward`: backward
needs the saved input and the per-row statistics (mean and rstd, 8 bytes a row), not
the norm output, which is what lets the fused modules save only MX bytes. Given the
statistics, backward runs torch's native norm backward and recomputes nothing; without
them (RMSNorm where torch has no fused backward kernel for the device) it runs the backward
formulas of torch's composite RMSNorm from the input. No autograd graph is built in backward,
and under torch.compile both directions are opaque ops (the compiled bits are eager's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mxtrain.oplib import opaque_op
from mxtrain.autocast import get_recipe
from mxtrain.modules._common import check_input, once_differentiable, round_elemwise

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def check_normalization(name: str) -> str:
    for n in NORMALIZATIONS:
        if isinstance(name, str) and name.lower() == n.lower():
            return n
    raise ValueError(f"unknown normalization {name!r}; allowed: {', '.join(NORMALIZATIONS)}")


def check_sizes_and_eps(eps, **sizes) -> None:
    """Raise ValueError unless every size is a positive int (not a bool) and ``eps`` is > 0."""
    for name, v in sizes.items():
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps!r}")


def init_norm_(module, size: int, normalization: str, eps, zero_centered_gamma: bool, device, dtype) -> None:
    """Gives a fused norm-GEMM module its norm: ``normalization`` (checked), ``eps``, ``zero_centered_gamma``,
    ``layer_norm_weight`` (zeros when zero-centered, else ones) and ``layer_norm_bias`` (LayerNorm only)."""
    module.normalization = check_normalization(normalization)
    module.eps = float(eps)
    module.zero_centered_gamma = bool(zero_centered_gamma)
    f = {"device": device, "dtype": dtype}
    module.layer_norm_weight = nn.Parameter((torch.zeros if zero_centered_gamma else torch.ones)(size, **f))
    module.layer_norm_bias = nn.Parameter(torch.zeros(size, **f)) if module.normalization == "LayerNorm" else None


def _gamma(weight, zero_centered_gamma: bool):
    """The norm's scale: ``1 + weight`` with a zero-centered gamma (in the weight's dtype), else the weight."""
    return weight + 1 if zero_centered_gamma and weight is not None else weight


def norm_forward(x, weight, bias, normalization: str, eps: float, zero_centered_gamma: bool):
    gamma = _gamma(weight, zero_centered_gamma)
    if normalization == "LayerNorm":
        return F.layer_norm(x, (x.shape[-1],), gamma, bias, eps)
    return F.rms_norm(x, (x.shape[-1],), gamma, eps)


def _has_kernel(op: str, device_type: str) -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(op, torch._C._dispatch_key_for_device(device_type))
    except (AttributeError, RuntimeError):  # no such op or key in this torch
        return False


# Whether torch has a fused RMSNorm backward kernel (aten::_fused_rms_norm_backward) for a device type:
# CUDA in recent torch, not the CPU. Looked up once (a plain dict, so torch.compile traces it as a constant).
_FUSED_RMS_BACKWARD = {t: _has_kernel("aten::_fused_rms_norm_backward", t) for t in ("cpu", "cuda")}


def _fused_rms_backward(device: torch.device) -> bool:
    return _FUSED_RMS_BACKWARD.get(device.type, False)


def norm_forward_stats(x, weight, bias, normalization: str, eps: float, zero_centered_gamma: bool):
    """``(output, stats)``: the norm of ``x`` (the same bits as :func:`norm_forward`) and the row statistics
    :func:`norm_backward` takes, ``(mean, rstd)`` as torch's native forward returns them (``mean`` None for
    RMSNorm). ``stats`` is None where backward recomputes them (RMSNorm without a fused backward).
    While compiling it is one opaque op, so the compiled forward computes eager's bits."""
    if torch.compiler.is_compiling():
        out, mean, rstd = torch.ops.mxtrain.norm_forward_stats(x, weight, bias, normalization, eps,
                                                               zero_centered_gamma)
        if normalization == "LayerNorm":
            return out, (mean, rstd)
        return out, ((None, rstd) if _fused_rms_backward(x.device) else None)
    return _norm_forward_stats(x, weight, bias, normalization, eps, zero_centered_gamma)


def _norm_forward_stats(x, weight, bias, normalization, eps, zero_centered_gamma):
    gamma = _gamma(weight, zero_centered_gamma)
    if normalization == "LayerNorm":
        out, mean, rstd = torch.native_layer_norm(x, (x.shape[-1],), gamma, bias, eps)
        return out, (mean, rstd)
    if _fused_rms_backward(x.device):
        out, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], gamma, eps)
        return out, (None, rstd)
    return F.rms_norm(x, (x.shape[-1],), gamma, eps), None


def norm_backward(x, weight, bias, grad, normalization, eps, zero_centered_gamma, needs, stats=None):
    """Gradients (dx, dweight, dbias) of the norm at ``x`` for output gradient ``grad``: the bits autograd
    of :func:`norm_forward` gives, with no graph built.

    ``stats``: the forward's ``(mean, rstd)`` (:func:`norm_forward_stats`, or a fused norm + cast kernel's,
    fp32 per row); torch's native backward runs on them. Without them a device with native kernels recomputes
    the statistics with its forward kernel; RMSNorm where torch has no fused backward (the CPU) runs the
    backward formulas of torch's composite forward (:func:`_rms_norm_backward`). While compiling it is one
    opaque op, so the compiled backward computes eager's bits."""
    needs = tuple(bool(n) for n in needs)
    if torch.compiler.is_compiling():
        mean, rstd = stats if stats is not None else (None, None)
        grads = torch.ops.mxtrain.norm_backward(x, weight, bias, grad, normalization, eps, zero_centered_gamma,
                                                list(needs), mean, rstd)
        return tuple(g if (n and t is not None) else None for g, t, n in zip(grads, (x, weight, bias), needs))
    return _norm_backward(x, weight, bias, grad, normalization, eps, zero_centered_gamma, needs, stats)


def _norm_backward(x, weight, bias, grad, normalization, eps, zero_centered_gamma, needs, stats):
    if normalization == "LayerNorm" or _fused_rms_backward(x.device):
        if stats is None:
            stats = _norm_forward_stats(x, weight, bias, normalization, eps, zero_centered_gamma)[1]
        return _native_norm_backward(x, weight, bias, grad, normalization, zero_centered_gamma, needs, stats)
    dx, dw = _rms_norm_backward(x, weight, grad, eps, zero_centered_gamma, needs[0], needs[1] and weight is not None)
    return dx, dw, None


def _native_norm_backward(x, weight, bias, grad, normalization, zero_centered_gamma, needs, stats):
    mean, rstd = stats
    k, stat_shape = x.shape[-1], (*x.shape[:-1], 1)
    gamma = _gamma(weight, zero_centered_gamma)
    need_w, need_b = needs[1] and weight is not None, needs[2] and bias is not None
    x, grad, rstd = x.contiguous(), grad.to(x.dtype).contiguous(), rstd.reshape(stat_shape)
    if normalization == "LayerNorm":
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(
            grad, x, [k], mean.reshape(stat_shape), rstd, gamma, bias, [needs[0], need_w, need_b])
    else:
        (dx, dw), db = torch.ops.aten._fused_rms_norm_backward(grad, x, [k], rstd, gamma, [needs[0], need_w]), None
    return (dx if needs[0] else None), (dw if need_w else None), (db if need_b else None)


def _rms_norm_backward(x, weight, grad, eps, zero_centered_gamma, need_x: bool, need_w: bool):
    """``(dx, dweight)`` of torch's composite RMSNorm (the CPU's) with the backward formulas autograd runs
    through it. That forward, in fp32 (``xf``, x upcast): ``r = rsqrt(mean(xf ** 2) + eps)``, ``n = xf * r``,
    ``out = (n * gamma).to(x.dtype)``; each line below is the derivative torch's autograd takes of one of those
    ops, in its order, so the result has autograd's bits (tests/modules/test_norm_activation_backward.py)."""
    k = x.shape[-1]
    xf = x.to(torch.promote_types(x.dtype, torch.float32))  # upcast as torch's opmath type
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True).add_(eps))
    g = grad.to(xf.dtype)  # the output cast's backward
    gamma = _gamma(weight, zero_centered_gamma)
    dw = dx = None
    if need_w:  # mul's backward for gamma, then summed to gamma's shape and cast to its dtype
        lead = list(range(x.ndim - 1))
        dw = (g * (xf * r)).sum(lead, keepdim=True).reshape(gamma.shape) if lead else g * (xf * r)
        dw = dw.to(weight.dtype)
    if need_x:
        dn = g * gamma if gamma is not None else g
        dr = (dn * xf).sum(-1, keepdim=True)
        da = -0.5 * dr * r.pow(3)  # rsqrt's backward: -0.5 * grad * result ** 3
        dp = da.expand(xf.shape) / k  # mean's backward
        dx = (dn * r + dp * (2.0 * xf)).to(x.dtype)  # n's and pow(., 2)'s contributions to xf
    return dx, dw


def _norm_forward_stats_parts(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                              normalization: str, eps: float, zero_centered_gamma: bool) -> list[torch.Tensor]:
    """``[out, mean, rstd]``; absent statistics come as empty tensors (an op returns no None)."""
    out, stats = _norm_forward_stats(x, weight, bias, normalization, eps, zero_centered_gamma)
    mean, rstd = stats if stats is not None else (None, None)
    return [out, *(t if t is not None else x.new_empty(0) for t in (mean, rstd))]


def _norm_backward_parts(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                         grad: torch.Tensor, normalization: str, eps: float, zero_centered_gamma: bool,
                         needs: list[bool], mean: torch.Tensor | None, rstd: torch.Tensor | None) -> list[torch.Tensor]:
    """``[dx, dweight, dbias]``; a gradient not asked for comes as an empty tensor (an op returns no None)."""
    stats = None if rstd is None else (mean, rstd)
    grads = _norm_backward(x, weight, bias, grad, normalization, eps, zero_centered_gamma, tuple(needs), stats)
    return [g if g is not None else x.new_empty(0) for g in grads]


# The fakes are the implementations run on fake tensors (each op in them has a meta kernel), so shapes,
# dtypes and strides are the real ones on every device (CPU LayerNorm keeps bf16 statistics, CUDA fp32).
# Lean ops (mxtrain.kernels._library): a compiled step calls each twice a layer.
opaque_op("mxtrain::norm_forward_stats", _norm_forward_stats_parts, fake=_norm_forward_stats_parts)
opaque_op("mxtrain::norm_backward", _norm_backward_parts, fake=_norm_backward_parts)


class _NormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, normalization, eps, zero_centered_gamma, recipe):
        ctx.cfg = (normalization, eps, zero_centered_gamma, recipe)
        out, stats = norm_forward_stats(x, weight, bias, normalization, eps, zero_centered_gamma)
        ctx.save_for_backward(x, weight, bias, *(stats or ()))
        return round_elemwise(out, recipe)

    @staticmethod
    @once_differentiable("LayerNorm / RMSNorm")
    def backward(ctx, grad):
        x, weight, bias, *stats = ctx.saved_tensors
        normalization, eps, zc, recipe = ctx.cfg
        dx, dw, db = norm_backward(x, weight, bias, grad, normalization, eps, zc, ctx.needs_input_grad[:3],
                                   stats or None)
        return (round_elemwise(dx, recipe) if dx is not None else None), dw, db, None, None, None, None


class _Norm(nn.Module):
    normalization = "LayerNorm"

    def __init__(self, normalized_shape: int, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, zero_centered_gamma: bool = False, device=None, dtype=None):
        super().__init__()
        if isinstance(normalized_shape, (tuple, list)):
            if len(normalized_shape) != 1:
                raise ValueError(f"{type(self).__name__} normalizes the last dimension only; "
                                 f"got normalized_shape={tuple(normalized_shape)}")
            normalized_shape = normalized_shape[0]
        if not isinstance(normalized_shape, int) or normalized_shape <= 0:
            raise ValueError(f"normalized_shape must be a positive int, got {normalized_shape!r}")
        if not eps > 0:
            raise ValueError(f"eps must be > 0, got {eps!r}")
        self.normalized_shape = (normalized_shape,)
        self.eps = float(eps)
        self.zero_centered_gamma = bool(zero_centered_gamma)
        factory = {"device": device, "dtype": dtype}
        if elementwise_affine:
            init = torch.zeros if zero_centered_gamma else torch.ones
            self.weight = nn.Parameter(init(normalized_shape, **factory))
            has_bias = bias and self.normalization == "LayerNorm"
            self.bias = nn.Parameter(torch.zeros(normalized_shape, **factory)) if has_bias else None
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_input(x, self.normalized_shape[0], type(self).__name__)
        recipe = get_recipe()
        if recipe is None or recipe.elemwise_format is None:
            return norm_forward(x, self.weight, self.bias, self.normalization, self.eps, self.zero_centered_gamma)
        return _NormFn.apply(x, self.weight, self.bias, self.normalization, self.eps,
                             self.zero_centered_gamma, recipe)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape[0]}, eps={self.eps}"
                + (", zero_centered_gamma=True" if self.zero_centered_gamma else ""))


class LayerNorm(_Norm):
    """``nn.LayerNorm`` over the last dimension (same state-dict keys ``weight``/``bias``)."""

    normalization = "LayerNorm"


class RMSNorm(_Norm):
    """``nn.RMSNorm`` over the last dimension (same state-dict key ``weight``)."""

    normalization = "RMSNorm"

    def __init__(self, normalized_shape: int, eps: float = 1e-6, elementwise_affine: bool = True,
                 zero_centered_gamma: bool = False, device=None, dtype=None):
        super().__init__(normalized_shape, eps, elementwise_affine, False, zero_centered_gamma, device, dtype)
