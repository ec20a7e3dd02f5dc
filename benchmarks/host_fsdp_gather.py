"""Host time of FSDP2's quantized weight all-gathers, per gather, on tiny weights where Python dominates.

bench_fsdp.py's model (a stack of ``LayerNormMLP`` blocks, each its own ``fully_shard`` unit, bf16
params, fp32 master weights and reduce-scatter, AdamW) at a size where compute is negligible, so a
step's time is the host's. Times are the calling thread's CPU time (``time.thread_time``, one intra-op
thread), which other processes on a busy machine move much less than wall time. Per mode, the minimum over
steps (``--stat``, min by default: the least disturbed step) of:

* ``step ms`` / ``step CPU ms``: a whole training step (forward, backward, optimizer), wall and CPU time;
* ``pre`` / ``post`` / ``fill``: microseconds per all-gather spent in ``MXAllGatherWeight.fsdp_pre_all_gather``
  (the shard's cast, FP8 amax all-reduce included), ``fsdp_post_all_gather`` and its ``_GatheredState.fill``
  (part of ``post``);
* ``amax AR us``: the part of ``pre`` in the FP8 amax all-reduce (on gloo it also waits for the other rank;
  under NCCL it is only issued); ``amax ARs``: those all-reduces in a step (``all_gather_stats()``);
* ``pre ops`` / ``post ops``: aten ops per gather in the hooks, views included (counted in one extra step): a
  figure the machine's load does not move. On a GPU each non-view op is a kernel launch, except that there
  the FP8 and MX casts are one kernel each where the CPU runs the reference's few ops;
* ``disp`` : microseconds per gather in the two subclasses' ``__torch_dispatch__`` (FSDP's views, the
  optimizer's ops on the sharded weights, module reads of the gathered weight);
* ``calls``: Python and builtin function calls in one more step (cProfile's count, the timers off): what
  the machine's load does not move;
* ``vs hp``: the step's extra CPU time over the same recipe with FSDP's own high-precision all-gathers
  (the ``+bf16ag`` mode of the recipe, run in the same call), per quantized all-gather.

    torchrun --nproc_per_node=2 benchmarks/host_fsdp_gather.py             # every recipe, both gathers
    torchrun --nproc_per_node=2 benchmarks/host_fsdp_gather.py --modes fp8_current+bf16ag,fp8_current+fp8ag
    ... --cprofile fp8_current+fp8ag     # also rank 0's cProfile of that mode's timed steps (top functions)
    torchrun --nproc_per_node=2 benchmarks/host_fsdp_gather.py --model llama --layers 8 --hidden 64 --ffn 256 \
        --modes hf,bf16,fp8_current+fp8ag,mxfp8+mxag,fp8_block+fp8ag     # a converted tiny Llama (bench_e2e's)
    ... --no-shard      # the same models without fully_shard (each rank alone): the modules' own host time

``--model llama`` trains ``convert_llama`` of a Hugging Face ``LlamaForCausalLM`` (``--layers`` decoder layers,
``--hidden`` / ``--ffn`` wide, 4 heads, 2 KV heads, vocab 256) as ``bench_e2e.py --fsdp`` does: fp32 master
weights, ``fully_shard`` per decoder layer and the root; mode ``hf`` is the Hugging Face model itself (bf16
compute), ``bf16`` the converted model without a recipe.

Runs on CPU with gloo (or CUDA with NCCL, where the figures are issue time, not step time). Ranks step
together, so rank 0's figures stand for both. Shared machines vary by 10-30% between runs: compare
modes within one call (``--rounds`` alternates them).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import datetime
import functools
import io
import os
import pstats
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fsdp import GEMM_MODES, MODES, build, init_distributed  # noqa: E402

import mxtrain  # noqa: E402
from mxtrain.distributed import all_gather_stats, reset_all_gather_stats  # noqa: E402
from mxtrain.distributed import fsdp as F  # noqa: E402

DEFAULT_MODES = ("bf16", "mxfp8+bf16ag", "mxfp8+mxag", "fp8_current+bf16ag", "fp8_current+fp8ag",
                 "fp8_delayed+bf16ag", "fp8_delayed+fp8ag", "fp8_block+bf16ag", "fp8_block+fp8ag")


# ops that wait for the GPU when run on CUDA data: a device value read on the host (.item(), bool(), int()),
# data-dependent output sizes; and (below) any copy to another device, e.g. a tensor built from Python data
# on the CPU and sent to the GPU (a pageable host-to-device copy)
SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique_dim", "_unique2"}


class OpCounter(TorchDispatchMode):
    """Counts the aten ops run under it (on a GPU each is at least one kernel launch or a host-side op), and
    notes where an op of ``SYNC_OPS`` or a copy to another device came from."""

    def __init__(self, counts, key, syncs):
        super().__init__()
        self.counts, self.key, self.syncs = counts, key, syncs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.counts[self.key] += 1
        name = func.overloadpacket.__name__
        moves = (name == "_to_copy" and "device" in kwargs and args and isinstance(args[0], torch.Tensor)
                 and torch.device(kwargs["device"]) != args[0].device)
        if name in SYNC_OPS or moves:
            where = next((f"{os.path.relpath(f.filename)}:{f.lineno}" for f in reversed(traceback.extract_stack())
                          if "/mxtrain/" in f.filename), "?")
            self.syncs[f"{func} at {where}"] += 1
        return func(*args, **kwargs)


class HookTimer:
    """Accumulates host seconds spent in the all-gather hooks and the subclasses' dispatch (patched in place)."""

    def __init__(self):
        self.seconds = collections.Counter()
        self.ops = collections.Counter()
        self.syncs = collections.Counter()
        self.count_ops = False  # True: count the aten ops of the pre / post hooks (slower: not timed)
        self._undo = []
        self._wrap(F.MXAllGatherWeight, "fsdp_pre_all_gather", "pre")
        self._wrap(F.MXAllGatherWeight, "fsdp_post_all_gather", "post")
        self._wrap(F._GatheredState, "fill", "fill")
        self._wrap(F.MXAllGatherWeight, "__torch_dispatch__", "disp", classmethod_=True)
        self._wrap(F.MXGatheredWeight, "__torch_dispatch__", "disp", classmethod_=True)
        self._wrap(F, "all_reduce_amax", "allreduce", module=True)

    def _wrap(self, cls, name, key, classmethod_=False, module=False):
        orig = getattr(cls, name) if module else cls.__dict__[name]
        fn = orig.__func__ if classmethod_ else orig
        seconds = self.seconds

        @functools.wraps(fn)
        def timed(*a, **k):
            if self.count_ops and key in ("pre", "post"):
                with OpCounter(self.ops, key, self.syncs):
                    return fn(*a, **k)
            t0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                seconds[key] += time.thread_time() - t0

        setattr(cls, name, classmethod(timed) if classmethod_ else timed)
        self._undo.append((cls, name, orig))

    def close(self):
        for cls, name, orig in reversed(self._undo):
            setattr(cls, name, orig)


