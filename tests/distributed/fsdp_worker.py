"""torchrun worker for tests/distributed: FSDP2 with MX all-gathers, checked against one process.

    python -m torch.distributed.run --standalone --nproc_per_node=2 fsdp_worker.py SCENARIO OUT_DIR

Scenarios (each writes ``OUT_DIR/<scenario>.json`` from rank 0; ``compile`` and ``graph*`` live in
compile_worker.py and graph_worker.py):
  core     gathered planes vs one-process quantization (several recipes, bf16 params),
           bytes per all-gather, training parity (MXFP8 / high precision; reshard after
           forward on/off; grad accumulation; activation checkpointing; mixed modules)
  ckpt     DCP save at step 3, resume in fresh objects, compare with the uninterrupted run;
           leaves the checkpoint and the losses for ``load1`` (one process, other world size)
  fp8      FP8 recipes (current, delayed, block scaling): gathered FP8 planes vs one process, bytes,
           training parity, DCP resume
  load1    (plain python, world size 1) load the 2-rank checkpoint, train on, compare
  fault [TAG]         train 8 steps with a checkpoint every 2; with MXTRAIN_FAULT_STEP=k rank 1
                      SIGKILLs itself at step k; rank 0 logs losses to OUT_DIR/TAG_losses.jsonl
  fault_resume [TAG]  the same, continuing from TAG's newest complete checkpoint

Uses NCCL on CUDA when available, else gloo on CPU.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import mxtrain
from mxtrain import config
import mxtrain.distributed as mxdist
from mxtrain.distributed.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from mxtrain.distributed import fsdp as mxfsdp
from mxtrain.distributed.fsdp import MXGatheredWeight
from mxtrain.kernels.dispatch import quantize
from mxtrain.quantization.float8 import Float8Tensor, quantize_float8

VOCAB, D, T, B = 64, 64, 16, 2  # B*T = 32 tokens per rank: wgrad token blocks never straddle ranks


class Block(nn.Module):
    def __init__(self, mixed: bool, fp8_shapes: bool = False):
        super().__init__()
        self.qkv = mxtrain.LayerNormLinear(D, 3 * D)
        self.proj = mxtrain.Linear(3 * D, D)
        self.mlp = mxtrain.LayerNormMLP(D, 2 * D, activation="gelu")
        self.mixed = mixed
        if mixed:  # torch modules in the block, an mxtrain weight whose K (80) is not a multiple of 32,
            # and one (48 rows: 24 per rank) that cannot be sharded into whole blocks (stays high precision)
            self.up = nn.Linear(D, 80)
            self.down = mxtrain.Linear(80, D, bias=False)
            self.odd = mxtrain.Linear(D, 48)
            self.odd_out = nn.Linear(48, D)
        self.fp8_shapes = fp8_shapes
        if fp8_shapes:  # FP8 all-gathers: 49 rows (25 + 24: uneven shards), 256 rows (whole 128 x 128 blocks per rank)
            self.uneven = mxtrain.Linear(D, 49)
            self.wide = mxtrain.Linear(D, 256)
            self.fp8_out = nn.Linear(49 + 256, D)

    def forward(self, x):
        x = x + self.proj(F.gelu(self.qkv(x)))
        x = x + self.mlp(x)
        if self.mixed:
            x = x + self.down(F.relu(self.up(x))) + self.odd_out(self.odd(x))
        if self.fp8_shapes:
            x = x + self.fp8_out(torch.cat([self.uneven(x), self.wide(x)], -1))
        return x


class Net(nn.Module):
    def __init__(self, n_blocks=2, mixed=False, checkpoint=False, recipe=None, fp8_shapes=False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block(mixed, fp8_shapes) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.checkpoint, self.recipe = checkpoint, recipe

    def forward(self, idx, targets):
        x = self.embed(idx)
        for blk in self.blocks:
            if self.checkpoint:
                # the recompute must see the same recipe: open mx_autocast inside the checkpointed function
                x = torch.utils.checkpoint.checkpoint(_run_block, blk, x, self.recipe, use_reentrant=False)
            else:
                x = blk(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def _run_block(blk, x, recipe):
    with mxtrain.mx_autocast(enabled=recipe is not None, recipe=recipe):
        return blk(x)


# --------------------------------------------------------------------------- setup helpers

def setup():
    import torch.distributed as dist

    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
        torch.set_num_threads(1)
    return dist.get_rank(), dist.get_world_size(), device


def global_batches(steps, micro, world, device, seed=0, b=B):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        mbs = []
        for _ in range(micro):
            idx = torch.randint(0, VOCAB, (world * b, T), generator=g)
            tgt = torch.randint(0, VOCAB, (world * b, T), generator=g)
            mbs.append((idx.to(device), tgt.to(device)))
        out.append(mbs)
    return out


def build(seed, device, mixed=False, checkpoint=False, recipe=None, fp8_shapes=False):
    torch.manual_seed(seed)
    return Net(mixed=mixed, checkpoint=checkpoint, recipe=recipe, fp8_shapes=fp8_shapes).to(device)


def shard(model, world, *, mx=True, reshard_after_forward=True, mp=None, ac=False, prefetch=0, recipe=None):
    """FSDP2 on each block and the root; ``prefetch`` > 0 sets FSDP2's explicit prefetching: each block
    gathers the next ``prefetch`` blocks' weights in its forward and the previous ones in its backward."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if mx:
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mxdist.enable_mx_all_gather(model, activation_checkpointing=ac, strict=False, recipe=recipe)
    kw = {"reshard_after_forward": reshard_after_forward}
    if mp is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=mp, reduce_dtype=torch.float32)
    for blk in model.blocks:
        fully_shard(blk, **kw)
    fully_shard(model, **kw)
    mxdist.set_block_prefetch(model.blocks, prefetch, prefetch)
    return model


