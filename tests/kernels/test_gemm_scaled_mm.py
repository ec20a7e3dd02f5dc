"""The sm_100+ MX GEMM path (``torch._scaled_mm`` with 1x32 E8M0 scales), on the CPU.

The lent GPUs are Hopper, which has no block-scaled tensor cores, so this path cannot run here.
These tests check everything mxtrain hands to ``torch._scaled_mm`` against an emulation of what
cuBLAS documents it computes. The emulation un-swizzles the scales with the documented index
formula, written out element by element, and multiplies the dequantized operands in float64.
Checked: which plane each GEMM uses, its fp8 view, the scale layout, the padding, and the bias.
"""

import pytest
import torch

from mxtrain.kernels import gemm
from mxtrain.kernels.dispatch import reference_gemm
from mxtrain.quantization import quantize_mx

pytestmark = pytest.mark.skipif(not hasattr(torch, "float8_e8m0fnu"), reason="needs torch.float8_e8m0fnu")


def unblock(flat: torch.Tensor, rows: int, nblocks: int) -> torch.Tensor:
    """[rows, nblocks] E8M0 bytes back from cuBLAS's layout, by the documented formula, one element at a time."""
    raw = flat.view(torch.uint8)
    tiles_per_row = -(-nblocks // 4)
    out = torch.empty(rows, nblocks, dtype=torch.uint8)
    for r in range(rows):
        for c in range(nblocks):
            tile = (r // 128) * tiles_per_row + c // 4
            out[r, c] = raw[tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4]
    return out


def emulated_scaled_mm(a, b, scale_a, scale_b, *, out_dtype, bias=None, **_):
    """What cuBLAS computes for MXFP8 x MXFP8: sum_k a[m, k] * 2^(sa[m, k/32] - 127) * b[k, n] * 2^(sb[n, k/32] - 127)."""
    assert a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and b.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    assert scale_a.dtype == scale_b.dtype == torch.float8_e8m0fnu
    assert a.is_contiguous() and b.t().is_contiguous()  # A row-major, B column-major: K contiguous in both
    m, k = a.shape
    n = b.shape[1]
    sa, sb = unblock(scale_a, m, k // 32), unblock(scale_b, n, k // 32)
    pa = torch.exp2(sa.double() - 127).repeat_interleave(32, dim=1)
    pb = torch.exp2(sb.double() - 127).repeat_interleave(32, dim=1)
    av = a.double() * pa
    bv = b.t().double() * pb
    out = av @ bv.t()
    if bias is not None:
        out = out + bias.double()
    return out.to(out_dtype)


def test_blocked_scales_layout():
    g = torch.Generator().manual_seed(0)
    for rows, cols in ((128, 4), (200, 7), (16, 1), (300, 12)):
        s = torch.randint(0, 255, (rows, cols), generator=g, dtype=torch.uint8)
        flat = gemm.blocked_scales(s)
        assert flat.dtype == torch.float8_e8m0fnu
        assert flat.numel() == (-(-rows // 128) * 128) * (-(-cols // 4) * 4)
        assert torch.equal(unblock(flat, rows, cols), s)
    with pytest.raises(ValueError, match="2-D uint8"):
        gemm.blocked_scales(torch.zeros(4, 4))


@pytest.mark.parametrize("fmts", (("fp8_e4m3", "fp8_e4m3"), ("fp8_e4m3", "fp8_e5m2"), ("fp8_e5m2", "fp8_e4m3")))
def test_scaled_mm_gemm_matches_reference(monkeypatch, fmts):
    """fprop, dgrad and wgrad orientations at ragged sizes (K of 3 blocks; 200 tokens: a padded
    columnwise block), with and without bias: equal to the reference GEMM of the dequantized operands."""
    monkeypatch.setattr(torch, "_scaled_mm", emulated_scaled_mm)
    g = torch.Generator().manual_seed(1)
    M, K, N = 208, 96, 48
    x = torch.randn(M, K, generator=g) * 3
    w = torch.randn(N, K, generator=g) * 0.2
    dy = torch.randn(M, N, generator=g)
    x[5, :7] = 1e-30  # a block far below the others
    xq = quantize_mx(x, fmts[0], axis=(-1, 0), scale_mode="rceil")
    wq = quantize_mx(w, fmts[1], axis=(-1, 0))
    dyq = quantize_mx(dy, fmts[1], axis=(-1, 0))
    bias = torch.randn(N, generator=g)
    for a, b, aa, ba, bias_ in ((xq, wq, 1, 1, bias), (xq, wq, 1, 1, None), (dyq, wq, 1, 0, None), (dyq, xq, 0, 0, None)):
        if a.fmt == b.fmt == "fp8_e5m2":
            continue
        assert gemm.scaled_mm_unsupported(a, b, aa, ba) is None
        got = gemm.scaled_mm_mx_gemm(a, b, a_axis=aa, b_axis=ba, out_dtype=torch.float32, bias=bias_)
        want = reference_gemm(a, b, a_axis=aa, b_axis=ba, out_dtype=torch.float32, bias=bias_)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_scaled_mm_unsupported_reasons():
    x = torch.randn(64, 64)
    q8 = quantize_mx(x, "fp8_e4m3", axis=(-1, 0))
    assert "formats" in gemm.scaled_mm_unsupported(q8, quantize_mx(x, "fp4_e2m1"), 1, 1)
    e5 = quantize_mx(x, "fp8_e5m2")
    assert "e5m2 x e5m2" in gemm.scaled_mm_unsupported(e5, e5, 1, 1)
    assert "block size 32" in gemm.scaled_mm_unsupported(q8, quantize_mx(x, "fp8_e4m3", block_size=16), 1, 1)
    assert "rows % 16" in gemm.scaled_mm_unsupported(q8, quantize_mx(torch.randn(40, 64), "fp8_e4m3"), 1, 1)
    assert "MXTensors" in gemm.scaled_mm_unsupported(q8, x, 1, 1)
    assert "no codes" in gemm.scaled_mm_unsupported(quantize_mx(x, "fp8_e4m3", axis=-1), q8, 0, 1)
    with pytest.raises(ValueError, match="scaled_mm_mx_gemm"):
        gemm.scaled_mm_mx_gemm(q8, x)


def test_native_mx_gemm_is_off_on_cpu_and_when_disabled(mx_config):
    assert not gemm.native_mx_gemm(torch.device("cpu"))
    mx_config(mx_scaled_mm=False)
    assert not gemm.native_mx_gemm(torch.device("cuda", 0))
