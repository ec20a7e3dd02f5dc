"""Smoke-level checks of the MX reference; the oracle suites live beside this file."""

import pytest
import torch

from mxtrain.formats import MX_FORMAT_NAMES
from mxtrain.quantization import MXTensor, fake_quantize_mx, quantize_mx


@pytest.mark.parametrize("fmt", MX_FORMAT_NAMES)
@pytest.mark.parametrize("scale_mode", ["floor", "rceil", "even"])
def test_fake_quant_equals_two_step(fmt, scale_mode):
    torch.manual_seed(0)
    x = torch.randn(8, 96) * torch.exp2(torch.randint(-20, 20, (8, 1)).float())
    x[0, 5] = -0.0
    x[1, :40] = 0.0
    two_step = quantize_mx(x, fmt, scale_mode=scale_mode).dequantize()
    fused = fake_quantize_mx(x, fmt, scale_mode=scale_mode)
    assert torch.equal(two_step.view(torch.int32), fused.view(torch.int32))


def test_roundtrip_save_load(tmp_path):
    x = torch.randn(16, 64)
    m = quantize_mx(x, "fp6_e2m3", axis=(-1, 0))
    torch.save(m, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt")
    assert isinstance(loaded, MXTensor)
    assert torch.equal(loaded.dequantize(), m.dequantize())
    assert torch.equal(loaded.dequantize(axis=0), m.dequantize(axis=0))
    assert "fp6_e2m3" in repr(loaded) and "columnwise" in repr(loaded)
