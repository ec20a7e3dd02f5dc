"""Fused FP8 casts (activation / activation-gradient prologue, bias gradient) against the unfused ops.

``tensor_cast_float8`` computes ``act(h)`` or ``da * act'(h)`` inside the cast. Where the
activation is exact arithmetic (relu, squared_relu) the bytes must equal the reference cast
of torch's unfused result; for transcendental ones (gelu, silu) the fp32 value may differ from
torch's by an ulp, so an FP8 byte may move by one code where a value sits next to a rounding
boundary. LayerNormMLP under the FP8 recipes takes these casts; with relu its outputs and
gradients must be bit-identical to the unfused path.
"""

import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

import mxtrain  # noqa: E402
from mxtrain.kernels import float8_cast  # noqa: E402
from mxtrain.kernels.float8_cast import block_cast_float8, tensor_cast_float8  # noqa: E402
from mxtrain.modules.activations import activation, activation_backward  # noqa: E402
from mxtrain.quantization.float8 import quantize_float8  # noqa: E402
from mxtrain.recipes import DelayedScaling, Float8BlockScaling, Float8CurrentScaling  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = torch.device("cpu") if INTERPRET else torch.device("cuda")
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)


def _h(rows, cols, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, cols, generator=g) * 3
    h[0, :4] = torch.tensor([0.0, -0.0, 1e-3, -1e-3])
    return h.to(dtype).to(DEVICE)


def _bytes(q, axis):
    return q.plane(axis).data.view(torch.uint8).cpu()


def _code_distance(a, b):
    """|a - b| in FP8 code steps for same-sign codes (sign-magnitude bytes)."""
    a, b = a.to(torch.int32), b.to(torch.int32)
    sa, sb = a >> 7, b >> 7
    ma, mb = a & 0x7F, b & 0x7F
    return torch.where(sa == sb, (ma - mb).abs(), ma + mb)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_plain_cast_with_given_amax_and_dbias(dtype, fmt):
    x = _h(67, 45, dtype)
    want = quantize_float8(x, fmt, axes=(1, 0))
    q, db = tensor_cast_float8(x, fmt, rowwise=True, columnwise=True, amax=want.amax, dbias=True)
    assert torch.equal(_bytes(q, 1), _bytes(want, 1)) and torch.equal(_bytes(q, 0), _bytes(want, 0))
    assert torch.equal(q.scale_inv.cpu(), want.scale_inv.cpu())
    torch.testing.assert_close(db.cpu(), x.float().sum(0).cpu(), rtol=1e-5, atol=1e-5)
    q2, none = tensor_cast_float8(x, fmt, rowwise=True)  # amax pass in the kernel
    assert none is None and torch.equal(q2.amax.cpu(), want.amax.cpu())
    assert torch.equal(_bytes(q2, 1), _bytes(want, 1))


@pytest.mark.parametrize("programs", [1, 3, 4096])
@pytest.mark.parametrize("special", ["none", "inf", "nan", "max_in_last_tile"])
def test_current_scaling_amax_pass_with_few_programs(programs, special, monkeypatch):
    """The amax pass runs at most AMAX_PROGRAMS programs, each over every AMAX_PROGRAMS-th tile, and the cast
    kernel reduces their partial maxima itself: the reference's amax, scale_inv and bytes wherever the largest
    value (or an Inf / NaN) lies, with one program, a few, or one per tile; with a prologue (its source stored
    by the amax pass) too."""
    monkeypatch.setattr(float8_cast, "AMAX_PROGRAMS", programs)
    x = _h(100, 300, torch.bfloat16, seed=4)  # 4 x 3 tiles of 32 x 128, ragged at both edges
    if special == "inf":
        x[70, 290] = float("-inf")
    elif special == "nan":
        x[99, 5] = float("nan")
    elif special == "max_in_last_tile":
        x[98, 299] = 1000.0
    want = quantize_float8(x, "fp8_e4m3", axes=(1, 0))
    q, _ = tensor_cast_float8(x, "fp8_e4m3", rowwise=True, columnwise=True)
    assert torch.equal(q.amax.cpu(), want.amax.cpu()) or (special == "nan" and q.amax.isinf())
    assert torch.equal(q.scale_inv.cpu(), want.scale_inv.cpu())
    assert torch.equal(_bytes(q, 1), _bytes(want, 1)) and torch.equal(_bytes(q, 0), _bytes(want, 0))
    r, _ = tensor_cast_float8(x, "fp8_e4m3", rowwise=True, act="relu")  # prologue: the source stored, then cast
    want_r = quantize_float8(torch.relu(x), "fp8_e4m3", axes=(1,))
    assert torch.equal(r.amax.cpu(), want_r.amax.cpu()) or (special == "nan" and r.amax.isinf())
    assert torch.equal(r.scale_inv.cpu(), want_r.scale_inv.cpu())
    got, ref = _bytes(r, 1), _bytes(want_r, 1)
    nan = (ref & 0x7F) == 0x7F  # a NaN's code: its sign is what the arithmetic left (torch's relu sets it)
    assert torch.equal((got & 0x7F) == 0x7F, nan) and torch.equal(got[~nan], ref[~nan])