def make_opt(model):
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)


def train_steps(model, opt, batches, recipe, rank, world, sharded: bool, start=0, no_sync=False, sum_grads=False):
    """Per-step global mean loss (fp32). ``no_sync``: FSDP2's gradient-accumulation switches (no
    reduce-scatter and no reshard after backward until the last microbatch). ``sum_grads``: each rank
    backpropagates its loss divided by the world size, so that every gradient tensor holds the values
    one process computes (delayed scales do not follow a factor of 2), and the reduced gradients are
    multiplied back by it (exact for a power-of-two world; gloo has no pre-scaled reduce-scatter)."""
    import torch.distributed as dist

    losses = []
    for mbs in batches[start:]:
        total = torch.zeros((), device=mbs[0][0].device)
        for i, (idx, tgt) in enumerate(mbs):
            if sharded and no_sync:
                last = i == len(mbs) - 1
                model.set_requires_gradient_sync(last)
                model.set_reshard_after_backward(last)
            if sharded:
                b = idx.shape[0] // world
                idx, tgt = idx[rank * b:(rank + 1) * b], tgt[rank * b:(rank + 1) * b]
            with mxtrain.mx_autocast(enabled=recipe is not None, recipe=recipe):
                loss = model(idx, tgt) / len(mbs)
            (loss / world if sharded and sum_grads else loss).backward()
            total += loss.detach()
        if sharded:
            dist.all_reduce(total)
            total /= world
            if sum_grads:
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(world)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total.item())
    return losses


def rel(a, b):
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


# --------------------------------------------------------------------------- scenarios

class PlaneRecorder:
    """Wraps MXGatheredWeight.mx_gathered_plane: which gathered planes reached the GEMMs."""

    def __init__(self):
        self.hits, self.misses, self.planes = {}, {}, {}
        self._orig = MXGatheredWeight.mx_gathered_plane
        rec = self

        def wrapped(w, spec, axis):
            mx = rec._orig(w, spec, axis)
            key = f"{w._state.name}:{axis % 2}"
            if spec is not None and spec.fmt is not None:
                d = rec.hits if mx is not None else rec.misses
                d[key] = d.get(key, 0) + 1
            if isinstance(mx, Float8Tensor):  # FP8 codes + scale-inverse, and (delayed) the module's scale now
                p = mx.plane(axis)
                now = (spec.state.scale_for(spec.slot, spec.fmt, p.data.device).clone() if spec.scaling == "delayed"
                       else None)
                rec.planes[key] = (spec, mx, p.data.clone(), p.scale_inv.clone(), now)
            elif mx is not None:  # codes + scales, or (gathered as values) the dequantized values
                vals = mx.dequantized_values(axis)
                if vals is not None:
                    rec.planes[key] = (spec, mx, vals.clone(), None)
                else:
                    p = mx.plane(axis)
                    rec.planes[key] = (spec, mx, p.data.clone(), p.scale.clone())
            return mx

        MXGatheredWeight.mx_gathered_plane = wrapped

    def close(self):
        MXGatheredWeight.mx_gathered_plane = self._orig


def mx_weights(model):
    for mod_name, m in model.named_modules():
        for pname in mxdist.mx_weight_names(m):
            yield f"{mod_name}.{pname}".lstrip("."), getattr(m, pname)


def check_gathered_planes(rank, world, device, recipe, mp, reshard_after_forward=True):
    """Every plane the GEMMs got equals quantizing the full weight in one process (codes and scales)."""
    model = shard(build(1, device, mixed=True), world, reshard_after_forward=reshard_after_forward, mp=mp)
    rec = PlaneRecorder()
    try:
        batch = global_batches(1, 1, world, device, seed=5)
        train_steps(model, torch.optim.SGD(model.parameters(), lr=0.0), batch, recipe, rank, world, True)
    finally:
        rec.close()
    fulls = {name: p.full_tensor() for name, p in mx_weights(model)}
    bad, checked = [], 0
    for key, (spec, mx, data, scale) in rec.planes.items():
        name, axis = key.rsplit(":", 1)
        full = fulls[name].to(mp or fulls[name].dtype)
        ref = quantize(full, spec.fmt, block_size=spec.block_size, axis=int(axis), scale_mode=spec.scale_mode,
                       rounding=spec.rounding)
        p = ref.plane(int(axis))
        same = ref.shape == mx.shape and ref.dtype == mx.dtype and ref.fmt == mx.fmt and ref.block_size == mx.block_size
        if scale is None:  # gathered as values: those of the full weight's plane, bit for bit
            want = ref.dequantize(data.dtype, int(axis))
            ok = same and torch.equal(want.view(torch.int16 if want.element_size() == 2 else torch.int32),
                                      data.view(torch.int16 if data.element_size() == 2 else torch.int32))
        else:
            ok = (same and torch.equal(p.data, data) and torch.equal(p.scale, scale)
                  and p.packed == mx.plane(int(axis)).packed)
        checked += 1
        if not ok:
            bad.append(key)
    values = sum(scale is None for _, _, _, scale in rec.planes.values())
    return {"checked": checked, "bad": bad, "hits": rec.hits, "misses": rec.misses, "values": values}


