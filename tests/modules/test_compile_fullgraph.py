"""torch.compile(fullgraph=True) on the CPU of a module with mx_autocast inside the compiled function: no graph
break, and the output and every gradient equal eager's bit for bit (the quantizers, GEMMs, norms and activations
are registered ops). Every norm and activation backward against torch's autograd: test_norm_activation_backward.py."""

import pytest
import torch

import mxtrain


def _step(recipe):
    def step(module, x):
        with mxtrain.mx_autocast(recipe=recipe):
            return module(x)
    return step


def _run(fn, module, x, dy):
    xx = x.clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    y = fn(module, xx)
    y.backward(dy)
    return y.detach(), xx.grad, {k: p.grad.clone() for k, p in module.named_parameters()}


@pytest.mark.parametrize("recipe", [mxtrain.MXFP8Recipe(), mxtrain.Float8CurrentScaling(), mxtrain.Float8BlockScaling()],
                         ids=lambda r: type(r).__name__)
def test_linear_fullgraph_matches_eager_bitwise(recipe):
    torch.manual_seed(0)
    m, x = mxtrain.Linear(64, 40), torch.randn(2, 16, 64)
    dy = torch.randn(2, 16, 40)
    y_e, dx_e, g_e = _run(_step(recipe), m, x, dy)
    torch._dynamo.reset()
    y_c, dx_c, g_c = _run(torch.compile(_step(recipe), fullgraph=True), m, x, dy)
    assert torch.equal(y_c, y_e) and torch.equal(dx_c, dx_e)
    assert g_c.keys() == g_e.keys() and all(torch.equal(g_c[k], g_e[k]) for k in g_e)


def test_generator_seed_names_what_cannot_compile():
    """A seeded MX recipe's stochastic rounding draws from a torch.Generator, which no registered op takes:
    compiling it raises an error naming it (never a silent eager fallback)."""
    recipe = mxtrain.MXRecipe(rounding="stochastic", seed=1)
    m = mxtrain.Linear(32, 16)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="stochastic rounding with a torch.Generator"):
        torch.compile(_step(recipe), fullgraph=True)(m, torch.randn(4, 32))


def _compiled_then_eager(recipe, module, x, dy):
    """The compiled run first (a recipe first used inside the compiled function must trace), then eager."""
    torch._dynamo.reset()
    compiled = _run(torch.compile(_step(recipe), fullgraph=True), module, x, dy)
    return compiled, _run(_step(recipe), module, x, dy)


def _assert_same(compiled, eager):
    (y_c, dx_c, g_c), (y_e, dx_e, g_e) = compiled, eager
    assert torch.equal(y_c, y_e) and torch.equal(dx_c, dx_e)
    assert g_c.keys() == g_e.keys()
    assert all(torch.equal(g_c[k], g_e[k]) for k in g_e), [k for k in g_e if not torch.equal(g_c[k], g_e[k])]


def _randomize_(module):
    # norm scales of ones and zero biases would hide a swapped or missing gradient term
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn_like(p))


_RECIPES = {"MXFP8": mxtrain.MXFP8Recipe, "Float8Current": mxtrain.Float8CurrentScaling,
            "Float8Block": mxtrain.Float8BlockScaling}


@pytest.mark.parametrize("recipe,normalization,zero_centered,dtype", [
    ("MXFP8", "RMSNorm", True, torch.float32),
    ("Float8Current", "LayerNorm", False, torch.bfloat16),
    ("Float8Block", "RMSNorm", False, torch.bfloat16),
])
def test_layernorm_linear_fullgraph_matches_eager_bitwise(recipe, normalization, zero_centered, dtype):
    torch.manual_seed(0)
    m = mxtrain.LayerNormLinear(64, 40, normalization=normalization, zero_centered_gamma=zero_centered, dtype=dtype)
    _randomize_(m)
    x, dy = torch.randn(2, 16, 64, dtype=dtype), torch.randn(2, 16, 40, dtype=dtype)
    _assert_same(*_compiled_then_eager(_RECIPES[recipe](), m, x, dy))


def test_layernorm_linear_returning_norm_output_fullgraph_matches_eager_bitwise():
    """The norm output returned too (a residual): its gradient joins the GEMM's in the norm's backward."""
    torch.manual_seed(0)
    m = mxtrain.LayerNormLinear(64, 40, normalization="RMSNorm", return_layernorm_output=True)
    _randomize_(m)
    x, dy, dln = torch.randn(32, 64), torch.randn(32, 40), torch.randn(32, 64)

    def run(fn):
        xx = x.clone().requires_grad_()
        m.zero_grad(set_to_none=True)
        y, ln = fn(m, xx)
        torch.autograd.backward((y, ln), (dy, dln))
        return y.detach(), ln.detach(), xx.grad, [p.grad.clone() for p in m.parameters()]
    torch._dynamo.reset()
    compiled = run(torch.compile(_step(mxtrain.MXFP8Recipe()), fullgraph=True))
    eager = run(_step(mxtrain.MXFP8Recipe()))
    for c, e in zip(compiled[:3] + tuple(compiled[3]), eager[:3] + tuple(eager[3])):
        assert torch.equal(c, e)


