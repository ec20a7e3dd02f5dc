"""The cast that also writes the dequantized operand (``dequantized=``): values bit-exact vs quantize + dequantize.

Runs on Triton's CPU interpreter where there is no CUDA (conftest sets TRITON_INTERPRET=1),
compiled on the GPU otherwise (there the fp8 codes come from the hardware conversion and are
decoded back by it). Shapes stay small: the interpreter is slow.
"""

import io

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from kernel_helpers import adversarial_matrix, as_dtype, planes_equal, values_equal  # noqa: E402

from mxtrain.kernels import cast, dispatch  # noqa: E402
from mxtrain.quantization import MXTensor, quantize_mx  # noqa: E402


def check_values(x, fmt, dequantized, keep_codes=None, dtype=torch.bfloat16, **kw):
    """Triton cast with values vs the reference quantize + dequantize; returns the kernel's MXTensor."""
    axis = kw.pop("axis", (-1, 0))
    got = cast.triton_quantize(x, fmt, axis=axis, dequantized=dequantized, dequantized_dtype=dtype,
                               keep_codes=keep_codes, **kw)
    want = quantize_mx(x.cpu(), fmt, axis=axis, **kw)
    deq, keep = dispatch.values_request(x.ndim, axis, dequantized, keep_codes, dtype)
    assert [p.axis for p in got.planes] == [p.axis for p in want.planes if p.axis in keep]
    kept = MXTensor(planes=tuple(p for p in want.planes if p.axis in keep), fmt=want.fmt,
                    block_size=want.block_size, shape=want.shape, dtype=want.dtype, scale_mode=want.scale_mode,
                    rounding=want.rounding) if keep else None
    if kept is not None:
        problems = planes_equal(dispatch.attach_values(got, (), dtype, keep), kept)
        assert not problems, f"{fmt} {kw}: " + "; ".join(problems)
    assert [a for a, _ in got.values] == list(deq)
    for a in deq:
        v = got.dequantized_values(a)
        assert v.dtype == dtype and tuple(v.shape) == tuple(x.shape)
        ref = want.dequantize(dtype, a)
        assert values_equal(v, ref), (fmt, kw, a, dtype, (v.cpu().float() != ref.float()).sum().item())
    return got


@pytest.mark.parametrize("fmt", ("fp8_e4m3", "fp8_e5m2", "fp6_e2m3", "fp6_e3m2", "fp4_e2m1", "int8", "int4", "int2"))
def test_both_planes_values_adversarial(kdevice, fmt):
    """Ragged 40x72 adversarial fp32 (subnormals, ties, NaN/Inf/zero blocks): both planes' values, codes kept."""
    x = adversarial_matrix(40, 72, seed=21).to(kdevice)
    for scale_mode, rounding in (("floor", "even"), ("rceil", "nearest")):
        check_values(x, fmt, (1, 0), scale_mode=scale_mode, rounding=rounding)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32, torch.float16))
@pytest.mark.parametrize("in_dtype", (torch.bfloat16, torch.float32))
def test_values_dtypes(kdevice, dtype, in_dtype):
    x = as_dtype(adversarial_matrix(40, 72, seed=22), in_dtype).to(kdevice)
    check_values(x, "fp8_e4m3", (1, 0), dtype=dtype)
    check_values(x, "fp4_e2m1", (-1,), dtype=dtype, scale_mode="even", rounding="floor")


def test_values_only_planes(kdevice):
    """Codes skipped for the dequantized plane (the forward-operand case), kept for the other one."""
    x = as_dtype(adversarial_matrix(72, 40, seed=23), torch.bfloat16).to(kdevice)
    got = check_values(x, "fp8_e4m3", (1,), keep_codes=(0,))
    assert got.rowwise is None and got.columnwise is not None
    assert got.nbytes == got.columnwise.data.numel() + got.columnwise.scale.numel()  # values not counted
    got = check_values(x, "fp8_e4m3", (0,), keep_codes=(1,))
    assert got.columnwise is None and got.rowwise is not None
    got = check_values(x, "int8", (1, 0), keep_codes=())  # no codes at all
    assert got.planes == () and got.nbytes == 0
    # a single plane, values only
    got = check_values(x, "fp6_e2m3", (-1,), keep_codes=(), axis=-1)
    assert got.planes == ()


@pytest.mark.parametrize("bs", (16, 64, 256))
def test_values_block_sizes(kdevice, bs):
    """Block 256 takes one launch per plane (the values of each from its own launch)."""
    x = adversarial_matrix(40, 136, seed=bs, block=min(bs, 32)).to(kdevice)
    for fmt in ("fp8_e4m3", "fp4_e2m1"):
        check_values(x, fmt, (1, 0), block_size=bs)
        check_values(x, fmt, (1,), keep_codes=(0,), block_size=bs)