def count_all_gather_bytes(rank, world, device, recipe, mx: bool, mp):
    """Bytes this rank puts into FSDP's all-gathers for one forward+backward of a model of mxtrain Linears only."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*(mxtrain.Linear(128, 128, bias=False) for _ in range(3))).to(device)
    if mx:
        mxdist.enable_mx_all_gather(model)
    for m in model:
        fully_shard(m, mp_policy=MixedPrecisionPolicy(param_dtype=mp))
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=mp))
    sent = {"bytes": 0, "calls": 0}
    # FSDP2 calls dist.all_gather_single (torch 2.13) or dist.all_gather_into_tensor (older)
    names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
    origs = {n: getattr(dist, n) for n in names}

    def counting(name):
        def fn(output_tensor, input_tensor, *a, **k):
            sent["bytes"] += input_tensor.numel() * input_tensor.element_size()
            sent["calls"] += 1
            return origs[name](output_tensor, input_tensor, *a, **k)
        return fn

    for n in names:
        setattr(dist, n, counting(n))
    mxdist.reset_all_gather_stats()
    try:
        x = torch.randn(32, 128, device=device)
        with mxtrain.mx_autocast(enabled=recipe is not None, recipe=recipe):
            y = model(x)
        y.float().pow(2).mean().backward()
    finally:
        for n in names:
            setattr(dist, n, origs[n])
    weight_elems_per_rank = sum(m.weight.numel() for m in model) // world
    # each Linear is gathered for forward (the root holds no parameters) and, resharded, again for backward
    gathers = sent["calls"]
    return {"bytes": sent["bytes"], "calls": gathers, "stats": mxdist.all_gather_stats(),
            "bytes_per_element": sent["bytes"] / (weight_elems_per_rank * gathers / len(model))}


def fp8_edit_between_passes(rank, world, device, recipe, mp=torch.bfloat16):
    """3 mxtrain Linears (each its own FSDP unit), one forward; then one weight is edited in place under
    no_grad; then backward. The backward gathers of the unchanged weights reuse their forward amaxes (no
    all-reduce); the edited one's must not: its dgrad plane must equal casting the edited full weight."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*(mxtrain.Linear(128, 128, bias=False) for _ in range(3))).to(device)
    mxdist.enable_mx_all_gather(model, recipe=recipe)
    for m in model:
        fully_shard(m, mp_policy=MixedPrecisionPolicy(param_dtype=mp))
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=mp))
    x = torch.randn(32, 128, device=device)
    rec = PlaneRecorder()
    mxdist.reset_all_gather_stats()
    try:
        with mxtrain.mx_autocast(recipe=recipe):
            y = model(x)
        after_forward = mxdist.all_gather_stats()["amax_reductions"]
        with torch.no_grad():
            model[1].weight.mul_(3.0)  # every rank edits its shard: all decide to recompute this unit's amax
        y.float().pow(2).mean().backward()
    finally:
        rec.close()
    spec, q, data, scale_inv, now = rec.planes["1.weight:0"]
    full = model[1].weight.full_tensor().to(mp)
    if spec.scaling == "delayed":  # a slot with no history yet casts at the scale of the weight's own amax
        now = spec.state.scale_for(spec.slot, spec.fmt, full.device, amax=full.abs().amax().float())
    kw = (dict(scale=now) if spec.scaling == "delayed" else
          dict(block=spec.block, power_of_2_scales=spec.power_of_2_scales, amax_epsilon=spec.amax_epsilon))
    ref = quantize_float8(full, spec.fmt, axes=0, **kw)
    p = ref.plane(0)
    same = (torch.equal(p.data.view(torch.uint8), data.view(torch.uint8)) and torch.equal(p.scale_inv, scale_inv)
            and (ref.amax is None) == (q.amax is None) and (ref.amax is None or torch.equal(ref.amax, q.amax)))
    # the forward's rowwise plane of the same weight: a reused (stale) scale would equal its scale
    fwd_scale_inv = rec.planes["1.weight:1"][3]
    stats = mxdist.all_gather_stats()
    return {"after_forward": after_forward, "amax_reductions": stats["amax_reductions"],
            "fp8_gathers": stats["fp8_gathers"], "resent": stats["resent"], "edited_plane_matches": same,
            "scale_changed": not torch.equal(fwd_scale_inv if spec.block is None else fwd_scale_inv.t(), scale_inv)}


def parity(rank, world, device, recipe, *, steps=4, micro=1, reshard_after_forward=True, mixed=False, ac=False,
           no_sync=False, prefetch=0, ref_recipe=None, fp8_shapes=False, b=B, sum_grads=False, vs_plain=False):
    """FSDP2 losses against one process (rank 0) on the whole batch; ``ref_recipe``: the one-process
    recipe where ``recipe`` holds a process group (FP8 amax reductions). ``vs_plain``: also train with
    FSDP2's own high-precision all-gathers (the modules cast the full weight) as ``plain``."""
    batches = global_batches(steps, micro, world, device, b=b)
    model = shard(build(0, device, mixed=mixed, checkpoint=ac, recipe=recipe, fp8_shapes=fp8_shapes), world,
                  reshard_after_forward=reshard_after_forward, ac=ac, prefetch=prefetch, recipe=recipe)
    rec = PlaneRecorder()
    try:
        dist_losses = train_steps(model, make_opt(model), batches, recipe, rank, world, True, no_sync=no_sync,
                                  sum_grads=sum_grads)
    finally:
        rec.close()
    plain = None
    if vs_plain:
        model = shard(build(0, device, mixed=mixed, checkpoint=ac, recipe=recipe, fp8_shapes=fp8_shapes), world,
                      mx=False, reshard_after_forward=reshard_after_forward, ac=ac, prefetch=prefetch)
        plain = train_steps(model, make_opt(model), batches, recipe, rank, world, True, no_sync=no_sync,
                            sum_grads=sum_grads)
    ref_losses = None
    if rank == 0:
        ref_recipe = ref_recipe or recipe
        ref = build(0, device, mixed=mixed, checkpoint=ac, recipe=ref_recipe, fp8_shapes=fp8_shapes)
        ref_losses = train_steps(ref, make_opt(ref), batches, ref_recipe, rank, world, False)
    return {"dist": dist_losses, "ref": ref_losses, "rel": rel(dist_losses, ref_losses) if rank == 0 else None,
            "hits": rec.hits, "misses": rec.misses, "plain": plain}


