"""FP8 operands of the module GEMMs: a ``Float8RoleSpec`` (mxtrain.recipes.float8) to a ``Float8Tensor``."""

from __future__ import annotations

import torch

from mxtrain.kernels.dispatch import quantize_float8
from mxtrain.quantization.float8 import Float8Tensor

__all__ = ["quantize_float8_operand"]


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
        scale = state.scale_for(spec.slot, spec.fmt, t2d.device)
        q = quantize_float8(t2d, spec.fmt, axes=axes, scale=scale)
        state.record(spec.slot, q.amax)
        return q
    return quantize_float8(t2d, spec.fmt, axes=axes, block=spec.block, power_of_2_scales=spec.power_of_2_scales,
                           amax_epsilon=spec.amax_epsilon, amax_reduction_group=spec.amax_reduction_group)
