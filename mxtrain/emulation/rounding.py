"""Fast exact elementwise rounding on the CPU (bfloatN / fpN), and microxcaling's MX scale options.

:func:`round_elemwise` is bit-identical to :func:`mxtrain.quantization.quantize_elemwise`
for every fp32 input; ``tests/compat/test_fast_rounding.py`` checks it on random and
adversarial values. It takes fewer passes over memory than the reference:

* Mantissa rounding of a normal fp32 value to ``m`` bits is done on its bit
  pattern: add half a step (or half a step minus one plus the kept LSB, for
  ties-to-even), clear the ``23 - m`` low bits. A carry runs into the exponent
  field by itself, so the rounding is exact for every binade and never
  double-rounds (the fault of ``floor(t + 0.5)``).
* Values below the format's smallest normal sit on a uniform grid; the few of
  them in a tensor are gathered and rounded with the reference's exact rule
  (``t - floor(t)`` is exact).

Other inputs (bf16/fp16 tensors are widened; stochastic rounding, flushed
subnormals, unusual formats) go to the reference. MX fake quantization has one
CPU implementation, the reference's lookup tables (:mod:`mxtrain.quantization.lut`);
:func:`fake_quantize_mx_floor` adds only microxcaling's scale options to it.
"""

from __future__ import annotations

import math

import torch

from mxtrain.formats import ElemFormat, parse_elemwise_format
from mxtrain.quantization import fake_quantize_mx, quantize_elemwise
from mxtrain.quantization.rounding import grid_value, round_to_grid

__all__ = ["round_elemwise", "fake_quantize_mx_floor", "FAST_ROUNDINGS"]

FAST_ROUNDINGS = ("even", "nearest", "floor")
_ABS = 0x7FFFFFFF
_EXP_MASK = 0x7F800000
_MANT_BITS = 23


def _round_mantissa_bits(b: torch.Tensor, drop: int, rounding: str, inplace: bool) -> torch.Tensor:
    """fp32 patterns ``b`` (int32 view) rounded to ``23 - drop`` mantissa bits (a new tensor unless ``inplace``)."""
    if drop <= 0:
        return b if inplace else b.clone()
    half = 1 << (drop - 1)
    if rounding == "nearest":
        r = b.add_(half) if inplace else b + half
    elif rounding == "even":
        lsb = torch.bitwise_right_shift(b, drop).bitwise_and_(1).add_(half - 1)
        r = b.add_(lsb) if inplace else lsb.add_(b)
    else:
        r = b if inplace else b.clone()
    return r.bitwise_and_(-(1 << drop))


# floor(t + 0.5) double-rounds t = 0.5 - 2**-25 up to 1; adding the largest fp32 below 0.5 instead is
# exact ties-away rounding for every non-negative fp32 t (at 2**-25 under a tie the sum stays below the
# integer; at a tie it rounds up onto it; larger binades are coarser than 2**-25)
_HALF_DOWN = 0.5 - 2.0**-25


def _round_small(a: torch.Tensor, up: float, rounding: str) -> torch.Tensor:
    """Round non-negative ``a`` to the grid of step ``1/up`` (a power of two), exactly."""
    t = a * up
    if rounding == "even":
        q = t.round_()
    elif rounding == "floor":
        q = t.floor_()
    else:
        q = t.add_(_HALF_DOWN).floor_()
    return q.mul_(1.0 / up)


# On a GPU a data-dependent branch costs a host synchronisation per call; there the small
# values and NaN are fixed with full-tensor selects instead (same bits). Tests flip this on the CPU.
FORCE_SELECT = False


def _select_mode(t: torch.Tensor) -> bool:
    return FORCE_SELECT or t.device.type != "cpu"


def _fix_small_select(y: torch.Tensor, v: torch.Tensor, mbits: int, emin: int, rounding: str) -> torch.Tensor:
    """``y`` with the elements of ``v`` below ``2**emin`` replaced by their exact grid value (no sync)."""
    a = v.abs()
    small = a < 2.0**emin
    fixed = torch.copysign(_round_small(a, 2.0 ** (mbits - emin), rounding), v)
    return torch.where(small, fixed, y)


