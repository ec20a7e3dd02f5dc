"""Checkpoint reliability in one process: atomic saves, checksums verified before loading, the newest
checkpoint of this run, recipe state and stochastic-rounding generators resumed bit for bit."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

import mxtrain
import mxtrain.distributed.checkpoint as ckpt
from mxtrain.distributed.checkpoint import (
    CheckpointError, RecipeMismatchError, latest_checkpoint, load_checkpoint, save_checkpoint,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

DELAYED = "fp8_delayed:amax_history_len=4"
STOCHASTIC = "mxfp4:grad_rounding=stochastic,seed=0"


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(mxtrain.Linear(32, 64), mxtrain.LayerNormMLP(64, 64, activation="gelu"))


def _opt(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(64, 32, generator=g)


def _train(model, opt, recipe, steps):
    """Train ``steps`` steps (batches by step number); returns the losses."""
    losses = []
    for step in steps:
        with mxtrain.mx_autocast(recipe=recipe):
            loss = model(_batch(step)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("spec", ["mxfp8", DELAYED, STOCHASTIC])
def test_resume_into_fresh_model_is_bit_identical(tmp_path, spec):
    """Save after 3 steps, go on for 3; a freshly built model (no step run, so no recipe state yet)
    loaded from the checkpoint repeats those 3 steps bit for bit, generators and amax histories included."""
    recipe = mxtrain.recipe_from_string(spec)
    model = _model()
    opt = _opt(model)
    _train(model, opt, recipe, range(3))
    path = save_checkpoint(str(tmp_path), 3, model, opt, recipe=recipe)
    after = _train(model, opt, recipe, range(3, 6))

    fresh = _model(seed=1)  # other weights too: everything must come from the checkpoint
    fresh_opt = _opt(fresh)
    assert fresh[0].recipe_state is None
    meta = load_checkpoint(path, fresh, fresh_opt, recipe=recipe)
    assert meta["step"] == 3
    if spec == DELAYED:
        # the first forward has no amax to push yet
        assert fresh[1].recipe_state is not None and fresh[1].recipe_state.updates == 2
    assert _train(fresh, fresh_opt, recipe, range(3, 6)) == after
    assert _same(_params(fresh), _params(model))
    if spec == DELAYED:
        a, b = model[1].recipe_state.state_dict(), fresh[1].recipe_state.state_dict()
        assert torch.equal(a["amax_history"], b["amax_history"]) and torch.equal(a["scale"], b["scale"])


def test_stochastic_rounding_generator_is_what_resumes(tmp_path):
    """Without its generator state a resumed stochastic-rounding run differs (the test above can fail)."""
    recipe = mxtrain.recipe_from_string(STOCHASTIC)
    model = _model()
    opt = _opt(model)
    _train(model, opt, recipe, range(2))
    path = save_checkpoint(str(tmp_path), 2, model, opt, recipe=recipe)
    after = _train(model, opt, recipe, range(2, 4))
    fresh = _model()
    fresh_opt = _opt(fresh)
    load_checkpoint(path, fresh, fresh_opt, recipe=recipe)
    from mxtrain.modules._common import set_generator_states
    set_generator_states([])  # as a new process: the generator starts again from its seed
    assert _train(fresh, fresh_opt, recipe, range(2, 4)) != after


@pytest.mark.parametrize("where", ["dcp", "checksums", "rename"])
def test_crash_mid_save_keeps_the_previous_copy(tmp_path, monkeypatch, where):
    """A save that dies (while DCP writes, while checksumming, or between the two renames of a re-save)
    leaves the earlier complete checkpoint loadable and returned by latest_checkpoint."""
    recipe = mxtrain.recipe_from_string("mxfp8")
    model = _model()
    opt = _opt(model)
    _train(model, opt, recipe, range(1))
    good = save_checkpoint(str(tmp_path), 4, model, opt, recipe=recipe)
    saved = _params(model)
    _train(model, opt, recipe, range(1, 2))

    class Crash(Exception):
        pass

    if where == "dcp":
        real = ckpt.dcp.save

        def dying_save(state, checkpoint_id):
            real(state, checkpoint_id=checkpoint_id)
            raise Crash
        monkeypatch.setattr(ckpt.dcp, "save", dying_save)
    elif where == "checksums":
        monkeypatch.setattr(ckpt, "_sha256", lambda path: (_ for _ in ()).throw(Crash()))
    else:
        real_rename = os.rename

        def rename(a, b):
            if str(a) == good + ".partial":  # step_4 -> step_4.old done; step_4.partial -> step_4 not
                assert os.path.isdir(good + ".old") and not os.path.exists(good)
                raise Crash
            real_rename(a, b)
        monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(Crash):
        save_checkpoint(str(tmp_path), 4, model, opt, recipe=recipe)  # re-save of the same step
    monkeypatch.undo()

    latest = latest_checkpoint(str(tmp_path))
    assert latest is not None and os.path.basename(latest).startswith("step_00000004")
    if where == "rename":
        assert latest == good + ".old"
    else:
        assert latest == good and os.path.isdir(good + ".partial")
    fresh = _model(seed=3)
    load_checkpoint(latest, fresh, _opt(fresh), recipe=recipe)
    assert _same(_params(fresh), saved)
    # the next save of that step cleans up and is complete again
    save_checkpoint(str(tmp_path), 4, model, opt, recipe=recipe)
    assert sorted(os.listdir(tmp_path)) == ["step_00000004"]
    assert latest_checkpoint(str(tmp_path)) == good


def _corrupt_distcp(path):
    shard = next(f for f in sorted(os.listdir(path)) if f.endswith(".distcp"))
    file = os.path.join(path, shard)
    data = bytearray(open(file, "rb").read())
    data[len(data) // 2] ^= 0x01  # one flipped bit inside the tensor data
    open(file, "wb").write(bytes(data))
    return shard


@pytest.mark.parametrize("damage", ["weights", "rank_state", "meta_truncated", "meta_checksum", "extra_file",
                                    "missing_file"])
def test_corrupt_checkpoint_is_refused_before_loading(tmp_path, damage):
    recipe = mxtrain.recipe_from_string(DELAYED)
    model = _model()
    opt = _opt(model)
    _train(model, opt, recipe, range(2))
    path = save_checkpoint(str(tmp_path), 2, model, opt, recipe=recipe)
    meta_file = os.path.join(path, "meta.json")
    if damage == "weights":
        culprit = _corrupt_distcp(path)
    elif damage == "rank_state":
        culprit = "rank_state_0.pt"
        data = bytearray(open(os.path.join(path, culprit), "rb").read())
        data[-40] ^= 0x10
        open(os.path.join(path, culprit), "wb").write(bytes(data))
    elif damage == "meta_truncated":
        text = open(meta_file).read()
        open(meta_file, "w").write(text[: len(text) // 2])
        culprit = "meta.json"
    elif damage == "meta_checksum":
        meta = json.load(open(meta_file))
        name = sorted(meta["files"])[0]
        meta["files"][name] = "0" * 64
        json.dump(meta, open(meta_file, "w"))
        culprit = name
    elif damage == "extra_file":
        open(os.path.join(path, "__9_0.distcp"), "wb").write(b"from another save")
        culprit = "__9_0.distcp"
    else:
        os.remove(os.path.join(path, ".metadata"))
        culprit = ".metadata"

    victim = _model(seed=5)
    victim_opt = _opt(victim)
    _train(victim, victim_opt, recipe, range(1))
    before, opt_before = _params(victim), victim_opt.state_dict()
    state_before = victim[1].recipe_state.state_dict()
    with pytest.raises(CheckpointError, match=culprit.replace(".", r"\.")):
        load_checkpoint(path, victim, victim_opt, recipe=recipe)
    assert _same(_params(victim), before)  # nothing was touched
    assert torch.equal(victim_opt.state_dict()["state"][0]["exp_avg"], opt_before["state"][0]["exp_avg"])
    assert torch.equal(victim[1].recipe_state.state_dict()["scale"], state_before["scale"])


def test_latest_is_this_runs_newest_not_the_highest_step(tmp_path):
    """A leftover step_100 of an older run in the same directory loses to this run's step_10."""
    model = _model()
    opt = _opt(model)
    old = save_checkpoint(str(tmp_path), 100, model, opt, run_id="old-run")
    assert latest_checkpoint(str(tmp_path)) == old
    new = save_checkpoint(str(tmp_path), 10, model, opt, run_id="new-run")
    assert latest_checkpoint(str(tmp_path)) == new
    assert latest_checkpoint(str(tmp_path), run_id="old-run") == old
    assert latest_checkpoint(str(tmp_path), run_id="nobody") is None
    newer = save_checkpoint(str(tmp_path), 20, model, opt, run_id="new-run")
    assert latest_checkpoint(str(tmp_path)) == newer
    # a directory without a readable meta.json is never picked
    os.makedirs(tmp_path / "step_00000500")
    open(tmp_path / "step_00000500" / "meta.json", "w").write("{not json")
    assert latest_checkpoint(str(tmp_path)) == newer
    assert latest_checkpoint(str(tmp_path / "absent")) is None


