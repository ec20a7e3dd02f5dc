"""Kernel-time breakdown of one LayerNormMLP forward+backward on CUDA (torch.profiler), MX recipe vs bf16 block.

    python benchmarks/profile_module.py --hidden 4096 --ffn 16384 --tokens 8192 --recipe mxfp8
"""

import argparse

import torch
import torch.nn.functional as F

import mxtrain

p = argparse.ArgumentParser()
p.add_argument("--hidden", type=int, default=4096)
p.add_argument("--ffn", type=int, default=16384)
p.add_argument("--tokens", type=int, default=8192)
p.add_argument("--recipe", default="mxfp8")
p.add_argument("--rows", type=int, default=18)
p.add_argument("--cpu", action="store_true", help="also profile the host side (ops by self CPU time)")
args = p.parse_args()
dev, dt = torch.device("cuda"), torch.bfloat16
x = torch.randn(args.tokens, args.hidden, device=dev, dtype=dt, requires_grad=True)
m = mxtrain.LayerNormMLP(args.hidden, args.ffn, device=dev, dtype=dt)
recipe = mxtrain.recipe_from_string(args.recipe)
dy = torch.randn(args.tokens, args.hidden, device=dev, dtype=dt)  # dense, as a loss downstream gives


def step():
    with mxtrain.mx_autocast(recipe=recipe):
        y = m(x)
    y.backward(dy)


for _ in range(3):
    step()
torch.cuda.synchronize()
torch.cuda.reset_peak_memory_stats()
base = torch.cuda.memory_allocated()
acts = [torch.profiler.ProfilerActivity.CUDA] + ([torch.profiler.ProfilerActivity.CPU] if args.cpu else [])
with torch.profiler.profile(activities=acts) as prof:
    step()
    torch.cuda.synchronize()
print(f"peak above base: {(torch.cuda.max_memory_allocated() - base) / 2**20:.0f} MiB")
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60))
if args.cpu:
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))