@pytest.mark.parametrize("act", ["relu", "squared_relu", "gelu", "silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_prologue(act, dtype):
    h = _h(70, 130, dtype, seed=1)
    a = activation(h, act)
    want = quantize_float8(a, "fp8_e4m3", axes=(1, 0))
    q, _ = tensor_cast_float8(h, "fp8_e4m3", rowwise=True, columnwise=True, act=act)
    if act in ("relu", "squared_relu"):
        assert torch.equal(q.amax.cpu(), want.amax.cpu())
        assert torch.equal(_bytes(q, 1), _bytes(want, 1)) and torch.equal(_bytes(q, 0), _bytes(want, 0))
    else:
        torch.testing.assert_close(q.amax.cpu(), want.amax.cpu(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                                   atol=0)
        if torch.equal(q.amax.cpu(), want.amax.cpu()):  # same scale: codes equal but for boundary cases
            d = _code_distance(_bytes(q, 1), _bytes(want, 1))
            assert d.max() <= 1 and (d != 0).float().mean() < 0.01, (d.max(), (d != 0).float().mean())
        assert torch.equal(_bytes(q, 0), _bytes(q, 1).t().contiguous())  # one cast, both layouts
    deq = q.dequantize(torch.float32)
    torch.testing.assert_close(deq.cpu(), a.float().cpu(), rtol=0.07, atol=float(q.scale_inv) * 2)


@pytest.mark.parametrize("act", ["relu", "gelu", "silu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_grad_prologue_and_dbias(act, dtype):
    h = _h(66, 96, dtype, seed=2)
    da = _h(66, 96, dtype, seed=3)
    dh = activation_backward(h, da, act)
    want = quantize_float8(dh, "fp8_e5m2", axes=(1, 0))
    q, db = tensor_cast_float8(h, "fp8_e5m2", rowwise=True, columnwise=True, act=act, grad=da, dbias=True)
    torch.testing.assert_close(db.cpu(), dh.float().sum(0).cpu(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=1e-2 if dtype == torch.bfloat16 else 1e-4)
    if act == "relu":
        assert torch.equal(q.amax.cpu(), want.amax.cpu())
        assert torch.equal(_bytes(q, 1), _bytes(want, 1)) and torch.equal(_bytes(q, 0), _bytes(want, 0))
    else:
        torch.testing.assert_close(q.amax.cpu(), want.amax.cpu(), rtol=1e-2, atol=0)
        torch.testing.assert_close(q.dequantize(torch.float32).cpu(), dh.float().cpu(), rtol=0.15,
                                   atol=float(q.scale_inv) * 4)


@pytest.mark.parametrize("split", [True, False], ids=["pass-per-plane", "one-pass"])
@pytest.mark.parametrize("block", [(1, 128), (128, 128)])
@pytest.mark.parametrize("act", [None, "relu", "gelu"])
def test_block_cast_prologue_and_dbias(block, act, split, monkeypatch):
    monkeypatch.setattr(float8_cast, "BLOCK_CAST_SPLIT", split)
    h = _h(130, 200, torch.bfloat16, seed=5)
    da = _h(130, 200, torch.bfloat16, seed=6)
    for grad in ((None, da) if act else (None,)):
        src = h if act is None else (activation(h, act) if grad is None else activation_backward(h, grad, act))
        want = quantize_float8(src, "fp8_e4m3", axes=(1, 0), block=block)
        q, db = block_cast_float8(h, "fp8_e4m3", block, rowwise=True, columnwise=True, act=act, grad=grad,
                                  dbias=True)
        for axis in (1, 0):  # one plane alone: the same bytes and scales as with both
            alone, _ = block_cast_float8(h, "fp8_e4m3", block, rowwise=axis == 1, columnwise=axis == 0, act=act,
                                         grad=grad)
            assert torch.equal(_bytes(alone, axis), _bytes(q, axis))
            assert torch.equal(alone.plane(axis).scale_inv.cpu(), q.plane(axis).scale_inv.cpu())
        torch.testing.assert_close(db.cpu(), src.float().sum(0).cpu(), rtol=1e-2, atol=1e-2)
        for axis in (1, 0):
            if act in (None, "relu"):  # exact arithmetic: the reference's bytes and scales
                assert torch.equal(_bytes(q, axis), _bytes(want, axis)), (axis, grad is None)
                assert torch.equal(q.plane(axis).scale_inv.cpu(), want.plane(axis).scale_inv.cpu())
            else:
                torch.testing.assert_close(q.dequantize(torch.float32, axis).cpu(), src.float().cpu(), rtol=0.15,
                                           atol=float(want.plane(axis).scale_inv.max()) * 4)


def test_delayed_scale_returns_source_amax():
    h = _h(40, 64, torch.bfloat16, seed=4)
    scale = torch.tensor(8.0, device=DEVICE)
    q, _ = tensor_cast_float8(h, "fp8_e4m3", act="relu", scale=scale)
    a = activation(h, "relu")
    want = quantize_float8(a, "fp8_e4m3", scale=scale)
    assert torch.equal(q.amax.cpu(), a.float().abs().amax().cpu())
    assert torch.equal(_bytes(q, 1), _bytes(want, 1))


def test_bad_arguments():
    h = _h(8, 16, torch.float32)
    with pytest.raises(ValueError, match="not fused backward"):
        tensor_cast_float8(h, act="squared_relu", grad=h)
    with pytest.raises(ValueError, match="needs act"):
        tensor_cast_float8(h, grad=h)
    with pytest.raises(ValueError, match="must match x"):
        tensor_cast_float8(h, act="gelu", grad=h.double())
    with pytest.raises(ValueError, match="2-D"):
        tensor_cast_float8(h.reshape(2, 4, 16))
    with pytest.raises(ValueError, match="rowwise and/or"):
        tensor_cast_float8(h, rowwise=False)


class _CastSpy:
    """Records the keyword arguments of every fused-cast call (the real casts still run)."""

    def __init__(self, monkeypatch):
        self.calls = []
        for name in ("tensor_cast_float8", "block_cast_float8"):
            fn = getattr(float8_cast, name)
            monkeypatch.setattr(float8_cast, name, lambda *a, _fn=fn, **k: self.calls.append(k) or _fn(*a, **k))

    def reset(self) -> list:
        self.calls.clear()
        return self.calls


@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), DelayedScaling(), Float8BlockScaling()],
                         ids=["current", "delayed", "block"])
def test_layernorm_mlp_fused_equals_unfused(recipe, monkeypatch, mx_config):
    """relu: exact arithmetic, so the fused path must reproduce the unfused one bit for bit."""
    if INTERPRET:
        mx_config(backend="triton")
    torch.manual_seed(0)
    results = []
    spy = _CastSpy(monkeypatch)
    for fused in (True, False):
        mx_config(fp8_fused_casts=fused)
        calls = spy.reset()
        torch.manual_seed(0)
        m = mxtrain.LayerNormMLP(64, 128, activation="relu", device=DEVICE)
        x = torch.randn(2, 48, 64, device=DEVICE, requires_grad=True)
        out = []
        for _ in range(2):  # delayed scaling: the second step uses the first step's amaxes
            with mxtrain.mx_autocast(recipe=recipe):
                y = m(x)
            y.backward(torch.randn_like(y))
            out += [y.detach().clone(), x.grad.clone()] + [p.grad.clone() for p in m.parameters()]
            x.grad = None
            m.zero_grad()
        results.append(out)
        prologues = [k["act"] for k in calls if k.get("act")]
        assert (("relu" in prologues) if fused else not prologues), prologues
    for i, (a, b) in enumerate(zip(*results)):
        # per step: y, dx, then the grads of ln weight, ln bias, fc1 weight, fc1 bias, fc2 weight, fc2 bias
        if i % 8 in (5, 7):  # bias gradients: fp32 sums in another order
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(a, b), i


@pytest.mark.parametrize("module", ["Linear", "LayerNormLinear"])
@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), DelayedScaling(), Float8BlockScaling()],
                         ids=["current", "delayed", "block"])
