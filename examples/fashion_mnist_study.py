"""Fashion-MNIST format study: which MX matmul and elementwise formats keep the lab's classifier accurate?

    python examples/fashion_mnist_study.py             # the two tables of the lab, then the search
    python examples/fashion_mnist_study.py --epochs 10 --device cuda --out runs/fmnist
    mxtrain study fashion-mnist --subset 512 --epochs 1 --configs fp32+fp32,int8+bfloat16   # the same, as a command

The classifier is the one of the lab (seeds/lab_mx_formats_fashion_mnist.txt),
whose script derives from PyTorch's MNIST example: conv 3x3 (1->32) -> ReLU ->
conv 3x3 (32->64) -> ReLU -> max-pool 2 -> dropout 0.25 -> linear 9216->128 ->
ReLU -> dropout 0.5 -> linear 128->10 -> log-softmax; Adadelta (lr 1.0), the
learning rate times 0.7 after every epoch, batch 64. The model is written against
microxcaling's API (``mx.Conv2d``, ``mx.Linear``, ``mx.relu`` with ``mx_specs``)
and built with ``mxtrain.compat.mx``; ``benchmarks/bench_study.py`` builds the same
model with microxcaling itself.

A configuration is named ``<matmul>+<elementwise>``: ``<matmul>`` is an MX element
format for weights and activations (``fp8_e4m3``), ``<w>/<a>`` for different ones
(``int4/fp6_e2m3``), ``bfloat16`` (microxcaling's MX bfloat16 elements) or ``fp32``
(no MX); ``<elementwise>`` is ``bfloatN`` or ``fpN`` (5 exponent bits; ``fp8`` is
1-5-2) for every elementwise op, or ``fp32``. Every configuration uses
microxcaling's defaults otherwise: 32-element blocks, 8-bit (E8M0) scales,
``round="nearest"``, quantized backward pass.

Cost model of the search (bits an accelerator stores and moves per element, per
operand): an MX operand costs its element bits plus 8 / 32 bits of shared scale;
elementwise ops cost the width of their format (32 when off). A configuration's
cost is weight bits + activation bits + elementwise bits. The search walks the
candidates in order of cost and stops at the first that reaches the target
accuracy; a candidate no wider than an already failed one in every component is
skipped without training (fewer bits are assumed not to help).

Files written to ``--out``: ``runs.csv`` (one row per run and epoch), ``runs.json``
(everything, with the specs), ``tables.md`` (the lab's tables and the search
result) and ``study.png`` (accuracy per epoch, accuracy vs bits). Fixed seeds: a
rerun on the same device gives the same numbers.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mxtrain.cli import STUDY_DESCRIPTION, HelpFormatter, add_study_arguments, check_writable_dir, resolve_study_args
from mxtrain.compat import mx as mxtrain_mx

__all__ = ["FashionCNN", "StudyConfig", "parse_config", "run_config", "run_study", "main", "TABLE1", "TABLE2",
           "SEARCH_MATMUL_FORMATS", "SEARCH_ELEMWISE_FORMATS", "config_bits", "load_data", "merge_studies"]

TABLE1 = ("int2+bfloat16", "int8+bfloat16", "fp8_e4m3+bfloat16", "fp8_e5m2+bfloat16", "bfloat16+bfloat16")
TABLE2 = ("fp8_e4m3+fp16", "fp8_e4m3+fp12", "fp8_e4m3+fp10", "fp8_e4m3+fp8")
BASELINE = "fp32+fp32"
SEARCH_MATMUL_FORMATS = ("int2", "fp4_e2m1", "int4", "fp6_e2m3", "fp6_e3m2", "fp8_e4m3", "int8")
SEARCH_ELEMWISE_FORMATS = ("fp8", "fp10", "fp12", "bfloat16")
MEAN, STD = 0.2860, 0.3530  # Fashion-MNIST training-set pixel statistics
BLOCK_SIZE, SCALE_BITS = 32, 8
_ELEMENT_BITS = {"int2": 2, "int4": 4, "int8": 8, "fp4_e2m1": 4, "fp6_e2m3": 6, "fp6_e3m2": 6, "fp8_e4m3": 8,
                 "fp8_e5m2": 8, "bfloat16": 16, "fp16": 16}


class FashionCNN(nn.Module):
    """The lab's classifier, written against microxcaling's API (``mx_lib`` is ``mxtrain.compat.mx`` or ``mx``)."""

    def __init__(self, mx_specs=None, mx_lib=None):
        super().__init__()
        lib = mx_lib or mxtrain_mx
        self.mx_lib, self.mx_specs = lib, mx_specs
        self.conv1 = lib.Conv2d(1, 32, 3, 1, mx_specs=mx_specs)
        self.conv2 = lib.Conv2d(32, 64, 3, 1, mx_specs=mx_specs)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = lib.Linear(9216, 128, mx_specs=mx_specs)
        self.fc2 = lib.Linear(128, 10, mx_specs=mx_specs)

    def forward(self, x):
        relu, specs = self.mx_lib.relu, self.mx_specs
        x = relu(self.conv1(x), mx_specs=specs)
        x = relu(self.conv2(x), mx_specs=specs)
        x = F.max_pool2d(x, 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = relu(self.fc1(x), mx_specs=specs)
        x = self.fc2(self.dropout2(x))
        return F.log_softmax(x, dim=1)


@dataclass(frozen=True)
class StudyConfig:
    """One point of the study: MX formats of the matmul operands and the elementwise precision."""

    name: str
    w_format: str | None
    a_format: str | None
    elemwise: str | None  # "bfloatN" / "fpN" / None

    def specs(self, mx_lib=None) -> dict | None:
        """Finalized mx_specs (None for the fp32 baseline)."""
        lib = mx_lib or mxtrain_mx
        s = {"w_elem_format": self.w_format, "a_elem_format": self.a_format, "block_size": BLOCK_SIZE,
             "scale_bits": SCALE_BITS}
        if self.elemwise is not None:
            family = "bfloat" if self.elemwise.startswith("bfloat") else "fp"
            s[family] = int(self.elemwise[len(family):])
        return lib.finalize_mx_specs(s)

    @property
    def bits(self) -> dict:
        return config_bits(self)


def _operand_bits(fmt: str | None) -> float:
    return 32.0 if fmt is None else _ELEMENT_BITS[fmt] + SCALE_BITS / BLOCK_SIZE


def config_bits(cfg: StudyConfig) -> dict:
    """Bits per element of each operand under the cost model (see the module docstring) and their sum."""
    w, a = _operand_bits(cfg.w_format), _operand_bits(cfg.a_format)
    e = 32.0 if cfg.elemwise is None else float(int("".join(ch for ch in cfg.elemwise if ch.isdigit())))
    return {"weight": w, "activation": a, "elementwise": e, "total": w + a + e}


def _matmul_format(text: str) -> str | None:
    key = text.strip().lower()
    if key in ("fp32", "none", "off"):
        return None
    if key in ("bf16", "bfloat16"):
        return "bfloat16"
    if key == "fp4":
        key = "fp4_e2m1"
    if key not in _ELEMENT_BITS or key == "fp16":
        raise ValueError(f"unknown matmul format {text!r}; use one of {', '.join(k for k in _ELEMENT_BITS if k != 'fp16')}"
                         " or fp32")
    return key


def _elemwise_format(text: str) -> str | None:
    key = text.strip().lower()
    if key in ("fp32", "none", "off"):
        return None
    for family, lo in (("bfloat", 10), ("fp", 7)):
        digits = key[len(family):]
        if key.startswith(family) and digits.isdigit() and lo <= int(digits) <= 32:
            return key if family == "fp" or int(digits) < 32 else None
    raise ValueError(f"unknown elementwise format {text!r}; use bfloatN (N=10..32), fpN (N=7..32) or fp32")


def parse_config(name: str) -> StudyConfig:
    """``"<matmul>+<elementwise>"`` (``<matmul>`` = ``fmt`` or ``w_fmt/a_fmt``) -> :class:`StudyConfig`."""
    if name.count("+") != 1:
        raise ValueError(f"configuration {name!r} must look like <matmul>+<elementwise>, e.g. fp8_e4m3+bfloat16, "
                         f"int4/fp6_e2m3+fp10 or fp32+fp32")
    matmul, elemwise = name.split("+")
    w_text, _, a_text = matmul.partition("/")
    w, a = _matmul_format(w_text), _matmul_format(a_text or w_text)
    e = _elemwise_format(elemwise)
    canon = (f"{w or 'fp32'}" + ("" if a == w else f"/{a or 'fp32'}")) + f"+{e or 'fp32'}"
    return StudyConfig(canon, w, a, e)


@dataclass
class RunResult:
    config: str
    w_format: str | None
    a_format: str | None
    elemwise: str | None
    bits: dict
    accuracy: list = field(default_factory=list)  # test accuracy (%) after each epoch
    train_loss: list = field(default_factory=list)  # mean training loss of each epoch
    seconds: float = 0.0
    specs: dict | None = None


def load_data(subset: int | None, device: torch.device):
    """Normalized ``(train_x, train_y, test_x, test_y)`` on ``device``; ``subset``: first N of each split."""
    from mxtrain.data import load_fashion_mnist
    try:
        tx, ty = load_fashion_mnist("train")
        vx, vy = load_fashion_mnist("test")
    except FileNotFoundError as err:
        raise SystemExit(f"Fashion-MNIST is not installed: {err}\nInstall it with:  bash scripts/install_data.sh")
    if subset:
        tx, ty, vx, vy = tx[:subset], ty[:subset], vx[:subset], vy[:subset]

    def prep(x):
        return ((x.float().div_(255.0) - MEAN) / STD).unsqueeze(1).to(device)

    return prep(tx), ty.to(device), prep(vx), vy.to(device)


def evaluate(model, x, y, batch_size=1000) -> float:
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, x.shape[0], batch_size):
            correct += int((model(x[i:i + batch_size]).argmax(1) == y[i:i + batch_size]).sum())
    return 100.0 * correct / max(1, x.shape[0])


def _set_determinism(device: torch.device) -> None:
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.allow_tf32 = False  # the emulation relies on fp32 accumulation
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.use_deterministic_algorithms(True, warn_only=True)


def run_config(cfg: StudyConfig, data, epochs: int, seed: int = 0, batch_size: int = 64, lr: float = 1.0,
               gamma: float = 0.7, mx_lib=None, progress: bool = True, log=print, on_epoch=None) -> RunResult:
    """Train the classifier under ``cfg`` for ``epochs`` epochs, testing after each one."""
    from tqdm import tqdm
    tx, ty, vx, vy = data
    device = tx.device
    lib = mx_lib or mxtrain_mx
    specs = cfg.specs(lib)
    torch.manual_seed(seed)
    model = FashionCNN(specs, lib).to(device)
    opt = torch.optim.Adadelta(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=gamma)
    gen = torch.Generator().manual_seed(seed)
    result = RunResult(cfg.name, cfg.w_format, cfg.a_format, cfg.elemwise, cfg.bits,
                       specs=None if specs is None else json.loads(json.dumps(dict(specs), default=str)))
    start = time.perf_counter()
    for epoch in range(1, epochs + 1):
        model.train()
        order = torch.randperm(tx.shape[0], generator=gen).to(device)
        total, count = torch.zeros((), device=device), 0
        steps = range(0, tx.shape[0], batch_size)
        bar = tqdm(steps, desc=f"{cfg.name} epoch {epoch}/{epochs}", leave=False, disable=not progress,
                   unit="batch", dynamic_ncols=True)
        for i in bar:
            idx = order[i:i + batch_size]
            opt.zero_grad(set_to_none=True)
            loss = F.nll_loss(model(tx[idx]), ty[idx])
            loss.backward()
            opt.step()
            total += loss.detach() * idx.numel()
            count += idx.numel()
        sched.step()
        acc = evaluate(model, vx, vy)
        result.accuracy.append(acc)
        result.train_loss.append(float(total) / max(1, count))
        log(f"  {cfg.name:28s} epoch {epoch:2d}: train loss {result.train_loss[-1]:.4f}  test accuracy {acc:6.2f}%")
        result.seconds = time.perf_counter() - start
        if on_epoch is not None:
            on_epoch(result)
    return result


def search_candidates(matmul_formats=SEARCH_MATMUL_FORMATS, elemwise_formats=SEARCH_ELEMWISE_FORMATS):
    """Every (weight, activation, elementwise) combination, cheapest first (ties: more elementwise bits first)."""
    cands = [StudyConfig(f"{w}" + ("" if a == w else f"/{a}") + f"+{e}", w, a, e)
             for w, a, e in itertools.product(matmul_formats, matmul_formats, elemwise_formats)]
    return sorted(cands, key=lambda c: (c.bits["total"], -c.bits["elementwise"], c.name))


def _dominated(cand: StudyConfig, failed: list[StudyConfig]) -> StudyConfig | None:
    b = cand.bits
    for f in failed:
        fb = f.bits
        if all(b[k] <= fb[k] for k in ("weight", "activation", "elementwise")):
            return f
    return None


def _fmt_acc(values, i):
    return f"{values[i]:.2f}" if len(values) > i else "-"


def _tables_markdown(results: dict, epochs: int, search: dict | None, meta: dict) -> str:
    lines = [f"# Fashion-MNIST format study", "",
             f"Device: {meta['device']}; torch {meta['torch']}; {meta['train_images']} training and "
             f"{meta['test_images']} test images; {epochs} epochs; seed {meta['seed']}.", ""]
    checkpoints = [e for e in (5, 10) if e <= epochs] or [epochs]

    def table(title, names, header):
        present = [n for n in names if n in results]
        if not present:
            return
        lines.extend([f"## {title}", "", "| " + header + " | " + " | ".join(
            results[n].config.split("+")[0 if header.startswith("Matmul") else 1] for n in present) + " |",
            "|---" * (len(present) + 1) + "|"])
        for e in checkpoints:
            lines.append(f"| Accuracy after {e} epochs (%) | " + " | ".join(
                _fmt_acc(results[n].accuracy, e - 1) for n in present) + " |")
        if any(len(results[n].accuracy) < checkpoints[-1] for n in present):  # a run stopped early
            lines.append("| Last epoch reached: accuracy (%) | " + " | ".join(
                f"{len(results[n].accuracy)}: {_fmt_acc(results[n].accuracy, len(results[n].accuracy) - 1)}"
                for n in present) + " |")
        lines.append("")

    table("1. Matmul formats, bfloat16 elementwise ops", TABLE1, "Matmul format")
    table("2. Elementwise formats, fp8_e4m3 matmuls", TABLE2, "Elementwise format")
    others = [n for n in results if n not in TABLE1 and n not in TABLE2 and not n.startswith("search:")]
    if others:
        lines.extend(["## Other configurations", "", "| configuration | bits (w + a + elementwise) | " + " | ".join(
            f"after {e} epochs (%)" for e in checkpoints) + " |", "|---|---|" + "---|" * len(checkpoints)])
        for n in others:
            r = results[n]
            lines.append(f"| {n} | {r.bits['total']:g} | " + " | ".join(_fmt_acc(r.accuracy, e - 1)
                                                                         for e in checkpoints) + " |")
        lines.append("")
    if search is not None:
        lines.extend(["## 3. Fewest bits at >= {:g}% test accuracy".format(search["target"]), "",
                      "Cost per element: MX operand = element bits + 8/32 scale bits; elementwise = format width; "
                      "total = weight + activation + elementwise. Candidates in order of cost; "
                      "a candidate no wider than a failed one in every component is skipped.", "",
                      "| candidate | bits | final accuracy (%) | outcome |", "|---|---|---|---|"])
        for row in search["tried"]:
            lines.append(f"| {row['config']} | {row['bits']:g} | {row['accuracy'] if row['accuracy'] is not None else '-'} "
                         f"| {row['outcome']} |")
        lines.append("")
        if search["best"]:
            b = search["best"]
            lines.append(f"**Selected: `{b['config']}`**: {b['bits']:g} bits per element "
                         f"(weights {b['detail']['weight']:g}, activations {b['detail']['activation']:g}, "
                         f"elementwise {b['detail']['elementwise']:g}), test accuracy {b['accuracy']:.2f}% "
                         f"after {search['epochs']} epochs.")
        else:
            lines.append(f"No candidate reached {search['target']:g}% within the {len(search['tried'])} tried.")
        lines.append("")
    return "\n".join(lines)


def _plot(results: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'mxtrain[plot]'): no plot written", file=sys.stderr)
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for name, r in results.items():
        if r.accuracy:
            ax1.plot(range(1, len(r.accuracy) + 1), r.accuracy, marker="o", markersize=3, label=name)
    ax1.set_xlabel("epoch")
    ax1.set_ylabel("test accuracy (%)")
    ax1.set_title("Test accuracy per epoch")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    for name, r in results.items():
        if r.accuracy:
            ax2.scatter(r.bits["total"], r.accuracy[-1])
            ax2.annotate(name.removeprefix("search:"), (r.bits["total"], r.accuracy[-1]), fontsize=6,
                         xytext=(3, 3), textcoords="offset points")
    ax2.axhline(90.0, color="gray", linestyle="--", linewidth=1)
    ax2.set_xlabel("bits per element (weight + activation + elementwise)")
    ax2.set_ylabel("final test accuracy (%)")
    ax2.set_title("Accuracy vs bits")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _write(out: Path, results: dict, epochs: int, search, meta) -> list[str]:
    """Write the study's files into ``out``; returns the names written (no plot without matplotlib)."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "runs.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["config", "w_format", "a_format", "elemwise", "bits_total", "epoch", "test_accuracy",
                    "train_loss", "seconds"])
        for r in results.values():
            for e, (acc, loss) in enumerate(zip(r.accuracy, r.train_loss), 1):
                w.writerow([r.config, r.w_format or "fp32", r.a_format or "fp32", r.elemwise or "fp32",
                            r.bits["total"], e, f"{acc:.2f}", f"{loss:.5f}", f"{r.seconds:.1f}"])
    with open(out / "runs.json", "w") as f:
        json.dump({"meta": meta, "epochs": epochs, "runs": [asdict(r) for r in results.values()],
                   "search": search}, f, indent=1)
    (out / "tables.md").write_text(_tables_markdown(results, epochs, search, meta))
    return ["runs.csv", "runs.json", "tables.md"] + (["study.png"] if _plot(results, out / "study.png") else [])