def test_resume_under_another_recipe_is_refused(tmp_path):
    model = _model()
    opt = _opt(model)
    mx = mxtrain.recipe_from_string("mxfp8")
    _train(model, opt, mx, range(1))
    path = save_checkpoint(str(tmp_path), 1, model, opt, recipe=mx)
    before = _params(model)
    for other in (mxtrain.recipe_from_string(DELAYED), mxtrain.recipe_from_string("mxfp8:block_size=16"), None):
        with pytest.raises(RecipeMismatchError, match="allow_recipe_change=True"):
            load_checkpoint(path, _model(seed=2), recipe=other)
    load_checkpoint(path, model, opt, recipe=mx)  # the same recipe
    fresh = _model(seed=2)
    load_checkpoint(path, fresh, recipe=None, allow_recipe_change=True)
    assert _same(_params(fresh), before)


def test_extra_cannot_shadow_meta_fields(tmp_path):
    model = _model()
    with pytest.raises(ValueError, match="reserves"):
        save_checkpoint(str(tmp_path), 1, model, extra={"files": {}})
    with pytest.raises(TypeError):
        save_checkpoint(str(tmp_path), 1, model, extra={"x": object()})
    assert os.listdir(tmp_path) == []


def test_train_lm_refuses_to_resume_under_another_recipe(tmp_path, monkeypatch, capsys):
    """examples/train_lm.py --resume under another --recipe stops with the reason, unless
    --allow-recipe-change; the same recipe resumes."""
    import importlib.util
    import pathlib

    try:
        from mxtrain.data import load_austen
        load_austen(books=["persuasion"])
    except (FileNotFoundError, OSError, RuntimeError) as e:
        pytest.skip(f"Austen corpus not installed (scripts/install_data.sh): {e}")
    script = pathlib.Path(__file__).resolve().parents[2] / "examples" / "train_lm.py"
    spec = importlib.util.spec_from_file_location("train_lm_for_ckpt_test", script)
    train_lm = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, train_lm)  # its dataclasses look their module up
    spec.loader.exec_module(train_lm)
    common = ["--steps", "2", "--batch-size", "2", "--seq-len", "32", "--d-model", "32", "--layers", "1",
              "--heads", "2", "--warmup", "1", "--eval-batches", "1", "--device", "cpu", "--no-progress",
              "--ckpt-dir", str(tmp_path)]
    train_lm.main(["--recipe", "mxfp8", *common])
    # main reports a failed run (with the reason) and exits 1 after keeping the finished ones
    with pytest.raises(SystemExit) as exit_info:
        train_lm.main(["--recipe", DELAYED, "--resume", *common])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "RecipeMismatchError" in err and "allow-recipe-change" in err
    train_lm.main(["--recipe", DELAYED, "--resume", "--allow-recipe-change", *common])
    train_lm.main(["--recipe", "mxfp8", "--resume", *common])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a checkpoint from a GPU loaded where there is none")
