"""Elementwise (scale-free) fake quantization: bfloatN, fpN and the MX element formats."""

from __future__ import annotations

import torch

from mxtrain.formats import ElemFormat, parse_elemwise_format
from mxtrain.oplib import opaque_op
from mxtrain.quantization._validate import ROUNDINGS, check_choice, check_float_tensor, make_generator
from mxtrain.quantization.rounding import FP32_ABS_MASK, grid_value, round_to_grid

def quantize_elemwise(x: torch.Tensor, fmt: "str | ElemFormat", rounding: str = "even",
                      subnormals: bool = True, saturate: bool | None = None,
                      seed: "int | torch.Generator | None" = None) -> torch.Tensor:
    """Round every element of ``x`` to ``fmt`` and return it in ``x``'s dtype (fake quantization).

    Args:
        x: float32, bfloat16 or float16 tensor (bf16/fp16 are widened exactly).
        fmt: ``"bfloat16"``, ``"bfloatN"`` (8 exponent bits), ``"fpN"`` (5 exponent
            bits, ``"fp16"`` is IEEE half) or any MX element format name.
        rounding: ``"even"`` (ties to even), ``"nearest"`` (ties away from zero),
            ``"floor"`` (toward zero) or ``"stochastic"``.
        subnormals: when False, inputs below the smallest normal flush to (signed)
            zero before rounding (microxcaling's ``bfloat_subnorms=False``).
        saturate: finite results above ``max_norm`` clamp to it when True and
            become +-Inf when False. Default: Inf for formats that encode Inf
            (bfloatN, fpN, fp8_e5m2), saturation for the others.
        seed: stochastic rounding only: int seed or Generator (None: torch's global RNG).

    NaN and +-Inf inputs pass through unchanged. The result is exact: the
    nearest (per ``rounding``) value of the format, computed from the bits.
    Rounding to a format wider than ``x``'s own dtype returns ``x`` unchanged
    in value (e.g. bfloat16 input to ``"fp16"`` may still round: fp16 has fewer
    exponent bits).
    """
    check_float_tensor(x)
    fmt = parse_elemwise_format(fmt)
    rounding = check_choice(rounding, ROUNDINGS, "rounding")
    if saturate is None:
        saturate = not fmt.has_inf
    if not torch.compiler.is_compiling():  # eager: the implementation itself
        return _round_elemwise(x, fmt, rounding, subnormals, saturate, seed)
    if rounding == "stochastic" and not (seed is None or type(seed) is int):  # a Generator (or a bad seed)
        if torch.compiler.is_compiling() and isinstance(seed, torch.Generator):
            raise NotImplementedError("quantize_elemwise: stochastic rounding with a torch.Generator (a recipe "
                                      "seed) cannot be compiled; use an int seed or None, or run it eagerly")
        return _round_elemwise(x, fmt, rounding, subnormals, saturate, seed)
    return torch.ops.mxtrain.quantize_elemwise(x, fmt.name, rounding, subnormals, saturate,
                                               seed if rounding == "stochastic" else None)


# Dynamo stays out of the quantizers: inductor has miscompiled their dtype-bitcast views
# inside fused chains (NaN where eager is exact), so a compiled graph holds them as one opaque op.
@opaque_op("mxtrain::quantize_elemwise")
def _quantize_elemwise_op(x: torch.Tensor, fmt: str, rounding: str, subnormals: bool, saturate: bool,
                          seed: int | None) -> torch.Tensor:
    return _round_elemwise(x, parse_elemwise_format(fmt), rounding, subnormals, saturate, seed)


@_quantize_elemwise_op.register_fake
def _(x, fmt, rounding, subnormals, saturate, seed):
    return torch.empty_like(x)


def _round_elemwise(x: torch.Tensor, fmt: ElemFormat, rounding: str, subnormals: bool, saturate: bool,
                    seed) -> torch.Tensor:
    generator = make_generator(seed, x.device) if rounding == "stochastic" else None
    xf = x.float()
    if not subnormals and fmt.is_float:
        xf = torch.where(xf.abs() < fmt.min_norm, xf * 0.0, xf)  # keeps the sign of zero
    q, step_inv = round_to_grid(xf, fmt, rounding, generator)
    mag = grid_value(q, step_inv, fmt)
    if saturate:
        mag = mag.clamp_(max=fmt.max_norm)
    else:
        mag = torch.where(mag > fmt.max_norm, float("inf"), mag)
    out = torch.copysign(mag, xf)
    finite = (xf.view(torch.int32) & FP32_ABS_MASK) < 0x7F800000
    out = torch.where(finite, out, xf)
    return out.to(x.dtype)
