"""Per-tensor FP8 casts of MoE tensors: one grouped cast over all experts against one cast per expert.

For each tensor of a Mixtral-8x7B expert layer (top-2 of 8192 tokens, counts padded to ``--align``; ``x``,
the SwiGLU output ``a``, its gradient ``dh``; the stacked weights ``w1``, ``w2``), the median time of
``quantize_float8`` of every expert's rows (both planes; amax pass included) against one
``grouped_cast_float8`` call (``segment_multiple`` = the alignment), CUDA events around each, the two run in
turn. Why GroupedLinear casts every such tensor grouped, whatever its size.

    python benchmarks/bench_grouped_cast.py                    # one GPU
    python benchmarks/bench_grouped_cast.py --small --device cpu   # smoke test (TRITON_INTERPRET=1)
"""

from __future__ import annotations

import argparse
import itertools
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from bench_moe import add_layer_args, route  # noqa: E402

from mxtrain.kernels import grouped_float8_cast as gfc  # noqa: E402
from mxtrain.kernels.dispatch import quantize_float8  # noqa: E402


def _time(fns, iters: int, cuda: bool) -> list[float]:
    """Median milliseconds of each function, the functions run in turn."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(iters):
        for fn, t in zip(fns, times):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                t.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                t.append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(t) for t in times]


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_layer_args(p)
    p.add_argument("--align", type=int, default=32, help="tokens per expert padded to a multiple of this (16, 32)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="tiny shapes (4 experts, 32 -> 2 x 64 -> 32, 64 tokens)")
    args = p.parse_args(argv)
    if args.align < 16 or args.align % 16:
        p.error(f"--align must be a multiple of 16, got {args.align}")
    if args.small:
        args.experts, args.hidden, args.ffn, args.tokens, args.iters = 4, 32, 64, 64, 1
    dev, cuda = torch.device(args.device), args.device.startswith("cuda")
    splits = [-(-n // args.align) * args.align for n in route(args.tokens, args.experts, args.top_k, args.skew)]
    ends = torch.tensor(list(itertools.accumulate(splits)), dtype=torch.int32, device=dev)
    E, H, F = args.experts, args.hidden, args.ffn
    shapes = {"x": (sum(splits), H), "a": (sum(splits), F), "dh": (sum(splits), 2 * F), "w1": (E, 2 * F, H),
              "w2": (E, H, F)}
    backend = None if cuda else "triton"  # the CPU: the Triton kernels under TRITON_INTERPRET=1
    print(f"# per-expert tokens {splits}; {dev} ({torch.cuda.get_device_name(dev) if cuda else 'CPU'})")
    print(f"{'tensor':6s} {'shape':>20s} {'per expert ms':>14s} {'grouped ms':>11s}")
    rows = []
    for name, shape in shapes.items():
        t = torch.randn(*shape, device=dev, dtype=torch.bfloat16)
        parts = list(t) if t.ndim == 3 else [p for p in t.split(splits)]
        grouped_kw = {} if t.ndim == 3 else {"ends": ends, "segment_multiple": args.align}
        per, grouped = _time([
            lambda: [quantize_float8(p, "fp8_e4m3", axes=(1, 0)) for p in parts],
            lambda: gfc.grouped_cast_float8(t, "fp8_e4m3", columnwise=True, backend=backend, **grouped_kw)],
            args.iters, cuda)
        rows.append({"tensor": name, "shape": list(shape), "per_expert_ms": per, "grouped_ms": grouped})
        print(f"{name:6s} {str(list(shape)):>20s} {per:14.3f} {grouped:11.3f}")
    return rows


if __name__ == "__main__":
    main()