def build_llama(mode, args, device, rank):
    """bench_e2e.py --fsdp's model at ``args``' size: (model, optimizer, recipe, (ids, targets)); ``hf``: the
    Hugging Face model unconverted. Without ``args.shard`` nothing is sharded (and no all-gather quantized)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    from mxtrain.distributed import enable_quantized_all_gather
    from mxtrain.integrations.llama import convert_llama

    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True,
                      max_position_embeddings=max(64, args.seq), rms_norm_eps=1e-5)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf = LlamaForCausalLM(cfg).to(device)
    recipe = None
    if mode == "hf":
        model, layers = hf, hf.model.layers
        if not args.shard:
            model.to(torch.bfloat16)
    else:
        model = convert_llama(hf, dtype=torch.float32 if args.shard else torch.bfloat16, device=device)
        layers = model.layers
        if mode != "bf16":
            recipe_name, quantized_ag = GEMM_MODES[mode]
            recipe = mxtrain.recipe_from_string(recipe_name)
            if quantized_ag and args.shard:
                enable_quantized_all_gather(model, recipe=recipe)
    if args.shard:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator(device=device).manual_seed(rank)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), device=device, generator=g)
    return model, opt, recipe, (ids[:, :-1].contiguous(), ids[:, 1:].contiguous())


def forward_loss(model, x, args):
    """The step's loss: bench_fsdp's stack on activations, or the Llama models on tokens."""
    if args.model == "stack":
        return model(x).float().pow(2).mean()
    ids, targets = x
    from mxtrain.integrations.llama import MXLlamaForCausalLM

    if isinstance(model, MXLlamaForCausalLM):
        return model(ids, targets)
    logits = model(input_ids=ids).logits
    return torch.nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def run_mode(mode, args, device, rank, profile: bool):
    model, opt, recipe, x = (build if args.model == "stack" else build_llama)(mode, args, device, rank)
    timer = HookTimer()
    prof = cProfile.Profile() if profile else None
    rows = []
    try:
        for i in range(args.warmup + args.steps):
            timed = i >= args.warmup
            reset_all_gather_stats()
            timer.seconds.clear()
            if device.type == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            if prof is not None and timed:
                prof.enable()
            t0, c0 = time.perf_counter(), time.thread_time()
            with mxtrain.mx_autocast(enabled=recipe is not None, recipe=recipe):
                loss = forward_loss(model, x, args)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            dt, dc = time.perf_counter() - t0, time.thread_time() - c0
            if prof is not None and timed:
                prof.disable()
            if timed:
                st = all_gather_stats()
                rows.append({"step": dt, "step_cpu": dc, "gathers": st["gathers"], "ars": st["amax_reductions"],
                             **timer.seconds})
        # one more step counting the hooks' aten ops
        reset_all_gather_stats()
        timer.count_ops = True
        with mxtrain.mx_autocast(enabled=recipe is not None, recipe=recipe):
            loss = forward_loss(model, x, args)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ops_gathers = all_gather_stats()["gathers"]
    finally:
        timer.close()
    # and one counting the Python and builtin function calls of a step (cProfile's count, the timers
    # unpatched): a figure of the host's work that the machine's load does not move
    counter = cProfile.Profile()
    counter.enable()
    with mxtrain.mx_autocast(enabled=recipe is not None, recipe=recipe):
        loss = forward_loss(model, x, args)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    counter.disable()
    py_calls = sum(nc for (_, nc, _, _, _) in pstats.Stats(counter).stats.values())
    # the least disturbed step: other work on the machine only adds time
    med = lambda k: (min if args.stat == "min" else statistics.median)(r.get(k, 0.0) for r in rows)  # noqa: E731
    res = {"mode": mode, "step_ms": 1e3 * med("step"), "step_cpu_ms": 1e3 * med("step_cpu"),
           "gathers": rows[-1]["gathers"], "ars": rows[-1]["ars"], "calls": py_calls}
    n = max(1, res["gathers"])
    for k in ("pre", "post", "fill", "disp", "allreduce"):
        res[k + "_us"] = 1e6 * med(k) / n
    for k in ("pre", "post"):
        res[k + "_ops"] = timer.ops[k] / max(1, ops_gathers)
    res["syncs"] = dict(timer.syncs)
    if prof is not None:
        out = io.StringIO()
        if args.cprofile_out:
            prof.dump_stats(args.cprofile_out)
        st = pstats.Stats(prof, stream=out)
        st.sort_stats("tottime").print_stats(args.cprofile_top)
        st.sort_stats("cumulative").print_stats(args.cprofile_top)
        res["cprofile"] = out.getvalue()
    del model, opt, x
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("stack", "llama"), default="stack",
                   help="stack: bench_fsdp.py's LayerNormMLP blocks; llama: a converted tiny Llama (see above)")
    p.add_argument("--no-shard", dest="shard", action="store_false",
                   help="no fully_shard: each rank trains the whole model alone (the modules' own host time)")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--batch", type=int, default=1, help="sequences per rank")
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--stat", choices=("min", "median"), default="min", help="of each figure over the timed steps")
    p.add_argument("--rounds", type=int, default=1, help="run the modes this many times, alternated")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated, from {', '.join(MODES)}")
    p.add_argument("--cprofile", default=None, metavar="MODE", help="cProfile rank 0's timed steps of this mode")
    p.add_argument("--cprofile-top", type=int, default=30)
    p.add_argument("--cprofile-out", default=None, metavar="FILE", help="also dump that profile here (pstats)")
    args = p.parse_args()
    args.forward_prefetch = args.backward_prefetch = 0  # what bench_fsdp.build reads
    modes = [m.strip() for m in args.modes.split(",")]
    unknown = [m for m in modes if m not in MODES and not (m == "hf" and args.model == "llama")]
    if unknown:
        raise SystemExit(f"unknown mode(s) {', '.join(map(repr, unknown))}; choose from {', '.join(MODES)} "
                         "(and hf with --model llama)")
    if not args.shard and args.model == "stack":
        raise SystemExit("--no-shard applies to --model llama")
    device = init_distributed()
    torch.set_num_threads(1)  # the ops' work on this thread, where thread_time sees it
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for rnd in range(args.rounds):
        for m in modes:
            r = run_mode(m, args, device, rank, profile=(rank == 0 and m == args.cprofile and rnd == 0))
            r["round"] = rnd
            results.append(r)
    if rank == 0:
        what = (f"{args.layers} x LayerNormMLP({args.hidden}, {args.ffn})" if args.model == "stack" else
                f"Llama, {args.layers} layers, hidden {args.hidden}, ffn {args.ffn}")
        print(f"host_fsdp_gather.py: {what}, {'FSDP2' if args.shard else 'no FSDP2, each'} over {world} "
              f"{device.type} ranks ({dist.get_backend()}), {args.batch} x {args.seq} tokens per rank, {args.stat} of "
              f"{args.steps} steps after {args.warmup} (thread CPU time); torch {torch.__version__}; {datetime.date.today()}\n")
        print(f"| {'mode':<20} | round | step ms | step CPU ms | gathers | amax ARs | pre us | amax AR us | post us | fill us | disp us | "
              "vs hp us | pre ops | post ops | calls |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        hp = {}
        for r in results:
            recipe, _, ag = r["mode"].partition("+")
            if ag == "bf16ag":
                hp[(recipe, r["round"])] = r["step_cpu_ms"]
            base = hp.get((recipe, r["round"]))
            extra = (f"{1e3 * (r['step_cpu_ms'] - base) / r['gathers']:.0f}"
                     if ag not in ("", "bf16ag") and base is not None and r["gathers"] else "")
            print(f"| {r['mode']:<20} | {r['round']} | {r['step_ms']:.1f} | {r['step_cpu_ms']:.1f} | {r['gathers']} | {r['ars']} | {r['pre_us']:.0f} | "
                  f"{r['allreduce_us']:.0f} | {r['post_us']:.0f} | {r['fill_us']:.0f} | {r['disp_us']:.0f} | {extra} | "
                  f"{r['pre_ops']:.1f} | {r['post_ops']:.1f} | {r['calls']} |")
        syncs = {(r["mode"], k): v for r in results if r["round"] == 0 for k, v in r["syncs"].items()}
        print("\nOps in the hooks that would wait for the GPU (or copy across devices) on CUDA data, per step:")
        for (mode, what), v in sorted(syncs.items()):
            print(f"  {mode}: {v} x {what}")
        if not syncs:
            print("  none")
        for r in results:
            if "cprofile" in r:
                print(f"\ncProfile of {r['mode']}, rank 0, {args.steps} steps:\n{r['cprofile']}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
