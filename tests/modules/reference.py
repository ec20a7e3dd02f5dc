"""Hand-built references for the MX modules, and small helpers shared by the module tests.

The references do not call anything in ``mxtrain.modules`` or ``mxtrain.kernels``:
every GEMM operand is fake-quantized here with ``fake_quantize_mx`` for its role
and block direction (DESIGN.md, "GEMM operands in a linear layer"), the GEMM is
an fp32 ``torch.matmul`` of the dequantized operands, and norms, activations and
their backward passes are plain torch autograd. Casts to the input / parameter
dtype happen where the modules document them (GEMM results and biases are fp32,
outputs go back to the input dtype, parameter gradients to the parameter dtype).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

import mxtrain
from mxtrain.quantization import fake_quantize_mx, quantize_elemwise

# --- recipes the tight tests run under --------------------------------------------------

# Mixed formats, some roles left in high precision (None), a smaller block, OCP floor scales,
# ties-away rounding and bfloat16 elementwise precision (norm / activation outputs rounded).
MIXED_RECIPE = mxtrain.MXRecipe(
    fprop_input="fp8_e4m3", fprop_weight="fp4_e2m1", dgrad_weight=None,
    dgrad_grad_output="fp8_e5m2", wgrad_input="fp6_e2m3", wgrad_grad_output=None,
    block_size=16, scale_mode="floor", rounding="nearest", elemwise_format="bfloat16",
)

RECIPES = {
    "mxfp8": mxtrain.MXFP8Recipe(),
    "mxfp8_hybrid": mxtrain.MXFP8Recipe(fp8_format="hybrid"),
    # deterministic gradients: these references are bit-tight (MXFP4Recipe rounds gradients stochastically by default)
    "mxfp4": mxtrain.MXFP4Recipe(grad_rounding=None),
    "mxint8": mxtrain.MXINT8Recipe(),
    "mixed": MIXED_RECIPE,
    "mxfp8_no_bwd": mxtrain.MXFP8Recipe(quantize_backward=False),
}

ACTIVATION_NAMES = ("gelu", "gelu_tanh", "relu", "squared_relu", "silu", "swiglu", "geglu", "reglu", "geglu_tanh")
GATED_ACTIVATIONS = ("swiglu", "geglu", "reglu", "geglu_tanh")


# --- numerics helpers ---------------------------------------------------------------------

def fq(t: torch.Tensor, recipe, role: str, axis: int) -> torch.Tensor:
    """fp32 values of ``t`` as the GEMM operand ``role``, blocked along ``axis`` (identity when unquantized)."""
    spec = recipe.role(role)
    t = t.detach()
    if spec.fmt is None:
        return t.float()
    return fake_quantize_mx(t.float(), spec.fmt, block_size=spec.block_size, axis=axis,
                            scale_mode=spec.scale_mode, rounding=spec.rounding)


def elem(t: torch.Tensor, recipe) -> torch.Tensor:
    """The recipe's elementwise rounding (norm / activation outputs and their input grads)."""
    if recipe is None or recipe.elemwise_format is None:
        return t
    return quantize_elemwise(t, recipe.elemwise_format, rounding=recipe.elemwise_rounding,
                             subnormals=recipe.elemwise_subnormals)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Norm-wise relative error ||actual - expected|| / ||expected|| (absolute when expected is 0)."""
    a, e = actual.detach().double(), expected.detach().double()
    denom = e.norm().item()
    diff = (a - e).norm().item()
    return diff / denom if denom > 0 else diff


def sqnr_db(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``actual`` against ``expected``, in dB (inf when equal)."""
    a, e = actual.detach().double(), expected.detach().double()
    noise = (a - e).norm().item()
    return math.inf if noise == 0 else 20 * math.log10(e.norm().item() / noise)


def assert_close_rel(actual, expected, tol: float, what: str = "") -> None:
    assert actual is not None and expected is not None, f"{what}: missing tensor"
    assert actual.shape == expected.shape, f"{what}: shape {list(actual.shape)} != {list(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = rel_err(actual, expected)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


