#!/usr/bin/env python
"""Bandwidth of the Triton MX kernels against a device-to-device copy (GPU).

Every figure is (bytes read + bytes written) / time, with time the median of
``triton.testing.do_bench``; the ratio divides it by the same figure of a
``torch`` copy of the input tensor timed in the same run (the memory ceiling
that this device actually reaches). Goals: cast >= 0.80 of the copy,
unpack+dequantize >= 0.80, fused norm/activation+cast >= 1.5x torch op + cast.

    python benchmarks/bench_casts.py                  # table
    python benchmarks/bench_casts.py --variants       # also every tile variant
    python benchmarks/bench_casts.py --out section.md # the markdown section for RESULTS.md

The kernels are checked bit-exact against the reference in tests/gpu; this
script only times them (it does check each variant once against the default).
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout

from mxtrain import config  # noqa: E402


def bench(fn, warmup=25, rep=200):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def gbps(nbytes, ms):
    return nbytes / (ms * 1e-3) / 1e9


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--variants", action="store_true", help="time every tile variant")
    ap.add_argument("--out", default=None, help="write the markdown section here")
    ap.add_argument("--once", action="store_true", help="run each kernel once and exit (for ncu)")
    ap.add_argument("--strip", action="store_true",
                    help="time the strip kernel configs and the module's cast+dequantize operations (tile vs strip, "
                         "cast writing the dequantized operand vs cast then dequantize), round-robin")
    ap.add_argument("--fused-only", action="store_true", help="time the copy and the fused norm/activation casts only")
    ap.add_argument("--dequant-only", action="store_true",
                    help="time the copy and the unpack+dequantize kernels only, eager and graph-replayed")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_casts needs a CUDA GPU", file=sys.stderr)
        return 1
    import triton

    from mxtrain.kernels import cast, dequantize as dq
    from mxtrain.quantization import quantize_mx

    n = args.size
    dev = torch.device("cuda")
    torch.manual_seed(0)
    x = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    rows = []  # (name, bytes, ms, baseline_name)
    if args.once:  # warm (compile), then one launch of each kernel to profile
        for _ in range(2):
            cast.triton_quantize(x, "fp8_e4m3", axis=(-1, 0))
            cast.triton_quantize(x, "fp8_e4m3", axis=-1)
        torch.cuda.synchronize()
        return 0

    dst = torch.empty_like(x)
    copy_ms = bench(lambda: dst.copy_(x))
    copy_bytes = 2 * x.numel() * x.element_size()
    copy_bw = gbps(copy_bytes, copy_ms)
    rows.append(("copy bf16 (baseline)", copy_bytes, copy_ms, None))
    if args.fused_only:
        return _report(rows + fused_rows(x, n), [], copy_bw, n, args.out)
    if args.dequant_only:
        copy_gms = graph_bench(lambda: dst.copy_(x))
        rows.append(("copy bf16, CUDA graph (baseline of the graph rows)", copy_bytes, copy_gms, None))
        return _report(rows + dequant_graph_rows(x, n), [], copy_bw, n, args.out, gbps(copy_bytes, copy_gms))

    # ---- cast: rowwise + columnwise MXFP8 from one read
    def cast_bytes(fmt_bits, planes):
        nb = -(-n // 32)
        return x.numel() * 2 + planes * (n * n * fmt_bits // 8 + n * nb)

    ref = quantize_mx(x, "fp8_e4m3", axis=(-1, 0))
    variants = [("default", None, config.current().triton_hw_fp8)]
    if args.variants:
        for cfg in ((32, 512, 4), (64, 128, 4), (128, 64, 4), (64, 256, 4), (128, 128, 8), (32, 128, 4)):
            variants.append((f"tile {cfg}", cfg, True))
        variants.append(("default, integer rounding (no hw cvt)", None, False))
    default_cfg = cast.TILE_CONFIGS[(True, True)]
    extra = []
    for label, cfg, hw in variants:
        cast.TILE_CONFIGS[(True, True)] = cfg or default_cfg
        with config.override(triton_hw_fp8=hw):
            out = cast.triton_quantize(x, "fp8_e4m3", axis=(-1, 0))
            ok = all(torch.equal(a.data, b.data) and torch.equal(a.scale, b.scale)
                     for a, b in zip(out.planes, ref.planes))
            ms = bench(lambda: cast.triton_quantize(x, "fp8_e4m3", axis=(-1, 0)))
        name = f"cast bf16->MXFP8 e4m3 row+col [{label}]" + ("" if ok else " MISMATCH")
        (rows if label == "default" else extra).append((name, cast_bytes(8, 2), ms, "copy"))
    cast.TILE_CONFIGS[(True, True)] = default_cfg
    ms = bench(lambda: cast.triton_quantize(x, "fp8_e4m3", axis=-1))
    rows.append(("cast bf16->MXFP8 e4m3 rowwise only", cast_bytes(8, 1), ms, "copy"))
    for fmt, bits in (("fp6_e2m3", 6), ("fp4_e2m1", 4)):
        ms = bench(lambda: cast.triton_quantize(x, fmt, axis=(-1, 0)))
        rows.append((f"cast bf16->MX {fmt} row+col", cast_bytes(bits, 2), ms, "copy"))
    rows += cuda_rows(x, cast_bytes)
    ms = bench(lambda: cast.triton_quantize(x, "fp8_e4m3", axis=(-1, 0), rounding="nearest"))
    rows.append(("cast bf16->MXFP8 row+col, nearest (integer path)", cast_bytes(8, 2), ms, "copy"))
    torch.cuda.synchronize()
    t0 = datetime.datetime.now()
    quantize_mx(x, "fp8_e4m3", axis=(-1, 0))
    torch.cuda.synchronize()
    ref_ms = (datetime.datetime.now() - t0).total_seconds() * 1e3
    rows.append(("reference quantize_mx (same cast, one call)", cast_bytes(8, 2), ref_ms, "copy"))

    # ---- fused unpack + dequantize -> bf16, rowwise plane
    default_dq = dq.TILE_CONFIG
    for fmt, bits in (("fp6_e2m3", 6), ("fp4_e2m1", 4), ("fp8_e4m3", 8)):
        mxt = quantize_mx(x, fmt, axis=-1)
        nbytes = n * n * bits // 8 + n * (n // 32) + n * n * 2
        want = mxt.dequantize(torch.bfloat16)
        cfgs = [default_dq]
        if args.variants and bits != 8:
            cfgs += [(16, 256, 4), (4, 1024, 4), (8, 1024, 8)]
        for cfg in cfgs:
            dq.TILE_CONFIG = cfg
            got = dq.triton_dequantize(mxt, torch.bfloat16)
            ok = torch.equal(got.view(torch.int16), want.view(torch.int16))
            ms = bench(lambda: dq.triton_dequantize(mxt, torch.bfloat16))
            name = f"unpack+dequantize {fmt} -> bf16 [{cfg}]" + ("" if ok else " MISMATCH")
            (rows if cfg == default_dq else extra).append((name, nbytes, ms, "copy"))
        dq.TILE_CONFIG = default_dq
    mxt = quantize_mx(x, "fp4_e2m1", axis=0)
    ms = bench(lambda: dq.triton_dequantize(mxt, torch.bfloat16, 0))
    rows.append(("unpack+dequantize fp4 columnwise -> bf16 [M,K]", n * n // 2 + n * (n // 32) + n * n * 2, ms,
                 "copy"))

    # ---- norm + cast, activation + cast (if implemented)
    rows += fused_rows(x, n, extra if args.variants else None)
    if args.strip:
        rows += strip_and_values_rows(x, n)

    return _report(rows, extra, copy_bw, n, args.out)


def dequant_graph_rows(x, n) -> list:
    """Unpack + dequantize of each packed format to bf16, eager (against the eager copy) and replayed from a
    CUDA graph (kernel time, against the graph-replayed copy); each checked bit for bit first."""
    from mxtrain.kernels import dequantize as dq
    from mxtrain.quantization import quantize_mx

    out = []
    for fmt, bits, axis in (("fp6_e2m3", 6, -1), ("fp4_e2m1", 4, -1), ("fp8_e4m3", 8, -1), ("fp4_e2m1", 4, 0)):
        mxt = quantize_mx(x, fmt, axis=axis)
        nbytes = n * n * bits // 8 + n * (n // 32) + n * n * 2
        ok = torch.equal(dq.triton_dequantize(mxt, torch.bfloat16, axis % 2).view(torch.int16),
                         mxt.dequantize(torch.bfloat16, axis % 2).view(torch.int16))
        fn = (lambda m=mxt, a=axis % 2: dq.triton_dequantize(m, torch.bfloat16, a))
        name = f"unpack+dequantize {fmt} {'rowwise' if axis == -1 else 'columnwise'} -> bf16" + ("" if ok else " MISMATCH")
        out.append((name, nbytes, bench(fn), "copy"))
        out.append((name + ", CUDA graph (kernel time)", nbytes, graph_bench(fn), "copy_graph"))
    out += cuda_dequant_rows(x, n)
    return out


def cuda_dequant_rows(x, n) -> list:
    """The CUDA dequantize (mxtrain/csrc/mx_dequantize.cu: FSDP2's gathered MXFP8 planes into bf16) on an
    fp8_e4m3 plane, rowwise and transposed (the columnwise plane written back in the weight's orientation),
    graph-replayed; each checked bit for bit against the reference first. No rows where the kernel does not run."""
    from mxtrain.formats import parse_format
    from mxtrain.kernels import cuda_cast
    from mxtrain.quantization import quantize_mx

    out = []
    fmt = parse_format("fp8_e4m3")
    for axis, label in ((-1, "rowwise"), (0, "transposed (columnwise plane)")):
        mxt = quantize_mx(x, "fp8_e4m3", axis=axis)
        plane = mxt.planes[0]
        rows, length = plane.data.shape
        res = torch.empty(n, n, dtype=torch.bfloat16, device=x.device)
        strides = (n, 1) if axis == -1 else (1, n)  # element (r, l) of the plane -> res.view(-1)[r*sr + l*sl]
        fn = (lambda p=plane, o=res, st=strides: cuda_cast.dequantize_fp8(p.data, p.scale, o, fmt, 32, rows, length,
                                                                         *st))
        if not fn():
            continue
        ok = torch.equal(res.view(torch.int16), mxt.dequantize(torch.bfloat16).view(torch.int16))
        nbytes = n * n + n * (n // 32) + n * n * 2
        name = f"CUDA dequantize fp8_e4m3 {label} -> bf16" + ("" if ok else " MISMATCH")
        out.append((name, nbytes, bench(fn), "copy"))
        out.append((name + ", CUDA graph (kernel time)", nbytes, graph_bench(fn), "copy_graph"))
    return out


def _report(rows, extra, copy_bw, n, out, copy_graph_bw=None):
    import triton

    dev_name = torch.cuda.get_device_name()
    lines = [f"### Triton MX kernels: {dev_name}, {datetime.date.today()}, torch {torch.__version__}, "
             f"triton {triton.__version__}, {n}x{n} bf16", "",
             "| kernel | ms (median) | GB/s | ratio |", "|---|---|---|---|"]
    for name, nbytes, ms, base in rows + extra:
        ratio = "" if base is None else f"{gbps(nbytes, ms) / copy_bw:.2f} of copy"
        if base == "copy_graph":
            ratio = f"{gbps(nbytes, ms) / copy_graph_bw:.2f} of the graph-replayed copy"
        elif base is not None and base != "copy":
            ratio = f"{base / ms:.2f}x vs the baseline in the name"
        lines.append(f"| {name} | {ms:.4f} | {gbps(nbytes, ms):.0f} | {ratio} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text)
    return 0


def _graph_row(label, fused, unfused, nbytes):
    """Fused against unfused, both replayed from CUDA graphs: kernel time without Python overhead."""
    base = graph_bench(unfused)
    return (f"{label}, CUDA graph (kernel time; unfused {base:.4f} ms)", nbytes, graph_bench(fused), base)


def graph_bench(fn, rep=100):
    """Median ms of ``fn`` replayed from a CUDA graph: GPU time alone, no Python launch overhead."""
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")


def cuda_rows(x, cast_bytes) -> list:
    """The CUDA C++ cast (mxtrain/csrc) against the Triton cast, eager and graph-replayed (kernel time)."""
    from mxtrain.kernels import cast, cuda_cast
    from mxtrain.quantization import quantize_mx

    if cuda_cast.library() is None:
        print(f"CUDA C++ cast unavailable: {cuda_cast.extension_error()}", file=sys.stderr)
        return []
    out = []
    cases = [("fp8_e4m3 row+col", "fp8_e4m3", dict(axis=(-1, 0)), cast_bytes(8, 2)),
             ("fp8_e5m2 row+col rceil", "fp8_e5m2", dict(axis=(-1, 0), scale_mode="rceil"), cast_bytes(8, 2)),
             ("fp8_e4m3 rowwise only", "fp8_e4m3", dict(axis=-1), cast_bytes(8, 1)),
             ("fp8_e4m3 row values bf16 + col codes (module input)", "fp8_e4m3",
              dict(axis=(1, 0), dequantized=(1,), keep_codes=(0,)), cast_bytes(8, 1) + x.numel() * 2)]
    for label, fmt, kw, nbytes in cases:
        ref = quantize_mx(x, fmt, **{k: v for k, v in kw.items() if k not in ("dequantized", "keep_codes")})
        got = cuda_cast.cuda_quantize(x, fmt, **kw)
        ok = all(torch.equal(a.data, ref.plane(a.axis).data) and torch.equal(a.scale, ref.plane(a.axis).scale)
                 for a in got.planes)
        for name, fn in (("CUDA C++", lambda: cuda_cast.cuda_quantize(x, fmt, **kw)),
                         ("Triton", lambda: cast.triton_quantize(x, fmt, **kw))):
            ms = bench(fn)
            gms = graph_bench(fn)
            tag = "" if ok or name == "Triton" else " MISMATCH"
            out.append((f"{name} cast {label}{tag}", nbytes, ms, "copy"))
            out.append((f"{name} cast {label}{tag}, CUDA graph (kernel time)", nbytes, gms, "copy"))
    return out


def rr_bench(fns: dict, rounds: int = 3) -> dict:
    """Median over ``rounds`` of do_bench medians, the candidates timed in turn (drift hits all alike)."""
    res = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            res[k].append(bench(f, warmup=10, rep=100))
    return {k: sorted(v)[len(v) // 2] for k, v in res.items()}


# (label, cast.STRIP_CONFIG, cast.TILE_CONFIGS value or None = default). Measured and dropped since:
# 2 or 4 tiles per program with the next tile's loads issued first (H200: 0.159-0.165 ms against
# 0.136 for the default; 180-246 registers), see benchmarks/NOTES_kernels.md
VARIANTS = (
    ("tile (32, 256, 4)", None, None),
    ("tile (32, 128, 4)", None, (32, 128, 4)),
    ("strip (4, 32, 64, 4)", (4, 32, 64, 4), None),
    ("strip (8, 16, 64, 4)", (8, 16, 64, 4), None),
)


def strip_and_values_rows(x, n):
    """Both-plane MXFP8 cast: kernel variants (tile configs, strip kernel), round-robin;
    the LayerNormMLP's cast(+dequantize) operations: cast writing the dequantized bf16 operand (values)
    vs cast then the separate dequantize pass."""
    from mxtrain.kernels import cast, dequantize as dq
    from mxtrain.quantization import quantize_mx

    defaults = (config.current().cast_strip, dict(cast.TILE_CONFIGS))
    rows = []
    nb = n // 32
    q = cast.triton_quantize
    ref = quantize_mx(x, "fp8_e4m3", axis=(-1, 0))
    ref_row = ref.dequantize(torch.bfloat16, 1).view(torch.int16)
    ref_col = ref.dequantize(torch.bfloat16, 0).view(torch.int16)

    def setv(v):
        cast.TILE_CONFIGS.update(defaults[1])
        if v is not None and v[2] is not None:
            cast.TILE_CONFIGS.update({key: v[2] for key in cast.TILE_CONFIGS})

    def with_cfg(v, fn):
        def run():
            setv(v)
            with config.override(cast_strip=defaults[0] if v is None else v[1]):
                return fn()
        return run

    def same(a, b):
        return a is not None and b is not None and torch.equal(a.data, b.data) and torch.equal(a.scale, b.scale)

    # 1. the goal row: both planes' codes, per variant
    fns, ok = {}, {}
    for v in VARIANTS:
        setv(v)
        out = q(x, "fp8_e4m3", axis=(-1, 0))
        ok[v] = all(same(a, b) for a, b in zip(out.planes, ref.planes))
        fns[v] = with_cfg(v, lambda: q(x, "fp8_e4m3", axis=(-1, 0)))
    ms = rr_bench(fns)
    both_bytes = x.numel() * 2 + 2 * (n * n + n * nb)
    for v in VARIANTS:
        rows.append((f"cast bf16->MXFP8 row+col [{v[0]}], round-robin" + ("" if ok[v] else " MISMATCH"),
                     both_bytes, ms[v], "copy"))
    setv(None)

    # 2. the module's operations: old path (codes, then dequantize) vs values from the cast, tile and strip
    best = min((v for v in VARIANTS[1:] if ok[v]), key=lambda v: ms[v], default=None)
    cands = [VARIANTS[0]] + ([best] if best is not None else [])

    def check_values(cfg, plane, kw):
        setv(cfg)
        out = q(x, "fp8_e4m3", **kw)
        want = ref_row if plane == 1 else ref_col
        return torch.equal(out.dequantized_values(plane).view(torch.int16), want)

    ops = {
        # (label, quantize kwargs, old path, bytes of the new path)
        "row+col: row as bf16 values, col codes (norm out, dY, dh)": (
            dict(axis=(-1, 0), dequantized=(1,), keep_codes=(0,)), 1,
            lambda: dq.triton_dequantize(q(x, "fp8_e4m3", axis=(-1, 0)), torch.bfloat16, 1),
            x.numel() * 4 + n * n + n * nb),
        "rowwise bf16 values only (act(h), weights fwd)": (
            dict(axis=-1, dequantized=(1,), keep_codes=()), 1,
            lambda: dq.triton_dequantize(q(x, "fp8_e4m3", axis=-1), torch.bfloat16, 1),
            x.numel() * 4),
        "columnwise bf16 values only (weights bwd)": (
            dict(axis=0, dequantized=(0,), keep_codes=()), 0,
            lambda: dq.triton_dequantize(q(x, "fp8_e4m3", axis=0), torch.bfloat16, 0),
            x.numel() * 4),
    }
    for label, (kw, plane, old, nbytes) in ops.items():
        fns = {"old": with_cfg(None, old)}
        oks = {}
        for cfg in cands:
            oks[cfg] = check_values(cfg, plane, kw)
            fns[cfg] = with_cfg(cfg, lambda kw=kw: q(x, "fp8_e4m3", **kw))
        t = rr_bench(fns)
        for cfg in oks:
            name = (f"{label} [{cfg[0]}] (cast+dequantize {t['old']:.4f} ms)"
                    + ("" if oks[cfg] else " MISMATCH"))
            rows.append((name, nbytes, t[cfg], t["old"]))
    # columnwise codes only (act(h) recomputed in backward for wgrad)
    fns = {cfg: with_cfg(cfg, lambda: q(x, "fp8_e4m3", axis=0)) for cfg in cands}
    t = rr_bench(fns)
    for cfg in cands:
        rows.append((f"cast bf16->MXFP8 columnwise only [{cfg[0]}]",
                     x.numel() * 2 + n * n + n * nb, t[cfg], "copy"))
    setv(None)
    return rows


def fused_rows(x, n, variants_out=None):
    """Norm+cast and activation+cast against the torch op followed by the separate cast.

    The baseline's cast is the fastest one (the dispatch point's default: the CUDA C++ cast where it
    is built, else Triton); the fused functions take the CUDA kernels where they apply. The names
    also give each against the Triton-only pair (``MXTRAIN_BACKEND=triton`` for both)."""
    from mxtrain.kernels import dispatch

    def with_backend(backend, fn):
        def run():
            with config.override(backend=backend):
                return fn()
        return run
    rows = []
    try:
        from mxtrain.kernels import norm_cast
    except ImportError:
        norm_cast = None
    try:
        from mxtrain.kernels import activation_cast
    except ImportError:
        activation_cast = None
    from mxtrain.kernels import cast

    if norm_cast is not None:
        w = torch.randn(n, device=x.device, dtype=torch.bfloat16)
        b = torch.randn(n, device=x.device, dtype=torch.bfloat16)
        for kind in ("LayerNorm", "RMSNorm"):
            def unfused(kind=kind):
                if kind == "LayerNorm":
                    y = torch.nn.functional.layer_norm(x, (n,), w, b)
                else:
                    y = torch.nn.functional.rms_norm(x, (n,), w)
                return dispatch.quantize(y, "fp8_e4m3", axis=(-1, 0))
            base_ms = bench(unfused)
            base_triton = bench(with_backend("triton", unfused))
            nbytes = x.numel() * 2 + 2 * (n * n + n * (n // 32))

            def fused(kind=kind):
                return norm_cast.norm_cast(x, w, b if kind == "LayerNorm" else None, kind=kind, fmt="fp8_e4m3",
                                           axis=(-1, 0))
            ms = bench(fused)
            ms_triton = bench(with_backend("triton", fused))
            rows.append((f"{kind}+cast MXFP8 row+col (unfused {base_ms:.4f} ms; Triton-only pair: fused "
                         f"{ms_triton:.4f} vs unfused {base_triton:.4f} ms = {base_triton / ms_triton:.2f}x)",
                         nbytes, ms, base_ms))
            rows.append(_graph_row(f"{kind}+cast MXFP8 row+col", fused, unfused, nbytes))
    if activation_cast is not None:
        h = torch.randn(n, 2 * n, device=x.device, dtype=torch.bfloat16)
        for act in ("gelu", "swiglu"):
            inp = h if act in ("swiglu",) else x

            def unfused(act=act, inp=inp):
                y = activation_cast.torch_activation(inp, act)
                return dispatch.quantize(y, "fp8_e4m3", axis=(-1, 0))

            def fused(act=act, inp=inp):
                return activation_cast.activation_cast(inp, act, "fp8_e4m3", axis=(-1, 0))
            base_ms = bench(unfused)
            base_triton = bench(with_backend("triton", unfused))
            ms = bench(fused)
            ms_triton = bench(with_backend("triton", fused))
            nbytes = inp.numel() * 2 + 2 * (n * n + n * (n // 32))
            rows.append((f"{act}+cast MXFP8 row+col (unfused {base_ms:.4f} ms; Triton-only pair: fused "
                         f"{ms_triton:.4f} vs unfused {base_triton:.4f} ms = {base_triton / ms_triton:.2f}x)",
                         nbytes, ms, base_ms))
            rows.append(_graph_row(f"{act}+cast MXFP8 row+col", fused, unfused, nbytes))
        # the activation's gradient + cast as LayerNormMLP's backward asks for it (no bias): dh's rowwise values
        # and its columnwise codes
        from mxtrain.modules.activations import activation_backward

        g = torch.randn(n, n, device=x.device, dtype=torch.bfloat16)
        kw = dict(axis=(-1, 0), dequantized=(-1,), keep_codes=(0,))
        for act in ("gelu", "silu"):
            def unfused_grad(act=act):
                dh = activation_backward(x, g, act)
                return dispatch.quantize(dh, "fp8_e4m3", **kw)

            def fused_grad(act=act):
                return activation_cast.activation_backward_cast(x, g, act, "fp8_e4m3", **kw)
            base_ms = bench(unfused_grad)
            ms = bench(fused_grad)
            ms_triton = bench(with_backend("triton", fused_grad))
            nbytes = 2 * x.numel() * 2 + x.numel() * 2 + n * n + n * (n // 32)
            rows.append((f"{act} gradient+cast, row values + col codes (Triton kernel {ms_triton:.4f} ms = "
                         f"{ms_triton / ms:.2f}x the CUDA one; torch backward + cast {base_ms:.4f} ms)",
                         nbytes, ms, base_ms))
    return rows


if __name__ == "__main__":
    sys.exit(main())
