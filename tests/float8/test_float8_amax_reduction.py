"""Amax reduction across ranks: two gloo processes on the CPU.

Current scaling with ``amax_reduction_group`` casts every rank's shard with the
scale of the global amax; DelayedScaling all-reduces the recorded amaxes before
they enter the histories, so every rank holds the same histories and scales.
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mxtrain.quantization.float8 import quantize_float8
from mxtrain.recipes import DelayedScaling

pytestmark = pytest.mark.slow  # spawns two processes (a few seconds)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        group = dist.group.WORLD
        g = torch.Generator().manual_seed(10 + rank)
        shard = torch.randn(16, 32, generator=g) * (1 + 5 * rank)  # rank 1 holds the larger values
        q = quantize_float8(shard, "fp8_e4m3", axes=(1, 0), amax_reduction_group=group)
        recipe = DelayedScaling(amax_history_len=3, amax_reduction_group=group)
        state = recipe.make_state()
        for step in range(4):
            state.update(recipe)
            state.scale_for("x", "fp8_e4m3", torch.device("cpu"))
            state.record("x", torch.tensor(float((step + 1) * (rank + 1))))
        state.update(recipe)
        torch.save({"scale_inv": q.scale_inv, "amax": q.amax, "data": q.plane(1).data.view(torch.uint8),
                    "shard": shard, "history": state.amax_history, "scale": state.scale},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_ranks_share_one_scale(tmp_path):
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    full = torch.cat([r0["shard"], r1["shard"]])
    whole = quantize_float8(full, "fp8_e4m3")  # one tensor, one scale
    for r in (r0, r1):
        assert torch.equal(r["amax"], whole.amax) and torch.equal(r["scale_inv"], whole.scale_inv)
    assert torch.equal(torch.cat([r0["data"], r1["data"]]), whole.plane().data.view(torch.uint8))
    # delayed: rank r records (step + 1) * (r + 1); the reduced history is rank 1's, on both ranks
    assert torch.equal(r0["history"], r1["history"]) and torch.equal(r0["scale"], r1["scale"])
    assert r0["history"][:, 0].tolist() == [8.0, 6.0, 4.0]
    assert r0["scale"].item() == torch.tensor(448.0).div(torch.tensor(8.0)).item()
