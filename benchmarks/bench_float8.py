"""LayerNormMLP forward+backward under the FP8 recipes against the bf16 torch block, on a Hopper GPU.

The torch block is LayerNorm -> Linear -> GELU -> Linear in bf16 (eager). mxtrain's
LayerNormMLP runs the same computation with its six GEMMs in FP8 under
Float8CurrentScaling, DelayedScaling and Float8BlockScaling. Times are CUDA-event
medians of whole steps (forward, backward, grads), after warm-up. A second table
times the GEMMs alone (operands cast beforehand) so the cast overhead can be read
off, and a kernel profile of one step per recipe is written with --profile-dir.
Per-tensor FP8 GEMMs use cuBLAS fast accumulation for fprop only (as Transformer
Engine); one extra row runs current scaling with it in all six GEMMs.

    python benchmarks/bench_float8.py                      # hidden 4096, ffn 16384, 8192 tokens, bf16
    python benchmarks/bench_float8.py --hidden 1024 --ffn 4096 --tokens 2048 --iters 5
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import mxtrain
from mxtrain import config
from mxtrain.kernels import float8_cast, float8_gemm, registry
from mxtrain.kernels.dispatch import mx_gemm, quantize_float8
from mxtrain.recipes import DelayedScaling, Float8BlockScaling, Float8CurrentScaling

RECIPES = {"current": Float8CurrentScaling(), "delayed": DelayedScaling(), "block": Float8BlockScaling()}


class TorchBlock(nn.Module):
    def __init__(self, hidden, ffn, device, dtype):
        super().__init__()
        self.norm = nn.LayerNorm(hidden, device=device, dtype=dtype)
        self.fc1 = nn.Linear(hidden, ffn, device=device, dtype=dtype)
        self.fc2 = nn.Linear(ffn, hidden, device=device, dtype=dtype)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(self.norm(x))))


def time_ms(fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():  # CPU smoke run of the script itself
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def step_fn(module, x, dy, recipe):
    def step():
        module.zero_grad(set_to_none=True)
        xg = x.detach().requires_grad_(True)
        with mxtrain.mx_autocast(enabled=recipe is not None, recipe=recipe):
            y = module(xg)
        y.backward(dy)
        return y
    return step


def forward_fn(module, x, recipe):
    def fwd():
        with torch.no_grad(), mxtrain.mx_autocast(enabled=recipe is not None, recipe=recipe):
            return module(x)
    return fwd


def write_profile(directory, name, fn, dev):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA if dev == "cuda" else ProfilerActivity.CPU]) as prof:
        fn()
        if dev == "cuda":
            torch.cuda.synchronize()
    with open(f"{directory}/profile_{name}.txt", "w") as f:
        f.write(prof.key_averages().table(sort_by=("cuda_time_total" if dev == "cuda" else "cpu_time_total"),
                                          row_limit=25))


def sqnr_db(a, b) -> float:
    a, b = a.double(), b.double()
    return (20 * torch.log10(b.norm() / (a - b).norm())).item()


def gemm_table(tokens, hidden, ffn, dtype, iters, warmup):
    """The six GEMMs of one step, operands cast beforehand: bf16 cuBLAS vs each FP8 path."""
    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = [(tokens, ffn, hidden), (tokens, hidden, ffn)]  # fc1 (M, N, K), fc2
    rows = []
    for kind in ("bf16", "per-tensor", "block (cuBLAS)", "block (Triton)"):  # noqa: B007
        total = 0.0
        block_gemm = "triton" if kind == "block (Triton)" else "auto"
        for m, n, k in shapes:
            x = torch.randn(m, k, device=dev, dtype=dtype)
            w = torch.randn(n, k, device=dev, dtype=dtype)
            dy = torch.randn(m, n, device=dev, dtype=dtype)
            if kind == "bf16":
                fns = [lambda: x @ w.t(), lambda: dy @ w, lambda: dy.t() @ x]
            else:
                blk = kind.startswith("block")  # per-tensor: fast accumulation in fprop only
                q = lambda t, b, f="fp8_e4m3": quantize_float8(t, f, axes=(1, 0), block=b if blk else None)  # noqa
                xq, wq, dyq = q(x, (1, 128)), q(w, (128, 128)), q(dy, (1, 128), "fp8_e5m2" if not blk else "fp8_e4m3")
                fns = [lambda: mx_gemm(xq, wq, a_axis=1, b_axis=1, out_dtype=dtype),
                       lambda: mx_gemm(dyq, wq, a_axis=1, b_axis=0, out_dtype=dtype),
                       lambda: mx_gemm(dyq, xq, a_axis=0, b_axis=0, out_dtype=dtype)]
            with config.override(fp8_block_gemm=block_gemm):
                for fn in fns:
                    total += time_ms(fn, iters, warmup)
        flops = 6 * 2 * tokens * hidden * ffn
        rows.append((kind, total, flops / total / 1e9))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=16384)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--recipes", default="current,delayed,block")
    ap.add_argument("--profile-dir", default=None, help="write a kernel-time table of one step per recipe here")
    ap.add_argument("--variants", action="store_true",
                    help="also time the recipes without fused casts, and block scaling on the Triton GEMM")
    ap.add_argument("--sweep-casts", action="store_true", help="time the per-tensor cast per tile shape (GPU)")
    args = ap.parse_args()
    dtype, dev = torch.bfloat16, ("cuda" if torch.cuda.is_available() else "cpu")  # CPU: smoke run only
    torch.manual_seed(0)
    torch_block = TorchBlock(args.hidden, args.ffn, dev, dtype)
    mx_block = mxtrain.LayerNormMLP(args.hidden, args.ffn, activation="gelu", device=dev, dtype=dtype)
    with torch.no_grad():
        mx_block.layer_norm_weight.copy_(torch_block.norm.weight)
        mx_block.layer_norm_bias.copy_(torch_block.norm.bias)
        mx_block.fc1_weight.copy_(torch_block.fc1.weight)
        mx_block.fc1_bias.copy_(torch_block.fc1.bias)
        mx_block.fc2_weight.copy_(torch_block.fc2.weight)
        mx_block.fc2_bias.copy_(torch_block.fc2.bias)
    x = torch.randn(args.tokens, args.hidden, device=dev, dtype=dtype)
    dy = torch.randn(args.tokens, args.hidden, device=dev, dtype=dtype)

    device_name = torch.cuda.get_device_name() if dev == "cuda" else "CPU (smoke run, not a benchmark)"
    print(f"## FP8 LayerNormMLP (hidden {args.hidden}, ffn {args.ffn}, {args.tokens} tokens, bf16, GELU) — "
          f"{datetime.date.today()} — {device_name}, torch {torch.__version__}, "
          f"triton {__import__('triton').__version__}\n")
    print("| module | forward (ms) | fwd+bwd step (ms) | step speedup vs torch bf16 | output SQNR vs bf16 (dB) |")
    print("|---|---|---|---|---|", flush=True)

    def row(name, fwd, step, sq):
        print(f"| {name} | {fwd:.2f} | {step:.2f} | {base_step / step:.2f}x | {sq:.1f} |", flush=True)

    y_ref = forward_fn(torch_block, x, None)()
    base_step = time_ms(step_fn(torch_block, x, dy, None), args.iters, args.warmup)
    base_fwd = time_ms(forward_fn(torch_block, x, None), args.iters, args.warmup)
    row("torch block bf16", base_fwd, base_step, float("inf"))
    runs = [(name, None) for name in args.recipes.split(",")]
    if args.variants:  # the same recipes without the fused casts, and block scaling on the Triton GEMM
        runs += [(name, "unfused casts") for name in args.recipes.split(",") if name != "block"]
        runs += [(name, "Triton block GEMM") for name in args.recipes.split(",") if name == "block"]
        runs += [(name, "block casts in one 128x128 pass") for name in args.recipes.split(",") if name == "block"]
    for name, variant in runs:
        recipe = RECIPES[name]
        float8_cast.BLOCK_CAST_SPLIT = variant != "block casts in one 128x128 pass"
        with config.override(fp8_fused_casts=variant != "unfused casts",
                             fp8_block_gemm="triton" if variant == "Triton block GEMM" else "auto"):
            fwd = time_ms(forward_fn(mx_block, x, recipe), args.iters, args.warmup)
            step = time_ms(step_fn(mx_block, x, dy, recipe), args.iters, args.warmup)
            y = forward_fn(mx_block, x, recipe)()
        float8_cast.BLOCK_CAST_SPLIT = True
        label = f"mxtrain.LayerNormMLP {type(recipe).__name__}" + (f", {variant}" if variant else "")
        row(label, fwd, step, sqnr_db(y, y_ref))
        if variant:
            continue
        if args.profile_dir:
            try:
                write_profile(args.profile_dir, name, step_fn(mx_block, x, dy, recipe), dev)
            except Exception as err:  # a missing profiler must not cost the timings
                print(f"profile of {name} failed: {err}")

    print("\n| six GEMMs of one step, operands pre-cast | ms | TFLOP/s |")
    print("|---|---|---|")
    for kind, ms, tflops in gemm_table(args.tokens, args.hidden, args.ffn, dtype, args.iters, args.warmup):
        print(f"| {kind} | {ms:.2f} | {tflops:.0f} |", flush=True)
    for kernel, why in registry.broken("float8_gemm").items():
        print(f"\n{kernel} unavailable (the registry walked on): {why}")
    if args.sweep_casts:
        sweep_casts(args.tokens, args.hidden, args.ffn, dtype, args.iters, args.warmup)


CAST_TILES = [(32, 128, 4), (64, 64, 4), (32, 256, 4)]


def sweep_casts(tokens, hidden, ffn, dtype, iters, warmup):
    """Per-tensor cast kernel time (amax pass included) per tile shape, for the casts of one step."""
    dev = "cuda"
    h = torch.randn(tokens, ffn, device=dev, dtype=dtype)
    da = torch.randn(tokens, ffn, device=dev, dtype=dtype)
    xl = torch.randn(tokens, hidden, device=dev, dtype=dtype)
    cases = {  # name: (call, bytes moved by the cast kernel itself, planes)
        "gelu(h) row": (lambda: float8_cast.tensor_cast_float8(h, act="gelu"), h.numel() * 3, (True, False)),
        "gelu(h) col": (lambda: float8_cast.tensor_cast_float8(h, act="gelu", rowwise=False, columnwise=True,
                                                               amax=torch.tensor(4.0, device=dev)),
                        h.numel() * 3, (False, True)),
        "dgelu(h, da) row+col+dbias": (lambda: float8_cast.tensor_cast_float8(
            h, "fp8_e5m2", columnwise=True, act="gelu", grad=da, dbias=True), h.numel() * 6, (True, True)),
        "x row+col": (lambda: float8_cast.tensor_cast_float8(xl, columnwise=True), xl.numel() * 4, (True, True)),
    }
    print("\n| cast (amax pass + cast) | tile BMxBN/warps | ms | cast-kernel GB/s (amax pass excluded from bytes) |")
    print("|---|---|---|---|")
    saved = dict(float8_cast.TENSOR_CAST_TILES), float8_cast.AMAX_TILE
    for name, (fn, nbytes, planes) in cases.items():
        best = None
        for tile in CAST_TILES:
            float8_cast.TENSOR_CAST_TILES[planes] = tile
            float8_cast.AMAX_TILE = tile
            try:
                ms = time_ms(fn, iters, warmup)
            except Exception as err:  # a tile that does not compile (shared memory) is skipped
                print(f"| {name} | {tile} | failed: {type(err).__name__} | |")
                continue
            best = min(best or (ms, tile), (ms, tile))
            print(f"| {name} | {tile[0]}x{tile[1]}/{tile[2]} | {ms:.3f} | {nbytes / ms / 1e6:.0f} |", flush=True)
        print(f"| **{name} best** | {best[1]} | {best[0]:.3f} | |", flush=True)
        float8_cast.TENSOR_CAST_TILES.clear()
        float8_cast.TENSOR_CAST_TILES.update(saved[0])
        float8_cast.AMAX_TILE = saved[1]
    w = torch.randn(ffn, hidden, device=dev, dtype=dtype)
    blocks = {  # 128-block casts: one 128x128 tile per program, warps swept
        "block gelu(h) row+col": (lambda: float8_cast.block_cast_float8(h, act="gelu", columnwise=True),
                                  h.numel() * 4),
        "block dgelu(h, da) row+col+dbias": (lambda: float8_cast.block_cast_float8(
            h, "fp8_e4m3", columnwise=True, act="gelu", grad=da, dbias=True), h.numel() * 6),
        "block x row+col": (lambda: float8_cast.block_cast_float8(xl, columnwise=True), xl.numel() * 4),
        "block W 128x128 row+col": (lambda: float8_cast.block_cast_float8(w, block=(128, 128), columnwise=True),
                                    w.numel() * 4),
    }
    saved = float8_cast.BLOCK_CAST_WARPS, float8_cast.BLOCK_CAST_SPLIT, float8_cast.BLOCK_ROW_TILE, \
        float8_cast.BLOCK_COL_TILE
    for name, (fn, nbytes) in blocks.items():
        float8_cast.BLOCK_CAST_SPLIT = False
        for warps in (8, 16):
            float8_cast.BLOCK_CAST_WARPS = warps
            ms = time_ms(fn, iters, warmup)
            print(f"| {name} | one pass 128x128/{warps} | {ms:.3f} | {nbytes / ms / 1e6:.0f} |", flush=True)
        if "128x128" in name:
            continue
        float8_cast.BLOCK_CAST_SPLIT = True
        for rt, ct in (((32, 4), (64, 4)), ((64, 4), (32, 4)), ((16, 4), (64, 8)), ((64, 8), (128, 8))):
            float8_cast.BLOCK_ROW_TILE, float8_cast.BLOCK_COL_TILE = rt, ct
            ms = time_ms(fn, iters, warmup)
            print(f"| {name} | per plane: [{rt[0]},128]/{rt[1]} + [128,{ct[0]}]/{ct[1]} | {ms:.3f} | "
                  f"{nbytes / ms / 1e6:.0f} |", flush=True)
    (float8_cast.BLOCK_CAST_WARPS, float8_cast.BLOCK_CAST_SPLIT, float8_cast.BLOCK_ROW_TILE,
     float8_cast.BLOCK_COL_TILE) = saved


if __name__ == "__main__":
    main()
