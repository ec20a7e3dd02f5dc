"""A Mixtral-8x7B expert layer, forward + backward: mxtrain.GroupedLinear under each recipe against bf16.

The layer: 8 experts, hidden 4096 -> 2 x 14336 (SwiGLU gate and up) -> 4096, top-2 routing of 8192
tokens (16384 expert rows). The routing is imbalanced as trained routers are: logits with a per-expert
bias drawn once (``--skew``, the standard deviation of that bias), so the busiest expert gets about
twice the tokens of the idlest (the counts are printed). Rows:

* ``bf16 grouped_mm``: stacked bf16 weights, ``torch.nn.functional.grouped_mm`` (autograd), the baseline;
* ``bf16 loop``: one ``nn.Linear`` per expert;
* ``GroupedLinear <recipe>``: ``mxtrain.GroupedLinear`` (fc1, fc2) under ``mx_autocast(recipe)``;
* ``Linear loop <recipe>``: one ``mxtrain.Linear`` per expert under the same recipe.

* ``GroupedLinear <recipe> aligned<N>``: the same with each expert's tokens padded with zero rows to a
  multiple of ``--align`` where they are permuted (Megatron-LM's ``moe_router_padding_for_fp8``, torchao's
  MoE token alignment): the casts then run once over all experts. Its FLOP/s count the real rows only.

The modes of one recipe (with the bf16 grouped_mm baseline) are timed alternately, step by step, so that
clock and thermal drift fall on all of them alike. Times are medians of ``--iters`` steps (each
synchronised); "vs bf16" is the bf16 grouped_mm time over the row's, both timed in the same turns; "issue"
the host's time to issue the step (to ``backward`` returning; near the step's time: host-bound). Only
the expert GEMMs and the activation are timed (routing, permutation excluded). Each step starts with the
parameters' gradients unset (as after ``zero_grad(set_to_none=True)``), so backward writes them rather
than adding to the last step's. The SwiGLU between the layers is ``mxtrain.gated_activation`` (one Triton
pass forward and one backward on CUDA) in every mode; ``--act torch`` runs ``F.silu(gate) * up``
instead. ``--profile`` then prints each mode's top CUDA kernels of one step (torch.profiler). ``--gpu-time``
adds "GPU ms": the step timed again with all its kernels queued behind a GPU spin, so that none waits for the
host (the GPU's own time; "ms" less this is what the host's issue costs the step).

    python benchmarks/bench_moe.py                         # one GPU (the Mixtral shape)
    python benchmarks/bench_moe.py --small --device cpu    # smoke test: tiny shapes, seconds
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import mxtrain

_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def route(tokens: int, experts: int, top_k: int, skew: float, seed: int = 0) -> list[int]:
    """Tokens per expert of a top-k routing whose logits carry a per-expert bias (std ``skew``)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g) + skew * torch.randn(experts, generator=g)
    chosen = logits.topk(top_k, dim=-1).indices.flatten()
    return torch.bincount(chosen, minlength=experts).tolist()


def torch_swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def fused_swiglu(h: torch.Tensor) -> torch.Tensor:
    return mxtrain.gated_activation(h, "swiglu")


ACTS = {"fused": fused_swiglu, "torch": torch_swiglu}
_ACT = "fused"  # the experts' activation in every mode (main() sets it from --act)


class GroupedExperts(nn.Module):
    """fc1 -> SwiGLU -> fc2 over tokens sorted by expert, as mxtrain.GroupedLinear."""

    def __init__(self, experts, hidden, ffn, **kw):
        super().__init__()
        self.fc1 = mxtrain.GroupedLinear(experts, hidden, 2 * ffn, bias=False, **kw)
        self.fc2 = mxtrain.GroupedLinear(experts, ffn, hidden, bias=False, **kw)

    def forward(self, x, splits):
        return self.fc2(ACTS[_ACT](self.fc1(x, splits)), splits)


class LoopExperts(nn.Module):
    """The same experts as a loop of per-expert linears (``mxtrain.Linear``: nn.Linear outside autocast)."""

    def __init__(self, experts, hidden, ffn, **kw):
        super().__init__()
        self.fc1 = nn.ModuleList(mxtrain.Linear(hidden, 2 * ffn, bias=False, **kw) for _ in range(experts))
        self.fc2 = nn.ModuleList(mxtrain.Linear(ffn, hidden, bias=False, **kw) for _ in range(experts))

    def forward(self, x, splits):
        outs = [fc2(ACTS[_ACT](fc1(xe))) for fc1, fc2, xe, n in zip(self.fc1, self.fc2, x.split(splits), splits) if n]
        return torch.cat(outs)


class TorchGroupedExperts(nn.Module):
    """The bf16 baseline: stacked weights and torch's grouped GEMM."""

    def __init__(self, experts, hidden, ffn, **kw):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, 2 * ffn, hidden, **kw) * hidden ** -0.5)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, ffn, **kw) * ffn ** -0.5)

    def forward(self, x, splits):
        offs = torch.tensor(splits, device=x.device).cumsum(0).to(torch.int32)
        h = _grouped_mm(x, self.w1.transpose(1, 2), offs=offs)
        return _grouped_mm(ACTS[_ACT](h), self.w2.transpose(1, 2), offs=offs)


