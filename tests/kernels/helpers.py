"""Data and comparison helpers of the kernel tests (imported as ``kernel_helpers``; see conftest.py)."""

import torch


def adversarial_matrix(rows: int, cols: int, seed: int = 0, block: int = 32) -> torch.Tensor:
    """fp32 [rows, cols]: random values over a wide exponent range plus special blocks.

    Rows get magnitudes from 2**-140 (fp32 subnormal) to 2**120; some blocks are
    all NaN-free zeros, -0.0, fp32 subnormals, exact ties of every grid, values
    one ulp under powers of two, huge values near fp32 max; single NaN / +-Inf
    elements poison a few blocks (in both orientations).
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    exps = torch.randint(-140, 121, (rows, 1), generator=g).float()
    x = x * torch.exp2(exps)
    # per-element spread inside a block, so small elements underflow the element grid
    x = x * torch.exp2(torch.randint(-12, 1, (rows, cols), generator=g).float())
    r = 0
    if rows > 8 and cols >= block:
        x[r, :block] = 0.0                                              # zero block
        x[r + 1, :block] = -0.0                                         # negative zeros
        x[r + 1, block:] = x[r + 1, block:].abs().neg()
        x[r + 2, :block] = torch.randn(block, generator=g) * 2.0**-140  # fp32 subnormals only
        x[r + 3, : block // 2] = 1.0e-42                                 # subnormal next to normals
        x[r + 3, block // 2: block] = torch.randn(block - block // 2, generator=g)
        # ties: k/8 + 1/16 multiples (midpoints of every grid at some scale)
        k = torch.randint(-64, 64, (cols,), generator=g).float()
        x[r + 4] = (k + 0.5) / 8.0
        x[r + 5] = (k + 0.5) * 2.0**-7
        # one ulp under powers of two (the shared exponent's edge) and max-ish values
        p2 = torch.exp2(torch.randint(-20, 20, (cols,), generator=g).float())
        x[r + 6] = torch.nextafter(p2, torch.zeros_like(p2)) * torch.where(k >= 0, 1.0, -1.0)
        x[r + 7] = torch.where(k >= 0, 3.3e38, -3.0e38) * torch.rand(cols, generator=g).clamp_min(0.5)
        x[r + 8, 1] = float("nan")
        if cols > block + 2:
            x[r + 8, block + 2] = float("inf")
        if cols > 2 * block:
            x[r + 8, 2 * block] = float("-inf")
        x[rows - 1, cols - 1] = float("nan")  # ragged corner block poisoned
    x[rows // 2, min(3, cols - 1)] = float("inf")  # poisons one columnwise block
    return x


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype`` with out-of-range values clipped to that dtype's finite range (NaN/Inf kept)."""
    if dtype == torch.float32:
        return x
    fin = torch.finfo(dtype)
    y = torch.where(torch.isfinite(x), x.clamp(-fin.max, fin.max), x)
    return y.to(dtype)


def planes_equal(a, b) -> list[str]:
    """Differences (empty when bit-identical) between two MXTensors' planes: data, scale, axis, layout."""
    problems = []
    if len(a.planes) != len(b.planes):
        return [f"{len(a.planes)} planes vs {len(b.planes)}"]
    for pa, pb in zip(a.planes, b.planes):
        if pa.axis != pb.axis or pa.packed != pb.packed:
            problems.append(f"plane axis/packed {pa.axis},{pa.packed} vs {pb.axis},{pb.packed}")
            continue
        for name in ("data", "scale"):
            ta, tb = getattr(pa, name), getattr(pb, name)
            if ta.shape != tb.shape or ta.dtype != tb.dtype:
                problems.append(f"axis {pa.axis} {name}: {list(ta.shape)} {ta.dtype} vs {list(tb.shape)} {tb.dtype}")
            elif not torch.equal(ta.cpu(), tb.cpu()):
                bad = (ta.cpu() != tb.cpu()).nonzero()
                problems.append(f"axis {pa.axis} {name}: {len(bad)} bytes differ, first at {bad[0].tolist()}")
    for field in ("fmt", "block_size", "shape", "dtype", "scale_mode", "rounding", "whole_axis"):
        if getattr(a, field) != getattr(b, field):
            problems.append(f"{field}: {getattr(a, field)} vs {getattr(b, field)}")
    return problems


def values_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical apart from NaN payloads (NaN in the same places)."""
    a, b = a.cpu(), b.cpu()
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    na, nb = torch.isnan(a), torch.isnan(b)
    if not torch.equal(na, nb):
        return False
    ia = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.masked_fill(na, 0).view(ia), b.masked_fill(nb, 0).view(ia))

