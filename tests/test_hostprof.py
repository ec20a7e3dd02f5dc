"""benchmarks/hostprof.py's torch.profiler summary: host time per region from a chrome trace, on a made-up trace
whose answer is known, and on a real profile of a few CPU ops."""

from __future__ import annotations

import pathlib
import re
import sys
import time

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))
import hostprof  # noqa: E402


def _ev(name, ts, dur, tid=1, cat="cpu_op"):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 0, "cat": cat}


def test_own_time_goes_to_the_innermost_region():
    ms = 1000  # trace times are microseconds
    events = [
        _ev("FSDP::all_gather (layers.0)", 0, 100 * ms, cat="user_annotation"),  # own 100 - 30 - 20 = 50
        _ev("aten::empty", 10 * ms, 30 * ms),  # FSDP::all_gather's
        _ev("Torch-Compiled Region: 2/0", 50 * ms, 20 * ms),
        _ev("cuLaunchKernelEx", 55 * ms, 5 * ms, cat="cuda_driver"),  # a launch of the compiled region
        _ev("FSDP::all_gather (layers.1)", 200 * ms, 40 * ms, cat="user_annotation"),  # summed with layers.0
        _ev("autograd::engine::evaluate_function: MmBackward0", 300 * ms, 60 * ms, tid=2),
        _ev("aten::mm", 310 * ms, 10 * ms, tid=2),  # inside the backward node: its region
        _ev("cudaDeviceSynchronize", 400 * ms, 8 * ms, cat="cuda_runtime"),  # outside every region
        _ev("void gemm_kernel", 0, 1000 * ms, tid=7, cat="kernel"),  # GPU time, not host
    ]
    out = hostprof.summarize_trace(events, steps=2, rows=10)
    rows = {m[3]: (float(m[1]), float(m[2])) for m in
            (re.match(r"^\s*([\d.]+)\s+([\d.]+)\s+(.*)$", line) for line in out.splitlines()[2:]) if m
            for m in [(None, *m.groups())]}
    assert rows == {"FSDP::all_gather": (60.0, 0.0), "backward node: MmBackward0": (30.0, 0.0),
                    "compiled: Torch-Compiled Region": (10.0, 0.5), "outside: cudaDeviceSynchronize": (4.0, 0.0)}
    assert "GPU 500.0 ms in 0 kernels a step" in out.splitlines()[0]  # one kernel in 2 steps
    assert out.splitlines()[-1] == "by kind: FSDP 60.0 ms, backward node 30.0 ms, compiled 10.0 ms, outside 4.0 ms"


def _kernel(name, ts, dur, stream):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_gpu_summary_of_a_made_up_trace():
    """Two steps: a GEMM, an amax pass and an inductor kernel (its name says transpose: "other") on stream 7, an
    all-gather on stream 20 over part of them. Busy is the union on the compute stream, idle the rest of the span,
    NCCL's overlap the intersection."""
    events = [_kernel("sm90_xmma_gemm_bf16", 0, 100, 7), _kernel("_tensor_amax_kernel", 150, 50, 7),
              _kernel("ncclDevKernel_AllGather_RING", 50, 200, 20),
              _kernel("triton_poi_fused_add_cat_mul_neg_split_transpose_view_1", 300, 100, 7),  # inductor's: other
              _ev("aten::mm", 0, 10)]
    from profile_fsdp import analyze_events

    k = analyze_events(events, 2)
    assert k["compute_stream"] == 7
    assert k["span_ms"] == pytest.approx(0.2) and k["compute_busy_ms"] == pytest.approx(0.125)
    assert k["compute_idle_ms"] == pytest.approx(0.075)
    assert k["nccl_ms"] == pytest.approx(0.1) and k["nccl_overlap_compute_ms"] == pytest.approx(0.05)
    assert k["categories_ms"] == pytest.approx({"nccl": 0.1, "gemm": 0.05, "other": 0.05, "mx/cast": 0.025})
    text = hostprof.gpu_summary(events, 2)
    assert "compute stream busy 0.1 ms, idle 0.1 ms" in text and "_tensor_amax_kernel" in text
    assert hostprof.gpu_summary([_ev("aten::mm", 0, 10)], 2) == ""  # no kernels (the CPU): nothing to add


def test_host_trace_of_real_ops():
    x = torch.randn(64, 64)
    out = hostprof.host_trace(lambda: (x @ x).sum(), 2, "matmul")
    assert out.startswith("## matmul (2 steps under torch.profiler)")
    assert "outside: aten::matmul" in out or "outside: aten::mm" in out


def test_host_phases_splits_the_step_and_puts_every_wrapper_back():
    from mxtrain.distributed import fsdp as mxf

    before = (torch.Tensor.backward, mxf.MXAllGatherWeight.__dict__["fsdp_pre_all_gather"], mxf._batched_call)
    w = torch.ones(64, 64, requires_grad=True)

    def step():
        loss = (w @ w).sum()
        time.sleep(0.002)  # a forward of at least 2 ms
        loss.backward()
        time.sleep(0.001)  # and 1 ms after it
        w.grad = None

    out = hostprof.host_phases(step, 5)
    assert out["forward"] >= 2.0 and out["after backward"] >= 1.0 and out["backward"] > 0
    assert out["wall"] >= out["forward"] + out["backward"] + out["after backward"] - 1e-6
    assert out["mxtrain pre-all-gather hooks"] == 0.0 and out["calls"] == {}  # no FSDP here: no hook ran
    assert (torch.Tensor.backward, mxf.MXAllGatherWeight.__dict__["fsdp_pre_all_gather"], mxf._batched_call) == before

    def failing():
        raise RuntimeError("step failed")

    with pytest.raises(RuntimeError, match="step failed"):
        hostprof.host_phases(failing, 2)
    assert (torch.Tensor.backward, mxf.MXAllGatherWeight.__dict__["fsdp_pre_all_gather"], mxf._batched_call) == before
    table = hostprof.phases_table([out, out], "demo", 5)
    assert table.splitlines()[0] == "## host phases: demo (5 steps, no profiler, every rank)"
    assert "rank 1" in table and "mxtrain pre-all-gather hooks" not in table  # rows all zero are left out
