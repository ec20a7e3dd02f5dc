"""benchmarks/bench_e2e.py --fsdp under torchrun (2 gloo ranks on CPU; NCCL when CUDA is there), tiny model:
every side trains, quantized all-gathers send fewer bytes than bf16 ones, and bad sides are refused early."""

from __future__ import annotations

import json
import re
import os
import pathlib
import subprocess
import sys

import pytest
import torch

REPO = pathlib.Path(__file__).parents[2]
BENCH = REPO / "benchmarks" / "bench_e2e.py"
TINY = ["--fsdp", "--model", "tiny", "--rounds", "1", "--steps", "2", "--warmup", "1"]

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")


def test_fsdp_sides_train_and_quantized_gathers_send_less(tmp_path, torchrun2):
    out = tmp_path / "r.json"
    prof = tmp_path / "prof"
    proc = torchrun2(BENCH, *TINY, "--sides", "hf,mx:none,mx:mxfp8,mx:fp8_current,mx:fp8_current+bf16ag",
                     "--json", out, "--host-profile", "mx:fp8_current", "--host-profile-out", prof,
                     "--host-trace", "hf", "--host-trace-out", prof, "--host-phases", "hf,mx:fp8_current", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    data = json.loads(out.read_text())
    assert data["world"] == 2
    res = {r["side"]: r for r in data["results"]}
    assert set(res) == {"hf", "mx:none", "mx:mxfp8", "mx:fp8_current", "mx:fp8_current+bf16ag"}
    for r in res.values():
        assert "error" not in r, r
        assert r["tokens_per_s"] > 0 and r["allgather_mib"] > 0 and 0 < r["loss"] < 10
    # bf16 gathers: the HF model and the mxtrain model without a recipe send the same bytes
    assert res["mx:none"]["allgather_mib"] == pytest.approx(res["hf"]["allgather_mib"])
    assert res["mx:fp8_current+bf16ag"]["allgather_mib"] == pytest.approx(res["hf"]["allgather_mib"])
    # quantized gathers: FP8 / MX bytes of the layers' GEMM weights, bf16 for norms and embeddings
    for side in ("mx:mxfp8", "mx:fp8_current"):
        assert res[side]["allgather_mib"] < 0.8 * res["hf"]["allgather_mib"], (side, res[side], res["hf"])
    # the same model and data: the mxtrain model without a recipe trains as Hugging Face's does
    assert res["mx:none"]["loss"] == pytest.approx(res["hf"]["loss"], rel=1e-3)
    assert "vs hf" in proc.stdout and "AG MiB" in proc.stdout
    assert "loss@6" in proc.stdout  # 1 warm-up + 3 issue-timing + 2 timed steps
    # --host-profile: rank 0 profiles 3 more steps of the side while rank 1 runs them (the same collectives)
    assert "## host profile: mx:fp8_current rank 0 of 2 (3 steps under cProfile)" in proc.stdout
    # --host-trace: the same under torch.profiler, host time by region (FSDP2's annotations among them)
    assert "## hf rank 0 of 2 (3 steps under torch.profiler)" in proc.stdout
    assert "FSDP::all_gather" in proc.stdout and "by kind: " in proc.stdout
    assert sorted(p.name for p in prof.iterdir()) == ["hf_rank_0_of_2.json.gz", "mx_fp8_current_rank_0_of_2.prof"]
    # --host-phases: 10 unprofiled steps, every rank's host time by phase; mxtrain's hooks for the FP8 side only
    out_fp8 = proc.stdout.split("## host phases: mx:fp8_current (10 steps, no profiler, every rank)")[1]
    out_hf = proc.stdout.split("## host phases: hf (10 steps, no profiler, every rank)")[1].split("## ")[0]
    for text in (out_fp8, out_hf):
        assert "rank 0" in text and "rank 1" in text
        for row in ("forward", "backward", "after backward", "wall", "FSDP2 all-gathers"):
            assert re.search(rf"^\s*{re.escape(row)}\b.*?(\s+[0-9]+\.[0-9]){{2}}$", text, re.M), (row, text)
    assert "mxtrain pre-all-gather hooks [" in out_fp8 and "mxtrain pre-all-gather hooks" not in out_hf


def test_graph_side_under_fsdp(tmp_path, torchrun2):
    """+graph captures the whole FSDP2 step on every rank (CUDA); without CUDA it is refused before any side runs."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        proc = torchrun2(BENCH, *TINY, "--sides", "hf,mx:mxfp8+graph", timeout=120)
        assert proc.returncode != 0
        assert "side 'mx:mxfp8+graph': +graph needs CUDA (make_graphed_step captures GPU work)" in proc.stderr
        assert "round 0" not in proc.stdout  # nothing ran
        return
    out = tmp_path / "r.json"
    proc = torchrun2(BENCH, *TINY[:-1], "2", "--sides", "mx:fp8_current+keep,mx:fp8_current+keep+graph",
                     "--json", out, timeout=300)  # 2 warm-up steps: one eager, one in make_graphed_step
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    res = {r["side"]: r for r in json.loads(out.read_text())["results"]}
    # the same steps, replayed: the same loss after them; the replays' gathers are not timed, their bytes are
    # the last eager warm-up step's
    graphed, eager = res["mx:fp8_current+keep+graph"], res["mx:fp8_current+keep"]
    assert graphed["loss"] == eager["loss"]
    assert "allgather_ms" not in graphed and graphed["allgather_mib"] == eager["allgather_mib"]


def test_fsdp_outside_torchrun_is_refused():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("RANK", None)
    proc = subprocess.run([sys.executable, str(BENCH), *TINY], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "torchrun" in proc.stderr


def test_fsdp_on_austen_text(tmp_path, torchrun2):
    """--data austen: every step its own batch of Austen byte tokens; the mxtrain model without a recipe trains
    as Hugging Face's does on it."""
    try:
        from mxtrain.data.austen import austen_package_dir
        austen_package_dir()
    except FileNotFoundError as e:
        pytest.skip(f"the Austen corpus is not installed: {str(e).splitlines()[0]}")
    out = tmp_path / "r.json"
    proc = torchrun2(BENCH, *TINY, "--data", "austen", "--sides", "hf,mx:none,mx:fp8_current,mx:fp8_current+keep",
                     "--json", out, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    data = json.loads(out.read_text())
    assert data["args"]["data"] == "austen"
    res = {r["side"]: r for r in data["results"]}
    assert res["mx:none"]["loss"] == pytest.approx(res["hf"]["loss"], rel=1e-3)
    assert 0 < res["hf"]["loss"] < 10
    # +keep: the layers keep their gathered FP8 weights for backward (one gather a layer a step, not two); the
    # same codes reach the same GEMMs, so the same training
    assert res["mx:fp8_current+keep"]["loss"] == res["mx:fp8_current"]["loss"]
    assert res["mx:fp8_current+keep"]["allgather_mib"] < 0.75 * res["mx:fp8_current"]["allgather_mib"]