@pytest.mark.parametrize("recipe,normalization,act,bias,dtype", [
    ("MXFP8", "RMSNorm", "swiglu", False, torch.float32),
    ("Float8Current", "LayerNorm", "gelu", True, torch.bfloat16),
    ("Float8Block", "RMSNorm", "squared_relu", True, torch.float32),
])
def test_layernorm_mlp_fullgraph_matches_eager_bitwise(recipe, normalization, act, bias, dtype):
    torch.manual_seed(0)
    m = mxtrain.LayerNormMLP(64, 96, bias=bias, normalization=normalization, activation=act, dtype=dtype)
    _randomize_(m)
    x, dy = torch.randn(2, 16, 64, dtype=dtype), torch.randn(2, 16, 64, dtype=dtype)
    _assert_same(*_compiled_then_eager(_RECIPES[recipe](), m, x, dy))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("recipe", list(_RECIPES))
@pytest.mark.parametrize("module", ["LayerNormLinear", "LayerNormMLP"])
def test_fused_modules_fullgraph_matches_eager_bitwise_on_cuda(module, recipe):
    """On CUDA the norm, the activation and their gradients run inside the fused cast kernels (bf16, RMSNorm,
    swiglu: a Llama block's shapes); compiled still equals eager bit for bit."""
    torch.manual_seed(0)
    f = {"device": "cuda", "dtype": torch.bfloat16}
    if module == "LayerNormLinear":
        m, out = mxtrain.LayerNormLinear(256, 384, bias=False, normalization="RMSNorm", **f), 384
    else:
        m, out = mxtrain.LayerNormMLP(256, 512, bias=False, normalization="RMSNorm", activation="swiglu", **f), 256
    _randomize_(m)
    x, dy = torch.randn(4, 64, 256, **f), torch.randn(4, 64, out, **f)
    compiled, eager = _compiled_then_eager(_RECIPES[recipe](), m, x, dy)
    # the fused casts are registered ops in the compiled graph too, so even the norm statistics are eager's
    _assert_same(compiled, eager)



def test_compile_fused_sources_switch(monkeypatch):
    """By default a module traced by torch.compile keeps the fused casts (registered ops, fullgraph), as in eager;
    MXTRAIN_COMPILE_FUSED_SOURCES=0 (compile_fused_sources) takes the op-then-cast path there."""
    from mxtrain import config
    from mxtrain.modules._quantizer import make_quantizers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    src = torch.randn(64, 256, device=device)
    q = make_quantizers(mxtrain.Float8CurrentScaling())[""].input
    with config.override(backend="auto" if device == "cuda" else "triton"):  # CPU: Triton's interpreter
        if q.quantize_fused(src, True, False, act="gelu") is None:
            pytest.skip("no fused FP8 casts here (they need CUDA or TRITON_INTERPRET=1)")
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert q.quantize_fused(src, True, False, act="gelu") is not None
        with config.override(compile_fused_sources=False):
            assert q.quantize_fused(src, True, False, act="gelu") is None
    assert config.from_environ({"MXTRAIN_COMPILE_FUSED_SOURCES": "0"}).compile_fused_sources is False
    assert config.from_environ({}).compile_fused_sources is True


@pytest.mark.parametrize("make", [lambda: mxtrain.Linear(64, 40),
                                  lambda: mxtrain.LayerNormLinear(64, 40, normalization="RMSNorm"),
                                  lambda: mxtrain.LayerNormMLP(64, 96, activation="swiglu", normalization="RMSNorm")],
                         ids=["Linear", "LayerNormLinear", "LayerNormMLP"])
def test_autocast_entered_outside_the_compiled_function(make):
    """mx_autocast around a compiled module (as a training loop writes it): no graph break (dynamo cannot read
    the autocast's ContextVar; it reads the thread's mirror), equal to eager bit for bit, and another recipe or
    none on a later call is seen (the graph is guarded on it, never reused stale)."""
    torch.manual_seed(0)
    m = make()
    x, dy = torch.randn(2, 16, 64), torch.randn(2, 16, 40 if not isinstance(m, mxtrain.LayerNormMLP) else 64)
    torch._dynamo.reset()
    compiled = torch.compile(m, fullgraph=True)

    def under(recipe, fn):
        def call(module, xx):
            with mxtrain.mx_autocast(enabled=recipe is not None, recipe=recipe):
                return fn(xx)
        return call
    for recipe in (mxtrain.Float8CurrentScaling(), mxtrain.MXFP8Recipe(), None):
        got, want = _run(under(recipe, compiled), m, x, dy), _run(under(recipe, m), m, x, dy)
        if recipe is None:  # plain torch ops: inductor's own reductions (the bias gradient) round differently
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            assert not torch.equal(got[0], _run(under(mxtrain.MXFP8Recipe(), m), m, x, dy)[0])
        else:
            _assert_same(got, want)