def _step_fn(model, x, dy, splits, recipe):
    params = list(model.parameters())

    def step():
        for p in params:  # as zero_grad(set_to_none=True): backward writes the gradients, adds to nothing
            p.grad = None
        xi = x.detach().requires_grad_()
        with mxtrain.mx_autocast(enabled=recipe is not None, recipe=recipe):
            y = model(xi, splits)
        y.backward(dy)
    return step


def gpu_seconds(step) -> float:
    """Seconds the GPU takes for one step whose kernels are all queued before the first runs: the step is issued
    behind a GPU spin longer than its issue, so no kernel waits for the host (``step`` seconds less this: what
    the host's issue costs the step)."""
    t0 = time.perf_counter()
    step()
    issue = time.perf_counter() - t0
    torch.cuda.synchronize()
    torch.cuda._sleep(int(max(2 * issue, 0.01) * 2.5e9))  # cycles: twice the issue time at up to 2.5 GHz
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def time_steps(steps: list, iters: int, warmup: int, cuda: bool,
               gpu_time: bool = False) -> list[tuple[float, float, float | None]]:
    """Median seconds of one forward + backward of each step function, of its issue on the host (until
    the step returns, before the synchronisation), and with ``gpu_time`` of the GPU alone (``gpu_seconds``),
    the steps run in turn."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(warmup):
        for step in steps:
            step()
    times: list[list[float]] = [[] for _ in steps]
    issues: list[list[float]] = [[] for _ in steps]
    gpus: list[list[float]] = [[] for _ in steps]
    for _ in range(iters):
        for step, t, i, g in zip(steps, times, issues, gpus):
            sync()
            t0 = time.perf_counter()
            step()
            t1 = time.perf_counter()
            sync()
            t.append(time.perf_counter() - t0)
            i.append(t1 - t0)
            if gpu_time and cuda:
                g.append(gpu_seconds(step))
    return [(statistics.median(t), statistics.median(i), statistics.median(g) if g else None)
            for t, i, g in zip(times, issues, gpus)]


def profile_step(label: str, step, cuda: bool, top: int) -> None:
    """Print the ``top`` CUDA kernels (by total device time) of one step."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    print(f"## {label}: top {top} {'CUDA kernels' if cuda else 'CPU ops'} of one step")
    print(prof.key_averages().table(sort_by=key, row_limit=top, max_name_column_width=70))


