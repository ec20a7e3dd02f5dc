"""bench_e2e.py's side names: modes after '+' are checked before any side runs (no GPU needed)."""

import pathlib
import sys

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_e2e  # noqa: E402


def test_unfused_mode_needs_an_mx_compile_side():
    assert bench_e2e.parse_side("mx:fp8_current+compile+graph+unfused") == (
        "mx", "fp8_current", frozenset({"compile", "graph", "unfused"}))
    for side in ("hf+unfused", "mx:mxfp8+unfused", "mx:mxfp8+graph+unfused", "ao-tensorwise+unfused"):
        with pytest.raises(ValueError, match=r"\+unfused applies to mx:<recipe>\+compile"):
            bench_e2e.parse_side(side)
    with pytest.raises(ValueError, match="modes after"):
        bench_e2e.parse_side("mx:mxfp8+compile+compile")


def test_torchloss_mode_is_for_mx_sides():
    assert bench_e2e.parse_side("mx:fp8_current+compile+torchloss")[2] == frozenset({"compile", "torchloss"})
    for side in ("hf+torchloss", "ao-tensorwise+torchloss"):
        with pytest.raises(ValueError, match=r"\+torchloss applies to mx:<recipe> sides"):
            bench_e2e.parse_side(side)


def test_unbatched_mode_is_for_mx_sides():
    assert bench_e2e.parse_side("mx:fp8_current+compile+unbatched")[2] == {"compile", "unbatched"}
    for side in ("hf+unbatched", "ao-tensorwise+unbatched"):
        with pytest.raises(ValueError, match=r"\+unbatched applies to mx:<recipe> sides"):
            bench_e2e.parse_side(side)


def test_keep_mode_parses_for_every_kind_and_is_refused_without_fsdp():
    for side in ("hf+keep", "mx:fp8_current+compile+keep"):
        assert "keep" in bench_e2e.parse_side(side)[2]
    assert bench_e2e.parse_side("ao-tensorwise+keep")[2] == {"compile", "keep"}
    with pytest.raises(ValueError, match=r"\+keep \(reshard_after_forward=False\) applies under --fsdp only"):
        bench_e2e.build("hf+keep", None, torch.device("cpu"), 0)


def test_profiled_sides_must_be_run(tmp_path):
    """--host-profile / --host-trace / --host-phases naming a side --sides does not run: a clear error, not a
    silently missing table."""
    import subprocess

    bench = pathlib.Path(bench_e2e.__file__)
    proc = subprocess.run([sys.executable, str(bench), "--model", "tiny", "--sides", "hf", "--host-phases", "mx:none"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--host-phases names sides that --sides does not run: mx:none (--sides: hf)" in proc.stderr


def _row(side, rnd, ms, **more):
    return {"side": side, "round": rnd, "ms": ms, "tokens_per_s": 8192 / ms * 1e3, "issue_ms": ms * 0.8,
            "peak_gib": 10.0, "loss": 2.5, **more}


def test_summary_shows_each_sides_step_time_over_the_rounds_and_the_baselines_noise():
    results = [_row("hf", 0, 140.0), _row("mx:fp8", 0, 170.0), _row("mx:fp8", 1, 160.0), _row("hf", 1, 160.0),
               {"side": "ao", "round": 0, "error": "RuntimeError: boom"}]
    lines = bench_e2e.summary_lines(results, ["hf", "mx:fp8", "ao"], fsdp=False)
    head, hf, fp8, ao, note = lines
    assert "ms (rounds)" in head and "vs hf" in head and "AG MiB" not in head
    assert hf.split()[:4] == ["hf", "58514", "140.0-160.0", "1.00-1.00x"]
    # best tokens/s is round 1's; against hf of the same round: 140/170 = 0.82, 160/160 = 1.00
    assert fp8.split()[:4] == ["mx:fp8", "51200", "160.0-170.0", "0.82-1.00x"]
    assert "median" in head and fp8.split()[4] == "0.91x" and hf.split()[4] == "1.00x"  # (0.82 + 1.00) / 2
    assert head.split()[-3:] == ["loss", "vs", "hf"] and hf.split()[-1] == "+0.00%"
    assert ao.split() == ["ao", "failed"]
    assert note == ("note: the hf baseline moved by 14% between rounds (the machine's noise): compare sides within "
                    "a round, or run more rounds")


def test_summary_has_no_noise_note_for_a_steady_baseline_and_shows_gathers_under_fsdp():
    results = [_row("hf", 0, 150.0, allgather_mib=1918.6, allgather_ms=23.5),
               _row("hf", 1, 153.0, allgather_mib=1918.6, allgather_ms=30.0)]
    lines = bench_e2e.summary_lines(results, ["hf"], fsdp=True)
    assert len(lines) == 2 and "AG MiB" in lines[0]
    assert lines[1].split()[-2:] == ["1918.6", "23.5"]  # the best round's (150 ms)


def test_summary_names_the_loss_step_and_each_sides_loss_against_hfs_of_the_same_round():
    results = [_row("hf", 0, 140.0, loss=2.50), _row("mx:a", 0, 130.0, loss=2.55), _row("mx:b", 0, 150.0, loss=2.45),
               _row("hf", 1, 150.0, loss=2.40), _row("mx:a", 1, 140.0, loss=2.40), _row("mx:b", 1, 160.0, loss=2.40),
               _row("mx:c", 0, 150.0, loss=float("nan"))]
    head, hf, a, b, c, _ = bench_e2e.summary_lines(results, ["hf", "mx:a", "mx:b", "mx:c"], fsdp=False, loss_step=50)
    assert "loss@50" in head.split()
    # round 0: +2.00% / -2.00%, round 1: +0.00% / +0.00%; the mean over the rounds
    assert (hf.split()[-1], a.split()[-1], b.split()[-1]) == ("+0.00%", "+1.00%", "-1.00%")
    assert c.split()[-2:] == ["nan", "+nan%"]  # a diverged side shows as such, not as a number


def test_summary_keeps_long_side_names_apart_and_shows_no_gathers_for_graphed_fsdp_sides():
    # a replayed FSDP2 step runs its gathers from the graph, where the all-gather timer sees none: "-", not 0
    side = "mx:fp8_current+compile+keep+graph"
    results = [_row("hf", 0, 150.0, allgather_mib=1918.6, allgather_ms=23.5), _row(side, 0, 6.0),
               _row("mx:fp8_current+graph", 0, 7.5, allgather_mib=990.6)]
    head, hf, graphed, counted = bench_e2e.summary_lines(results, ["hf", side, "mx:fp8_current+graph"], fsdp=True)
    assert graphed.split()[:5] == [side, "1365333", "6.0-6.0", "25.00-25.00x", "25.00x"]
    assert graphed.split()[-2:] == ["-", "-"] and hf.split()[-2:] == ["1918.6", "23.5"]
    assert counted.split()[-2:] == ["990.6", "-"]  # bytes counted in an eager step, no time
    assert head.index("tok/s") > len(side)
