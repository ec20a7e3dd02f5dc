"""DelayedScaling's per-step update and amax record as registered torch ops, and the update in one Triton kernel (CUDA).

:meth:`mxtrain.quantization.float8.DelayedScalingState.update` pushes each recorded
amax into its slot's history, takes the history's max (or newest), recomputes the
scale (:func:`~mxtrain.quantization.float8.compute_delayed_scale`) and advances the
update count ``gen``, when any slot was recorded (a slot was recorded since the last update when its stamp equals
``gen``): :func:`~mxtrain.quantization.float8.delayed_scaling_update_`, about 20 small
torch ops, none reading the device on the host. At the start of a forward the GPU is
often idle (the previous step has finished), so their launches are paid in full
(benchmarks/RESULTS.md). The kernel here does the same in one launch, with the same fp32
operations in the same order (IEEE divisions), so histories and scales are
bit-identical (tests/float8/test_float8_state_kernel.py).

``mxtrain::delayed_scaling_update`` and ``mxtrain::delayed_scaling_record`` are the
registered forms, mutating the state's tensors in place, which torch.compile sees;
eager code calls the implementations directly (no op dispatch overhead). An amax
all-reduce (``amax_reduction_group``) keeps the eager torch path.
"""

from __future__ import annotations

import torch

from mxtrain.quantization.float8 import (
    delayed_scaling_record_, delayed_scaling_update_, register_delayed_scaling_ops, register_fused_delayed_update,
)

__all__ = ["fused_delayed_update", "delayed_scaling_update", "delayed_scaling_record"]

try:
    import triton
    import triton.language as tl
except ImportError:  # the registered ops need no Triton
    triton = None


def _update_impl(history, scale, gen, fwd_amax, fwd_stamp, grad_amax, grad_stamp, fp8_max, margin, most_recent,
                 power_of_2):
    if history.device.type == "cuda" and fused_delayed_update is not None and history.shape[1]:
        fused_delayed_update(history, scale, gen, fwd_amax, fwd_stamp, grad_amax, grad_stamp, fp8_max, margin,
                             most_recent, power_of_2)
    else:
        delayed_scaling_update_(history, scale, gen, fwd_amax, fwd_stamp, grad_amax, grad_stamp, fp8_max, margin,
                                most_recent, power_of_2)


@torch.library.custom_op("mxtrain::delayed_scaling_update", mutates_args=("history", "scale", "gen"))
def delayed_scaling_update(history: torch.Tensor, scale: torch.Tensor, gen: torch.Tensor, fwd_amax: torch.Tensor,
                           fwd_stamp: torch.Tensor, grad_amax: torch.Tensor, grad_stamp: torch.Tensor,
                           fp8_max: torch.Tensor, margin: int, most_recent: bool, power_of_2: bool) -> None:
    """In place: ``history`` [H, S], ``scale`` [S] of the recorded slots, and ``gen`` += 1 (see module doc).
    Nothing inside a backward: that is a forward recomputed by activation checkpointing, whose update ran in
    the forward (checked when the op runs, so it holds in compiled graphs too)."""
    if torch._C._current_graph_task_id() != -1:
        return
    _update_impl(history, scale, gen, fwd_amax, fwd_stamp, grad_amax, grad_stamp, fp8_max, margin, most_recent,
                 power_of_2)


@delayed_scaling_update.register_fake
def _(history, scale, gen, fwd_amax, fwd_stamp, grad_amax, grad_stamp, fp8_max, margin, most_recent, power_of_2):
    return None


@torch.library.custom_op("mxtrain::delayed_scaling_record", mutates_args=("amax_buf", "stamp"))
def delayed_scaling_record(amax_buf: torch.Tensor, stamp: torch.Tensor, gen: torch.Tensor, index: int,
                           amax: torch.Tensor) -> None:
    """In place: slot ``index`` keeps ``max(amax, amaxes recorded since the last update)`` and is stamped ``gen``."""
    delayed_scaling_record_(amax_buf, stamp, gen, index, amax)


@delayed_scaling_record.register_fake
def _(amax_buf, stamp, gen, index, amax):
    return None


