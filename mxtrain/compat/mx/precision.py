"""The translation of microxcaling's ``mx_specs`` into mxtrain's :class:`ElementwisePrecision`.

This is where an ``mx_specs`` dict meets the emulation engine: its ``bfloat`` /
``fp`` width, ``round`` (``dither`` is stochastic), ``bfloat_subnorms``,
``quantize_backprop``, ``vec_use_exp2``, ``vec_use_recip`` and ``softmax_exp2``
become one typed precision. Keys the engine does not use are ignored.
"""

from __future__ import annotations

import inspect

import functools

from mxtrain.compat.mx.formats import rounding_of
from mxtrain.compat.mx.specs import DEFAULTS
from mxtrain.emulation.precision import ElementwisePrecision
from mxtrain.formats import ElemFormat, bfloat, fp

__all__ = ["precision_of", "elemwise_format_of", "translating_function"]


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


@functools.lru_cache(maxsize=256)
def _precision(fmt, round, subnormals, backward, exp2, recip, softmax_exp2) -> ElementwisePrecision:
    # the rounding mode is checked only where something is rounded, as microxcaling does
    return ElementwisePrecision(fmt, rounding_of(round) if fmt is not None else "even", subnormals, backward,
                                exp2, recip, softmax_exp2)


def precision_of(mx_specs, round=None) -> ElementwisePrecision | None:
    """The elementwise precision of ``mx_specs`` (None for None); ``round`` overrides ``mx_specs['round']``.

    Keys missing from a partial dict take microxcaling's defaults.
    """
    if mx_specs is None:
        return None
    get = lambda key: mx_specs.get(key, DEFAULTS[key])  # noqa: E731
    return _precision(elemwise_format_of(mx_specs), get("round") if round is None else round,
                      bool(get("bfloat_subnorms")), bool(get("quantize_backprop")), bool(get("vec_use_exp2")),
                      bool(get("vec_use_recip")), bool(get("softmax_exp2")))


def translating_function(engine):
    """``engine`` (an emulation autograd Function whose ``forward`` takes ``prec``) as microxcaling's: taking
    ``mx_specs`` in that argument's place, translated by :func:`precision_of`."""
    params = list(inspect.signature(engine.forward).parameters)[1:]  # after ctx
    if "prec" not in params:
        raise TypeError(f"{engine.__name__}.forward takes no 'prec' argument: {params}")
    specs_at = params.index("prec")

    class Function(engine):
        @staticmethod
        def forward(ctx, *args):
            args = list(args)
            if specs_at < len(args):
                args[specs_at] = precision_of(args[specs_at])
            return engine.forward(ctx, *args)

    Function.__name__ = Function.__qualname__ = engine.__name__
    return Function
