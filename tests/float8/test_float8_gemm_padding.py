"""FP8 GEMMs of sizes the tensor-core kernels do not take (K, N not multiples of 16; K not of 128 for block
scales): the operands are zero-padded and the output cut back, which must give the GEMM of the unpadded operands.
On the CPU: torch._scaled_mm (which takes any size here) and the block kernel under the Triton interpreter."""

import dataclasses
import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from mxtrain.kernels import float8_gemm as fg  # noqa: E402
from mxtrain.quantization.float8 import Float8Plane, quantize_float8  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PRECISE_TOL, FAST_TOL = 5e-4, 1e-2  # norm-relative error of Hopper FP8 GEMMs: split / fast accumulation


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()
interpret = os.environ.get("TRITON_INTERPRET") == "1" or DEVICE == "cuda"


def test_pad_plane_zero_codes_and_unit_block_scales():
    q = quantize_float8(torch.randn(40, 200), "fp8_e4m3", axes=(1,), block=(1, 128))
    p = q.plane(1)
    padded = fg.pad_plane(p, 48, 256)
    assert padded.data.shape == (48, 256) and padded.data.dtype == p.data.dtype
    assert torch.equal(padded.data[:40, :200].view(torch.uint8), p.data.view(torch.uint8))
    assert not padded.data[40:].view(torch.uint8).any() and not padded.data[:, 200:].view(torch.uint8).any()
    assert padded.scale_inv.shape == (48, 2) and torch.equal(padded.scale_inv[:40], p.scale_inv)
    assert torch.equal(padded.scale_inv[40:], torch.ones(8, 2))
    assert fg.pad_plane(p, 40, 200) is p
    with pytest.raises(ValueError, match="at least its size"):
        fg.pad_plane(p, 32, 200)


@pytest.mark.parametrize("m,n,k", [(37, 50, 40), (64, 48, 2946 % 512)])
def test_padded_per_tensor_gemm_equals_unpadded(m, n, k):
    if DEVICE == "cpu" and not hasattr(torch, "_scaled_mm"):
        pytest.skip("torch._scaled_mm is missing")
    g = torch.Generator().manual_seed(0)
    a = quantize_float8(torch.randn(m, k, generator=g), "fp8_e4m3", axes=(1,))
    b = quantize_float8(torch.randn(n, k, generator=g), "fp8_e4m3", axes=(1,))
    pa, pb = (t.plane(1).to(DEVICE) for t in (a, b))
    bias = torch.randn(n, generator=g).to(DEVICE, torch.bfloat16)
    want = (a.dequantize(torch.float32, 1) @ b.dequantize(torch.float32, 1).t()).to(DEVICE)
    got = fg._padded(fg._scaled_mm_planes, pa, pb, 1, 16, 16, torch.float32, None, fast=False)
    assert got.shape == (m, n) and got.is_contiguous()
    if DEVICE == "cpu":
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    else:  # Hopper's FP8 tensor cores accumulate below fp32 (benchmarks/NOTES_float8.md): test_float8_gpu's bound
        assert _rel(got, want) <= PRECISE_TOL, _rel(got, want)
    got_b = fg._padded(fg._scaled_mm_planes, pa, pb, 1, 16, 16, torch.bfloat16, bias, fast=False)
    torch.testing.assert_close(got_b.float(), (want + bias.float()), rtol=2 ** -7, atol=1e-2)