register_delayed_scaling_ops(torch.ops.mxtrain.delayed_scaling_update, torch.ops.mxtrain.delayed_scaling_record)


fused_delayed_update = None
if triton is not None:
    @triton.jit
    def _delayed_update_kernel(hist_ptr, scale_ptr, gen_ptr, fwd_amax_ptr, fwd_stamp_ptr, grad_amax_ptr,
                               grad_stamp_ptr, fmax_ptr, S, H, MDIV, MOST_RECENT: tl.constexpr, POW2: tl.constexpr,
                               BS: tl.constexpr, BH: tl.constexpr):
        col = tl.arange(0, BS)
        cmask = col < S
        gen = tl.load(gen_ptr)
        fwd = (tl.load(fwd_stamp_ptr + col, mask=cmask, other=-1) == gen) & cmask
        bwd = (tl.load(grad_stamp_ptr + col, mask=cmask, other=-1) == gen) & cmask
        rec = fwd | bwd
        amax = tl.where(fwd, tl.load(fwd_amax_ptr + col, mask=cmask, other=0.0),
                        tl.where(bwd, tl.load(grad_amax_ptr + col, mask=cmask, other=0.0), 0.0))
        h = tl.arange(0, BH)
        m2 = (h[:, None] < H) & cmask[None, :]
        old = tl.load(hist_ptr + h[:, None] * S + col[None, :], mask=m2, other=0.0)
        # the history (newest first) of a recorded slot shifts down one row and the new amax enters row 0
        prev = tl.load(hist_ptr + (h[:, None] - 1) * S + col[None, :], mask=m2 & (h[:, None] >= 1), other=0.0)
        new = tl.where(rec[None, :], tl.where(h[:, None] == 0, amax[None, :], prev), old)
        tl.debug_barrier()  # every old row is read before any is overwritten
        tl.store(hist_ptr + h[:, None] * S + col[None, :], new, mask=m2 & rec[None, :])
        if MOST_RECENT:
            a = amax  # slots not recorded keep their scale below
        else:
            a = tl.max(tl.where(m2, new, 0.0), axis=0)  # amaxes are >= 0 (NaN was recorded as +Inf)
        fmax = tl.load(fmax_ptr + col, mask=cmask, other=1.0)
        previous = tl.load(scale_ptr + col, mask=cmask, other=1.0)
        s = tl.math.div_rn(tl.math.div_rn(fmax, a), tl.zeros([BS], tl.float32) + MDIV)
        s = tl.where(s == float("inf"), 3.4028234663852886e38, s)  # FP32 max
        if POW2:
            s = (s.to(tl.int32, bitcast=True) & -8388608).to(tl.float32, bitcast=True)
        keep = (a == 0.0) | (a == float("inf")) | (a != a) | ~rec
        tl.store(scale_ptr + col, tl.where(keep, previous, s), mask=cmask)
        tl.debug_barrier()  # every stamp is compared with gen before it moves on
        tl.store(gen_ptr, gen + tl.max(rec.to(tl.int64), axis=0))  # moves only if a slot was recorded

    def fused_delayed_update(history, scale, gen, fwd_amax, fwd_stamp, grad_amax, grad_stamp, fp8_max, margin: int,
                             most_recent: bool, power_of_2: bool) -> None:
        """:func:`~mxtrain.quantization.float8.delayed_scaling_update_` in one launch (same arguments, same bits)."""
        H, S = history.shape
        _delayed_update_kernel[(1,)](history, scale, gen, fwd_amax, fwd_stamp, grad_amax, grad_stamp, fp8_max, S, H,
                                     float(2.0 ** margin), MOST_RECENT=bool(most_recent), POW2=bool(power_of_2),
                                     BS=triton.next_power_of_2(max(S, 2)), BH=triton.next_power_of_2(max(H, 2)),
                                     num_warps=4)

    from mxtrain.kernels._triton_utils import interpret_mode

    if torch.cuda.is_available() and not interpret_mode():
        register_fused_delayed_update("cuda", fused_delayed_update)
