"""The fused unpack + dequantize kernel against MXTensor.dequantize: bit-identical values.

Interpreter on CPU (conftest), compiled on a GPU. Small shapes.
"""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from kernel_helpers import adversarial_matrix, values_equal  # noqa: E402

from mxtrain.formats import MX_FORMAT_NAMES, parse_format  # noqa: E402
from mxtrain.kernels import dequantize as dq  # noqa: E402
from mxtrain.kernels.dispatch import dequantize  # noqa: E402
from mxtrain.quantization import MXPlane, MXTensor, pack_codes, quantize_mx  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check(mxt, dtype=None, axis=None):
    got = dq.triton_dequantize(mxt, dtype, axis)
    want = mxt.cpu().dequantize(dtype, axis)
    assert values_equal(got, want), f"{mxt.fmt} dtype={dtype} axis={axis}"


@pytest.mark.parametrize("fmt", MX_FORMAT_NAMES)
@pytest.mark.parametrize("pack", (True, False))
def test_roundtrip_both_planes(kdevice, fmt, pack):
    """Ragged 40x72 adversarial data: both planes (the columnwise one written transposed), every dtype."""
    x = adversarial_matrix(40, 72, seed=21)
    mxt = quantize_mx(x, fmt, block_size=32, axis=(-1, 0), scale_mode="rceil", pack=pack).to(kdevice)
    for dtype in DTYPES:
        for axis in (1, 0):
            check(mxt, dtype, axis)
    check(mxt)  # defaults: the quantized dtype, the first plane