def scenario_core(rank, world, device, out):
    res = {"world": world, "device": str(device)}
    fp8 = mxtrain.MXFP8Recipe()
    t0 = time.time()
    res["planes"] = {
        "mxfp8": check_gathered_planes(rank, world, device, fp8, None),
        "mxfp8_bf16_params": check_gathered_planes(rank, world, device, fp8, torch.bfloat16),
        "mxfp4": check_gathered_planes(rank, world, device, mxtrain.MXFP4Recipe(), None),
        "mxfp6_floor_nearest": check_gathered_planes(
            rank, world, device, mxtrain.MXFP6Recipe(scale_mode="floor", rounding="nearest"), None),
        "mxfp8_no_reshard": check_gathered_planes(rank, world, device, fp8, None, reshard_after_forward=False),
    }
    # the planes dequantized straight from the gather buffer (the default on Hopper with bf16 params)
    with config.override(gather_values=True):
        res["planes"]["mxfp8_bf16_params_values"] = check_gathered_planes(rank, world, device, fp8, torch.bfloat16)
        res["planes"]["mxfp4_bf16_params_values"] = check_gathered_planes(
            rank, world, device, mxtrain.MXFP4Recipe(), torch.bfloat16)
        res["parity_values"] = parity(rank, world, device, fp8)
    res["bytes"] = {
        "mxfp8": count_all_gather_bytes(rank, world, device, fp8, True, torch.bfloat16),
        "mxfp4": count_all_gather_bytes(rank, world, device, mxtrain.MXFP4Recipe(), True, torch.bfloat16),
        "bf16": count_all_gather_bytes(rank, world, device, fp8, False, torch.bfloat16),
        "outside_autocast_bf16": count_all_gather_bytes(rank, world, device, None, True, torch.bfloat16),
    }
    res["parity"] = {
        "mxfp8": parity(rank, world, device, fp8),
        "high_precision": parity(rank, world, device, None),
        "mxfp8_no_reshard": parity(rank, world, device, fp8, reshard_after_forward=False),
        "mxfp8_grad_accum": parity(rank, world, device, fp8, micro=2, steps=3),
        "mxfp8_grad_accum_no_sync": parity(rank, world, device, fp8, micro=3, steps=2, no_sync=True),
        "mxfp8_act_ckpt": parity(rank, world, device, fp8, ac=True, steps=3),
        # FSDP2's explicit prefetching: the next block's gather is issued inside this block's hooks
        "mxfp8_prefetch": parity(rank, world, device, fp8, prefetch=1, steps=3),
        "mxfp8_prefetch_no_reshard": parity(rank, world, device, fp8, prefetch=1, steps=2, reshard_after_forward=False),
        "mxfp8_mixed": parity(rank, world, device, fp8, mixed=True, steps=3),
        # an FP8 recipe: the weights travel as FP8 codes (tests/distributed/test_fsdp_fp8.py checks them closely)
        "fp8_current": parity(rank, world, device, mxtrain.recipes.recipe_from_string("fp8_current"), steps=2),
    }
    res["mp_bf16_trains"] = mp_bf16_run(rank, world, device, fp8)
    res["seconds"] = time.time() - t0
    return res


def fp8_recipe_pairs():
    """FP8 recipes for FSDP2 (activation amaxes all-reduced over the ranks, as one process sees the whole
    batch) and the same recipes for one process."""
    import torch.distributed as dist

    g = dist.group.WORLD
    return {"current": (mxtrain.Float8CurrentScaling(amax_reduction_group=g), mxtrain.Float8CurrentScaling()),
            "delayed": (mxtrain.DelayedScaling(amax_reduction_group=g), mxtrain.DelayedScaling()),
            "block": (mxtrain.Float8BlockScaling(), mxtrain.Float8BlockScaling())}


