"""Non-finite values under the FP8 recipes propagate (docs/float8.md, "Non-finite values").

A NaN or +-Inf source element becomes NaN in FP8 (reference, Triton casts bit for bit on the
interpreter or a GPU), the per-tensor amax says +Inf, and through the modules an Inf in the input
or in the gradient reaches the output / the gradients, where a loss scaler or NaN check sees it.
A finite value whose scaled product overflows still saturates.
"""

import os

import pytest
import torch

import mxtrain
from mxtrain.quantization.float8 import quantize_float8

pytest.importorskip("triton", reason="triton is not installed")

from mxtrain.kernels import float8_cast  # noqa: E402
from .test_float8_kernels_interpret import same_fp8  # noqa: E402

DEVICE = torch.device("cpu") if os.environ.get("TRITON_INTERPRET", "0") == "1" else torch.device("cuda")
SPECIALS = {(0, 0): float("inf"), (1, 5): float("-inf"), (2, 7): float("nan"), (129, 200): float("inf")}
CASES = [dict(), dict(scale=torch.tensor(4.0)), dict(block=(1, 128)), dict(block=(128, 128))]
CASE_IDS = ["current", "delayed", "block1x128", "block128x128"]


def with_specials(rows=130, cols=256, seed=0):
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 3
    for (r, c), v in SPECIALS.items():
        x[r, c] = v
    return x


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("kw", CASES, ids=CASE_IDS)
def test_reference_cast_turns_non_finite_into_nan(fmt, kw):
    x = with_specials()
    q = quantize_float8(x, fmt, axes=(1, 0), **kw)
    bad = ~torch.isfinite(x)
    for axis in (1, 0):
        values = q.dequantize(torch.float32, axis)
        assert torch.isnan(values[bad]).all(), "a non-finite source element must dequantize to NaN"
        assert torch.isfinite(values[~bad]).all()  # the scale of a non-finite amax is 1: the rest stays finite
    if "block" not in kw:
        assert q.amax.item() == float("inf")  # what delayed scaling records and a training loop can read


def test_finite_overflow_still_saturates():
    x = torch.tensor([[1e10, -1e10, 1.0, 0.0]])
    q = quantize_float8(x, "fp8_e4m3", scale=torch.tensor(1e30))  # 1e40 overflows fp32: a finite source
    assert q.plane(1).data.float()[0].tolist() == [448.0, -448.0, 448.0, 0.0]


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("kw", CASES, ids=CASE_IDS)
def test_triton_cast_matches_reference_on_non_finite(fmt, kw):
    x = with_specials()
    want = quantize_float8(x, fmt, axes=(1, 0), **kw)
    dev = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    got = float8_cast.triton_quantize_float8(x.to(DEVICE), fmt, axes=(1, 0), **dev)
    same_fp8(got, want, f"{fmt} {kw}")
    nan_codes = torch.isnan(got.plane(1).data.float().cpu())
    assert torch.equal(nan_codes, ~torch.isfinite(x))


RECIPES = [mxtrain.Float8CurrentScaling(), mxtrain.DelayedScaling(), mxtrain.Float8BlockScaling()]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_inf_in_input_reaches_the_output(recipe):
    torch.manual_seed(0)
    m = mxtrain.Linear(128, 64)
    x = torch.randn(16, 128)
    x[3, 10] = float("inf")
    with mxtrain.mx_autocast(recipe=recipe):
        y = m(x)
    assert not torch.isfinite(y[3]).any()  # the row that held the Inf
    assert torch.isfinite(y[torch.arange(16) != 3]).all()


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_inf_in_gradient_reaches_the_gradients(recipe):
    torch.manual_seed(0)
    m = mxtrain.Linear(128, 64)
    x = torch.randn(16, 128, requires_grad=True)
    with mxtrain.mx_autocast(recipe=recipe):
        y = m(x)
    dy = torch.randn_like(y)
    dy[5, 7] = float("-inf")
    y.backward(dy)
    assert not torch.isfinite(m.weight.grad[7]).all()  # wgrad: the Inf's output feature
    assert not torch.isfinite(x.grad[5]).all()  # dgrad: the Inf's token
    # what a loss scaler checks (torch.amp's found_inf): any non-finite gradient
    assert not all(torch.isfinite(p.grad).all() for p in m.parameters())


def test_delayed_scaling_records_inf_amax_and_keeps_its_scale():
    torch.manual_seed(0)
    m = mxtrain.Linear(32, 16)
    recipe = mxtrain.DelayedScaling(amax_history_len=4)
    x = torch.randn(8, 32)
    with mxtrain.mx_autocast(recipe=recipe):
        m(x)
        m(x)
        scale = m.recipe_state.scale.clone()
        bad = x.clone()
        bad[0, 0] = float("inf")
        m(bad)
        m(x)  # the update after the Inf step
    state = m.recipe_state
    assert torch.isinf(state.amax_history).any()  # the flag a training loop can read
    i = state.slots["input"]
    assert torch.isinf(state.amax_history[:, i]).any()
    assert state.scale[i] == scale[i]  # a non-finite amax keeps the previous scale (Transformer Engine)
