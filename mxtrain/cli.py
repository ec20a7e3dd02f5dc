"""The ``mxtrain`` command line, and the argument checks it shares with the example scripts.

    mxtrain --version
    mxtrain study fashion-mnist --quick              # a couple of minutes on a CPU
    mxtrain study fashion-mnist [--epochs 10] [--subset N] [--configs A,B] [--out DIR] [--device cpu|cuda]

``mxtrain study fashion-mnist --help`` lists every option. The study itself is an application,
``examples/fashion_mnist_study.py`` of the source checkout (also runnable as
``python examples/fashion_mnist_study.py``); the command loads it from the checkout this file lies in,
so it needs a clone (installed with ``pip install -e`` or not), not a wheel.

This module imports only the standard library: ``mxtrain --help`` and ``--version``
answer without loading torch (the ``mxtrain`` command enters through the top-level
``mxtrain_cli`` shim, which loads this file without the package's ``__init__``).
A command imports its module (and torch) when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import re
import sys
import tempfile
import time

__all__ = ["main", "build_parser", "version", "HelpFormatter", "bounded_int", "bounded_float", "positive_int",
           "nonnegative_int", "positive_float", "nonnegative_float", "split_recipe_specs", "check_writable_dir",
           "new_run_dir", "clamp_warmup", "run_label", "save_results", "add_study_arguments", "STUDY_QUICK",
           "load_example"]


def version() -> str:
    """The version of the mxtrain package this file belongs to (read from its ``__init__.py``, not imported)."""
    try:
        text = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "__init__.py")).read()
        found = re.search(r'^__version__\s*=\s*["\']([^"\']+)["\']', text, re.M)
        if found:
            return found.group(1)
    except OSError:
        pass
    from importlib.metadata import PackageNotFoundError, version as dist_version
    try:
        return dist_version("mxtrain")
    except PackageNotFoundError:
        return "unknown"


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the description's line breaks and appends each option's default (unless None, False or empty)."""

    def _get_help_string(self, action):
        if action.default in (None, False, (), []) or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


# ------------------------------------------------------------------------------------------ argument types

def _describe(lo, hi, lo_open=False, hi_open=False) -> str:
    if hi is None:
        return f"{'>' if lo_open else '>='} {lo:g}"
    return f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"


def bounded_int(lo: int, hi: int | None = None):
    """An argparse ``type``: a whole number in ``[lo, hi]``; the error says what is allowed."""
    allowed = f"a whole number {_describe(lo, hi)}"

    def parse(text: str) -> int:
        try:
            value = int(text, 0) if text.strip().lower().startswith("0x") else int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; allowed: {allowed}") from None
        if value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"{value} is not allowed; allowed: {allowed}")
        return value

    parse.__name__ = allowed
    return parse


def bounded_float(lo: float, hi: float | None = None, lo_open: bool = False, hi_open: bool = False):
    """An argparse ``type``: a finite number in the given range (open or closed ends)."""
    allowed = f"a number {_describe(lo, hi, lo_open, hi_open)}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number; allowed: {allowed}") from None
        bad = (not math.isfinite(value) or value < lo or (lo_open and value == lo)
               or (hi is not None and (value > hi or (hi_open and value == hi))))
        if bad:
            raise argparse.ArgumentTypeError(f"{text} is not allowed; allowed: {allowed}")
        return value

    parse.__name__ = allowed
    return parse


positive_int = bounded_int(1)
nonnegative_int = bounded_int(0)
positive_float = bounded_float(0.0, lo_open=True)
nonnegative_float = bounded_float(0.0)


def split_recipe_specs(values) -> list[str]:
    """Recipe specs from repeated flags, each of which may also hold several comma-separated specs.

    A recipe's own options are comma-separated too (``mxfp4:grad_rounding=stochastic,seed=0``):
    a piece holding ``=`` but no ``:`` continues the spec before it, so
    ``bf16,mxfp4:grad_rounding=stochastic,seed=0`` is two specs. Repeat the flag to be explicit.
    """
    if isinstance(values, str):
        values = [values]
    specs: list[str] = []
    for value in values or ():
        pieces = [p.strip() for p in value.split(",")]
        group: list[str] = []
        for piece in pieces:
            if not piece:
                continue
            if group and "=" in piece and ":" not in piece:
                group[-1] += "," + piece
            else:
                group.append(piece)
        specs.extend(group)
    return specs


