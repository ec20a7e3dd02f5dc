"""benchmarks/bench_moe.py at its --small size on the CPU: every row runs and the table is printed."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

BENCH = pathlib.Path(__file__).parents[1] / "benchmarks" / "bench_moe.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_moe", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_route_counts_every_choice_and_is_imbalanced():
    bench = _load()
    counts = bench.route(8192, 8, 2, skew=0.3)
    assert sum(counts) == 2 * 8192 and len(counts) == 8
    assert max(counts) > 1.3 * min(counts)  # a skewed router, not a uniform one


def test_small_run_prints_every_mode(capsys):
    bench = _load()
    rows = bench.main(["--small", "--device", "cpu", "--recipes", "mxfp8,fp8_current"])
    modes = [r["mode"] for r in rows]
    for label in ("GroupedLinear bf16", "bf16 loop", "GroupedLinear mxfp8", "GroupedLinear mxfp8 aligned32",
                  "Linear loop mxfp8", "GroupedLinear fp8_current", "Linear loop fp8_current"):
        assert label in modes
    assert all(r["ms"] > 0 and r["vs_bf16"] > 0 for r in rows)
    out = capsys.readouterr().out
    assert "rows per expert" in out and "vs bf16" in out


def test_unknown_recipe_is_refused():
    bench = _load()
    with pytest.raises(SystemExit):
        bench.main(["--small", "--device", "cpu", "--recipes", "mxfp9"])


def test_aligned_pads_each_expert_with_zero_rows():
    bench = _load()
    x = torch.arange(1.0, 8.0).reshape(7, 1)
    xa, _, counts = bench.aligned(x, x, [3, 0, 4], 4)
    assert counts == [4, 0, 4]
    assert xa.flatten().tolist() == [1, 2, 3, 0, 4, 5, 6, 7]


def test_profile_prints_each_mode(capsys):
    bench = _load()
    bench.main(["--small", "--device", "cpu", "--recipes", "mxfp8", "--no-loop", "--profile", "--top", "2"])
    out = capsys.readouterr().out
    assert "## GroupedLinear mxfp8: top 2 CPU ops" in out and "## GroupedLinear mxfp8 aligned32" in out


def test_steps_start_without_gradients_and_both_activations_run():
    """Each timed step writes fresh gradients (none carried from the last step), and the torch SwiGLU gives what
    the fused one gives."""
    bench = _load()
    torch.manual_seed(0)
    model = bench.GroupedExperts(2, 8, 16)
    x, dy = torch.randn(6, 8), torch.randn(6, 8)
    step = bench._step_fn(model, x, dy, [2, 4], None)
    step()
    first = [p.grad.clone() for p in model.parameters()]
    step()
    assert all(torch.equal(a, p.grad) for a, p in zip(first, model.parameters()))
    h = torch.randn(5, 12)
    assert torch.equal(bench.fused_swiglu(h), bench.torch_swiglu(h))
    rows = bench.main(["--small", "--device", "cpu", "--recipes", "fp8_current", "--no-loop", "--act", "torch"])
    assert all(r["issue_ms"] > 0 for r in rows)


def test_grouped_cast_benchmark_runs_small(capsys):
    import os
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the grouped cast's Triton kernel needs TRITON_INTERPRET=1 on the CPU")
    spec = importlib.util.spec_from_file_location("bench_grouped_cast", BENCH.parent / "bench_grouped_cast.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = module.main(["--small", "--device", "cpu", "--align", "16"])
    assert [r["tensor"] for r in rows] == ["x", "a", "dh", "w1", "w2"]
    assert all(r["per_expert_ms"] > 0 and r["grouped_ms"] > 0 for r in rows)
    with pytest.raises(SystemExit):
        module.main(["--small", "--device", "cpu", "--align", "8"])


def test_host_profile_prints_each_mode(capsys, tmp_path):
    bench = _load()
    bench.main(["--small", "--device", "cpu", "--recipes", "fp8_current", "--no-loop", "--host-profile",
                "--host-profile-out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "## host profile: GroupedLinear fp8_current (5 steps under cProfile)" in out
    assert "ms/step own" in out and "ms/step inclusive" in out and "grouped_linear.py" in out
    kept = {p.name for p in tmp_path.iterdir()}  # (and bf16_grouped_mm.prof where torch has grouped_mm)
    assert {"GroupedLinear_bf16.prof", "GroupedLinear_fp8_current.prof",
            "GroupedLinear_fp8_current_aligned32.prof"} <= kept
