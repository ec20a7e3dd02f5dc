"""transpose_bytes: the Triton transpose of one-byte elements against torch's (the reference), and its errors."""

import os

import pytest
import torch

from mxtrain.kernels import registry
from mxtrain.kernels._triton_utils import device_supported
from mxtrain.kernels.transpose import transpose_bytes, transpose_bytes_many

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET", "0") == "1" or not torch.cuda.is_available() else "cuda"
TRITON = device_supported(torch.device(DEVICE)) and any(k.backend == "triton"
                                                        for k in registry.kernels("transpose_bytes"))


@pytest.mark.parametrize("shape", [(1, 1), (3, 130), (64, 64), (65, 127), (200, 72), (0, 5)])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_transpose_bytes_equals_torch(shape, dtype, backend):
    if backend == "triton" and not TRITON:
        pytest.skip("needs Triton (CUDA or TRITON_INTERPRET=1)")
    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    src = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).to(DEVICE).view(dtype)
    want = src.t().contiguous()
    got = transpose_bytes(src, backend=backend)
    assert got.dtype == dtype and got.shape == want.shape and got.is_contiguous()
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    # into a given output, and from a row slice of a wider buffer (rows contiguous, a longer stride)
    wide = torch.randint(0, 256, (shape[0], shape[1] + 7), dtype=torch.uint8, generator=g).to(DEVICE).view(dtype)
    out = torch.empty((shape[1], shape[0]), dtype=dtype, device=DEVICE)
    assert transpose_bytes(wide[:, :shape[1]], out, backend=backend) is out
    assert torch.equal(out.view(torch.uint8), wide[:, :shape[1]].t().contiguous().view(torch.uint8))


def test_transpose_bytes_errors():
    with pytest.raises(ValueError, match="one-byte elements"):
        transpose_bytes(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="one-byte elements"):
        transpose_bytes(torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="out must be"):
        transpose_bytes(torch.zeros(4, 3, dtype=torch.uint8), torch.empty(4, 3, dtype=torch.uint8))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_transpose_bytes_many_equals_each_alone(backend):
    """Seven tensors (two launches of four on Triton, one of them empty, one a row slice of a wider buffer, FP8 and
    uint8): each output is its source's transpose, as transpose_bytes makes it."""
    if backend == "triton" and not TRITON:
        pytest.skip("needs Triton (CUDA or TRITON_INTERPRET=1)")
    g = torch.Generator().manual_seed(7)
    shapes = [(3, 130), (64, 64), (0, 5), (65, 127), (200, 72), (1, 1), (129, 257)]
    dtypes = [torch.float8_e4m3fn, torch.uint8, torch.float8_e5m2] * 3
    srcs = [torch.randint(0, 256, s, dtype=torch.uint8, generator=g).to(DEVICE).view(d) for s, d in zip(shapes, dtypes)]
    wide = torch.randint(0, 256, (40, 90), dtype=torch.uint8, generator=g).to(DEVICE)
    srcs.append(wide[:, :33])
    outs = [torch.empty(s.shape[1], s.shape[0], dtype=s.dtype, device=DEVICE) for s in srcs]
    got = transpose_bytes_many(srcs, outs, backend=backend)
    assert len(got) == len(outs) and all(a is b for a, b in zip(got, outs))
    for src, out in zip(srcs, outs):
        assert torch.equal(out.view(torch.uint8), src.t().contiguous().view(torch.uint8)), tuple(src.shape)
    assert transpose_bytes_many([], [], backend=backend) == []


def test_transpose_bytes_many_errors():
    a = torch.zeros(4, 3, dtype=torch.uint8)
    with pytest.raises(ValueError, match="2 sources but 1 outputs"):
        transpose_bytes_many([a, a], [torch.empty(3, 4, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="source 1 must be a 2-D tensor of one-byte elements"):
        transpose_bytes_many([a, torch.zeros(4, 3)], [torch.empty(3, 4, dtype=torch.uint8)] * 2)
    with pytest.raises(ValueError, match=r"output 0 must be torch.uint8 of shape \(3, 4\)"):
        transpose_bytes_many([a], [torch.empty(4, 3, dtype=torch.uint8)])


def test_a_grouped_kernel_that_writes_wrong_bytes_is_left_for_torchs_copy(monkeypatch):
    """The grouped kernel's first launch on a device is checked against torch's transpose: one that writes wrong
    bytes there is marked broken for the device and the call (and every later one) runs torch's copy."""
    if not TRITON:
        pytest.skip("needs Triton (CUDA or TRITON_INTERPRET=1)")
    from mxtrain.kernels import transpose as tr

    class Wrong:  # launches nothing: the outputs keep what they held
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    monkeypatch.setattr(tr, "_transpose_group_kernel", Wrong())
    monkeypatch.setattr(tr, "_VERIFIED", set())
    monkeypatch.setattr(registry, "_BROKEN", {})
    src = torch.arange(12, dtype=torch.uint8, device=DEVICE).view(3, 4)
    out = torch.zeros(4, 3, dtype=torch.uint8, device=DEVICE)
    transpose_bytes_many([src], [out], backend="triton")
    assert torch.equal(out, src.t())
    assert any("wrote wrong bytes" in why for why in registry.broken("transpose_bytes_many").values())
