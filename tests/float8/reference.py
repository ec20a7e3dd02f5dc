"""Hand-written FP8 references for the tests: scales, casts (via ml_dtypes), blocks, delayed scaling.

Nothing here calls mxtrain's FP8 code: scales are plain fp32 arithmetic in numpy,
power-of-two rounding uses math.frexp, casts go through ml_dtypes, blocks are
looped over one by one and the delayed-scaling history is a Python list.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import torch

F32_MAX = float(np.finfo(np.float32).max)
FMAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
NP_FP8 = {"fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2}
TORCH_FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def f32(v) -> float:
    return float(np.float32(v))


def ref_pow2_floor(s: float) -> float:
    _, e = math.frexp(s)
    return math.ldexp(0.5, e)


def _quotient(fmax: float, amax: float, margin: int = 0) -> float:
    with np.errstate(over="ignore"):
        s = np.float32(fmax) / np.float32(amax) / np.float32(2.0 ** margin)
    return F32_MAX if np.isinf(s) else float(s)


def ref_current_scale(amax: float, fmax: float, pow2=False, eps=0.0) -> float:
    """Transformer Engine's compute_scale_from_amax, by hand in fp32."""
    amax = max(amax, eps) if not math.isnan(amax) else amax
    if amax == 0 or not math.isfinite(amax):
        return 1.0
    s = _quotient(fmax, amax)
    return ref_pow2_floor(s) if pow2 else s


def np_cast(x: np.ndarray, scale: float, fmt: str) -> np.ndarray:
    """ml_dtypes' float8 cast of clamp(x * scale, ±max), back in fp32."""
    v = np.clip(x.astype(np.float32) * np.float32(scale), -FMAX[fmt], FMAX[fmt])
    return v.astype(NP_FP8[fmt]).astype(np.float32)


def ref_block_quantize(x: np.ndarray, block, fmt, pow2, eps=0.0):
    """(fp8 values, scale_inv) of a 2-D array, one block at a time."""
    br, bc = block
    rows, cols = x.shape
    vals = np.zeros((rows, cols), np.float32)
    sinv = np.zeros((-(-rows // br), -(-cols // bc)), np.float32)
    for i in range(0, rows, br):
        for j in range(0, cols, bc):
            tile = x[i:i + br, j:j + bc].astype(np.float32)
            s = ref_current_scale(float(np.abs(tile).max()), FMAX[fmt], pow2, eps)
            vals[i:i + br, j:j + bc] = np_cast(tile, s, fmt)
            sinv[i // br, j // bc] = np.float32(1.0) / np.float32(s)
    return vals, sinv


def fq_tensor(t: torch.Tensor, fmt: str, scale: float) -> torch.Tensor:
    """fp32 values of ``t`` cast with one scale: fp8 values times fp32(1 / scale)."""
    vals = np_cast(t.detach().float().numpy(), scale, fmt)
    return torch.from_numpy(vals) * torch.tensor(np.float32(1.0) / np.float32(scale))


def fq_blocks(t: torch.Tensor, fmt: str, block, pow2: bool, axis: int) -> torch.Tensor:
    """fp32 values of ``t`` cast in blocks lying along ``axis`` (its columnwise plane: blocks of the transpose)."""
    src = t.detach().float().numpy()
    if axis == 0 and block[0] != block[1]:
        vals, sinv = ref_block_quantize(src.T, block, fmt, pow2)
        return _expand(vals, sinv, block).T
    vals, sinv = ref_block_quantize(src, block, fmt, pow2)
    return _expand(vals, sinv, block)


def _expand(vals, sinv, block):
    br, bc = block
    s = np.repeat(np.repeat(sinv, br, 0)[:vals.shape[0]], bc, 1)[:, :vals.shape[1]]
    return torch.from_numpy(vals * s)


class RefDelayed:
    """Transformer Engine's delayed scaling of one tensor by hand: a list of amaxes, newest last."""

    def __init__(self, fmax, history_len, algo, margin, pow2=False):
        self.fmax, self.len, self.algo, self.margin, self.pow2 = fmax, history_len, algo, margin, pow2
        self.amaxes, self.scale, self.pending = [], 1.0, None

    def first_scale(self, amax: float) -> float:
        """mxtrain's departure from Transformer Engine: before any amax has entered the history, the scale comes
        from the tensor cast (TE casts with 1 there)."""
        if amax == 0 or not math.isfinite(amax):
            return self.scale
        s = _quotient(self.fmax, amax, self.margin)
        return ref_pow2_floor(s) if self.pow2 else s

    def record(self, amax: float) -> None:
        self.pending = amax if self.pending is None else max(self.pending, amax)

    def update(self) -> None:
        if self.pending is None:
            return
        self.amaxes = (self.amaxes + [self.pending])[-self.len:]
        self.pending = None
        a = max(self.amaxes) if self.algo == "max" else self.amaxes[-1]
        if a == 0 or not math.isfinite(a):
            return
        s = _quotient(self.fmax, a, self.margin)
        self.scale = ref_pow2_floor(s) if self.pow2 else s


class RefQuantizer:
    """GEMM operand fake-quantization of an FP8 recipe, slot by slot (``"fc1.input"``, ``"weight"``...)."""

    def __init__(self, recipe):
        self.recipe = recipe
        self.delayed: dict[str, RefDelayed] = {}

    def fmt(self, slot: str) -> str:
        grad = slot.endswith("grad_output")
        return "fp8_e5m2" if (grad and self.recipe.fp8_format == "hybrid") else "fp8_e4m3"

    def begin_step(self) -> None:
        for ref in self.delayed.values():
            ref.update()

    def __call__(self, t: torch.Tensor, slot: str, axis: int) -> torch.Tensor:
        r, fmt = self.recipe, self.fmt(slot)
        t = t.detach().float()
        if r.scaling == "current":
            amax = f32(t.abs().max().item())
            return fq_tensor(t, fmt, ref_current_scale(amax, FMAX[fmt], r.power_of_2_scales, r.amax_epsilon))
        if r.scaling == "block":
            block = (128, 128) if slot.endswith("weight") else (1, 128)
            return fq_blocks(t, fmt, block, r.power_of_2_scales, axis)
        ref = self.delayed.get(slot)
        if ref is None:
            ref = self.delayed[slot] = RefDelayed(FMAX[fmt], r.amax_history_len, r.amax_compute_algo, r.margin,
                                                  r.power_of_2_scales)
        amax = f32(t.abs().max().item())
        ref.record(amax)
        return fq_tensor(t, fmt, ref.first_scale(amax) if not ref.amaxes else ref.scale)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.detach().double(), expected.detach().double()
    return ((a - e).norm() / e.norm()).item() if e.norm() > 0 else (a - e).norm().item()
