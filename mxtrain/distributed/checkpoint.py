"""Distributed checkpoints with ``torch.distributed.checkpoint`` (DCP): save, resume, change world size.

A checkpoint is a directory ``<ckpt_dir>/step_<NNNNNNNN>/`` written by DCP (every rank
writes its own shards), plus ``meta.json`` which rank 0 writes last, after every rank
has finished: :func:`latest_checkpoint` only returns directories that have it, so a
run killed in the middle of a save resumes from the previous complete checkpoint.

State dicts come from ``torch.distributed.checkpoint.state_dict.get_state_dict``, so
the same files load into an FSDP2 model on any number of ranks or into a plain model
in one process (DCP reshards on load). The MX all-gather subclass never reaches them:
they hold plain tensors or DTensors of plain tensors (see ``enable_mx_all_gather``).
"""

from __future__ import annotations

import json
import os
import re

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "checkpoint_path"]

_STEP_DIR = re.compile(r"^step_(\d+)$")
META = "meta.json"


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist() else 0


def checkpoint_path(ckpt_dir: str, step: int) -> str:
    return os.path.join(ckpt_dir, f"step_{step:08d}")


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    if optimizer is None:
        model_sd, _ = get_state_dict(model, [])
        return {"model": model_sd}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def save_checkpoint(ckpt_dir: str, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    *, extra: dict | None = None) -> str:
    """Save model (and optimizer) state at ``step``; every rank calls it. Returns the checkpoint directory.

    ``extra``: small JSON-serialisable values (scheduler state, data position, losses)
    kept in ``meta.json`` next to ``step`` and the world size.
    """
    path = checkpoint_path(ckpt_dir, step)
    dcp.save(_state(model, optimizer), checkpoint_id=path)
    if _dist():
        dist.barrier()  # every rank's shards are on disk before the marker says so
    if _rank() == 0:
        meta = {"step": step, "world_size": dist.get_world_size() if _dist() else 1, **(extra or {})}
        tmp = os.path.join(path, META + ".tmp")
        with open(tmp, "w") as f:
            json.dump(meta, f)
        os.replace(tmp, os.path.join(path, META))
    if _dist():
        dist.barrier()
    return path


def load_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load a checkpoint saved by :func:`save_checkpoint` into ``model`` (and ``optimizer``), in place.

    Works for any world size, with or without FSDP2 and with or without a process group.
    Returns the ``meta.json`` values (``step``, ``world_size`` and the ``extra`` saved).
    """
    state = _state(model, optimizer)
    dcp.load(state, checkpoint_id=path)
    if optimizer is None:
        set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={})
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    with open(os.path.join(path, META)) as f:
        return json.load(f)


def latest_checkpoint(ckpt_dir: str) -> str | None:
    """The complete checkpoint (one with ``meta.json``) of the highest step in ``ckpt_dir``, or None."""
    if not os.path.isdir(ckpt_dir):
        return None
    best = None
    for name in os.listdir(ckpt_dir):
        m = _STEP_DIR.match(name)
        if m and os.path.isfile(os.path.join(ckpt_dir, name, META)):
            step = int(m.group(1))
            if best is None or step > best[0]:
                best = (step, os.path.join(ckpt_dir, name))
    return None if best is None else best[1]
