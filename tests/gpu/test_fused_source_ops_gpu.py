"""The fused source casts under torch.compile(fullgraph=True) on CUDA: norm_cast, activation_cast,
activation_backward_cast and the fused FP8 casts enter the graph as registered ops (mxtrain::norm_cast, ...), whose
implementation (CUDA C++ or Triton) is chosen at run time as in eager. So a compiled LayerNormLinear / LayerNormMLP
with the fused casts gives eager's outputs and gradients bit for bit, with no graph break. Skipped without CUDA.

``compile_fused_sources`` (the default; ``MXTRAIN_COMPILE_FUSED_SOURCES=0`` turns it off) keeps the fused casts in
compiled graphs (mxtrain/modules/_quantizer.py ``quantize_source``, ``quantize_fused``).
"""

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") == "1",
                                 reason="TRITON_INTERPRET=1 would interpret the kernels")]

pytest.importorskip("triton", reason="triton is not installed")

import mxtrain  # noqa: E402
from mxtrain import config  # noqa: E402
from mxtrain.kernels.activation_cast import activation_backward_cast, activation_cast  # noqa: E402
from mxtrain.kernels.norm_cast import norm_cast  # noqa: E402

F = {"device": "cuda", "dtype": torch.bfloat16}
RECIPES = {"MXFP8": mxtrain.MXFP8Recipe, "Float8Current": mxtrain.Float8CurrentScaling,
           "Float8Block": mxtrain.Float8BlockScaling}
# the registered fused casts each recipe's modules should put in the graph
FUSED_OPS = {"MXFP8": {"LayerNormLinear": ("mxtrain.norm_cast",),
                       "LayerNormMLP": ("mxtrain.norm_cast", "mxtrain.activation_cast",
                                        "mxtrain.activation_backward_cast")},
             "Float8Current": {"LayerNormMLP": ("mxtrain.tensor_cast_float8",)},
             "Float8Block": {"LayerNormMLP": ("mxtrain.block_cast_float8",)}}


def _inductor_recording(seen: set):
    """A backend that notes every op of the graphs dynamo hands over (backward subgraphs included), then inductor."""
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        for mod in gm.modules():
            if isinstance(mod, torch.fx.GraphModule):
                seen.update(str(n.target) for n in mod.graph.nodes if n.op == "call_function")
        return compile_fx(gm, example_inputs)
    return backend


def _run(fn, module, x, dy):
    xx = x.clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    y = fn(module, xx)
    y.backward(dy)
    return [y.detach(), xx.grad] + [p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("module,act", [("LayerNormLinear", None), ("LayerNormMLP", "swiglu"),
                                        ("LayerNormMLP", "gelu")])
def test_fused_modules_fullgraph_with_fused_casts_equal_eager_bitwise(module, act, recipe):
    torch.manual_seed(0)
    if module == "LayerNormLinear":
        m, out = mxtrain.LayerNormLinear(256, 384, bias=False, normalization="RMSNorm", **F), 384
    else:
        m, out = mxtrain.LayerNormMLP(256, 512, bias=act == "gelu", normalization="RMSNorm", activation=act, **F), 256
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x, dy = torch.randn(4, 64, 256, **F), torch.randn(4, 64, out, **F)
    rec = RECIPES[recipe]()

    def step(module, x):
        with mxtrain.mx_autocast(recipe=rec):
            return module(x)
    seen: set = set()
    with config.override(compile_fused_sources=True):  # the default
        torch._dynamo.reset()
        compiled = _run(torch.compile(step, fullgraph=True, backend=_inductor_recording(seen)), m, x, dy)
        eager = _run(step, m, x, dy)
    for name in FUSED_OPS[recipe].get(module, ()):
        assert any(name in t for t in seen), f"{name} not in the graphs: {sorted(t for t in seen if 'mxtrain' in t)}"
    for i, (c, e) in enumerate(zip(compiled, eager)):
        assert torch.equal(c, e), f"output/gradient {i} differs"


def _casts(x, w, h, da):
    """The MX source casts as the modules call them on CUDA (bf16: rowwise planes as values)."""
    r = norm_cast(x, w, None, kind="RMSNorm", eps=1e-6, axis=(1, 0), dequantized=(1,), keep_codes=(0,))
    a = activation_cast(h, "swiglu", "fp8_e4m3", axis=(1, 0), dequantized=(1,), keep_codes=(0,))
    g = activation_backward_cast(h, da, "swiglu", "fp8_e4m3", axis=(1, 0), dequantized=(1, 0), keep_codes=())
    gl = activation_backward_cast(h[:, :512], da, "gelu", "fp8_e4m3", axis=(1, 0), dequantized=(1, 0), keep_codes=(),
                                  dbias=True)
    out = [r.rstd, r.mx.plane(0).data, r.mx.plane(0).scale, r.mx.dequantized_values(1)]
    out += [a.plane(0).data, a.plane(0).scale, a.dequantized_values(1)]
    out += [g.mx.dequantized_values(1), g.mx.dequantized_values(0), gl.mx.dequantized_values(0), gl.dbias]
    return out


def test_compiled_source_casts_equal_eager_on_cuda():
    """The ops alone under inductor: the CUDA C++ / Triton kernels inside give eager's bits."""
    torch.manual_seed(0)
    x, w = torch.randn(256, 512, **F), torch.rand(512, **F) + 0.5
    h, da = torch.randn(256, 1024, **F), torch.randn(256, 512, **F)
    want = _casts(x, w, h, da)
    torch._dynamo.reset()
    got = torch.compile(_casts, fullgraph=True)(x, w, h, da)
    for i, (g, e) in enumerate(zip(got, want)):
        assert g.dtype == e.dtype and g.shape == e.shape and torch.equal(g, e), f"output {i} differs"
