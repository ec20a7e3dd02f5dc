"""Distributed checkpoints with ``torch.distributed.checkpoint`` (DCP): save, resume, change world size.

A checkpoint is a directory ``<ckpt_dir>/step_<NNNNNNNN>/`` holding DCP's files (every rank
writes its own shards), one ``rank_state_<r>.pt`` per rank (recipe state such as
DelayedScaling's amax histories and scales, and the stochastic-rounding generators: both
differ between ranks) and ``meta.json``. A save writes everything into
``step_<N>.partial/``; once every rank has finished, rank 0 fsyncs, records the sha256 of
every file in ``meta.json`` and renames the directory into place. So a ``step_<N>`` directory
is always complete, a re-save of an existing step never leaves a mix of two saves (the old
copy moves to ``step_<N>.old`` until the new one is in place, and counts as complete meanwhile),
and a run killed mid-save resumes from the previous checkpoint. :func:`load_checkpoint` verifies
``meta.json`` and every checksum before it touches the model or the optimizer.

Which checkpoint is newest: ``meta.json`` carries ``seq``, one more than the largest ``seq``
in the directory when it was written, so :func:`latest_checkpoint` returns the checkpoint
written last, whatever its step: a fresh run's ``step_10`` wins over a leftover ``step_100``
of an older run in the same directory (pass ``run_id`` to keep runs apart explicitly).

State dicts come from ``torch.distributed.checkpoint.state_dict.get_state_dict``, so
the same files load into an FSDP2 model on any number of ranks or into a plain model
in one process (DCP reshards on load). The MX all-gather subclass never reaches them:
they hold plain tensors or DTensors of plain tensors (see ``enable_mx_all_gather``).
Per-rank state is restored bit for bit at the same world size; at another one rank ``r``
takes the state of saved rank ``r % saved_world_size``.

Security: DCP's ``.metadata`` file is a pickle, and unpickling runs code. Load checkpoints
only from directories you trust; the checksums catch corruption, not an attacker who can
also rewrite ``meta.json``. (``rank_state_<r>.pt`` is read with ``torch.load(weights_only=True)``.)
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from mxtrain.modules._common import generator_states, set_generator_states
from mxtrain.modules._recipe_state import EXTRA_STATE_KEY, load_recipe_states, recipe_state_modules, recipe_states

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "checkpoint_path", "read_meta",
           "CheckpointError", "RecipeMismatchError"]

_STEP_DIR = re.compile(r"^step_(\d+)(\.old)?$")  # .old: the previous copy of a step being re-saved
META = "meta.json"
FORMAT = 2  # meta.json layout: 2 = checksums, seq, per-rank state files
_PARTIAL, _OLD = ".partial", ".old"
_RESERVED = ("format", "step", "world_size", "seq", "run_id", "recipe", "files", "saved_at")
_UNSET = object()


class CheckpointError(RuntimeError):
    """A checkpoint directory is incomplete, corrupt or not one of :func:`save_checkpoint`'s."""


class RecipeMismatchError(ValueError):
    """The checkpoint was saved under another recipe than the one this run asks for."""


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist() else 0


def _world() -> int:
    return dist.get_world_size() if _dist() else 1


def _barrier() -> None:
    if _dist():
        dist.barrier()


def checkpoint_path(ckpt_dir: str, step: int) -> str:
    return os.path.join(ckpt_dir, f"step_{step:08d}")


def _rank_state_file(rank: int) -> str:
    return f"rank_state_{rank}.pt"


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    if optimizer is None:
        model_sd, _ = get_state_dict(model, [])
        state = {"model": model_sd}
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    # recipe state goes to the per-rank files: DCP would keep one rank's copy of these replicated
    # tensors, and would skip them on load into a model that has not run a step yet
    for name in recipe_state_modules(model):
        model_sd.pop(f"{name}.{EXTRA_STATE_KEY}" if name else EXTRA_STATE_KEY, None)
    return state