def test_values_nd_and_strided(kdevice):
    x = adversarial_matrix(48, 72, seed=24).to(kdevice)
    x3 = x.reshape(4, 12, 72)
    check_values(x3, "fp8_e5m2", (2,), axis=(2, 0))
    check_values(x3, "int4", (0,), keep_codes=(2,), axis=(2, 0))
    check_values(x.t(), "fp8_e4m3", (1, 0))  # strided input


def test_stochastic_values_match_own_codes(kdevice):
    """Stochastic codes differ from the reference's, but the values are those of the kernel's codes."""
    x = torch.full((64, 64), 1.125, device=kdevice)
    x[:, ::32] = 6.0
    got = cast.triton_quantize(x, "fp4_e2m1", axis=(-1, 0), rounding="stochastic", seed=5,
                               dequantized=(1, 0), dequantized_dtype=torch.float32)
    for a in (1, 0):
        assert values_equal(got.dequantized_values(a), got.dequantize(torch.float32, a))
    again = cast.triton_quantize(x, "fp4_e2m1", axis=(-1, 0), rounding="stochastic", seed=5)
    assert not planes_equal(dispatch.attach_values(got, (), torch.float32, (1, 0)), again)


def test_dispatch_backends_agree(kdevice):
    """quantize(..., dequantized=) on the reference backend (quantize, then dequantize) and on Triton."""
    x = as_dtype(adversarial_matrix(40, 72, seed=25), torch.bfloat16).to(kdevice)
    kw = dict(axis=(1, 0), dequantized=(1,), keep_codes=(0,))
    ref = dispatch.quantize(x, "fp8_e4m3", backend="reference", **kw)
    tri = dispatch.quantize(x, "fp8_e4m3", backend="triton", **kw)
    assert not planes_equal(ref, tri)
    assert values_equal(ref.dequantized_values(1), tri.dequantized_values(1))
    assert ref.rowwise is None and ref.columnwise is not None
    # an unsupported case (axis 1 of a 3-D tensor) falls back to the reference, values included
    x3 = x[:36].reshape(3, 12, 72)
    got = dispatch.quantize(x3, "fp8_e4m3", axis=1, dequantized=(1,), backend="triton")
    assert values_equal(got.dequantized_values(1), quantize_mx(x3.cpu(), "fp8_e4m3", axis=1).dequantize(
        torch.bfloat16, 1))
    with pytest.raises(ValueError, match="among the quantized axes"):
        dispatch.quantize(x, "fp8_e4m3", axis=1, dequantized=(0,))
    with pytest.raises(ValueError, match="codes kept or its values"):
        dispatch.quantize(x, "fp8_e4m3", axis=(1, 0), dequantized=(1,), keep_codes=(1,))


def test_gemm_operand_uses_carried_values(kdevice):
    """The cuBLAS path's operand is the carried tensor itself (no pass), bit-identical to dequantizing."""
    from mxtrain.kernels import gemm

    x = as_dtype(adversarial_matrix(40, 64, seed=26), torch.bfloat16).to(kdevice)
    x = torch.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0)
    full = dispatch.quantize(x, "fp8_e4m3", axis=(1, 0), dequantized=(1, 0))
    only = dispatch.quantize(x, "fp8_e4m3", axis=(1, 0), dequantized=(1, 0), keep_codes=())
    for a in (1, 0):
        op = gemm._operand(full, a, torch.bfloat16)
        assert op.data_ptr() == full.dequantized_values(a).data_ptr()
        want = full.dequantize(torch.bfloat16, a)
        assert values_equal(op if a == 1 else op.t(), want)
        # another dtype: from the codes where kept, else the values widened (exact for a bf16 input)
        assert values_equal(gemm._operand(full, a, torch.float32).contiguous(),
                            (full.dequantize(torch.float32, a) if a == 1 else full.dequantize(torch.float32, a).t()
                             ).contiguous())
        assert values_equal(gemm._operand(only, a, torch.float32).contiguous(),
                            gemm._operand(full, a, torch.float32).contiguous())
    # the reference GEMM path reads values-only operands too
    y = torch.randn(40, 64, device=kdevice).to(torch.bfloat16)
    full = dispatch.quantize(y, "fp8_e4m3", axis=(1, 0), dequantized=(1, 0))
    only = dispatch.quantize(y, "fp8_e4m3", axis=(1, 0), dequantized=(1, 0), keep_codes=())
    for a in (1, 0):
        ref = dispatch.mx_gemm(only, only, a_axis=a, b_axis=a, backend="reference")
        assert torch.equal(ref, dispatch.mx_gemm(full, full, a_axis=a, b_axis=a, backend="reference"))