@pytest.mark.parametrize("fmt", MX_FORMAT_NAMES)
def test_every_code_every_scale_edge(kdevice, fmt):
    """Every code of the format under scales 2**-127 (subnormal fp32 products), 2**-126, 1, 2**127 and NaN."""
    f = parse_format(fmt)
    n = 2**f.bits
    scales = torch.tensor([0, 1, 2, 20, 100, 127, 140, 200, 250, 254, 255], dtype=torch.uint8)
    codes = torch.arange(n, dtype=torch.int32).repeat(-(-256 // n))[:256].to(torch.uint8)
    codes = codes.reshape(1, 256).repeat(len(scales), 1)  # 8 blocks of 32 per row
    scale = scales.reshape(-1, 1).repeat(1, 8)
    for pack in (True, False):
        data = pack_codes(codes, f) if pack else codes
        mxt = MXTensor(planes=(MXPlane(data, scale, 1, pack),), fmt=fmt, block_size=32,
                       shape=(len(scales), 256), dtype=torch.float32).to(kdevice)
        for dtype in DTYPES:
            check(mxt, dtype)


@pytest.mark.parametrize("bs", (4, 8, 64, 128, 512))
def test_block_sizes_and_nd(kdevice, bs):
    x = adversarial_matrix(24, 136, seed=bs).reshape(4, 6, 136)
    for fmt in ("fp8_e5m2", "fp6_e3m2", "fp4_e2m1", "int2"):
        mxt = quantize_mx(x, fmt, block_size=bs, axis=(-1, 0)).to(kdevice)
        check(mxt, torch.bfloat16, -1)
        check(mxt, torch.float32, 0)


def test_fallbacks(kdevice):
    x = adversarial_matrix(8, 48, seed=30)
    for mxt in (quantize_mx(x, "int8", block_size=0), quantize_mx(x, "int8", block_size=24),
                quantize_mx(x.reshape(2, 4, 48), "fp4_e2m1", axis=1)):
        check(mxt.to(kdevice), torch.float32)


def test_dispatch_dequantize(kdevice):
    x = adversarial_matrix(40, 72, seed=31)
    mxt = quantize_mx(x, "fp6_e2m3", axis=(-1, 0)).to(kdevice)
    got = dequantize(mxt, torch.bfloat16, 0, backend="triton")
    assert values_equal(got, dequantize(mxt.cpu(), torch.bfloat16, 0, backend="reference"))


@pytest.mark.parametrize("fmt", ("fp8_e4m3", "fp4_e2m1", "fp6_e3m2"))
def test_dequantize_into_a_slice(kdevice, fmt):
    """``out=``: each plane written into rows of a larger buffer (as the FSDP all-gather fills a weight
    rank by rank); the values are the reference's bit for bit and nothing outside the slice changes."""
    x = adversarial_matrix(64, 96, seed=3).to(kdevice)
    mxt = quantize_mx(x, fmt, block_size=32, axis=(-1, 0))
    for axis in (1, 0):
        for dtype in (torch.bfloat16, torch.float32):
            buf = torch.full((160, 96), -3.5, dtype=dtype, device=kdevice)
            got = dq.triton_dequantize(mxt, dtype, axis, out=buf[40:104])
            assert got.data_ptr() == buf[40:104].data_ptr()
            assert values_equal(buf[40:104], mxt.dequantize(dtype, axis))
            assert (buf[:40] == -3.5).all() and (buf[104:] == -3.5).all()
    with pytest.raises(ValueError, match="out must be"):
        dq.triton_dequantize(mxt, torch.bfloat16, 1, out=torch.empty(64, 95, dtype=torch.bfloat16, device=kdevice))


def _gather_buffer(shards, axis, device):
    """Each shard's plane (codes then scales) packed rank after rank into one uint8 buffer, as
    ``fsdp_pre_all_gather`` sends them; returns the buffer viewed [ranks, per_rank] and the sizes."""
    chunks = []
    for s in shards:
        p = s.plane(axis)
        chunks.append(torch.cat([p.data.reshape(-1), p.scale.reshape(-1)]))
    return torch.stack(chunks).to(device), shards[0].plane(axis).data.numel(), shards[0].plane(axis).scale.numel()


@pytest.mark.parametrize("fmt", ("fp8_e4m3", "fp4_e2m1", "fp6_e2m3"))
@pytest.mark.parametrize("ranks", (1, 2, 3))
def test_dequantize_shards_one_launch(kdevice, fmt, ranks):
    """``triton_dequantize_shards``: the rank chunks of an all-gather buffer dequantized in one launch into
    the full weight: each rank's rows equal the reference dequantize of that rank's shard bit for bit, in
    both plane orientations and output dtypes, and the rows of a larger output around them stay as they were."""
    from mxtrain.quantization import MXPlane as Plane

    rows, cols = 64, 96
    full = adversarial_matrix(rows * ranks, cols, seed=11 + ranks)
    shards = [quantize_mx(full[r * rows:(r + 1) * rows], fmt, block_size=32, axis=(1, 0)) for r in range(ranks)]
    for axis in (1, 0):
        per_rank, nd, ns = _gather_buffer(shards, axis, kdevice)
        p0 = shards[0].plane(axis)
        first = MXTensor(planes=(Plane(data=per_rank[0, :nd].view(p0.data.shape),
                                       scale=per_rank[0, nd:nd + ns].view(p0.scale.shape), axis=axis,
                                       packed=p0.packed),),
                         fmt=shards[0].fmt, block_size=32, shape=(rows, cols), dtype=shards[0].dtype)
        for dtype in (torch.bfloat16, torch.float32):
            buf = torch.full((rows * ranks + 8, cols), -3.5, dtype=dtype, device=kdevice)
            out = buf[4:4 + rows * ranks]
            got = dq.triton_dequantize_shards(first, ranks, per_rank.stride(0), per_rank.stride(0), out, axis)
            assert got.data_ptr() == out.data_ptr()
            for r in range(ranks):
                assert values_equal(out[r * rows:(r + 1) * rows], shards[r].dequantize(dtype, axis)), (axis, r)
            assert (buf[:4] == -3.5).all() and (buf[4 + rows * ranks:] == -3.5).all()
    with pytest.raises(ValueError, match="out must have shape"):
        dq.triton_dequantize_shards(first, ranks, per_rank.stride(0), per_rank.stride(0),
                                    torch.empty(rows * ranks + 1, cols, device=kdevice), 0)
    with pytest.raises(ValueError, match="run past the storage"):
        dq.triton_dequantize_shards(first, ranks + 1, per_rank.stride(0), per_rank.stride(0),
                                    torch.empty(rows * (ranks + 1), cols, device=kdevice), 0)
