"""FSDP2 quantized all-gathers with compiled blocks. Dynamo takes the gathered-weight subclass (MXGatheredWeight)
for a Python object, not a tensor: passed to a module's autograd function as it is, it never entered the graph and
its gradient was dropped (every GEMM weight of a compiled block trained not at all, silently). Modules now hand the
function a traced stand-in whose gradient reaches FSDP's parameter, and a traced weight's gathers all lay out
both planes in one place, so that the backward's gather refills the buffers the traced forward saved. 2 ranks, gloo
on CPU (NCCL when CUDA is there), 3 steps (later steps gather updated weights), gradients compared with eager's bit
for bit."""

from __future__ import annotations

import json

import pytest
import torch

from test_fsdp_mx import torchrun

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")

CONFIGS = ["reshard", "keep", "reshard-inner"]  # reshard_after_forward True / False; inner: module compiled in a block
GEMM_WEIGHTS = ["0.fc1_weight", "1.weight", "2.weight", "3.weight"]  # the first gathered weight of each module


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("compile")
    torchrun("compile", out, timeout=600)
    return json.loads((out / "compile.json").read_text())


@pytest.mark.parametrize("recipe", ["fp8_current", "mxfp8", "fp8_delayed"])
@pytest.mark.parametrize("config", CONFIGS)
def test_compiled_blocks_get_every_gradient_eager_gives(compiled, recipe, config):
    r = compiled[f"{recipe}-{config}"]
    assert len(r["params"]) == 12  # LayerNormMLP 5 (norm weight, 2 weights, 2 biases), LayerNormLinear 3, Linear 2 x 2
    assert r["no_grad"] == [], f"parameters without a gradient under torch.compile: {r['no_grad']}"
    assert r["differ"] == [], f"gradients differing from eager: {r['differ']}"


@pytest.mark.parametrize("recipe", ["fp8_current", "mxfp8"])
@pytest.mark.parametrize("config", ["reshard", "keep"])
def test_blocks_compiled_before_fully_shard_trace_whole(compiled, recipe, config):
    r = compiled[f"{recipe}-{config}"]
    assert r["warned"] == []
    assert r["graph_breaks"] == [0, 0, 0]
    # one per kind of block: the two alike Linears share theirs (each gathered weight's own sharded parameter
    # once made dynamo guard on it, and every decoder layer of a model recompiled, past dynamo's limit); later
    # steps' gathers (into the same buffers) recompile nothing
    # (every graph dynamo compiled: the FP8 gathers' batched casts on CUDA are kernel launches, not compiled helpers)
    assert r["graphs"] == [3, 0, 0]


@pytest.mark.parametrize("recipe", ["fp8_current", "mxfp8"])
def test_modules_compiled_inside_a_block_run_eagerly_one_step_and_say_so(compiled, recipe):
    # FSDP2 cannot tell that these weights will be traced before their first forward gather (rowwise only); the
    # second step recompiles the frames resumed after those breaks (dynamic shapes: their graph breaks are not
    # about gathered weights), the third runs without a break
    r = compiled[f"{recipe}-reshard-inner"]
    assert r["warned"] == GEMM_WEIGHTS
    assert r["graph_breaks"][0] >= 3 and r["graph_breaks"][2] == 0


@pytest.mark.parametrize("config", CONFIGS)
def test_delayed_scaling_modules_in_compiled_blocks_run_eagerly_and_say_so(compiled, config):
    # DelayedScaling's gathered codes carry amax records and a staleness check: its modules' GEMM paths run
    # eagerly (a warning per weight) inside the compiled blocks, whose first forward failed before (the
    # compiled step's view of the state did not match the gathered codes' spec) and whose backward gather
    # cast at another scale than the forward's (a compiled update marks the state's slots seasoned while
    # traced); the gradients above are eager's bit for bit
    r = compiled[f"fp8_delayed-{config}"]
    assert r["warned"] == GEMM_WEIGHTS
    assert r["graph_breaks"][0] >= 4


@pytest.mark.parametrize("recipe", ["fp8_current", "mxfp8"])
def test_checkpointed_compiled_blocks_get_eagers_gradients(compiled, recipe):
    # mxtrain.checkpoint inside blocks compiled before fully_shard (gathers for the recompute send both planes)
    r = compiled[f"{recipe}-checkpoint"]
    assert len(r["params"]) == 12 and r["differ"] == []


def test_checkpointed_compiled_blocks_without_reshard_transpose_in_the_graph(compiled):
    # FP8 current scaling, no reshard after forward: the gathers leave the dgrad plane out (no gather transposes), the
    # recompute reads the rowwise codes, the compiled backward transposes them: eager's gradients
    r = compiled["fp8_current-checkpoint-keep"]
    assert len(r["params"]) == 12
    assert r["differ"] == [] and r["transposes"] == 0


