"""Training speed of the Fashion-MNIST study model: mxtrain.compat.mx vs microxcaling, same machine, same model.

    python benchmarks/bench_study.py                   # 20 steps each, 3 interleaved rounds
    python benchmarks/bench_study.py --steps 938       # one epoch (60000 images, batch 64)
    python benchmarks/bench_study.py --record          # append a section to benchmarks/RESULTS.md

The model is ``FashionCNN`` of ``examples/fashion_mnist_study.py`` built once with
``mxtrain.compat.mx`` and once with microxcaling's ``mx`` (imported at run time
from third_party/microxcaling), with MXFP8 (fp8_e4m3, 32-element blocks, E8M0
scales) matmuls and bfloat16 elementwise ops, microxcaling's defaults otherwise
(``round="nearest"``, quantized backward). Each step is forward, backward and an
Adadelta update on a batch of 64 Fashion-MNIST images (random images when the
data set is not installed). The two libraries run in alternating rounds so that
load from other processes hits both alike; the table reports the median and the
fastest round. The losses of the two runs are compared step by step.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time
import warnings

import torch
import torch.nn.functional as F

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mxtrain.compat import mx as ours  # noqa: E402
from mxtrain.cli import load_example  # noqa: E402

_study = load_example("examples/fashion_mnist_study.py")
FashionCNN, load_data, parse_config = _study.FashionCNN, _study.load_data, _study.parse_config

CONFIG = "fp8_e4m3+bfloat16"


def load_microxcaling():
    path = REPO / "third_party" / "microxcaling"
    if not (path / "mx" / "__init__.py").is_file():
        raise SystemExit(f"microxcaling is not checked out at {path}")
    sys.path.insert(0, str(path))
    return importlib.import_module("mx")


def batches(steps: int, batch: int):
    try:
        tx, ty, _, _ = load_data(steps * batch, torch.device("cpu"))
    except SystemExit:
        g = torch.Generator().manual_seed(0)
        tx, ty = torch.randn(steps * batch, 1, 28, 28, generator=g), torch.randint(0, 10, (steps * batch,), generator=g)
    n = tx.shape[0]
    return [(tx[(i * batch) % n:(i * batch) % n + batch], ty[(i * batch) % n:(i * batch) % n + batch])
            for i in range(steps)]


def train(lib, data, seed=0):
    """Per-step seconds and losses of ``len(data)`` training steps of a fresh model built with ``lib``."""
    specs = parse_config(CONFIG).specs(lib)
    torch.manual_seed(seed)
    model = FashionCNN(specs, lib)
    opt = torch.optim.Adadelta(model.parameters(), lr=1.0)
    times, losses = [], []
    for x, y in data:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.nll_loss(model(x), y)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return times, losses


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        return rev + (" plus working-tree changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20, help="training steps per round (938 = one epoch)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per library")
    p.add_argument("--warmup", type=int, default=2, help="steps of each round not timed")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--record", action="store_true", help="append the result to benchmarks/RESULTS.md")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    theirs = load_microxcaling()
    data = batches(args.steps + args.warmup, 64)
    rounds = {"mxtrain": [], "microxcaling": []}
    losses = {}
    load_before = os.getloadavg()
    for r in range(args.rounds):
        for name, lib in (("mxtrain", ours), ("microxcaling", theirs)):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t, l = train(lib, data)
            rounds[name].append(sum(t[args.warmup:]) / args.steps)
            losses[name] = l
            print(f"round {r + 1}: {name:12s} {rounds[name][-1] * 1000:8.1f} ms/step", flush=True)
    load_after = os.getloadavg()
    med = {k: statistics.median(v) for k, v in rounds.items()}
    best = {k: min(v) for k, v in rounds.items()}
    same = losses["mxtrain"] == losses["microxcaling"]
    diff = max(abs(a - b) for a, b in zip(losses["mxtrain"], losses["microxcaling"]))
    epoch = 60000 / 64
    rows = [("microxcaling", med["microxcaling"], best["microxcaling"]), ("mxtrain.compat.mx", med["mxtrain"],
                                                                          best["mxtrain"])]
    table = ["| library | ms/step (median of rounds) | ms/step (fastest round) | one epoch (938 steps), s | speedup |",
             "|---|---|---|---|---|"]
    for name, m, b in rows:
        table.append(f"| {name} | {m * 1000:.1f} | {b * 1000:.1f} | {m * epoch:.0f} | "
                     f"{med['microxcaling'] / m:.2f}x (fastest: {best['microxcaling'] / b:.2f}x) |")
    losses_line = ("identical in every step" if same else f"max |difference| {diff:.3g}") + \
        f" ({len(losses['mxtrain'])} steps)"
    print("\n".join(table))
    print(f"losses: {losses_line}")
    if args.record:
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        section = "\n".join([
            "", f"## bench_study.py — {now}", "",
            f"- device: {cpu_name()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads; "
            f"load average before/after: {load_before[0]:.2f} / {load_after[0]:.2f}",
            f"- torch {torch.__version__}, Python {platform.python_version()}; mxtrain {git_commit()}",
            f"- model: the Fashion-MNIST study classifier (FashionCNN of examples/fashion_mnist_study.py), {CONFIG}: "
            "MXFP8 e4m3 matmuls (block 32, E8M0), bfloat16 elementwise, round=nearest, quantized backward; "
            f"batch 64, Adadelta; {args.steps} timed steps after {args.warmup} warm-up steps, "
            f"{args.rounds} alternating rounds per library",
            f"- training losses of the two libraries: {losses_line}", "", *table, ""])
        with open(REPO / "benchmarks" / "RESULTS.md", "a") as f:
            f.write(section)
        print("appended to benchmarks/RESULTS.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
