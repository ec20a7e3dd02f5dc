"""FP8 operands of the module GEMMs: a ``Float8RoleSpec`` (mxtrain.recipes.float8) to a ``Float8Tensor``."""

from __future__ import annotations


import torch

from mxtrain import config
from mxtrain.kernels.dispatch import quantize_float8
from mxtrain.quantization.float8 import Float8Tensor
from mxtrain.recipes.float8 import Float8RoleSpec

__all__ = ["quantize_float8_operand", "fused_float8_operands"]

# LayerNormMLP's activation / bias-gradient casts fused into the FP8 cast kernels (GPU, or the
# Triton interpreter under MXTRAIN_BACKEND=triton); MXTRAIN_FP8_FUSED_CASTS=0 runs the unfused ops.


def quantize_float8_operand(t2d: torch.Tensor, spec, axes: tuple[int, ...]) -> Float8Tensor:
    """Cast ``t2d`` for the planes ``axes`` (1: rowwise, 0: the transpose) as ``spec`` says, in one call.

    Delayed scaling casts with the slot's scale from the module's state and records
    the tensor's amax there; current scaling computes the scale from ``t2d``
    (all-reduced over the spec's group); block scaling computes one per block.
    """
    if spec.scaling == "delayed":
        state = spec.state
        if state is None:
            raise RuntimeError(
                "DelayedScaling keeps amax histories per module: run it through mxtrain modules (Linear, "
                "LayerNormLinear, LayerNormMLP), not the functional mx_linear, or use Float8CurrentScaling")
        scale = state.scale_for(spec.slot, spec.fmt, t2d.device, source=t2d)
        q = quantize_float8(t2d, spec.fmt, axes=axes, scale=scale)
        state.record(spec.slot, q.amax)
        return q
    return quantize_float8(t2d, spec.fmt, axes=axes, block=spec.block, power_of_2_scales=spec.power_of_2_scales,
                           amax_epsilon=spec.amax_epsilon, amax_reduction_group=spec.amax_reduction_group)


def fused_float8_operands(src: torch.Tensor, specs_axes, *, act: str | None = None, grad: torch.Tensor | None = None,
                          dbias: bool = False):
    """FP8 operands of ``act(src)`` / ``grad * act'(src)`` / ``src`` from fused Triton casts, or None.

    ``specs_axes``: ``(spec, axis)`` uses as for ``quantize_operand`` (a None spec: unused).
    The activation (or its derivative times ``grad``) is computed inside the cast: the
    unfused path writes it, reads it for the amax and again for the cast. ``dbias`` adds
    the fp32 column sums of the source (a bias gradient) from the same pass.

    Returns ``(operands, dbias)``, or None where the fused casts do not apply (any
    use not an FP8 role with per-tensor or 128-block scales, no Triton backend for the
    device, an activation the prologue lacks); the caller then runs the unfused ops.
    """
    from mxtrain.kernels import registry

    uses = [(i, spec, axis) for i, (spec, axis) in enumerate(specs_axes) if spec is not None]
    settings = config.current()
    if (not settings.fp8_fused_casts or not uses or src.ndim != 2
            or src.dtype not in (torch.float32, torch.bfloat16, torch.float16)
            or (torch.compiler.is_compiling() and not settings.compile_fused_sources)):
        return None  # compiled: the activation op, then the cast op (fullgraph; see compile_fused_sources)
    if any(not isinstance(spec, Float8RoleSpec) or spec.fmt is None
           or (spec.block is not None and spec.block not in ((1, 128), (128, 128)))
           or (spec.scaling == "delayed" and (spec.state is None or spec.state.fresh(spec.slot)))
           for _, spec, _ in uses):  # a fresh delayed slot's scale needs the cast tensor's amax first
        return None
    try:
        if not registry.walks("float8_quantize", src.device, "triton"):  # the fused casts are Triton's
            return None
        from mxtrain.kernels.float8_cast import (
            FUSED_ACTIVATION_GRADS, FUSED_ACTIVATIONS, block_cast_float8, tensor_cast_float8,
        )
    except (ImportError, RuntimeError):
        return None
    if act is not None and act not in (FUSED_ACTIVATIONS if grad is None else FUSED_ACTIVATION_GRADS):
        return None
    groups: dict = {}
    for i, spec, axis in uses:
        groups.setdefault(spec, []).append((i, axis % 2))
    out: list = [None] * len(specs_axes)
    bias_grad = amax = None
    for spec, members in groups.items():
        axes = {axis for _, axis in members}
        kw = dict(rowwise=1 in axes, columnwise=0 in axes, act=act, grad=grad, dbias=dbias and bias_grad is None,
                  power_of_2_scales=spec.power_of_2_scales, amax_epsilon=spec.amax_epsilon)
        if spec.block is not None:  # 128-block scales: one pass, the prologue computed once
            q, db = block_cast_float8(src, spec.fmt, spec.block, **kw)
        elif spec.scaling == "delayed":
            q, db = tensor_cast_float8(src, spec.fmt, scale=spec.state.scale_for(spec.slot, spec.fmt, src.device), **kw)
            spec.state.record(spec.slot, q.amax)
        else:
            q, db = tensor_cast_float8(src, spec.fmt, amax=amax, amax_reduction_group=spec.amax_reduction_group, **kw)
            amax = q.amax  # the source's amax: the next group's cast skips its amax pass
        bias_grad = db if db is not None else bias_grad
        for i, axis in members:
            out[i] = q.only(axis)
    return out, bias_grad