# Tolerances of the tight (fake-quant reference) comparison per dtype: fp32 is the issue's
# 1e-5; in bf16/fp16 the reference mirrors every cast, so only the rare one-ulp rounding
# flip of a low-precision intermediate remains.
TIGHT_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


# --- torch building blocks ---------------------------------------------------------------

def ref_norm(x, weight, bias, normalization: str, eps: float, zero_centered_gamma: bool):
    gamma = weight + 1 if (zero_centered_gamma and weight is not None) else weight
    if normalization == "LayerNorm":
        return F.layer_norm(x, (x.shape[-1],), gamma, bias, eps)
    return F.rms_norm(x, (x.shape[-1],), gamma, eps)


def ref_activation(h: torch.Tensor, name: str) -> torch.Tensor:
    """Transformer Engine's activations; gated ones are ``act(first half) * second half``."""
    if name in GATED_ACTIVATIONS:
        gate, up = h.chunk(2, dim=-1)
        act = {"swiglu": F.silu, "geglu": F.gelu, "reglu": F.relu,
               "geglu_tanh": lambda g: F.gelu(g, approximate="tanh")}[name]
        return act(gate) * up
    if name == "gelu":
        return F.gelu(h)
    if name == "gelu_tanh":
        return F.gelu(h, approximate="tanh")
    if name == "relu":
        return F.relu(h)
    if name == "squared_relu":
        return F.relu(h) ** 2
    if name == "silu":
        return F.silu(h)
    raise KeyError(name)


def _vjp(fn, inputs, grad):
    """Gradients of ``fn(*inputs)`` for output gradient ``grad`` w.r.t. every non-None input."""
    with torch.enable_grad():
        leaves = [None if t is None else t.detach().requires_grad_(True) for t in inputs]
        out = fn(*leaves)
        live = [t for t in leaves if t is not None]
        grads = iter(torch.autograd.grad(out, live, grad))
    return [None if t is None else next(grads) for t in leaves]


# --- references ---------------------------------------------------------------------------

def ref_linear_fwd(x2d, weight, bias, recipe):
    """fprop: fq(X, fprop_input, along K) @ fq(W, fprop_weight, along K)^T + b, fp32."""
    y = fq(x2d, recipe, "fprop_input", 1) @ fq(weight, recipe, "fprop_weight", 1).t()
    if bias is not None:
        y = y + bias.detach().float()
    return y


def ref_linear_bwd(dy2d, x2d, weight, recipe):
    """dgrad dY W (dY along N, W along N) and wgrad dY^T X (both along tokens), fp32."""
    dx = fq(dy2d, recipe, "dgrad_grad_output", 1) @ fq(weight, recipe, "dgrad_weight", 0)
    dw = fq(dy2d, recipe, "wgrad_grad_output", 0).t() @ fq(x2d, recipe, "wgrad_input", 0)
    return dx, dw


def ref_linear(x, weight, bias, dy, recipe):
    """Output and gradients {"x", "weight", "bias"} of mxtrain.Linear under ``recipe``."""
    x2d = x.detach().reshape(-1, x.shape[-1])
    y = ref_linear_fwd(x2d, weight, bias, recipe).to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])
    dy2d = dy.reshape(-1, dy.shape[-1])
    dx, dw = ref_linear_bwd(dy2d, x2d, weight, recipe)
    grads = {"x": dx.to(x.dtype).reshape(x.shape), "weight": dw.to(weight.dtype)}
    if bias is not None:
        grads["bias"] = dy2d.float().sum(0).to(bias.dtype)
    return y, grads


def _norm_grads(x2d, ln_w, ln_b, dln, cfg, recipe):
    normalization, eps, zc = cfg
    dx, dlnw, dlnb = _vjp(lambda a, w, b: ref_norm(a, w, b, normalization, eps, zc),
                          [x2d, ln_w.detach(), None if ln_b is None else ln_b.detach()], dln)
    grads = {"x": elem(dx, recipe), "layer_norm_weight": dlnw}
    if ln_b is not None:
        grads["layer_norm_bias"] = dlnb
    return grads


