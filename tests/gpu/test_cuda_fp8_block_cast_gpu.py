"""GPU checks of the CUDA C++ FP8 block cast (mxtrain/csrc/fp8_block_cast.cu).

Its codes and scale-inverses equal the Triton block cast's bit for bit without a prologue and with
relu / squared_relu / silu (and their gradients), and the reference ``quantize_float8``'s without a
transcendental prologue: 1x128 and
128x128 blocks, every dtype, both formats, power-of-2 scales, an amax epsilon, ragged shapes, special
values. With gelu / gelu_tanh (the CUDA math library's erff / tanhf, which differ from Triton's
libdevice in the last bit for some inputs) and silu, the source may differ from torch's unfused one
by an fp32 ulp: checked against its reference cast within one step. Bias sums equal the Triton ones to fp32 rounding
(another summation order).
"""

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") == "1",
                                 reason="TRITON_INTERPRET=1 would interpret the kernels")]

if torch.cuda.is_available():
    from mxtrain.kernels import cuda_cast  # noqa: E402

    if cuda_cast.toolchain_problem() is not None:
        pytest.skip(f"CUDA extension cannot build here: {cuda_cast.toolchain_problem()}", allow_module_level=True)

pytest.importorskip("triton", reason="triton is not installed")

from mxtrain import config  # noqa: E402
from mxtrain.kernels.float8_cast import block_cast_float8  # noqa: E402
from mxtrain.quantization.float8 import quantize_float8  # noqa: E402

DEV = torch.device("cuda")


def source(rows, cols, dtype, seed=0, special=True):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(rows, cols, generator=g, device=DEV) * 3
    x *= torch.exp2(torch.randint(-8, 9, (rows, 1), generator=g, device=DEV).float())
    if special:
        x[0, :6] = torch.tensor([0.0, -0.0, 1e-3, -1e-3, 1e-30, -1e-38])
        x[1, :128] = 0.0                          # a zero row block
        x[2, 5] = float("nan")                    # NaN: its blocks get scale 1, the NaN code
        x[3, 7] = float("inf")
        x[min(130, rows - 1), 9] = -float("inf")
        x[4, 10:20] = 6e4                         # saturating values in e4m3 blocks with a zero scale
    return x.to(dtype)


def run(x, fmt, block, cuda, **kw):
    with config.override(fp8_block_cast="auto" if cuda else "triton", cuda_kernels=True):
        return block_cast_float8(x, fmt, block, **kw)


def same(qa, qb):
    for a, b in zip(qa.planes, qb.planes):
        assert a.axis == b.axis
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)), f"axis {a.axis} codes differ"
        assert torch.equal(a.scale_inv.view(torch.int32), b.scale_inv.view(torch.int32)), f"axis {a.axis} scales"
    assert len(qa.planes) == len(qb.planes)


def test_cuda_path_is_taken(monkeypatch):
    calls = []
    real = cuda_cast.fp8_block_cast
    monkeypatch.setattr(cuda_cast, "fp8_block_cast", lambda *a, **k: calls.append(1) or real(*a, **k))
    block_cast_float8(source(256, 256, torch.bfloat16), "fp8_e4m3", (1, 128), rowwise=True, columnwise=True)
    assert calls


