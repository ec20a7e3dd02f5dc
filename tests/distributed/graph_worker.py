"""``fsdp_worker.py graph`` / ``graph_fail`` / ``graph_agree``: FSDP2 steps captured whole by ``mxtrain.make_graphed_step``.

``graph`` (2 CUDA GPUs, NCCL): per recipe, compiled or eager blocks, resharded after forward or kept, the same
model trained eagerly and with its step captured after two eager steps and a warm-up: the losses of the eager
steps and of the replays, and the final parameters (full tensors), which must be the same bits.
``graph_fail`` (CUDA): rank 1's step synchronises with the host under capture only; each rank writes what
``make_graphed_step`` raised to ``graph_fail_rank<r>.json`` (and leaves without tearing NCCL down).
``graph_agree`` (any device): the agreement after a capture, rank 1 reporting a failure."""

from __future__ import annotations

import json
import os

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import mxtrain
from mxtrain.distributed import enable_quantized_all_gather

WIDTH, FFN, TOKENS, STEPS = 128, 256, 64, 6
CAPTURE_AT = 2  # eager steps before the capture; step 2 is make_graphed_step's warm-up; 3.. are replays


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([
            mxtrain.LayerNormMLP(WIDTH, FFN, normalization="RMSNorm", activation="swiglu"),
            mxtrain.LayerNormLinear(WIDTH, WIDTH, normalization="RMSNorm"),
            mxtrain.Linear(WIDTH, WIDTH), mxtrain.Linear(WIDTH, WIDTH)])

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return x


def build(recipe, compiled: bool, keep: bool, device):
    torch.manual_seed(0)
    net = Net().to(device)
    if recipe is not None:
        enable_quantized_all_gather(net, recipe=recipe)
    if compiled:
        for i, blk in enumerate(list(net.blocks)):
            net.blocks[i] = torch.compile(blk)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for blk in net.blocks:
        fully_shard(blk, mp_policy=mp, reshard_after_forward=not keep)
    fully_shard(net, mp_policy=mp)
    return net


def evaluate(net, recipe, x):
    """An eager forward in eval mode without gradients (the groups that keep their weights stay unsharded)."""
    net.eval()
    with torch.no_grad(), mxtrain.mx_autocast(enabled=recipe is not None, recipe=recipe):
        y = net(x).float()
    net.train()
    return y


def train(name, compiled: bool, keep: bool, device, rank: int, graphed: bool, fail_rank: int | None = None,
          evals: tuple = ()):
    """(losses by step, None where the step is make_graphed_step's warm-up; final parameters; the outputs of an
    evaluation after each step in ``evals``)."""
    recipe = mxtrain.recipe_from_string(name) if name != "none" else None
    net = build(recipe, compiled, keep, device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, fused=True, capturable=True)
    g = torch.Generator(device=device).manual_seed(1 + rank)
    data = [torch.randn(TOKENS, WIDTH, device=device, generator=g) for _ in range(STEPS)]
    x = torch.empty_like(data[0])

    def step():
        with mxtrain.mx_autocast(enabled=recipe is not None, recipe=recipe):
            loss = net(x).float().square().mean()
        if fail_rank == rank and torch.cuda.is_current_stream_capturing():
            loss.item()  # a host sync: this rank's capture fails
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss

    losses, replay, outs = [], None, []
    for i in range(STEPS):
        x.copy_(data[i])
        if graphed and i == CAPTURE_AT:
            replay = mxtrain.make_graphed_step(step, warmup=1)  # runs step i once (the warm-up), then captures
            losses.append(None)
        else:
            losses.append((replay() if replay is not None else step()).item())
        if i in evals:
            outs.append(evaluate(net, recipe, data[0]).cpu())
    params = {n: p.full_tensor().float().cpu() for n, p in net.named_parameters()}
    return losses, params, outs