def _gather_small(v: torch.Tensor, emin: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Flat indices and values of the nonzero elements of contiguous ``v`` below ``2**emin`` in magnitude.

    None when there are none (zeros round to themselves). The test runs on integer
    patterns (boolean tensors are slow on the CPU): ``(|bits| - 1) & 0x7FFFFFFF``
    maps zero to the largest value and keeps the order of the other magnitudes.
    """
    flat = v.view(-1)
    key = (flat.view(torch.int32) & _ABS).sub_(1).bitwise_and_(_ABS)
    below = ((emin + 127) << _MANT_BITS) - 1  # key < below  <=>  0 < |v| < 2**emin
    if int(key.amin()) >= below:
        return None
    sel = (key < below).nonzero().squeeze(1)
    return sel, flat[sel]


def _scatter_small_(y: torch.Tensor, small, mbits: int, emin: int, rounding: str) -> None:
    """Write the exact grid values of the gathered small values (see :func:`_gather_small`) into contiguous ``y``."""
    if small is not None:
        sel, vals = small
        y.view(-1)[sel] = torch.copysign(_round_small(vals.abs(), 2.0 ** (mbits - emin), rounding), vals)


def _is_fast(x: torch.Tensor, rounding: str) -> bool:
    return x.dtype == torch.float32 and rounding in FAST_ROUNDINGS and x.numel() > 0


def round_elemwise(x: torch.Tensor, fmt: "str | ElemFormat", rounding: str = "even",
                   subnormals: bool = True) -> torch.Tensor:
    """``quantize_elemwise(x, fmt, rounding, subnormals)``, faster for fp32 bfloatN / fpN (same bits)."""
    fmt = parse_elemwise_format(fmt)
    if (not _is_fast(x, rounding) or not subnormals or fmt.mx_element or not fmt.has_inf
            or fmt.ebits not in (5, 8)):
        return quantize_elemwise(x, fmt, rounding=rounding, subnormals=subnormals)
    if rounding == "even" and fmt.name in ("bfloat16", "fp16"):
        # torch's casts round to nearest even, keep subnormals and overflow to Inf: one pass each way
        return x.to(torch.bfloat16 if fmt.name == "bfloat16" else torch.float16).float()
    xc = x.contiguous()
    y = _round_mantissa_bits(xc.view(torch.int32), _MANT_BITS - fmt.mbits, rounding, inplace=False)
    y = y.view(torch.float32)
    if fmt.emin <= -126:  # bfloatN: fp32's own subnormals and overflow are bfloatN's
        # NaN payloads may not survive the bit rounding; on the CPU one fused reduction says whether there
        # are any (a sum is NaN if an element is NaN, or if +Inf and -Inf meet: the where is then redundant)
        if _select_mode(xc) or torch.isnan(xc.sum()):
            y = torch.where(torch.isnan(xc), xc, y)
        return y.view(x.shape)
    # fpN: values under 2**emin are fpN subnormals; |x| >= overflow_at rounds above max_norm: Inf
    a = xc.abs()
    if _select_mode(xc):
        small = a < 2.0**fmt.emin
        y = torch.where(small, torch.copysign(_round_small(a, 2.0 ** (fmt.mbits - fmt.emin), rounding), xc), y)
    else:
        _scatter_small_(y, _gather_small(xc, fmt.emin), fmt.mbits, fmt.emin, rounding)
    # one select for overflow and NaN: NaN fails a < overflow_at too, and NaN * Inf is NaN
    return torch.where(a < _overflow_at(fmt, rounding), y, xc * math.inf).view(x.shape)


def _overflow_at(fmt: ElemFormat, rounding: str) -> float:
    """Smallest magnitude that rounds above ``fmt.max_norm`` (a tie at the top rounds up: max_norm is odd)."""
    if rounding == "floor" or fmt.mbits >= _MANT_BITS:
        return 2.0 ** (fmt.emax + 1)
    return fmt.max_norm + 2.0 ** (fmt.emax - fmt.mbits - 1)


def _scale_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    e = torch.arange(-127, 128, dtype=torch.float64)
    return torch.exp2(e).float().to(device), torch.exp2(-e).float().to(device)


_TABLES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _block_scales(amax: torch.Tensor, emax: int, scale_bits: int, flush_fp32_subnorms: bool):
    """(2**X, 2**-X) per block, X = floor(log2 amax) - emax from the bits, with microxcaling's scale options.

    X is clamped to ``[-(2**(s-1)-1), 2**(s-1)-1]`` for ``s = scale_bits`` and a larger one makes
    the block NaN (as a NaN/Inf amax does); ``flush_fp32_subnorms`` gives 2**X = 0 to blocks whose
    amax is an fp32 subnormal.
    """
    ab = amax.view(torch.int32) & _ABS
    biased = ab >> _MANT_BITS
    e = torch.where(biased == 0, torch.where(ab == 0, -126, -127), biased - 127) - emax
    emax_s = 2 ** (scale_bits - 1) - 1
    nan_blk = (ab >= _EXP_MASK) | (e > emax_s)
    idx = e.clamp_(-emax_s, emax_s).add_(127).long()
    tables = _TABLES.get(amax.device)
    if tables is None:
        tables = _TABLES[amax.device] = _scale_tables(amax.device)
    sc, inv = tables[0][idx], tables[1][idx]
    sc = sc.masked_fill_(nan_blk, math.nan)
    inv = inv.masked_fill_(nan_blk, math.nan)
    if flush_fp32_subnorms:  # microxcaling's mx_flush_fp32_subnorms: blocks whose amax is an fp32 subnormal
        sc = sc.masked_fill_((biased == 0) & (ab != 0), 0.0)
    return sc, inv


def fake_quantize_mx_floor(x: torch.Tensor, fmt: ElemFormat, block_size: int = 32, axis: int = -1,
                           rounding: str = "even", scale_bits: int = 8,
                           flush_fp32_subnorms: bool = False) -> torch.Tensor:
    """``fake_quantize_mx(x, fmt, block_size, axis, scale_mode="floor", rounding)``, plus microxcaling's scale options.

    With 8-bit scales and no flush this is :func:`~mxtrain.quantization.fake_quantize_mx` itself (its
    lookup tables on the CPU). ``scale_bits`` other than 8 clamp the shared exponent to
    ``[-(2**(s-1)-1), 2**(s-1)-1]`` and make larger ones NaN (microxcaling); ``flush_fp32_subnorms``
    zeroes blocks whose amax is an fp32 subnormal. Those scales are computed here; the elements are
    rounded by the reference's grid functions.
    """
    if scale_bits == 8 and not flush_fp32_subnorms:
        return fake_quantize_mx(x, fmt, block_size=block_size, axis=axis, scale_mode="floor", rounding=rounding)
    if rounding not in FAST_ROUNDINGS:
        raise NotImplementedError(f"scale_bits != 8 and mx_flush_fp32_subnorms take rounding in {FAST_ROUNDINGS}, "
                                  f"got {rounding!r}")
    if x.dtype != torch.float32:
        return fake_quantize_mx_floor(x.float(), fmt, block_size, axis, rounding, scale_bits,
                                      flush_fp32_subnorms).to(x.dtype)
    if x.numel() == 0:
        return x.clone()
    ax = axis % x.ndim
    shape = x.shape
    length = shape[ax]
    bs = block_size if block_size > 0 else length
    if length > bs and length % bs:  # the ragged last block on its own: zero padding would not change its amax
        main = length - length % bs
        parts = [fake_quantize_mx_floor(x.narrow(ax, lo, n), fmt, block_size, ax, rounding, scale_bits,
                                        flush_fp32_subnorms) for lo, n in ((0, main), (main, length - main))]
        return torch.cat(parts, dim=ax)
    pre = math.prod(shape[:ax])
    post = math.prod(shape[ax + 1:])
    nb, width = (length // bs, bs) if length >= bs else (1, length)
    xv = x.contiguous().view(pre, nb, width, post)
    # two reductions of the raw values (no temporary); NaN propagates, so a NaN block gets a NaN amax
    amax = torch.maximum(xv.amin(dim=2, keepdim=True).neg_(), xv.amax(dim=2, keepdim=True))
    sc, inv = _block_scales(amax, fmt.emax, scale_bits, flush_fp32_subnorms)
    y = xv * inv
    q, step_inv = round_to_grid(y, fmt, rounding, None)
    vals = torch.copysign(grid_value(q, step_inv, fmt).clamp_(max=fmt.max_norm), y)
    if fmt.is_int:
        vals.add_(0.0)  # two's complement has no -0: -0.0 + 0.0 == +0.0
    return vals.mul_(sc).view(shape)  # a NaN block's scale is NaN, whatever its elements rounded to
