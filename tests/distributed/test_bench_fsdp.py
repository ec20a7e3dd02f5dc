"""benchmarks/bench_fsdp.py under torchrun (2 gloo ranks on CPU; NCCL when CUDA is there), at a tiny size:
the table it prints and the JSON it writes (bytes per weight element, modes run twice, bad modes)."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

REPO = pathlib.Path(__file__).parents[2]
BENCH = REPO / "benchmarks" / "bench_fsdp.py"
TINY = ["--layers", "2", "--hidden", "256", "--ffn", "1024", "--batch", "2", "--seq", "64", "--steps", "2",
        "--warmup", "1"]

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")


def test_repeated_modes_table_and_json(tmp_path, torchrun2):
    out_json, out_md = tmp_path / "r.json", tmp_path / "r.md"
    proc = torchrun2(BENCH, *TINY, "--modes", "mxfp8+mxag,bf16,mxfp8+mxag", "--json", out_json, "--markdown", out_md)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    res = json.loads(out_json.read_text())["results"]
    assert [r["mode"] for r in res] == ["mxfp8+mxag", "bf16", "mxfp8+mxag"]
    mx1, bf, mx2 = res
    # the budget: at most 1.04 bytes per weight element for MX all-gathers (bf16 sends 2)
    assert mx1["bytes_per_param_element"] <= 1.04 and mx2["bytes_per_param_element"] <= 1.04
    assert bf["bytes_per_param_element"] == pytest.approx(2.0)
    assert mx1["mx_weight_bytes_per_element"] <= 1.04 and bf["mx_weight_bytes_per_element"] is None
    # each mode starts from the same seed and data: a repeated mode trains to the same loss
    assert mx1["loss"] == mx2["loss"]
    assert bf["loss"] != mx1["loss"]  # and the MX mode really quantizes
    rows = [line.split("|")[1:-1] for line in out_md.read_text().splitlines() if line.startswith(("| mx", "| bf16"))]
    assert [r[0].strip() for r in rows] == ["mxfp8+mxag", "bf16", "mxfp8+mxag"]
    vs = [float(r[2]) for r in rows]
    # a row before any bf16 run is against the first bf16 run; the others against the last bf16 run before them
    assert vs[0] == pytest.approx(mx1["step_ms"] / bf["step_ms"], abs=0.006)
    assert vs[1] == 1.0
    assert vs[2] == pytest.approx(mx2["step_ms"] / bf["step_ms"], abs=0.006)


def test_unknown_mode_is_refused_before_any_run(torchrun2):
    proc = torchrun2(BENCH, *TINY, "--modes", "bf16,mxfp4+mxag", timeout=120)
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert "unknown mode(s) 'mxfp4+mxag'" in text and "mxfp8+bf16ag" in text
    assert "| bf16 |" not in text  # nothing ran
