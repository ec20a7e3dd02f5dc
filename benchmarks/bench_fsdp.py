"""FSDP2 step time and all-gather time: weights all-gathered as MXFP8 bytes vs bf16.

A stack of ``mxtrain.LayerNormMLP`` blocks (each its own ``fully_shard`` unit, bf16
params through ``MixedPrecisionPolicy``, fp32 master weights and gradient reduction,
AdamW), trained on random activations. Modes:

* ``bf16``          bf16 compute (no mx_autocast), bf16 all-gathers: plain FSDP2
* ``mxfp8+bf16ag``  MXFP8 GEMMs, bf16 all-gathers (``enable_mx_all_gather`` not called)
* ``mxfp8+mxag``    MXFP8 GEMMs, MXFP8 all-gathers (codes + E8M0 scales in one uint8 buffer)
* ``fp8_current+bf16ag`` / ``fp8_current+fp8ag`` (also ``fp8_delayed``, ``fp8_block``): an FP8 recipe's
  GEMMs with bf16 all-gathers / FP8 all-gathers (codes; scales from one amax all-reduce per block)

All-gather time is the time of the collective kernels themselves (CUDA events around
each ``all_gather_single`` / ``all_gather_into_tensor`` call on FSDP's all-gather
stream, summed over one step); on CPU it is wall time of the call. It overlaps with
compute in a real step, so the step-time difference is what users see.

    torchrun --nproc_per_node=2 benchmarks/bench_fsdp.py                             # 16 x (4096, 16384): 2.1 B params
    torchrun --nproc_per_node=2 benchmarks/bench_fsdp.py --layers 4 --hidden 8192 --ffn 32768  # the same, 4 wide blocks
    ... --modes bf16,mxfp8+mxag,bf16,mxfp8+mxag   # alternated repeats in one call
    torchrun --nproc_per_node=2 benchmarks/bench_fsdp.py --layers 2 --hidden 256 --ffn 1024 --batch 2 --seq 128  # CPU
    ... --modes bf16,fp8_current+bf16ag,fp8_current+fp8ag,fp8_block+fp8ag   # the FP8 recipes
    ... --forward-prefetch 2 --backward-prefetch 2   # FSDP2 explicit prefetching (every mode)
    ... --json out.json --markdown out.md      # rank 0 writes the results
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import time

import torch
import torch.distributed as dist
from torch import nn

import mxtrain
from mxtrain.distributed import all_gather_stats, enable_mx_all_gather, reset_all_gather_stats, set_block_prefetch


class Stack(nn.Module):
    def __init__(self, layers, hidden, ffn, device):
        super().__init__()
        self.blocks = nn.ModuleList(
            mxtrain.LayerNormMLP(hidden, ffn, bias=False, activation="gelu", device=device) for _ in range(layers))

    def forward(self, x):
        for blk in self.blocks:
            x = x + blk(x)
        return x


class AllGatherTimer:
    """Times FSDP2's all-gather collectives (patched on torch.distributed) and counts their bytes."""

    def __init__(self, device, timed: bool = True):
        """``timed=False``: count calls and bytes only (no events: usable while a CUDA graph is captured)."""
        self.device, self.events, self.wall, self.bytes, self.calls = device, [], 0.0, 0, 0
        self.timed = timed
        self.names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
        self.origs = {n: getattr(dist, n) for n in self.names}
        for n in self.names:
            setattr(dist, n, self._wrap(self.origs[n]))

    def _wrap(self, fn):
        def timed(output_tensor, input_tensor, *a, **k):
            self.bytes += input_tensor.numel() * input_tensor.element_size()
            self.calls += 1
            if not self.timed:
                return fn(output_tensor, input_tensor, *a, **k)
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                work = fn(output_tensor, input_tensor, *a, **k)
                end.record()
                self.events.append((start, end))
                return work
            t0 = time.perf_counter()
            work = fn(output_tensor, input_tensor, *a, **k)
            if work is not None and k.get("async_op"):
                work.wait()
            self.wall += time.perf_counter() - t0
            return work
        return timed

    def reset(self):
        self.events, self.wall, self.bytes, self.calls = [], 0.0, 0, 0

    def seconds(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            return sum(s.elapsed_time(e) for s, e in self.events) / 1e3
        return self.wall

    def close(self):
        for n in self.names:
            setattr(dist, n, self.origs[n])


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


DEFAULT_MODES = ("bf16", "mxfp8+bf16ag", "mxfp8+mxag")
# mode -> (recipe string for recipe_from_string, quantized all-gathers)
GEMM_MODES = {"mxfp8+bf16ag": ("mxfp8", False), "mxfp8+mxag": ("mxfp8", True),
              **{f"{r}+{ag}": (r, ag == "fp8ag") for r in ("fp8_current", "fp8_delayed", "fp8_block")
                 for ag in ("bf16ag", "fp8ag")}}
MODES = ("bf16", *GEMM_MODES)


def build(mode, args, device, rank):
    """The sharded model, its optimizer, the recipe (None for bf16) and this rank's input for one mode."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if mode not in MODES:
        raise SystemExit(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    torch.manual_seed(0)
    model = Stack(args.layers, args.hidden, args.ffn, device)
    recipe = None if mode == "bf16" else mxtrain.recipe_from_string(GEMM_MODES[mode][0])
    if mode != "bf16" and GEMM_MODES[mode][1]:
        enable_mx_all_gather(model, recipe=recipe)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for blk in model.blocks:
        fully_shard(blk, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    set_block_prefetch(model.blocks, args.forward_prefetch, args.backward_prefetch)  # 0: FSDP2's default order
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator(device=device).manual_seed(rank)
    x = torch.randn(args.batch, args.seq, args.hidden, device=device, dtype=torch.bfloat16, generator=g)
    return model, opt, recipe, x


def run_mode(mode, args, device, rank, world):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model, opt, recipe, x = build(mode, args, device, rank)
    n_params = sum(p.numel() for p in model.parameters())
    timer = AllGatherTimer(device)
    step_times, ag_times, losses = [], [], []
    try:
        for i in range(args.warmup + args.steps):
            reset_all_gather_stats()
            timer.reset()
            sync(device)
            t0 = time.perf_counter()
            with mxtrain.mx_autocast(enabled=recipe is not None, recipe=recipe):
                y = model(x)
            loss = y.float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync(device)
            dt = time.perf_counter() - t0
            if i >= args.warmup:
                step_times.append(dt)
                ag_times.append(timer.seconds())
                losses.append(loss.item())
        stats = all_gather_stats()
        ag_bytes, ag_calls = timer.bytes, timer.calls
    finally:
        timer.close()
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    res = {"mode": mode, "params": n_params, "step_ms": 1e3 * med(step_times), "step_ms_min": 1e3 * min(step_times),
           "allgather_ms": 1e3 * med(ag_times), "allgather_bytes_per_rank": ag_bytes, "allgather_calls": ag_calls,
           # every all-gather call carries one block (its norm weight included)
           "bytes_per_param_element": ag_bytes / max(1, ag_calls) / (n_params / args.layers / world),
           "mx_weight_bytes_per_element": stats["bytes_per_element"] if stats["elements"] else None,
           "peak_gib": peak, "loss": losses[-1],
           "tokens_per_s": args.batch * args.seq * world / med(step_times)}
    # an FSDP2 module and its state reference each other, and the last step's output (y / loss, whose
    # graph holds FSDP's hooks) references the module: only the cycle collector frees the previous
    # mode's parameters once all of them are gone (without this, the next mode's peak counted them too)
    del model, opt, x, y, loss
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


def model_arguments(p: argparse.ArgumentParser, steps: int) -> None:
    """The model, batch and step options (shared with profile_fsdp.py)."""
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=16384)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help=f"comma-separated, from {', '.join(MODES)}; a mode may repeat (alternated runs in one "
                        f"call: each row's 'vs bf16' is against the last bf16 run before it)")
    p.add_argument("--forward-prefetch", type=int, default=0, metavar="N",
                   help="each block's forward gathers the next N blocks' weights (FSDP2 explicit prefetching; "
                        "0: FSDP2's implicit order, the gather issued when the host reaches the block)")
    p.add_argument("--backward-prefetch", type=int, default=0, metavar="N",
                   help="each block's backward gathers the N blocks before it (0: FSDP2's default, one)")


def init_distributed(timeout: datetime.timedelta | None = None) -> torch.device:
    """NCCL on this rank's GPU under torchrun, else gloo on the CPU (threads split between ranks); ``timeout``:
    how long a stuck collective waits before it fails (torch's default when None)."""
    kw = {} if timeout is None else {"timeout": timeout}
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device, **kw)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", **kw)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("WORLD_SIZE", "1"))))
    return device


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_arguments(p, steps=8)
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    args = p.parse_args()
    device = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    modes = [m.strip() for m in args.modes.split(",")]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"unknown mode(s) {', '.join(map(repr, unknown))} in --modes; choose from {', '.join(MODES)}")
    results = [run_mode(m, args, device, rank, world) for m in modes]
    if rank == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU"
        head = (f"bench_fsdp.py: {args.layers} x LayerNormMLP({args.hidden}, {args.ffn}, gelu, no bias) = "
                f"{results[0]['params'] / 1e9:.2f} B params, FSDP2 over {world} x {name} "
                f"({'NCCL' if device.type == 'cuda' else 'gloo'}), bf16 params (MixedPrecisionPolicy, fp32 master "
                f"and reduce-scatter), AdamW, {args.batch} x {args.seq} tokens per rank; median of {args.steps} "
                f"steps after {args.warmup}; prefetch forward {args.forward_prefetch} / backward "
                f"{args.backward_prefetch or 'default'}; torch {torch.__version__}; {datetime.date.today()}")
        bf16_rows = [i for i, r in enumerate(results) if r["mode"] == "bf16"]

        def vs_bf16(i):  # against the last bf16 run before this row (the first one for rows before any)
            if not bf16_rows:
                return "n/a"
            before = [j for j in bf16_rows if j <= i]
            return f"{results[i]['step_ms'] / results[before[-1] if before else bf16_rows[0]]['step_ms']:.2f}"
        lines = [head, "",
                 "| mode | step (ms) | vs bf16 | all-gather kernels (ms/step) | all-gather MiB/rank/step | "
                 "bytes/param elem | tokens/s | peak GiB |",
                 "|---|---|---|---|---|---|---|---|"]
        for i, r in enumerate(results):
            lines.append(f"| {r['mode']} | {r['step_ms']:.1f} | {vs_bf16(i)} | {r['allgather_ms']:.1f} | "
                         f"{r['allgather_bytes_per_rank'] / 2**20:.0f} | {r['bytes_per_param_element']:.3f} | "
                         f"{r['tokens_per_s']:.0f} | {r['peak_gib']:.1f} |")
        text = "\n".join(lines)
        print(text)
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(text + "\n")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "world": world, "device": name, "torch": torch.__version__,
                           "results": results}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
