"""MX GEMM throughput on the GPU against bf16 torch.matmul timed in the same run.

Variants (see benchmarks/NOTES_gemm.md for what each predicts):
* ``dequant+cuBLAS``: the shipped path: fused unpack+dequantize of both MX operands
  to bf16 (exact), then cuBLAS bf16 with fp32 accumulation; timed end to end.
* ``cuBLAS on cached bf16``: the GEMM alone on already-dequantized operands, i.e. the
  ceiling of a design where the cast kernel also writes the bf16 operand.
* ``dequant passes``: the two dequantize kernels alone.

    python benchmarks/bench_gemm.py [--record]
"""

from __future__ import annotations

import argparse
import datetime

import torch
import triton
import triton.testing

from mxtrain.kernels.dispatch import dequantize, mx_gemm, quantize

CASES = [
    ("8192^3", 8192, 8192, 8192, (1, 1)),
    ("MLP fprop 8192x14336x4096", 8192, 14336, 4096, (1, 1)),
    ("MLP dgrad 8192x4096x14336", 8192, 4096, 14336, (1, 0)),
    ("MLP wgrad 14336x4096x8192", 14336, 4096, 8192, (0, 0)),
]


def bench(fn):
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fmt", default="fp8_e4m3")
    p.add_argument("--record", action="store_true")
    args = p.parse_args()
    rows = []
    for name, m, n, k, (a_axis, b_axis) in CASES:
        torch.manual_seed(0)
        # logical operand shapes: a's reduction axis is a_axis, b's is b_axis
        a = torch.randn((m, k) if a_axis == 1 else (k, m), device="cuda", dtype=torch.bfloat16)
        b = torch.randn((n, k) if b_axis == 1 else (k, n), device="cuda", dtype=torch.bfloat16)
        aq = quantize(a, args.fmt, 32, axis=a_axis, scale_mode="rceil")
        bq = quantize(b, args.fmt, 32, axis=b_axis, scale_mode="rceil")
        a_op = a if a_axis == 1 else a.t()
        b_op = b if b_axis == 1 else b.t()
        t_bf16 = bench(lambda: torch.matmul(a_op, b_op.t()))
        t_mx = bench(lambda: mx_gemm(aq, bq, a_axis=a_axis, b_axis=b_axis, out_dtype=torch.bfloat16))
        ad = dequantize(aq, torch.bfloat16, a_axis)
        bd = dequantize(bq, torch.bfloat16, b_axis)
        ad_op = ad if a_axis == 1 else ad.t()
        bd_op = bd if b_axis == 1 else bd.t()
        t_cached = bench(lambda: torch.matmul(ad_op, bd_op.t()))
        t_deq = bench(lambda: (dequantize(aq, torch.bfloat16, a_axis), dequantize(bq, torch.bfloat16, b_axis)))
        flops = 2 * m * n * k
        rows.append((name, flops / t_bf16 / 1e9, flops / t_mx / 1e9, t_bf16 / t_mx, t_bf16 / t_cached, t_deq))
    lines = [f"MX GEMM ({args.fmt}, block 32), bf16 output, {torch.cuda.get_device_name()}", "",
             "| GEMM (MxNxK) | bf16 matmul TFLOP/s | MX dequant+cuBLAS TFLOP/s | ratio | cuBLAS on cached bf16 ratio | dequant passes (ms) |",
             "|---|---|---|---|---|---|"]
    for name, tb, tm, r, rc, td in rows:
        lines.append(f"| {name} | {tb:.0f} | {tm:.0f} | {r:.2f} | {rc:.2f} | {td:.3f} |")
    table = "\n".join(lines)
    print(table)
    if args.record:
        with open("benchmarks/RESULTS.md", "a") as f:
            f.write(f"\n## bench_gemm.py — {datetime.date.today()} — {torch.cuda.get_device_name()}, "
                    f"torch {torch.__version__}, triton {triton.__version__}\n\n{table}\n")


if __name__ == "__main__":
    main()
