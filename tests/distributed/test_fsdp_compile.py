"""FSDP2 quantized all-gathers with compiled blocks: traced, the gathered-weight subclass lost its gradient
(every GEMM weight of a compiled block trained not at all, silently); the modules now run their autograd
function eagerly there. 2 ranks, gloo on CPU (NCCL when CUDA is there)."""

from __future__ import annotations

import json

import pytest
import torch

from test_fsdp_mx import torchrun

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("compile")
    torchrun("compile", out, timeout=600)
    return json.loads((out / "compile.json").read_text())


@pytest.mark.parametrize("recipe", ["fp8_current", "mxfp8"])
def test_compiled_blocks_get_every_gradient_eager_gives(compiled, recipe):
    r = compiled[recipe]
    assert len(r["params"]) == 10  # LayerNormMLP 5 (norm weight, 2 weights, 2 biases), LayerNormLinear 3, Linear 2
    assert r["no_grad"] == [], f"parameters without a gradient under torch.compile: {r['no_grad']}"
    assert r["differ"] == [], f"gradients differing from eager: {r['differ']}"
    assert r["warned"] == (1 if recipe == "fp8_current" else 0)  # once a process, naming the graph break
