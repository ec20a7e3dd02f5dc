"""Each compat op equals torch with quantization off and the reference quantizers' composition with it on."""

import pytest
import torch
import torch.nn.functional as F

from mxtrain.compat import mx
from mxtrain.quantization import fake_quantize_mx, quantize_elemwise

FP8_BF16 = {"w_elem_format": "fp8_e4m3", "a_elem_format": "fp8_e4m3", "block_size": 32, "scale_bits": 8, "bfloat": 16}


def specs(**kw):
    return mx.finalize_mx_specs(kw, early_exit=False)


def elem(t, fmt="bfloat16", rounding="nearest"):
    return quantize_elemwise(t, fmt, rounding)


def mxq(t, fmt, axis, rounding="nearest", bs=32):
    return fake_quantize_mx(t, fmt, bs, axis, "floor", rounding)


def test_quantization_off_is_torch():
    off = specs()
    torch.manual_seed(0)
    x, w, b = torch.randn(5, 40), torch.randn(7, 40), torch.randn(7)
    assert torch.equal(mx.linear(x, w, b, mx_specs=off), F.linear(x, w) + b)
    assert torch.equal(mx.linear(x, w, b, mx_specs=None), F.linear(x, w, b))
    a, c = torch.randn(2, 4, 40), torch.randn(2, 40, 6)
    assert torch.equal(mx.matmul(a, c, mx_specs=off), a @ c)
    assert torch.equal(mx.bmm(a, c, mx_specs=off), torch.bmm(a, c))
    xi, wi = torch.randn(2, 4, 8, 8), torch.randn(6, 4, 3, 3)
    assert torch.equal(mx.conv2d(xi, wi, None, padding=1, mx_specs=off), F.conv2d(xi, wi, padding=1))
    for name, ref in (("relu", F.relu), ("relu6", F.relu6), ("sigmoid", torch.sigmoid), ("tanh", torch.tanh),
                      ("silu", F.silu)):
        assert torch.allclose(getattr(mx, name)(x, mx_specs=off), ref(x), atol=1e-6), name
    assert torch.allclose(mx.softmax(x, -1, mx_specs=off), F.softmax(x, -1), atol=1e-6)
    ln = mx.LayerNorm(40, eps=1e-5, mx_specs=off)
    assert torch.allclose(ln(x), F.layer_norm(x, (40,), eps=1e-5), atol=1e-5)
    gelu_formula = x * torch.sigmoid(1.59375 * (x + 0.044677734 * x**3))
    assert torch.allclose(mx.gelu(x, mx_specs=off), gelu_formula, atol=1e-6)
    assert torch.equal(mx.gelu(x), F.gelu(x, approximate="tanh"))


def test_linear_equals_reference_composition():
    s = specs(**FP8_BF16)
    torch.manual_seed(0)
    x = torch.randn(6, 64, requires_grad=True)
    w = torch.randn(16, 64, requires_grad=True)
    b = torch.randn(16, requires_grad=True)
    y = mx.linear(x, w, b, mx_specs=s)
    bx, bw, bb = elem(x.detach()), elem(w.detach()), elem(b.detach())
    ref = elem(elem(F.linear(mxq(bx, "fp8_e4m3", -1), mxq(bw, "fp8_e4m3", -1))) + bb)
    assert torch.equal(y, ref)
    g = torch.randn_like(y)
    y.backward(g)
    gq = elem(g)
    dw = elem(mxq(gq, "fp8_e4m3", 0).t() @ mxq(bx, "fp8_e4m3", 0))
    dx = elem(mxq(gq, "fp8_e4m3", -1) @ mxq(bw, "fp8_e4m3", 0))
    assert torch.equal(w.grad, dw) and torch.equal(x.grad, dx) and torch.equal(b.grad, elem(gq.sum(0)))


