"""Whole-model training throughput: tokens/s, peak memory and loss of Llama-family models, every side in one run.

The headline benchmark. Each model is a ``transformers`` ``LlamaConfig`` with random weights and random
tokens (nothing downloaded); every side trains the same model from the same seed with fused AdamW
(bf16 parameters and optimizer state, pure bf16 training as a user would start), and the sides are
alternated round by round in one process on one GPU. Sides:

* ``hf``: Hugging Face ``LlamaForCausalLM`` (sdpa attention), eager; ``hf+compile``: the same under ``torch.compile``;
* ``ao-tensorwise`` / ``ao-rowwise``: torchao float8 training (``convert_to_float8_training``, lm_head kept in
  bf16, as torchao's own Llama recipe does) under ``torch.compile``;
* ``mx:<recipe>``: ``mxtrain.integrations.convert_llama`` of the same model, eager, under ``mx_autocast``
  (``<recipe>`` as ``recipe_from_string`` reads it; ``none`` runs the mxtrain model without a recipe);
  ``mx:<recipe>+graph``: the whole step (forward, backward, optimizer) captured once in a CUDA graph and
  replayed (``mxtrain.make_graphed_step``); ``mx:<recipe>+compile``: the model under ``torch.compile``
  (fullgraph: the fused norm / activation casts are registered ops); ``+unfused`` with ``+compile``: the norm /
  activation op, then the cast op, under compile (``MXTRAIN_COMPILE_FUSED_SOURCES=0``). The mxtrain model computes
  its loss with ``mxtrain.cross_entropy`` (one pass over the logits each way); ``+torchloss`` takes its logits and
  computes the loss as the ``hf`` sides do (``F.cross_entropy(logits.float(), targets)``).

Throughput is timed with CUDA events over ``--steps`` steps after ``--warmup`` steps (compiling and capturing
happen in the warm-up); ``vs hf`` divides by the ``hf`` side of the same round, and the summary gives the median
of those ratios over the rounds. ``issue ms`` is the host's time to issue one eager step (no synchronisation inside
a step), which says whether the GPU waits for the host. Each round builds every side's model anew from the seed, so
the loss is after warm-up + 3 + ``--steps`` steps (``loss@N``), next to its difference from hf's of the same round.

    python benchmarks/bench_e2e.py --model llama-1b                       # all default sides
    python benchmarks/bench_e2e.py --model smollm2-135m --sides hf,mx:mxfp8,mx:mxfp8+graph --rounds 2
    python benchmarks/bench_e2e.py --model llama-1b --profile mx:fp8_current   # where one step's time goes

``--fsdp`` (under ``torchrun``) trains the model with FSDP2 instead: ``fully_shard`` on every decoder layer and
the root, fp32 master weights with bf16 compute and fp32 reduce-scatter (``MixedPrecisionPolicy``), fused AdamW,
``--batch`` sequences per rank. Sides then gather their weights as follows: ``hf`` in bf16; ``ao-tensorwise``
in float8 (``enable_fsdp_float8_all_gather`` with ``precompute_float8_dynamic_scale_for_fsdp`` after each
optimizer step, torchao's best FSDP2 configuration); ``ao-rowwise`` in bf16 (torchao has no rowwise all-gather);
``mx:<recipe>`` quantized by ``mxtrain.distributed.enable_quantized_all_gather`` (MX bytes or FP8 codes), or in
bf16 with ``+bf16ag``. ``+compile`` compiles each decoder layer (as torchtitan does); ``+graph`` captures the
whole FSDP2 step (gathers, reduce-scatters, casts, optimizer) on every rank with ``make_graphed_step`` and replays
it (its gathers are not timed: ``AG ms`` shows "-"; ``AG MiB`` is the last eager warm-up step's, which gathers
what the captured step does).
``+unbatched``: Float8CurrentScaling's FP8 gathers cast each weight in its own gather, not all at the step's first
(``MXTRAIN_FSDP_BATCHED_CASTS=0``; the batched casts are the CUDA default). ``+keep`` (any side): the decoder
layers keep their gathered weights from forward to backward (``reshard_after_forward=False``: one gather a layer a
step, not two; the gathered weights of every layer held until its backward, FP8 / MX bytes for quantized gathers).
Tokens/s count every rank's tokens; the table adds each side's all-gather bytes and kernel time per step.
``--host-phases SIDES``: every rank's unprofiled host time a step by phase and in FSDP2's steps and mxtrain's
all-gather hooks (``hostprof.host_phases``).

``--data austen`` trains on the Jane Austen corpus as byte tokens, a new batch every step (random tokens repeat 4
batches, which every side memorises), so the sides' losses after N steps compare how they train. The GPU machine
needs the corpus (``scripts/install_data.sh`` unpacks it; ``--data-dir`` or ``$MXTRAIN_DATA_DIR`` where it is)
and the ``rdata`` package.

    S=hf,ao-tensorwise+keep,mx:fp8_current+compile+keep+graph,mx:mxfp8+compile+keep+graph
    torchrun --nproc_per_node=2 benchmarks/bench_e2e.py --fsdp --model llama-1b --batch 2 --warmup 5 --steps 42 \
        --data austen --rounds 3 --sides $S,mx:fp8_block+compile+keep+graph
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import gc
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import mxtrain
from mxtrain import config as mx_config

MODELS = {
    # name: (LlamaConfig fields, batch, sequence length)
    "smollm2-135m": (dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                          num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0),
                     8, 1024),
    "llama-1b": (dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=True, rope_theta=500000.0),
                 4, 2048),
    "llama-8b-slice": (dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=4, num_attention_heads=32,
                            num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
                            rope_theta=500000.0), 4, 2048),
    "tiny": (dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True), 2, 64),
}
DEFAULT_SIDES = ("hf,hf+compile,ao-tensorwise,ao-rowwise,mx:none,mx:mxfp8,mx:fp8_current,mx:fp8_delayed,"
                 "mx:fp8_block,mx:none+graph,mx:mxfp8+graph,mx:fp8_current+graph,mx:fp8_delayed+graph,"
                 "mx:fp8_block+graph")


def hf_config(name: str, layers: int | None):
    from transformers import LlamaConfig

    fields, _, _ = MODELS[name]
    fields = dict(fields, max_position_embeddings=8192, rms_norm_eps=1e-5)
    if layers is not None:
        fields["num_hidden_layers"] = layers
    cfg = LlamaConfig(**fields)
    cfg.use_cache = False  # training: no KV cache (a DynamicCache per forward made compiled HF layers recompile)
    cfg._attn_implementation = "sdpa"
    return cfg


def parse_side(side: str) -> tuple[str, str | None, frozenset]:
    """``side`` -> (kind, recipe spec, modes): kind in hf / ao / mx, modes a subset of {compile, graph}."""
    base, *modes = side.split("+")
    bad = set(modes) - {"compile", "graph", "bf16ag", "unfused", "torchloss", "unbatched", "keep"}
    if bad or len(set(modes)) != len(modes):
        raise ValueError(f"side {side!r}: modes after '+' must be compile, graph, unfused, torchloss, bf16ag, "
                         f"unbatched or keep, got {modes}")
    if "unbatched" in modes and not base.startswith("mx:"):
        raise ValueError(f"side {side!r}: +unbatched applies to mx:<recipe> sides (under --fsdp) only")
    if "torchloss" in modes and not base.startswith("mx:"):
        raise ValueError(f"side {side!r}: +torchloss applies to mx:<recipe> sides (the others compute it so)")
    if "unfused" in modes and not (base.startswith("mx:") and "compile" in modes):
        raise ValueError(f"side {side!r}: +unfused applies to mx:<recipe>+compile sides (no fused casts under compile)")
    modes = frozenset(modes)
    if base == "hf":
        return "hf", None, modes
    if "bf16ag" in modes and not base.startswith("mx:"):
        raise ValueError(f"side {side!r}: +bf16ag applies to mx:<recipe> sides (under --fsdp) only")
    if base in ("ao-tensorwise", "ao-rowwise"):
        return "ao", base.removeprefix("ao-"), modes | {"compile"}
    if base.startswith("mx:"):
        mxtrain.recipe_from_string(base[3:])  # refuse a bad spec before any side runs
        return "mx", base[3:], modes
    raise ValueError(f"unknown side {side!r}: expected hf, ao-tensorwise, ao-rowwise or mx:<recipe>, "
                     "then +compile and/or +graph")


def build(side: str, cfg, device, seed: int):
    """(step function, parameters) of one side: ``step(ids, targets) -> loss`` runs forward and backward."""
    from transformers import LlamaForCausalLM

    kind, spec, modes = parse_side(side)
    if "keep" in modes:
        raise ValueError(f"side {side!r}: +keep (reshard_after_forward=False) applies under --fsdp only")
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(cfg).to(device=device, dtype=torch.bfloat16)
    if kind in ("hf", "ao"):
        model = hf
        if kind == "ao":
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

            convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(spec),
                                       module_filter_fn=lambda mod, fqn: fqn != "lm_head")
        fwd = torch.compile(model) if "compile" in modes else model

        def step(ids, targets):
            logits = fwd(input_ids=ids).logits
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))
            loss.backward()
            return loss
        return step, list(model.parameters())

    from mxtrain.integrations.llama import convert_llama

    model = convert_llama(hf, dtype=torch.bfloat16, device=device)
    del hf
    recipe = mxtrain.recipe_from_string(spec)
    fwd = torch.compile(model) if "compile" in modes else model

    # +unfused: under compile the norm / activation op, then the cast op (no fused casts)
    # one settings object for every step: the kernel registry caches its decisions per settings object
    unfused = dataclasses.replace(mx_config.current(), compile_fused_sources=False) if "unfused" in modes else None

    torchloss = "torchloss" in modes

    def step(ids, targets):
        settings = mx_config.use(unfused) if unfused is not None else contextlib.nullcontext()
        with settings, mxtrain.mx_autocast(enabled=recipe is not None, recipe=recipe):
            if torchloss:
                logits = fwd(ids)
                loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))
            else:
                loss = fwd(ids, targets)
        loss.backward()
        return loss
    return step, list(model.parameters())


def build_fsdp(side: str, cfg, device, seed: int):
    """(step function, parameters, after-optimizer hook) of one side under FSDP2 (see the module docstring)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import LlamaForCausalLM

    kind, spec, modes = parse_side(side)
    if "unfused" in modes:
        raise ValueError(f"side {side!r}: +unfused is not supported with --fsdp (set MXTRAIN_COMPILE_FUSED_SOURCES=0)")
    torch.manual_seed(seed)
    with torch.device(device):  # initialised where it trains (a 1B model's CPU init takes seconds per side)
        hf = LlamaForCausalLM(cfg)  # fp32 master weights, as FSDP2 shards them
    after_step = None
    if kind in ("hf", "ao"):
        model, layers = hf, hf.model.layers
        if kind == "ao":
            import dataclasses

            from torchao.float8 import (Float8LinearConfig, convert_to_float8_training,
                                        precompute_float8_dynamic_scale_for_fsdp)

            config = Float8LinearConfig.from_recipe_name(spec)
            if spec == "tensorwise":
                config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
            convert_to_float8_training(model, config=config, module_filter_fn=lambda mod, fqn: fqn != "lm_head")
            if spec == "tensorwise":
                after_step = lambda: precompute_float8_dynamic_scale_for_fsdp(model)  # noqa: E731
    else:
        from mxtrain.distributed import enable_quantized_all_gather
        from mxtrain.integrations.llama import convert_llama

        model = convert_llama(hf, dtype=torch.float32, device=device)
        del hf
        layers = model.layers
    recipe = mxtrain.recipe_from_string(spec) if kind == "mx" else None
    if recipe is not None and "bf16ag" not in modes:
        enable_quantized_all_gather(model, recipe=recipe)
    if "compile" in modes:  # each decoder layer, before fully_shard, as torchtitan does
        for i, layer in enumerate(list(layers)):
            layers.register_module(str(i), torch.compile(layer))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in layers:  # +keep: the layers keep their gathered weights for backward (no second gather)
        fully_shard(layer, mp_policy=mp, reshard_after_forward="keep" not in modes)
    fully_shard(model, mp_policy=mp)

    def step(ids, targets):
        if kind == "mx":
            with mxtrain.mx_autocast(enabled=recipe is not None, recipe=recipe):
                if "torchloss" in modes:
                    logits = model(ids)
                    loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))
                else:
                    loss = model(ids, targets)
        else:
            logits = model(input_ids=ids).logits
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))
        loss.backward()
        return loss
    return step, list(model.parameters()), after_step