def check_writable_dir(path: str, flag: str) -> str:
    """Create ``path`` if needed and prove a file can be written there; else exit with a message naming ``flag``."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write_check_"):
            pass
    except OSError as err:
        raise SystemExit(f"{flag} {path}: not a writable folder ({err.strerror or err}); give a folder this user "
                         "can create and write") from None
    return path


def new_run_dir(out: str | None, default_root: str) -> str:
    """``out`` if given, else ``default_root/<date>-<time>`` (a suffix keeps it new); created and checked writable."""
    if out is None:
        base = os.path.join(default_root, time.strftime("%Y%m%d-%H%M%S"))
        out, n = base, 1
        while os.path.exists(out):
            n += 1
            out = f"{base}-{n}"
    return check_writable_dir(out, "--out")


def clamp_warmup(warmup: int, steps: int, log=print) -> int:
    """Warm-up steps no longer than the run (noted when shortened); at least 1, the schedule divides by it."""
    if warmup > steps:
        log(f"note: --warmup {warmup} is longer than the {steps} steps of the run; using {steps}")
        warmup = steps
    return max(1, warmup)


def check_device(parser, text: str) -> None:
    """Refuse (through ``parser.error``) a ``--device`` torch cannot parse or that this machine lacks."""
    import torch  # only when a command runs: --help stays fast

    try:
        device = torch.device(text)
    except RuntimeError as err:
        parser.error(f"--device {text!r}: {err}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {text}: torch sees no CUDA device here; use --device cpu")


def run_label(spec: str, high_precision: bool, dtype: str) -> str:
    """What a run is called in tables and plots: the recipe spec, or for a run without MX the dtype that ran.

    ``bf16`` as a recipe only means "no MX"; under ``--dtype fp32`` that run computes in
    fp32 and is labelled so.
    """
    return dtype if high_precision else spec


def save_results(run_dir: str, payload: dict, plot=None, log=print) -> list[str]:
    """Write ``results.json`` into ``run_dir`` and, with matplotlib installed, ``plot(path)`` to ``loss.png``.

    Returns the paths written (no plot without matplotlib; a note says so).
    """
    import json
    path = os.path.join(run_dir, "results.json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=str)
    written = [path]
    if plot is not None:
        try:
            import matplotlib
        except ImportError:
            log("matplotlib is not installed (pip install 'mxtrain[plot]'): no loss.png written")
        else:
            matplotlib.use("Agg")
            png = os.path.join(run_dir, "loss.png")
            plot(png)
            written.append(png)
    return written


# -------------------------------------------------------------------------------------------- the study

# What ``--quick`` runs: the fp32 baseline against two MX formats, a small subset, no search.
STUDY_QUICK = {"epochs": 2, "subset": 2000, "configs": "fp32+fp32,fp8_e4m3+bfloat16,int2+bfloat16", "search": False}
STUDY_DEFAULTS = {"epochs": 10, "subset": None, "configs": None}

STUDY_DESCRIPTION = """\
Which MX matmul and elementwise formats keep a Fashion-MNIST classifier accurate?

