"""Chunked CPU work handed to single-threaded worker threads instead of torch's per-op thread teams.

The table paths of :mod:`mxtrain.quantization.lut` run about fifteen small ops per
cache-sized chunk. With torch's intra-op threads every one of them is an OpenMP
parallel region that ends in a barrier; when another process holds a core, a
thread of the team is descheduled and the barrier waits out a scheduler time
slice, op after op (a 4096 x 4096 quantize + dequantize took 2-14 s instead of
0.2 s on two busy cores). Here the chunks are handed out one at a time to worker
threads whose torch ops run single-threaded (inline, no team): a descheduled
worker delays only the chunk it holds while the others take the rest, and on an
idle machine the workers still use every core torch would. The chunks and the ops
on each are those of the inline loop, so the results are the same bits.

The calling thread takes chunks too, with its OpenMP thread count set to one for
the call (``omp_set_num_threads`` is per thread: nothing else changes), so a
small call is done before a worker has woken up. The workers set theirs the same
way. Where torch's OpenMP runtime cannot be reached that way (another threading
backend), the workers call ``torch.set_num_threads(1)`` once when they start,
which also sets process-wide defaults (the count new threads start with, the
pthreadpool size) that the starting thread restores right away, and the caller
only waits. Set :data:`ENABLED` to False to run every chunk inline on the
calling thread with torch's threads, as before 2026-11-25.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
from collections.abc import Callable, Sequence

import torch

ENABLED = True
# at::internal::GRAIN_SIZE: torch runs an op of fewer elements inline, without a team, anyway
MIN_ELEMENTS = 1 << 15

_local = threading.local()
_OMP_UNRESOLVED = object()
_omp = _OMP_UNRESOLVED  # ctypes omp_set_num_threads of torch's OpenMP runtime, or None


def _omp_set_num_threads():
    """torch's ``omp_set_num_threads`` (this thread's count only), or None where it cannot be found
    or torch does not follow it (checked once, on the calling thread)."""
    global _omp
    if _omp is _OMP_UNRESOLVED:
        fn = None
        try:
            fn = ctypes.CDLL(None).omp_set_num_threads
            fn.argtypes, fn.restype = [ctypes.c_int], None
            threads = torch.get_num_threads()
            fn(1)
            follows = torch.get_num_threads() == 1
            fn(threads)
            if not follows or torch.get_num_threads() != threads:
                fn = None
        except (OSError, AttributeError):
            fn = None
        _omp = fn
    return _omp


class _Job:
    """One call's chunks, taken one at a time by whichever workers join."""

    def __init__(self, fn: Callable, chunks: Sequence[tuple[int, int]], make_state: Callable):
        self.fn, self.chunks, self.make_state = fn, chunks, make_state
        self.inference = torch.is_inference_mode_enabled()
        self.cond = threading.Condition()
        self.next = self.active = 0
        self.error: BaseException | None = None

    def _take(self) -> int | None:
        with self.cond:
            if self.error is not None or self.next >= len(self.chunks):
                return None
            i, self.next = self.next, self.next + 1
            return i

    def join(self) -> None:
        with self.cond:
            self.active += 1
        try:
            # grad and inference mode are per thread: the caller's outputs may be inference tensors
            with torch.inference_mode(self.inference), torch.no_grad():
                state = None
                while (i := self._take()) is not None:
                    if state is None:
                        state = self.make_state()
                    self.fn(*self.chunks[i], state)
        except BaseException as exc:  # handed to the caller, which re-raises it
            with self.cond:
                self.error = self.error or exc
        finally:
            with self.cond:
                self.active -= 1
                self.cond.notify_all()

    def wait(self) -> None:
        with self.cond:
            while self.active or (self.error is None and self.next < len(self.chunks)):
                self.cond.wait()
        if self.error is not None:
            raise self.error


class _Pool:
    def __init__(self):
        self.lock = threading.Lock()
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.size = 0

    def _work(self, ready: threading.Event) -> None:
        torch.get_num_threads()  # torch's lazy per-thread init first, or it would undo the next line later
        omp = _omp_set_num_threads()
        if omp is not None:
            omp(1)  # this thread's ops run inline: no team, no barrier
        else:
            torch.set_num_threads(1)
        _local.worker = True
        ready.set()
        while True:
            self.jobs.get().join()

    def ensure(self, n: int) -> None:
        """Start workers until there are ``n``."""
        with self.lock:
            if self.size >= n:
                return
            threads = torch.get_num_threads()
            for _ in range(n - self.size):
                ready = threading.Event()
                threading.Thread(target=self._work, args=(ready,), name="mxtrain-quantize", daemon=True).start()
                ready.wait()
                self.size += 1
            if _omp_set_num_threads() is None:
                torch.set_num_threads(threads)  # undo the process-wide part of the workers' set_num_threads(1)


_pool = _Pool()


def _reset_after_fork() -> None:
    global _pool
    _pool = _Pool()  # a forked child has none of the parent's threads


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def _usable(tensors: Sequence[torch.Tensor]) -> bool:
    return (ENABLED and not getattr(_local, "worker", False)
            and all(type(t) is torch.Tensor and t.device.type == "cpu" for t in tensors)
            and torch._C._len_torch_dispatch_stack() == 0  # a dispatch mode sees only its own thread's ops
            and not torch._C._is_torch_function_mode_enabled())


def run_chunks(fn: Callable[[int, int, object], None], chunks: Sequence[tuple[int, int]], elements: int,
               make_state: Callable[[], object], tensors: Sequence[torch.Tensor]) -> None:
    """Call ``fn(lo, hi, state)`` for every ``(lo, hi)`` in ``chunks``, each chunk exactly once.

    ``fn`` must write only its own chunk's part of the outputs. ``state`` (from
    ``make_state()``) is private to one thread, e.g. its scratch buffers.
    ``elements`` (the work in all) and ``tensors`` (the inputs and outputs) decide
    whether workers run the chunks: only for plain CPU tensors of at least
    :data:`MIN_ELEMENTS` elements, when torch has more than one thread, outside
    dispatch modes and outside a worker; the calling thread takes chunks as well
    (one-threaded for the call), up to one thread per torch thread in all.
    Otherwise the chunks run inline here, with torch's threads. Exceptions from
    ``fn`` are re-raised here.
    """
    threads = torch.get_num_threads()
    if threads <= 1 or elements < MIN_ELEMENTS or not chunks or not _usable(tensors):
        state = make_state()
        for lo, hi in chunks:
            fn(lo, hi, state)
        return
    n = min(threads, len(chunks))
    omp = _omp_set_num_threads()
    helpers = n - 1 if omp is not None else n  # with omp, the caller is one of the n
    pool = _pool
    job = _Job(fn, chunks, make_state)
    if helpers:
        pool.ensure(helpers)
        for _ in range(helpers):
            pool.jobs.put(job)
    if omp is not None:
        omp(1)
        try:
            job.join()
        finally:
            omp(threads)
    job.wait()