def recipe_record(recipe) -> dict | None:
    """What ``meta.json`` keeps of a recipe (None: high precision), compared on resume."""
    return None if recipe is None else recipe.to_dict()


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _files(path: str) -> list[str]:
    out = []
    for root, _, names in os.walk(path):
        out += [os.path.relpath(os.path.join(root, n), path) for n in names]
    return sorted(f for f in out if f != META)


def _complete_metas(ckpt_dir: str):
    """``(path, meta)`` of every complete checkpoint in ``ckpt_dir`` (unreadable meta.json: skipped)."""
    if not os.path.isdir(ckpt_dir):
        return
    for name in os.listdir(ckpt_dir):
        m = _STEP_DIR.match(name)
        if not m:
            continue
        path = os.path.join(ckpt_dir, name)
        try:
            yield path, read_meta(path)
        except CheckpointError:
            continue


def save_checkpoint(ckpt_dir: str, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    *, extra: dict | None = None, recipe=_UNSET, run_id: str | None = None) -> str:
    """Save model (and optimizer) state at ``step`` atomically; every rank calls it. Returns the directory.

    ``extra``: small JSON-serialisable values (scheduler state, data position, losses)
    kept in ``meta.json`` beside ``step`` and the world size. ``recipe``: the recipe this run
    trains with (None: high precision), recorded so that :func:`load_checkpoint` can refuse
    to resume under another. ``run_id``: a name :func:`latest_checkpoint` can filter on.
    Recipe state and stochastic-rounding generators are saved too (see the module doc).
    """
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    clash = sorted(set(extra or {}) & set(_RESERVED))
    if clash:
        raise ValueError(f"extra must not use the keys meta.json reserves: {clash} (reserved: {list(_RESERVED)})")
    meta = {"format": FORMAT, "step": step, "world_size": _world(), **(extra or {})}
    if recipe is not _UNSET:
        meta["recipe"] = recipe_record(recipe)
    if run_id is not None:
        meta["run_id"] = str(run_id)
    json.dumps(meta)  # not JSON-serialisable: every rank fails here, before anything is written
    final = checkpoint_path(ckpt_dir, step)
    tmp = final + _PARTIAL
    rank = _rank()
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a save that died earlier
    _barrier()
    dcp.save(_state(model, optimizer), checkpoint_id=tmp)  # DCP's writer fsyncs its files
    rank_file = os.path.join(tmp, _rank_state_file(rank))
    torch.save({"recipe_states": recipe_states(model), "generators": generator_states()}, rank_file)
    _fsync(rank_file)
    _barrier()  # every rank's files are on disk before rank 0 seals the directory
    if rank == 0:
        meta["seq"] = 1 + max((m.get("seq", 0) for _, m in _complete_metas(ckpt_dir)), default=0)
        meta["saved_at"] = time.time()
        meta["files"] = {f: _sha256(os.path.join(tmp, f)) for f in _files(tmp)}
        with open(os.path.join(tmp, META), "w") as f:
            json.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())
        _fsync(tmp)
        old = final + _OLD
        if os.path.exists(final):  # re-saving a step: the old copy stays complete until the new one is in place
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync(ckpt_dir)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def read_meta(path: str) -> dict:
    """``meta.json`` of the checkpoint at ``path``, checked for the fields a complete checkpoint has."""
    file = os.path.join(path, META)
    if not os.path.isfile(file):
        raise CheckpointError(f"{path} is not a complete checkpoint: it has no {META} (a save that did not finish, "
                              "or not a directory written by save_checkpoint)")
    try:
        with open(file) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file} is unreadable or not JSON ({e}); the checkpoint is corrupt") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{file} holds {type(meta).__name__}, not a JSON object; the checkpoint is corrupt")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{file} has format {meta.get('format')!r}; this mxtrain reads format {FORMAT} "
                              "(checkpoints with checksums and per-rank state)")
    for key, kind in (("step", int), ("world_size", int), ("seq", int), ("files", dict)):
        if not isinstance(meta.get(key), kind):
            raise CheckpointError(f"{file}: field {key!r} missing or not {kind.__name__} "
                                  f"(got {meta.get(key)!r}); the checkpoint is corrupt")
    if meta["world_size"] < 1:
        raise CheckpointError(f"{file}: world_size {meta['world_size']} (must be >= 1); the checkpoint is corrupt")
    return meta


