"""Triton FP8 casts and the block-scaled GEMM against the reference (interpreter on CPU, compiled on a GPU).

Casts must be bit-identical to mxtrain.quantization.float8.quantize_float8 (data,
scale-inverses, amax); the block GEMM must equal the fp32 GEMM of the dequantized
operands up to accumulation order. Shapes stay small: the interpreter is slow.
"""

import math
import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from mxtrain.kernels import float8_cast  # noqa: E402
from mxtrain.kernels.float8_gemm import block_fp8_gemm  # noqa: E402
from mxtrain.quantization.float8 import quantize_float8  # noqa: E402

DEVICE = torch.device("cpu") if os.environ.get("TRITON_INTERPRET", "0") == "1" else torch.device("cuda")


def adversarial(rows, cols, fmt, seed=0):
    """Random values over a wide range plus FP8 ties, subnormals, zeros, -0.0, NaN and ±Inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-6, 4, cols)[None, :]
    codes = torch.arange(256, dtype=torch.uint8).view(
        torch.float8_e4m3fn if fmt == "fp8_e4m3" else torch.float8_e5m2).float()
    grid = codes[torch.isfinite(codes)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    special = torch.cat([grid, mids, mids.nextafter(torch.tensor(math.inf)),
                         torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e38, -1e38])])
    flat = x.reshape(-1)
    n = min(special.numel(), flat.numel() // 2)
    flat[:n] = special[:n]
    return x


def same_tensor(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, what
    if got.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        # any NaN code stands for NaN (GPU arithmetic does not keep the sign of a NaN)
        nan = lambda t: torch.where(torch.isnan(t.float()), torch.tensor(0x7F, dtype=torch.uint8, device=t.device),  # noqa
                                    t.view(torch.uint8))
        got, want = nan(got), nan(want)
    else:
        got, want = got.view(torch.int32), want.view(torch.int32)  # bit patterns (NaN == NaN)
    bad = (got.cpu() != want.cpu()).sum().item()
    assert bad == 0, f"{what}: {bad} elements differ"


def same_fp8(got, want, what=""):
    assert [p.axis for p in got.planes] == [p.axis for p in want.planes], what
    for pg, pw in zip(got.planes, want.planes):
        same_tensor(pg.data, pw.data, f"{what} data axis {pg.axis}")
        same_tensor(pg.scale_inv.float(), pw.scale_inv, f"{what} scale_inv axis {pg.axis}")
        assert pg.block == pw.block
    if want.amax is not None:
        same_tensor(got.amax.reshape(()), want.amax.reshape(()), f"{what} amax")


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("axes", [(1, 0), -1, 0])
def test_per_tensor_cast_given_scale(fmt, dtype, axes):
    x = adversarial(70, 130, fmt).to(dtype)
    for scale in (1.0, 0.37, 2.0 ** 7):
        s = torch.tensor(scale)
        got = float8_cast.triton_quantize_float8(x.to(DEVICE), fmt, axes=axes, scale=s.to(DEVICE))
        want = quantize_float8(x, fmt, axes=axes, scale=s)
        same_fp8(got, want, f"scale {scale}")
        if isinstance(axes, tuple):
            assert got.plane(0).scale_inv is got.plane(1).scale_inv


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("pow2", [False, True])
def test_per_tensor_current_scaling(fmt, pow2):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(96, 72, generator=g) * 30).to(torch.bfloat16)
    got = float8_cast.triton_quantize_float8(x.to(DEVICE), fmt, axes=(1, 0), power_of_2_scales=pow2)
    same_fp8(got, quantize_float8(x, fmt, axes=(1, 0), power_of_2_scales=pow2))


@pytest.mark.parametrize("rows", [64, 70])
def test_per_tensor_cast_of_a_tall_tensor_takes_64_row_tiles(monkeypatch, rows):
    """Both planes of a tensor of TALL_ROWS rows or more come from 64-row tiles (ragged last tile included):
    bit for bit the reference, as the 32-row tiles are."""
    monkeypatch.setattr(float8_cast, "TALL_ROWS", 64)
    x = adversarial(rows, 130, "fp8_e4m3").to(torch.bfloat16)
    got = float8_cast.triton_quantize_float8(x.to(DEVICE), "fp8_e4m3", axes=(1, 0))
    same_fp8(got, quantize_float8(x, "fp8_e4m3", axes=(1, 0)), f"{rows} rows")


def test_per_tensor_current_scaling_with_a_reduction_group(monkeypatch):
    """With a process group the amax is reduced first and handed to the kernel (all_reduce stubbed here)."""
    seen = []
    monkeypatch.setattr(float8_cast, "all_reduce_amax", lambda amax, group: seen.append(group) or amax * 4)
    group = object()
    x = torch.randn(50, 70) * 3
    got = float8_cast.triton_quantize_float8(x.to(DEVICE), "fp8_e4m3", axes=(1, 0), amax_reduction_group=group)
    want = quantize_float8(x * 4, "fp8_e4m3", axes=(1, 0))  # the scale of a 4x larger amax ...
    assert seen == [group] and got.amax.item() == want.amax.item()
    same_tensor(got.scale_inv.float(), want.scale_inv, "scale_inv")
    scale = torch.reciprocal(want.scale_inv)  # ... applied to x itself
    same_fp8(got, quantize_float8(x, "fp8_e4m3", axes=(1, 0), scale=scale).__class__(
        tuple(p for p in quantize_float8(x, "fp8_e4m3", axes=(1, 0), scale=scale).planes), "fp8_e4m3",
        tuple(x.shape), x.dtype, want.amax), "reduced amax")


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_per_tensor_nd_rowwise_and_nan_amax(fmt):
    x = torch.randn(3, 5, 40)
    x[1, 2, 3], x[2, 0, 0] = math.nan, -math.nan
    got = float8_cast.triton_quantize_float8(x.to(DEVICE), fmt, scale=torch.tensor(4.0).to(DEVICE))
    same_fp8(got, quantize_float8(x, fmt, scale=torch.tensor(4.0)))
    assert got.amax.item() == math.inf and got.plane().data.shape == (3, 5, 40)


@pytest.mark.parametrize("block", [(1, 128), (128, 128)])
@pytest.mark.parametrize("shape", [(256, 256), (130, 300), (5, 129)])
@pytest.mark.parametrize("pow2", [True, False])
def test_block_cast(block, shape, pow2):
    x = adversarial(*shape, "fp8_e4m3", seed=2).to(torch.bfloat16)
    x[:, :128] = 0.0  # all-zero blocks: scale 1
    for axes in ((1, 0), 1, 0):
        got = float8_cast.triton_quantize_float8(x.to(DEVICE), "fp8_e4m3", axes=axes, block=block,
                                                 power_of_2_scales=pow2)
        same_fp8(got, quantize_float8(x, "fp8_e4m3", axes=axes, block=block, power_of_2_scales=pow2),
                 f"axes {axes}")


def test_block_cast_epsilon_e5m2():
    x = torch.randn(130, 256) * 1e-4
    got = float8_cast.triton_quantize_float8(x.to(DEVICE), "fp8_e5m2", axes=(1, 0), block=(1, 128),
                                             amax_epsilon=1e-2, power_of_2_scales=False)
    same_fp8(got, quantize_float8(x, "fp8_e5m2", axes=(1, 0), block=(1, 128), amax_epsilon=1e-2))


@pytest.mark.parametrize("m,n,k", [(64, 96, 256), (40, 72, 200)])
def test_block_gemm_matches_dequantized_fp32(m, n, k):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, k)
    w = torch.randn(n, k, generator=g) * 0.05
    dy = torch.randn(m, n, generator=g)
    q = lambda t, block: quantize_float8(t, "fp8_e4m3", axes=(1, 0), block=block)  # noqa: E731
    xq, wq, dyq = q(x, (1, 128)), q(w, (128, 128)), q(dy, (1, 128))
    to = lambda t: t.to(DEVICE)  # noqa: E731
    xq, wq, dyq = (type(t)(tuple(p.to(DEVICE) for p in t.planes), t.fmt, t.shape, t.dtype, None)
                   for t in (xq, wq, dyq))
    bias = to(torch.randn(n, generator=g))
    cases = {
        "fprop": (dict(a=xq, b=wq, a_axis=1, b_axis=1, bias=bias),
                  xq.dequantize(torch.float32, 1) @ wq.dequantize(torch.float32, 1).t() + bias),
        "dgrad": (dict(a=dyq, b=wq, a_axis=1, b_axis=0), dyq.dequantize(torch.float32, 1) @ wq.dequantize(
            torch.float32, 0)),
        "wgrad": (dict(a=dyq, b=xq, a_axis=0, b_axis=0), dyq.dequantize(torch.float32, 0).t() @ xq.dequantize(
            torch.float32, 0)),
    }
    for name, (kw, want) in cases.items():
        got = block_fp8_gemm(kw.pop("a"), kw.pop("b"), out_dtype=torch.float32, BM=32, BN=32, **kw)
        err = ((got.double() - want.double()).norm() / want.double().norm()).item()
        assert err <= 1e-6, (name, err)