def batches(cfg, batch: int, seq: int, device, seed: int, count: int = 4, data: str = "random",
            data_dir: str | None = None):
    """``count`` (inputs, targets) pairs; each side sees the same ones in the same order. ``data``: "random"
    tokens, or "austen": windows of the Jane Austen corpus as byte tokens (ids < 256), real text whose loss
    after N steps compares the sides' training (``mxtrain.data``; ``data_dir`` where it is unpacked)."""
    if data == "austen":
        from mxtrain.data import austen_lm_tokens

        ids, _, _ = austen_lm_tokens(data_dir=data_dir)
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, ids.numel() - seq - 1, (count * batch,), generator=g).tolist()
        windows = torch.stack([ids[s:s + seq + 1] for s in starts]).view(count, batch, seq + 1).to(device)
        return [(w[:, :-1].contiguous(), w[:, 1:].contiguous()) for w in windows]
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (count, batch, seq + 1), device=device, generator=g)
    return [(i[:, :-1].contiguous(), i[:, 1:].contiguous()) for i in ids]


def run_side(side: str, cfg, batch: int, seq: int, args, device) -> dict:
    """Build, warm up and time one side; returns its figures. Every side runs warmup + 3 + steps steps."""
    _, _, modes = parse_side(side)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    rank, world = (dist.get_rank(), dist.get_world_size()) if args.fsdp else (0, 1)
    if args.fsdp:
        step, params, after_step = build_fsdp(side, cfg, device, args.seed)
    else:
        (step, params), after_step = build(side, cfg, device, args.seed), None
    opt = torch.optim.AdamW(params, lr=args.lr, fused=True, capturable="graph" in modes)
    # random tokens repeat 4 batches; Austen gives every step its own batch (warm-up, issue timing, timed steps)
    count = 4 if args.data == "random" else args.warmup + 3 + args.steps
    data = batches(cfg, batch, seq, device, args.seed + rank, count=count, data=args.data, data_dir=args.data_dir)
    inputs, targets = (t.clone() for t in data[0])  # static buffers, refilled before each step
    served = [0]

    def train_step():
        loss = step(inputs, targets)
        opt.step()
        opt.zero_grad(set_to_none="graph" not in modes)
        if after_step is not None:
            after_step()
        return loss

    def next_batch():
        i, t = data[served[0] % len(data)]
        inputs.copy_(i)
        targets.copy_(t)
        served[0] += 1

    def run():
        next_batch()
        return train_step()

    def sync():
        if cuda:
            torch.cuda.synchronize()
        if args.fsdp:
            dist.barrier()

    eager_warmup = args.warmup - ("graph" in modes)
    # a replay's gathers run without the Python the timer hooks: count the bytes of the last eager warm-up step,
    # which gathers what the captured one does
    count_last = args.fsdp and "graph" in modes and eager_warmup > 0
    for _ in range(eager_warmup - count_last):
        run()
    graph_bytes = None
    if count_last:
        from bench_fsdp import AllGatherTimer  # benchmarks/ is on sys.path when this file runs as a script

        counter = AllGatherTimer(device, timed=False)
        try:
            run()
        finally:
            counter.close()
        graph_bytes = counter.bytes
    if "graph" in modes:  # the last warm-up step runs in make_graphed_step, the capture runs none
        next_batch()
        graphed = mxtrain.make_graphed_step(train_step, warmup=1)

        def run():
            next_batch()
            return graphed()
    sync()
    issue = []
    for _ in range(3):  # host time to issue a step, the queue drained first
        sync()
        t0 = time.perf_counter()
        run()
        issue.append(time.perf_counter() - t0)
    gather = None
    if args.fsdp and "graph" not in modes:  # (a replay runs the gathers without the Python the timer hooks)
        from bench_fsdp import AllGatherTimer  # benchmarks/ is on sys.path when this file runs as a script

        gather = AllGatherTimer(device)
    sync()
    try:
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            loss = run()
        if cuda:
            end.record()
        sync()
        # the last timed step's loss (a graph side's replays write it in place: the profilers' steps would not)
        loss = loss.detach().float().clone()
        ms = start.elapsed_time(end) / args.steps if cuda else 1e3 * (time.perf_counter() - t0) / args.steps
        if gather is not None:
            gather_ms, gather_bytes = 1e3 * gather.seconds() / args.steps, gather.bytes / args.steps
    finally:
        if gather is not None:
            gather.close()
    for tool in ("host_profile", "host_trace"):
        if side not in getattr(args, tool, "").split(","):
            continue
        # every rank runs the steps (collectives), rank 0 profiles
        import hostprof

        if rank == 0:
            print(getattr(hostprof, tool)(run, 3, f"{side} rank 0 of {world}" if args.fsdp else side, sync=sync,
                                          out_dir=getattr(args, tool + "_out", None)), flush=True)
        else:  # the same collectives (the profilers synchronise before and after)
            sync()
            for _ in range(3):
                run()
            sync()
    if side in getattr(args, "host_phases", "").split(","):
        import hostprof

        steps = 10
        mine = hostprof.host_phases(run, steps, sync=sync)
        ranks = [None] * world
        if args.fsdp:
            dist.all_gather_object(ranks, mine)
        else:
            ranks = [mine]
        if rank == 0:
            print(hostprof.phases_table(ranks, side, steps), flush=True)
    loss = loss.detach().float()
    if args.fsdp:  # the mean over ranks of the last step's loss
        dist.all_reduce(loss)
        loss /= world
    res = {"side": side, "ms": ms, "tokens_per_s": world * batch * seq / ms * 1e3, "issue_ms": 1e3 * min(issue),
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"), "loss": loss.item()}
    if gather is not None:
        res.update(allgather_ms=gather_ms, allgather_mib=gather_bytes / 2**20)
    elif graph_bytes is not None:
        res.update(allgather_mib=graph_bytes / 2**20)
    return res


def mxtrain_kernel_names() -> set[str]:
    """Names of mxtrain's own kernels (Triton functions and CUDA __global__s), read from its sources."""
    import pathlib
    import re

    root = pathlib.Path(mxtrain.__file__).parent
    names = set()
    for f in (root / "kernels").glob("*.py"):
        names |= set(re.findall(r"@triton\.jit[^\n]*\n(?:\s*@[^\n]*\n)*\s*def (\w+)", f.read_text()))
    for f in (root / "csrc").glob("*.cu*"):
        names |= set(re.findall(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)", f.read_text()))
    return names


KERNEL_CLASSES = (  # (class, substrings of kernel names), first match wins
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "scaled_mm", "cublas")),
    ("attention", ("flash", "fmha", "sdpa")),
    ("optimizer", ("adam", "multi_tensor_apply")),
    ("loss", ("softmax", "nll_loss", "cross_entropy", "logsumexp")),
    ("norm", ("rms_norm", "layer_norm", "rmsnorm", "layernorm")),
    ("copy / cat", ("catarray", "copy_kernel", "direct_copy")),
)


