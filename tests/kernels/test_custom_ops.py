"""torch.library.opcheck of every registered mxtrain op (schema, fake implementation, autograd registration,
AOT dispatch), on the CPU with small shapes; the GPU backends run inside the same ops."""

import pytest
import torch

import mxtrain  # noqa: F401  (registers the ops)
from mxtrain.kernels import dispatch


def _x(*shape, dtype=torch.float32):
    torch.manual_seed(0)
    return (torch.randn(*shape) * 3).to(dtype)


QUANTIZE_MX = [  # x, fmt, block_size, axes, scale_mode, rounding, seed, pack, dequantized, values dtype, keep
    (_x(6, 40), "fp8_e4m3", 32, [1, 0], "floor", "even", None, True, [], torch.bfloat16, [1, 0]),
    (_x(4, 64, dtype=torch.bfloat16), "fp4_e2m1", 32, [1], "rceil", "nearest", None, True, [], torch.bfloat16, [1]),
    (_x(8, 32), "fp6_e3m2", 0, [0], "even", "even", None, True, [], torch.bfloat16, [0]),
    (_x(8, 32), "int8", 16, [1, 0], "floor", "stochastic", 7, False, [1], torch.float32, [0]),
    (_x(2, 3, 32), "fp8_e5m2", 32, [2, 1], "floor", "even", None, True, [2], torch.bfloat16, [1]),
]


@pytest.mark.parametrize("args", QUANTIZE_MX, ids=lambda a: f"{a[1]}-{a[3]}")
def test_opcheck_quantize_mx(args):
    torch.library.opcheck(torch.ops.mxtrain.quantize_mx.default, (*args, None))


@pytest.mark.parametrize("axis", [1, 0])
def test_opcheck_dequantize(axis):
    mxt = dispatch.quantize(_x(6, 40), "fp4_e2m1", axis=axis)
    p = mxt.plane(axis)
    torch.library.opcheck(torch.ops.mxtrain.dequantize_mx.default,
                          (p.data, p.scale, mxt.fmt, mxt.block_size, list(mxt.shape), mxt.dtype, mxt.scale_mode,
                           mxt.rounding, mxt.whole_axis, p.axis, p.packed, torch.bfloat16, None))
    torch.library.opcheck(torch.ops.mxtrain.dequantize_plane.default, (p.data, p.scale, "fp4_e2m1", True, 6 if
                                                                       axis == 0 else 40, torch.float32))


@pytest.mark.parametrize("block", [None, [1, 32], [16, 16]])
def test_opcheck_quantize_float8(block):
    x = _x(20, 40, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.mxtrain.quantize_float8.default,
                          (x, "fp8_e4m3", [1, 0], None, block, block is not None, 0.0, None))
    if block is None:  # a given (delayed) scale
        torch.library.opcheck(torch.ops.mxtrain.quantize_float8.default,
                              (x, "fp8_e5m2", [1], torch.tensor(0.5), None, False, 0.0, None))


def _gemm_args(a, a_axis, b, b_axis, bias=None, out_dtype=torch.float32):
    (ta, ma), (tb, mb) = dispatch._operand_parts(a, a_axis), dispatch._operand_parts(b, b_axis)
    return (ta, ma, tb, mb, a_axis, b_axis, out_dtype, bias, None)


def test_opcheck_mx_gemm():
    x, w, dy = _x(8, 64), _x(32, 64) / 4, _x(8, 32)
    mx, mw = dispatch.quantize(x, "fp8_e4m3", axis=(1, 0)), dispatch.quantize(w, "fp4_e2m1", axis=(1, 0))
    mdy = dispatch.quantize(dy, "fp8_e5m2", axis=(1, 0), dequantized=(1,), keep_codes=(0,))
    gemm = torch.ops.mxtrain.mx_gemm.default
    torch.library.opcheck(gemm, _gemm_args(mx, 1, mw, 1, bias=_x(32), out_dtype=torch.bfloat16))  # fprop
    torch.library.opcheck(gemm, _gemm_args(mdy, 1, mw, 0))  # dgrad: dy carried as values
    torch.library.opcheck(gemm, _gemm_args(mdy, 0, x, 0))  # wgrad, a high-precision operand
    fx = dispatch.quantize_float8(x, "fp8_e4m3", axes=(1, 0), block=(1, 32))
    fw = dispatch.quantize_float8(w, "fp8_e4m3", axes=(1, 0))
    # test_schema compares float8 inputs with arithmetic torch lacks for float8 on the CPU: the other checks
    torch.library.opcheck(gemm, _gemm_args(fx.only(1), 1, fw.only(1), 1),
                          test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"))
    assert torch.equal(dispatch.mx_gemm(fx.only(1), fw.only(1)),
                       dispatch.reference_gemm(fx.only(1), fw.only(1), a_axis=1, b_axis=1, out_dtype=torch.float32))


def test_opcheck_quantize_elemwise():
    x = _x(4, 33)
    for fmt, rounding, seed in (("bfloat12", "even", None), ("fp8_e4m3", "stochastic", 3), ("fp6_e2m3", "floor", None)):
        torch.library.opcheck(torch.ops.mxtrain.quantize_elemwise.default, (x, fmt, rounding, True, True, seed))


def test_quantize_through_the_op_matches_the_reference():
    """The Python API rebuilds MXTensor / Float8Tensor from the ops' outputs: same planes as the reference casts."""
    from mxtrain.quantization import quantize_mx
    from mxtrain.quantization.float8 import quantize_float8

    x = _x(12, 70)
    for fmt in ("fp8_e4m3", "fp4_e2m1", "fp6_e3m2"):
        got, want = dispatch.quantize(x, fmt, axis=(1, 0)), quantize_mx(x, fmt, axis=(1, 0))
        assert [p.axis for p in got.planes] == [p.axis for p in want.planes] and got.block_size == want.block_size
        for p, q in zip(got.planes, want.planes):
            assert torch.equal(p.data, q.data) and torch.equal(p.scale, q.scale)
    for block in (None, (128, 128), (1, 32)):
        got, want = dispatch.quantize_float8(x, "fp8_e4m3", axes=(1, 0), block=block), quantize_float8(x, axes=(1, 0), block=block)
        for p, q in zip(got.planes, want.planes):
            assert p.data.view(torch.uint8).equal(q.data.view(torch.uint8)) and torch.equal(p.scale_inv, q.scale_inv)
        assert (got.amax is None) == (want.amax is None) and (got.amax is None or torch.equal(got.amax, want.amax))