def test_linear_modules_fused_equal_unfused(module, recipe, monkeypatch, mx_config):
    """Linear / LayerNormLinear: dy cast with the bias gradient fused, the weight's dgrad plane kept from
    forward; outputs and gradients equal the unfused path (bias gradients up to summation order)."""
    if INTERPRET:
        mx_config(backend="triton")
    results = []
    spy = _CastSpy(monkeypatch)
    for fused in (True, False):
        mx_config(fp8_fused_casts=fused)
        calls = spy.reset()
        torch.manual_seed(0)
        m = (mxtrain.Linear(64, 96, device=DEVICE) if module == "Linear"
             else mxtrain.LayerNormLinear(64, 96, device=DEVICE))
        x = torch.randn(2, 40, 64, device=DEVICE, requires_grad=True)
        out = []
        for _ in range(2):
            with mxtrain.mx_autocast(recipe=recipe):
                y = m(x)
            y.backward(torch.randn_like(y))
            out += [y.detach().clone(), x.grad.clone()] + [(n, p.grad.clone()) for n, p in m.named_parameters()]
            x.grad = None
            m.zero_grad()
        results.append(out)
        assert any(k.get("dbias") for k in calls) == fused  # the bias gradient came from the dy cast
    for a, b in zip(*results):
        if isinstance(a, tuple):
            (name, a), (_, b) = a, b
            if name == "bias":
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
                continue
        assert torch.equal(a, b)


