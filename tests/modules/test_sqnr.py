"""Loose check against the plain high-precision torch layers: SQNR in dB per recipe and module.

256 tokens x 512 features of randn, weights in torch's default init, randn output
gradients. Thresholds sit about 2.5 dB under the values measured here (they move by
less than 1 dB across seeds); torchao's MXFP8 linear test asks for >= 27 dB forward
and >= 24 dB gradients. The measured table is in docs/modules.md.
"""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mxtrain

from .reference import sqnr_db

TOKENS, HIDDEN, FFN = 256, 512, 1024

RECIPES = {
    "mxfp8_e4m3": mxtrain.MXFP8Recipe(),
    "mxfp8_hybrid": mxtrain.MXFP8Recipe(fp8_format="hybrid"),
    "mxfp8_e5m2": mxtrain.MXFP8Recipe(fp8_format="e5m2"),
    "mxfp6_e2m3": mxtrain.MXFP6Recipe(fp6_format="e2m3"),
    "mxfp6_e3m2": mxtrain.MXFP6Recipe(fp6_format="e3m2"),
    "mxfp4": mxtrain.MXFP4Recipe(),
    "mxint8": mxtrain.MXINT8Recipe(),
}

# (forward, worst gradient) lower bounds in dB; measured values (seed 0) in the comments.
THRESHOLDS = {
    "Linear": {
        "mxfp8_e4m3": (27.0, 26.0),     # 28.5, 28.4
        "mxfp8_hybrid": (27.0, 22.0),   # 28.5, 24.5
        "mxfp8_e5m2": (19.5, 19.5),     # 22.2, 22.1
        "mxfp6_e2m3": (25.5, 25.5),     # 28.1, 28.0
        "mxfp6_e3m2": (19.5, 19.5),     # 22.2, 22.1
        "mxfp4": (13.0, 13.0),          # 15.6, 15.6
        "mxint8": (37.5, 36.0),         # 40.1, 38.6
    },
    "LayerNormLinear": {
        "mxfp8_e4m3": (27.0, 25.5),     # 28.5, 28.4
        "mxfp8_hybrid": (27.0, 21.5),   # 28.5, 24.5
        "mxfp8_e5m2": (19.5, 19.5),     # 22.2, 22.1
        "mxfp6_e2m3": (25.5, 25.0),     # 28.1, 28.0
        "mxfp6_e3m2": (19.5, 19.5),     # 22.2, 22.1
        "mxfp4": (13.0, 12.5),          # 15.7, 15.6
        "mxint8": (37.5, 36.0),         # 40.1, 38.6
    },
    "LayerNormMLP": {  # gelu; two quantized GEMMs in a row
        "mxfp8_e4m3": (23.0, 22.0),     # 25.6, 24.2
        "mxfp8_hybrid": (23.0, 18.5),   # 25.6, 20.8
        "mxfp8_e5m2": (17.0, 16.0),     # 19.5, 18.1
        "mxfp6_e2m3": (22.5, 21.5),     # 25.0, 23.8
        "mxfp6_e3m2": (17.0, 16.0),     # 19.5, 18.2
        "mxfp4": (10.0, 9.0),           # 12.4, 11.2
        "mxint8": (33.5, 32.5),         # 36.1, 34.6
    },
}

# Gradients that no quantized GEMM touches: equal to the torch layer's up to fp32 summation order.
EXACT_GRADS = {"Linear": ("bias",), "LayerNormLinear": ("bias",), "LayerNormMLP": ("fc2_bias",)}


def _torch_reference(name, m):
    """The plain torch layer(s) holding the same weights as ``m``."""
    if name == "Linear":
        lin = nn.Linear(HIDDEN, HIDDEN)
        lin.load_state_dict(m.state_dict())
        return lin
    norm = nn.LayerNorm(HIDDEN)
    norm.load_state_dict({"weight": m.layer_norm_weight, "bias": m.layer_norm_bias})
    if name == "LayerNormLinear":
        lin = nn.Linear(HIDDEN, HIDDEN)
        lin.load_state_dict({"weight": m.weight, "bias": m.bias})
        return nn.Sequential(norm, lin)
    fc1, fc2 = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)
    fc1.load_state_dict({"weight": m.fc1_weight, "bias": m.fc1_bias})
    fc2.load_state_dict({"weight": m.fc2_weight, "bias": m.fc2_bias})
    return nn.Sequential(norm, fc1, nn.GELU(), fc2)


