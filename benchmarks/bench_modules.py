"""Memory held for backward and step time: mxtrain.LayerNormMLP (MX recipes) against the torch block.

The torch block is LayerNorm -> Linear -> GELU -> Linear in the same dtype (eager,
and torch.compile'd with --compile). "Saved for backward" counts the distinct
storages that the autograd graph of one forward keeps alive, parameters excluded
(both sides hold the same parameters): for torch nodes their ``_saved_*`` tensors,
for mxtrain's autograd functions their saved tensors and the MX planes on their ctx.
On CUDA the script also reports the allocator's peak during forward+backward.
Two times: "step" is the median of single steps, each followed by a sync, so it includes the
host latency until the device has work; "steady" runs the steps back to back with one sync at the
end, as a training loop over many layers runs them.

    python benchmarks/bench_modules.py --hidden 1024 --ffn 4096 --tokens 4096          # CPU
    python benchmarks/bench_modules.py --hidden 4096 --ffn 16384 --tokens 8192 --device cuda --compile
"""

from __future__ import annotations

import argparse
import datetime
import platform
import time

import torch
import torch.nn.functional as F
from torch import nn

import mxtrain
from mxtrain.quantization import MXTensor


class TorchBlock(nn.Module):
    def __init__(self, hidden, ffn, device, dtype):
        super().__init__()
        self.norm = nn.LayerNorm(hidden, device=device, dtype=dtype)
        self.fc1 = nn.Linear(hidden, ffn, device=device, dtype=dtype)
        self.fc2 = nn.Linear(ffn, hidden, device=device, dtype=dtype)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(self.norm(x))))


def _tensors_of(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, MXTensor):
        for p in obj.planes:
            yield p.data
            yield p.scale
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors_of(o)


def saved_bytes(output: torch.Tensor, params) -> int:
    """Bytes of distinct storages kept alive by the autograd graph of ``output`` (parameters excluded)."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    seen, total, stack, visited = set(), 0, [output.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        found = []
        for name in dir(node):
            if name.startswith("_saved_"):
                try:
                    found.append(getattr(node, name))
                except RuntimeError:
                    pass
        if hasattr(node, "saved_tensors"):
            try:
                found.append(node.saved_tensors)
            except RuntimeError:
                pass
            found.extend(v for v in getattr(node, "__dict__", {}).values())
        for t in _tensors_of(found):
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr in seen or ptr in param_ptrs or ptr == 0:
                continue
            seen.add(ptr)
            total += st.nbytes()
        stack.extend(fn for fn, _ in node.next_functions)
    return total


def time_step(fn, device, repeats):
    for _ in range(2):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def time_steady(fn, device, steps):
    """Per-step time of ``steps`` steps run back to back with one sync at the end, as a training
    loop over many layers runs them: the host's launch latency hides behind the device's work."""
    for _ in range(2):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--recipes", default="mxfp8,mxfp6,mxfp4,mxint8")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="also time the torch.compile'd torch block")
    p.add_argument("--no-time", action="store_true", help="memory only")
    p.add_argument("--record", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = p.parse_args()
    device, dtype = torch.device(args.device), {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    torch.manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype, requires_grad=True)
    # a dense output gradient, as a loss downstream gives (y.sum() would hand backward a broadcast view)
    dy = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype)
    ref = TorchBlock(args.hidden, args.ffn, device, dtype)
    mx = mxtrain.LayerNormMLP(args.hidden, args.ffn, activation="gelu", device=device, dtype=dtype)
    rows = []

    def measure(name, module, recipe=None, compiled=False):
        run = torch.compile(module) if compiled else module

        def step():
            with mxtrain.mx_autocast(enabled=recipe is not None, recipe=recipe):
                y = run(x)
            y.backward(dy)

        with mxtrain.mx_autocast(enabled=recipe is not None, recipe=recipe):
            y = module(x)
        held = saved_bytes(y, list(module.parameters()) + [x])
        del y
        peak = None
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        t = None if args.no_time else time_step(step, device, args.repeats)
        steady = None if args.no_time else time_steady(step, device, max(args.repeats, 5))
        rows.append((name, held / 2**20, peak, t, steady))

    measure(f"torch block ({args.dtype})", ref)
    if args.compile:
        measure(f"torch block ({args.dtype}, compiled)", ref, compiled=True)
    for name in args.recipes.split(","):
        measure(f"mxtrain.LayerNormMLP {name}", mx, mxtrain.recipe_from_string(name))

    base_held, base_t, base_s = rows[0][1], rows[0][3], rows[0][4]
    lines = [f"LayerNormMLP hidden {args.hidden}, ffn {args.ffn}, {args.tokens} tokens, {args.dtype}, gelu, "
             f"device {device.type}", "",
             "| module | saved for backward (MiB) | ratio | peak fwd+bwd (MiB) | step (ms) | time ratio "
             "| steady step (ms) | steady ratio |",
             "|---|---|---|---|---|---|---|---|"]

    def ms(v, base):
        return ("", "") if v is None else (f"{v * 1e3:.2f}", f"{v / base:.3f}")
    for name, held, peak, t, steady in rows:
        lines.append(f"| {name} | {held:.1f} | {held / base_held:.2f} | {'' if peak is None else f'{peak:.0f}'} | "
                     + " | ".join(ms(t, base_t)) + " | " + " | ".join(ms(steady, base_s)) + " |")
    table = "\n".join(lines)
    print(table)
    if args.record:
        dev = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU"
        with open("benchmarks/RESULTS.md", "a") as f:
            f.write(f"\n## bench_modules.py — {datetime.date.today()} — {dev}, torch {torch.__version__}\n\n"
                    f"{table}\n")


if __name__ == "__main__":
    main()
