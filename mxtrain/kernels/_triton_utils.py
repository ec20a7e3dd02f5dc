"""Shared pieces of the Triton kernels: availability, launch options, format constants.

Triton is optional: on a machine without it (or without CUDA and without
``TRITON_INTERPRET=1``) the kernel modules still import, register nothing, and
the dispatch point uses the reference.
"""

from __future__ import annotations

import functools
import os
import struct

import torch

from mxtrain.formats import ElemFormat

try:  # pragma: no cover - exercised by the environment, not by a test
    import triton
    import triton.language as tl

    HAVE_TRITON = True
    TRITON_IMPORT_ERROR: Exception | None = None
except Exception as exc:  # ImportError, or a broken install
    triton = None
    tl = None
    HAVE_TRITON = False
    TRITON_IMPORT_ERROR = exc

__all__ = [
    "HAVE_TRITON", "triton", "tl", "interpret_mode", "kernels_available", "device_supported",
    "launch_options", "FormatConsts", "format_consts", "SCALE_MODE_IDS", "ROUNDING_IDS", "is_pow2",
    "decode_codes", "bf16_bits",
]

SCALE_MODE_IDS = {"floor": 0, "rceil": 1, "even": 2}
ROUNDING_IDS = {"even": 0, "nearest": 1, "floor": 2, "stochastic": 3}


def bf16_bits(t: torch.Tensor) -> torch.Tensor:
    """A bf16 tensor as its int16 bits (the interpreter has no bf16; kernels widen them exactly), others as given."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def interpret_mode() -> bool:
    """Whether Triton runs kernels on the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def kernels_available() -> bool:
    """Whether the Triton kernels can run at all here (CUDA, or the CPU interpreter)."""
    return HAVE_TRITON and (interpret_mode() or torch.cuda.is_available())


def device_supported(device: torch.device) -> bool:
    """Whether a tensor on ``device`` can be handed to a Triton kernel in this process."""
    if not HAVE_TRITON:
        return False
    if interpret_mode():
        return device.type == "cpu"
    return device.type == "cuda"


def launch_options() -> dict:
    """Compile options for every launch.

    FP fusion must stay off: the kernels rely on ``(t + 2**23) - 2**23`` and on
    a rounded product feeding an add; an FMA would skip the rounding and break
    bit-exactness with the reference. The interpreter computes in numpy and
    takes no compile options.
    """
    return {} if interpret_mode() else {"enable_fp_fusion": False}


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _fp32_bits(value: float) -> int:
    return struct.unpack("<i", struct.pack("<f", value))[0]


class FormatConsts(dict):
    """``constexpr`` keyword arguments describing an element format to the kernels."""


def format_consts(fmt: ElemFormat) -> FormatConsts:
    """The format's constants (a fresh dict each call: callers may add to it; computed once per format)."""
    return FormatConsts(_format_consts(fmt))


@functools.cache
def _format_consts(fmt: ElemFormat) -> FormatConsts:
    nan_kind = 0
    if fmt.is_float and fmt.has_inf:
        nan_kind = 2  # IEEE-like: top exponent = Inf (mantissa 0) / NaN
    elif fmt.is_float and fmt.has_nan:
        nan_kind = 1  # "fn": only the all-ones magnitude is NaN
    return FormatConsts(
        IS_INT=fmt.is_int,
        BITS=fmt.bits,
        MBITS=fmt.mbits,
        EMIN=fmt.emin,
        EMAX=fmt.emax,
        BIAS=fmt.bias,
        MAX_CODE=fmt.max_code_magnitude,
        MAX_NORM=float(fmt.max_norm),
        # fp32(1 / max_norm) as the reference computes it (float64 quotient rounded to fp32)
        INV_MAX_BITS=_fp32_bits(1.0 / fmt.max_norm),
        NAN_KIND=nan_kind,
    )


if HAVE_TRITON:

    @triton.jit
    def decode_codes(code, IS_INT: tl.constexpr, BITS: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr,
                BIAS: tl.constexpr, NAN_KIND: tl.constexpr):
        """fp32 value of int32 codes (the reference code table, computed); the casts and the dequantize share it."""
        if IS_INT:
            k = code - ((code >> (BITS - 1)) << BITS)  # two's complement sign extension
            v = k.to(tl.float32) * (2.0 ** -MBITS)
        else:
            mag = code & ((1 << (BITS - 1)) - 1)
            biased = mag >> MBITS
            mant = mag & ((1 << MBITS) - 1)
            vb = ((tl.maximum(biased, 1) - BIAS + 127) << 23) | (mant << (23 - MBITS))
            v = vb.to(tl.float32, bitcast=True) - tl.where(biased == 0, 2.0 ** EMIN, 0.0)
            sign = (code >> (BITS - 1)) << 31
            vb = v.to(tl.int32, bitcast=True) | sign
            if NAN_KIND == 1:  # fn: only the all-ones magnitude is NaN
                vb = tl.where(mag == (1 << (BITS - 1)) - 1, 0x7FC00000, vb)
            elif NAN_KIND == 2:  # IEEE-like: top exponent is Inf / NaN
                top = biased == (1 << (BITS - 1 - MBITS)) - 1
                vb = tl.where(top, tl.where(mant == 0, sign | 0x7F800000, 0x7FC00000), vb)
            v = vb.to(tl.float32, bitcast=True)
        return v
else:
    decode_codes = None
