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
                  generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Round fp32 ``y`` to ``fmt``'s grid (no scaling, no saturation).

    Returns ``(q, step_inv)``: ``|y|`` rounds to ``q / step_inv`` where ``q`` is a
    non-negative integer-valued fp32 tensor and ``step_inv = 2**(mbits - e)`` is
    the inverse grid step at the element exponent ``e = max(floor(log2|y|), emin)``
    (an exact power of two; None for ints, whose step is ``2**-mbits``). For
    floats ``q`` is at most ``2**(mbits + 1)`` (a carry into the next binade).
    For 8-exponent-bit formats (bfloatN) ``2**(mbits - e)`` can leave the fp32
    range, so ``step_inv`` is then the int32 exponent ``mbits - e`` instead.
    Inf/NaN inputs give garbage: callers mask them.
    """
    mag = y.view(torch.int32) & FP32_ABS_MASK
    absy = mag.view(torch.float32)
    if fmt.is_int:
        return round_nonneg(absy * float(2**fmt.mbits), rounding, generator), None
    biased = (mag >> FP32_MANT_BITS).clamp_(min=fmt.emin + FP32_BIAS)
    if fmt.mbits - fmt.emin > 127:  # bfloatN: 2**shift leaves the normal fp32 range
        shift = torch.sub(fmt.mbits + FP32_BIAS, biased)
        return round_nonneg(_mul_pow2_wide(absy, shift), rounding, generator), shift
    # bits of 2**(mbits - e) are (mbits - e + 127) << 23, with e = biased - 127
    step_inv = torch.sub(fmt.mbits + 2 * FP32_BIAS, biased).bitwise_left_shift_(FP32_MANT_BITS)
    step_inv = step_inv.view(torch.float32)
    return round_nonneg(absy * step_inv, rounding, generator), step_inv


def grid_value(q: torch.Tensor, step_inv: torch.Tensor | None, fmt: ElemFormat) -> torch.Tensor:
    """The magnitude ``q / step_inv`` (exact; may exceed max_norm: callers saturate). Reuses ``q``."""
    if fmt.is_int:
        return q.mul_(2.0**-fmt.mbits)
    if step_inv.dtype == torch.int32:
        return _mul_pow2_wide(q, -step_inv)
    return q.div_(step_inv)  # division by a power of two is exact


TORCH_FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def element_codes(y: torch.Tensor, fmt: ElemFormat, rounding: str,
                  generator: torch.Generator | None) -> torch.Tensor:
    """Codes (``fmt.bits`` wide, sign included; uint8 for fp8, else int32) of fp32 ``y`` rounded to ``fmt``, saturating.

    Floats: ``sign << (bits-1) | biased_exp << mbits | mantissa``; the magnitude
    code is ``((e - emin) << mbits) + q``, which carries into the exponent field
    by itself and is the subnormal code when ``e == emin`` and ``q < 2**mbits``.
    Ints: two's complement of ``+-q`` in ``bits`` bits (no negative zero).
    """
    q, step_inv = round_to_grid(y, fmt, rounding, generator)
    native = TORCH_FP8.get(fmt.name)
    if native is not None:
        # The saturated grid value is representable, so torch's cast is exact: one fast pass.
        value = torch.copysign(grid_value(q, step_inv, fmt).clamp_(max=fmt.max_norm), y)
        return value.to(native).view(torch.uint8)
    negative = y.view(torch.int32) < 0
    if fmt.is_int:
        # clamp before the int cast: |y| * 2**mbits beyond int32 (or Inf) would wrap
        qi = q.clamp_(max=fmt.max_code_magnitude).to(torch.int32)
        return torch.where(negative, -qi, qi) & ((1 << fmt.bits) - 1)
    # e - emin from the step's exponent bits: step_inv = 2**(mbits - e)
    e_minus_emin = (fmt.mbits - fmt.emin + FP32_BIAS) - (step_inv.view(torch.int32) >> FP32_MANT_BITS)
    code = (e_minus_emin << fmt.mbits).add_(q.to(torch.int32)).clamp_(max=fmt.max_code_magnitude)
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


def decode_codes_fast(codes: torch.Tensor, fmt: ElemFormat) -> torch.Tensor:
    """:func:`decode_codes` through torch's float8 cast where there is one (much faster than a gather).

    Identical values; only the NaN codes of fp8_e4m3/e5m2 may decode to a NaN
    with another sign or payload (quantizers never emit those codes).
    """
    native = TORCH_FP8.get(fmt.name)
    if native is not None and codes.dtype == torch.uint8:
        return codes.view(native).float()
    return decode_codes(codes, fmt)
