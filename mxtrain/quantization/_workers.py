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

Each worker calls ``torch.set_num_threads(1)`` once when it starts; that call also
sets process-wide defaults (the count new threads start with, the pthreadpool
size), which the thread that started the workers restores right away to its own
count. Set :data:`ENABLED` to False to run every chunk inline on the calling
thread, as before.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence

import torch

ENABLED = True
# at::internal::GRAIN_SIZE: torch runs an op of fewer elements inline, without a team, anyway
MIN_ELEMENTS = 1 << 15

_local = threading.local()


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
        torch.set_num_threads(1)  # this thread's ops run inline: no team, no barrier
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
    dispatch modes and outside a worker. Otherwise, or with one thread, they run
    inline here. Exceptions from ``fn`` are re-raised here.
    """
    threads = torch.get_num_threads()
    if threads <= 1 or elements < MIN_ELEMENTS or not chunks or not _usable(tensors):
        state = make_state()
        for lo, hi in chunks:
            fn(lo, hi, state)
        return
    n = min(threads, len(chunks))
    pool = _pool
    pool.ensure(n)
    job = _Job(fn, chunks, make_state)
    for _ in range(n):
        pool.jobs.put(job)
    job.wait()
