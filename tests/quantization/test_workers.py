"""The CPU table paths run their chunks on one-threaded threads: workers and the caller (``_workers``).

The workers must give the bits of the inline loop and of the reference path, run
every chunk exactly once with one torch thread each, hand errors back to the
caller and leave the caller's thread settings alone.
"""

import threading

import pytest
import torch

from mxtrain.quantization import _workers, fake_quantize_mx, lut, quantize_mx


@pytest.fixture
def two_threads():
    """torch with two intra-op threads (the workers' trigger), restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _input(rows: int = 128, length: int = 384) -> torch.Tensor:
    """fp32 rows at scales 2**-140 .. 2**120, with zero, NaN and Inf blocks: > MIN_ELEMENTS elements."""
    g = torch.Generator().manual_seed(25)
    x = torch.randn(rows, length, generator=g) * torch.exp2(torch.randint(-140, 120, (rows, 1), generator=g).float())
    x[3, :40] = 0.0
    x[5, 7] = float("nan")
    x[9, 100] = float("-inf")
    assert x.numel() >= _workers.MIN_ELEMENTS
    return x


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.float()
    return torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t).view(torch.int32)


def _run_all(x, name, rounding):
    q = quantize_mx(x, name, block_size=32, axis=(-1, 0), rounding=rounding)
    out = [t for p in q.planes for t in (p.data, p.scale)]
    out += [_bits(q.dequantize(axis=p.axis)) for p in q.planes]
    out.append(_bits(q.dequantize(torch.bfloat16)))
    out.append(_bits(fake_quantize_mx(x, name, block_size=32, rounding=rounding)))
    return out


@pytest.mark.parametrize("name,chunk", [("fp8_e4m3", 5 * 384), ("fp6_e3m2", 5 * 384), ("fp4_e2m1", 5 * 384),
                                        ("int8", 5 * 384), ("fp8_e4m3", None), ("fp4_e2m1", None)])
def test_workers_give_the_inline_and_reference_bits(name, chunk, two_threads, monkeypatch):
    if chunk:  # many chunks, a ragged last one; None: the default size, cut in one chunk per thread
        monkeypatch.setattr(lut, "LUT_CHUNK_ELEMENTS", chunk)
    x = _input()
    rounding = "nearest" if name == "fp8_e4m3" else "even"
    for xs in (x, x[:, :360], x.to(torch.bfloat16)):  # direct, cropped (ragged block) and non-fp32 outputs
        got = _run_all(xs, name, rounding)
        # one torch thread: the inline loop and the reference (the bits never depend on the count)
        torch.set_num_threads(1)
        inline = _run_all(xs, name, rounding)
        monkeypatch.setattr(lut, "USE_LOOKUP_TABLES", False)
        reference = _run_all(xs, name, rounding)
        monkeypatch.setattr(lut, "USE_LOOKUP_TABLES", True)
        torch.set_num_threads(2)
        for a, b, c in zip(got, inline, reference):
            assert torch.equal(a, b) and torch.equal(a, c)


def _record_chunks(n_chunks=40, elements=1 << 20):
    """``run_chunks`` over ``n_chunks`` one-row chunks: ``(chunk, thread name, torch threads, grad mode)`` each."""
    seen, lock = [], threading.Lock()

    def fn(lo, hi, state):
        state.append(lo)
        with lock:
            seen.append((lo, threading.current_thread().name, torch.get_num_threads(), torch.is_grad_enabled()))

    _workers.run_chunks(fn, [(i, i + 1) for i in range(n_chunks)], elements, list, [torch.empty(1)])
    return seen


def _assert_thread_counts_kept():
    assert torch.get_num_threads() == 2  # the caller's count survives the workers' and its own one-thread calls
    fresh = []
    t = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert fresh == [2]  # and so does the count a new thread starts with


@pytest.mark.parametrize("omp", [True, False])
def test_every_chunk_runs_once_on_a_single_threaded_thread(omp, two_threads, monkeypatch):
    if not omp:  # torch's OpenMP runtime out of reach: fresh workers use torch.set_num_threads(1)
        monkeypatch.setattr(_workers, "_omp", None)
        monkeypatch.setattr(_workers, "_pool", _workers._Pool())
    elif _workers._omp_set_num_threads() is None:
        pytest.skip("torch's omp_set_num_threads is not reachable here")
    seen = _record_chunks()
    assert sorted(s[0] for s in seen) == list(range(40))
    names = {s[1] for s in seen}
    caller = threading.current_thread().name
    assert names <= {"mxtrain-quantize", caller} and (caller not in names or omp)  # without omp the caller waits
    assert {s[2:] for s in seen} == {(1, False)}
    _assert_thread_counts_kept()


def test_small_work_and_one_thread_stay_inline(two_threads):
    caller = threading.current_thread().name
    seen = _record_chunks(2, _workers.MIN_ELEMENTS - 1)
    assert {s[1:3] for s in seen} == {(caller, 2)}  # inline, with torch's threads
    torch.set_num_threads(1)
    seen = _record_chunks(2)
    assert {s[1:3] for s in seen} == {(caller, 1)}


def test_a_chunk_error_reaches_the_caller(two_threads):
    def fn(lo, hi, state):
        if lo == 7:
            raise ValueError("chunk 7 failed")

    with pytest.raises(ValueError, match="chunk 7 failed"):
        _workers.run_chunks(fn, [(i, i + 1) for i in range(20)], 1 << 20, lambda: None, [torch.empty(1)])
    # the workers are still serving
    done = []
    _workers.run_chunks(lambda lo, hi, s: done.append(lo), [(0, 1), (1, 2)], 1 << 20, lambda: None,
                        [torch.empty(1)])
    assert sorted(done) == [0, 1]


def test_inference_mode_outputs(two_threads):
    x = _input()
    expected = quantize_mx(x, "fp8_e4m3").dequantize()
    with torch.inference_mode():
        q = quantize_mx(x, "fp8_e4m3")
        got = q.dequantize()
        fake = fake_quantize_mx(x, "fp8_e4m3")
    assert got.is_inference() and q.planes[0].data.is_inference()
    assert torch.equal(_bits(got), _bits(expected)) and torch.equal(_bits(fake), _bits(expected))