def test_conv_and_softmax_equal_reference_composition():
    s = specs(w_elem_format="int8", a_elem_format="int8", block_size=32, scale_bits=8, fp=10, round="even")
    torch.manual_seed(0)
    x, w = torch.randn(2, 8, 6, 6), torch.randn(4, 8, 3, 3)
    e = lambda t: elem(t, "fp10", "even")  # noqa: E731
    # the conv's MX steps round to nearest whatever the specs say (microxcaling)
    ref = e(F.conv2d(mxq(e(x), "int8", 1, "nearest"), mxq(e(w), "int8", 1, "nearest")))
    assert torch.equal(mx.conv2d(x, w, None, mx_specs=s), ref)
    z = torch.randn(3, 20)
    q = e(z)
    num = e(torch.exp(e(q - q.max(-1, keepdim=True).values)))
    assert torch.equal(mx.softmax(z, -1, mx_specs=s), e(num / e(num.sum(-1, keepdim=True))))


def test_quantize_ops_equal_reference():
    s = specs(block_size=32, scale_bits=8, bfloat=12)
    x = torch.randn(4, 40, 3)
    for axis in (0, 1, 2):
        for fmt in ("fp8_e5m2", "int4", "fp6_e2m3"):
            assert torch.equal(mx.quantize_mx_op(x, s, elem_format=fmt, axes=[axis], round="even"),
                               mxq(x, fmt, axis, "even"))
    assert torch.equal(mx.quantize_mx_op(x, s, elem_format="int8", block_size=0, axes=None),
                       fake_quantize_mx(x.reshape(-1), "int8", 0, 0, "floor", "nearest").view(x.shape))
    assert torch.equal(mx.quantize_elemwise_op(x, s), quantize_elemwise(x, "bfloat12", "nearest"))
    assert mx.quantize_mx_op(x, s, elem_format=None) is x


def _train_steps(model_fn, steps=2):
    torch.manual_seed(0)
    model = model_fn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 4, (16,))
    outs = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        outs.append(loss.detach())
    return outs, [p.detach().clone() for p in model.parameters()]


def _small_cnn(s):
    return torch.nn.Sequential(mx.Conv2d(1, 4, 3, padding=1, mx_specs=s), mx.ReLU(mx_specs=s), torch.nn.Flatten(),
                               mx.Linear(256, 4, mx_specs=s))


def test_fast_path_equals_reference_path(mx_config):
    s = specs(**FP8_BF16)
    fast = _train_steps(lambda: _small_cnn(s))
    mx_config(compat_reference=True)
    ref = _train_steps(lambda: _small_cnn(s))
    assert all(torch.equal(a, b) for a, b in zip(fast[0] + fast[1], ref[0] + ref[1]))


def test_weight_cache_follows_parameter_version():
    s = specs(**FP8_BF16)
    torch.manual_seed(0)
    lin = mx.Linear(32, 8, mx_specs=s)
    x = torch.randn(4, 32)
    with torch.no_grad():
        y1 = lin(x)
        assert torch.equal(lin(x), y1)
        lin.weight.mul_(2)  # in-place update bumps the version: the cache must not serve the old weight
        y2 = lin(x)
    ref = elem(elem(F.linear(mxq(elem(x), "fp8_e4m3", -1), mxq(elem(lin.weight), "fp8_e4m3", -1))) + elem(lin.bias))
    assert torch.equal(y2, ref) and not torch.equal(y1, y2)


def test_modules_without_specs_are_torch():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    conv = mx.Conv2d(3, 4, 3)
    assert torch.equal(conv(x), F.conv2d(x, conv.weight, conv.bias))
    ct = mx.ConvTranspose2d(3, 4, 3, stride=2)
    assert torch.equal(ct(x), F.conv_transpose2d(x, ct.weight, ct.bias, stride=2))
    assert torch.equal(mx.ReLU()(x), F.relu(x)) and torch.equal(mx.Softmax(dim=1)(x), F.softmax(x, 1))


def test_inject_pyt_ops_and_restore():
    s = specs(**FP8_BF16)
    original = torch.nn.Linear, torch.matmul, F.relu
    mx.inject_pyt_ops(s)
    try:
        lin = torch.nn.Linear(32, 4)
        assert isinstance(lin, mx.Linear) and lin.mx_specs["a_elem_format"] == "fp8_e4m3"
        x = torch.randn(3, 32, requires_grad=True)
        y = F.relu(torch.matmul(x, lin.weight.t()))
        y.sum().backward()  # mxtrain's own calls to torch ops stay torch ops
        assert x.grad is not None
    finally:
        mx.restore_pyt_ops()
    assert (torch.nn.Linear, torch.matmul, F.relu) == original
