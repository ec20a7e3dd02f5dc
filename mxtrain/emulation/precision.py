"""The elementwise precision every emulated operation rounds its result to.

:class:`ElementwisePrecision` is the one input of the engine (vector ops, norms,
softmax, activations): the format (``bfloatN``, 8 exponent bits, or ``fpN``, 5),
the rounding, whether subnormals are kept, whether the backward pass rounds too,
and microxcaling's formula switches. ``None`` in place of a precision means plain
fp32 torch arithmetic; a precision whose ``fmt`` is None runs the same formulas
unrounded. :mod:`mxtrain.elementwise` builds it from a recipe, :mod:`mxtrain.compat.mx`
from an ``mx_specs`` dict.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from mxtrain.emulation.rounding import round_elemwise
from mxtrain.formats import ElemFormat, parse_elemwise_format

__all__ = ["ElementwisePrecision", "ROUNDINGS", "round_to"]

ROUNDINGS = ("even", "nearest", "floor", "stochastic")


@dataclass(frozen=True)
class ElementwisePrecision:
    """What each elementwise result is rounded to, and how the formulas are computed.

    Attributes:
        fmt: ``bfloatN`` (N in 10..32) or ``fpN`` (N in 7..32); None rounds nothing.
            ``bfloat32`` is fp32 itself and is stored as None.
        rounding: one of :data:`ROUNDINGS`.
        subnormals: False flushes results below the format's smallest normal to zero.
        quantize_backward: False leaves the backward pass unrounded (:meth:`backward`).
        exp_as_exp2: ``e**x`` computed as ``2**(x * log2(e) in bfloat16)``, each step rounded.
        div_as_recip: ``a / b`` computed as ``a * (1 / b)``, each step rounded.
        softmax_exp2: softmax uses ``2**x`` instead of ``e**x``.
    """

    fmt: ElemFormat | None
    rounding: str = "even"
    subnormals: bool = True
    quantize_backward: bool = True
    exp_as_exp2: bool = False
    div_as_recip: bool = False
    softmax_exp2: bool = False

    def __post_init__(self):
        fmt = self.fmt
        if isinstance(fmt, str):
            fmt = parse_elemwise_format(fmt)
        if fmt is not None:
            if not isinstance(fmt, ElemFormat):
                raise TypeError(f"ElementwisePrecision.fmt must be an ElemFormat, a format name or None, "
                                f"got {type(fmt).__name__} {fmt!r}")
            if fmt.mx_element or fmt.ebits not in (5, 8):
                raise ValueError(f"ElementwisePrecision.fmt must be bfloatN (8 exponent bits) or fpN "
                                 f"(5 exponent bits), got {fmt.name!r}")
            if fmt.ebits == 8 and fmt.bits == 32:  # fp32 itself: nothing to round
                fmt = None
        object.__setattr__(self, "fmt", fmt)
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"ElementwisePrecision.rounding must be one of {ROUNDINGS}, got {self.rounding!r}")
        for name in ("subnormals", "quantize_backward", "exp_as_exp2", "div_as_recip", "softmax_exp2"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ElementwisePrecision.{name} must be a bool, got {getattr(self, name)!r}")

    def backward(self) -> "ElementwisePrecision":
        """The precision of the backward pass: this one, or unrounded when ``quantize_backward`` is False."""
        return self if self.quantize_backward else dataclasses.replace(self, fmt=None)


def round_to(x, prec: ElementwisePrecision | None):
    """``x`` (tensor or Python number) rounded to ``prec``; unchanged when ``prec`` or its format is None."""
    if prec is None or prec.fmt is None:
        return x
    if not isinstance(x, torch.Tensor):
        return round_elemwise(torch.tensor(x, dtype=torch.float32), prec.fmt, prec.rounding,
                              subnormals=prec.subnormals).item()
    return round_elemwise(x, prec.fmt, prec.rounding, subnormals=prec.subnormals)
