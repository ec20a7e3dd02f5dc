"""Brute-force float64 oracles for the quantization suites (independent of mxtrain).

Nothing here imports mxtrain: every grid is enumerated from the format's bit
layout as written in the OCP MX v1.0 spec (and DESIGN.md "Numerics contract"),
every rounding is a nearest-grid-point search with exact float64 comparisons,
and the MX scale comes from ``math.frexp``-style exponents of the float64 amax.

Exactness: every input is an fp32 value (exact in float64); grid points have at
most 25 significant bits, so the midpoint ``(lo + hi) / 2`` of two adjacent
grid points is exact in float64 and rounding decisions compare ``|x|`` with it
without any arithmetic on ``x``.  Scaling by ``2**-X`` (|X| <= 127) is exact in
float64 for every fp32 input.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

# name -> (kind, bits or ebits, mbits, variant); written from the spec, not from mxtrain.formats
#   variant "fn": top exponent finite, only the all-ones mantissa there is NaN (OCP E4M3)
#   variant "ieee": top exponent reserved for Inf/NaN (E5M2, bfloatN, fpN)
#   variant "finite": every code is a number (FP6, FP4)
MX_SPECS = {
    "fp8_e4m3": ("float", 4, 3, "fn"),
    "fp8_e5m2": ("float", 5, 2, "ieee"),
    "fp6_e3m2": ("float", 3, 2, "finite"),
    "fp6_e2m3": ("float", 2, 3, "finite"),
    "fp4_e2m1": ("float", 2, 1, "finite"),
    "int8": ("int", 8, 6, None),
    "int4": ("int", 4, 2, None),
    "int2": ("int", 2, 0, None),
}
MX_NAMES = tuple(MX_SPECS)
FLOAT_MX_NAMES = tuple(n for n, s in MX_SPECS.items() if s[0] == "float")
INT_MX_NAMES = tuple(n for n, s in MX_SPECS.items() if s[0] == "int")

# the values the design document states (max_norm, emax)
DOC_MAX_NORM = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0, "fp6_e3m2": 28.0, "fp6_e2m3": 7.5,
                "fp4_e2m1": 6.0, "int8": 127 / 64, "int4": 7 / 4, "int2": 1.0}
DOC_EMAX = {"fp8_e4m3": 8, "fp8_e5m2": 15, "fp6_e3m2": 4, "fp6_e2m3": 2, "fp4_e2m1": 2,
            "int8": 0, "int4": 0, "int2": 0}

DETERMINISTIC_ROUNDINGS = ("even", "nearest", "floor")


def spec_of(name: str):
    """(kind, ebits, mbits, variant) for MX names, ``bfloatN`` and ``fpN`` (5 exponent bits)."""
    if name in MX_SPECS:
        return MX_SPECS[name]
    if name.startswith("bfloat"):
        return ("float", 8, int(name[6:]) - 9, "ieee")
    if name.startswith("fp"):
        return ("float", 5, int(name[2:]) - 6, "ieee")
    raise KeyError(name)


@dataclass(frozen=True)
class Grid:
    """Non-negative finite values of a format, sorted, with their magnitude codes."""

    name: str
    kind: str
    bits: int
    mbits: int
    mags: np.ndarray  # float64, sorted ascending, mags[0] == 0
    codes: np.ndarray  # int64 magnitude code (sign bit clear) of each entry
    has_inf: bool

    @property
    def max_norm(self) -> float:
        return float(self.mags[-1])

    @property
    def emax(self) -> int:
        return int(np.floor(np.log2(self.max_norm)))

    @property
    def min_positive(self) -> float:
        return float(self.mags[1])

    @property
    def min_normal(self) -> float:
        """Smallest normal (floats); the grid step for ints."""
        if self.kind == "int":
            return float(self.mags[1])
        return float(self.mags[1 << self.mbits])

    def signed_code(self, idx: np.ndarray, negative: np.ndarray) -> np.ndarray:
        mag_code = self.codes[idx]
        if self.kind == "int":
            return np.where(negative, -mag_code, mag_code) & ((1 << self.bits) - 1)
        return mag_code | (negative.astype(np.int64) << (self.bits - 1))


@lru_cache(maxsize=None)
def grid(name: str) -> Grid:
    kind, a, mbits, variant = spec_of(name)
    if kind == "int":
        bits = a
        k = np.arange(2 ** (bits - 1), dtype=np.int64)  # 0 .. 2**(bits-1)-1: no most-negative code
        return Grid(name, kind, bits, mbits, k / 2.0**mbits, k, False)
    ebits = a
    bits = 1 + ebits + mbits
    bias = 2 ** (ebits - 1) - 1
    mags, codes = [], []
    for biased in range(2**ebits):
        for mant in range(2**mbits):
            top = biased == 2**ebits - 1
            if variant == "ieee" and top:
                continue
            if variant == "fn" and top and mant == 2**mbits - 1:
                continue
            if biased == 0:
                v = mant * 2.0 ** (1 - bias - mbits)
            else:
                v = (1 + mant / 2.0**mbits) * 2.0 ** (biased - bias)
            mags.append(v)
            codes.append((biased << mbits) | mant)
    mags = np.array(mags, dtype=np.float64)
    codes = np.array(codes, dtype=np.int64)
    order = np.argsort(mags, kind="stable")
    assert np.all(np.diff(mags[order]) > 0)
    return Grid(name, kind, bits, mbits, mags[order], codes[order], variant == "ieee")


def round_mags(a: np.ndarray, g: Grid, mode: str, *, inf_on_overflow: bool = False):
    """Grid index of ``|x|`` rounded per ``mode``; returns (idx, overflow).

    Saturates at max_norm.  With ``inf_on_overflow`` the grid is extended by the
    next binade's first point ``2**(emax+1)``: a value rounding to it (or beyond)
    is reported in ``overflow`` (the caller makes it Inf).
    """
    a = np.asarray(a, dtype=np.float64)
    mags = g.mags
    parity = g.codes & 1
    if inf_on_overflow:
        mags = np.append(mags, 2.0 ** (g.emax + 1))
        parity = np.append(parity, 0)  # mantissa 0 of the next binade: even
    n = len(mags)
    i = np.clip(np.searchsorted(mags, a, side="right") - 1, 0, n - 1)
    lo = mags[i]
    j = np.minimum(i + 1, n - 1)
    hi = mags[j]
    mid = (lo + hi) / 2  # exact
    if mode == "floor":
        idx = i
    elif mode == "nearest":
        idx = np.where(a < mid, i, j)
    elif mode == "even":
        idx = np.where(a < mid, i, np.where(a > mid, j, np.where(parity[i] == 0, i, j)))
    else:
        raise ValueError(mode)
    idx = np.where(a == lo, i, idx)
    if inf_on_overflow:
        overflow = idx == n - 1
        return np.minimum(idx, n - 2), overflow
    return idx, np.zeros(a.shape, dtype=bool)


def round_values(x: np.ndarray, name: str, mode: str, *, inf_on_overflow: bool = False):
    """Signed float64 values of fp32 ``x`` rounded to ``name`` (NaN/Inf pass through)."""
    g = grid(name)
    x = np.asarray(x, dtype=np.float64)
    finite = np.isfinite(x)
    a = np.where(finite, np.abs(x), 0.0)
    idx, overflow = round_mags(a, g, mode, inf_on_overflow=inf_on_overflow)
    mag = np.where(overflow, np.inf, g.mags[idx])
    out = np.copysign(mag, x)
    return np.where(finite, out, x)


def round_codes(x: np.ndarray, name: str, mode: str) -> np.ndarray:
    """Saturating codes of finite fp32 ``x`` rounded to ``name``."""
    g = grid(name)
    x = np.asarray(x, dtype=np.float64)
    idx, _ = round_mags(np.abs(x), g, mode)
    negative = np.signbit(x)
    if g.kind == "int":
        negative = negative & (idx > 0)
    return g.signed_code(idx, negative)


def neighbours(x: np.ndarray, name: str):
    """(lower, upper) grid magnitudes around |x| (equal when |x| is on the grid); clamps at max."""
    g = grid(name)
    a = np.abs(np.asarray(x, dtype=np.float64))
    i = np.clip(np.searchsorted(g.mags, a, side="right") - 1, 0, len(g.mags) - 1)
    lo = g.mags[i]
    hi = np.where(a == lo, lo, g.mags[np.minimum(i + 1, len(g.mags) - 1)])
    return lo, hi


# ---------------------------------------------------------------------------------------------
# fp32 helpers


def f32(values) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.asarray(values, dtype=np.float32)


def f32_from_bits(bits) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def f32_bits(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).view(np.uint32)


def next_up(x: np.ndarray) -> np.ndarray:
    x = f32(x)
    return np.nextafter(x, np.float32(np.inf), dtype=np.float32)


def next_down(x: np.ndarray) -> np.ndarray:
    x = f32(x)
    return np.nextafter(x, np.float32(-np.inf), dtype=np.float32)


def exactly_f32(values: np.ndarray) -> np.ndarray:
    """The float64 values that are exactly representable in fp32 (others dropped)."""
    values = np.asarray(values, dtype=np.float64)
    with np.errstate(over="ignore"):
        keep = values.astype(np.float32).astype(np.float64) == values
    return values[keep]


def adversarial_elements(name: str, rng: np.random.Generator, n_random: int = 2000) -> np.ndarray:
    """fp32 inputs around the grid of ``name`` (unscaled): every grid value, every midpoint,
    one fp32 ulp either side of both, random in range, beyond max_norm, fp32 subnormals, +-0."""
    g = grid(name)
    mags = g.mags
    mids = exactly_f32((mags[:-1] + mags[1:]) / 2)
    base = np.concatenate([mags, mids, [mags[-1] * 1.5, mags[-1] * 2, mags[-1] + g.min_positive / 4]])
    base = f32(base)
    pos = np.concatenate([base, next_up(base), next_down(base[base > 0])])
    rand = rng.uniform(0, mags[-1], n_random).astype(np.float32)
    logrand = f32(np.exp2(rng.uniform(np.log2(g.min_positive) - 4, np.log2(mags[-1]) + 1, n_random)))
    sub = f32_from_bits(np.concatenate([[1, 2, 3, 0x400000, 0x7FFFFF], rng.integers(1, 0x800000, 50)]))
    pos = np.concatenate([pos, rand, logrand, sub, f32([0.0])])
    return np.concatenate([pos, -pos]).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# MX block reference


def _floor_log2(a: np.ndarray) -> np.ndarray:
    """floor(log2 a) for positive finite float64 ``a`` (exact, via frexp)."""
    _, e = np.frexp(a)
    return e.astype(np.int64) - 1


def _ceil_log2(a: np.ndarray) -> np.ndarray:
    """ceil(log2 a) for positive finite float64 ``a`` (exact)."""
    m, e = np.frexp(a)
    return np.where(m == 0.5, e - 1, e).astype(np.int64)


def shared_exponent(amax: np.ndarray, name: str, scale_mode: str) -> np.ndarray:
    """Unclamped shared exponent X of blocks with finite fp32 amax ``amax`` (float64 array)."""
    g = grid(name)
    amax = np.asarray(amax, dtype=np.float64)
    safe = np.where(amax > 0, amax, 1.0)
    if scale_mode == "floor":
        return np.where(amax > 0, _floor_log2(safe), -126) - g.emax
    if scale_mode == "even":
        # contract: add half an ulp at the element's mantissa width to the fp32 bits, then floor
        bits = f32_bits(f32(amax)).astype(np.int64) + (1 << (22 - g.mbits))
        overflow = bits >= 0x7F800000
        rounded = f32_from_bits(np.where(overflow, 0, bits).astype(np.uint32)).astype(np.float64)
        e = np.where(overflow, 128, _floor_log2(np.where(rounded > 0, rounded, 1.0)))
        return np.where(amax > 0, e, -126) - g.emax
    if scale_mode == "rceil":
        inv = np.float32(1.0) / np.float32(g.max_norm)
        d = (f32(amax) * inv).astype(np.float64)  # the fp32 product, as Transformer Engine computes it
        return np.where(d > 0, _ceil_log2(np.where(d > 0, d, 1.0)), -127)
    raise ValueError(scale_mode)


@dataclass
class MXReference:
    scale: np.ndarray  # uint8 [..., nblocks], block axis last
    codes: np.ndarray  # int64 [..., nblocks * bs], block axis last, padded
    values: np.ndarray  # float32 dequantized, logical layout


def mx_reference(x: np.ndarray, name: str, block_size: int = 32, axis: int = -1,
                 scale_mode: str = "floor", rounding: str = "even") -> MXReference:
    """Float64 reference of MX quantize/dequantize of fp32 ``x`` along ``axis``."""
    g = grid(name)
    x = np.asarray(x, dtype=np.float32)
    axis = axis % x.ndim
    moved = np.moveaxis(x, axis, -1).astype(np.float64)
    length = moved.shape[-1]
    bs = block_size if block_size > 0 else max(length, 1)
    nblocks = -(-length // bs)
    pad = nblocks * bs - length
    padded = np.concatenate([moved, np.zeros(moved.shape[:-1] + (pad,))], axis=-1)
    blocks = padded.reshape(moved.shape[:-1] + (nblocks, bs))
    finite = np.isfinite(blocks).all(axis=-1)
    safe = np.where(np.isfinite(blocks), blocks, 0.0)
    amax = np.abs(safe).max(axis=-1)
    X = np.clip(shared_exponent(amax, name, scale_mode), -127, 127)
    y = safe * np.exp2(-X.astype(np.float64))[..., None]
    idx, _ = round_mags(np.abs(y), g, rounding)
    negative = np.signbit(y)
    if g.kind == "int":
        negative = negative & (idx > 0)
        mag = g.mags[idx] * 1.0
        vals = np.where(negative, -mag, mag) + 0.0
    else:
        vals = np.copysign(g.mags[idx], y)
    vals = vals * np.exp2(X.astype(np.float64))[..., None]
    codes = g.signed_code(idx, negative)
    vals = np.where(finite[..., None], vals, np.nan)
    codes = np.where(finite[..., None], codes, 0)
    scale = np.where(finite, X + 127, 255).astype(np.uint8)
    with np.errstate(over="ignore"):
        values32 = vals.astype(np.float32)  # RNE: exact, except that 2**128 (rceil at fp32 max) is Inf
    exact = np.isnan(vals) | (values32.astype(np.float64) == vals) | (np.abs(vals) >= 2.0**128)
    assert exact.all(), "reference value not exact in fp32"
    flat = values32.reshape(moved.shape[:-1] + (nblocks * bs,))[..., :length]
    return MXReference(scale=scale, codes=codes.reshape(moved.shape[:-1] + (nblocks * bs,)),
                       values=np.moveaxis(flat, -1, axis))


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """fp32 arrays equal bit for bit, except that any NaN equals any NaN."""
    a = np.asarray(a, dtype=np.float32)
    b = np.asarray(b, dtype=np.float32)
    if a.shape != b.shape:
        return False
    nan = np.isnan(a) & np.isnan(b)
    return bool(np.all(nan | (a.view(np.uint32) == b.view(np.uint32))))


def mismatch_report(x, got, want, limit: int = 8) -> str:
    got = np.asarray(got, dtype=np.float32).ravel()
    want = np.asarray(want, dtype=np.float32).ravel()
    x = np.asarray(x, dtype=np.float32).ravel() if x is not None else None
    bad = ~((np.isnan(got) & np.isnan(want)) | (got.view(np.uint32) == want.view(np.uint32)))
    idx = np.flatnonzero(bad)[:limit]
    rows = [f"{int(bad.sum())} mismatches of {bad.size}"]
    for i in idx:
        xi = f"x={x[i]!r} ({x[i].view(np.uint32):#010x}) " if x is not None and x.size == got.size else ""
        rows.append(f"  [{i}] {xi}got={got[i]!r} want={want[i]!r}")
    return "\n".join(rows)
