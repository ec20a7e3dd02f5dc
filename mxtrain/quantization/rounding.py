"""Exact rounding of fp32 values to an element grid, on integer bit patterns.

Everything here is exact for every fp32 input: exponents come from the bits
(never a float ``log2``), scaling is by powers of two built from bits, and the
rounding of a non-negative fp32 ``t`` to an integer uses only exact operations
(``t - floor(t)`` is exact in floating point).
"""

from __future__ import annotations

import torch

from mxtrain.formats import ElemFormat

FP32_EXP_MASK = 0x7F800000
FP32_ABS_MASK = 0x7FFFFFFF
FP32_MANT_BITS = 23
FP32_BIAS = 127


def pow2_from_int(k: torch.Tensor) -> torch.Tensor:
    """``2.0**k`` in fp32 for integer ``k`` in [-126, 127], built from the exponent bits."""
    return ((k + FP32_BIAS) << FP32_MANT_BITS).view(torch.float32)


def unbiased_exponent(mag_bits: torch.Tensor) -> torch.Tensor:
    """floor(log2|x|) for normal fp32 magnitudes; -127 for zero and fp32 subnormals."""
    return (mag_bits >> FP32_MANT_BITS) - FP32_BIAS


def round_nonneg(t: torch.Tensor, rounding: str, generator: torch.Generator | None) -> torch.Tensor:
    """Round a non-negative fp32 tensor to integers (as fp32) in the given mode, exactly."""
    if rounding == "even":
        return torch.round(t)  # IEEE round-half-to-even
    if rounding == "floor":
        return torch.floor(t)  # t >= 0, so toward zero
    fl = torch.floor(t)
    frac = t - fl  # exact
    if rounding == "nearest":
        # floor(t + 0.5) would double-round values just under 0.5 (microxcaling does)
        return fl.add_((frac >= 0.5).to(t.dtype))
    if rounding == "stochastic":
        # round up with probability frac; fp32 uniforms on a 2**-24 grid
        u = torch.rand(t.shape, generator=generator, dtype=torch.float32, device=t.device)
        return fl.add_((u < frac).to(t.dtype))
    raise ValueError(f"unknown rounding {rounding!r}")


def _mul_pow2_wide(t: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``t * 2**k`` for k in [-252, 253] in two exact steps (for 8-exponent-bit formats)."""
    k1 = k.clamp(-126, 126)
    return (t * pow2_from_int(k1)) * pow2_from_int(k - k1)


def round_to_grid(y: torch.Tensor, fmt: ElemFormat, rounding: str,
                  generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Round fp32 ``y`` to ``fmt``'s grid (no scaling, no saturation).

    Returns ``(q, e)``: ``|y|`` rounds to ``q * 2**(e - mbits)`` where ``q`` is a
    non-negative integer-valued fp32 tensor and ``e`` (int32) is the element
    exponent used (``max(floor(log2|y|), emin)``; unused for ints). For floats,
    ``q`` is at most ``2**(mbits + 1)`` (a carry into the next binade).
    Inf/NaN inputs give garbage: callers mask them.
    """
    mag = y.view(torch.int32) & FP32_ABS_MASK
    if fmt.is_int:
        t = mag.view(torch.float32) * float(2**fmt.mbits)
        return round_nonneg(t, rounding, generator), None
    e = unbiased_exponent(mag).clamp_(min=fmt.emin)
    shift = fmt.mbits - e  # t = |y| * 2**shift lies in [0, 2**(mbits+1))
    absy = mag.view(torch.float32)
    if fmt.mbits - fmt.emin > 127:  # bfloatN: 2**shift leaves the normal fp32 range
        t = _mul_pow2_wide(absy, shift)
    else:
        t = absy * pow2_from_int(shift)
    return round_nonneg(t, rounding, generator), e


def grid_value(q: torch.Tensor, e: torch.Tensor | None, fmt: ElemFormat) -> torch.Tensor:
    """The magnitude ``q * 2**(e - mbits)`` (exact; may exceed max_norm: callers saturate)."""
    if fmt.is_int:
        return q * float(2.0**-fmt.mbits)
    k = e - fmt.mbits
    if fmt.emin - fmt.mbits < -126:
        return _mul_pow2_wide(q, k)
    return q * pow2_from_int(k)


def element_codes(y: torch.Tensor, fmt: ElemFormat, rounding: str,
                  generator: torch.Generator | None) -> torch.Tensor:
    """Codes (int32, ``fmt.bits`` wide, sign included) of fp32 ``y`` rounded to ``fmt``, saturating.

    Floats: ``sign << (bits-1) | biased_exp << mbits | mantissa``; the magnitude
    code is ``((e - emin) << mbits) + q``, which carries into the exponent field
    by itself and is the subnormal code when ``e == emin`` and ``q < 2**mbits``.
    Ints: two's complement of ``+-q`` in ``bits`` bits (no negative zero).
    """
    q, e = round_to_grid(y, fmt, rounding, generator)
    negative = y.view(torch.int32) < 0
    if fmt.is_int:
        # clamp before the int cast: |y| * 2**mbits beyond int32 (or Inf) would wrap
        qi = q.clamp(max=fmt.max_code_magnitude).to(torch.int32)
        return torch.where(negative, -qi, qi) & ((1 << fmt.bits) - 1)
    qi = q.to(torch.int32)
    code = ((e - fmt.emin) << fmt.mbits).add_(qi).clamp_(max=fmt.max_code_magnitude)
    return code | (negative.to(torch.int32) << (fmt.bits - 1))


def _code_table(fmt: ElemFormat) -> list[float]:
    values = []
    for code in range(2**fmt.bits):
        if fmt.is_int:
            k = code - 2**fmt.bits if code >= 2 ** (fmt.bits - 1) else code
            values.append(k * 2.0**-fmt.mbits)
            continue
        sign = -1.0 if code >> (fmt.bits - 1) else 1.0
        biased = (code >> fmt.mbits) & ((1 << fmt.ebits) - 1)
        mant = code & ((1 << fmt.mbits) - 1)
        top = biased == (1 << fmt.ebits) - 1
        if fmt.has_inf and top:
            values.append(sign * float("inf") if mant == 0 else float("nan"))
        elif fmt.has_nan and not fmt.has_inf and top and mant == (1 << fmt.mbits) - 1:
            values.append(float("nan"))
        elif biased == 0:
            values.append(sign * mant * 2.0 ** (fmt.emin - fmt.mbits))
        else:
            values.append(sign * (1 + mant * 2.0**-fmt.mbits) * 2.0 ** (biased - fmt.bias))
    return values


_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def code_table(fmt: ElemFormat, device: torch.device | str = "cpu") -> torch.Tensor:
    """fp32 value of every code of ``fmt`` (index = code): the decoding table."""
    device = torch.device(device)
    key = (fmt.name, device)
    table = _TABLES.get(key)
    if table is None:
        table = torch.tensor(_code_table(fmt), dtype=torch.float32, device=device)
        _TABLES[key] = table
    return table


def decode_codes(codes: torch.Tensor, fmt: ElemFormat) -> torch.Tensor:
    """fp32 values of unpacked codes (any integer dtype holding ``fmt.bits``-bit codes)."""
    return code_table(fmt, codes.device)[codes.long()]
