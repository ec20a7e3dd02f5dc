"""An MXFP8 linear layer, forward + backward, against torchao's emulated MX linear and bf16 (same run).

The layer is the issue's MLP up-projection: 8192 tokens, 4096 -> 14336, bf16, no bias. Three sides:

* ``bf16``: ``F.linear`` with autograd (cuBLAS bf16);
* ``mxtrain``: ``mxtrain.Linear`` under ``MXFP8Recipe()`` (e4m3 everywhere, rceil scales): the CUDA casts
  write each operand's dequantized bf16 values and cuBLAS bf16 runs the three GEMMs (Hopper);
* ``torchao``: torchao's ``mx_mm`` (``torchao.prototype.moe_training.mxfp8_linear``) with
  ``KernelPreference.EMULATED`` (its Hopper path: MX casts, then dequantize and a bf16 matmul), e4m3,
  rceil, its Triton dim0 / dim1 casts (``--dim1 torch`` for its pure-torch one).

Both MX sides quantize the same tensors with the same format and scale rule (the reference casts agree
byte for byte: tests/quantization/test_torchao_oracle.py), so the script also prints how far their
outputs and gradients are apart, next to how far each is from bf16.

    pip install --no-deps torchao==0.18.0
    python benchmarks/bench_linear_torchao.py [--tokens 8192 --din 4096 --dout 14336]
"""

from __future__ import annotations

import argparse
import datetime

import torch
import torch.nn.functional as F
import triton
import triton.testing

import mxtrain


def torchao_linear(dim1: str):
    from torchao.prototype.moe_training.mxfp8_linear import mx_mm
    from torchao.prototype.mx_formats.config import (MXFP8Dim0CastKernelChoice, MXFP8Dim1CastKernelChoice,
                                                     ScaleCalculationMode)
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    e4m3 = torch.float8_e4m3fn
    d1 = {"triton": MXFP8Dim1CastKernelChoice.TRITON, "torch": MXFP8Dim1CastKernelChoice.TORCH}[dim1]

    def fn(x, w):
        return mx_mm.apply(x, w, e4m3, e4m3, e4m3, 32, KernelPreference.EMULATED, MXFP8Dim0CastKernelChoice.TRITON,
                           d1, ScaleCalculationMode.RCEIL, False)
    return fn


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--din", type=int, default=4096)
    p.add_argument("--dout", type=int, default=14336)
    p.add_argument("--dim1", choices=("triton", "torch"), default="triton")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_linear_torchao.py needs a CUDA device")
    import torchao

    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(args.tokens, args.din, device=dev, dtype=dt, generator=g).requires_grad_(True)
    lin = mxtrain.Linear(args.din, args.dout, bias=False, device=dev, dtype=dt)
    dy = torch.randn(args.tokens, args.dout, device=dev, dtype=dt, generator=g)
    recipe = mxtrain.MXFP8Recipe()
    tao = torchao_linear(args.dim1)

    def step_bf16():
        y = F.linear(x, lin.weight)
        return (y, *torch.autograd.grad(y, (x, lin.weight), dy))

    def step_mxtrain():
        with mxtrain.mx_autocast(recipe=recipe):
            y = lin(x)
        return (y, *torch.autograd.grad(y, (x, lin.weight), dy))

    def step_torchao():
        y = tao(x, lin.weight)
        return (y, *torch.autograd.grad(y, (x, lin.weight), dy))

    sides = {"bf16 (F.linear)": step_bf16, "mxtrain.Linear, MXFP8Recipe": step_mxtrain,
             f"torchao {torchao.__version__} mx_mm EMULATED": step_torchao}
    outs = {k: fn() for k, fn in sides.items()}
    flops = 3 * 2 * args.tokens * args.din * args.dout
    rows = []
    base = None
    for name, fn in sides.items():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - before) / 2**20
        ms = triton.testing.do_bench(fn, warmup=20, rep=200, return_mode="median")
        base = ms if base is None else base
        rows.append(f"| {name} | {ms:.3f} | {flops / ms / 1e9:.0f} | {base / ms:.2f}x | {peak:.0f} |")
    names = list(outs)
    err = []
    for label, i in (("y", 0), ("dx", 1), ("dw", 2)):
        err.append(f"| {label} | {rel(outs[names[1]][i], outs[names[0]][i]):.2e} | "
                   f"{rel(outs[names[2]][i], outs[names[0]][i]):.2e} | {rel(outs[names[1]][i], outs[names[2]][i]):.2e} |")
    print(f"{torch.cuda.get_device_name()}, {datetime.date.today()}, torch {torch.__version__}, "
          f"triton {triton.__version__}, torchao {torchao.__version__}; {args.tokens} tokens, "
          f"{args.din} -> {args.dout}, bf16, forward + backward (3 GEMMs)")
    print("\n| side | ms | TFLOP/s (3 GEMMs) | speed vs bf16 | peak MiB above inputs |\n|---|---|---|---|---|")
    print("\n".join(rows))
    print("\n| tensor | mxtrain vs bf16 (rel. Frobenius) | torchao vs bf16 | mxtrain vs torchao |\n|---|---|---|---|")
    print("\n".join(err))


if __name__ == "__main__":
    main()
