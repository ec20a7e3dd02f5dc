"""Where the host's time goes while it issues training steps: cProfile over a few steps, two short tables.

Used by ``bench_e2e.py --host-profile`` and ``bench_moe.py --host-profile``. The steps run back to back with one
synchronisation before and after (so the profile is the host's issue, not a wait for the GPU, as long as the GPU
keeps up); cProfile's own overhead inflates every figure (roughly 2x on calls of a few microseconds), so read the
ranking, not the absolute times. ``--host-profile-out DIR`` also keeps each profile as a ``.prof`` file
(``python -m pstats`` or snakeviz read it). On Python 3.12, whose cProfile rides ``sys.monitoring``, the profile
also holds the autograd engine's device thread (where a CUDA backward's Python runs); on 3.11 that thread's work
appears as the one ``run_backward`` call that waits for it.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import re


def _name(func: tuple) -> str:
    path, line, name = func
    if path == "~":  # a builtin: "<method 'x' of 'y' objects>" or "<built-in method torch.foo>"
        return re.sub(r"^<(?:built-in method|method) ", "", name).rstrip(">")
    parts = path.replace("\\", "/").split("/")
    # from the last package folder named in the path (site-packages/triton, not /opt/torch/.venv above it)
    at = [i for i, part in enumerate(parts) if part in ("mxtrain", "torch", "triton", "torchao", "transformers")]
    parts = parts[at[-1]:] if at else parts[-2:]
    return f"{'/'.join(parts)}:{line}({name})"


def host_profile(step, steps: int, label: str, rows: int = 25, sync=None, out_dir: str | None = None) -> str:
    """cProfile ``steps`` calls of ``step``; returns (and the caller prints) the top ``rows`` functions by own time
    and by inclusive time, per step, in milliseconds."""
    if sync is not None:
        sync()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    if sync is not None:
        sync()
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        prof.dump_stats(os.path.join(out_dir, re.sub(r"[^A-Za-z0-9_.-]", "_", label) + ".prof"))
    stats = pstats.Stats(prof, stream=io.StringIO())
    table = stats.stats  # {func: (primitive calls, calls, own s, inclusive s, callers)}
    total = sum(v[2] for v in table.values())
    calls = sum(v[1] for v in table.values())
    lines = [f"## host profile: {label} ({steps} steps under cProfile): {1e3 * total / steps:.1f} ms of "
             f"profiled time and {calls // steps} calls a step"]
    for title, key in (("own", 2), ("inclusive", 3)):
        lines.append(f"{'ms/step ' + title:>16} {'calls/step':>11}  function")
        for func, v in sorted(table.items(), key=lambda kv: -kv[1][key])[:rows]:
            lines.append(f"{1e3 * v[key] / steps:16.2f} {v[1] / steps:11.1f}  {_name(func)}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- torch.profiler: host time by region

# Regions that own the host time of the ops under them (the innermost one wins): FSDP2's annotations, the compiled
# graphs' runtime, the optimizer, and autograd's backward nodes. Anything under none of them is "outside", by the
# name of its outermost event.
_REGIONS = (
    (re.compile(r"^FSDP::"), None),
    (re.compile(r"^(Torch-Compiled Region|CompiledFunctionBackward|CompiledFunction)\b"), "compiled: {}"),
    (re.compile(r"^Optimizer\."), "optimizer"),
    (re.compile(r"^autograd::engine::evaluate_function: (\w+)"), "backward node: {}"),
)
_LAUNCH = re.compile(r"^(cudaLaunchKernel|cuLaunchKernel|cudaLaunchKernelExC|cuLaunchKernelEx)")


def _region(name: str) -> str | None:
    for pattern, fmt in _REGIONS:
        m = pattern.match(name)
        if m:
            if fmt is None:  # FSDP2's, less the module it names ("FSDP::all_gather (layers.3)"): summed over units
                return re.sub(r"\s*(\(.*\)| for .*)$", "", name)
            return fmt.format(m.group(1)) if m.groups() else fmt
    return None


def summarize_trace(events: list, steps: int, rows: int = 30) -> str:
    """Host time per region from a chrome trace's complete events (``ph == "X"``): each CPU event's own time (its
    duration less its children's) goes to the innermost region around it, per thread; kernel launches are counted
    with it. Returns the table (ms per step)."""
    by_tid: dict = {}
    gpu_ms, kernels = 0.0, 0
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        cat = e.get("cat", "")
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            gpu_ms += e["dur"] / 1e3
            kernels += cat == "kernel"
            continue
        if cat not in ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver", "python_function"):
            continue
        by_tid.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    own: dict = {}
    launches: dict = {}
    busy: dict = {}
    for tid, evs in by_tid.items():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list = []  # (end, region, event index)
        child = [0.0] * len(evs)
        regions = [None] * len(evs)
        top = 0.0
        for i, e in enumerate(evs):
            while stack and stack[-1][0] <= e["ts"]:
                stack.pop()
            parent = stack[-1] if stack else None
            if parent is not None:
                child[parent[2]] += e["dur"]
            else:
                top += e["dur"]
            r = _region(e["name"])
            if r is None:
                r = parent[1] if parent is not None else f"outside: {e['name'][:60]}"
            regions[i] = r
            stack.append((e["ts"] + e["dur"], r, i))
        busy[tid] = top
        for i, e in enumerate(evs):
            own[regions[i]] = own.get(regions[i], 0.0) + max(e["dur"] - child[i], 0.0)
            if _LAUNCH.match(e["name"]):
                launches[regions[i]] = launches.get(regions[i], 0) + 1
    total = sum(own.values())
    lines = [f"## host trace: {total / 1e3 / steps:.1f} ms of host time a step over {len(by_tid)} threads "
             f"(" + ", ".join(f"{v / 1e3 / steps:.1f}" for v in sorted(busy.values(), reverse=True)[:3])
             + f" ms busy on the busiest); GPU {gpu_ms / steps:.1f} ms in {kernels // steps} kernels a step",
             f"{'ms/step':>9} {'launches':>9}  region"]
    for r, t in sorted(own.items(), key=lambda kv: -kv[1])[:rows]:
        lines.append(f"{t / 1e3 / steps:9.2f} {launches.get(r, 0) / steps:9.1f}  {r}")
    groups: dict = {}
    for r, t in own.items():
        g = r.split(":")[0] if r.startswith(("FSDP::", "compiled:", "backward node:", "outside:")) else r
        groups[g] = groups.get(g, 0.0) + t
    lines.append("by kind: " + ", ".join(f"{g} {t / 1e3 / steps:.1f} ms"
                                         for g, t in sorted(groups.items(), key=lambda kv: -kv[1])))
    return "\n".join(lines)


def host_trace(step, steps: int, label: str, rows: int = 30, sync=None, out_dir: str | None = None) -> str:
    """torch.profiler over ``steps`` calls of ``step`` (CPU ops and annotations, plus CUDA where there is one):
    host time per region (``summarize_trace``). Its overhead per recorded op is about a microsecond, far below
    cProfile's per Python call, so the regions' shares are close to the unprofiled host's. ``out_dir`` keeps the
    chrome trace (gzipped)."""
    import gzip
    import json
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    if sync is not None:
        sync()
    with profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        if sync is not None:
            sync()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with gzip.open(os.path.join(out_dir, re.sub(r"[^A-Za-z0-9_.-]", "_", label) + ".json.gz"), "wt") as f:
            json.dump(trace, f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return (f"## {label} ({steps} steps under torch.profiler)\n" + summarize_trace(events, steps, rows)
            + gpu_summary(events, steps))


def gpu_summary(events, steps: int) -> str:
    """The GPU side of a profiled trace, a step (``profile_fsdp.analyze_events``): the kernels' span, the compute
    stream's busy and idle time (busy well under the step: the GPU waits for the host), kernel time by category,
    NCCL time and its overlap with the compute stream. Empty without CUDA kernels."""
    from profile_fsdp import analyze_events  # benchmarks/ is on sys.path

    k = analyze_events(events, steps)
    if k is None:
        return ""
    cats = ", ".join(f"{c} {v:.1f}" for c, v in k["categories_ms"].items())
    return (f"\nGPU a step: kernels span {k['span_ms']:.1f} ms; compute stream busy {k['compute_busy_ms']:.1f} ms, "
            f"idle {k['compute_idle_ms']:.1f} ms; kernel ms by kind: {cats}; NCCL {k['nccl_ms']:.1f} ms "
            f"({k['nccl_overlap_compute_ms']:.1f} over compute)\n"
            + "".join(f"  {v:8.2f} ms  {n}\n" for n, v in k["top_kernels_ms"]))


# --------------------------------------------------------------------------- unprofiled: host time by phase

_INHERITED = object()  # a timed method the class inherits: removed from it again afterwards


def _phase_targets() -> list:
    """``(owner, attribute, label)`` of the callables ``host_phases`` times: mxtrain's FSDP2 hooks and FSDP2's own
    steps (private names of torch's FSDP2: those a torch version lacks are left out)."""
    targets = []
    try:
        from mxtrain.distributed import fsdp as mxf
    except ImportError:
        mxf = None
    if mxf is not None:
        targets += [(mxf.MXAllGatherWeight, "fsdp_pre_all_gather", "mxtrain pre-all-gather hooks"),
                    (mxf.MXAllGatherWeight, "fsdp_post_all_gather", "mxtrain post-all-gather hooks"),
                    (mxf, "_batched_call", "mxtrain batched FP8 casts"),
                    (mxf, "transpose_bytes", "mxtrain dgrad transposes"),
                    (mxf, "transpose_bytes_many", "mxtrain dgrad transposes, a group a launch")]
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg
    except ImportError:
        pg = None
    if pg is not None:
        targets += [(pg, "foreach_all_gather", "FSDP2 all-gathers (with pre-gather hooks)"),
                    (pg, "foreach_all_gather_copy_out", "FSDP2 copy-outs (with post-gather hooks)"),
                    (pg, "foreach_reduce", "FSDP2 reduce-scatters")]
        group = getattr(pg, "FSDPParamGroup", None)
        for name in ("pre_forward", "post_forward", "pre_backward", "post_backward"):
            targets.append((group, name, f"FSDP2 {name} (nests the above)"))
    return [(o, n, label) for o, n, label in targets if o is not None and callable(getattr(o, n, None))]


def host_phases(step, steps: int, sync=None) -> dict:
    """``steps`` calls of ``step`` without a profiler, back to back (one synchronisation before and after): this
    process's host milliseconds a step in the step's phases (the forward until ``Tensor.backward`` is called, the
    backward, the rest: optimizer, zero_grad) and inside the callables of ``_phase_targets`` (nested ones
    counted in each; a callable on the autograd engine's thread counts there too), plus ``"wall"``: the steps'
    wall time. Timers cost about a microsecond a call: these are the host's figures as the benchmark runs them.
    The wrappers are removed before it returns."""
    import functools
    import time

    import torch

    acc: dict = {}
    calls: dict = {}
    marks: dict = {}
    undo = []

    def timed(fn, label):
        @functools.wraps(fn)  # (FSDP2 reads the hooks' signatures: inspect follows __wrapped__)
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[label] = acc.get(label, 0.0) + time.perf_counter() - t0
                calls[label] = calls.get(label, 0) + 1
        return call

    backward = torch.Tensor.backward

    def marked_backward(self, *args, **kwargs):
        marks["b0"] = time.perf_counter()
        try:
            return backward(self, *args, **kwargs)
        finally:
            marks["b1"] = time.perf_counter()

    targets = _phase_targets()
    phases = {"forward": 0.0, "backward": 0.0, "after backward": 0.0}
    try:
        for owner, name, label in targets:
            fn = getattr(owner, name)
            undo.append((owner, name, owner.__dict__.get(name, _INHERITED) if isinstance(owner, type) else fn))
            setattr(owner, name, timed(fn, label))
        torch.Tensor.backward = marked_backward
        if sync is not None:
            sync()
        wall = time.perf_counter()
        for _ in range(steps):
            marks.clear()
            t0 = time.perf_counter()
            step()
            t1 = time.perf_counter()
            if "b0" in marks:
                phases["forward"] += marks["b0"] - t0
                phases["backward"] += marks["b1"] - marks["b0"]
                phases["after backward"] += t1 - marks["b1"]
            else:  # no Tensor.backward call (autograd.backward): the whole step as forward
                phases["forward"] += t1 - t0
        if sync is not None:
            sync()
        wall = time.perf_counter() - wall
    finally:
        torch.Tensor.backward = backward
        for owner, name, original in reversed(undo):
            if original is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
    out = {k: 1e3 * v / steps for k, v in phases.items()}
    out["wall"] = 1e3 * wall / steps
    out.update({label: 1e3 * acc.get(label, 0.0) / steps for _, _, label in targets})
    out["calls"] = {label: calls.get(label, 0) / steps for label in acc}
    return out


def phases_table(per_rank: list, label: str, steps: int) -> str:
    """The figures of ``host_phases`` from every rank, one column each (ms a step)."""
    head = f"{'ms a step':>56}" + "".join(f"{'rank ' + str(r):>10}" for r in range(len(per_rank)))
    lines = [f"## host phases: {label} ({steps} steps, no profiler, every rank)", head]
    keys = [k for k in per_rank[0] if k != "calls"]
    for k in keys:
        if all(r.get(k, 0.0) == 0.0 for r in per_rank) and k not in ("forward", "backward", "after backward"):
            continue  # a hook this side never calls (bf16 sides: no mxtrain hooks)
        calls = per_rank[0]["calls"].get(k)
        name = k if calls is None else f"{k} [{calls:.0f}/step]"
        lines.append(f"{name:>56}" + "".join(f"{r.get(k, 0.0):10.1f}" for r in per_rank))
    return "\n".join(lines)