def _torch_grad_names(name):
    """mxtrain parameter name -> parameter name in the torch reference."""
    if name == "Linear":
        return {"weight": "weight", "bias": "bias"}
    if name == "LayerNormLinear":
        return {"layer_norm_weight": "0.weight", "layer_norm_bias": "0.bias", "weight": "1.weight",
                "bias": "1.bias"}
    return {"layer_norm_weight": "0.weight", "layer_norm_bias": "0.bias", "fc1_weight": "1.weight",
            "fc1_bias": "1.bias", "fc2_weight": "3.weight", "fc2_bias": "3.bias"}


def _fwd_bwd(module, x, dy, recipe):
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    with mxtrain.mx_autocast(enabled=recipe is not None, recipe=recipe):
        y = module(x)
    y.backward(dy)
    return y.detach(), {"x": x.grad, **{n: p.grad for n, p in module.named_parameters()}}


@functools.cache
def _setup(name):
    torch.manual_seed(0)
    m = {"Linear": lambda: mxtrain.Linear(HIDDEN, HIDDEN),
         "LayerNormLinear": lambda: mxtrain.LayerNormLinear(HIDDEN, HIDDEN),
         "LayerNormMLP": lambda: mxtrain.LayerNormMLP(HIDDEN, FFN, activation="gelu")}[name]()
    x = torch.randn(TOKENS, HIDDEN)
    dy = torch.randn(TOKENS, HIDDEN)
    ref = _torch_reference(name, m)
    y_ref, g = _fwd_bwd(ref, x, dy, None)
    g_ref = {"x": g["x"], **{ours: g[theirs] for ours, theirs in _torch_grad_names(name).items()}}
    return m, x, dy, y_ref, g_ref


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("name", list(THRESHOLDS))
def test_sqnr_against_torch_layer(name, recipe):
    m, x, dy, y_ref, g_ref = _setup(name)
    y, grads = _fwd_bwd(m, x, dy, RECIPES[recipe])
    fwd = sqnr_db(y, y_ref)
    grad_sqnr = {k: sqnr_db(grads[k], g_ref[k]) for k in g_ref if k not in EXACT_GRADS[name]}
    worst = min(grad_sqnr, key=grad_sqnr.get)
    print(f"\n{name:16s} {recipe:13s} fwd {fwd:5.1f} dB  grads " +
          " ".join(f"{k}={v:.1f}" for k, v in grad_sqnr.items()))
    fwd_min, grad_min = THRESHOLDS[name][recipe]
    assert fwd >= fwd_min, f"forward SQNR {fwd:.1f} dB < {fwd_min} dB"
    assert grad_sqnr[worst] >= grad_min, f"grad {worst} SQNR {grad_sqnr[worst]:.1f} dB < {grad_min} dB"
    for k in EXACT_GRADS[name]:
        torch.testing.assert_close(grads[k], g_ref[k], rtol=1e-5, atol=1e-5)


def test_formats_rank_as_expected():
    """More element bits, less noise: int8 > fp8 e4m3 ~ fp6 e2m3 > e5m2 ~ e3m2 > fp4 (same 3-bit mantissa
    for e4m3 and e2m3, same 2-bit mantissa for e5m2 and e3m2: randn blocks do not need the extra range)."""
    m, x, dy, y_ref, _ = _setup("Linear")
    with torch.no_grad():
        s = {}
        for r, recipe in RECIPES.items():
            with mxtrain.mx_autocast(recipe=recipe):
                s[r] = sqnr_db(m(x), y_ref)
    assert s["mxint8"] > s["mxfp8_e4m3"] > s["mxfp8_e5m2"] > s["mxfp4"]
    assert abs(s["mxfp8_e4m3"] - s["mxfp6_e2m3"]) < 1.5
    assert abs(s["mxfp8_e5m2"] - s["mxfp6_e3m2"]) < 1.0
    assert s["mxfp8_hybrid"] == s["mxfp8_e4m3"]  # hybrid changes only the grad-output roles


def test_mlp_activations_gated_and_plain_mxfp8():
    """Every activation stays close to its torch chain under MXFP8 (forward; gated fc1 of width 2*ffn)."""
    from .reference import ACTIVATION_NAMES, GATED_ACTIVATIONS, ref_activation
    torch.manual_seed(0)
    x = torch.randn(128, 256)
    for act in ACTIVATION_NAMES:
        m = mxtrain.LayerNormMLP(256, 512, activation=act)
        with torch.no_grad():
            ref = F.linear(ref_activation(F.linear(F.layer_norm(x, (256,)), m.fc1_weight, m.fc1_bias), act),
                           m.fc2_weight, m.fc2_bias)
            with mxtrain.mx_autocast(recipe=mxtrain.MXFP8Recipe()):
                y = m(x)
        s = sqnr_db(y, ref)
        print(f"\nLayerNormMLP {act:12s} mxfp8 fwd {s:.1f} dB (gated={act in GATED_ACTIVATIONS})")
        assert s >= 20.0, f"{act}: {s:.1f} dB"
