"""microxcaling's format vocabulary (``RoundingMode``, ``ElemFormat``) mapped onto mxtrain's formats."""

from __future__ import annotations

import dataclasses
import functools
from enum import Enum, IntEnum

from mxtrain.formats import ElemFormat as _MXTElemFormat
from mxtrain.formats import bfloat, fp, parse_format

__all__ = ["RoundingMode", "ElemFormat", "mx_elem_format", "rounding_of", "ROUND_MODES",
           "FP32_EXPONENT_BIAS", "FP32_MIN_NORMAL"]

FP32_EXPONENT_BIAS = 127
FP32_MIN_NORMAL = 2 ** (-FP32_EXPONENT_BIAS + 1)


class RoundingMode(IntEnum):
    nearest = 0
    floor = 1
    even = 2

    @staticmethod
    def string_enums():
        return [s.name for s in RoundingMode]


class ElemFormat(Enum):
    """Element formats microxcaling names (``fp4`` is ``fp4_e2m1``; ``fp16``/``bfloat16`` as MX elements)."""

    int8 = 1
    int4 = 2
    int2 = 3
    fp8_e5m2 = 4
    fp8_e4m3 = 5
    fp6_e3m2 = 6
    fp6_e2m3 = 7
    fp4 = 8
    fp4_e2m1 = 8
    float16 = 9
    fp16 = 9
    bfloat16 = 10
    bf16 = 10

    @staticmethod
    def from_str(s):
        if s is None:
            raise ValueError("String elem_format == None")
        key = s.lower()
        if key in ElemFormat.__members__:
            return ElemFormat[key]
        raise ValueError(f"Undefined elem format {s!r}; valid: {', '.join(ElemFormat.__members__)}")


# microxcaling rounding name -> mxtrain rounding ("dither" is its stochastic rounding)
ROUND_MODES = {"nearest": "nearest", "floor": "floor", "even": "even", "dither": "stochastic"}


def rounding_of(name) -> str:
    """mxtrain's rounding for a microxcaling ``round`` value."""
    if isinstance(name, RoundingMode):
        name = name.name
    key = name.lower() if isinstance(name, str) else name
    if key not in ROUND_MODES:
        raise ValueError(f"unknown rounding mode {name!r}; microxcaling's modes are "
                         f"{', '.join(ROUND_MODES)}")
    return ROUND_MODES[key]


@functools.lru_cache(maxsize=None)
def _mx_elem_format_by_name(name: str) -> _MXTElemFormat:
    member = ElemFormat.from_str(name)
    if member is ElemFormat.float16:
        return dataclasses.replace(fp(16), mx_element=True)
    if member is ElemFormat.bfloat16:
        return dataclasses.replace(bfloat(16), mx_element=True)
    return parse_format(member.name)


def mx_elem_format(elem_format) -> _MXTElemFormat | None:
    """An mxtrain ElemFormat for a microxcaling ``*_elem_format`` value (str, ElemFormat enum or mxtrain format)."""
    if elem_format is None:
        return None
    if isinstance(elem_format, _MXTElemFormat):
        return elem_format
    if isinstance(elem_format, ElemFormat):
        elem_format = elem_format.name
    if not isinstance(elem_format, str):
        raise TypeError(f"elem_format must be a format name, got {type(elem_format).__name__} {elem_format!r}")
    return _mx_elem_format_by_name(elem_format.lower())