def test_delayed_scaling_under_mxtrain_checkpoint_with_fp8_gathers_says_what_to_use(compiled):
    # the recompute casts at its forward's scales; the backward gather's codes carry the updated ones
    assert "torch.utils.checkpoint.checkpoint(..., use_reentrant=False)" in compiled["fp8_delayed-checkpoint"]["error"]


@pytest.mark.parametrize("recipe", ["fp8_delayed", "mxfp8"])
def test_compiled_blocks_resume_from_a_checkpoint_bit_identically(compiled, recipe):
    # traced quantized gathers and DelayedScaling's state through mxtrain.distributed.save / load_checkpoint
    r = compiled[f"{recipe}-resume"]
    assert r["resumed"] == r["straight"]


WEIGHTS, STEPS = 5, 3  # gathered weights (LayerNormMLP 2, LayerNormLinear 1, Linear 2), steps of each run


@pytest.mark.parametrize("recipe", ["fp8_current", "fp8_delayed", "mxfp8"])
@pytest.mark.parametrize("config", CONFIGS)
def test_backward_gathers_send_the_forward_gathers_bytes_without_casting_again(compiled, recipe, config):
    # A weight resharded after forward is gathered again before backward, unchanged. FP8 codes are the same
    # bytes for either pass: that gather sends the forward's again (no cast), eager or compiled. MX planes are
    # cast again (they differ by pass; a traced weight's gathers send both, 2 bytes per element to keep). No
    # reshard after forward: one gather a step, nothing kept
    r = compiled[f"{recipe}-{config}"]
    per_step = 2 if config != "keep" else 1
    for run in ("gathers", "eager_gathers"):
        assert r[run]["gathers"] == WEIGHTS * per_step * STEPS
    if config == "keep":
        assert r["gathers"]["resent"] == r["eager_gathers"]["resent"] == 0
    elif recipe.startswith("fp8"):
        assert r["gathers"]["resent"] == r["eager_gathers"]["resent"] == WEIGHTS * STEPS
    else:
        assert r["gathers"]["resent"] == r["eager_gathers"]["resent"] == 0


@pytest.mark.parametrize("recipe", ["fp8_current", "fp8_delayed"])
@pytest.mark.parametrize("config", CONFIGS)
def test_fp8_dgrad_planes_are_transposed_once_a_step(compiled, recipe, config):
    # eager: each weight's dgrad plane is transposed once a step, by the fill of the gather that serves backward (a
    # traced forward gather followed by a backward gather leaves it to that gather). Traced, current scaling: the
    # compiled graph transposes the gathered codes itself, so no gather does (the gradients are eager's: the tests
    # above); a module compiled inside a block runs its first step eagerly, whose backward transposes each weight.
    # DelayedScaling runs its GEMM paths eagerly: its fills transpose
    r = compiled[f"{recipe}-{config}"]
    assert r["eager_gathers"]["transposes"] == WEIGHTS * STEPS
    if recipe == "fp8_delayed":
        assert r["transposes"] == [WEIGHTS] * STEPS
    elif config == "reshard-inner":
        assert r["transposes"][0] == WEIGHTS and sum(r["transposes"]) <= WEIGHTS * STEPS
    else:
        assert r["transposes"] == [0] * STEPS


@pytest.mark.parametrize("config", ["reshard", "reshard-inner"])
def test_traced_mx_forward_gathers_send_the_rowwise_plane_once_laid_out(compiled, config):
    # a traced MX weight's planes live in fixed places: a gather of both lays them out (the first traced one); a
    # later forward gather that a backward gather follows sends the rowwise plane only, written in its place (the
    # compiled forward only saves the columnwise one); backward gathers send both (a recompute inside a compiled
    # backward may read the rowwise plane). Before, every gather of a traced weight sent both planes
    r = compiled[f"mxfp8-{config}"]
    eager = r["eager_gathers"]
    assert eager["planes"] == {"rowwise": WEIGHTS * STEPS, "columnwise": WEIGHTS * STEPS}
    if config == "reshard":  # traced from the first gather
        want = {"both": WEIGHTS * (STEPS + 1), "rowwise": WEIGHTS * (STEPS - 1)}
    else:  # the first forward runs eagerly (rowwise); its backward gather lays out both
        want = {"rowwise": WEIGHTS * STEPS, "both": WEIGHTS * STEPS}
    assert r["gathers"]["planes"] == want
    assert eager["bytes"] < r["gathers"]["bytes"] < 2 * eager["bytes"]


def test_traced_mx_gathers_without_reshard_send_both_planes(compiled):
    # no reshard after forward: the forward gather serves backward too, so it carries both planes
    r = compiled["mxfp8-keep"]
    assert r["gathers"]["planes"] == {"both": WEIGHTS * STEPS}