def profile_side(side: str, cfg, batch: int, seq: int, args, device) -> None:
    """Kernel time per class and per op over a few eager steps, against the step's wall and host issue time."""
    from torch.profiler import ProfilerActivity, profile

    step, params = build(side, cfg, device, args.seed)
    opt = torch.optim.AdamW(params, lr=args.lr, fused=True)
    inputs, targets = batches(cfg, batch, seq, device, args.seed, count=1)[0]

    def train_step():
        step(inputs, targets)
        opt.step()
        opt.zero_grad(set_to_none=True)
    for _ in range(args.warmup):
        train_step()
    torch.cuda.synchronize()
    ours = mxtrain_kernel_names()
    n = 3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            train_step()
        issued = time.perf_counter() - t0
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    per_class: dict[str, float] = collections.defaultdict(float)
    per_kernel: dict[str, float] = collections.defaultdict(float)
    launches = 0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA or e.device_time_total <= 0 or \
                getattr(e, "is_user_annotation", False) or e.name.startswith(("Optimizer.", "ProfilerStep")):
            continue  # annotations span kernels counted already
        launches += 1
        name = e.name.lower()
        if e.name.split("(")[0].split("<")[0].removeprefix("void ").strip() in ours:
            cls = "mxtrain casts"
        else:
            cls = next((c for c, keys in KERNEL_CLASSES if any(k in name for k in keys)), "other elementwise")
        per_class[cls] += e.device_time_total / 1e3 / n
        per_kernel[e.name[:150]] += e.device_time_total / 1e3 / n
    busy = sum(per_class.values())
    print(f"\nprofile {side} ({n} steps under the profiler, which slows the host): step {1e3 * wall / n:.1f} ms wall, "
          f"issued in {1e3 * issued / n:.1f} ms, kernels busy {busy:.1f} ms, {launches // n} kernels a step")
    print(f"{'class':<20}{'ms/step':>10}{'share':>8}")
    for cls, t in sorted(per_class.items(), key=lambda kv: -kv[1]):
        print(f"{cls:<20}{t:>10.2f}{t / busy:>8.1%}")
    print(f"\n{'kernel (top 12)':<150}{'ms/step':>9}")
    for k, t in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:12]:
        print(f"{k:<150}{t:>9.2f}")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60))


