"""Modules on GPU with the norm and the activation computed inside the casts of their outputs.

On CUDA, LayerNormMLP and LayerNormLinear hand fc1's input to ``norm_cast`` and fc2's to
``activation_cast`` (the default, ``MXTRAIN_FUSE_SOURCES``): the norm / activation output is
never written, the fprop operand comes out as bf16 values and the wgrad operand as codes. The
kernels' fp32 arithmetic is not torch's, so a module's result may differ from the unfused path
by the odd code; these tests check that the difference is far under the quantization error
itself, and that the fused kernels are the ones that ran. Skipped without CUDA.
"""

import os

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") == "1",
                                 reason="TRITON_INTERPRET=1 would interpret the kernels")]

pytest.importorskip("triton", reason="triton is not installed")

import mxtrain  # noqa: E402
from mxtrain.kernels import cast, cuda_cast  # noqa: E402
from mxtrain.kernels.activation_cast import GRAD_FUSED  # noqa: E402

DEV = torch.device("cuda")


def _run(m, x, dy, recipe):
    m.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_(True)
    with mxtrain.mx_autocast(enabled=recipe is not None, recipe=recipe):
        y = m(xi)
    y.backward(dy)
    return [y.detach().float(), xi.grad.float()] + [p.grad.float() for p in m.parameters()]


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _count_calls(monkeypatch, module, name):
    calls = []
    orig = getattr(module, name)

    def spy(*a, **kw):
        out = orig(*a, **kw)
        calls.append(out is not None)
        return out
    monkeypatch.setattr(module, name, spy)
    return calls


@pytest.mark.parametrize("recipe", ("MXFP8Recipe", "MXFP4Recipe"))
@pytest.mark.parametrize("activation,norm,dtype", (("gelu", "LayerNorm", torch.bfloat16),
                                                   ("silu", "RMSNorm", torch.bfloat16),
                                                   ("relu", "LayerNorm", torch.bfloat16),
                                                   ("swiglu", "RMSNorm", torch.bfloat16),
                                                   ("gelu_tanh", "LayerNorm", torch.float32)))
def test_layernorm_mlp_fused_sources_match_unfused(monkeypatch, recipe, activation, norm, dtype, mx_config):
    torch.manual_seed(2)
    m = mxtrain.LayerNormMLP(512, 1024, activation=activation, normalization=norm, device=DEV, dtype=dtype)
    with torch.no_grad():  # a norm weight and bias that are not 1 / 0
        m.layer_norm_weight.uniform_(0.5, 1.5)
        if m.layer_norm_bias is not None:
            m.layer_norm_bias.uniform_(-0.2, 0.2)
    x = (torch.randn(3, 200, 512, device=DEV) * 2 + 0.3).to(dtype)  # 600 tokens: a ragged columnwise block
    dy = torch.randn(3, 200, 512, device=DEV).to(dtype)
    # deterministic gradients (MXFP4Recipe rounds them stochastically by default; the two paths draw differently)
    rec = getattr(mxtrain, recipe)(grad_rounding=None)
    cuda_norm = _count_calls(monkeypatch, cuda_cast, "norm_cast")
    cuda_act = _count_calls(monkeypatch, cuda_cast, "activation_cast")
    grad_launches = []
    orig_launch = cast._launch

    def launch(*a, **kw):
        grad_launches.append(kw.get("grad") is not None)
        return orig_launch(*a, **kw)
    monkeypatch.setattr(cast, "_launch", launch)
    mx_config(fuse_sources=True)
    fused = _run(m, x, dy, rec)
    assert activation in GRAD_FUSED  # every activation's gradient is fused now, gated ones included
    assert sum(grad_launches) == 1, "dh = dy * act'(h) and its cast: one kernel"
    kernel_path = recipe == "MXFP8Recipe" and dtype == torch.bfloat16 and cuda_cast.library() is not None
    if kernel_path and cuda_cast.fused_sources_selected(DEV):
        assert any(cuda_norm), "the CUDA norm + cast kernel did not run"
        if activation != "swiglu":  # gated activations take Triton's fused kernel
            assert sum(cuda_act) == 2, "act(h): forward fprop operand and backward wgrad operand"
    mx_config(fuse_sources=False)
    unfused = _run(m, x, dy, rec)
    high = _run(m, x, dy, None)
    names = ["y", "dx"] + [n for n, _ in m.named_parameters()]
    for name, f, u, h in zip(names, fused, unfused, high):
        assert torch.isfinite(f).all(), name
        err_q = _rel(u, h)  # what quantization itself costs
        assert _rel(f, u) <= 0.1 * err_q, (name, _rel(f, u), err_q)