@pytest.mark.parametrize("shape", [(0, 64), (48, 0)])
@pytest.mark.parametrize("how", ["current", "amax", "delayed"])
def test_tensor_cast_of_an_empty_source_is_the_references(shape, how):
    """No element to cast: empty planes, amax 0, scale_inv from the given scale or from that amax (the
    reference's), a zero bias gradient; the compiled op's body the same (no kernel launched)."""
    x = torch.empty(shape, dtype=torch.bfloat16, device=DEVICE)
    kw = {"current": {}, "amax": {"amax": torch.tensor(3.0, device=DEVICE)},
          "delayed": {"scale": torch.tensor(0.5, device=DEVICE)}}[how]
    q, db = tensor_cast_float8(x, "fp8_e4m3", rowwise=True, columnwise=True, act="gelu", dbias=True, **kw)
    ref = quantize_float8(x, "fp8_e4m3", axes=(1, 0), scale=kw.get("scale"))
    assert [p.data.shape for p in q.planes] == [p.data.shape for p in ref.planes]
    if how == "amax":  # the cast's scale comes from the amax given: 448 / 3
        assert torch.equal(q.scale_inv, torch.tensor(1.0, device=DEVICE) / (torch.tensor(448.0) / 3).to(DEVICE))
        assert torch.equal(q.amax, kw["amax"])
    else:
        assert torch.equal(q.scale_inv, ref.scale_inv) and torch.equal(q.amax, ref.amax)
    assert torch.equal(db, torch.zeros(shape[1], device=DEVICE))
    parts = torch.ops.mxtrain.tensor_cast_float8_triton(x, "fp8_e4m3", True, True, "gelu", None, kw.get("scale"),
                                                        kw.get("amax"), False, 0.0, True)
    assert parts[0].shape == shape and parts[1].shape == shape[::-1] and torch.equal(parts[2], q.scale_inv)
    assert parts[-1].shape == (0, shape[1])  # the per-tile bias sums: no tile
