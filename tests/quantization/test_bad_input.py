"""Bad arguments fail loudly, with messages that say what is allowed."""

import pytest
import torch

from mxtrain.formats import MX_FORMAT_NAMES, parse_elemwise_format, parse_format
from mxtrain.quantization import fake_quantize_mx, quantize_elemwise, quantize_mx

MX_FUNCS = [quantize_mx, fake_quantize_mx]
X = torch.randn(4, 32)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.int8, torch.bool,
                                   torch.complex64, torch.float64])
@pytest.mark.parametrize("func", MX_FUNCS + [lambda x: quantize_elemwise(x, "bfloat16")])
def test_unsupported_dtypes_raise_type_error(func, dtype):
    x = torch.ones(4, 32).to(dtype)
    with pytest.raises(TypeError, match="float32"):
        func(x) if func not in MX_FUNCS else func(x, "fp8_e4m3")


def test_float64_hint_and_non_tensors():
    with pytest.raises(TypeError, match="float64"):
        quantize_mx(torch.ones(32, dtype=torch.float64), "fp8_e4m3")
    with pytest.raises(TypeError):
        quantize_mx([1.0, 2.0], "fp8_e4m3")
    with pytest.raises(TypeError):
        quantize_elemwise(1.0, "bfloat16")


@pytest.mark.parametrize("func", MX_FUNCS)
@pytest.mark.parametrize("block_size,exc", [(-1, ValueError), (-32, ValueError), (True, TypeError),
                                            (False, TypeError), (32.0, TypeError), ("32", TypeError),
                                            (None, TypeError)])
def test_bad_block_sizes(func, block_size, exc):
    with pytest.raises(exc, match="block_size"):
        func(X, "fp8_e4m3", block_size=block_size)


@pytest.mark.parametrize("func", MX_FUNCS)
@pytest.mark.parametrize("axis,exc", [(2, ValueError), (-3, ValueError), (100, ValueError),
                                      (1.0, TypeError), (True, TypeError), ("0", TypeError)])
def test_bad_axis(func, axis, exc):
    with pytest.raises(exc):
        func(X, "fp8_e4m3", axis=axis)


def test_bad_axis_tuples_and_0d():
    with pytest.raises(ValueError, match="out of range"):
        quantize_mx(X, "fp8_e4m3", axis=(0, 2))
    with pytest.raises(ValueError, match="twice"):
        quantize_mx(X, "fp8_e4m3", axis=(1, -1))
    with pytest.raises(ValueError):
        quantize_mx(X, "fp8_e4m3", axis=())
    with pytest.raises(ValueError, match="0-d"):
        quantize_mx(torch.tensor(1.0), "fp8_e4m3")


@pytest.mark.parametrize("func", MX_FUNCS)
def test_unknown_format_lists_the_valid_names(func):
    with pytest.raises(ValueError) as err:
        func(X, "fp7_e4m2")
    for name in MX_FORMAT_NAMES:
        assert name in str(err.value)
    with pytest.raises(ValueError, match="elementwise"):
        func(X, parse_elemwise_format("bfloat16"))  # an elementwise-only format is not an MX element
    with pytest.raises(ValueError):
        func(X, "bfloat16")
    with pytest.raises(TypeError):
        func(X, 8)


@pytest.mark.parametrize("func", MX_FUNCS)
def test_unknown_scale_mode_lists_allowed(func):
    with pytest.raises(ValueError) as err:
        func(X, "fp8_e4m3", scale_mode="ceil")
    for allowed in ("floor", "rceil", "even"):
        assert allowed in str(err.value)
    with pytest.raises(ValueError):
        func(X, "fp8_e4m3", scale_mode=None)


@pytest.mark.parametrize("func", MX_FUNCS + [quantize_elemwise])
def test_unknown_rounding_lists_allowed(func):
    fmt = "bfloat16" if func is quantize_elemwise else "fp8_e4m3"
    with pytest.raises(ValueError) as err:
        func(X, fmt, rounding="round_half_up")
    for allowed in ("even", "nearest", "floor", "stochastic"):
        assert allowed in str(err.value)


def test_names_are_case_insensitive():
    assert parse_format("MXFP8") is parse_format("fp8_e4m3")
    m = quantize_mx(X, "FP8_E4M3", scale_mode="RCEIL", rounding="Nearest")
    assert (m.scale_mode, m.rounding) == ("rceil", "nearest")


@pytest.mark.parametrize("name", ["fp6_e2m3", "fp6_e3m2"])
def test_fp6_packing_needs_multiple_of_4(name):
    # the packed axis is the whole padded axis (nblocks * block_size), not each block
    x = torch.randn(2, 18)
    with pytest.raises(ValueError, match="pack=False"):
        quantize_mx(x, name, block_size=6)
    with pytest.raises(ValueError, match="pack=False"):
        quantize_mx(torch.randn(2, 6), name, block_size=0)
    with pytest.raises(ValueError, match="pack=False"):
        quantize_mx(torch.randn(2, 5), name, block_size=1)
    m = quantize_mx(x, name, block_size=6, pack=False)  # the suggested way out works
    assert m.codes().shape == (2, 18) and m.plane().scale.shape == (2, 3)


@pytest.mark.parametrize("name", ["fp4_e2m1", "int4", "int2"])
def test_sub_byte_packing_needs_whole_bytes(name):
    with pytest.raises(ValueError, match="pack=False"):
        quantize_mx(torch.randn(2, 3), name, block_size=3)
    assert quantize_mx(torch.randn(2, 3), name, block_size=3, pack=False).codes().shape == (2, 3)


@pytest.mark.parametrize("name", ["bfloat9", "bfloat33", "bfloat0", "fp5", "fp33", "bf8", "float3"])
def test_elementwise_widths_out_of_range(name):
    with pytest.raises(ValueError, match="width"):
        parse_elemwise_format(name)
    with pytest.raises(ValueError):
        quantize_elemwise(X, name)


def test_unknown_elementwise_format_lists_families():
    with pytest.raises(ValueError) as err:
        quantize_elemwise(X, "posit8")
    assert "bfloatN" in str(err.value) and "fpN" in str(err.value)


def test_bad_seed():
    with pytest.raises(TypeError, match="seed"):
        quantize_mx(X, "fp8_e4m3", rounding="stochastic", seed=1.5)
    with pytest.raises(TypeError, match="seed"):
        quantize_elemwise(X, "bfloat16", rounding="stochastic", seed="1")