@pytest.mark.skipif(not interpret, reason="the Triton kernel needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("m,n,k", [(40, 72, 200), (17, 33, 130)])
def test_padded_block_gemm_equals_unpadded_bit_for_bit(m, n, k):
    """Zero codes add zero partial products and the added blocks' scale 1 multiplies them: the padded block
    GEMM (what cuBLAS gets) equals the masked kernel on the unpadded operands exactly."""
    g = torch.Generator().manual_seed(1)
    x = quantize_float8(torch.randn(m, k, generator=g), "fp8_e4m3", axes=(1, 0), block=(1, 128))
    w = quantize_float8(torch.randn(n, k, generator=g) * 0.05, "fp8_e4m3", axes=(1, 0), block=(128, 128))
    pairs = {"fprop": (x.plane(1), w.plane(1)), "dgrad-like": (x.plane(1), x.plane(1))}
    for name, (pa, pb) in pairs.items():
        pa, pb = pa.to(DEVICE), pb.to(DEVICE)
        plain = fg._block_fp8_planes(pa, pb, out_dtype=torch.float32, bias=None, BM=32, BN=32)
        padded = fg._padded(fg._block_fp8_planes, pa, pb, 16, 16, 128, torch.float32, None, BM=32, BN=32)
        assert padded.shape == plain.shape
        assert torch.equal(padded, plain), name


def test_float8_planes_keep_their_values_under_padding():
    """The dequantized values of a padded plane, cut back, are the plane's (scales included)."""
    q = quantize_float8(torch.randn(20, 300), "fp8_e5m2", axes=(1,), block=(1, 128))
    p = q.plane(1)
    padded = fg.pad_plane(p, 32, 384)
    assert isinstance(padded, Float8Plane)
    assert torch.equal(padded.values()[:20, :300], p.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (float8_gemm's routing)")
@pytest.mark.parametrize("block", [None, ((1, 128), (128, 128))])
def test_cuda_gemm_of_ragged_sizes_runs_on_the_tensor_cores(monkeypatch, block):
    """A wgrad-shaped GEMM whose K is a token count (2946) and whose N is not a multiple of 16: the kernels get
    padded operands; the fp32 GEMM of dequantized operands (the fallback) is never called."""
    def no_fallback(*a, **k):
        raise AssertionError("float8_gemm fell back to the fp32 GEMM of dequantized operands")
    monkeypatch.setattr(fg, "fallback_gemm", no_fallback)
    g = torch.Generator().manual_seed(2)
    ba, bb = block or (None, None)
    a = quantize_float8(torch.randn(200, 2946, generator=g), "fp8_e5m2", axes=(1,), block=ba)
    b = quantize_float8(torch.randn(1000, 2946, generator=g), "fp8_e4m3", axes=(1,), block=bb)
    a, b = (type(t)(tuple(p.to("cuda") for p in t.planes), t.fmt, t.shape, t.dtype, None) for t in (a, b))
    want = a.dequantize(torch.float32, 1) @ b.dequantize(torch.float32, 1).t()
    got = fg.float8_gemm(a, b, a_axis=1, b_axis=1, out_dtype=torch.float32)
    # axes (1, 1) take cuBLAS's fast accumulation (the fprop setting): test_float8_gpu's bound for it
    assert got.shape == (200, 1000) and _rel(got, want) <= FAST_TOL, _rel(got, want)


def test_scale_that_is_an_element_of_a_larger_tensor():
    """FSDP2's FP8 gathers compute a unit's scales in one tensor and hand each weight an element of it: an
    address cuBLASLt refuses unless 16-byte aligned (CUBLAS_STATUS_NOT_SUPPORTED on an H100). The GEMM gives
    what it gives with a scale of its own."""
    if DEVICE == "cpu" and not hasattr(torch, "_scaled_mm"):
        pytest.skip("torch._scaled_mm is missing")
    g = torch.Generator().manual_seed(3)
    a = quantize_float8(torch.randn(64, 64, generator=g), "fp8_e4m3", axes=(1,))
    b = quantize_float8(torch.randn(32, 64, generator=g), "fp8_e4m3", axes=(1,))
    pa, pb = (t.plane(1).to(DEVICE) for t in (a, b))
    unit = torch.stack([pa.scale_inv, pb.scale_inv]).reshape(2)
    shifted = dataclasses.replace(pb, scale_inv=unit[1])  # 4 bytes into the unit's tensor
    assert shifted.scale_inv.data_ptr() % 16 == 4
    want = fg._scaled_mm_planes(pa, pb, fast=False, out_dtype=torch.float32, bias=None)
    got = fg._scaled_mm_planes(pa, shifted, fast=False, out_dtype=torch.float32, bias=None)
    assert torch.equal(got, want)