def check_fp8_planes(rank, world, device, recipe, mp, reshard_after_forward=True, steps=2):
    """Every FP8 plane the GEMMs got equals casting the full weight in one process (codes, scale-inverse,
    amax); delayed scaling with the module's scale at that moment."""
    model = shard(build(1, device, mixed=True, fp8_shapes=True), world, reshard_after_forward=reshard_after_forward,
                  mp=mp, recipe=recipe)
    rec = PlaneRecorder()
    mxdist.reset_all_gather_stats()
    try:
        batches = global_batches(steps, 1, world, device, seed=5)
        train_steps(model, torch.optim.SGD(model.parameters(), lr=0.0), batches, recipe, rank, world, True)
    finally:
        rec.close()
    stats = mxdist.all_gather_stats()
    fulls = {name: p.full_tensor() for name, p in mx_weights(model)}
    bad = []
    for key, (spec, q, data, scale_inv, now) in rec.planes.items():
        name, axis = key.rsplit(":", 1)
        full = fulls[name].to(mp or fulls[name].dtype)
        kw = (dict(scale=now) if spec.scaling == "delayed" else
              dict(block=spec.block, power_of_2_scales=spec.power_of_2_scales, amax_epsilon=spec.amax_epsilon))
        ref = quantize_float8(full, spec.fmt, axes=int(axis), **kw)
        p = ref.plane(int(axis))
        ok = (ref.shape == q.shape and ref.dtype == q.dtype and ref.fmt == q.fmt and p.block == q.plane(int(axis)).block
              and torch.equal(p.data.view(torch.uint8), data.view(torch.uint8)) and torch.equal(p.scale_inv, scale_inv)
              and (ref.amax is None) == (q.amax is None) and (ref.amax is None or torch.equal(ref.amax, q.amax)))
        if not ok:
            bad.append(key)
    return {"checked": len(rec.planes), "bad": bad, "hits": rec.hits, "misses": rec.misses,
            "stats": stats}


def fp8_other_model_on_one_rank(rank, world, device, recipe):
    """Rank 0 also holds a second FSDP2 model with FP8 gathers that never runs. The step's one amax all-reduce
    covers the FSDP tree being gathered only, so both ranks reduce the same amaxes (over every live FSDP state
    the ranks would disagree on the size: a collective mismatch). One forward+backward of 3 Linears."""
    from torch.distributed.fsdp import fully_shard

    def model_of(seed):
        torch.manual_seed(seed)
        m = nn.Sequential(*(mxtrain.Linear(128, 128, bias=False) for _ in range(3))).to(device)
        mxdist.enable_mx_all_gather(m, recipe=recipe)
        for layer in m:
            fully_shard(layer)
        fully_shard(m)
        return m
    idle = model_of(1) if rank == 0 else None  # kept alive through the step
    model = model_of(0)
    mxdist.reset_all_gather_stats()
    x = torch.randn(32, 128, device=device)
    with mxtrain.mx_autocast(recipe=recipe):
        y = model(x)
    y.float().pow(2).mean().backward()
    stats = mxdist.all_gather_stats()
    del idle
    return {"amax_reductions": stats["amax_reductions"], "fp8_gathers": stats["fp8_gathers"],
            "grads": all(m.weight.grad is not None for m in model)}


def fp8_units_inside_a_checkpoint(rank, world, device, recipe, steps=2):
    """Each block's modules are FSDP units of their own inside the block's checkpointed region (the recompute in
    backward needs them gathered again): no kept codes after a step, the losses of FSDP2's own high-precision
    all-gathers, the gather and resend counts."""
    from torch.distributed.fsdp import fully_shard

    def sharded(mx: bool):
        model = build(0, device, checkpoint=True, recipe=recipe)
        if mx:
            mxdist.enable_mx_all_gather(model, activation_checkpointing=True, recipe=recipe)
        for blk in model.blocks:
            for unit in (blk.qkv, blk.proj, blk.mlp):
                fully_shard(unit)
            fully_shard(blk)
        fully_shard(model)
        return model

    batches = global_batches(steps, 1, world, device, b=8)
    model = sharded(True)
    mxdist.reset_all_gather_stats()
    losses = train_steps(model, make_opt(model), batches, recipe, rank, world, True, sum_grads=True)
    kept = sorted(name for name, p in model.named_parameters()
                  if getattr(p.to_local(), "_mx_sent", None) is not None)
    stats = mxdist.all_gather_stats()
    plain_model = sharded(False)
    plain = train_steps(plain_model, make_opt(plain_model), batches, recipe, rank, world, True, sum_grads=True)
    return {"dist": losses, "plain": plain, "kept_after_step": kept, "fp8_gathers": stats["fp8_gathers"],
            "resent": stats["resent"], "batched": stats["batched"]}


def scenario_fp8(rank, world, device, out):
    """FP8 recipes' all-gathers: planes against one process, bytes, training parity, DCP resume."""
    res = {"world": world, "device": str(device)}
    t0 = time.time()
    pairs = fp8_recipe_pairs()
    res["planes"], res["bytes"], res["parity"], res["ckpt"], res["edit"] = {}, {}, {}, {}, {}
    for name, (recipe, ref) in pairs.items():
        res["planes"][name] = check_fp8_planes(rank, world, device, recipe, None)
        res["planes"][name + "_bf16_params"] = check_fp8_planes(rank, world, device, recipe, torch.bfloat16)
        res["bytes"][name] = count_all_gather_bytes(rank, world, device, recipe, True, torch.bfloat16)
        res["bytes"][name + "_fp32_params"] = count_all_gather_bytes(rank, world, device, recipe, True, None)
        res["edit"][name] = fp8_edit_between_passes(rank, world, device, recipe)
        res.setdefault("one_rank_model", {})[name] = fp8_other_model_on_one_rank(rank, world, device, recipe)
        res.setdefault("units_in_checkpoint", {})[name] = fp8_units_inside_a_checkpoint(rank, world, device, recipe)
        # 128 tokens per rank: Float8BlockScaling's wgrad blocks (128 tokens) then never straddle ranks
        kw = dict(ref_recipe=ref, b=8, sum_grads=True, vs_plain=True)
        res["parity"][name] = parity(rank, world, device, recipe, steps=3, **kw)
        res["parity"][name + "_mixed"] = parity(rank, world, device, recipe, steps=2, mixed=True, fp8_shapes=True, **kw)
        res["parity"][name + "_no_reshard"] = parity(rank, world, device, recipe, steps=2, reshard_after_forward=False,
                                                     **kw)
        res["parity"][name + "_act_ckpt"] = parity(rank, world, device, recipe, steps=3, ac=True, **kw)
        res["parity"][name + "_grad_accum_no_sync"] = parity(rank, world, device, recipe, steps=2, micro=2,
                                                             no_sync=True, **kw)
        res["ckpt"][name] = scenario_ckpt(rank, world, device, out, recipe=recipe, tag=f"ckpt_{name}",
                                          fp8_shapes=True, b=8)
    res["planes"]["delayed_no_reshard"] = check_fp8_planes(rank, world, device, pairs["delayed"][0], None,
                                                           reshard_after_forward=False)
    res["parity"]["high_precision"] = parity(rank, world, device, None, steps=2, b=8)
    res["seconds"] = time.time() - t0
    return res


