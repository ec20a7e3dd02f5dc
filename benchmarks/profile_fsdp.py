"""Where an FSDP2 step spends its time and memory, per mode and per rank (bench_fsdp.py's model).

For each mode of ``bench_fsdp.py`` (bf16, mxfp8+bf16ag, mxfp8+mxag) every rank reports:

* **steps**: wall time of each timed step (CUDA synchronized), and the host's *issue*
  time (when ``opt.step()`` returned, before the synchronize). Issue time close to the
  step time means the host, not the GPU, sets the pace.
* **syncs**: host-device synchronizations inside a step, from
  ``torch.cuda.set_sync_debug_mode`` (each stops FSDP's CPU run-ahead), with where they came from.
* **kernels** (torch.profiler, CUDA activity, averaged over the profiled steps): busy time
  per category (GEMM, NCCL, mxtrain casts, other), the compute stream's idle time inside
  the step, NCCL time and how much of it overlaps compute-stream kernels, and the
  kernels on FSDP's side streams (all-gather copy-in: the MX shard quantize).
* **memory**: peak allocated in forward, backward and the optimizer step, and the live
  allocations at the step's peak grouped by the source line that made them (CUDA memory
  history, Python stacks).

    torchrun --nproc_per_node=2 benchmarks/profile_fsdp.py                 # the 2.15 B model of bench_fsdp.py
    torchrun --nproc_per_node=2 benchmarks/profile_fsdp.py --layers 2 --hidden 256 --ffn 1024 --seq 128  # CPU
    ... --trace-dir DIR      # also keep each rank's chrome trace of the profiled steps (gzipped)

Ranks print in turn (rank 0 first); on CPU only the step, issue and host figures apply.
"""

from __future__ import annotations

import argparse
import collections
import gc
import gzip
import json
import os
import re
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fsdp import build, init_distributed, model_arguments  # noqa: E402

import mxtrain  # noqa: E402

GEMM = re.compile(r"gemm|cutlass|nvjet|sm90_xmma|cublas|wgmma", re.IGNORECASE)
NCCL = re.compile(r"nccl", re.IGNORECASE)
# mxtrain's kernels (inductor's own are named triton_..._<origins>: a "transpose" there is a view, not a kernel of ours)
MX = re.compile(r"mx_|_mx|cast|quant|dequant|norm_cast|act|amax_kernel|transpose(_group)?_kernel", re.IGNORECASE)
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")  # blocking


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def one_step(model, opt, recipe, x, marks=None):
    """One training step; ``marks`` (a dict) gets the host times at the end of forward, backward and step."""
    t0 = time.perf_counter()
    with mxtrain.mx_autocast(enabled=recipe is not None, recipe=recipe):
        y = model(x)
    loss = y.float().pow(2).mean()
    if marks is not None:
        marks["forward"] = time.perf_counter() - t0
    loss.backward()
    if marks is not None:
        marks["backward"] = time.perf_counter() - t0
    opt.step()
    opt.zero_grad(set_to_none=True)
    if marks is not None:
        marks["step"] = time.perf_counter() - t0
    return loss


def _merge(intervals):
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def _overlap(a, b):
    """Total length of the intersection of two merged interval lists."""
    i = j = 0
    tot = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        tot += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tot


def analyze_trace(path, steps):
    """Per-step kernel figures (ms) from a chrome trace of ``steps`` profiled steps (:func:`analyze_events`)."""
    with open(path) as f:
        return analyze_events(json.load(f)["traceEvents"], steps)


def analyze_events(events, steps):
    """Per-step kernel figures (ms) from the events of a chrome trace of ``steps`` profiled steps; None without
    kernels. The compute stream is the one whose non-NCCL kernels take longest; its busy time is the union of its
    kernels' intervals, its idle time the rest of the span from the first kernel to the last."""
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    runtime = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"]
    marks = [e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"
             and e.get("name", "").startswith("profiled_step")]
    if not kernels:
        return None
    by_stream = collections.defaultdict(list)
    for k in kernels:
        by_stream[k["args"].get("stream")].append(k)
    cat_time = collections.Counter()
    names = collections.Counter()
    for k in kernels:
        n = k["name"]
        cat = "nccl" if NCCL.search(n) else "gemm" if GEMM.search(n) else "mx/cast" if MX.search(n) else "other"
        cat_time[cat] += k["dur"]
        names[n[:70]] += k["dur"]
    non_nccl = {s: sum(k["dur"] for k in ks if not NCCL.search(k["name"])) for s, ks in by_stream.items()}
    compute = max(non_nccl, key=non_nccl.get)
    comp_iv = _merge([(k["ts"], k["ts"] + k["dur"]) for k in by_stream[compute]])
    nccl_iv = _merge([(k["ts"], k["ts"] + k["dur"]) for k in kernels if NCCL.search(k["name"])])
    span = (min(k["ts"] for k in kernels), max(k["ts"] + k["dur"] for k in kernels))
    busy = sum(e - s for s, e in comp_iv)
    side = {s: v for s, v in non_nccl.items() if s != compute and v > 0}
    syncs = collections.Counter()
    sync_time = collections.Counter()
    for r in runtime:
        if r["name"] in SYNC_CALLS:  # exact names: cudaMemcpyAsync does not block the host
            syncs[r["name"]] += 1
            sync_time[r["name"]] += r["dur"]
    host_steps = [m["dur"] for m in marks]
    per = 1e3 * steps  # us per step -> ms
    return {
        "span_ms": (span[1] - span[0]) / per, "host_step_ms": sum(host_steps) / per if host_steps else float("nan"),
        "compute_stream": compute, "compute_busy_ms": busy / per,
        "compute_idle_ms": ((span[1] - span[0]) - busy) / per,
        "categories_ms": {c: v / per for c, v in cat_time.most_common()},
        "nccl_ms": sum(e - s for s, e in nccl_iv) / per, "nccl_overlap_compute_ms": _overlap(nccl_iv, comp_iv) / per,
        "side_streams_ms": {str(s): v / per for s, v in side.items()},
        "runtime_syncs_per_step": {k: v / steps for k, v in syncs.items()},
        "runtime_sync_ms": {k: v / per for k, v in sync_time.items()},
        "top_kernels_ms": [(n, v / per) for n, v in names.most_common(10)],
    }


