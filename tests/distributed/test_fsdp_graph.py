"""FSDP2 steps captured whole in a CUDA graph (``mxtrain.make_graphed_step``): the replays train as the eager
steps do, bit for bit, with mxtrain's quantized all-gathers (FP8 and MX, compiled or eager blocks, resharded after
forward or kept) and without; a rank that cannot capture makes every rank raise instead of hanging in a replay.
The capture needs 2 CUDA GPUs (NCCL); the agreement between the ranks runs anywhere (gloo)."""

from __future__ import annotations

import json

import pytest
import torch

import mxtrain
from mxtrain.graphs import _capture_agreement
from test_fsdp_mx import torchrun

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL)")

CONFIGS = ["fp8_current-compiled-keep", "fp8_current-compiled-reshard", "mxfp8-compiled-keep", "mxfp8-eager-reshard",
           "fp8_block-eager-keep", "fp8_delayed-eager-reshard", "none-eager-reshard"]


@pytest.fixture(scope="module")
def graphed(tmp_path_factory):
    out = tmp_path_factory.mktemp("graph")
    torchrun("graph", out, timeout=900)
    return json.loads((out / "graph.json").read_text())


@two_gpus
@pytest.mark.gpu
@pytest.mark.parametrize("config", CONFIGS)
def test_replayed_fsdp_steps_train_as_eager_steps(graphed, config):
    r = graphed[config]
    assert r["params"] == 12  # LayerNormMLP 5 (norm weight, 2 weights, 2 biases), LayerNormLinear 3, Linear 2 x 2
    eager, replayed = r["eager"], r["graphed"]
    assert replayed[2] is None  # make_graphed_step's warm-up
    assert [v for i, v in enumerate(eager) if i != 2] == [v for v in replayed if v is not None]
    assert len(set(eager)) == len(eager), "the losses did not move: nothing trained"
    assert r["differ"] == [], f"parameters after the replays differing from eager: {r['differ']}"
    # evaluations between replays (kept weights) see what the eager run's see
    assert r["evals"] == (2 if config.endswith("-keep") else 0) and r["evals_differ"] == []


@two_gpus
@pytest.mark.gpu
def test_a_rank_that_cannot_capture_makes_every_rank_raise(tmp_path):
    torchrun("graph_fail", tmp_path, timeout=300)
    ranks = [json.loads((tmp_path / f"graph_fail_rank{r}.json").read_text())["raised"] for r in (0, 1)]
    assert "could not be captured" in ranks[1]
    assert "rank(s) [1] could not capture the step" in ranks[0]


def test_ranks_agree_on_a_failed_capture(tmp_path):
    torchrun("graph_agree", tmp_path, timeout=120)
    r = json.loads((tmp_path / "graph_agree.json").read_text())
    assert r["raised"][1] is None  # the failed rank raises its own error, not the agreement's
    assert "rank(s) [1] could not capture the step" in r["raised"][0]
    assert r["cached"]


def test_agreement_outside_torch_distributed():
    assert _capture_agreement(None) is None  # one process: nothing to agree on
    with pytest.raises(ValueError, match="torch.distributed is not initialized"):
        _capture_agreement(object())


def test_make_graphed_step_needs_cuda_before_any_group():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only error")
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        mxtrain.make_graphed_step(lambda: None, group=object())


def test_replays_keep_fsdp_and_mxtrain_host_state_true(tmp_path):
    # an evaluation between replays: FSDP2 keeps the gathered weights of kept groups, mxtrain reuses a weight's
    # FP8 codes while its version is unchanged; both must see the replays' writes (emulated here: the shards
    # written in place, their versions put back, as a graph's optimizer leaves them)
    torchrun("graph_books", tmp_path, timeout=240)
    r = json.loads((tmp_path / "graph_books.json").read_text())
    full = r["full"]
    # the tensors the optimizer's in-place updates counted: each parameter's local shard at least (and an FP8
    # weight's data inside it); the DTensors themselves on torch versions that count them too
    assert 12 <= full["written"] <= full["leaves"]
    assert full["moved"] and full["equal"], "an evaluation after a replay did not see the replay's weights"
    # each half alone leaves it stale: the kept gathered weights, or the cached FP8 codes
    assert not r["none"]["equal"] and not r["reshard_only"]["equal"]
