"""E8M0 scales: the shared-exponent rules and exact scale values, in pure PyTorch."""

from __future__ import annotations

import torch

from mxtrain.formats import E8M0, ElemFormat
from mxtrain.quantization.rounding import FP32_BIAS, FP32_EXP_MASK, FP32_MANT_BITS

__all__ = ["scale_values", "shared_exponent_bytes"]

FP32_MIN_NORMAL_EXP = -126


def _scale_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(2**(b-127), 2**(127-b))`` for every scale byte b, NaN at 0xFF (exact, subnormal 2**-127 included)."""
    b = torch.arange(256, dtype=torch.float64)
    up = torch.exp2(b - E8M0.bias)
    down = torch.exp2(E8M0.bias - b)
    up[E8M0.nan_code] = float("nan")
    down[E8M0.nan_code] = float("nan")
    return up.to(torch.float32).to(device), down.to(torch.float32).to(device)


_SCALE_TABLES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _tables_for(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    tables = _SCALE_TABLES.get(device)
    if tables is None:
        tables = _SCALE_TABLES[device] = _scale_tables(device)
    return tables


def scale_values(scale_bytes: torch.Tensor) -> torch.Tensor:
    """fp32 ``2**(byte - 127)`` of E8M0 scale bytes (0xFF -> NaN)."""
    return _tables_for(scale_bytes.device)[0][scale_bytes.long()]


def _inverse_scale_values(scale_bytes: torch.Tensor) -> torch.Tensor:
    """fp32 ``2**(127 - byte)``: multiplying by it divides by the scale, exactly."""
    return _tables_for(scale_bytes.device)[1][scale_bytes.long()]


def shared_exponent_bytes(amax_bits: torch.Tensor, fmt: ElemFormat, scale_mode: str) -> torch.Tensor:
    """E8M0 scale bytes from the fp32 bit patterns of block amaxes (int32, sign clear).

    ``floor``: ``floor(log2 amax) - emax``, an all-zero block taking amax = 2**-126
    (microxcaling/OCP). ``even``: amax first rounded (half up) to ``mbits``
    mantissa bits (torchao's EVEN). ``rceil``: ``ceil(log2(amax * fp32(1/max_norm)))``
    with the product in fp32 (Transformer Engine / cuBLAS). All clamp to
    [-127, 127]; a NaN or Inf amax gives 0xFF.
    """
    nonfinite = amax_bits >= FP32_EXP_MASK
    if scale_mode == "rceil":
        d = amax_bits.view(torch.float32) * torch.tensor(1.0 / fmt.max_norm, dtype=torch.float32)
        d_bits = d.view(torch.int32)
        biased = d_bits >> FP32_MANT_BITS
        mant = d_bits & ((1 << FP32_MANT_BITS) - 1)
        # subnormal d: 2**-127 < d < 2**-126 rounds up to -126, anything smaller to -127
        round_up = torch.where(biased == 0, mant > (1 << (FP32_MANT_BITS - 1)), mant != 0)
        exp = biased - FP32_BIAS + round_up.to(torch.int32)
    else:
        bits = amax_bits
        if scale_mode == "even":
            bits = bits + (1 << (FP32_MANT_BITS - 1 - fmt.mbits))
        biased = bits >> FP32_MANT_BITS
        # zero block: amax := 2**-126; fp32-subnormal amax: floor(log2) <= -127
        exp = torch.where(biased == 0, torch.where(amax_bits == 0, FP32_MIN_NORMAL_EXP, -FP32_BIAS),
                          biased - FP32_BIAS) - fmt.emax
    scale = exp.clamp_(E8M0.min_exp, E8M0.max_exp) + E8M0.bias
    return torch.where(nonfinite, E8M0.nan_code, scale).to(torch.uint8)