def _three_linears(device, recipe, mx: bool):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*(mxtrain.Linear(128, 128, bias=False) for _ in range(3))).to(device)
    if mx:
        mxdist.enable_mx_all_gather(model, recipe=recipe)
    for m in model:
        fully_shard(m)
    fully_shard(model)
    return model


def fp8_micro_batches(rank, world, device, recipe):
    """Two micro-batches accumulated without a gradient sync in between (weights resharded after each pass, as
    FSDP2 does unless told otherwise), then one synced: every forward gather sends batched codes, one amax
    all-reduce; the gradients equal those of high-precision gathers."""
    xs = [torch.randn(32, 128, device=device, generator=torch.Generator(device).manual_seed(rank * 10 + i))
          for i in range(2)]
    out = {}
    for mx in (True, False):
        model = _three_linears(device, recipe, mx)
        mxdist.reset_all_gather_stats()
        for i, x in enumerate(xs):
            model.set_requires_gradient_sync(i == len(xs) - 1)
            with mxtrain.mx_autocast(recipe=recipe):
                model(x).float().pow(2).mean().backward()
        out[mx] = ([p.grad.full_tensor() for p in model.parameters()], mxdist.all_gather_stats())
    (grads, s), (plain, _) = out[True], out[False]
    return {"same": all(torch.equal(a, b) for a, b in zip(grads, plain)),
            **{k: s[k] for k in ("fp8_gathers", "batched", "resent", "amax_reductions")}}


def fp8_eval_forwards(rank, world, device, recipe):
    """Two evaluation forwards (no_grad) of a sharded model of 3 mxtrain Linears: the second reuses the first's
    scales (no amax all-reduce) and sends batched codes; both give the outputs of high-precision gathers."""
    x = torch.randn(32, 128, device=device)
    out = {}
    for mx in (True, False):
        model = _three_linears(device, recipe, mx)
        mxdist.reset_all_gather_stats()
        ys = []
        with torch.no_grad(), mxtrain.mx_autocast(recipe=recipe):
            for _ in range(2):
                ys.append(model(x))
        out["mx" if mx else "plain"] = (ys, mxdist.all_gather_stats())
    (ys, s), (plain, _) = out["mx"], out["plain"]
    return {"same": all(torch.equal(a, b) for a, b in zip(ys, plain)), "fp8_gathers": s["fp8_gathers"],
            "batched": s["batched"], "amax_reductions": s["amax_reductions"]}