@pytest.mark.parametrize("dtype", [torch.bfloat16,  # the quick tier runs bf16; the full tier every dtype
                                   pytest.param(torch.float16, marks=pytest.mark.exhaustive),
                                   pytest.param(torch.float32, marks=pytest.mark.exhaustive)], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("block", [(1, 128), (128, 128)], ids=["1x128", "128x128"])
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_plain_cast_equals_triton_and_reference(fmt, block, dtype):
    x = source(272, 400, dtype, seed=1)  # ragged: 272 = 2*128 + 16 rows, 400 = 3*128 + 16 columns
    got, _ = run(x, fmt, block, True, rowwise=True, columnwise=True)
    want, _ = run(x, fmt, block, False, rowwise=True, columnwise=True)
    same(got, want)
    ref = quantize_float8(x, fmt, axes=(1, 0), block=block)
    same(got, ref)


@pytest.mark.parametrize("opts", [dict(power_of_2_scales=True), dict(amax_epsilon=1e-3),
                                  dict(power_of_2_scales=True, amax_epsilon=2.0 ** -20)], ids=["pow2", "eps", "both"])
@pytest.mark.parametrize("block", [(1, 128), (128, 128)], ids=["1x128", "128x128"])
def test_scale_options(block, opts):
    x = source(256, 384, torch.bfloat16, seed=2)
    got, _ = run(x, "fp8_e4m3", block, True, rowwise=True, columnwise=True, **opts)
    same(got, run(x, "fp8_e4m3", block, False, rowwise=True, columnwise=True, **opts)[0])
    same(got, quantize_float8(x, "fp8_e4m3", axes=(1, 0), block=block, **opts))


@pytest.mark.parametrize("planes", [(True, False), (False, True)], ids=["rowwise", "columnwise"])
def test_single_planes(planes):
    x = source(144, 264, torch.bfloat16, seed=3)
    got, _ = run(x, "fp8_e4m3", (1, 128), True, rowwise=planes[0], columnwise=planes[1])
    same(got, run(x, "fp8_e4m3", (1, 128), False, rowwise=planes[0], columnwise=planes[1])[0])


EXACT_ACTS = ("relu", "squared_relu")  # exact arithmetic: bit-identical everywhere
# bit-identical to the Triton cast: expf agrees with libdevice's; the CUDA math library's erff (gelu)
# and tanhf (gelu_tanh) differ from libdevice's in the last bit for some inputs
BIT_EQUAL_ACTS = EXACT_ACTS + ("silu",)


def code_distance(a, b):
    """|a - b| in FP8 code steps for same-sign codes (sign-magnitude bytes)."""
    a, b = a.view(torch.uint8).to(torch.int32), b.view(torch.uint8).to(torch.int32)
    return torch.where((a >> 7) == (b >> 7), ((a & 0x7F) - (b & 0x7F)).abs(), (a & 0x7F) + (b & 0x7F))


def close_to_unfused(q, src, block):
    """``q`` against the reference cast of torch's unfused source: the CUDA math library's erff/expf/tanhf
    may differ from torch's kernels by an fp32 ulp, so an element rounded to the dtype, a block amax
    and so a scale can move by one step, and a code by one step where it sits on a boundary."""
    ref = quantize_float8(src, q.fmt, axes=(1, 0), block=block)
    for axis in (1, 0):
        a, b = q.plane(axis), ref.plane(axis)
        same_scale = (a.scale_inv == b.scale_inv).float().mean().item()
        assert same_scale > 0.95, f"axis {axis}: only {same_scale:.3f} of the blocks have the reference's scale"
        if same_scale == 1.0:
            d = code_distance(a.data, b.data)
            assert d.max() <= 1 and (d != 0).float().mean() < 0.01, (d.max(), (d != 0).float().mean())
    torch.testing.assert_close(q.dequantize(torch.float32), src.float(), rtol=0.15,
                               atol=float(ref.plane(1).scale_inv.max()) * 4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "relu", "squared_relu", "silu"])
def test_activation_prologue(act, dtype):
    from mxtrain.modules.activations import activation

    h = source(1024, 2048, dtype, seed=4, special=False)
    src = activation(h, act)
    for block in ((1, 128), (128, 128)):
        got, db = run(h, "fp8_e4m3", block, True, rowwise=True, columnwise=True, act=act, dbias=True)
        want, db_t = run(h, "fp8_e4m3", block, False, rowwise=True, columnwise=True, act=act, dbias=True)
        if act in BIT_EQUAL_ACTS:
            same(got, want)
        if act in EXACT_ACTS:
            same(got, quantize_float8(src, "fp8_e4m3", axes=(1, 0), block=block))
        else:
            close_to_unfused(got, src, block)
        torch.testing.assert_close(db, db_t, rtol=1e-4, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("act", ["gelu", "relu", "silu"])
def test_activation_grad_prologue_and_dbias(act, dtype):
    from mxtrain.modules.activations import activation_backward

    h = source(512, 1024, dtype, seed=5, special=False)
    da = source(512, 1024, dtype, seed=6, special=False)
    src = activation_backward(h, da, act)
    got, db = run(h, "fp8_e5m2", (1, 128), True, rowwise=True, columnwise=True, act=act, grad=da, dbias=True)
    want, db_t = run(h, "fp8_e5m2", (1, 128), False, rowwise=True, columnwise=True, act=act, grad=da, dbias=True)
    if act in BIT_EQUAL_ACTS:
        same(got, want)
    if act not in EXACT_ACTS:
        close_to_unfused(got, src, (1, 128))
    torch.testing.assert_close(db, db_t, rtol=1e-4, atol=1e-2)
    torch.testing.assert_close(db.double(), src.double().sum(0), rtol=1e-3, atol=5e-2)


def test_unsupported_shapes_take_triton(monkeypatch):
    calls = []
    real = cuda_cast.fp8_block_cast
    monkeypatch.setattr(cuda_cast, "fp8_block_cast", lambda *a, **k: calls.append(real(*a, **k)) or calls[-1])
    x = source(100, 256, torch.bfloat16, seed=7)  # 100 rows: not a multiple of 16 for the columnwise plane
    got, _ = block_cast_float8(x, "fp8_e4m3", (1, 128), rowwise=True, columnwise=True)
    assert calls == []  # refused by the CUDA kernel's supports(): never launched
    same(got, quantize_float8(x, "fp8_e4m3", axes=(1, 0), block=(1, 128)))
    assert "multiple of 16 rows" in cuda_cast.fp8_block_unsupported(x, None, True)
    assert "multiple of 16 rows" in cuda_cast.fp8_block_unsupported(x, None, False)  # one backend per source
    assert "rows of a multiple of 8" in cuda_cast.fp8_block_unsupported(source(64, 36, torch.bfloat16), None, False)
