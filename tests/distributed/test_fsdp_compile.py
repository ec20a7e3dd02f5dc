"""FSDP2 quantized all-gathers with compiled blocks. Dynamo takes the gathered-weight subclass (MXGatheredWeight)
for a Python object, not a tensor: passed to a module's autograd function as it is, it never entered the graph and
its gradient was dropped (every GEMM weight of a compiled block trained not at all, silently). Modules now hand the
function a traced stand-in whose gradient reaches FSDP's parameter, and trace whole where the gathered planes serve
both passes (reshard_after_forward=False); a weight gathered again before backward runs its module eagerly, with a
warning naming it. 2 ranks, gloo on CPU (NCCL when CUDA is there), 2 steps (the second gathers updated weights)."""

from __future__ import annotations

import json

import pytest
import torch

from test_fsdp_mx import torchrun

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")

GEMM_WEIGHTS = ["0.fc1_weight", "1.weight", "2.weight"]  # the first gathered weight of each module


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("compile")
    torchrun("compile", out, timeout=600)
    return json.loads((out / "compile.json").read_text())


@pytest.mark.parametrize("recipe", ["fp8_current", "mxfp8"])
@pytest.mark.parametrize("reshard", ["reshard", "keep"])
def test_compiled_blocks_get_every_gradient_eager_gives(compiled, recipe, reshard):
    r = compiled[f"{recipe}-{reshard}"]
    assert len(r["params"]) == 10  # LayerNormMLP 5 (norm weight, 2 weights, 2 biases), LayerNormLinear 3, Linear 2
    assert r["no_grad"] == [], f"parameters without a gradient under torch.compile: {r['no_grad']}"
    assert r["differ"] == [], f"gradients differing from eager: {r['differ']}"


@pytest.mark.parametrize("recipe", ["fp8_current", "mxfp8"])
def test_gathers_serving_both_passes_trace_whole(compiled, recipe):
    r = compiled[f"{recipe}-keep"]
    assert r["warned"] == [] and r["graph_breaks"] == 0
    assert r["graphs"] == 3  # one per block, none recompiled by the second step's gathers


@pytest.mark.parametrize("recipe", ["fp8_current", "mxfp8"])
def test_weights_gathered_again_for_backward_run_eagerly_and_say_so(compiled, recipe):
    r = compiled[f"{recipe}-reshard"]
    assert r["warned"] == GEMM_WEIGHTS
    assert r["graph_breaks"] >= 3