def scenario_fp8_batched(rank, world, device):
    """Float8CurrentScaling's all-gathers with the step's casts batched (run with MXTRAIN_FSDP_BATCHED_CASTS=1, the
    CUDA default, on any device): the planes, bytes, reuse after an edit, recompute and training of the per-weight
    casts' cases, plus how many gathers sent batched codes."""
    from mxtrain import config

    assert config.current().fsdp_batched_casts == "1", "run this scenario with MXTRAIN_FSDP_BATCHED_CASTS=1"
    recipe, ref = fp8_recipe_pairs()["current"]
    res = {"planes": {}, "parity": {}}
    res["planes"]["current"] = check_fp8_planes(rank, world, device, recipe, None)
    res["planes"]["current_bf16_params"] = check_fp8_planes(rank, world, device, recipe, torch.bfloat16)
    # a group's one-launch transposes that fail (a kernel that does not build): a warning, once, and every fill
    # transposes its own dgrad plane, the same planes
    import warnings

    from mxtrain.distributed import fsdp as mxfsdp

    def broken(srcs, outs, backend=None):
        raise RuntimeError("triton: no such kernel here\ndetails")

    saved = mxfsdp.transpose_bytes_many
    mxfsdp.transpose_bytes_many = broken
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            res["planes"]["current_transposes_fail"] = check_fp8_planes(rank, world, device, recipe, None)
    finally:
        mxfsdp.transpose_bytes_many = saved
        failed, mxfsdp._TRANSPOSES_FAILED[:] = list(mxfsdp._TRANSPOSES_FAILED), []
    res["planes"]["current_transposes_fail"]["warned"] = [str(w.message) for w in seen
                                                          if "could not be transposed in one launch" in str(w.message)]
    res["planes"]["current_transposes_fail"]["failed"] = failed
    res["bytes"] = count_all_gather_bytes(rank, world, device, recipe, True, torch.bfloat16)
    res["edit"] = fp8_edit_between_passes(rank, world, device, recipe)
    res["edit"]["batched"] = mxdist.all_gather_stats()["batched"]
    res["units_in_checkpoint"] = fp8_units_inside_a_checkpoint(rank, world, device, recipe)
    kw = dict(ref_recipe=ref, b=8, sum_grads=True, vs_plain=True)
    res["parity"][""] = parity(rank, world, device, recipe, steps=3, **kw)
    res["parity"]["_mixed"] = parity(rank, world, device, recipe, steps=2, mixed=True, fp8_shapes=True, **kw)
    res["parity"]["_act_ckpt"] = parity(rank, world, device, recipe, steps=3, ac=True, **kw)
    res["parity"]["_grad_accum_no_sync"] = parity(rank, world, device, recipe, steps=2, micro=2, no_sync=True, **kw)
    # gradient accumulation that reshards between micro-batches: the second micro-batch's forward gathers batch
    # anew at the step's scales
    res["grad_accum"] = fp8_micro_batches(rank, world, device, recipe)
    # an evaluation forward after training (scales of the last step's weights: a new amax all-reduce, batched)
    # and a second one without a step in between (the same scales: batched anew, no all-reduce)
    res["eval"] = fp8_eval_forwards(rank, world, device, recipe)
    # compiled blocks (traced gathers: forward gathers lay out both planes, backward gathers resend the codes)
    from torch._dynamo.utils import counters

    from compile_worker import grads

    eager = grads(recipe, False, device, rank, True, steps=3)
    torch._dynamo.reset()
    counters.clear()
    steps = []
    mxdist.reset_all_gather_stats()

    def after_step():
        steps.append(counters["stats"]["unique_graphs"])
        counters.clear()

    compiled = grads(recipe, True, device, rank, True, steps=3, after_step=after_step)
    stats = mxdist.all_gather_stats()
    res["compiled"] = {"differ": sorted(n for n, g in compiled.items() if not torch.equal(g, eager[n])),
                       "graphs": steps, "batched": stats["batched"], "transposes": stats["transposes"],
                       "batched_transposes": stats["batched_transposes"]}
    from mxtrain.kernels import registry

    # the batched casts' kernels (CUDA) kept their first launch's check: no fallback to the per-tensor reference
    res["shard_kernels_broken"] = {**registry.broken("float8_shard_amaxes"), **registry.broken("float8_shard_codes")}
    return res


def mp_bf16_run(rank, world, device, recipe):
    """bf16 params (MixedPrecisionPolicy) with MX all-gathers: trains, and matches the one-process model
    whose weights are cast to bf16 for compute within bf16-rounding noise."""
    batches = global_batches(3, 1, world, device)
    model = shard(build(0, device), world, mp=torch.bfloat16)
    losses = train_steps(model, make_opt(model), batches, recipe, rank, world, True)
    if rank != 0:
        return {"losses": losses}
    # one process: bf16 compute copy of fp32 master weights (what FSDP's policy does)
    master = build(0, device)
    compute = copy.deepcopy(master).to(torch.bfloat16)
    opt = make_opt(master)
    ref = []
    for mbs in batches:
        idx, tgt = mbs[0]
        with mxtrain.mx_autocast(recipe=recipe):
            loss = compute(idx, tgt)
        loss.backward()
        for pm, pc in zip(master.parameters(), compute.parameters()):
            pm.grad = pc.grad.float()
            pc.grad = None
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for pm, pc in zip(master.parameters(), compute.parameters()):
                pc.copy_(pm)
        ref.append(loss.item())
    return {"losses": losses, "ref": ref, "rel_first": rel(losses[:1], ref[:1]), "rel": rel(losses, ref)}


def state_dict_types(model):
    """Type names of the model's state-dict values (of the local shards for DTensors), recipe state
    (``_extra_state``: DelayedScaling's dict) left out."""
    from torch.distributed.tensor import DTensor

    types = set()
    for k, v in model.state_dict().items():
        if not k.endswith("_extra_state"):
            types.add(type(v._local_tensor if isinstance(v, DTensor) else v).__name__)
    return sorted(types)


def _recipe_states(model):
    """Per-module recipe states (DelayedScaling histories and scales) as comparable lists."""
    out = {}
    for name, m in model.named_modules():
        st = getattr(m, "recipe_state", None)
        if st is not None:
            out[name] = {k: (v.cpu().tolist() if isinstance(v, torch.Tensor) else v)
                         for k, v in st.state_dict().items()}
    return out


