"""Number formats of the MX numerics contract: pure data, no tensors.

Element formats (the per-element codes of an MX block), the elementwise
formats used for vector ops (``bfloatN`` with 8 exponent bits, ``fpN`` with 5),
and the E8M0 shared scale.  Everything the quantizers need to know about a
format lives on :class:`ElemFormat`; nothing here touches a tensor.

Floating-point element formats follow OCP MX v1.0: ``emax`` is the largest
normal exponent, ``emin = 1 - bias`` the smallest, subnormals are
representable.  ``fp8_e4m3`` is the "fn" variant (no Inf, one NaN code per
sign), ``fp8_e5m2`` is IEEE-like (Inf and NaN), fp6/fp4 have neither.

Integer element formats are sign-magnitude fixed point with ``bits - 2``
fractional bits (``int8``: k/64 for k in [-127, 127]), stored as two's
complement with the most negative code unused, as in the OCP spec and
microxcaling.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

__all__ = [
    "FormatKind",
    "ElemFormat",
    "ScaleFormat",
    "E8M0",
    "ELEMENT_FORMATS",
    "MX_FORMAT_NAMES",
    "parse_format",
    "parse_elemwise_format",
    "bfloat",
    "fp",
]


class FormatKind(str, Enum):
    FLOAT = "float"
    INT = "int"


@dataclass(frozen=True)
class ElemFormat:
    """An element format.

    Attributes:
        name: canonical name (``"fp8_e4m3"``, ``"int8"``, ``"bfloat16"``, ``"fp12"``...).
        kind: float or int.
        bits: total bits of one element code (sign included).
        ebits: exponent bits (0 for ints).
        mbits: explicit mantissa bits for floats; fractional bits for ints
            (the grid step at the top binade is ``2**-mbits`` before scaling).
        emax: largest unbiased exponent of a normal value (0 for ints).
        emin: smallest unbiased exponent of a normal value (0 for ints).
        max_norm: largest finite magnitude.
        has_inf: the format encodes +-Inf (overflow goes to Inf when not saturating).
        has_nan: the format encodes NaN.
        mx_element: usable as an MX block element (otherwise elementwise-only).
    """

    name: str
    kind: FormatKind
    bits: int
    ebits: int
    mbits: int
    emax: int
    emin: int
    max_norm: float
    has_inf: bool
    has_nan: bool
    mx_element: bool

    @property
    def is_float(self) -> bool:
        return self.kind is FormatKind.FLOAT

    @property
    def is_int(self) -> bool:
        return self.kind is FormatKind.INT

    @property
    def bias(self) -> int:
        return 1 - self.emin if self.is_float else 0

    @property
    def min_norm(self) -> float:
        """Smallest positive normal magnitude (the grid step for ints)."""
        return 2.0**self.emin if self.is_float else 2.0**-self.mbits

    @property
    def min_subnorm(self) -> float:
        """Smallest positive magnitude (subnormals included)."""
        return 2.0 ** (self.emin - self.mbits) if self.is_float else 2.0**-self.mbits

    @property
    def max_code_magnitude(self) -> int:
        """Code (sign bit clear) of ``max_norm``: codes saturate at this value."""
        if self.is_int:
            return 2 ** (self.bits - 1) - 1
        return ((self.emax - self.emin + 1) << self.mbits) | int(
            round((self.max_norm / 2.0**self.emax - 1.0) * 2**self.mbits)
        )

    @property
    def packed_per_byte(self) -> float:
        return 8 / self.bits

    def __repr__(self) -> str:
        return f"ElemFormat({self.name})"

    def __str__(self) -> str:
        return self.name


def _float_format(name: str, ebits: int, mbits: int, *, fn: bool = False, ieee: bool = False,
                  mx_element: bool = True) -> ElemFormat:
    bias = 2 ** (ebits - 1) - 1
    emin = 1 - bias
    if ieee:
        # top exponent code reserved for Inf/NaN
        emax = 2**ebits - 2 - bias
        max_norm = 2.0**emax * (2 - 2.0**-mbits)
    elif fn:
        # top exponent code is finite, only the all-ones mantissa is NaN
        emax = 2**ebits - 1 - bias
        max_norm = 2.0**emax * (2 - 2.0 ** (1 - mbits))
    else:
        # every code finite (fp6, fp4)
        emax = 2**ebits - 1 - bias
        max_norm = 2.0**emax * (2 - 2.0**-mbits)
    return ElemFormat(name, FormatKind.FLOAT, 1 + ebits + mbits, ebits, mbits, emax, emin,
                      max_norm, has_inf=ieee, has_nan=ieee or fn, mx_element=mx_element)


def _int_format(name: str, bits: int) -> ElemFormat:
    frac = bits - 2
    return ElemFormat(name, FormatKind.INT, bits, 0, frac, 0, 0,
                      (2 ** (bits - 1) - 1) / 2.0**frac, has_inf=False, has_nan=False,
                      mx_element=True)


FP8_E4M3 = _float_format("fp8_e4m3", 4, 3, fn=True)
FP8_E5M2 = _float_format("fp8_e5m2", 5, 2, ieee=True)
FP6_E3M2 = _float_format("fp6_e3m2", 3, 2)
FP6_E2M3 = _float_format("fp6_e2m3", 2, 3)
FP4_E2M1 = _float_format("fp4_e2m1", 2, 1)
INT8 = _int_format("int8", 8)
INT4 = _int_format("int4", 4)
INT2 = _int_format("int2", 2)

ELEMENT_FORMATS: dict[str, ElemFormat] = {
    f.name: f for f in (FP8_E4M3, FP8_E5M2, FP6_E3M2, FP6_E2M3, FP4_E2M1, INT8, INT4, INT2)
}
MX_FORMAT_NAMES = tuple(ELEMENT_FORMATS)

# Codes per packing group by element bits (mxtrain.quantization.packing): a packed block's length must
# be a multiple of it. And the largest block size: a block is stored padded to its full size, so a
# block far longer than any axis only allocates padding (0 gives one scale for the whole axis instead).
PACK_GROUP = {8: 1, 6: 4, 4: 2, 2: 4}
MAX_BLOCK_SIZE = 8192


def pack_group(fmt: "str | ElemFormat") -> int:
    """Codes per packing group of ``fmt``: a packed block size must be a multiple of it (1 for 8 bits)."""
    return PACK_GROUP[parse_format(fmt).bits]

# bfloatN: 8 exponent bits, fpN: 5 exponent bits (microxcaling's bfloat=N / fp=N).
BFLOAT_MIN_BITS, BFLOAT_MAX_BITS = 10, 32
FP_MIN_BITS, FP_MAX_BITS = 7, 32


def bfloat(n: int) -> ElemFormat:
    """``bfloatN``: 1 sign, 8 exponent and ``n - 9`` mantissa bits; overflow goes to Inf."""
    if not isinstance(n, int) or isinstance(n, bool) or not BFLOAT_MIN_BITS <= n <= BFLOAT_MAX_BITS:
        raise ValueError(f"bfloat width must be an int in [{BFLOAT_MIN_BITS}, {BFLOAT_MAX_BITS}] "
                         f"(1 sign + 8 exponent + at least 1 mantissa bit), got {n!r}")
    return _float_format(f"bfloat{n}", 8, n - 9, ieee=True, mx_element=False)


def fp(n: int) -> ElemFormat:
    """``fpN``: 1 sign, 5 exponent and ``n - 6`` mantissa bits (fp16 is IEEE half)."""
    if not isinstance(n, int) or isinstance(n, bool) or not FP_MIN_BITS <= n <= FP_MAX_BITS:
        raise ValueError(f"fp width must be an int in [{FP_MIN_BITS}, {FP_MAX_BITS}] "
                         f"(1 sign + 5 exponent + at least 1 mantissa bit), got {n!r}")
    return _float_format(f"fp{n}", 5, n - 6, ieee=True, mx_element=False)


_ALIASES = {
    "fp8_e4m3": "fp8_e4m3", "e4m3": "fp8_e4m3", "fp8e4m3": "fp8_e4m3", "float8_e4m3": "fp8_e4m3",
    "float8_e4m3fn": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3", "e4m3fn": "fp8_e4m3", "mxfp8": "fp8_e4m3",
    "mxfp8_e4m3": "fp8_e4m3", "fp8": "fp8_e4m3",
    "fp8_e5m2": "fp8_e5m2", "e5m2": "fp8_e5m2", "fp8e5m2": "fp8_e5m2", "float8_e5m2": "fp8_e5m2",
    "mxfp8_e5m2": "fp8_e5m2",
    "fp6_e3m2": "fp6_e3m2", "e3m2": "fp6_e3m2", "float6_e3m2": "fp6_e3m2", "float6_e3m2fn": "fp6_e3m2",
    "mxfp6_e3m2": "fp6_e3m2",
    "fp6_e2m3": "fp6_e2m3", "e2m3": "fp6_e2m3", "float6_e2m3": "fp6_e2m3", "float6_e2m3fn": "fp6_e2m3",
    "mxfp6_e2m3": "fp6_e2m3", "mxfp6": "fp6_e2m3", "fp6": "fp6_e2m3",
    "fp4_e2m1": "fp4_e2m1", "e2m1": "fp4_e2m1", "fp4": "fp4_e2m1", "mxfp4": "fp4_e2m1",
    "float4_e2m1": "fp4_e2m1", "float4_e2m1fn": "fp4_e2m1", "mxfp4_e2m1": "fp4_e2m1",
    "int8": "int8", "mxint8": "int8", "int4": "int4", "mxint4": "int4", "int2": "int2", "mxint2": "int2",
}

_ELEMWISE_RE = re.compile(r"^(bfloat|bf|fp|float)(\d+)$")


def _normalize(name: str) -> str:
    return name.strip().lower().replace("-", "_")


def parse_format(fmt: "str | ElemFormat") -> ElemFormat:
    """An MX element format from its name or alias (case-insensitive).

    ``"e4m3"``, ``"MXFP8"``, ``"fp8_e4m3"`` all give fp8_e4m3; ``"fp4"`` gives
    fp4_e2m1, ``"mxfp6"`` fp6_e2m3. Raises ``ValueError`` listing the valid names.
    """
    if isinstance(fmt, ElemFormat):
        if not fmt.mx_element:
            raise ValueError(f"{fmt.name} is an elementwise format, not an MX element format; "
                             f"valid MX element formats: {', '.join(MX_FORMAT_NAMES)}")
        return fmt
    if not isinstance(fmt, str):
        raise TypeError(f"format must be a str or ElemFormat, got {type(fmt).__name__}")
    key = _normalize(fmt)
    if key in _ALIASES:
        return ELEMENT_FORMATS[_ALIASES[key]]
    raise ValueError(f"unknown MX element format {fmt!r}; valid names: {', '.join(MX_FORMAT_NAMES)} "
                     f"(aliases: {', '.join(sorted(k for k in _ALIASES if k not in ELEMENT_FORMATS))})")


def parse_elemwise_format(fmt: "str | ElemFormat") -> ElemFormat:
    """Any format usable by elementwise fake-quantization.

    Accepts every MX element format plus ``bfloatN`` (N in 10..32, ``bfloat16``
    = torch.bfloat16), ``fpN`` (N in 7..32, ``fp16`` = IEEE half), and the
    aliases ``bf16``, ``float16``, ``half``. Here ``fpN`` always means 5 exponent
    bits (microxcaling's ``fp=N``): ``"fp8"`` is 1-5-2, ``"fp8_e4m3"`` is the MX element.
    """
    if isinstance(fmt, ElemFormat):
        return fmt
    if not isinstance(fmt, str):
        raise TypeError(f"format must be a str or ElemFormat, got {type(fmt).__name__}")
    key = _normalize(fmt)
    key = {"half": "fp16", "bfloat": "bfloat16"}.get(key, key)
    m = _ELEMWISE_RE.match(key)
    # In elementwise context "fpN" means microxcaling's fp=N (5 exponent bits), so
    # "fp8" is 1-5-2 here, not fp8_e4m3; out-of-range widths fall through to aliases.
    if m and (FP_MIN_BITS if m.group(1) in ("fp", "float") else BFLOAT_MIN_BITS) <= int(m.group(2)):
        family, n = m.group(1), int(m.group(2))
        return bfloat(n) if family in ("bfloat", "bf") else fp(n)
    if key in _ALIASES:
        return ELEMENT_FORMATS[_ALIASES[key]]
    if m:
        family, n = m.group(1), int(m.group(2))
        return bfloat(n) if family in ("bfloat", "bf") else fp(n)  # raises with the valid range
    raise ValueError(f"unknown elementwise format {fmt!r}; valid: {', '.join(MX_FORMAT_NAMES)}, "
                     f"bfloatN (N={BFLOAT_MIN_BITS}..{BFLOAT_MAX_BITS}, e.g. bfloat16), "
                     f"fpN (N={FP_MIN_BITS}..{FP_MAX_BITS}, e.g. fp16)")


@dataclass(frozen=True)
class ScaleFormat:
    """E8M0 shared scale: one byte, value ``2**(byte - bias)``, ``nan_code`` = NaN."""

    name: str = "e8m0"
    bits: int = 8
    bias: int = 127
    min_exp: int = -127
    max_exp: int = 127
    nan_code: int = 0xFF


E8M0 = ScaleFormat()
