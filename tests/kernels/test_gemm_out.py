"""``mx_gemm(out=...)``: the result written into a given tensor (GroupedLinear's experts fill their rows of
one output). CPU: every operand kind's result equals the one without ``out``, bit for bit, and lands in a
row slice of a larger tensor; bad ``out`` arguments are clear errors. The GPU case (the per-tensor FP8 GEMM
writing ``out`` itself) is in tests/gpu/test_float8_gpu.py."""

import pytest
import torch

from mxtrain.kernels.dispatch import mx_gemm
from mxtrain.quantization import quantize_mx
from mxtrain.quantization.float8 import quantize_float8


def _operands(kind, m=24, n=40, k=64):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    if kind == "hp":
        return a, b
    if kind == "mx":
        return quantize_mx(a, "fp8_e4m3", axis=-1), quantize_mx(b, "fp8_e4m3", axis=-1)
    return quantize_float8(a, "fp8_e4m3"), quantize_float8(b, "fp8_e4m3")


@pytest.mark.parametrize("kind", ["hp", "mx", "fp8"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_out_holds_the_same_bits_in_a_row_slice(kind, out_dtype):
    a, b = _operands(kind)
    bias = torch.randn(40)
    want = mx_gemm(a, b, out_dtype=out_dtype, bias=bias)
    big = torch.full((50, 40), 7.0, dtype=out_dtype)
    got = mx_gemm(a, b, out_dtype=out_dtype, bias=bias, out=big[10:34])
    assert got.data_ptr() == big[10:34].data_ptr() and got.shape == (24, 40)
    assert torch.equal(big[10:34], want)
    assert (big[:10] == 7).all() and (big[34:] == 7).all()  # rows outside the slice untouched


def test_bad_out_is_a_clear_error():
    a, b = _operands("fp8")
    with pytest.raises(ValueError, match=r"contiguous \[24, 40\] tensor of out_dtype torch.float32"):
        mx_gemm(a, b, out=torch.empty(24, 41))
    with pytest.raises(ValueError, match="out_dtype torch.bfloat16, got .* torch.float32"):
        mx_gemm(a, b, out_dtype=torch.bfloat16, out=torch.empty(24, 40))
    with pytest.raises(ValueError, match="not contiguous"):
        mx_gemm(a, b, out=torch.empty(40, 24).t())
    with pytest.raises(TypeError, match="out must be a torch.Tensor"):
        mx_gemm(a, b, out=[0.0])
