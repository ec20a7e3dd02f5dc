"""DelayedScaling's per-step update in one Triton kernel (CUDA).

:meth:`mxtrain.quantization.float8.DelayedScalingState.update` pushes each recorded
amax into its slot's history, takes the history's max (or newest), recomputes the
scale (:func:`~mxtrain.quantization.float8.compute_delayed_scale`) and clears the
pending amaxes: about 25 small torch ops. At the start of a forward the GPU is
often idle (the previous step has finished), so their launches are paid in full
(benchmarks/RESULTS.md). This kernel does
the same in one launch, with the same fp32 operations in the same order (IEEE
divisions), so histories and scales are bit-identical (tests/float8/test_float8_state_kernel.py).
An amax all-reduce (``amax_reduction_group``) keeps the torch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mxtrain.kernels._triton_utils import interpret_mode
from mxtrain.quantization.float8 import register_fused_delayed_update

__all__ = ["fused_delayed_update"]



@triton.jit
def _delayed_update_kernel(hist_ptr, pend_ptr, scale_ptr, idx_ptr, fmax_ptr, R, H, S, MDIV,
                           MOST_RECENT: tl.constexpr, POW2: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr):
    r = tl.arange(0, BR)
    rmask = r < R
    col = tl.load(idx_ptr + r, mask=rmask, other=0)
    amax = tl.load(pend_ptr + col, mask=rmask, other=0.0)
    h = tl.arange(0, BH)
    m2 = (h[:, None] < H) & rmask[None, :]
    # the history (newest first) shifts down one row and the new amax enters row 0
    prev = tl.load(hist_ptr + (h[:, None] - 1) * S + col[None, :], mask=m2 & (h[:, None] >= 1), other=0.0)
    new = tl.where(h[:, None] == 0, amax[None, :], prev)
    tl.debug_barrier()  # every old row is read before any is overwritten
    tl.store(hist_ptr + h[:, None] * S + col[None, :], new, mask=m2)
    if MOST_RECENT:
        a = amax
    else:
        a = tl.max(tl.where(m2, new, 0.0), axis=0)  # amaxes are >= 0 (NaN was recorded as +Inf)
    fmax = tl.load(fmax_ptr + r, mask=rmask, other=1.0)
    previous = tl.load(scale_ptr + col, mask=rmask, other=1.0)
    s = tl.math.div_rn(tl.math.div_rn(fmax, a), tl.zeros([BR], tl.float32) + MDIV)
    s = tl.where(s == float("inf"), 3.4028234663852886e38, s)  # FP32 max
    if POW2:
        s = (s.to(tl.int32, bitcast=True) & -8388608).to(tl.float32, bitcast=True)
    keep = (a == 0.0) | (a == float("inf")) | (a != a)
    tl.store(scale_ptr + col, tl.where(keep, previous, s), mask=rmask)
    tl.store(pend_ptr + col, tl.zeros([BR], tl.float32), mask=rmask)


def fused_delayed_update(history: torch.Tensor, pending: torch.Tensor, scale: torch.Tensor, idx: torch.Tensor,
                         fp8_max: torch.Tensor, recipe) -> None:
    """In-place update of the recorded slots ``idx`` (see module doc); ``fp8_max`` is aligned with ``idx``."""
    H, S = history.shape
    R = idx.numel()
    _delayed_update_kernel[(1,)](history, pending, scale, idx, fp8_max.float(), R, H, S, float(2.0 ** recipe.margin),
                                 MOST_RECENT=recipe.amax_compute_algo == "most_recent",
                                 POW2=bool(recipe.power_of_2_scales), BR=triton.next_power_of_2(max(R, 2)),
                                 BH=triton.next_power_of_2(max(H, 2)), num_warps=4)


if torch.cuda.is_available() and not interpret_mode():
    register_fused_delayed_update("cuda", fused_delayed_update)