def sync_report(model, opt, recipe, x, device):
    """Host-device synchronizations inside one step (CUDA only), by where they were reported."""
    from profile_host import synchronizing_calls

    if device.type != "cuda":
        return {}
    where = collections.Counter(synchronizing_calls(lambda: one_step(model, opt, recipe, x)))
    sync(device)
    return dict(where)


def memory_report(model, opt, recipe, x, device, top=8):
    """Peak allocated per phase (GiB), and what was live at the step's peak by allocation site (MiB)."""
    if device.type != "cuda":
        return {}
    sync(device)
    phases = {}
    torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    with mxtrain.mx_autocast(enabled=recipe is not None, recipe=recipe):
        y = model(x)
    loss = y.float().pow(2).mean()
    sync(device)
    phases["forward_peak"] = torch.cuda.max_memory_allocated(device)
    phases["after_forward"] = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    loss.backward()
    sync(device)
    phases["backward_peak"] = torch.cuda.max_memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync(device)
    phases["optimizer_peak"] = torch.cuda.max_memory_allocated(device)
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    del y, loss
    trace = snap["device_traces"][device.index or 0]
    live, cur, best, best_i = {}, 0, -1, -1
    for i, ev in enumerate(trace):
        a = ev["action"]
        if a == "alloc":
            live[ev["addr"]] = ev["size"]
            cur += ev["size"]
            if cur > best:
                best, best_i = cur, i
        elif a in ("free_requested", "free_completed") and ev["addr"] in live:
            cur -= live.pop(ev["addr"])
    live_at_peak = {}
    for ev in trace[:best_i + 1]:
        if ev["action"] == "alloc":
            live_at_peak[ev["addr"]] = ev
        elif ev["action"] in ("free_requested", "free_completed"):
            live_at_peak.pop(ev["addr"], None)
    groups = collections.Counter()
    for ev in live_at_peak.values():
        groups[_site(ev.get("frames", []))] += ev["size"]
    peak_phase = _site(trace[best_i].get("frames", [])) if best_i >= 0 else None
    return {"base_gib": base / 2**30, **{k: v / 2**30 for k, v in phases.items()},
            "peak_above_base_gib": best / 2**30, "peak_at": peak_phase,
            "live_at_peak_mib": [(k, v / 2**20) for k, v in groups.most_common(top)]}


def _site(frames):
    """The innermost frame in mxtrain, FSDP, the optimizer or this benchmark, as file:line (function)."""
    for f in frames:
        fn = f.get("filename", "")
        if any(k in fn for k in ("mxtrain/", "fsdp/", "torch/optim", "bench_fsdp", "profile_fsdp", "autograd")):
            short = fn.split("site-packages/")[-1].split("/work/")[-1]
            return f"{short}:{f.get('line')} ({f.get('name')})"
    return frames[0].get("filename", "?") + ":" + str(frames[0].get("line")) if frames else "?"


def python_report(model, opt, recipe, x, device, rows, steps=3):
    """The Python functions (and ops) taking the host's time per step, own and inclusive (us)."""
    from profile_host import python_times

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True) as prof:
        for _ in range(steps):
            one_step(model, opt, recipe, x)
        sync(device)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        own, incl, calls = python_times(path)
    return {"own": [(n, v / steps, calls[n] / steps) for n, v in own.most_common(rows)],
            "inclusive": [(n, v / steps, calls[n] / steps) for n, v in incl.most_common(rows)]}


def _guarded(fn, *a):
    """A report, or {"error": ...} when it failed (one report's failure keeps the others)."""
    try:
        return fn(*a)
    except Exception as e:  # noqa: BLE001 - a profiling aid: show what failed and go on
        return {"error": f"{fn.__name__}: {type(e).__name__}: {e}"}