def scenario_ckpt(rank, world, device, out, recipe=None, tag="ckpt", fp8_shapes=False, b=B):
    import torch.distributed as dist

    recipe = recipe or mxtrain.MXFP8Recipe()
    steps, cut = 6, 3
    batches = global_batches(steps, 1, world, device, seed=3, b=b)
    # uninterrupted
    model = shard(build(0, device, mixed=True, fp8_shapes=fp8_shapes), world, recipe=recipe)
    opt = make_opt(model)
    full = train_steps(model, opt, batches, recipe, rank, world, True)
    # interrupted: train to `cut`, save, rebuild everything, load, continue
    model = shard(build(0, device, mixed=True, fp8_shapes=fp8_shapes), world, recipe=recipe)
    opt = make_opt(model)
    first = train_steps(model, opt, batches[:cut], recipe, rank, world, True)
    ckpt_dir = os.path.join(out, tag)
    path = save_checkpoint(ckpt_dir, cut, model, opt, extra={"losses": first})
    types = state_dict_types(model)
    full_weights = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).cpu()
                    for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    recipe_states = _recipe_states(model)
    if rank == 0 and tag == "ckpt":
        torch.save(full_weights, os.path.join(out, "weights_at_cut.pt"))
    del model, opt
    # other init: the load must overwrite it
    model = shard(build(123, device, mixed=True, fp8_shapes=fp8_shapes), world, recipe=recipe)
    opt = make_opt(model)
    latest = latest_checkpoint(ckpt_dir)
    extra = load_checkpoint(latest, model, opt)
    loaded = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).cpu() for k, v in model.state_dict().items()
              if isinstance(v, torch.Tensor)}
    same_weights = all(torch.equal(loaded[k], full_weights[k]) for k in full_weights)
    same_weights = same_weights and _recipe_states(model) == recipe_states
    resumed = train_steps(model, opt, batches, recipe, rank, world, True, start=cut)
    dist.barrier()
    return {"full": full, "first": first, "resumed": resumed, "extra_losses": extra.get("losses"),
            "step": extra.get("step"), "latest": latest, "path": path, "state_dict_types": types,
            "same_weights_after_load": same_weights, "recipe_states": len(recipe_states)}


def scenario_load1(out):
    """World size 1, no FSDP, no process group: load the 2-rank checkpoint and train on."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(1)
    recipe = mxtrain.MXFP8Recipe()
    with open(os.path.join(out, "ckpt.json")) as f:
        prev = json.load(f)
    ckpt_dir = os.path.join(out, "ckpt")
    model = build(7, device, mixed=True)
    mxdist.enable_mx_all_gather(model, strict=False)  # a world-size-1 model with the subclass loads too
    opt = make_opt(model)
    extra = load_checkpoint(latest_checkpoint(ckpt_dir), model, opt)
    saved = torch.load(os.path.join(out, "weights_at_cut.pt"))
    sd = model.state_dict()
    same = all(torch.equal(sd[k].cpu(), saved[k]) for k in saved)
    batches = global_batches(6, 1, prev["world"], device, seed=3)
    resumed = train_steps(model, opt, batches, recipe, 0, 1, False, start=extra["step"])
    return {"same_weights": same, "resumed": resumed, "two_rank_full": prev["full"],
            "rel": rel(resumed, prev["full"][extra["step"]:]), "step": extra["step"],
            "types": sorted({type(v).__name__ for v in sd.values()})}


def scenario_fault(rank, world, device, out, resume: bool, tag: str):
    """Checkpoint every 2 steps; rank 0 logs each step's loss as it goes (the run may die)."""
    recipe = mxtrain.MXFP8Recipe()
    steps = 8
    batches = global_batches(steps, 1, world, device, seed=9)
    model = shard(build(0, device), world)
    opt = make_opt(model)
    ckpt_dir = os.path.join(out, f"{tag}_ckpt")
    start = 0
    if resume:
        latest = latest_checkpoint(ckpt_dir)
        if latest is not None:
            start = load_checkpoint(latest, model, opt)["step"]
    fault_step = config.current().fault_step
    log = os.path.join(out, f"{tag}_losses.jsonl")
    for step in range(start, steps):
        if step == fault_step and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # a hard crash: no cleanup, no exception
        loss = train_steps(model, opt, batches[step:step + 1], recipe, rank, world, True)[0]
        if rank == 0:
            with open(log, "a") as f:
                f.write(json.dumps({"step": step, "loss": loss, "resumed_from": start}) + "\n")
        if fault_step >= 0:
            # rank 0's line of this step is written before rank 1 may crash at the next one (torchrun kills
            # rank 0 when rank 1 dies: on a loaded machine it sometimes came before the write)
            torch.distributed.barrier()
        if (step + 1) % 2 == 0:
            save_checkpoint(ckpt_dir, step + 1, model, opt)
    return {"start": start}


def main():
    scenario, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    if scenario == "load1":
        res = scenario_load1(out)
        with open(os.path.join(out, "load1.json"), "w") as f:
            json.dump(res, f)
        return
    import torch.distributed as dist

    rank, world, device = setup()
    try:
        if scenario == "core":
            res = scenario_core(rank, world, device, out)
        elif scenario == "fp8":
            res = scenario_fp8(rank, world, device, out)
        elif scenario == "fp8_batched":
            res = scenario_fp8_batched(rank, world, device)
        elif scenario == "compile":
            from compile_worker import scenario_compile

            res = scenario_compile(rank, device)
        elif scenario == "graph":
            from graph_worker import scenario_graph

            res = scenario_graph(rank, device)
        elif scenario == "graph_fail":
            from graph_worker import scenario_graph_fail

            res = scenario_graph_fail(rank, device, out)
        elif scenario == "graph_books":
            from graph_worker import scenario_graph_books

            res = scenario_graph_books(rank, device)
        elif scenario == "graph_agree":
            from graph_worker import scenario_graph_agree

            res = scenario_graph_agree(rank)
        elif scenario == "ckpt":
            res = scenario_ckpt(rank, world, device, out)
            res["world"] = world
        elif scenario in ("fault", "fault_resume"):
            res = scenario_fault(rank, world, device, out, resume=scenario == "fault_resume",
                                 tag=sys.argv[3] if len(sys.argv) > 3 else "fault")
        else:
            raise SystemExit(f"unknown scenario {scenario}")
        if rank == 0:
            with open(os.path.join(out, f"{scenario}.json"), "w") as f:
                json.dump(res, f, indent=1, default=str)
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
