"""Large CPU outputs backed by transparent huge pages.

A fresh tensor of tens of MiB is a fresh mapping: every 4 KiB page faults on
its first write. On virtual machines a fault costs microseconds, so filling a
large output can take longer than computing it (benchmarks/NOTES_casts.md).
``madvise(MADV_HUGEPAGE)`` on the
untouched mapping makes the kernel fault it in 2 MiB pages instead. It is
advice only: the values never depend on it, and any failure leaves an ordinary
tensor. Only allocations of at least :data:`MIN_BYTES` are advised: glibc
serves those from a mapping of their own (above its largest mmap threshold), so
the advice never touches memory that other allocations share. This is what
PyTorch's ``THP_MEM_ALLOC_ENABLE=1`` does for every allocation.
"""

from __future__ import annotations

import ctypes
import math
import sys

import torch

ENABLED = True  # set False to allocate plainly
MIN_BYTES = 32 << 20
_HUGE = 2 << 20
_MADV_HUGEPAGE = 14
_madvise = None  # resolved on first use: the libc function, or False


def _thp_madvise_mode() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[madvise]" in f.read()  # "[always]": every mapping gets them already; "[never]": none
    except OSError:
        return False


def _resolve():
    global _madvise
    if _madvise is None:
        _madvise = False
        if sys.platform.startswith("linux") and _thp_madvise_mode():
            try:
                fn = ctypes.CDLL(None, use_errno=True).madvise
                fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                fn.restype = ctypes.c_int
                _madvise = fn
            except (OSError, AttributeError):
                pass
    return _madvise


def empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty(shape, dtype, device)``; a large CPU one is advised to use huge pages before its first write."""
    out = torch.empty(shape, dtype=dtype, device=device)
    nbytes = math.prod(out.shape) * out.element_size()
    if ENABLED and out.device.type == "cpu" and nbytes >= MIN_BYTES:
        madvise = _resolve()
        if madvise:
            start = out.data_ptr()
            lo = (start + _HUGE - 1) & ~(_HUGE - 1)
            hi = (start + nbytes) & ~(_HUGE - 1)
            if hi > lo:
                madvise(lo, hi - lo, _MADV_HUGEPAGE)  # advice: a failure changes nothing
    return out
