"""MX GEMM on the GPU against a float64 matmul of the dequantized operands (skipped without CUDA)."""

import pytest
import torch

from mxtrain.kernels.dispatch import mx_gemm, quantize

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPES = [(8192, 8192, 8192), (4096, 14336, 4096), (1000, 3000, 1760), (33, 65, 96), (1, 32, 32)]


def _rel_fro(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2", "fp6_e2m3", "fp4_e2m1", "int8"])
def test_three_training_gemms_match_float64(m, n, k, fmt):
    if m * n * k > 2**36 and fmt != "fp8_e4m3":
        pytest.skip("one format is enough at the largest shapes")
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    xq = quantize(x, fmt, 32, axis=(1, 0), scale_mode="rceil")
    wq = quantize(w, fmt, 32, axis=(1, 0), scale_mode="rceil")
    dyq = quantize(dy, fmt, 32, axis=(1, 0), scale_mode="rceil")
    deq = lambda t, ax: t.dequantize(torch.float32, axis=ax).double()  # noqa: E731
    cases = {
        "fprop": (mx_gemm(xq, wq, a_axis=1, b_axis=1), deq(xq, 1) @ deq(wq, 1).T),
        "dgrad": (mx_gemm(dyq, wq, a_axis=1, b_axis=0), deq(dyq, 1) @ deq(wq, 0)),
        "wgrad": (mx_gemm(dyq, xq, a_axis=0, b_axis=0), deq(dyq, 0).T @ deq(xq, 0)),
    }
    for name, (got, ref) in cases.items():
        assert got.dtype == torch.float32 and torch.isfinite(got).all(), name
        assert _rel_fro(got, ref) <= 1e-5, (name, _rel_fro(got, ref))


def test_bias_and_bf16_output_round_once():
    torch.manual_seed(1)
    x = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(768, 1024, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(768, device="cuda", dtype=torch.bfloat16)
    xq, wq = quantize(x, "fp8_e4m3", 32, axis=1), quantize(w, "fp8_e4m3", 32, axis=1)
    got = mx_gemm(xq, wq, out_dtype=torch.bfloat16, bias=bias)
    ref = (xq.dequantize(torch.float64) @ wq.dequantize(torch.float64).T + bias.double())
    assert got.dtype == torch.bfloat16
    assert _rel_fro(got, ref) <= 4e-3  # one bf16 rounding of the result


def test_gpu_gemm_matches_reference_backend():
    torch.manual_seed(2)
    x = torch.randn(256, 320, device="cuda")
    w = torch.randn(192, 320, device="cuda")
    xq, wq = quantize(x, "fp6_e3m2", 32, axis=1), quantize(w, "fp6_e3m2", 32, axis=1)
    got = mx_gemm(xq, wq)
    ref = mx_gemm(xq.cpu(), wq.cpu())
    assert _rel_fro(got.cpu(), ref) <= 1e-6


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp4_e2m1"])
def test_gemm_on_carried_values_is_bit_identical(fmt):
    """Operands carrying their dequantized bf16 values (cast writes them) give the very same GEMM results."""
    torch.manual_seed(3)
    x = torch.randn(1024, 768, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, 768, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
    plain = {n: quantize(t, fmt, 32, axis=(1, 0)) for n, t in (("x", x), ("w", w), ("dy", dy))}
    vals = {n: quantize(t, fmt, 32, axis=(1, 0), dequantized=(1, 0), keep_codes=())
            for n, t in (("x", x), ("w", w), ("dy", dy))}
    for ops in (plain, vals):
        ops["fprop"] = mx_gemm(ops["x"], ops["w"], a_axis=1, b_axis=1, out_dtype=torch.bfloat16)
        ops["dgrad"] = mx_gemm(ops["dy"], ops["w"], a_axis=1, b_axis=0, out_dtype=torch.bfloat16)
        ops["wgrad"] = mx_gemm(ops["dy"], ops["x"], a_axis=0, b_axis=0)
    for name in ("fprop", "dgrad", "wgrad"):
        assert torch.equal(plain[name], vals[name]), name