def aligned(x: torch.Tensor, dy: torch.Tensor, splits: list[int], align: int):
    """``x``, ``dy`` with each expert's rows followed by zero rows up to a multiple of ``align`` (as a token
    permutation that pads writes them), and the padded counts."""
    padded = [-(-n // align) * align for n in splits]
    def pad(t):
        out = t.new_zeros(sum(padded), t.shape[1])
        for src, dst, n in zip(t.split(splits), out.split(padded), splits):
            dst[:n] = src
        return out
    return pad(x), pad(dy), padded


RECIPES = {"mxfp8": mxtrain.MXFP8Recipe, "fp8_current": mxtrain.Float8CurrentScaling,
           "fp8_delayed": mxtrain.DelayedScaling, "fp8_block": mxtrain.Float8BlockScaling,
           # E4M3 gradients too: on sm_90 dgrad and wgrad can then run as grouped FP8 GEMMs (E4M3 x E4M3 only)
           "fp8_current_e4m3": lambda: mxtrain.Float8CurrentScaling(fp8_format="e4m3"),
           "fp8_delayed_e4m3": lambda: mxtrain.DelayedScaling(fp8_format="e4m3")}


def add_layer_args(p: argparse.ArgumentParser) -> None:
    """The expert layer's shape and routing options (the Mixtral-8x7B layer by default)."""
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--skew", type=float, default=0.3, help="std of the per-expert logit bias (imbalance)")


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_layer_args(p)
    p.add_argument("--recipes", default="mxfp8,fp8_current,fp8_delayed,fp8_block")
    p.add_argument("--no-loop", action="store_true", help="skip the per-expert loop rows")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--align", type=int, default=32, help="token alignment of the 'aligned' rows (0: none)")
    p.add_argument("--profile", action="store_true", help="print each mode's top CUDA kernels of one step")
    p.add_argument("--gpu-time", action="store_true",
                   help="also time each step with its kernels queued behind a GPU spin (the GPU's time alone; CUDA)")
    p.add_argument("--host-profile", action="store_true",
                   help="cProfile 5 steps of each mode (hostprof.py): where the host's issue time goes")
    p.add_argument("--host-profile-out", default=None, metavar="DIR", help="also keep the .prof files here")
    p.add_argument("--top", type=int, default=12, help="kernels listed per mode with --profile")
    p.add_argument("--act", choices=sorted(ACTS), default="fused",
                   help="the SwiGLU of every mode: mxtrain.gated_activation (fused) or F.silu(gate) * up (torch)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="tiny shapes (4 experts, 32 -> 2 x 64 -> 32, 64 tokens)")
    args = p.parse_args(argv)
    if args.small:
        args.experts, args.hidden, args.ffn, args.tokens, args.iters, args.warmup = 4, 32, 64, 64, 1, 0
    global _ACT
    _ACT = args.act
    recipes = [r for r in args.recipes.split(",") if r]
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        p.error(f"unknown recipes {unknown}; choose from {sorted(RECIPES)}")
    device, dtype = torch.device(args.device), torch.bfloat16
    splits = route(args.tokens, args.experts, args.top_k, args.skew)
    rows = sum(splits)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, args.hidden, generator=g).to(device, dtype)
    dy = torch.randn(rows, args.hidden, generator=g).to(device, dtype)
    kw = {"device": device, "dtype": dtype}
    shape = (args.experts, args.hidden, args.ffn)
    flops = 6 * rows * args.hidden * 3 * args.ffn  # fc1 (2 x ffn) + fc2, forward + backward
    print(f"# experts {args.experts}, {args.hidden} -> 2 x {args.ffn} -> {args.hidden}, SwiGLU, top-{args.top_k} of "
          f"{args.tokens} tokens; rows per expert {splits}; {args.act} SwiGLU; {device} "
          f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), torch {torch.__version__}")
    results = []
    xa, dya, splits_a = aligned(x, dy, splits, args.align) if args.align > 0 else (x, dy, splits)
    groups = [[("GroupedLinear bf16", GroupedExperts, None, False)]
              + ([] if args.no_loop else [("bf16 loop", LoopExperts, None, False)])]
    for name in recipes:
        group = [(f"GroupedLinear {name}", GroupedExperts, name, False)]
        if args.align > 0 and splits_a != splits:
            group.append((f"GroupedLinear {name} aligned{args.align}", GroupedExperts, name, True))
        if not args.no_loop:
            group.append((f"Linear loop {name}", LoopExperts, name, False))
        groups.append(group)
    baseline = None
    if _grouped_mm is not None:
        torch.manual_seed(0)
        baseline = ("bf16 grouped_mm", TorchGroupedExperts(*shape, **kw), None, False)
    for group in groups:
        cases = [] if baseline is None else [baseline]
        for label, cls, rname, pad in group:
            torch.manual_seed(0)
            cases.append((label, cls(*shape, **kw), rname, pad))
        steps, ok = [], []
        for label, model, rname, pad in cases:
            step = _step_fn(model, *((xa, dya, splits_a) if pad else (x, dy, splits)),
                            RECIPES[rname]() if rname else None)
            try:
                step()
            except RuntimeError as err:  # e.g. torch's grouped GEMM not on this device
                print(f"# {label}: skipped ({str(err).splitlines()[0]})")
                continue
            steps.append(step)
            ok.append(label)
        secs = dict(zip(ok, time_steps(steps, args.iters, args.warmup, device.type == "cuda", args.gpu_time)))
        base = secs.get("bf16 grouped_mm")
        for label, (sec, issue, gpu) in secs.items():
            if not any(r["mode"] == label for r in results):  # the baseline: its first group's row
                # "vs bf16" against the baseline timed alongside (in turn with) this row
                results.append({"mode": label, "ms": sec * 1e3, "issue_ms": issue * 1e3,
                                "gpu_ms": None if gpu is None else gpu * 1e3,
                                "tflops": flops / sec / 1e12, "vs_bf16": (base[0] if base else sec) / sec,
                                "gpu_vs_bf16": None if gpu is None or not base else base[2] / gpu})
        if args.profile:
            for label, step in zip(ok, steps):
                profile_step(label, step, device.type == "cuda", args.top)
        if args.host_profile:
            import pathlib
            import sys

            sys.path.insert(0, str(pathlib.Path(__file__).parent))  # hostprof.py beside this file
            from hostprof import host_profile

            for label, step in zip(ok, steps):
                print(host_profile(step, 5, label, sync=torch.cuda.synchronize if device.type == "cuda" else None,
                                   out_dir=args.host_profile_out))
        for case in cases[1 if baseline is not None else 0:]:
            case[1].zero_grad(set_to_none=True)
        del cases, steps
    gpu = any(r["gpu_ms"] is not None for r in results)
    print(f"{'mode':34s} {'ms':>9s} {'issue ms':>9s} {'TFLOP/s':>8s} {'vs bf16':>8s}"
          + (f" {'GPU ms':>8s} {'GPU vs bf16':>11s}" if gpu else ""))
    for r in results:
        print(f"{r['mode']:34s} {r['ms']:9.2f} {r['issue_ms']:9.2f} {r['tflops']:8.1f} {r['vs_bf16']:7.2f}x"
              + (f" {r['gpu_ms'] or 0:8.2f} {r['gpu_vs_bf16'] or 0:10.2f}x" if gpu else ""))
    return results


if __name__ == "__main__":
    main()