def ref_layernorm_linear(x, ln_w, ln_b, weight, bias, dy, recipe, normalization="LayerNorm", eps=1e-5,
                         zero_centered_gamma=False, dln_out=None):
    """(y, ln_out, grads) of LayerNormLinear; ``dln_out`` is the gradient reaching the returned norm output."""
    x2d = x.detach().reshape(-1, x.shape[-1])
    cfg = (normalization, eps, zero_centered_gamma)
    ln = elem(ref_norm(x2d, ln_w.detach(), None if ln_b is None else ln_b.detach(), *cfg), recipe)
    y = ref_linear_fwd(ln, weight, bias, recipe).to(x.dtype)
    dy2d = dy.reshape(-1, dy.shape[-1])
    dln, dw = ref_linear_bwd(dy2d, ln, weight, recipe)
    if dln_out is not None:
        dln = dln + dln_out.reshape(dln.shape).float()
    grads = _norm_grads(x2d, ln_w, ln_b, dln.to(x.dtype), cfg, recipe)
    grads["x"] = grads["x"].reshape(x.shape)
    grads["weight"] = dw.to(weight.dtype)
    if bias is not None:
        grads["bias"] = dy2d.float().sum(0).to(bias.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0]), ln.reshape(x.shape), grads


def ref_layernorm_mlp(x, params: dict, dy, recipe, activation="gelu", normalization="LayerNorm", eps=1e-5,
                      zero_centered_gamma=False, include_fc2_bias=True):
    """(y, grads) of LayerNormMLP: norm -> fc1 -> act -> fc2.

    fc2's wgrad input is the fake-quant of act(h); the activation backward runs at
    the high-precision fc1 output h. ``params`` maps TE parameter names to tensors.
    """
    w1, b1, w2, b2 = (params.get(k) for k in ("fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"))
    ln_w, ln_b = params["layer_norm_weight"], params.get("layer_norm_bias")
    if not include_fc2_bias:
        b2 = None
    x2d = x.detach().reshape(-1, x.shape[-1])
    cfg = (normalization, eps, zero_centered_gamma)
    ln = elem(ref_norm(x2d, ln_w.detach(), None if ln_b is None else ln_b.detach(), *cfg), recipe)
    h = ref_linear_fwd(ln, w1, b1, recipe).to(x.dtype)
    a = elem(ref_activation(h, activation), recipe)
    y = ref_linear_fwd(a, w2, b2, recipe).to(x.dtype)

    dy2d = dy.reshape(-1, dy.shape[-1])
    da, dw2 = ref_linear_bwd(dy2d, a, w2, recipe)
    (dh,) = _vjp(lambda t: ref_activation(t, activation), [h], da.to(h.dtype))
    dh = elem(dh, recipe)
    dln, dw1 = ref_linear_bwd(dh, ln, w1, recipe)
    grads = _norm_grads(x2d, ln_w, ln_b, dln.to(x.dtype), cfg, recipe)
    grads["x"] = grads["x"].reshape(x.shape)
    grads["fc1_weight"] = dw1.to(w1.dtype)
    grads["fc2_weight"] = dw2.to(w2.dtype)
    if b1 is not None:
        grads["fc1_bias"] = dh.float().sum(0).to(b1.dtype)
    if b2 is not None:
        grads["fc2_bias"] = dy2d.float().sum(0).to(b2.dtype)
    return y.reshape(*x.shape[:-1], w2.shape[0]), grads


# --- running a module ---------------------------------------------------------------------

def run_module(module, x, dy, recipe, extra_grads=()):
    """Forward under ``mx_autocast(recipe)`` (plain torch when None) and backward with ``dy``.

    Returns ``(outputs, grads)``: outputs as the module returned them, grads a dict
    {"x": x.grad, <parameter name>: grad}. ``extra_grads`` are gradients for the
    outputs after the first (e.g. the returned norm output).
    """
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    with mxtrain.mx_autocast(enabled=recipe is not None, recipe=recipe):
        out = module(x)
    outs = out if isinstance(out, tuple) else (out,)
    tensors, grads_in = [outs[0]], [dy]
    for o, g in zip(outs[1:], extra_grads):
        if g is not None:
            tensors.append(o)
            grads_in.append(g)
    torch.autograd.backward(tensors, grads_in)
    grads = {"x": x.grad}
    grads.update((n, p.grad) for n, p in module.named_parameters())
    return out, grads