def test_mxtensor_values_field(tmp_path):
    x = torch.randn(64, 96).to(torch.bfloat16)
    m = dispatch.quantize(x, "fp8_e4m3", axis=(1, 0), dequantized=(1,), keep_codes=(0,), backend="reference")
    assert m.device == x.device and "dequantized values" in repr(m)
    with pytest.raises(ValueError, match="no plane"):
        m.plane(1)
    assert values_equal(m.dequantize(torch.float32, 1), m.dequantized_values(1).float())
    assert m.values_only(1) is not None and m.values_only(0) is None
    assert m.dequantize_blocked(torch.bfloat16, 1).shape == (64, 96)
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    back = torch.load(buf)  # weights_only default: MXTensor is an allowed global
    assert back.values[0][0] == 1 and torch.equal(back.values[0][1], m.values[0][1])
    assert not planes_equal(back, m) and back.nbytes == m.nbytes
    moved = m.to("cpu")
    assert moved.values[0][1].device.type == "cpu"
    with pytest.raises(ValueError, match="at least one plane"):
        MXTensor(planes=(), fmt="fp8_e4m3", block_size=32, shape=(64, 96), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="shape"):
        MXTensor(planes=(), fmt="fp8_e4m3", block_size=32, shape=(64, 96), dtype=torch.bfloat16,
                 values=((1, torch.zeros(3)),))
    with pytest.raises(TypeError, match="pairs"):
        MXTensor(planes=(), fmt="fp8_e4m3", block_size=32, shape=(64, 96), dtype=torch.bfloat16,
                 values=(torch.zeros(64, 96),))


def test_quantizer_cpu_unchanged():
    """On the CPU a Quantizer's cast carries no values (identical behaviour); the rule picks axes on CUDA only."""
    from mxtrain.modules import _common
    from mxtrain.modules._quantizer import make_quantizers
    from mxtrain.recipes import MXFP8Recipe

    x = torch.randn(64, 64).to(torch.bfloat16)
    row, col = make_quantizers(MXFP8Recipe())[""].input.quantize(x)
    assert row.values == () and col.values == () and row.rowwise is not None and col.columnwise is not None
    assert _common._used_at_once(x, (1, 0)) == ()
    w = torch.nn.Parameter(x.clone())
    assert _common._used_at_once(w, (1, 0)) == ()


# ---------------------------------------------------------------- the strip kernel (columnwise-friendly tiles)

STRIPS = ((8, 16, 64, 4), (4, 32, 64, 4))


@pytest.mark.parametrize("strip", STRIPS, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("fmt", ("fp8_e4m3", "fp8_e5m2", "fp6_e2m3", "fp4_e2m1", "int8", "int2"))
def test_strip_kernel_bit_exact(mx_config, kdevice, strip, fmt):
    """Rows taken as j*REP + rep: same codes, scales and values as the reference (ragged 140x72 adversarial)."""
    mx_config(cast_strip=strip)
    x = adversarial_matrix(140, 72, seed=27).to(kdevice)
    check_values(x, fmt, (1, 0), scale_mode="rceil", rounding="nearest")
    check_values(as_dtype(x, torch.bfloat16), fmt, (1,), keep_codes=(0,))
    check_values(x, fmt, (0,), axis=0)  # the columnwise plane alone
    got = cast.triton_quantize(x, fmt, axis=(-1, 0), scale_mode="even", rounding="floor")
    assert not planes_equal(got, quantize_mx(x.cpu(), fmt, axis=(-1, 0), scale_mode="even", rounding="floor"))


@pytest.mark.parametrize("bs", (8, 16, 64))
def test_strip_kernel_block_sizes(mx_config, kdevice, bs):
    mx_config(cast_strip=(8, 16, 64, 4))
    x = adversarial_matrix(136, 136, seed=28, block=min(bs, 32)).to(kdevice)
    for fmt in ("fp8_e4m3", "fp4_e2m1"):
        check_values(x, fmt, (1, 0), block_size=bs)


def test_strip_kernel_stochastic_same_stream(mx_config, kdevice):
    """The strip kernel draws the same Philox numbers per element as the tile kernel: identical planes."""
    x = torch.randn(96, 128, device=kdevice)
    mx_config(cast_strip=None)
    a = cast.triton_quantize(x, "fp4_e2m1", axis=(-1, 0), rounding="stochastic", seed=3)
    mx_config(cast_strip=(8, 16, 64, 4))
    b = cast.triton_quantize(x, "fp4_e2m1", axis=(-1, 0), rounding="stochastic", seed=3)
    assert not planes_equal(a, b)


def test_values_request_traces_without_dynamos_lru_cache_warning():
    """Under torch.compile the request is worked out as plain Python: dynamo warns on every lru_cache-wrapped
    function it traces through (a user saw one such warning per compiled module on CUDA). Same answer as eager."""
    import warnings

    want = dispatch.values_request(2, (0, 1), (1,), None, torch.bfloat16)

    def f(x):
        deq, keep = dispatch.values_request(2, (0, 1), (1,), None, torch.bfloat16)
        return x * (len(deq) + 10 * len(keep))

    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = torch.compile(f, fullgraph=True, backend="eager")(torch.ones(3))
    torch._dynamo.reset()
    assert not [w for w in seen if "lru_cache" in str(w.message)], [str(w.message)[:200] for w in seen]
    assert torch.equal(got, torch.ones(3) * (len(want[0]) + 10 * len(want[1])))