How long it takes: the default (fp32 baseline + the 9 configurations of the two
tables, 10 epochs each on all 60000 images, then a search of up to 12 more runs)
takes about 10 hours on a 2-core CPU for the tables alone (about 6 minutes per
configuration and epoch), and as long again for the search. On a GPU use
--device cuda --jobs 10 (4 configurations x 10 epochs took 4 minutes on an H100).
--quick (3 configurations, 2 epochs, 2000 images, no search) takes about 5
minutes on a 2-core CPU (290 s of CPU time).
"""


def add_study_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``mxtrain study fashion-mnist`` (also ``python examples/fashion_mnist_study.py``)."""
    q = STUDY_QUICK
    p.add_argument("--quick", action="store_true",
                   help=f"a 5-minute CPU run: --configs {q['configs']} --epochs {q['epochs']} "
                        f"--subset {q['subset']} --no-search (options given explicitly win)")
    p.add_argument("--epochs", type=positive_int, default=None,
                   help=f"epochs per configuration (default: {STUDY_DEFAULTS['epochs']}; --quick: {q['epochs']})")
    p.add_argument("--subset", type=bounded_int(1, 60000), default=None,
                   help=f"use only the first N training and N test images (default: all 60000 / 10000; "
                        f"--quick: {q['subset']})")
    p.add_argument("--configs", type=str, default=None,
                   help="comma-separated configurations, e.g. 'fp32+fp32,int8+bfloat16,int4/fp6_e2m3+fp10' "
                        "(default: fp32+fp32 and the two tables' 9 configurations)")
    p.add_argument("--out", type=str, default="runs/fashion_mnist", help="output folder")
    p.add_argument("--device", type=str, choices=["cpu", "cuda"], default="cpu", help="where to train")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the initialization and data order")
    p.add_argument("--batch-size", type=positive_int, default=64, help="training images per step")
    p.add_argument("--search", dest="search", action="store_true", default=None,
                   help="search the fewest bits keeping --target accuracy (default: on without --configs)")
    p.add_argument("--no-search", dest="search", action="store_false", help="no search after the tables")
    p.add_argument("--search-only", action="store_true", help="skip the tables, only search")
    p.add_argument("--search-epochs", type=positive_int, default=None,
                   help="epochs per search run (default: --epochs)")
    p.add_argument("--search-max-runs", type=positive_int, default=12, help="most search runs to train")
    p.add_argument("--target", type=bounded_float(0.0, 100.0, lo_open=True), default=90.0,
                   help="test accuracy (%%) the search must keep")
    p.add_argument("--jobs", type=positive_int, default=1,
                   help="configurations trained at once, one process each")
    p.add_argument("--merge", nargs="+", default=None, metavar="DIR",
                   help="only combine the runs.json of these study folders into --out (tables and plot)")
    p.add_argument("--prior", nargs="+", default=(), metavar="DIR",
                   help="study folders whose runs count as done (not retrained; their failures prune the search)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def resolve_study_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the options left unset from ``--quick`` or the full study's defaults."""
    preset = STUDY_QUICK if getattr(args, "quick", False) else STUDY_DEFAULTS
    for key in ("epochs", "subset", "configs"):
        if getattr(args, key) is None:
            setattr(args, key, preset[key])
    if args.search is None and "search" in preset:
        args.search = preset["search"]
    return args


# ------------------------------------------------------------------------------------------ the command

def build_parser() -> argparse.ArgumentParser:
    """The ``mxtrain`` parser; commands name their runner as ``"module:function"`` or ``"examples/file.py:function"``
    (imported when run)."""
    parser = argparse.ArgumentParser(prog="mxtrain", description="mxtrain: MX-format training and format studies",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"mxtrain {version()}")
    commands = parser.add_subparsers(dest="command", metavar="command")
    study = commands.add_parser("study", help="format studies (accuracy of a model per number format)",
                                description="Format studies: the accuracy of a model per number format.",
                                formatter_class=HelpFormatter)
    studies = study.add_subparsers(dest="study", metavar="study")
    fm = studies.add_parser("fashion-mnist", help="a Fashion-MNIST classifier over MX / elementwise formats "
                            "(about 10 hours on a CPU by default; --quick: minutes)",
                            description=STUDY_DESCRIPTION, formatter_class=HelpFormatter)
    add_study_arguments(fm)
    fm.set_defaults(run="examples/fashion_mnist_study.py:run_from_args")
    return parser


def load_example(relpath: str):
    """Import ``relpath`` (``examples/<name>.py``) of the source checkout holding this package.

    Applications live outside the package; a wheel install has no ``examples/``, and the error says so.
    """
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), relpath)
    if not os.path.isfile(path):
        raise SystemExit(f"mxtrain: {relpath} is not beside this mxtrain package ({path} is missing); the studies "
                         "live in the source checkout: clone the repository and run the command there (pip install "
                         f"-e . keeps it working from anywhere), or run python {relpath} in the clone")
    name = os.path.splitext(os.path.basename(path))[0]
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == path:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file runs
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def main(argv=None) -> int:
    """Run a command; without one print the help to stderr and return 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    run = getattr(args, "run", None)
    if run is None:
        import contextlib
        with contextlib.redirect_stdout(sys.stderr):
            try:
                parser.parse_args([args.command, "--help"] if args.command else ["--help"])
            except SystemExit:
                pass
        print("\nerror: name a " + ("study" if args.command else "command"), file=sys.stderr)
        return 2
    module, _, func = run.partition(":")
    loaded = load_example(module) if module.endswith(".py") else importlib.import_module(module)
    return getattr(loaded, func)(args)


if __name__ == "__main__":
    sys.exit(main())
