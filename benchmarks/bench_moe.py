"""A Mixtral-8x7B expert layer, forward + backward: mxtrain.GroupedLinear under each recipe against bf16.

The layer: 8 experts, hidden 4096 -> 2 x 14336 (SwiGLU gate and up) -> 4096, top-2 routing of 8192
tokens (16384 expert rows). The routing is imbalanced as trained routers are: logits with a per-expert
bias drawn once (``--skew``, the standard deviation of that bias), so the busiest expert gets about
twice the tokens of the idlest (the counts are printed). Rows:

* ``bf16 grouped_mm``: stacked bf16 weights, ``torch.nn.functional.grouped_mm`` (autograd), the baseline;
* ``bf16 loop``: one ``nn.Linear`` per expert;
* ``GroupedLinear <recipe>``: ``mxtrain.GroupedLinear`` (fc1, fc2) under ``mx_autocast(recipe)``;
* ``Linear loop <recipe>``: one ``mxtrain.Linear`` per expert under the same recipe.

Times are medians of ``--iters`` steps (each synchronised); "vs bf16" is the grouped bf16 time over the
row's. Only the expert GEMMs and the activation are timed (routing, permutation excluded).

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


def swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


class GroupedExperts(nn.Module):
    """fc1 -> SwiGLU -> fc2 over tokens sorted by expert, as mxtrain.GroupedLinear."""

    def __init__(self, experts, hidden, ffn, **kw):
        super().__init__()
        self.fc1 = mxtrain.GroupedLinear(experts, hidden, 2 * ffn, bias=False, **kw)
        self.fc2 = mxtrain.GroupedLinear(experts, ffn, hidden, bias=False, **kw)

    def forward(self, x, splits):
        return self.fc2(swiglu(self.fc1(x, splits)), splits)


class LoopExperts(nn.Module):
    """The same experts as a loop of per-expert linears (``mxtrain.Linear``: nn.Linear outside autocast)."""

    def __init__(self, experts, hidden, ffn, **kw):
        super().__init__()
        self.fc1 = nn.ModuleList(mxtrain.Linear(hidden, 2 * ffn, bias=False, **kw) for _ in range(experts))
        self.fc2 = nn.ModuleList(mxtrain.Linear(ffn, hidden, bias=False, **kw) for _ in range(experts))

    def forward(self, x, splits):
        outs = [fc2(swiglu(fc1(xe))) for fc1, fc2, xe, n in zip(self.fc1, self.fc2, x.split(splits), splits) if n]
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
        return _grouped_mm(swiglu(h), self.w2.transpose(1, 2), offs=offs)


def time_step(model, x, dy, splits, recipe, iters: int, warmup: int) -> float:
    """Median seconds of one forward + backward."""
    def step():
        xi = x.detach().requires_grad_()
        with mxtrain.mx_autocast(enabled=recipe is not None, recipe=recipe):
            y = model(xi, splits)
        y.backward(dy)

    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    return statistics.median(times)


RECIPES = {"mxfp8": mxtrain.MXFP8Recipe, "fp8_current": mxtrain.Float8CurrentScaling,
           "fp8_delayed": mxtrain.DelayedScaling, "fp8_block": mxtrain.Float8BlockScaling}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--skew", type=float, default=0.3, help="std of the per-expert logit bias (imbalance)")
    p.add_argument("--recipes", default="mxfp8,fp8_current,fp8_delayed,fp8_block")
    p.add_argument("--no-loop", action="store_true", help="skip the per-expert loop rows")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="tiny shapes (4 experts, 32 -> 2 x 64 -> 32, 64 tokens)")
    args = p.parse_args(argv)
    if args.small:
        args.experts, args.hidden, args.ffn, args.tokens, args.iters, args.warmup = 4, 32, 64, 64, 1, 0
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
          f"{args.tokens} tokens; rows per expert {splits}; {device} "
          f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), torch {torch.__version__}")
    results = []
    cases = []
    if _grouped_mm is not None:
        cases.append(("bf16 grouped_mm", TorchGroupedExperts, None))
    cases.append(("GroupedLinear bf16", GroupedExperts, None))
    if not args.no_loop:
        cases.append(("bf16 loop", LoopExperts, None))
    for name in recipes:
        cases.append((f"GroupedLinear {name}", GroupedExperts, name))
        if not args.no_loop:
            cases.append((f"Linear loop {name}", LoopExperts, name))
    for label, cls, rname in cases:
        torch.manual_seed(0)
        model = cls(*shape, **kw)
        try:
            sec = time_step(model, x, dy, splits, RECIPES[rname]() if rname else None, args.iters, args.warmup)
        except RuntimeError as err:  # e.g. torch's grouped GEMM not on this device
            print(f"# {label}: skipped ({str(err).splitlines()[0]})")
            continue
        results.append({"mode": label, "ms": sec * 1e3, "tflops": flops / sec / 1e12})
        del model
    base = next((r["ms"] for r in results if r["mode"] == "bf16 grouped_mm"), results[0]["ms"])
    print(f"{'mode':28s} {'ms':>9s} {'TFLOP/s':>8s} {'vs bf16':>8s}")
    for r in results:
        r["vs_bf16"] = base / r["ms"]
        print(f"{r['mode']:28s} {r['ms']:9.2f} {r['tflops']:8.1f} {r['vs_bf16']:7.2f}x")
    return results


if __name__ == "__main__":
    main()