def scenario_graph(rank: int, device) -> dict:
    result = {}
    for name, compiled, keep in (("fp8_current", True, True), ("fp8_current", True, False), ("mxfp8", True, True),
                                 ("mxfp8", False, False), ("fp8_block", False, True), ("fp8_delayed", False, False),
                                 ("none", False, False)):
        # evaluations between replays (kept weights: FSDP2 leaves them gathered after an eager forward)
        evals = (3, 4) if keep else ()
        eager_losses, eager_params, eager_outs = train(name, compiled, keep, device, rank, graphed=False, evals=evals)
        losses, params, outs = train(name, compiled, keep, device, rank, graphed=True, evals=evals)
        result[f"{name}-{'compiled' if compiled else 'eager'}-{'keep' if keep else 'reshard'}"] = {
            "eager": eager_losses, "graphed": losses, "params": len(params),
            "differ": sorted(n for n, p in params.items() if not torch.equal(p, eager_params[n])),
            "evals": len(outs), "evals_differ": [i for i, (a, b) in enumerate(zip(outs, eager_outs))
                                                 if not torch.equal(a, b)],
        }
    return result


def scenario_graph_books(rank: int, device) -> dict:
    """ReplayBookkeeping without a GPU: a replay is emulated by writing the shards in place and putting their
    version counters back (what a CUDA graph's optimizer does, seen from the host). An evaluation before and
    after it, with kept weights (FSDP2 leaves them gathered) and FP8 all-gathers (mxtrain reuses a weight's
    codes while its version is unchanged), against a fresh model holding the same shards."""
    from torch.distributed.fsdp import FSDPModule

    from mxtrain.distributed.fsdp import ReplayBookkeeping, _leaves, _param_groups

    recipe = mxtrain.recipe_from_string("fp8_current")
    torch.manual_seed(1 + rank)
    x = torch.randn(TOKENS, WIDTH, device=device)
    result = {}
    for mode in ("full", "reshard_only", "none"):
        net = build(recipe, False, True, device)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        for i in range(3):  # the last one stands for the capture: the optimizer moves the versions in it
            books = ReplayBookkeeping() if i == 2 else None
            with mxtrain.mx_autocast(recipe=recipe):
                net(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        books.captured()
        before = evaluate(net, recipe, x)
        if mode != "none":
            books.before_replay()
        shards = [fp.sharded_param for m in net.modules() if isinstance(m, FSDPModule)
                  for g in _param_groups(m._get_fsdp_state()) for fp in g.fsdp_params]
        leaves = [leaf for p in shards for leaf in _leaves(p)]
        versions = [leaf._version for leaf in leaves]
        with torch.no_grad():
            for p in shards:
                p.mul_(0.75)
        torch._C._autograd._unsafe_set_version_counter(leaves, versions)
        if mode == "full":
            books.after_replay()
        after = evaluate(net, recipe, x)
        fresh = build(recipe, False, True, device)
        for m in net.modules():  # (the evaluation left the kept groups gathered)
            if isinstance(m, FSDPModule):
                m.reshard()
        with torch.no_grad():
            for q, p in zip(fresh.parameters(), net.parameters()):
                q.copy_(p)
        reference = evaluate(fresh, recipe, x)
        result[mode] = {"written": len(books.written), "leaves": len(leaves),
                        "moved": not torch.equal(before, after), "equal": torch.equal(after, reference)}
    return result


def scenario_graph_fail(rank: int, device, out: str) -> None:
    try:
        train("fp8_current", False, True, device, rank, graphed=True, fail_rank=1)
        res = {"raised": None}
    except RuntimeError as e:
        res = {"raised": str(e)}
    with open(os.path.join(out, f"graph_fail_rank{rank}.json"), "w") as f:
        json.dump(res, f)
    os._exit(0)  # the failed rank's capture may leave NCCL unusable: no teardown


def scenario_graph_agree(rank: int) -> dict:
    from mxtrain.graphs import _capture_agreement

    agree = _capture_agreement(None)
    agree(True)  # both captured: nothing raised
    try:
        agree(rank != 1)
        raised = None
    except RuntimeError as e:
        raised = str(e)
    import torch.distributed as dist

    seen = [None, None]
    dist.all_gather_object(seen, raised)
    return {"raised": seen, "cached": _capture_agreement(None) is not None}