def test_generator_of_a_missing_device_warns_and_the_others_restore():
    from mxtrain.modules import _common

    cpu = torch.Generator().manual_seed(11)
    torch.randint(0, 10, (5,), generator=cpu)
    states = [{"seed": 5, "device": "cuda:0", "state": torch.Generator().get_state()},
              {"seed": 7, "device": "cpu", "state": cpu.get_state()}]
    with pytest.warns(UserWarning, match="seed 5 on cuda:0 not restored"):
        _common.set_generator_states(states)
    restored = _common._GENERATORS[(7, torch.device("cpu"))]
    assert torch.equal(restored.get_state(), cpu.get_state())
    assert (5, torch.device("cuda:0")) not in _common._GENERATORS


def test_saved_from_a_compiled_model_loads_into_the_plain_one(tmp_path):
    """torch.compile wraps the model (``_orig_mod.``): recipe state is named as the parameters are, so a
    checkpoint of the compiled model resumes the plain one (and the reverse)."""
    recipe = mxtrain.recipe_from_string(DELAYED)
    model = _model()
    opt = _opt(model)
    _train(model, opt, recipe, range(3))
    save_checkpoint(str(tmp_path), 3, torch.compile(model), opt, recipe=recipe)  # compiled lazily: never run
    fresh = _model(seed=1)
    fresh_opt = _opt(fresh)
    load_checkpoint(latest_checkpoint(str(tmp_path)), fresh, fresh_opt, recipe=recipe)
    assert _same(_params(fresh), _params(model))
    for (name, a), b in zip(((n, m) for n, m in model.named_modules() if getattr(m, "recipe_state", None)),
                            (m for m in fresh.modules() if getattr(m, "recipe_state", None))):
        assert torch.equal(a.recipe_state.amax_history, b.recipe_state.amax_history), name
        assert torch.equal(a.recipe_state.scale, b.recipe_state.scale), name
    assert _train(fresh, fresh_opt, recipe, range(3, 5)) == _train(model, opt, recipe, range(3, 5))