def compare_grads(grads: dict, expected: dict, tol: float, what: str = "") -> None:
    """Every expected gradient matches; parameters without an expected gradient got none."""
    for name, g in grads.items():
        if name not in expected:
            assert g is None, f"{what}: {name} got a gradient but the reference has none"
    for name, e in expected.items():
        g = grads.get(name)
        assert g is not None, f"{what}: no gradient for {name}"
        assert g.dtype == e.dtype, f"{what}: grad {name} dtype {g.dtype} != {e.dtype}"
        assert_close_rel(g, e, tol, f"{what} grad {name}")


def module_params(module) -> dict:
    return {n: p for n, p in module.named_parameters()}


def forward_then_backward(module, x, dy, forward_recipe, backward_recipe=None, backward_autocast=False):
    """Forward under ``forward_recipe``; backward outside any autocast, or inside ``mx_autocast(backward_recipe)``."""
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    with mxtrain.mx_autocast(recipe=forward_recipe):
        out = module(x)
    y = out[0] if isinstance(out, tuple) else out
    if backward_autocast:
        with mxtrain.mx_autocast(enabled=backward_recipe is not None, recipe=backward_recipe):
            y.backward(dy)
    else:
        y.backward(dy)
    grads = {"x": x.grad}
    grads.update((n, p.grad) for n, p in module.named_parameters())
    return grads


def assert_backward_uses_forward_recipe(module, x, dy, recipe_a, recipe_b) -> None:
    """The backward of a forward run under A equals A's backward, whatever autocast is active at backward time."""
    expected = forward_then_backward(module, x, dy, recipe_a, backward_autocast=True, backward_recipe=recipe_a)
    other = forward_then_backward(module, x, dy, recipe_b, backward_autocast=True, backward_recipe=recipe_b)
    assert any(not torch.equal(expected[n], other[n]) for n in expected), "recipes A and B must differ here"
    for kwargs in ({}, {"backward_autocast": True, "backward_recipe": recipe_b},
                   {"backward_autocast": True, "backward_recipe": None}):
        got = forward_then_backward(module, x, dy, recipe_a, **kwargs)
        for name, g in expected.items():
            assert torch.equal(got[name], g), f"grad {name} differs when backward runs with {kwargs}"


def wide_range(t: torch.Tensor, binades: int = 10, seed: int = 7) -> torch.Tensor:
    """``t`` times 2**k with a random k in [-binades, binades] per element.

    On randn data MXFP8 e4m3 rounds every element to 3 mantissa bits whatever its
    block (the elements stay in e4m3's normal range): quantizing along the wrong axis
    would go unnoticed. Values spread over many binades put small elements into the
    subnormals of their block, so the block direction shows in the result.
    """
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(-binades, binades + 1, t.shape, generator=g)
    return (t.float() * torch.exp2(k.float())).to(t.dtype)


@contextlib.contextmanager
def record_gemm_operands():
    """Record the fp32 operand values (reduction axis last) of every reference MX GEMM run inside.

    Yields a list that fills with ``(a_values, b_values)`` pairs: the GEMM computed is
    ``a_values @ b_values.T``. Spies on ``mxtrain.kernels.dispatch.gemm_operand``, which
    the reference ``mx_gemm`` calls for a then b.
    """
    import mxtrain.kernels.dispatch as dispatch

    original = dispatch.gemm_operand
    values: list = []
    pairs: list = []

    def spy(t, axis):
        v = original(t, axis)
        values.append(v.detach().clone())
        if len(values) % 2 == 0:
            pairs.append((values[-2], values[-1]))
        return v

    dispatch.gemm_operand = spy
    try:
        yield pairs
    finally:
        dispatch.gemm_operand = original


def find_gemm(pairs, a=None, b=None) -> bool:
    """Whether some recorded GEMM has exactly operand values ``a`` (if given) and ``b`` (if given)."""
    def same(x, y):
        return y is None or (x.shape == y.shape and torch.equal(x, y))
    return any(same(pa, a) and same(pb, b) for pa, pb in pairs)