@pytest.mark.parametrize("norm", ("LayerNorm", "RMSNorm"))
def test_layernorm_linear_fused_norm_returns_its_output(monkeypatch, norm, mx_config):
    torch.manual_seed(3)
    m = mxtrain.LayerNormLinear(768, 384, normalization=norm, return_layernorm_output=True,
                                device=DEV, dtype=torch.bfloat16)
    x = torch.randn(700, 768, device=DEV, dtype=torch.bfloat16) * 3
    rec = mxtrain.MXFP8Recipe()
    mx_config(fuse_sources=True)
    calls = _count_calls(monkeypatch, cuda_cast, "norm_cast")
    xi = x.clone().requires_grad_(True)
    with mxtrain.mx_autocast(recipe=rec):
        y, ln_out = m(xi)
    if cuda_cast.library() is not None and cuda_cast.fused_sources_selected(DEV):
        assert any(calls)
    if norm == "LayerNorm":
        ref = F.layer_norm(x.float(), (768,), m.layer_norm_weight.float(), m.layer_norm_bias.float(), m.eps)
    else:
        ref = F.rms_norm(x.float(), (768,), m.layer_norm_weight.float(), m.eps)
    ulp = torch.finfo(torch.bfloat16).eps * ref.abs().clamp_min(2**-100)
    assert ((ln_out.float() - ref).abs() <= ulp).all()  # within one bf16 ulp of the fp32 norm
    (y.float().square().sum() + ln_out.float().sum()).backward()
    grads = [xi.grad] + [p.grad for p in m.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    mx_config(fuse_sources=False)
    xu = x.clone().requires_grad_(True)
    with mxtrain.mx_autocast(recipe=rec):
        yu, lnu = m(xu)
    assert _rel(y.float(), yu.float()) < 2e-3
    assert _rel(ln_out.float(), lnu.float()) < 2e-3


@pytest.mark.parametrize("norm", ("LayerNorm", "RMSNorm"))
def test_norm_backward_runs_on_the_cast_kernels_statistics(monkeypatch, norm):
    """The fused modules keep the norm + cast kernel's mean / rstd and run torch's native norm backward on
    them: no forward is recomputed in backward, and the gradients are as close to a float64 oracle as
    those of recomputing torch's forward."""
    from mxtrain.kernels.norm_cast import norm_cast
    from mxtrain.modules import normalization

    g = torch.Generator(device=DEV).manual_seed(5)
    x = torch.randn(512, 1024, device=DEV, generator=g).mul(3).add(1).bfloat16()
    w = torch.randn(1024, device=DEV, generator=g).bfloat16()
    b = torch.randn(1024, device=DEV, generator=g).bfloat16() if norm == "LayerNorm" else None
    dy = torch.randn(512, 1024, device=DEV, generator=g).bfloat16()
    needs = (True, True, b is not None)
    r = norm_cast(x, w, b, kind=norm, fmt="fp8_e4m3", axis=(1, 0))
    recomputed = normalization.norm_backward(x, w, b, dy, norm, 1e-5, False, needs)

    leaves = [t.double().requires_grad_() for t in (x, w) + ((b,) if b is not None else ())]
    ref = normalization.norm_forward(*leaves[:2], leaves[2] if b is not None else None, norm, 1e-5, False)
    oracle = torch.autograd.grad(ref, leaves, dy.double())

    def fail(*a, **kw):
        raise AssertionError("the norm's forward was recomputed in backward")
    monkeypatch.setattr(normalization, "norm_forward", fail)
    got = normalization.norm_backward(x, w, b, dy, norm, 1e-5, False, needs, (r.mean, r.rstd))
    for name, a, e, o in zip(("dx", "dweight", "dbias"), got, recomputed, oracle):
        assert a.dtype == e.dtype == x.dtype, name
        assert _rel(a.double(), o) <= 1.5 * _rel(e.double(), o) + 1e-6, (name, _rel(a.double(), o), _rel(e.double(), o))

    m = mxtrain.LayerNormMLP(1024, 2048, normalization=norm, device=DEV, dtype=torch.bfloat16)
    xi = x.clone().requires_grad_(True)
    with mxtrain.mx_autocast(recipe=mxtrain.MXFP8Recipe()):
        y = m(xi)
    y.backward(dy)  # LayerNormMLP's forward runs the fused cast; its backward must not call norm_forward
    assert torch.isfinite(xi.grad).all() and torch.isfinite(m.layer_norm_weight.grad).all()
