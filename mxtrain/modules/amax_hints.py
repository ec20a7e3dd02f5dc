"""Known maxima of tensors, so that a per-tensor FP8 cast of them need not read them once more for the amax.

Current scaling casts a tensor in two passes: one reads it for its amax, the next casts it with the scale of
that amax. A kernel that wrote the tensor has already seen every value: :func:`mxtrain.gated_activation`'s
kernels (CUDA) record, beside their output, the max ``|value|`` of each program's piece of each row, a
``[rows, P]`` fp32 tensor. A cast of that very output (``GroupedLinear``: the next GEMM's input in forward,
the previous GEMM's output gradient in backward) reduces those few maxima per expert instead of reading the
tensor (at the Mixtral expert layer's shape: 0.26 ms of the SwiGLU output's and 0.37 ms of its gradient's amax
passes a step on an H100).

A record is bound to the tensor object and to its version: an in-place change of the tensor that bumps its
version (``add_``, ``copy_``, writes under ``torch.no_grad``, through a view too) drops it, and any other tensor, a
view or a copy of it included, has none; a cast that finds none computes the amax itself. Writes that bypass the
version counter (``t.data.mul_()``, ``t.data = other``, a raw kernel writing into ``t``) are not seen: after such a
write, record again or not at all. Inference tensors have no version counter: nothing is recorded for them.
The maxima are exact (the maxima of the values as stored, NaN counted as +Inf as the amax passes count it), so a
cast gives the same bits with or without them.
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = ["record_row_maxima", "row_maxima"]

_RECORDS = WeakTensorKeyDictionary()


def record_row_maxima(t: torch.Tensor, maxima: torch.Tensor) -> None:
    """Record that ``maxima [rows, P]`` (fp32, >= 0, NaN as +Inf) holds, for each row of the 2-D ``t``, the
    maxima of ``|t|`` over P pieces that together cover the row."""
    if t.ndim != 2 or maxima.ndim != 2 or maxima.shape[0] != t.shape[0] or maxima.dtype != torch.float32 \
            or maxima.device != t.device:
        raise ValueError(f"record_row_maxima: maxima must be a float32 [{t.shape[0] if t.ndim else '?'}, P] tensor "
                         f"on {t.device} for a 2-D tensor, got {maxima.dtype} {list(maxima.shape)} on "
                         f"{maxima.device} for {list(t.shape)}")
    if t.is_inference():  # no version counter to bind the record to
        return
    _RECORDS[t] = (t._version, maxima)


def row_maxima(t: torch.Tensor) -> torch.Tensor | None:
    """The maxima recorded for ``t`` (this very tensor, unchanged since), or None."""
    got = None if t.is_inference() else _RECORDS.get(t)
    if got is None:
        return None
    version, maxima = got
    if version != t._version:
        del _RECORDS[t]
        return None
    return maxima
