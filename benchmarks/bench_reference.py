#!/usr/bin/env python
"""Time mxtrain's reference MX quantizer against microxcaling's CPU path.

Both sides quantize and then dequantize the same fp32 matrix (default
4096x4096, ``torch.randn``, seed 0) in blocks of 32 along the last axis:

* microxcaling (https://github.com/microsoft/microxcaling), pure-PyTorch path::

      mx.mx_ops.quantize_mx_op(x, specs, elem_format=fmt, block_size=32,
                               axes=[-1], round=R)

  with ``specs = mx.specs.MxSpecs(scale_bits=8, custom_cuda=False,
  shared_exp_method="max", mx_flush_fp32_subnorms=False)``; this is
  ``mx.mx_ops._quantize_mx(x, 8, fmt, "max", axes=[-1], block_size=32,
  round=R, flush_fp32_subnorms=False, custom_cuda=False)``.  It returns the
  dequantized fp32 tensor directly.
* mxtrain::

      quantize_mx(x, fmt, block_size=32, axis=-1, scale_mode="floor",
                  rounding=R).dequantize(torch.float32)

  and, if it exists, the fused ``fake_quantize_mx`` with the same arguments.

It prints the median (and min) time per call after warm-up, the fraction of
elements on which the results are equal (``==``, so -0.0 == +0.0; NaN == NaN
counts as equal), and how many elements each side gets wrong against an
independent exact float64 reference (``exact_reference``), then a markdown
table.  ``--stress`` repeats the correctness check (untimed) on an adversarial
input built to hit microxcaling's float ``log2`` and ``floor(t + 0.5)``;
``--count-ops`` counts the aten ops (memory passes) of one call.
``--no-huge-pages`` turns off mxtrain's transparent-huge-page advice for its large
CPU outputs (a fresh 64 MiB output otherwise costs a page fault per 4 KiB, which on
a virtual machine can take longer than the quantization).  ``--record``
appends the table with the machine, date and torch version to
``benchmarks/RESULTS.md`` (append only).

``--background-load [N]`` times the CPU quantizer with N busy processes
(``python3 -c "while True: pass"``, default 1) running beside it, as on a user's
machine that is rarely idle: each implementation with torch's default thread
count and with one thread, and mxtrain also with its chunk workers turned off
(``mxtrain.quantization._workers.ENABLED = False``: every op of every chunk an
OpenMP team of its own, as before 2026-11-25). The variants alternate call by
call, so that the load of other processes on the machine falls on all of them
alike; it reports median, min and max.

microxcaling is never vendored: point ``--microxcaling`` at a checkout (e.g.
``third_party/microxcaling``, which is git-ignored).  It is imported from that
path at run time; its C++/CUDA extension module is replaced by a stub so that
nothing is JIT-compiled (it is only used when ``custom_cuda=True``).  Without
a checkout only mxtrain's timings are shown.

Example::

    git clone https://github.com/microsoft/microxcaling third_party/microxcaling
    python benchmarks/bench_reference.py --microxcaling third_party/microxcaling --stress
    python benchmarks/bench_reference.py --microxcaling third_party/microxcaling \
        --background-load --formats fp8_e4m3 --roundings nearest --repeats 9
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import types

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_MD = os.path.join(REPO_ROOT, "benchmarks", "RESULTS.md")
BLOCK_SIZE = 32


# ---------------------------------------------------------------------------
# microxcaling loading
# ---------------------------------------------------------------------------
class _DisabledExtension:
    """Stands in for ``mx.custom_extensions`` (a JIT-compiled C++/CUDA module)."""

    def __getattr__(self, name):
        raise RuntimeError(
            "microxcaling's custom C++/CUDA extension is disabled in this benchmark "
            f"(attribute {name!r} requested); the pure-PyTorch path "
            "(custom_cuda=False) should never need it")


def load_microxcaling(path: str):
    """Import microxcaling's ``mx`` package from a checkout at ``path``.

    Returns ``(quantize_fn, info)`` where ``quantize_fn(x, fmt, rounding)``
    returns the quantize-dequantized fp32 tensor.
    """
    path = os.path.abspath(path)
    pkg_dir = os.path.join(path, "mx")
    if not os.path.isfile(os.path.join(pkg_dir, "mx_ops.py")):
        raise FileNotFoundError(f"{path} does not look like a microxcaling checkout "
                                "(no mx/mx_ops.py)")
    for name in [m for m in sys.modules if m == "mx" or m.startswith("mx.")]:
        del sys.modules[name]
    sys.path.insert(0, path)

    # Never let microxcaling JIT-compile its extension (torch.utils.cpp_extension.load).
    stub = types.ModuleType("mx.custom_extensions")
    stub.funcs = _DisabledExtension()

    note = ""
    try:
        sys.modules["mx.custom_extensions"] = stub
        mx = importlib.import_module("mx")  # full package: layers, specs, ...
    except Exception as exc:  # pragma: no cover - shim for future torch breakage
        # Fall back to a bare package object so that only the four modules we
        # need are imported (mx/__init__.py pulls in every layer type).
        for name in [m for m in sys.modules if m == "mx" or m.startswith("mx.")]:
            del sys.modules[name]
        mx = types.ModuleType("mx")
        mx.__path__ = [pkg_dir]
        mx.__file__ = os.path.join(pkg_dir, "__init__.py")
        sys.modules["mx"] = mx
        sys.modules["mx.custom_extensions"] = stub
        note = f"full `import mx` failed ({type(exc).__name__}: {exc}); imported mx.mx_ops alone"
    mx_ops = importlib.import_module("mx.mx_ops")
    mx_specs_mod = importlib.import_module("mx.specs")
    if not os.path.abspath(mx_ops.__file__).startswith(pkg_dir):
        raise ImportError(f"imported mx.mx_ops from {mx_ops.__file__}, not from {pkg_dir}")

    specs = mx_specs_mod.MxSpecs()
    specs["scale_bits"] = 8               # E8M0 scale
    specs["block_size"] = BLOCK_SIZE
    specs["shared_exp_method"] = "max"    # floor(log2(amax)) - emax_elem
    specs["mx_flush_fp32_subnorms"] = False
    specs["custom_cuda"] = False          # pure-PyTorch CPU path

    def quantize_fn(x, fmt, rounding):
        return mx_ops.quantize_mx_op(x, specs, elem_format=fmt, block_size=BLOCK_SIZE,
                                     axes=[-1], round=rounding)

    info = {"path": path, "commit": _git_rev(path), "note": note}
    return quantize_fn, info


# ---------------------------------------------------------------------------
# mxtrain loading
# ---------------------------------------------------------------------------
def load_mxtrain():
    """Returns ``(qdq_fn or None, fake_fn or None, note)``."""
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)
    try:
        quantization = importlib.import_module("mxtrain.quantization")
    except Exception as exc:
        return None, None, f"cannot import mxtrain.quantization ({type(exc).__name__}: {exc})"
    qmx = getattr(quantization, "quantize_mx", None)
    fqmx = getattr(quantization, "fake_quantize_mx", None)
    notes = []
    qdq_fn = fake_fn = None
    if qmx is None:
        notes.append("mxtrain.quantization has no quantize_mx yet")
    else:
        def qdq_fn(x, fmt, rounding):
            return qmx(x, fmt, block_size=BLOCK_SIZE, axis=-1, scale_mode="floor",
                       rounding=rounding).dequantize(torch.float32)
    if fqmx is None:
        notes.append("mxtrain.quantization has no fake_quantize_mx")
    else:
        def fake_fn(x, fmt, rounding):
            return fqmx(x, fmt, block_size=BLOCK_SIZE, axis=-1, scale_mode="floor",
                        rounding=rounding)
    return qdq_fn, fake_fn, "; ".join(notes)


# ---------------------------------------------------------------------------
# independent exact reference (float64) and adversarial input, for arbitration
# ---------------------------------------------------------------------------
# (ebits, mbits, emax, max_norm) of the OCP MX element formats
ELEM_FORMATS = {
    "fp8_e4m3": (4, 3, 8, 448.0),
    "fp8_e5m2": (5, 2, 15, 57344.0),
    "fp6_e3m2": (3, 2, 4, 28.0),
    "fp6_e2m3": (2, 3, 2, 7.5),
    "fp4_e2m1": (2, 1, 2, 6.0),
}


def exact_reference(x, fmt, rounding, block=BLOCK_SIZE):
    """OCP MX quantize-dequantize along the last axis, computed exactly in float64.

    Shared exponent floor(log2(amax)) from frexp (no float log2), E8M0 scale
    clamped to [-127, 127] (NaN above), elements rounded on their own grid
    (subnormals included) and saturated to max_norm.  ``rounding``:
    ``nearest`` = ties away from zero, ``even`` = ties to even, ``floor`` =
    toward zero (microxcaling's and mxtrain's meanings).  Finite inputs only
    (a block with Inf/NaN becomes all NaN).
    """
    ebits, mbits, emax, max_norm = ELEM_FORMATS[fmt]
    emin = 2 - 2 ** (ebits - 1)
    xb = x.to(torch.float64).reshape(*x.shape[:-1], -1, block)
    amax = xb.abs().amax(-1, keepdim=True)
    s = (torch.frexp(amax).exponent - 1 - emax).clamp(min=-127)
    y = torch.ldexp(xb, -s)                                  # exact
    a = y.abs()
    p = (torch.frexp(a).exponent - 1).clamp(min=emin)
    t = torch.ldexp(a, mbits - p)                            # exact, < 2**(mbits+1)
    if rounding == "even":
        q = torch.round(t)
    elif rounding == "nearest":
        q = torch.floor(t + 0.5)                             # exact in float64 here
    elif rounding == "floor":
        q = torch.floor(t)
    else:
        raise ValueError(f"no exact reference for rounding {rounding!r}")
    v = torch.ldexp(q, p - mbits).clamp(max=max_norm)
    out = torch.ldexp(torch.copysign(v, y), s)
    out = torch.where(torch.isfinite(amax) & (s <= 127), out, torch.full_like(out, float("nan")))
    return out.reshape(x.shape).to(torch.float32)


STRESS_KINDS = ("randn", "amax just below 2^k", "exact ties", "t = 0.5 - 2^-25")


def make_stress(size, fmt, seed, block=BLOCK_SIZE):
    """fp32 ``size x size`` input whose blocks (chosen at random) are one of:

    0. plain randn;
    1. amax = 2^k (1 - 2^-24), k in [3, 40]: float32 log2 rounds it up to k,
       so a float-log2 shared exponent is one too large;
    2. amax = 1.96875 * 2^k and the other elements exactly halfway between two
       neighbouring element-grid points (normal and subnormal), so
       ties-away and ties-to-even differ;
    3. amax = 1.5 * 2^k and half of the elements at (0.5 - 2^-25) of the
       smallest subnormal step: ``floor(t + 0.5)`` in fp32 rounds 0.5 - 2^-25
       up to 1 (double rounding), the exact result is 0.

    Returns ``(x, kind)`` with ``kind`` the per-block category, shape
    ``[size, size // block]``.
    """
    ebits, mbits, emax, _ = ELEM_FORMATS[fmt]
    emin = 2 - 2 ** (ebits - 1)
    g = torch.Generator().manual_seed(seed + 1)
    nb = size // block
    shape = (size, nb, block)
    xb = torch.randn(shape, generator=g, dtype=torch.float64)
    kind = torch.randint(0, 4, (size, nb), generator=g)
    sign = torch.randint(0, 2, shape, generator=g).to(torch.float64) * 2 - 1
    k = torch.randint(-20, 21, (size, nb, 1), generator=g).to(torch.float64)
    X = torch.exp2(k - emax)                                    # the exact block scale

    # 1: amax just below a power of two
    k1 = torch.randint(3, 41, (size, nb, 1), generator=g).to(torch.float64)
    amax1 = torch.exp2(k1) * (1 - 2.0 ** -24)
    b1 = (xb * torch.exp2(k1 - 3)).clamp(-0.9 * amax1, 0.9 * amax1)
    b1[..., :1] = amax1
    # 2: ties on the element grid
    e = torch.randint(emin, emax + 1, shape, generator=g).to(torch.float64)
    j = torch.randint(0, 2 ** mbits, shape, generator=g).to(torch.float64)
    normal_tie = torch.exp2(e) * (1 + (2 * j + 1) / 2 ** (mbits + 1))
    sub_tie = 2.0 ** emin * (2 * j + 1) / 2 ** (mbits + 1)
    use_sub = torch.rand(shape, generator=g) < 0.25
    b2 = X * torch.where(use_sub, sub_tie, normal_tie)
    b2[..., :1] = X * 2.0 ** emax * 1.96875
    # 3: just under half of the smallest subnormal step
    tiny = X * 2.0 ** (emin - mbits - 1) * (1 - 2.0 ** -24)
    b3 = torch.where(torch.rand(shape, generator=g) < 0.5, tiny.expand(shape),
                     (xb * X * 2.0 ** (emax - 2)).clamp(-X * 2.0 ** emax, X * 2.0 ** emax))
    b3[..., :1] = X * 2.0 ** emax * 1.5

    kk = kind.unsqueeze(-1)
    out = torch.where(kk == 1, b1, torch.where(kk == 2, b2, torch.where(kk == 3, b3, xb)))
    out = out * sign
    x = out.to(torch.float32)
    # the constructed values must be exact in fp32 (random fill aside)
    special = (kk > 0) & ((kk != 1) | (torch.arange(block) == 0)) & ((kk != 3) | (out.abs() == tiny.abs()))
    assert torch.equal(x.to(torch.float64)[special], out[special]), "stress values not exact in fp32"
    return x.reshape(size, size), kind


def stress_report(x, kind, fmt, rnd, impls, block=BLOCK_SIZE):
    """Per stress category: elements where each implementation differs from the exact reference."""
    exact = exact_reference(x, fmt, rnd)
    kind_el = kind.unsqueeze(-1).expand(*kind.shape, block).reshape(x.shape)
    lines = [f"  stress input, {fmt}, rounding={rnd}: elements differing from the exact float64 reference"]
    header = f"    {'block kind':<22}{'elements':>10}" + "".join(f"{name:>32}" for name, _ in impls)
    lines.append(header)
    results = {}
    for name, out in impls:
        same = (out == exact) | (torch.isnan(out) & torch.isnan(exact))
        results[name] = ~same
    for c, label in enumerate(STRESS_KINDS):
        m = kind_el == c
        cells = "".join(f"{int((results[name] & m).sum()):>32}" for name, _ in impls)
        lines.append(f"    {label:<22}{int(m.sum()):>10}{cells}")
    return lines


def count_passes(fn, n=256, block=BLOCK_SIZE):
    """Non-view aten ops in one ``fn(x)`` call on an n x n fp32 input: (full, partial, tiny).

    "full" ops read or write a tensor with as many elements as the input (one
    memory pass each); "partial" ones touch at least n*n/block elements (per-block
    scales, packed sub-byte codes); "tiny" the rest.
    """
    from torch.utils._python_dispatch import TorchDispatchMode  # private but long-stable
    from torch.utils._pytree import tree_leaves

    counts = {"full": 0, "partial": 0, "tiny": 0}

    class _Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not getattr(func, "is_view", False):
                sizes = [t.numel() for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
                m = max(sizes, default=0)
                counts["full" if m >= n * n else "partial" if m >= n * n // block else "tiny"] += 1
            return out

    x = torch.randn(n, n, generator=torch.Generator().manual_seed(0))
    with _Count():
        fn(x)
    return counts["full"], counts["partial"], counts["tiny"]


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------
def _git_rev(path):
    try:
        out = subprocess.run(["git", "-C", path, "rev-parse", "--short=12", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except Exception:
        return None


def time_fn(fn, repeats, warmup):
    """Median / min / max wall time in ms; also returns the last output."""
    out = None
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times), max(times), out


def agreement(a, b, block=BLOCK_SIZE):
    """(fraction of equal elements, #differing elements, #differing blocks, max |a-b|)."""
    a = a.to(torch.float32)
    b = b.to(torch.float32)
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    n = same.numel()
    ndiff = int(n - same.sum())
    nblk = 0
    maxdiff = 0.0
    if ndiff:
        diff = ~same
        if diff.shape[-1] % block == 0:
            nblk = int(diff.reshape(*diff.shape[:-1], -1, block).any(-1).sum())
        d = (a - b).abs()[diff & ~(torch.isnan(a) | torch.isnan(b))]
        maxdiff = float(d.max()) if d.numel() else float("nan")
    return 1.0 - ndiff / n, ndiff, nblk, maxdiff


def fmt_agree(res):
    if res is None:
        return "n/a"
    frac, ndiff, _, _ = res
    if ndiff == 0:
        return "1 (all equal)"
    return f"{frac:.9f} ({ndiff} differ)"


def describe_diffs(x, ref, out, limit=5):
    """A few differing elements with the block's amax, for the console."""
    same = (ref == out) | (torch.isnan(ref) & torch.isnan(out))
    idx = (~same).nonzero()[:limit]
    lines = []
    for r, c in idx.tolist():
        b0 = (c // BLOCK_SIZE) * BLOCK_SIZE
        amax = float(x[r, b0:b0 + BLOCK_SIZE].abs().max())
        lines.append(f"      x[{r},{c}]={float(x[r, c]):.9g} (block amax {amax:.9g}): "
                     f"microxcaling {float(ref[r, c]):.9g}, mxtrain {float(out[r, c]):.9g}")
    return lines


def huge_page_note(disable=False):
    """Whether mxtrain's large CPU outputs are advised to use transparent huge pages (and the kernel's THP mode)."""
    try:
        memory = importlib.import_module("mxtrain.quantization._memory")
    except Exception:
        return ""
    if disable:
        memory.ENABLED = False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read().strip()
    except OSError:
        mode = "n/a"
    used = memory.ENABLED and bool(memory._resolve())
    return (f"mxtrain outputs of >= {memory.MIN_BYTES >> 20} MiB advised to use huge pages: "
            f"{'yes' if used else 'no'} (THP mode: {mode}; microxcaling allocates plainly)")


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def loadavg():
    try:
        return "%.2f %.2f %.2f" % os.getloadavg()
    except OSError:
        return "n/a"


def fmt_exact(d):
    return " / ".join(str(d[k]) if k in d else "n/a" for k in ("microxcaling", "qdq", "fake"))


def ms(v, lo=None):
    if v is None:
        return "n/a"
    return f"{v:.1f}" if lo is None else f"{v:.1f} ({lo:.1f})"


def speedup(ref, v):
    return "n/a" if (ref is None or v is None or v <= 0) else f"{ref / v:.2f}x"


def make_table(rows):
    head = ("| format | rounding | microxcaling ms | mxtrain quantize_mx+dequantize ms | speedup "
            "| mxtrain fake_quantize_mx ms | speedup | agreement (quantize_mx vs microxcaling) "
            "| agreement (fake_quantize_mx vs microxcaling) "
            "| elements != exact ref (microxcaling / quantize_mx / fake_quantize_mx) |")
    sep = "|" + "---|" * 10
    lines = [head, sep]
    for r in rows:
        lines.append(
            f"| {r['fmt']} | {r['rounding']} | {ms(r['mx_ms'], r.get('mx_min'))} "
            f"| {ms(r['qdq_ms'], r.get('qdq_min'))} "
            f"| {speedup(r['mx_ms'], r['qdq_ms'])} | {ms(r['fake_ms'], r.get('fake_min'))} "
            f"| {speedup(r['mx_ms'], r['fake_ms'])} | {fmt_agree(r['agree_qdq'])} "
            f"| {fmt_agree(r['agree_fake'])} | {fmt_exact(r['exact'])} |")
    return "\n".join(lines)


def record(table, args, mx_info, notes, stress_lines, load_start):
    now = datetime.datetime.now().astimezone()
    new_file = not os.path.exists(RESULTS_MD)
    with open(RESULTS_MD, "a") as f:  # append only
        if new_file:
            f.write("# Benchmark results\n\n"
                    "Append-only log written by the benchmark scripts' `--record` flag. "
                    "Times are wall-clock ms per call, median (min).\n")
        f.write(f"\n## bench_reference.py — {now.strftime('%Y-%m-%d %H:%M %Z')}\n\n")
        f.write(f"- device: {cpu_model()}, {os.cpu_count()} cores, "
                f"{torch.get_num_threads()} torch threads; load average (1/5/15 min) at start "
                f"{load_start}, at end {loadavg()} (other processes on the machine inflate medians)\n")
        f.write(f"- torch {torch.__version__}, Python {platform.python_version()}\n")
        f.write(f"- input: fp32 {args.size}x{args.size} randn (seed {args.seed}), block {BLOCK_SIZE} "
                f"along the last axis; median of {args.repeats} after {args.warmup} warm-up\n")
        if mx_info:
            f.write(f"- microxcaling {mx_info['commit'] or '(unknown commit)'}: "
                    "`mx.mx_ops.quantize_mx_op(x, specs, elem_format=fmt, block_size=32, "
                    "axes=[-1], round=R)`, scale_bits=8, custom_cuda=False\n")
        f.write(f"- mxtrain: `quantize_mx(x, fmt, block_size=32, axis=-1, scale_mode=\"floor\", "
                f"rounding=R).dequantize(torch.float32)`; repo commit "
                f"{_git_rev(REPO_ROOT) or '(none)'} plus working-tree changes\n")
        for n in notes:
            f.write(f"- note: {n}\n")
        f.write("\n" + table + "\n")
        if stress_lines:
            f.write("\nStress input (`--stress`), elements differing from the exact float64 "
                    "reference:\n\n```\n" + "\n".join(l[2:] for l in stress_lines) + "\n```\n")
    print(f"\nappended to {os.path.relpath(RESULTS_MD, os.getcwd())}")


# ---------------------------------------------------------------------------
# --background-load: default threads against one thread, with busy processes beside
# ---------------------------------------------------------------------------
BUSY_LOOP = "while True: pass"


def start_background_load(n):
    """``n`` busy Python processes; stop them with :func:`stop_background_load`."""
    return [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(n)]


def stop_background_load(procs):
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def _mxtrain_workers():
    try:
        return importlib.import_module("mxtrain.quantization._workers")
    except ImportError:  # a tree from before the chunk workers
        return None


def time_alternating(variants, repeats, warmup):
    """Times of each ``(fn, threads, workers)`` variant, called in turn so that outside load hits all alike.

    Each round calls the variants in its own shuffled order (seeded by the round): a call can be
    slowed by the one before it (benchmarks/RESULTS.md, 2026-11-26), and a fixed cycle would give
    every variant the same predecessor in every round.

    Returns ``{name: (median, min, max) ms}`` and ``{name: last output}``.
    """
    workers = _mxtrain_workers()
    default_threads = torch.get_num_threads()
    times = {name: [] for name in variants}
    outs = {}

    def call(name):
        fn, threads, use_workers = variants[name]
        torch.set_num_threads(threads)
        if workers is not None:
            workers.ENABLED = use_workers
        t0 = time.perf_counter()
        out = fn()
        return (time.perf_counter() - t0) * 1e3, out

    try:
        for _ in range(warmup):
            for name in variants:
                call(name)
        for i in range(repeats):
            names = list(variants)
            random.Random(i).shuffle(names)
            for name in names:
                t, outs[name] = call(name)
                times[name].append(t)
    finally:
        torch.set_num_threads(default_threads)
        if workers is not None:
            workers.ENABLED = True
    return {k: (statistics.median(v), min(v), max(v)) for k, v in times.items()}, outs


def background_load_run(args, x, mx_fn, qdq_fn):
    """Rows for the ``--background-load`` table: every format and rounding, every variant."""
    threads = torch.get_num_threads()
    has_workers = _mxtrain_workers() is not None
    rows = []
    procs = start_background_load(args.background_load)
    try:
        for fmt in args.formats:
            for rnd in args.roundings:
                variants = {}
                if mx_fn is not None:
                    variants[f"microxcaling, {threads} threads"] = (lambda: mx_fn(x, fmt, rnd), threads, True)
                    variants["microxcaling, 1 thread"] = (lambda: mx_fn(x, fmt, rnd), 1, True)
                if qdq_fn is not None:
                    variants[f"mxtrain, {threads} threads"] = (lambda: qdq_fn(x, fmt, rnd), threads, True)
                    if has_workers:
                        variants[f"mxtrain, {threads} threads, workers off"] = (
                            lambda: qdq_fn(x, fmt, rnd), threads, False)
                    variants["mxtrain, 1 thread"] = (lambda: qdq_fn(x, fmt, rnd), 1, True)
                print(f"\n[{fmt}, rounding={rnd}, {args.background_load} busy process(es) beside, "
                      f"load average {loadavg()}]")
                stats, outs = time_alternating(variants, args.repeats, args.warmup)
                for name, (med, lo, hi) in stats.items():
                    print(f"  {name:<42} {med:9.1f} ms  (min {lo:.1f}, max {hi:.1f})")
                first = next(iter(outs.values()))
                same = all(bool(((o == first) | (o.isnan() & first.isnan())).all()) for o in outs.values())
                print(f"  all variants give the same values: {same}")
                rows.append(dict(fmt=fmt, rounding=rnd, stats=stats, same=same))
                del outs, first
    finally:
        stop_background_load(procs)
    return rows


def make_load_table(rows, threads):
    names = list(rows[0]["stats"]) if rows else []
    head = "| format | rounding | " + " | ".join(f"{n} ms" for n in names)
    mx_name, mxt_name = f"microxcaling, {threads} threads", f"mxtrain, {threads} threads"
    ratio = bool(rows) and mx_name in rows[0]["stats"] and mxt_name in rows[0]["stats"]
    if ratio:
        head += f" | speedup ({mx_name} / {mxt_name}, medians)"
    head += " | same values |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cells = [f"{r['stats'][n][0]:.1f} ({r['stats'][n][1]:.1f}-{r['stats'][n][2]:.1f})" for n in names]
        line = f"| {r['fmt']} | {r['rounding']} | " + " | ".join(cells)
        if ratio:
            line += f" | {r['stats'][mx_name][0] / r['stats'][mxt_name][0]:.1f}x"
        lines.append(line + f" | {'yes' if r['same'] else 'NO'} |")
    return "\n".join(lines)


def record_load(table, args, mx_info, notes, load_start, command):
    now = datetime.datetime.now().astimezone()
    with open(RESULTS_MD, "a") as f:  # append only
        f.write(f"\n## bench_reference.py --background-load — {now.strftime('%Y-%m-%d %H:%M %Z')}\n\n")
        f.write(f"- command: `{command}`\n")
        f.write(f"- device: {cpu_model()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads by "
                f"default; {args.background_load} busy process(es) (`python3 -c \"{BUSY_LOOP}\"`) started "
                f"beside it; load average (1/5/15 min) at start {load_start}, at end {loadavg()} "
                "(other processes on the machine count too)\n")
        f.write(f"- torch {torch.__version__}, Python {platform.python_version()}\n")
        f.write(f"- input: fp32 {args.size}x{args.size} randn (seed {args.seed}), block {BLOCK_SIZE} along the "
                f"last axis; ms per call: median (min-max) of {args.repeats} after {args.warmup} warm-up, "
                "the variants called in a shuffled order per round (seeded by the round)\n")
        if mx_info:
            f.write(f"- microxcaling {mx_info['commit'] or '(unknown commit)'}: "
                    "`mx.mx_ops.quantize_mx_op(x, specs, elem_format=fmt, block_size=32, axes=[-1], round=R)`\n")
        f.write(f"- mxtrain: `quantize_mx(x, fmt, block_size=32, axis=-1, scale_mode=\"floor\", rounding=R)"
                f".dequantize(torch.float32)`; repo commit {_git_rev(REPO_ROOT) or '(none)'} plus working-tree "
                "changes; \"workers off\": `mxtrain.quantization._workers.ENABLED = False`\n")
        for n in notes:
            f.write(f"- note: {n}\n")
        f.write("\n" + table + "\n")
    print(f"\nappended to {os.path.relpath(RESULTS_MD, os.getcwd())}")


# ---------------------------------------------------------------------------
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--microxcaling", metavar="PATH", default=None,
                   help="path to a microxcaling checkout (the directory holding mx/); "
                        "if missing, only mxtrain is timed")
    p.add_argument("--size", type=int, default=4096, help="input is SIZE x SIZE fp32 (default 4096)")
    p.add_argument("--formats", nargs="+", default=["fp8_e4m3", "fp4_e2m1"])
    p.add_argument("--roundings", nargs="+", default=["nearest", "even"],
                   help="rounding modes, passed unchanged to both libraries "
                        "(microxcaling: nearest=ties away from zero, even, floor)")
    p.add_argument("--repeats", type=int, default=7, help="timed runs per case (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs before timing")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (default: leave torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stress", action="store_true",
                   help="also compare every implementation with an exact float64 reference on an "
                        "adversarial input (amax just below 2^k, exact ties, 0.5-2^-25); untimed")
    p.add_argument("--count-ops", action="store_true",
                   help="also count the aten ops (memory passes) of one call of each implementation")
    p.add_argument("--record", action="store_true",
                   help="append the table to benchmarks/RESULTS.md")
    p.add_argument("--no-huge-pages", action="store_true",
                   help="allocate mxtrain's large CPU outputs without the transparent-huge-page advice "
                        "(mxtrain.quantization._memory), to see what page faults cost")
    p.add_argument("--background-load", type=int, nargs="?", const=1, default=0, metavar="N",
                   help="start N busy processes (default 1) beside the benchmark and time default-threaded "
                        "against single-threaded calls (and mxtrain with its chunk workers off), alternating")
    args = p.parse_args(argv)
    if args.background_load < 0:
        p.error(f"--background-load takes a number of busy processes >= 0, got {args.background_load}")

    load_start = loadavg()
    if args.threads:
        torch.set_num_threads(args.threads)
    notes = []

    mx_fn = mx_info = None
    if args.microxcaling:
        try:
            mx_fn, mx_info = load_microxcaling(args.microxcaling)
            if mx_info["note"]:
                notes.append("microxcaling: " + mx_info["note"])
        except Exception as exc:
            notes.append(f"microxcaling not loaded: {type(exc).__name__}: {exc}")
    else:
        notes.append("no --microxcaling PATH given: microxcaling columns are n/a")

    qdq_fn, fake_fn, mxt_note = load_mxtrain()
    if mxt_note:
        notes.append(mxt_note)
    huge = huge_page_note(disable=args.no_huge_pages)
    if huge:
        notes.append(huge)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU: {cpu_model()} "
          f"({os.cpu_count()} cores), load average {loadavg()}")
    if mx_info:
        print(f"microxcaling at {mx_info['path']} (commit {mx_info['commit']})")
    for n in notes:
        print("note:", n)

    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.size, args.size, generator=g, dtype=torch.float32)
    x_before = x.clone()

    if args.background_load:
        command = "python " + " ".join([os.path.relpath(os.path.abspath(__file__), REPO_ROOT)]
                                       + (sys.argv[1:] if argv is None else list(argv)))
        load_rows = background_load_run(args, x, mx_fn, qdq_fn)
        table = make_load_table(load_rows, torch.get_num_threads())
        print()
        for n in notes:
            print("note:", n)
        print(f"(fp32 {args.size}x{args.size}, block {BLOCK_SIZE}, last axis; {args.background_load} busy "
              f"process(es) beside; ms per call: median (min-max) of {args.repeats} runs after {args.warmup} "
              f"warm-up, variants alternating; load average {loadavg()})\n")
        print(table)
        if args.record:
            record_load(table, args, mx_info, notes, load_start, command)
        return

    rows = []
    for fmt in args.formats:
        for rnd in args.roundings:
            row = dict(fmt=fmt, rounding=rnd, mx_ms=None, qdq_ms=None, fake_ms=None,
                       agree_qdq=None, agree_fake=None, exact={})
            outs = {}
            print(f"\n[{fmt}, rounding={rnd}]")
            ref = None
            if mx_fn is not None:
                try:
                    med, lo, hi, ref = time_fn(lambda: mx_fn(x, fmt, rnd), args.repeats, args.warmup)
                    row["mx_ms"] = med
                    row["mx_min"] = lo
                    outs["microxcaling"] = ref
                    print(f"  microxcaling                    {med:9.1f} ms  (min {lo:.1f}, max {hi:.1f})")
                except Exception as exc:
                    print(f"  microxcaling failed: {type(exc).__name__}: {exc}")
            for key, fn, label in (("qdq", qdq_fn, "mxtrain quantize_mx+dequantize"),
                                   ("fake", fake_fn, "mxtrain fake_quantize_mx")):
                if fn is None:
                    continue
                try:
                    med, lo, hi, out = time_fn(lambda: fn(x, fmt, rnd), args.repeats, args.warmup)
                except Exception as exc:
                    print(f"  {label} failed: {type(exc).__name__}: {exc}")
                    continue
                row[f"{key}_ms"] = med
                row[f"{key}_min"] = lo
                outs[key] = out
                print(f"  {label:<31} {med:9.1f} ms  (min {lo:.1f}, max {hi:.1f})")
                if ref is not None:
                    res = agreement(ref, out)
                    row[f"agree_{key}"] = res
                    frac, ndiff, nblk, maxdiff = res
                    print(f"    agreement with microxcaling: {frac:.9f} "
                          f"({ndiff} elements in {nblk} blocks differ, max |diff| {maxdiff:.6g})")
                    for line in describe_diffs(x, ref, out):
                        print(line)
            if outs and fmt in ELEM_FORMATS and rnd in ("nearest", "even", "floor"):
                exact = exact_reference(x, fmt, rnd)
                for name, out in outs.items():
                    same = (out == exact) | (torch.isnan(out) & torch.isnan(exact))
                    row["exact"][name] = int(same.numel() - same.sum())
                print("    elements differing from the exact float64 reference: " + ", ".join(
                    f"{name} {n}" for name, n in row["exact"].items()))
                del exact
            del outs, ref
            rows.append(row)

    if args.count_ops:
        print("\naten ops per call (256x256 input; full-size / partial (>= 1/32 size) / tiny; views excluded)")
        for fmt in args.formats:
            for rnd in args.roundings:
                parts = []
                for name, fn in (("microxcaling", mx_fn), ("mxtrain quantize_mx+dequantize", qdq_fn),
                                 ("mxtrain fake_quantize_mx", fake_fn)):
                    if fn is None:
                        continue
                    try:
                        parts.append("%s %d / %d / %d" % ((name,) + count_passes(lambda t: fn(t, fmt, rnd))))
                    except Exception as exc:
                        parts.append(f"{name} failed ({type(exc).__name__}: {exc})")
                print(f"  {fmt} {rnd}: " + "; ".join(parts))

    stress_lines = []
    if args.stress:
        print("\nstress check (not timed)")
        for fmt in args.formats:
            if fmt not in ELEM_FORMATS or args.size % BLOCK_SIZE:
                print(f"  {fmt}: no stress input for this format/size")
                continue
            xs, kind = make_stress(args.size, fmt, args.seed)
            for rnd in args.roundings:
                if rnd not in ("nearest", "even", "floor"):
                    continue
                impls = []
                for name, fn in (("microxcaling", mx_fn), ("mxtrain quantize_mx", qdq_fn),
                                 ("mxtrain fake_quantize_mx", fake_fn)):
                    if fn is None:
                        continue
                    try:
                        impls.append((name, fn(xs, fmt, rnd)))
                    except Exception as exc:
                        print(f"  {name} failed on the stress input: {type(exc).__name__}: {exc}")
                if impls:
                    lines = stress_report(xs, kind, fmt, rnd, impls)
                    print("\n".join(lines))
                    stress_lines += lines
                del impls

    if not torch.equal(x, x_before):
        notes.append("WARNING: the input tensor was modified in place by one of the calls")
        print("WARNING: the input tensor was modified in place")

    table = make_table(rows)
    print()
    for n in notes:
        print("note:", n)
    print(f"(fp32 {args.size}x{args.size}, block {BLOCK_SIZE}, last axis; ms per call: median (min) of "
          f"{args.repeats} runs after {args.warmup} warm-up; speedup = microxcaling median / mxtrain "
          f"median; {torch.get_num_threads()} threads; load average {loadavg()})\n")
    print(table)
    if args.record:
        record(table, args, mx_info, notes, stress_lines, load_start)


if __name__ == "__main__":
    main()