def summary_lines(results: list, sides: list, fsdp: bool, loss_step: int | None = None) -> list[str]:
    """The table after the rounds: each side's best tokens/s, its step time over the rounds (min-max), its speed
    against the hf side of the same round (min-max, and the median over the rounds: the figure to quote where the
    machine's noise moves single rounds), issue time, peak memory, loss (the best round's, after ``loss_step``
    steps where given: every round builds its model anew) and its difference from hf's loss of the same round
    (the mean over the rounds, in percent), and all-gather bytes and time with FSDP; a note where the hf baseline
    itself moved by more than 5% between rounds (it runs no mxtrain code: that spread is the machine's, and every
    ratio carries it)."""
    lines = []
    hf_ms = {r["round"]: r["ms"] for r in results if r["side"] == "hf" and "ms" in r}
    hf_loss = {r["round"]: r["loss"] for r in results if r["side"] == "hf" and "ms" in r}
    extra = f"{'AG MiB':>9}{'AG ms':>8}" if fsdp else ""
    loss = "loss" if loss_step is None else f"loss@{loss_step}"
    w = max([26] + [len(side) + 1 for side in sides])  # the side column: the longest side's name
    lines.append(f"\n{'side':<{w}}{'tok/s (best)':>13}{'ms (rounds)':>16}{'vs hf':>13}{'median':>8}{'issue ms':>10}"
                 f"{'peak GiB':>10}{loss:>9}{'vs hf':>9}{extra}")
    for side in sides:
        rows = [r for r in results if r["side"] == side and "ms" in r]
        if not rows:
            lines.append(f"{side:<{w}}{'failed':>13}")
            continue
        best = max(rows, key=lambda r: r["tokens_per_s"])
        ratios = [hf_ms[r["round"]] / r["ms"] for r in rows if r["round"] in hf_ms]
        ratio = f"{min(ratios):.2f}-{max(ratios):.2f}x" if ratios else "-"
        median = f"{statistics.median(ratios):.2f}x" if ratios else "-"
        spread = f"{min(r['ms'] for r in rows):.1f}-{max(r['ms'] for r in rows):.1f}"
        deltas = [100 * (r["loss"] / hf_loss[r["round"]] - 1) for r in rows if hf_loss.get(r["round"])]
        delta = f"{sum(deltas) / len(deltas):+.2f}%" if deltas else "-"  # (a NaN loss prints nan)
        extra = ((f"{best['allgather_mib']:>9.1f}" if "allgather_mib" in best else f"{'-':>9}")
                 + (f"{best['allgather_ms']:>8.1f}" if "allgather_ms" in best else f"{'-':>8}") if fsdp else "")
        lines.append(f"{side:<{w}}{best['tokens_per_s']:>13.0f}{spread:>16}{ratio:>13}{median:>8}"
                     f"{best['issue_ms']:>10.1f}{best['peak_gib']:>10.1f}{best['loss']:>9.4f}{delta:>9}{extra}")
    if len(hf_ms) > 1 and max(hf_ms.values()) > 1.05 * min(hf_ms.values()):
        lines.append(f"note: the hf baseline moved by {100 * (max(hf_ms.values()) / min(hf_ms.values()) - 1):.0f}% "
                     "between rounds (the machine's noise): compare sides within a round, or run more rounds")
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="llama-1b")
    p.add_argument("--layers", type=int, default=None, help="override the model's layer count")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default: the model's)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the model's)")
    p.add_argument("--sides", default=DEFAULT_SIDES, help="comma-separated sides (see the module docstring)")
    p.add_argument("--rounds", type=int, default=2, help="times each side runs, alternated with the others")
    p.add_argument("--steps", type=int, default=10, help="timed steps per side and round")
    p.add_argument("--warmup", type=int, default=4, help="untimed steps first (compile, capture, autotune)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", default=None, metavar="SIDES", help="profile these eager sides instead of timing")
    p.add_argument("--json", default=None, help="also write every figure to this JSON file")
    p.add_argument("--host-profile", default="", metavar="SIDES",
                   help="after timing these sides, cProfile 3 steps of each on rank 0 (hostprof.py) and print where "
                        "the host's issue time goes")
    p.add_argument("--host-profile-out", default=None, metavar="DIR", help="also keep the .prof files here")
    p.add_argument("--host-trace", default="", metavar="SIDES",
                   help="after timing these sides, torch.profiler over 3 steps of each on rank 0 (hostprof.py): the "
                        "host's time a step by region (FSDP2's annotations, compiled graphs, optimizer, backward "
                        "nodes), with kernel launches; lighter than --host-profile's cProfile. On CUDA also the GPU's "
                        "side: the compute stream's busy and idle time a step, kernel time by kind, NCCL's overlap")
    p.add_argument("--host-trace-out", default=None, metavar="DIR", help="also keep the chrome traces here")
    p.add_argument("--host-phases", default="", metavar="SIDES",
                   help="after timing these sides, 10 more steps without a profiler: every rank's host time a step in "
                        "forward, backward and optimizer, and in FSDP2's steps and mxtrain's all-gather hooks")
    p.add_argument("--data", choices=("random", "austen"), default="random",
                   help="random tokens (4 batches repeated), or the Austen corpus as byte tokens, a new batch "
                        "every step: its losses compare how the sides train")
    p.add_argument("--data-dir", default=None, help="where the Austen corpus is unpacked (default: mxtrain.data's)")
    p.add_argument("--fsdp", action="store_true",
                   help="FSDP2 over torchrun's ranks (NCCL; gloo on CPU tests the code path only)")
    args = p.parse_args()
    for name in ("rounds", "steps", "warmup"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    for tool in ("host_profile", "host_trace", "host_phases"):
        unknown = [s for s in getattr(args, tool).split(",") if s.strip() and s.strip() not in sides]
        if unknown:
            p.error(f"--{tool.replace('_', '-')} names sides that --sides does not run: {', '.join(unknown)} "
                    f"(--sides: {', '.join(sides)})")
    if args.fsdp:
        if "RANK" not in os.environ:
            p.error("--fsdp runs under torchrun: torchrun --nproc_per_node=N benchmarks/bench_e2e.py --fsdp ...")
        if args.profile:
            p.error("--profile profiles one process; it does not combine with --fsdp")
        from bench_fsdp import init_distributed  # benchmarks/ is on sys.path when this file runs as a script

        device = init_distributed(timeout=datetime.timedelta(minutes=5))  # a stuck collective fails, not hangs
    elif not torch.cuda.is_available():
        raise SystemExit("bench_e2e.py needs a CUDA device (or --fsdp under torchrun, which runs on CPU with gloo)")
    else:
        device = torch.device("cuda")
    rank = dist.get_rank() if args.fsdp else 0
    say = print if rank == 0 else (lambda *a, **k: None)
    cfg = hf_config(args.model, args.layers)
    _, batch, seq = MODELS[args.model]
    batch, seq = args.batch or batch, args.seq or seq
    torch.backends.cuda.matmul.allow_tf32 = True
    if args.profile:
        for side in args.profile.split(","):
            parse_side(side)
            profile_side(side, cfg, batch, seq, args, device)
        return
    for s in sides:
        if "graph" in parse_side(s)[2] and device.type != "cuda":
            p.error(f"side {s!r}: +graph needs CUDA (make_graphed_step captures GPU work); this run is on "
                    f"{device.type}")
    versions = f"torch {torch.__version__}"
    for mod in ("transformers", "torchao", "triton"):
        try:
            versions += f", {mod} {__import__(mod).__version__}"
        except ImportError:
            pass
    if device.type == "cuda":  # (mxtrain.kernels.static_launch; MXTRAIN_STATIC_LAUNCH=0 turns it off)
        import torch._inductor.config as inductor_config

        static = getattr(inductor_config, "static_launch_user_defined_triton_kernels", None)
        versions += f"; user Triton kernels launched {'statically' if static else 'by Triton'} under compile"
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    world = dist.get_world_size() if args.fsdp else 1
    setup = (f"FSDP2 over {world} x {name} ({'NCCL' if device.type == 'cuda' else 'gloo'}), fp32 master weights, "
             f"bf16 compute, fp32 reduce-scatter; {batch} x {seq} tokens a step per rank" if args.fsdp
             else f"{batch} x {seq} tokens a step")
    say(f"{datetime.date.today()} {name} {versions}\n"
        f"{args.model}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, ffn {cfg.intermediate_size}, "
        f"vocab {cfg.vocab_size}; {setup}; {args.warmup} warm-up + {args.steps} timed steps x {args.rounds} rounds")
    results = []
    for r in range(args.rounds):
        order = sides if r % 2 == 0 else sides[::-1]
        for side in order:
            # +unbatched: the FP8 gathers cast each weight in its own gather (MXTRAIN_FSDP_BATCHED_CASTS=0)
            batching = (mx_config.override(fsdp_batched_casts="0") if "unbatched" in parse_side(side)[2]
                        else contextlib.nullcontext())
            try:
                with batching:
                    res = run_side(side, cfg, batch, seq, args, device)
            except Exception as e:  # one side failing must not lose the others' figures
                res = {"side": side, "error": f"{type(e).__name__}: {str(e)[:300]}"}
                print(f"rank {rank} round {r}: {side} failed: {res['error']}", flush=True)
            else:
                gather = (f"  all-gather {res['allgather_mib']:7.1f} MiB"
                          + (f" {res['allgather_ms']:6.1f} ms" if "allgather_ms" in res else " (in the graph)")
                          if "allgather_mib" in res else "")
                say(f"round {r}: {side:<24} {res['ms']:8.1f} ms  {res['tokens_per_s']:9.0f} tok/s  "
                    f"issue {res['issue_ms']:6.1f} ms  peak {res['peak_gib']:5.1f} GiB  loss {res['loss']:.4f}{gather}",
                    flush=True)
            res["round"] = r
            results.append(res)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            torch._dynamo.reset()
    for line in summary_lines(results, sides, args.fsdp, loss_step=args.warmup + 3 + args.steps):
        say(line)
    if args.json and rank == 0:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": name, "world": world, "versions": versions,
                       "results": results}, f, indent=1)
    if args.fsdp:
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
