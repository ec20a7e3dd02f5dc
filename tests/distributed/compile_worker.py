"""``fsdp_worker.py compile``: FSDP2 with quantized all-gathers and compiled blocks (``torch.compile`` of each
block, as torchtitan does): every weight must get the gradient the eager run gives. Per recipe and
``reshard_after_forward``, the names of the parameters without a gradient and of those differing from eager, the
eager-fallback warnings and dynamo's graph breaks (test_fsdp_compile.py reads them)."""

from __future__ import annotations

import re

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import mxtrain
import mxtrain.distributed as mxdist
from mxtrain.distributed import enable_quantized_all_gather

WIDTH, FFN, TOKENS = 64, 128, 16


class Checkpointed(nn.Module):
    """A block whose forward is recomputed in backward (``mxtrain.checkpoint``)."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return mxtrain.checkpoint(self.block, x)


def build(recipe, compiled: bool, device, reshard: bool = True, inner: bool = False, ckpt: bool = False):
    """Four blocks, each ``fully_shard``-ed (the last two alike: compiled apart, they share one graph, as a model's
    decoder layers do). Compiled: each block is compiled before ``fully_shard`` (as torchtitan
    does), or with ``inner`` the mxtrain module inside a block FSDP2 manages (an ``nn.Sequential`` of it)."""
    torch.manual_seed(0)
    blocks = nn.ModuleList([mxtrain.LayerNormMLP(WIDTH, FFN, normalization="RMSNorm"),
                            mxtrain.LayerNormLinear(WIDTH, WIDTH, normalization="RMSNorm"),
                            mxtrain.Linear(WIDTH, WIDTH), mxtrain.Linear(WIDTH, WIDTH)]).to(device)
    enable_quantized_all_gather(blocks, recipe=recipe, activation_checkpointing=ckpt)
    for i, blk in enumerate(list(blocks)):
        if ckpt:
            blk = Checkpointed(blk)
        if compiled:
            blk = torch.compile(blk, backend="aot_eager")
        blocks[i] = nn.Sequential(blk) if inner else blk
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for blk in blocks:
        fully_shard(blk, mp_policy=mp, reshard_after_forward=reshard)
    return blocks


def grads(recipe, compiled: bool, device, rank: int, reshard: bool = True, steps: int = 1, inner: bool = False,
          after_step=None, ckpt: bool = False) -> dict:
    blocks = build(recipe, compiled, device, reshard, inner, ckpt)
    torch.manual_seed(1 + rank)
    x0 = torch.randn(TOKENS, WIDTH, device=device)
    for step in range(steps):  # later steps: gathers of updated weights into the buffers the graphs saw
        if step:
            with torch.no_grad():
                for p in blocks.parameters():
                    p -= 0.5 * p.grad
                    p.grad = None
        x = x0
        with mxtrain.mx_autocast(recipe=recipe):
            for blk in blocks:
                x = blk(x)
        x.float().square().mean().backward()
        if after_step is not None:
            after_step()
    return {re.sub(r"^(\d+)\.0\.", r"\1.", name.replace("_orig_mod.", "").replace(".block.", ".")):
            None if p.grad is None else p.grad.full_tensor().clone() for name, p in blocks.named_parameters()}


def scenario_compile(rank: int, device) -> dict:
    import warnings

    from torch._dynamo.utils import counters

    import mxtrain.modules._common as common

    result, eager, eager_stats = {}, {}, {}
    warnings.simplefilter("always")
    for name, reshard, inner in (("fp8_current", True, False), ("mxfp8", True, False), ("fp8_current", False, False),
                                 ("mxfp8", False, False), ("fp8_current", True, True), ("mxfp8", True, True),
                                 ("fp8_delayed", True, False), ("fp8_delayed", False, False),
                                 ("fp8_delayed", True, True)):
        recipe = mxtrain.recipe_from_string(name)
        if (name, reshard) not in eager:
            mxdist.reset_all_gather_stats()
            eager[name, reshard] = grads(recipe, False, device, rank, reshard, steps=3)
            eager_stats[name, reshard] = _gather_counts()
        torch._dynamo.reset()
        counters.clear()
        common._WARNED_EAGER_GATHERED.clear()
        steps = []

        def after_step():
            # every graph dynamo compiled in the step: the blocks' (the FP8 gathers' batched casts are kernel
            # launches, not compiled functions)
            steps.append((sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"],
                          mxdist.all_gather_stats()["transposes"] - sum(t for *_, t in steps)))
            counters.clear()

        mxdist.reset_all_gather_stats()
        with warnings.catch_warnings(record=True) as seen:
            compiled = grads(recipe, True, device, rank, reshard, steps=3, inner=inner, after_step=after_step)
        gathered = _gather_counts()
        ref = eager[name, reshard]
        result[f"{name}-{'reshard' if reshard else 'keep'}{'-inner' if inner else ''}"] = {
            "params": sorted(ref),
            "warned": sorted({str(w.message).split("one graph break: ")[1].split(" ")[0] for w in seen
                              if "runs its GEMM path eagerly" in str(w.message)}),
            "graph_breaks": [b for b, _, _ in steps],  # per step
            "graphs": [g for _, g, _ in steps],  # graphs compiled, per step
            "transposes": [t for _, _, t in steps],  # FP8 dgrad planes transposed outside the graphs, per step
            "no_grad": sorted(n for n, g in compiled.items() if g is None or not g.abs().max() > 0),
            "differ": sorted(n for n, g in compiled.items()
                             if g is not None and ref.get(n) is not None and not torch.equal(g, ref[n])),
            "gathers": gathered, "eager_gathers": eager_stats[name, reshard],
        }
    # DCP resume of compiled blocks (traced gathers; DelayedScaling's state): the resumed run's losses
    for name in ("fp8_delayed", "mxfp8"):
        result[f"{name}-resume"] = _resume(mxtrain.recipe_from_string(name), device, rank)
    # blocks checkpointed with mxtrain.checkpoint and compiled: the compiled backward recomputes them
    for name in ("fp8_current", "mxfp8", "fp8_delayed"):
        recipe = mxtrain.recipe_from_string(name)
        try:
            ref = grads(recipe, False, device, rank, steps=2, ckpt=True)
            torch._dynamo.reset()
            got = grads(recipe, True, device, rank, steps=2, ckpt=True)
        except NotImplementedError as e:
            result[f"{name}-checkpoint"] = {"error": str(e)}
            continue
        result[f"{name}-checkpoint"] = {
            "params": sorted(ref),
            "differ": sorted(n for n, g in got.items() if g is None or not torch.equal(g, ref[n])),
        }
    # the same without a reshard after forward: the recompute reads the gathered rowwise codes, and the compiled
    # backward transposes them for the dgrad plane, which FP8 current scaling's gathers leave out
    recipe = mxtrain.recipe_from_string("fp8_current")
    ref = grads(recipe, False, device, rank, reshard=False, steps=2, ckpt=True)
    torch._dynamo.reset()
    mxdist.reset_all_gather_stats()
    got = grads(recipe, True, device, rank, reshard=False, steps=2, ckpt=True)
    result["fp8_current-checkpoint-keep"] = {
        "params": sorted(ref), "transposes": mxdist.all_gather_stats()["transposes"],
        "differ": sorted(n for n, g in got.items() if g is None or not torch.equal(g, ref[n])),
    }
    return result


def _gather_counts() -> dict:
    """Of the all-gathers since the last reset: how many, how many sent the forward gather's bytes again, how
    many FP8 dgrad planes were transposed from gathered codes."""
    s = mxdist.all_gather_stats()
    return {"gathers": s["gathers"], "resent": s["resent"], "transposes": s["transposes"], "planes": s["planes"],
            "bytes": s["bytes_sent"]}


def _resume(recipe, device, rank: int) -> dict:
    """Train compiled blocks 2 steps, save a DCP checkpoint, train 3 more; then build them again, load it and
    train the same 3 steps: the losses of both runs (they must be the same bits)."""
    import shutil
    import tempfile

    from mxtrain.distributed.checkpoint import save_checkpoint, load_checkpoint

    def run(blocks, opt, steps, x0):
        losses = []
        for _ in range(steps):
            x = x0
            with mxtrain.mx_autocast(recipe=recipe):
                for blk in blocks:
                    x = blk(x)
            loss = x.float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return losses

    torch.manual_seed(1 + rank)
    x0 = torch.randn(TOKENS, WIDTH, device=device)
    obj = [tempfile.mkdtemp(prefix="mxtrain_resume_") if rank == 0 else None]
    torch.distributed.broadcast_object_list(obj, src=0)
    torch._dynamo.reset()
    blocks = build(recipe, True, device)
    opt = torch.optim.AdamW(blocks.parameters(), lr=1e-2)
    run(blocks, opt, 2, x0)
    path = save_checkpoint(obj[0], 2, blocks, opt, recipe=recipe)
    straight = run(blocks, opt, 3, x0)
    torch._dynamo.reset()
    blocks = build(recipe, True, device)
    opt = torch.optim.AdamW(blocks.parameters(), lr=1e-2)
    load_checkpoint(path, blocks, opt, recipe=recipe)
    resumed = run(blocks, opt, 3, x0)
    torch.distributed.barrier()
    if rank == 0:
        shutil.rmtree(obj[0], ignore_errors=True)
    return {"straight": straight, "resumed": resumed}
