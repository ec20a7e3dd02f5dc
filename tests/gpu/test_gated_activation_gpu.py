"""Gated activation kernels on CUDA against torch's eager CUDA ops (the path they replace in LayerNormMLP)."""

import pytest
import torch

from mxtrain.modules.activations import GATED

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _torch_forward_backward(h, g, name):
    h_ = h.detach().requires_grad_(True)
    gate, up = h_.chunk(2, dim=-1)
    y = GATED[name](gate) * up
    (dh,) = torch.autograd.grad(y, h_, g)
    return y.detach(), dh


@pytest.mark.parametrize("name", ["swiglu", "geglu", "geglu_tanh", "reglu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernels_match_torch_cuda(name, dtype):
    from mxtrain.kernels.gated_activation import gated_activation, gated_activation_backward

    torch.manual_seed(0)
    h = (torch.randn(1024, 2 * 1000, device="cuda") * 3).to(dtype)
    h[0, :3] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    g = torch.randn(1024, 1000, device="cuda").to(dtype)
    y_ref, dh_ref = _torch_forward_backward(h, g, name)
    y, dh = gated_activation(h, name), gated_activation_backward(h, g, name)
    ulp = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float32: 2 ** -23}[dtype]
    for got, ref in ((y, y_ref), (dh, dh_ref)):
        torch.testing.assert_close(got, ref, rtol=ulp, atol=1e-6, equal_nan=True)
        same = (got == ref) | (got.isnan() & ref.isnan())
        assert same.float().mean() > 0.999, f"{name} {dtype}: {1 - same.float().mean():.2%} of elements differ"


def test_layernorm_mlp_uses_the_kernel_and_stays_close():
    """LayerNormMLP under an FP8 recipe (whose gated activation runs outside the casts) on the kernel."""
    import mxtrain
    from mxtrain.modules import activations

    torch.manual_seed(0)
    m = mxtrain.LayerNormMLP(512, 1024, activation="swiglu", normalization="RMSNorm", device="cuda",
                             dtype=torch.bfloat16)
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    calls = []
    real = activations.gated_activation
    activations.gated_activation = lambda h, n: (calls.append(n), real(h, n))[1]
    try:
        with mxtrain.mx_autocast(recipe=mxtrain.Float8CurrentScaling()):
            y = m(x)
    finally:
        activations.gated_activation = real
    assert calls == ["swiglu"]
    y.float().square().mean().backward()
    with torch.no_grad():
        ref = torch.nn.functional.linear(
            activations.activation(torch.nn.functional.linear(torch.nn.functional.rms_norm(
                x, (512,), m.layer_norm_weight, m.eps), m.fc1_weight), "swiglu"), m.fc2_weight)
    rel = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel < 0.1 and torch.isfinite(x.grad).all()
