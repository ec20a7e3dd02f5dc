"""Host (CPU) time of one LayerNormMLP forward+backward: the Python and launch cost per call.

With few tokens the GPU finishes each kernel before the host issues the next one, so
the wall time of many back-to-back steps (one synchronize at the end) is the host's
time per step. A layer of a real model costs at least this much host time per step,
whatever its size; under FSDP2 the hooks add theirs. Compares mxtrain.LayerNormMLP
under a recipe with the same block in plain torch (bf16), and prints the Python functions
that take the host's time, by own and by inclusive time per step (torch.profiler's Python
tracer, which also follows the autograd engine's device thread, where backward runs on CUDA;
the tracer's own overhead inflates the figures, their ranking is what it shows).

    python benchmarks/profile_host.py                          # CUDA if present, else CPU
    python benchmarks/profile_host.py --recipe mxfp8 --tokens 128 --hidden 1024 --ffn 4096 --rows 30
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
import time
import warnings

import torch
import torch.nn.functional as F

import mxtrain


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--recipe", default="mxfp8")
    p.add_argument("--activation", default="gelu")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rows", type=int, default=30, help="cProfile rows per table (0: no profile)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--ops", type=int, default=25,
                   help="rows of the op table (torch.profiler without the Python tracer: ops and CUDA runtime calls "
                        "by own CPU time, both threads; 0: none)")
    args = p.parse_args()
    dev, dt = torch.device(args.device), torch.bfloat16
    torch.manual_seed(0)
    m = mxtrain.LayerNormMLP(args.hidden, args.ffn, bias=False, activation=args.activation, device=dev, dtype=dt)
    x = torch.randn(args.tokens, args.hidden, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn(args.tokens, args.hidden, device=dev, dtype=dt)
    recipe = mxtrain.recipe_from_string(args.recipe)
    ln = torch.nn.LayerNorm(args.hidden, device=dev, dtype=dt)
    w1, w2 = m.fc1_weight.detach().clone().requires_grad_(), m.fc2_weight.detach().clone().requires_grad_()

    def torch_block():
        y = F.linear(F.gelu(F.linear(ln(x), w1)), w2)
        y.backward(dy)

    def mx_block():
        with mxtrain.mx_autocast(recipe=recipe):
            y = m(x)
        y.backward(dy)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def per_step(fn):
        for _ in range(10):
            fn()
        sync()
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(args.steps):
            fn()
        issued, cpu = time.perf_counter() - t0, time.thread_time() - c0
        sync()
        wall = time.perf_counter() - t0
        return 1e6 * wall / args.steps, 1e6 * issued / args.steps, 1e6 * cpu / args.steps

    rows = [("torch block (bf16)", per_step(torch_block)), (f"mxtrain.LayerNormMLP {args.recipe}", per_step(mx_block))]
    print(f"host time per forward+backward: hidden {args.hidden}, ffn {args.ffn}, {args.tokens} tokens, "
          f"{args.activation}, {dev.type} ({torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'CPU'}), "
          f"torch {torch.__version__}")
    print("| block | wall us/step | issued us/step | main-thread CPU us/step |")
    print("|---|---|---|---|")
    for name, (w, i, c) in rows:
        print(f"| {name} | {w:.0f} | {i:.0f} | {c:.0f} |")
    if dev.type == "cuda":  # host-device synchronizations inside a step stop the host from running ahead
        syncs = synchronizing_calls(mx_block)
        print(f"synchronizing calls in one mxtrain step: {len(syncs)}" + (f" ({', '.join(syncs)})" if syncs else ""))
    if args.ops:
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda"
                                                        else [])
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(20):
                mx_block()
            sync()
        print("\nops and runtime calls by own CPU time (20 steps)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.ops, max_name_column_width=55))
    if args.rows:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True) as prof:
            for _ in range(20):
                mx_block()
            sync()
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "trace.json")
            prof.export_chrome_trace(path)
            own, incl, calls = python_times(path)
        for title, table in (("own", own), ("inclusive", incl)):
            print(f"\nPython functions by {title} time (us per step, under the tracer)")
            for name, us in table.most_common(args.rows):
                print(f"{us / 20:9.1f}  x{calls[name] / 20:5.1f}  {name}")


def synchronizing_calls(fn) -> list[str]:
    """Where (file:line) the host-device synchronizations of one call of ``fn`` were reported
    (``torch.cuda.set_sync_debug_mode``; a sync on the autograd thread surfaces at the next Python line)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # the first use of the debug mode in a process also warns that the mode is "a prototype feature" (a
    # notice, reported at set_sync_debug_mode's own line): not a synchronization
    return [f"{os.path.relpath(w.filename)}:{w.lineno}" for w in caught
            if "synchroniz" in str(w.message) and "prototype feature" not in str(w.message)]


def python_times(path):
    """Own and inclusive time (us, summed) and call counts of each Python function in a chrome trace."""
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"]
                  if e.get("ph") == "X" and e.get("cat") in ("python_function", "cpu_op")]
    own, incl, calls = collections.Counter(), collections.Counter(), collections.Counter()
    by_tid = collections.defaultdict(list)
    for e in events:
        by_tid[e["tid"]].append(e)
    for evs in by_tid.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []  # [end, name, child time]
        for e in evs:
            while stack and stack[-1][0] <= e["ts"]:
                _, name, child, dur = stack.pop()
                own[name] += dur - child
            if stack:
                stack[-1][2] += e["dur"]
            name = e["name"] if e["cat"] == "python_function" else "[op] " + e["name"]
            stack.append([e["ts"] + e["dur"], _short(name), 0.0, e["dur"]])
            incl[_short(name)] += e["dur"]
            calls[_short(name)] += 1
        while stack:
            _, name, child, dur = stack.pop()
            own[name] += dur - child
    return own, incl, calls


def _short(name):
    for cut in ("site-packages/", "/work/main/", "/mxtrain/"):
        if cut in name:
            name = name.split(cut)[-1] if cut != "/mxtrain/" else "mxtrain/" + name.split(cut)[-1]
    return name[:110]

if __name__ == "__main__":
    main()
