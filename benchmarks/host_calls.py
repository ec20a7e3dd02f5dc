"""Host time per call of each piece of the MX module path on CUDA: the casts, the dequantize, the GEMM
dispatch, FSDP2's MX all-gather hooks (the send buffer of a shard, the gathered planes filled from a
gather buffer), and one LayerNormMLP forward / forward+backward, in microseconds.

Each piece runs back to back without a synchronize in between (the GPU keeps up at these small
shapes), so the time per call is what the host spends issuing it: the Python layers, argument
checks, allocations and the launch. ``profile_host.py`` shows the same for the whole module against
the torch block; this script names the piece. Host timings on shared machines vary by 20-40% from
run to run: compare pieces within one run.

    python benchmarks/host_calls.py                       # 128 x 1024 bf16 operands
    python benchmarks/host_calls.py --tokens 256 --hidden 2048 --calls 500
    python benchmarks/host_calls.py --device cpu --tokens 16 --hidden 64 --ffn 128   # the modules' Python path
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import mxtrain
from mxtrain.formats import parse_format
from mxtrain.kernels import cuda_cast, dispatch
from mxtrain.kernels.activation_cast import activation_cast
from mxtrain.kernels.cast import triton_quantize
from mxtrain.kernels.dequantize import triton_dequantize
from mxtrain.kernels.norm_cast import norm_cast
from mxtrain.modules._quantizer import make_quantizers


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--repeats", type=int, default=3,
                   help="time each piece this many times (batches of --calls): the table gives the fastest and "
                        "the median batch, the fastest being the least disturbed by the machine's other work")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: only the modules' forward+backward under each recipe family (tiny shapes make it the "
                        "host cost of their Python path: quantizers, autograd, dispatch)")
    args = p.parse_args()
    if args.device == "cpu":
        return cpu_modules(args)
    if not torch.cuda.is_available():
        raise SystemExit("host_calls.py times the CUDA path: it needs a GPU (or --device cpu)")
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    x = torch.randn(args.tokens, args.hidden, device=dev, dtype=bf16)
    w = torch.nn.Parameter(torch.randn(args.hidden, args.hidden, device=dev, dtype=bf16))
    g, b = torch.ones(args.hidden, device=dev, dtype=bf16), torch.zeros(args.hidden, device=dev, dtype=bf16)
    fmt = parse_format("fp8_e4m3")
    recipe = mxtrain.MXFP8Recipe()
    quantizers = make_quantizers(recipe)[""]
    mx = dispatch.quantize(x, fmt, axis=(1, 0))
    row_values = dispatch.quantize(x, fmt, axis=(1,), dequantized=(1,), keep_codes=())
    w_values = dispatch.quantize(w, fmt, axis=(1,), dequantized=(1,), keep_codes=())
    m = mxtrain.LayerNormMLP(args.hidden, args.ffn, bias=False, device=dev, dtype=bf16)
    xg = x.clone().requires_grad_()
    with mxtrain.mx_autocast(recipe=recipe):
        dy = torch.randn_like(m(xg))

    def forward():
        with mxtrain.mx_autocast(recipe=recipe):
            return m(xg)

    # FSDP2's MX all-gather hooks on one weight shard (fp32 master, bf16 params, 2 ranks): the send buffer,
    # and the gathered planes dequantized from a gather buffer (a copy each call: fill frees it)
    from mxtrain.distributed.fsdp import MXAllGatherWeight, _GatheredState, _WeightInfo

    shard = MXAllGatherWeight(torch.randn(args.hidden // 2, args.hidden, device=dev), _WeightInfo("w"))
    full = (args.hidden, args.hidden)
    wspec, dspec = recipe.role("fprop_weight"), recipe.role("dgrad_weight")
    (send,), meta = shard._mx_input([(wspec, 1)], full, 2, bf16)
    gathered = torch.cat([send, send])
    state = _GatheredState("w", [gathered.new_empty(0)])

    def forward_backward():
        with mxtrain.mx_autocast(recipe=recipe):
            y = m(xg)
        y.backward(dy)

    pieces = [
        ("torch.mm (for scale)", lambda: torch.mm(x, w.t())),
        ("torch tensor.float() (for scale)", lambda: x.float()),
        ("CUDA cast, both planes (dispatch.quantize)", lambda: dispatch.quantize(x, fmt, axis=(1, 0))),
        ("Quantizer, weight fprop plane", lambda: quantizers.weight.quantize(w, True, False)),
        ("Quantizer, input row + col", lambda: quantizers.input.quantize(x)),
        ("Triton cast, both planes", lambda: triton_quantize(x, fmt, axis=(-1, 0))),
        ("dequantize, rowwise plane", lambda: triton_dequantize(mx, bf16, 1)),
        ("dequantize, columnwise plane", lambda: triton_dequantize(mx, bf16, 0)),
        ("norm_cast LayerNorm, both planes", lambda: norm_cast(x, g, b, fmt=fmt, dequantized=(1,), keep_codes=(0,))),
        ("activation_cast gelu, rowwise values", lambda: activation_cast(x, "gelu", fmt, axis=(-1,), dequantized=(1,),
                                                                         keep_codes=())),
        ("mx_gemm, values x values", lambda: dispatch.mx_gemm(row_values, w_values, out_dtype=bf16)),
        ("FSDP MX send buffer, rowwise (fp32 shard)", lambda: shard._mx_input([(wspec, 1)], full, 2, bf16)),
        ("FSDP MX send buffer, columnwise (fp32 shard)", lambda: shard._mx_input([(dspec, 0)], full, 2, bf16)),
        ("gather buffer copy (for the next row)", lambda: gathered.clone()),
        ("FSDP gathered planes filled (copy included)", lambda: state.fill(gathered.clone(), meta)),
        (f"LayerNormMLP {args.hidden}/{args.ffn} forward", forward),
        (f"LayerNormMLP {args.hidden}/{args.ffn} forward+backward", forward_backward),
    ]
    print(f"host us per call, {args.tokens} x {args.hidden} bf16, {torch.cuda.get_device_name(dev)}, "
          f"torch {torch.__version__}, CUDA kernels {'built' if cuda_cast.library() else 'unavailable'}")
    print(f"| call | host us (fastest of {args.repeats}) | host us (median) |")
    print("|---|---|---|")
    _time_pieces(pieces, args, torch.cuda.synchronize)


def _time_pieces(pieces, args, sync) -> None:
    for name, fn in pieces:
        calls = args.calls if "LayerNormMLP" not in name else max(1, args.calls // 3)
        for _ in range(20):
            fn()
        sync()
        batches = []
        for _ in range(max(1, args.repeats)):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            batches.append((time.perf_counter() - t0) / calls * 1e6)
            sync()
        batches.sort()
        print(f"| {name} | {batches[0]:.1f} | {batches[len(batches) // 2]:.1f} |", flush=True)


def cpu_modules(args) -> None:
    """Forward+backward of Linear, LayerNormLinear and LayerNormMLP on the CPU under one recipe of each family."""
    torch.manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, requires_grad=True)
    modules = [("Linear", mxtrain.Linear(args.hidden, args.hidden)),
               ("LayerNormLinear", mxtrain.LayerNormLinear(args.hidden, args.hidden)),
               ("LayerNormMLP", mxtrain.LayerNormMLP(args.hidden, args.ffn))]
    recipes = [("MXFP8", mxtrain.MXFP8Recipe()), ("Float8CurrentScaling", mxtrain.Float8CurrentScaling()),
               ("DelayedScaling", mxtrain.DelayedScaling())]

    def step(m, recipe):
        def run():
            with mxtrain.mx_autocast(recipe=recipe):
                y = m(x)
            y.sum().backward()
        return run

    pieces = [(f"{name} {rname} forward+backward", step(m, r)) for name, m in modules for rname, r in recipes]
    print(f"host us per call (CPU), {args.tokens} x {args.hidden} fp32 (ffn {args.ffn}), torch {torch.__version__}")
    # the CPU casts and GEMMs are slow and the time noisy on a shared machine: the count of Python function
    # calls a step makes (after warm-up) is the steady measure of the path's host work
    print("| call | Python calls per step |")
    print("|---|---|")
    for name, fn in pieces:
        for _ in range(3):
            fn()
        print(f"| {name} | {_python_calls(fn)} |", flush=True)
    print(f"| call | host us (fastest of {args.repeats}) | host us (median) |")
    print("|---|---|---|")
    _time_pieces(pieces, args, lambda: None)


def _python_calls(fn) -> int:
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        count += event == "call"

    sys.setprofile(tracer)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


if __name__ == "__main__":
    main()
