"""Elementwise quantization to ``bfloat=N`` (8 exponent bits) or ``fp=N`` (5 exponent bits) from mx_specs.

:func:`quantize_elemwise_op` reproduces microxcaling's rules and exact values
(bit-exact where its float ``log2`` is exact; mxtrain is exact everywhere, see
docs/numerics.md): ``bfloat`` and ``fp`` both 0 means no rounding; both set is an
error; ``bfloat`` must be 10..32 (32 = fp32, no rounding) and ``fp`` 7..32;
overflow goes to Inf; ``bfloat_subnorms=False`` flushes subnormals to zero.
"""

from __future__ import annotations

import functools

import torch

from mxtrain.emulation.formats import rounding_of
from mxtrain.emulation.rounding import round_elemwise
from mxtrain.formats import ElemFormat, bfloat, fp

__all__ = ["quantize_elemwise_op", "elemwise_format_of"]


@functools.lru_cache(maxsize=None)
def _format(bfloat_bits: int, fp_bits: int) -> ElemFormat | None:
    if bfloat_bits and fp_bits:
        raise ValueError(f"Cannot set both [bfloat] and [fp] in mx_specs (got bfloat={bfloat_bits}, "
                         f"fp={fp_bits}); set the other to 0")
    if bfloat_bits:
        if not 10 <= bfloat_bits <= 32:
            raise ValueError(f"mx_specs['bfloat'] must be 0 (off) or 10..32 (1 sign + 8 exponent + at least "
                             f"1 mantissa bit; 16 = bfloat16, 32 = fp32), got {bfloat_bits}")
        return None if bfloat_bits == 32 else bfloat(bfloat_bits)
    if fp_bits:
        if not 7 <= fp_bits <= 32:
            raise ValueError(f"mx_specs['fp'] must be 0 (off) or 7..32 (1 sign + 5 exponent + at least "
                             f"1 mantissa bit; 16 = IEEE half), got {fp_bits}")
        return fp(fp_bits)
    return None


def elemwise_format_of(mx_specs) -> ElemFormat | None:
    """The elementwise format selected by ``mx_specs`` (``bfloat``/``fp``), or None when off."""
    if mx_specs is None:
        return None
    b, f = mx_specs["bfloat"], mx_specs["fp"]
    for name, v in (("bfloat", b), ("fp", f)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"mx_specs[{name!r}] must be an int, got {type(v).__name__} {v!r}")
    return _format(b, f)


def quantize_elemwise_op(A, mx_specs, round=None):
    """Round every element of ``A`` to the specs' bfloatN/fpN (identity when off or ``mx_specs`` is None)."""
    if mx_specs is None:
        return A
    if round is None:
        round = mx_specs["round"]
    fmt = elemwise_format_of(mx_specs)
    if fmt is None:
        return A
    if not isinstance(A, torch.Tensor):
        return round_elemwise(torch.tensor(A, dtype=torch.float32), fmt, rounding_of(round),
                              subnormals=bool(mx_specs["bfloat_subnorms"])).item()
    return round_elemwise(A, fmt, rounding_of(round), subnormals=bool(mx_specs["bfloat_subnorms"]))