def _subprocess_run(cfg: StudyConfig, epochs: int, common: dict, workdir: Path):
    """Start one configuration in its own process (``--jobs``); returns (Popen, its output folder)."""
    import subprocess
    out = workdir / cfg.name.replace("/", "_").replace("+", "__")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--configs", cfg.name, "--epochs", str(epochs),
           "--no-search", "--quiet", "--out", str(out), "--device", common["device"], "--seed", str(common["seed"]),
           "--batch-size", str(common["batch_size"]), "--threads", str(common["threads"])]
    if common["subset"]:
        cmd += ["--subset", str(common["subset"])]
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])  # the checkout, so a clone without install runs too
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    log = open(out.with_suffix(".log"), "w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), out


def _read_run(folder: Path) -> "RunResult | None":
    try:
        runs = json.loads((folder / "runs.json").read_text())["runs"]
    except (OSError, ValueError, KeyError):
        return None
    return RunResult(**runs[0]) if runs else None


def _train_many(cfgs, epochs, data, common, jobs, workdir, log, progress, on_update):
    """Train ``cfgs``; with ``jobs > 1`` in parallel processes. Returns {name: RunResult} (missing if a job failed)."""
    results = {}
    if jobs <= 1:
        from tqdm import tqdm
        for cfg in tqdm(cfgs, desc="configurations", disable=not progress or len(cfgs) < 2, unit="run",
                        dynamic_ncols=True):
            log(f"{cfg.name}: {cfg.bits['total']:g} bits per element")
            results[cfg.name] = run_config(cfg, data, epochs, seed=common["seed"], batch_size=common["batch_size"],
                                           progress=progress, log=log,
                                           on_epoch=lambda r: on_update({**results, r.config: r}))
            on_update(results)
        return results
    workdir.mkdir(parents=True, exist_ok=True)
    pending = list(cfgs)
    running = []
    while pending or running:
        while pending and len(running) < jobs:
            cfg = pending.pop(0)
            log(f"{cfg.name}: {cfg.bits['total']:g} bits per element (process)")
            running.append((cfg, *_subprocess_run(cfg, epochs, common, workdir)))
        time.sleep(0.5)
        for item in list(running):
            cfg, proc, folder = item
            if proc.poll() is None:
                continue
            running.remove(item)
            r = _read_run(folder)
            if proc.returncode != 0 or r is None:
                log(f"{cfg.name}: failed (exit {proc.returncode}); see {folder.with_suffix('.log')}")
                continue
            results[cfg.name] = r
            log(f"{cfg.name}: test accuracy per epoch {', '.join(f'{a:.2f}' for a in r.accuracy)}")
            on_update(results)
    return results


def run_study(configs: list[str] | None = None, epochs: int = 10, subset: int | None = None,
              out: str | os.PathLike = "runs/fashion_mnist", device: str = "cpu", seed: int = 0,
              batch_size: int = 64, search: bool | None = None, search_epochs: int | None = None,
              target: float = 90.0, search_max_runs: int = 12, jobs: int = 1, prior=(), progress: bool = True,
              log=print) -> dict:
    """Run the grid (default: the baseline and the lab's two tables), then the search; write the files.

    ``jobs > 1`` trains that many configurations at once, each in its own process
    (useful on a GPU, which one small model leaves mostly idle); the search then
    tries its candidates in waves of ``jobs``, keeping the cost order of the answer.
    ``prior``: study folders whose runs count as already done (not retrained; their
    failures prune the search).
    """
    for name, value in (("epochs", epochs), ("batch_size", batch_size), ("jobs", jobs)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: must be a whole number >= 1")
    if subset is not None and (not isinstance(subset, int) or subset < 1):
        raise ValueError(f"subset={subset!r}: must be None (all images) or a whole number >= 1")
    if search_epochs is not None and (not isinstance(search_epochs, int) or search_epochs < 1):
        raise ValueError(f"search_epochs={search_epochs!r}: must be None (= epochs) or a whole number >= 1")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda asked for, but torch sees no CUDA device")
    _set_determinism(dev)
    if search is None:
        search = configs is None
    names = list(configs) if configs is not None else [BASELINE, *TABLE1, *TABLE2]
    parsed = [parse_config(n) for n in names]
    data = load_data(subset, dev)
    meta = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else _cpu_name(),
            "torch": torch.__version__, "train_images": int(data[0].shape[0]), "test_images": int(data[2].shape[0]),
            "seed": seed, "batch_size": batch_size, "model": "FashionCNN (PyTorch MNIST example)",
            "optimizer": "Adadelta lr 1.0, StepLR gamma 0.7", "block_size": BLOCK_SIZE, "scale_bits": SCALE_BITS,
            "round": "nearest"}
    out = Path(out)
    common = {"device": device, "seed": seed, "batch_size": batch_size, "subset": subset,
              "threads": max(1, (os.cpu_count() or 2) // max(1, jobs)) if jobs > 1 else torch.get_num_threads()}
    if jobs > 1:
        data = None  # each process loads its own copy
    results: dict[str, RunResult] = {}
    for folder in prior:
        for r in json.loads((Path(folder) / "runs.json").read_text())["runs"]:
            results[r["config"].removeprefix("search:")] = RunResult(**r)
    parsed = [c for c in parsed if len(results.get(c.name, RunResult("", None, None, None, {})).accuracy) < epochs]
    state = {"search": None, "files": []}

    def write(res=None):
        state["files"] = _write(out, {**results, **(res or {})}, epochs, state["search"], meta)

    results.update(_train_many(parsed, epochs, data, common, jobs, out / "jobs", log, progress, write))
    write()
    if search:
        search_epochs = search_epochs or epochs
        info = state["search"] = {"target": target, "epochs": search_epochs, "tried": [], "best": None}
        failed: list[StudyConfig] = []
        for name, r in results.items():  # what is already known prunes the search
            if len(r.accuracy) >= search_epochs and r.accuracy[search_epochs - 1] < target:
                failed.append(parse_config(name))
        runs = 0
        remaining = search_candidates()
        while remaining and info["best"] is None and runs < search_max_runs:
            wave = []
            for cand in list(remaining):
                if len(wave) >= max(1, jobs) or runs + len(wave) >= search_max_runs:
                    break
                remaining.remove(cand)
                if _dominated(cand, failed) is None:
                    wave.append(cand)
            todo = [c for c in wave if len(results.get(c.name, RunResult("", None, None, None, {})).accuracy)
                    < search_epochs]
            trained = _train_many(todo, search_epochs, data, common, jobs, out / "jobs", log, progress,
                                  lambda res: write({f"search:{k}": v for k, v in res.items()}))
            runs += len(todo)
            for k, v in trained.items():
                results[f"search:{k}"] = v
            for cand in wave:  # in cost order: the first success is the answer
                r = trained.get(cand.name) or results.get(cand.name)
                if r is None or len(r.accuracy) < search_epochs:
                    continue
                acc = r.accuracy[search_epochs - 1]
                ok = acc >= target
                info["tried"].append({"config": cand.name, "bits": cand.bits["total"], "accuracy": round(acc, 2),
                                      "outcome": "reaches target" if ok else "below target"})
                log(f"search: {cand.name} ({cand.bits['total']:g} bits): {acc:.2f}% -> {'OK' if ok else 'below'}")
                if ok:
                    info["best"] = {"config": cand.name, "bits": cand.bits["total"], "detail": cand.bits,
                                    "accuracy": acc}
                    break
                failed.append(cand)
            write()
    write()
    return {"results": results, "search": state["search"], "out": str(out), "meta": meta, "files": state["files"]}


def merge_studies(folders, out) -> Path:
    """Combine the runs of several study folders (e.g. from separate machines) into one set of files."""
    results, meta, epochs = {}, None, 0
    for folder in folders:
        data = json.loads((Path(folder) / "runs.json").read_text())
        meta = meta or data["meta"]
        epochs = max(epochs, data["epochs"])
        for r in data["runs"]:
            results[r["config"]] = RunResult(**r)
    out = Path(out)
    _write(out, results, epochs, None, meta)
    return out


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"
    except OSError:
        pass
    import platform
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The study's options (shared with ``mxtrain study fashion-mnist``, see :mod:`mxtrain.cli`)."""
    p = parser or argparse.ArgumentParser(prog="python examples/fashion_mnist_study.py",
                                          description=STUDY_DESCRIPTION, formatter_class=HelpFormatter)
    return add_study_arguments(p)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return run_from_args(args)


def run_from_args(args) -> int:
    """Run the study (or ``--merge``) as the parsed options say; the files written are listed at the end."""
    resolve_study_args(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.merge:
        out = merge_studies(args.merge, args.out)
        print((out / "tables.md").read_text())
        return 0
    configs = [c for c in args.configs.split(",") if c.strip()] if args.configs is not None else None
    if configs == [] and not args.search_only:
        print("error: --configs names no configuration; give e.g. --configs fp32+fp32,int8+bfloat16", file=sys.stderr)
        return 2
    if args.search_only:
        configs, args.search = [], True
    check_writable_dir(args.out, "--out")
    try:
        if configs:
            for c in configs:
                parse_config(c)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    res = run_study(configs, epochs=args.epochs, subset=args.subset, out=args.out, device=args.device, seed=args.seed,
                    batch_size=args.batch_size, search=args.search, search_epochs=args.search_epochs,
                    target=args.target, search_max_runs=args.search_max_runs, jobs=args.jobs, prior=args.prior,
                    progress=not args.quiet)
    print(Path(res["out"], "tables.md").read_text())
    print(f"wrote {', '.join(res['files'])} in {res['out']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
