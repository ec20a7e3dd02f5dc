"""Shared by the benchmark tests of this folder: a script under torchrun with 2 ranks (gloo on CPU)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).parents[2]


@pytest.fixture
def torchrun2():
    """``run(script, *args, timeout=...)``: ``script`` under ``torch.distributed.run`` with 2 ranks, this
    checkout's mxtrain on the path; the finished process (its output captured)."""
    def run(script, *args, timeout=240) -> subprocess.CompletedProcess:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONWARNINGS"] = "ignore"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
               *map(str, args)]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    return run