def _verify(path: str, meta: dict) -> None:
    files = meta["files"]
    on_disk = set(_files(path))
    missing, unknown = sorted(set(files) - on_disk), sorted(on_disk - set(files))
    if missing or unknown:
        raise CheckpointError(f"{path}: files missing {missing} / not written by this save {unknown}; "
                              "refusing a checkpoint that mixes saves")
    for name in sorted(files):
        if _sha256(os.path.join(path, name)) != files[name]:
            raise CheckpointError(f"{path}: {name} does not match its sha256 in {META}; the file is corrupt")
    for r in range(meta["world_size"]):
        if _rank_state_file(r) not in files:
            raise CheckpointError(f"{path}: no {_rank_state_file(r)} for rank {r} of {meta['world_size']}")


def load_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    recipe=_UNSET, allow_recipe_change: bool = False) -> dict:
    """Load a checkpoint saved by :func:`save_checkpoint` into ``model`` (and ``optimizer``), in place.

    Verifies ``meta.json`` and the sha256 of every file first (rank 0 reads, every rank gets
    the verdict) and raises :class:`CheckpointError` before anything is loaded. ``recipe``:
    the recipe this run trains with (None: high precision); if the checkpoint recorded another,
    raises :class:`RecipeMismatchError` unless ``allow_recipe_change``. Restores recipe state
    and stochastic-rounding generators, also into a model that has not run a step yet.
    Works for any world size, with or without FSDP2 and with or without a process group.
    Returns the ``meta.json`` values (``step``, ``world_size`` and the ``extra`` saved).
    Loads pickled DCP metadata: only from trusted directories (see the module doc).
    """
    error = None
    if _rank() == 0:
        try:
            meta = read_meta(path)
            _verify(path, meta)
        except CheckpointError as e:
            error = str(e)
    if _dist():
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise CheckpointError(error)
    meta = read_meta(path)
    if recipe is not _UNSET and "recipe" in meta and not allow_recipe_change:
        saved, now = meta["recipe"], recipe_record(recipe)
        if saved != now:
            raise RecipeMismatchError(
                f"{path} was saved under recipe {saved} but this run uses {now}; resuming would continue "
                "training in another format. Pass allow_recipe_change=True (train_lm.py: --allow-recipe-change) "
                "to resume anyway")
    rank_file = os.path.join(path, _rank_state_file(_rank() % meta["world_size"]))
    rank_state = torch.load(rank_file, map_location="cpu", weights_only=True)
    unknown = sorted(set(rank_state["recipe_states"]) - set(recipe_state_modules(model)))
    if unknown:
        raise CheckpointError(f"{path} holds recipe state for modules this model lacks: {unknown[:5]}; "
                              "is it a checkpoint of another model?")
    state = _state(model, optimizer)
    dcp.load(state, checkpoint_id=path)
    if optimizer is None:
        set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={})
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    load_recipe_states(model, rank_state["recipe_states"])
    set_generator_states(rank_state["generators"])
    return meta


def latest_checkpoint(ckpt_dir: str, run_id: str | None = None) -> str | None:
    """The complete checkpoint in ``ckpt_dir`` written last (highest ``seq``; see the module doc), or None.

    ``run_id``: only checkpoints saved with that ``run_id``. A directory whose ``meta.json``
    is missing or unreadable is never returned (its files are not checked here:
    :func:`load_checkpoint` does that).
    """
    best = None
    for path, meta in _complete_metas(ckpt_dir):
        if run_id is not None and meta.get("run_id") != run_id:
            continue
        key = (meta["seq"], meta["step"])
        if best is None or key > best[0]:
            best = (key, path)
    return None if best is None else best[1]
