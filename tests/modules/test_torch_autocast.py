"""mx_autocast inside torch.autocast: converted layers return the dtype torch's layers return.

Under ``torch.autocast`` a module running a recipe casts its input to the autocast dtype and runs its
own ops with autocast off: the result is exactly the module run on that cast input, and parameter
gradients keep the parameters' dtype.
"""

import pytest
import torch

import mxtrain

MODULES = {
    "Linear": lambda: mxtrain.Linear(64, 48),
    "LayerNormLinear": lambda: mxtrain.LayerNormLinear(64, 48, normalization="RMSNorm"),
    "LayerNormMLP": lambda: mxtrain.LayerNormMLP(64, 96, activation="swiglu", normalization="RMSNorm"),
}


def _run(module, x, recipe, autocast: bool):
    x = x.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), mxtrain.mx_autocast(recipe=recipe):
        y = module(x)
    y.float().square().sum().backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    return y, x.grad, grads


@pytest.mark.parametrize("name", list(MODULES))
@pytest.mark.parametrize("recipe", ["mxfp8", "fp8_current", "fp8_block"])
def test_autocast_gives_torch_dtypes_and_equals_cast_input(name, recipe):
    torch.manual_seed(0)
    module = MODULES[name]()
    x = torch.randn(4, 16, 64)
    rec = mxtrain.recipe_from_string(recipe)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch_dtype = torch.nn.functional.linear(x, torch.randn(8, 64)).dtype
    y, dx, grads = _run(module, x, rec, autocast=True)
    assert y.dtype == torch_dtype == torch.bfloat16
    assert dx.dtype == torch.float32  # the input's own dtype, through the cast at the boundary
    assert all(g.dtype == torch.float32 for g in grads.values())
    xb = x.bfloat16().detach().requires_grad_(True)
    with mxtrain.mx_autocast(recipe=rec):
        y_ref = module(xb)
    y_ref.float().square().sum().backward()
    assert torch.equal(y, y_ref)
    assert torch.equal(dx, xb.grad.float())
    for n, p in module.named_parameters():
        assert torch.equal(grads[n], p.grad), n


def test_without_autocast_nothing_changes():
    torch.manual_seed(0)
    module = mxtrain.Linear(64, 48)
    x = torch.randn(8, 64)
    y, _, _ = _run(module, x, mxtrain.MXFP8Recipe(), autocast=False)
    assert y.dtype == torch.float32
