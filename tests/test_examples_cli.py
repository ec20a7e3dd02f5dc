"""The ``mxtrain`` command and the example scripts as a user meets them: help, version, argument checks,
the run directory and the files a tiny run writes.

Tiny runs use random data and models a few dozen wide: seconds each on a CPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

import mxtrain
from mxtrain import cli

ROOT = Path(__file__).resolve().parents[1]


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def train_lm():
    return _load_script("train_lm")


@pytest.fixture(scope="module")
def finetune():
    return _load_script("finetune_llm")


def _shim(*args: str, code: str | None = None):
    """Run the ``mxtrain`` console entry (``mxtrain_cli``) in a fresh interpreter."""
    cmd = [sys.executable, "-c", code] if code else [sys.executable, str(ROOT / "mxtrain_cli.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


# ------------------------------------------------------------------------------------------- mxtrain CLI

def test_cli_help_does_not_import_torch():
    code = ("import sys, mxtrain_cli\n"
            "for argv in (['--help'], ['study', 'fashion-mnist', '--help']):\n"
            "    try:\n"
            "        mxtrain_cli.main(argv)\n"
            "    except SystemExit as e:\n"
            "        print('EXIT', e.code)\n"
            "print('TORCH', 'torch' in sys.modules)\n")
    proc = _shim(code=code)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.count("EXIT 0") == 2 and "TORCH False" in out
    assert "usage: mxtrain" in out and "--version" in out
    # the study's help: how long the default takes, the quick preset, defaults shown
    assert "10 hours" in out and "--quick" in out and "(default: 64)" in out and "(default: 90.0)" in out


def test_bare_command_prints_help_and_fails():
    proc = _shim()
    assert proc.returncode == 2 and "usage: mxtrain" in proc.stderr and "name a command" in proc.stderr
    proc = _shim("study")
    assert proc.returncode == 2 and "fashion-mnist" in proc.stderr and "name a study" in proc.stderr


def test_version():
    proc = _shim("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"mxtrain {mxtrain.__version__}"
    assert cli.version() == mxtrain.__version__


@pytest.mark.parametrize("argv, message", [
    (["--subset", "0"], "argument --subset: 0 is not allowed; allowed: a whole number [1, 60000]"),
    (["--epochs", "0"], "argument --epochs: 0 is not allowed; allowed: a whole number >= 1"),
    (["--epochs", "-2"], "argument --epochs: -2 is not allowed"),
    (["--batch-size", "0"], "argument --batch-size: 0 is not allowed"),
    (["--batch-size", "8.5"], "argument --batch-size: '8.5' is not a whole number"),
    (["--jobs", "0"], "argument --jobs: 0 is not allowed"),
    (["--target", "0"], "argument --target: 0 is not allowed; allowed: a number (0, 100]"),
    (["--target", "nan"], "argument --target: nan is not allowed"),
    (["--search-epochs", "0"], "argument --search-epochs: 0 is not allowed"),
    (["--device", "tpu"], "argument --device: invalid choice"),
])
def test_study_argument_checks(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["study", "fashion-mnist", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_study_quick_preset_and_explicit_options():
    parser = cli.build_parser()
    quick = cli.resolve_study_args(parser.parse_args(["study", "fashion-mnist", "--quick"]))
    assert (quick.epochs, quick.subset, quick.search) == (2, 2000, False)
    assert quick.configs == cli.STUDY_QUICK["configs"]
    mine = cli.resolve_study_args(parser.parse_args(["study", "fashion-mnist", "--quick", "--epochs", "1",
                                                     "--configs", "fp32+fp32"]))
    assert (mine.epochs, mine.subset, mine.configs) == (1, 2000, "fp32+fp32")
    full = cli.resolve_study_args(parser.parse_args(["study", "fashion-mnist"]))
    assert (full.epochs, full.subset, full.configs, full.search) == (10, None, None, None)


def test_study_refuses_empty_configs_and_bad_api_values(tmp_path, capsys):
    assert cli.main(["study", "fashion-mnist", "--configs", ",", "--out", str(tmp_path)]) == 2
    assert "--configs names no configuration" in capsys.readouterr().err
    fm = cli.load_example("examples/fashion_mnist_study.py")
    for kwargs in ({"subset": 0}, {"epochs": 0}, {"batch_size": 0}):
        with pytest.raises(ValueError, match="whole number >= 1"):
            fm.run_study(["fp32+fp32"], out=tmp_path, **kwargs)


def test_study_is_loaded_from_the_checkout_not_the_package(tmp_path):
    """The study lives in examples/ (no mxtrain.examples); without a checkout beside the package the error says so."""
    fm = cli.load_example("examples/fashion_mnist_study.py")
    assert Path(fm.__file__) == ROOT / "examples" / "fashion_mnist_study.py"
    assert importlib.util.find_spec("mxtrain.examples") is None
    with pytest.raises(SystemExit, match="examples/no_such_study.py is not beside this mxtrain package"):
        cli.load_example("examples/no_such_study.py")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "fashion_mnist_study.py"), "--epochs", "0"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2 and "usage: python examples/fashion_mnist_study.py" in proc.stderr
    assert "argument --epochs: 0 is not allowed" in proc.stderr


def test_study_lists_only_files_written(tmp_path, monkeypatch):
    """Without matplotlib no study.png is written, and none is claimed."""
    fm = cli.load_example("examples/fashion_mnist_study.py")
    meta = {"device": "cpu", "torch": "x", "train_images": 1, "test_images": 1, "seed": 0}
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: import raises ImportError
    assert fm._write(tmp_path, {}, 1, None, meta) == ["runs.csv", "runs.json", "tables.md"]
    assert not (tmp_path / "study.png").exists()


def test_argument_types_and_recipe_splitting(tmp_path):
    assert cli.positive_int("3") == 3
    with pytest.raises(argparse.ArgumentTypeError, match="allowed: a whole number >= 1"):
        cli.positive_int("0")
    with pytest.raises(argparse.ArgumentTypeError, match="allowed: a number > 0"):
        cli.positive_float("-1e-3")
    assert cli.split_recipe_specs(["bf16,mxfp8"]) == ["bf16", "mxfp8"]
    assert cli.split_recipe_specs(["bf16,mxfp4:grad_rounding=stochastic,seed=0,mxint8"]) == [
        "bf16", "mxfp4:grad_rounding=stochastic,seed=0", "mxint8"]
    assert cli.split_recipe_specs(["mx:fprop_input=int4,block_size=16", "bf16"]) == [
        "mx:fprop_input=int4,block_size=16", "bf16"]
    assert cli.clamp_warmup(20, 5, log=lambda *_: None) == 5 and cli.clamp_warmup(0, 5) == 1
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SystemExit, match="--ckpt-dir .*not a writable folder"):
        cli.check_writable_dir(str(blocker / "sub"), "--ckpt-dir")
    run = cli.new_run_dir(None, str(tmp_path / "runs"))
    assert Path(run).is_dir() and cli.new_run_dir(None, str(tmp_path / "runs")) != run


# ----------------------------------------------------------------------------------------------- examples

def _help_checks(parser):
    text = parser.format_help()
    for action in parser._actions:  # every flag explains itself
        assert action.help, f"{action.option_strings} has no help text"
    return text


def test_examples_help_shows_defaults_and_shared_flags(train_lm, finetune):
    t = _help_checks(train_lm.build_parser())
    f = _help_checks(finetune.build_parser())
    assert "(default: 200)" in t and "(default: 0.002)" in t and "(default: 16)" in t
    assert "(default: 20)" in f and "(default: 0.0001)" in f
    for flag in ("--ckpt-every", "--save-every", "--compare", "--out", "--seed", "--batch-size", "--warmup",
                 "--data", "--dtype", "--no-progress", "--json", "--resume", "--ckpt-dir"):
        assert flag in t and flag in f, flag
    # --save-every is another name of --ckpt-every
    assert train_lm.build_parser().parse_args(["--save-every", "5"]).ckpt_every == 5
    assert finetune.build_parser().parse_args(["--save-every", "5"]).ckpt_every == 5


TRAIN_LM_BAD = [
    (["--steps", "0"], "argument --steps: 0 is not allowed; allowed: a whole number >= 1"),
    (["--steps", "-5"], "argument --steps: -5 is not allowed"),
    (["--batch-size", "0"], "argument --batch-size: 0 is not allowed"),
    (["--seq-len", "0"], "argument --seq-len: 0 is not allowed"),
    (["--lr", "0"], "argument --lr: 0 is not allowed; allowed: a number > 0"),
    (["--warmup", "-1"], "argument --warmup: -1 is not allowed; allowed: a whole number >= 0"),
    (["--eval-batches", "0"], "argument --eval-batches: 0 is not allowed"),
    (["--ckpt-every", "-1"], "argument --ckpt-every/--save-every: -1 is not allowed"),
    (["--d-model", "60", "--heads", "8"], "--d-model 60 is not a multiple of --heads 8"),
    (["--compare", "bf16,mxfp9"], "recipe 'mxfp9': unknown recipe"),
    (["--compare", "mxfp8,mxfp8"], "names a recipe twice"),
    (["--resume"], "--resume needs --ckpt-dir"),
]


@pytest.mark.parametrize("argv, message", TRAIN_LM_BAD)
def test_train_lm_argument_checks(train_lm, argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        train_lm.parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "argument --steps: 0 is not allowed"),
    (["--batch-size", "-1"], "argument --batch-size: -1 is not allowed"),
    (["--val-fraction", "1"], "argument --val-fraction: 1 is not allowed; allowed: a number (0, 1)"),
    (["--clip", "0"], "argument --clip: 0 is not allowed"),
    (["--eval-batches", "0"], "argument --eval-batches: 0 is not allowed"),
    (["--compare", "bf16,mxfp9"], "unknown recipe"),
    (["--resume"], "--resume needs --ckpt-dir"),
    (["--books", "persuasion,dracula"], "--books 'persuasion,dracula': allowed are comma-separated keys"),
    (["--shape", "tiny"], "--shape tiny applies to a random model: add --random-init"),
    (["--random-init", "--shape", "tiny"], "use it with --data random"),
])
def test_finetune_argument_checks(finetune, argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        finetune.parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_finetune_accepts_book_keys_and_titles(finetune):
    assert finetune.parse_args(["--books", "persuasion,Pride and Prejudice"]).books == "persuasion,Pride and Prejudice"


TINY_LM = ["--data", "random", "--steps", "2", "--d-model", "32", "--heads", "2", "--layers", "1", "--seq-len", "8",
           "--batch-size", "2", "--eval-batches", "1", "--no-progress"]


def test_train_lm_unusable_ckpt_dir_refused_first(train_lm, tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    with pytest.raises(SystemExit, match="--ckpt-dir .*not a writable folder"):
        train_lm.main(TINY_LM + ["--ckpt-dir", str(blocker), "--out", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()  # refused before anything ran


def test_train_lm_compare_writes_run_dir(train_lm, tmp_path, capsys):
    """--compare without --ckpt-dir, a spec with commas, warm-up clamped, labels and results files."""
    out = tmp_path / "run"
    results = train_lm.main(TINY_LM + ["--compare", "bf16,mxfp4:grad_rounding=stochastic,seed=0", "--out", str(out),
                                       "--device", "cpu"])  # the labels below name the device
    printed = capsys.readouterr().out
    assert [r["recipe"] for r in results] == ["fp32", "mxfp4:grad_rounding=stochastic,seed=0"]
    assert results[1]["recipe_dict"]["seed"] == 0
    assert "--warmup 20 is longer than the 2 steps" in printed and f"run directory: {out}" in printed
    saved = json.loads((out / "results.json").read_text())
    assert saved["args"]["warmup"] == 2 and saved["precision"] == "high-precision compute fp32 on cpu"
    assert [len(r["history"]) for r in saved["results"]] == [2, 2] and saved["failures"] == []
    assert "random bytes" in saved["title"] and "fp32 on cpu" in saved["title"]
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_train_lm_keeps_finished_runs_when_one_fails(train_lm, tmp_path, capsys, monkeypatch):
    """A failing later recipe (failure injected into its run) leaves the finished run printed and saved; exit 1."""
    real_train = train_lm.train

    def train(spec, *args, **kwargs):
        if spec == "mxfp8":
            raise RuntimeError("injected failure")
        return real_train(spec, *args, **kwargs)

    monkeypatch.setattr(train_lm, "train", train)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        train_lm.main(TINY_LM + ["--steps", "1", "--compare", "bf16", "--compare", "mxfp8", "--out", str(out)])
    assert exc.value.code == 1
    printed = capsys.readouterr().out
    assert "mxfp8: FAILED (RuntimeError: injected failure)" in printed and "\nfp32 " in printed
    saved = json.loads((out / "results.json").read_text())
    assert [r["recipe"] for r in saved["results"]] == ["fp32"] and saved["failures"][0]["spec"] == "mxfp8"


def test_train_lm_resume_bar_and_checkpoint_line(train_lm, tmp_path, capsys):
    ckpt = tmp_path / "ck"
    train_lm.main(TINY_LM + ["--recipe", "mxfp8", "--ckpt-dir", str(ckpt), "--ckpt-every", "1", "--steps", "1",
                             "--out", str(tmp_path / "a")])
    assert "[mxfp8] checkpoint of step 1 written" in capsys.readouterr().out
    train_lm.main(TINY_LM + ["--recipe", "mxfp8", "--ckpt-dir", str(ckpt), "--resume", "--out", str(tmp_path / "b")])
    out = capsys.readouterr().out
    assert "[mxfp8] resumed from" in out and "(step 1," in out and "checkpoint of step 2 written" in out
    assert len(json.loads((tmp_path / "b" / "results.json").read_text())["results"][0]["history"]) == 2


def test_finetune_tiny_run_writes_run_dir(finetune, tmp_path, capsys):
    out = tmp_path / "run"
    results = finetune.main(["--random-init", "--shape", "tiny", "--data", "random", "--seq-len", "8",
                             "--batch-size", "1", "--eval-batches", "1", "--steps", "1", "--no-progress",
                             "--no-initial-eval", "--compare", "bf16", "--compare", "mxfp8", "--out", str(out),
                             "--device", "cpu"])
    printed = capsys.readouterr().out
    assert [r["recipe"] for r in results] == ["fp32", "mxfp8"]  # bf16 asked, fp32 ran: labelled fp32
    assert "high-precision compute fp32 on cpu" in printed and f"run directory: {out}" in printed
    saved = json.loads((out / "results.json").read_text())
    assert saved["title"].startswith("random-init tiny (2 layers) on random tokens; fp32 on cpu")
    assert "SmolLM2" not in saved["title"] and saved["args"]["warmup"] == 1
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
