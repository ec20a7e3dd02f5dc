"""``mxtrain.gated_activation``: the differentiable gated activation (torch's ops off CUDA and under compile; the
Triton kernels on CUDA are tested in tests/gpu/test_gated_activation_gpu.py)."""

import pytest
import torch
import torch.nn.functional as F

import mxtrain

TORCH = {"swiglu": F.silu, "geglu": F.gelu, "reglu": F.relu,
         "geglu_tanh": lambda t: F.gelu(t, approximate="tanh")}


def _torch(h, g, name):
    h = h.detach().requires_grad_()
    gate, up = h.chunk(2, dim=-1)
    y = TORCH[name](gate) * up
    y.backward(g)
    return y.detach(), h.grad


@pytest.mark.parametrize("name", list(TORCH))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 32), (2, 3, 16), (0, 8)])
def test_equals_torch_bit_for_bit(name, dtype, shape):
    torch.manual_seed(0)
    h = (torch.randn(*shape) * 3).to(dtype).requires_grad_()
    g = torch.randn(*shape[:-1], shape[-1] // 2).to(dtype)
    y = mxtrain.gated_activation(h, name)
    y.backward(g)
    y_ref, dh_ref = _torch(h, g, name)
    assert y.shape == y_ref.shape and torch.equal(y, y_ref) and torch.equal(h.grad, dh_ref)


def test_compiled_equals_eager():
    torch.manual_seed(0)
    h = torch.randn(16, 64, requires_grad=True)
    g = torch.randn(16, 32)
    fn = torch.compile(lambda t: mxtrain.gated_activation(t, "swiglu") * 2, backend="aot_eager", fullgraph=True)
    fn(h).backward(g)
    got = h.grad.clone()
    h.grad = None
    (mxtrain.gated_activation(h, "swiglu") * 2).backward(g)
    assert torch.equal(got, h.grad)


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="gated activation .*got 'gelu'"):
        mxtrain.gated_activation(torch.randn(4, 8), "gelu")
    with pytest.raises(ValueError, match="unknown activation 'swish'"):
        mxtrain.gated_activation(torch.randn(4, 8), "swish")
    with pytest.raises(ValueError, match="last dimension is even"):
        mxtrain.gated_activation(torch.randn(4, 7))
    with pytest.raises(ValueError, match="floating tensor"):
        mxtrain.gated_activation(torch.ones(4, 8, dtype=torch.int64))


def test_second_derivative_raises():
    """The kernels' gradient carries no graph: asking for a second derivative is an error, not a wrong number."""
    h = torch.randn(4, 8, requires_grad=True)
    (g,) = torch.autograd.grad(mxtrain.gated_activation(h).sum(), h, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|differentiate|does not require grad"):
        g.sum().backward()
