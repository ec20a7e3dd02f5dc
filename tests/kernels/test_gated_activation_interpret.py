"""Gated activation kernels (swiglu, geglu, geglu_tanh, reglu) on the Triton interpreter against torch.

On the CPU torch's libm differs from the kernels' by up to an ulp of fp32 in the activation, which
bf16 rounding almost always hides; the GPU test (tests/gpu/test_kernels_gpu.py) checks CUDA.
"""

import pytest
import torch

from mxtrain.kernels._triton_utils import interpret_mode, kernels_available
from mxtrain.modules.activations import activation, activation_backward

pytestmark = pytest.mark.skipif(not (kernels_available() and interpret_mode()),
                                reason="needs Triton with TRITON_INTERPRET=1")

GATED = ["swiglu", "geglu", "geglu_tanh", "reglu"]


def _close(a, b, dtype):
    # a few ulps of the dtype where the interpreter's fp32 exp differs from torch's libm; atol for values near
    # zero, where the interpreter's tanh (from a sigmoid) and torch's give results either side of an underflow
    rtol = {torch.float32: 5e-7, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(a, b, rtol=rtol, atol=2e-5, equal_nan=True)


@pytest.mark.parametrize("name", GATED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(37, 140), (3, 2), (1, 4098)])
def test_forward_and_backward_match_torch(name, dtype, shape):
    from mxtrain.kernels.gated_activation import gated_activation, gated_activation_backward

    torch.manual_seed(0)
    h = (torch.randn(shape) * 3).to(dtype)
    h[0, :2] = torch.tensor([float("inf"), float("nan")]) if shape[1] > 2 else h[0, :2]
    g = torch.randn(shape[0], shape[1] // 2).to(dtype)
    y, dh = gated_activation(h, name), gated_activation_backward(h, g, name)
    assert y.dtype == dh.dtype == dtype and y.shape == g.shape and dh.shape == h.shape
    _close(y, activation(h, name), dtype)
    _close(dh, activation_backward(h, g, name), dtype)


def test_bf16_swiglu_equals_torch_bit_for_bit():
    from mxtrain.kernels.gated_activation import gated_activation, gated_activation_backward

    torch.manual_seed(1)
    h = torch.randn(64, 512).bfloat16()
    g = torch.randn(64, 256).bfloat16()
    assert torch.equal(gated_activation(h, "swiglu"), activation(h, "swiglu"))
    assert torch.equal(gated_activation_backward(h, g, "swiglu"), activation_backward(h, g, "swiglu"))


def test_empty_and_strided_rows():
    from mxtrain.kernels.gated_activation import gated_activation, gated_activation_backward

    assert gated_activation(torch.empty(0, 8), "swiglu").shape == (0, 4)
    assert gated_activation_backward(torch.empty(0, 8), torch.empty(0, 4), "swiglu").shape == (0, 8)
    big = torch.randn(6, 20)
    h = big[::2, 2:18]  # rows strided, columns contiguous
    torch.testing.assert_close(gated_activation(h, "reglu"), activation(h.contiguous(), "reglu"), rtol=0, atol=0)


def test_bad_inputs_are_refused():
    from mxtrain.kernels.gated_activation import gated_activation, gated_activation_backward

    with pytest.raises(ValueError, match="not a gated activation"):
        gated_activation(torch.randn(4, 8), "gelu")
    with pytest.raises(ValueError, match="row-contiguous"):
        gated_activation(torch.randn(8, 4).t(), "swiglu")
    with pytest.raises(ValueError, match="row-contiguous"):
        gated_activation(torch.randn(4, 7), "swiglu")
    with pytest.raises(ValueError, match="grad must be"):
        gated_activation_backward(torch.randn(4, 8), torch.randn(4, 8), "swiglu")


def _abs_max_rows(t):
    a = torch.where(torch.isnan(t), torch.tensor(float("inf")), t.float().abs())
    return a.amax(1) if t.shape[1] else torch.zeros(t.shape[0])


@pytest.mark.parametrize("tile", [(4, 512), (1, 1024), (2, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_maxima_beside_the_output(monkeypatch, tile, dtype):
    """``row_amax=True``: the same output, and per row the max |output| over each program's columns (NaN as
    +Inf): exact, for tiles of several rows over a row count that is not a multiple of them."""
    import mxtrain.kernels.gated_activation as ga

    monkeypatch.setattr(ga, "TILE", tile)
    torch.manual_seed(2)
    h = (torch.randn(37, 2 * 150) * 3).to(dtype)
    h[0, 3] = float("nan")
    h[5, 150 + 7] = float("inf")
    g = torch.randn(37, 150).to(dtype)
    y, m = ga.gated_activation(h, "swiglu", row_amax=True)
    dh, md = ga.gated_activation_backward(h, g, "swiglu", row_amax=True)
    pieces = -(-150 // min(tile[1], 256))
    assert m.shape == md.shape == (37, pieces) and m.dtype == md.dtype == torch.float32
    torch.testing.assert_close(y, ga.gated_activation(h, "swiglu"), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(dh, ga.gated_activation_backward(h, g, "swiglu"), rtol=0, atol=0, equal_nan=True)
    assert torch.equal(m.amax(1), _abs_max_rows(y)) and torch.equal(md.amax(1), _abs_max_rows(dh))
    assert m[0].amax() == float("inf") and md[0].amax() == float("inf")  # the NaN row
    assert ga.gated_activation(torch.empty(0, 8), "swiglu", row_amax=True)[1].shape == (0, 1)