def profile_mode(mode, args, device, rank):
    model, opt, recipe, x = build(mode, args, device, rank)
    for _ in range(args.warmup):
        one_step(model, opt, recipe, x)
    sync(device)
    steps = []
    for _ in range(args.steps):
        marks = {}
        sync(device)
        t0 = time.perf_counter()
        one_step(model, opt, recipe, x, marks)
        issued = time.perf_counter() - t0
        sync(device)
        steps.append((1e3 * (time.perf_counter() - t0), 1e3 * issued, 1e3 * marks["forward"]))
    out = {"mode": mode, "rank": rank, "steps_ms": steps}
    out["syncs"] = sync_report(model, opt, recipe, x, device)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                    if device.type == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        for i in range(args.profile_steps):
            with torch.profiler.record_function(f"profiled_step{i}"):
                one_step(model, opt, recipe, x)
            sync(device)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        out["kernels"] = _guarded(analyze_trace, path, args.profile_steps)
        if args.trace_dir:
            os.makedirs(args.trace_dir, exist_ok=True)
            with open(path, "rb") as src, gzip.open(os.path.join(args.trace_dir, f"{mode}_rank{rank}.json.gz"),
                                                    "wb") as dst:
                dst.write(src.read())
    out["memory"] = _guarded(memory_report, model, opt, recipe, x, device)
    if args.python_rows:
        out["python"] = _guarded(python_report, model, opt, recipe, x, device, args.python_rows)
    del model, opt, x
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def fmt(r):
    lines = [f"== {r['mode']} rank {r['rank']}"]
    st = r["steps_ms"]
    lines.append("  steps ms (wall / issued / forward issued): " +
                 "  ".join(f"{w:.1f}/{i:.1f}/{f:.1f}" for w, i, f in st))
    w = sorted(s[0] for s in st)
    lines.append(f"  step median {w[len(w) // 2]:.1f} ms, min {w[0]:.1f}, max {w[-1]:.1f}")
    if r["syncs"]:
        lines.append("  host syncs in one step: " + ", ".join(f"{k} x{v}" for k, v in r["syncs"].items()))
    else:
        lines.append("  host syncs in one step: none")
    for key in ("kernels", "memory", "python"):
        if r.get(key) and "error" in r[key]:
            lines.append(f"  {key} report failed: {r[key]['error']}")
            r = {**r, key: None}
    k = r.get("kernels")
    if k:
        lines.append(f"  profiled: host {k['host_step_ms']:.1f} ms/step, GPU span {k['span_ms']:.1f}, compute stream "
                     f"{k['compute_stream']} busy {k['compute_busy_ms']:.1f} idle {k['compute_idle_ms']:.1f}")
        lines.append("  kernel ms/step: " + ", ".join(f"{c} {v:.1f}" for c, v in k["categories_ms"].items()) +
                     f"; nccl {k['nccl_ms']:.1f} of which over compute {k['nccl_overlap_compute_ms']:.1f}")
        lines.append("  side streams (non-NCCL kernels) ms/step: " +
                     (", ".join(f"{s}: {v:.2f}" for s, v in k["side_streams_ms"].items()) or "none"))
        if k["runtime_syncs_per_step"]:
            lines.append("  runtime sync calls/step: " + ", ".join(
                f"{n} x{c:.0f} ({k['runtime_sync_ms'][n]:.2f} ms)" for n, c in k["runtime_syncs_per_step"].items()))
        if r["rank"] == 0:
            lines += [f"    {v:7.2f}  {n}" for n, v in k["top_kernels_ms"]]
    m = r.get("memory")
    if m:
        lines.append(f"  memory GiB: base {m['base_gib']:.2f}, forward peak {m['forward_peak']:.2f}, after forward "
                     f"{m['after_forward']:.2f}, backward peak {m['backward_peak']:.2f}, optimizer peak "
                     f"{m['optimizer_peak']:.2f}; step peak {m['peak_above_base_gib']:.2f} above base, last "
                     f"allocation before it at {m['peak_at']}")
        lines += [f"    {v:8.1f} MiB  {s}" for s, v in m["live_at_peak_mib"]]
    py = r.get("python")
    if py and r["rank"] == 0:
        for key in ("own", "inclusive"):
            lines.append(f"  Python by {key} time (us/step under the tracer, calls/step):")
            lines += [f"    {v:9.1f} x{c:6.1f}  {n}" for n, v, c in py[key]]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_arguments(p, steps=6)
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--trace-dir", default=None)
    p.add_argument("--python-rows", type=int, default=0,
                   help="also list the Python functions taking rank 0's host time (torch.profiler's Python tracer)")
    p.add_argument("--json", default=None, help="rank 0 writes every rank's figures here")
    args = p.parse_args()
    device = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for mode in (m.strip() for m in args.modes.split(",")):
        mine = profile_mode(mode, args, device, rank)
        every = [None] * world
        dist.all_gather_object(every, mine)
        results += every
        if rank == 0:
            for r in every:
                print(fmt(r), flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "world": world, "torch": torch.__version__, "results": results}, f,
                      indent=1, default=str)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
