"""The Fashion-MNIST format study (examples/fashion_mnist_study.py): configuration names, cost model, search order,
and the command on a tiny subset."""

import csv
import json

import pytest

from mxtrain import cli

fm = cli.load_example("examples/fashion_mnist_study.py")  # as ``mxtrain study`` loads it


def test_parse_config_and_bits():
    c = fm.parse_config("fp8_e4m3+bfloat16")
    assert (c.w_format, c.a_format, c.elemwise) == ("fp8_e4m3", "fp8_e4m3", "bfloat16")
    assert c.bits == {"weight": 8.25, "activation": 8.25, "elementwise": 16.0, "total": 32.5}
    c = fm.parse_config("int4/FP6_E2M3+fp10")
    assert (c.name, c.w_format, c.a_format, c.elemwise) == ("int4/fp6_e2m3+fp10", "int4", "fp6_e2m3", "fp10")
    assert fm.parse_config("fp32+fp32").specs() is None
    s = fm.parse_config("int2+fp8").specs()
    assert s["fp"] == 8 and s["w_elem_format_bp"] == "int2" and s["block_size"] == 32 and s["round"] == "nearest"
    assert fm.parse_config("bfloat16+bfloat16").specs()["bfloat"] == 16
    for bad in ("fp8_e4m3", "int3+bfloat16", "int8+fp5", "int8+bfloat8"):
        with pytest.raises(ValueError):
            fm.parse_config(bad)


def test_search_order_and_pruning():
    cands = fm.search_candidates()
    totals = [c.bits["total"] for c in cands]
    assert totals == sorted(totals) and cands[0].name == "int2+fp8"
    failed = [fm.parse_config("int4+fp10")]
    assert fm._dominated(fm.parse_config("fp4_e2m1/int2+fp8"), failed) is not None
    assert fm._dominated(fm.parse_config("int8/int2+fp8"), failed) is None


def test_study_command_writes_its_files(tmp_path):
    pytest.importorskip("tqdm")
    from mxtrain.data import load_fashion_mnist
    try:
        load_fashion_mnist("test")
    except FileNotFoundError:
        pytest.skip("Fashion-MNIST is not installed (bash scripts/install_data.sh)")
    from mxtrain import cli
    args = ["study", "fashion-mnist", "--subset", "128", "--epochs", "1", "--configs", "fp32+fp32,int8+bfloat16",
            "--quiet", "--threads", "1"]
    assert cli.main(args + ["--out", str(tmp_path / "a")]) == 0
    out = tmp_path / "a"
    rows = list(csv.DictReader(open(out / "runs.csv")))
    assert [r["config"] for r in rows] == ["fp32+fp32", "int8+bfloat16"]
    data = json.loads((out / "runs.json").read_text())
    assert data["runs"][1]["specs"]["w_elem_format"] == "int8" and data["search"] is None
    assert "| Matmul format | int8 |" in (out / "tables.md").read_text()
    pytest.importorskip("matplotlib")
    assert (out / "study.png").stat().st_size > 1000
    # fixed seeds: a rerun gives the same numbers
    assert fm.main(args[2:] + ["--out", str(tmp_path / "b")]) == 0
    assert list(csv.DictReader(open(tmp_path / "b" / "runs.csv")))[1]["test_accuracy"] == rows[1]["test_accuracy"]


def test_merge_and_prior(tmp_path):
    from mxtrain.data import load_fashion_mnist
    try:
        load_fashion_mnist("test")
    except FileNotFoundError:
        pytest.skip("Fashion-MNIST is not installed (bash scripts/install_data.sh)")
    a = fm.run_study(["fp32+fp32"], epochs=1, subset=64, out=tmp_path / "a", progress=False, log=lambda *_: None)
    fm.run_study(["int8+fp10"], epochs=1, subset=64, out=tmp_path / "b", progress=False, log=lambda *_: None)
    fm.merge_studies([tmp_path / "a", tmp_path / "b"], tmp_path / "m")
    assert [r["config"] for r in csv.DictReader(open(tmp_path / "m" / "runs.csv"))] == ["fp32+fp32", "int8+fp10"]
    again = fm.run_study(["fp32+fp32"], epochs=1, subset=64, out=tmp_path / "c", prior=[tmp_path / "a"],
                         progress=False, log=lambda *_: None)
    assert again["results"]["fp32+fp32"].seconds == a["results"]["fp32+fp32"].seconds  # reused, not retrained
