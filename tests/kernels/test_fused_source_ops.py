"""The fused source casts (norm_cast, activation_cast, activation_backward_cast) as registered ops: opcheck of
each op, and a fullgraph torch.compile of the casts as the modules call them giving eager's bits (on the CPU
under the Triton interpreter, so the Triton kernels run inside the ops; on CUDA without it)."""

import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from mxtrain.kernels.activation_cast import activation_backward_cast, activation_cast  # noqa: E402
from mxtrain.kernels.float8_cast import block_cast_float8, tensor_cast_float8  # noqa: E402
from mxtrain.kernels.norm_cast import norm_cast  # noqa: E402


# the Triton kernels run on the CPU under the interpreter (tests/kernels/conftest.py sets it without CUDA)
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET", "0") == "1" else "cuda"


def _t(*shape, dtype=torch.bfloat16, seed=0, scale=2.0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)


# the op arguments after the tensors: fmt, block_size, axes, scale_mode, rounding, seed, pack, then the values
# request (dequantized axes, their dtype, kept axes)
NORM = [  # kind, x shape, dtype, fmt, block, axes, scale_mode, rounding, seed, pack, return_output, deq, dtype, keep
    ("LayerNorm", (16, 64), torch.bfloat16, "fp8_e4m3", 32, [1, 0], "floor", "even", None, True, True, [],
     torch.bfloat16, [1, 0]),
    ("RMSNorm", (16, 64), torch.bfloat16, "fp8_e4m3", 32, [1, 0], "rceil", "even", None, True, False, [1],
     torch.bfloat16, [0]),
    ("LayerNorm", (2, 5, 64), torch.float32, "fp4_e2m1", 32, [2], "floor", "stochastic", 5, True, True, [2],
     torch.float32, [2]),
    ("RMSNorm", (8, 40), torch.float16, "int8", 0, [1], "even", "nearest", None, False, True, [], torch.bfloat16, [1]),
]


def _norm_inputs(kind, shape, dtype, device=DEVICE):
    x = _t(*shape, dtype=dtype, device=device)
    w = _t(shape[-1], dtype=dtype, seed=1, scale=0.5, device=device) + 1
    b = _t(shape[-1], dtype=dtype, seed=2, scale=0.2, device=device) if kind == "LayerNorm" else None
    return x, w, b


@pytest.mark.parametrize("case", NORM, ids=lambda c: f"{c[0]}-{c[3]}-{c[5]}")
def test_opcheck_norm_cast(case):
    kind, shape, dtype, fmt, bs, axes, mode, rnd, seed, pack, ret, deq, ddt, keep = case
    x, w, b = _norm_inputs(kind, shape, dtype)
    torch.library.opcheck(torch.ops.mxtrain.norm_cast.default,
                          (x, w, b, kind, 1e-5, kind == "RMSNorm", fmt, bs, axes, mode, rnd, seed, pack, ret, deq,
                           ddt, keep))


ACT = [  # activation, h shape, dtype, fmt, block, axes, scale_mode, rounding, seed, pack, return_output, deq, dtype,
       # keep
    ("swiglu", (16, 128), torch.bfloat16, "fp8_e4m3", 32, [1, 0], "floor", "even", None, True, False, [1],
     torch.bfloat16, [0]),
    ("gelu", (16, 64), torch.bfloat16, "fp8_e5m2", 32, [1], "rceil", "even", None, True, True, [], torch.bfloat16, [1]),
    ("relu", (2, 4, 64), torch.float32, "fp6_e2m3", 32, [2], "floor", "stochastic", 3, True, True, [2], torch.float32,
     [2]),
]


@pytest.mark.parametrize("case", ACT, ids=lambda c: f"{c[0]}-{c[3]}-{c[5]}")
def test_opcheck_activation_cast(case):
    act, shape, dtype, fmt, bs, axes, mode, rnd, seed, pack, ret, deq, ddt, keep = case
    torch.library.opcheck(torch.ops.mxtrain.activation_cast.default,
                          (_t(*shape, dtype=dtype), act, fmt, bs, axes, mode, rnd, seed, pack, ret, deq, ddt, keep))


BWD = [  # as ACT, with dbias after return_output
    ("gelu", (16, 64), torch.bfloat16, "fp8_e4m3", 32, [1, 0], "floor", "even", None, True, False, True, [1, 0],
     torch.bfloat16, []),
    ("swiglu", (16, 128), torch.bfloat16, "fp8_e5m2", 32, [1, 0], "rceil", "even", None, True, True, False, [1],
     torch.bfloat16, [0]),
    ("silu", (2, 3, 64), torch.float16, "fp4_e2m1", 0, [2], "floor", "even", None, True, True, True, [],
     torch.bfloat16, [2]),
]


@pytest.mark.parametrize("case", BWD, ids=lambda c: f"{c[0]}-{c[3]}-{c[5]}")
def test_opcheck_activation_backward_cast(case):
    act, shape, dtype, fmt, bs, axes, mode, rnd, seed, pack, ret, dbias, deq, ddt, keep = case
    h = _t(*shape, dtype=dtype)
    out_shape = (*shape[:-1], shape[-1] // 2 if act == "swiglu" else shape[-1])
    g = _t(*out_shape, dtype=dtype, seed=4)
    torch.library.opcheck(torch.ops.mxtrain.activation_backward_cast.default,
                          (h, g, act, fmt, bs, axes, mode, rnd, seed, pack, ret, dbias, deq, ddt, keep))


def _flat(mxt) -> list[torch.Tensor]:
    """Every tensor an MXTensor holds, in order (planes' codes and scales, then carried values)."""
    out = []
    for p in mxt.planes:
        out += [p.data, p.scale]
    return out + [v for _, v in mxt.values]


def _mlp_casts(x, ln_w, ln_b, h, da, *, fmt, act, deq, keep, bdeq, bkeep, dbias, seed, rounding):
    """The source casts as LayerNormLinear / LayerNormMLP call them (a forward and a backward's worth)."""
    kw = dict(fmt=fmt, block_size=32, scale_mode="floor", rounding=rounding, seed=seed)
    r = norm_cast(x, ln_w, ln_b, kind="LayerNorm", eps=1e-5, axis=(1, 0), dequantized=deq, keep_codes=keep,
                  return_output=True, **kw)
    rms = norm_cast(x, ln_w, None, kind="RMSNorm", eps=1e-6, zero_centered_gamma=True, axis=(1, 0),
                    dequantized=deq, keep_codes=keep, **kw)
    a = activation_cast(h, act, axis=(1, 0), dequantized=deq, keep_codes=keep, **kw)
    a1, a_out = activation_cast(h, act, axis=1, return_output=True, **kw)
    g = activation_backward_cast(h, da, act, axis=(1, 0), dequantized=bdeq, keep_codes=bkeep, dbias=dbias,
                                 reuse_grad=False, **kw)
    out = _flat(r.mx) + [r.mean, r.rstd, r.out] + _flat(rms.mx) + [rms.rstd] + _flat(a) + _flat(a1) + [a_out]
    out += _flat(g.mx) + ([g.dbias] if dbias else [])
    assert rms.mean is None and rms.out is None and g.out is None and (g.dbias is None) != dbias
    return out


@pytest.mark.parametrize("act,fmt,carry,dbias,rounding", [
    ("gelu", "fp8_e4m3", False, True, "even"),      # codes kept (CPU / non-bf16), fc1's bias gradient
    ("swiglu", "fp8_e4m3", True, False, "even"),    # CUDA bf16: rowwise planes as values, backward all values
    ("silu", "fp4_e2m1", True, True, "stochastic"),  # an int seed enters the ops
])
def test_compiled_source_casts_equal_eager(act, fmt, carry, dbias, rounding):
    torch._dynamo.reset()
    x, w, b = _norm_inputs("LayerNorm", (32, 64), torch.bfloat16)
    gated = act == "swiglu"
    h = _t(32, 128 if gated else 64, seed=5)
    da = _t(32, 64, seed=6)
    kw = dict(fmt=fmt, act=act, deq=(1,) if carry else (), keep=(0,) if carry else None,
              bdeq=(1, 0) if carry else (), bkeep=() if carry else None, dbias=dbias,
              seed=11 if rounding == "stochastic" else None, rounding=rounding)
    from mxtrain.formats import parse_format
    from mxtrain.kernels import cast

    # the kernels run inside the ops (Triton's on the CPU under the interpreter), not only the reference
    assert cast._fallback_reason(h, parse_format(fmt), 32, (1, 0), True) is None
    want = _mlp_casts(x, w, b, h, da, **kw)
    got = torch.compile(lambda *t: _mlp_casts(*t, **kw), fullgraph=True, backend="aot_eager")(x, w, b, h, da)
    assert len(got) == len(want)
    for i, (g, e) in enumerate(zip(got, want)):
        assert g.dtype == e.dtype and g.shape == e.shape, f"output {i}: {g.dtype} {g.shape} vs {e.dtype} {e.shape}"
        assert torch.equal(g.view(torch.uint8) if g.dtype.itemsize == 1 else g, e), f"output {i} differs"


def test_compiled_generator_seed_is_refused():
    """A torch.Generator cannot enter an op: stochastic rounding with one names itself under compile."""
    x, w, b = _norm_inputs("LayerNorm", (8, 32), torch.float32, device="cpu")
    gen = torch.Generator().manual_seed(0)
    calls = (lambda x: norm_cast(x, w, b, rounding="stochastic", seed=gen, axis=1).rstd,
             lambda x: activation_cast(x, "gelu", "fp8_e4m3", rounding="stochastic", seed=gen, axis=1).planes[0].data,
             lambda x: activation_backward_cast(x, x, "gelu", "fp8_e4m3", rounding="stochastic", seed=gen,
                                                axis=1).mx.planes[0].data)
    for fn in calls:
        torch._dynamo.reset()
        with pytest.raises(Exception, match="stochastic rounding with a torch.Generator") as err:
            torch.compile(fn, fullgraph=True, backend="aot_eager")(x)
        causes = [err.value, err.value.__cause__, err.value.__context__]
        assert any(isinstance(e, NotImplementedError) for e in causes) or "NotImplementedError" in str(err.value)
        fn(x)  # eagerly the Generator is drawn from


# The fused FP8 casts of LayerNormMLP under the FP8 recipes (mxtrain/modules/_quantizer.py Quantizer.quantize_fused)


@pytest.mark.parametrize("pre", ["none", "act", "grad"])
def test_opcheck_tensor_cast_float8(pre):
    x = _t(40, 72)
    act, grad = (None, None) if pre == "none" else ("gelu", None if pre == "act" else _t(40, 72, seed=3))
    op = torch.ops.mxtrain.tensor_cast_float8.default
    # current scaling (amax pass), a given amax, delayed scaling (a given scale)
    for rows, cols, scale, amax, dbias in ((True, True, None, None, pre == "grad"),
                                           (False, True, None, torch.tensor(9.0, device=DEVICE), False),
                                           (True, False, torch.tensor(0.25, device=DEVICE), None, True)):
        torch.library.opcheck(op, (x, "fp8_e4m3", rows, cols, act, grad, scale, amax, pre == "act", 0.0, dbias))


@pytest.mark.parametrize("block", [[1, 128], [128, 128]])
def test_opcheck_block_cast_float8(block):
    x, grad = _t(40, 136), _t(40, 136, seed=3)
    op = torch.ops.mxtrain.block_cast_float8.default
    torch.library.opcheck(op, (x, "fp8_e4m3", block, True, True, "relu", None, False, 0.0, False))
    torch.library.opcheck(op, (x, "fp8_e5m2", block, False, True, "silu", grad, True, 1e-6, True))


def _flat8(q) -> list[torch.Tensor]:
    out = []
    for p in q.planes:
        out += [p.data.view(torch.uint8), p.scale_inv]
    return out + ([q.amax] if q.amax is not None else [])


def _float8_casts(h, da, scale):
    """The fused FP8 casts as Quantizer.quantize_fused calls them: current scaling (the second group reusing the
    first's amax), delayed scaling, 1x128 blocks; forward (act) and backward (grad, dbias)."""
    q1, _ = tensor_cast_float8(h, "fp8_e4m3", rowwise=True, columnwise=True, act="gelu")
    q2, db2 = tensor_cast_float8(h, "fp8_e5m2", rowwise=False, columnwise=True, act="gelu", grad=da, dbias=True)
    q3, _ = tensor_cast_float8(h, "fp8_e4m3", rowwise=True, columnwise=False, act="gelu", amax=q1.amax)
    q4, _ = tensor_cast_float8(h, "fp8_e4m3", rowwise=True, columnwise=True, act="relu", scale=scale)
    q5, db5 = block_cast_float8(h, "fp8_e4m3", (1, 128), rowwise=True, columnwise=True, act="silu", grad=da,
                                dbias=True)
    q6, _ = block_cast_float8(h, "fp8_e4m3", (128, 128), rowwise=True, columnwise=True, act="gelu")
    assert q5.amax is None
    return [*_flat8(q1), *_flat8(q2), db2, *_flat8(q3), *_flat8(q4), *_flat8(q5), db5, *_flat8(q6)]


def test_compiled_float8_casts_equal_eager():
    torch._dynamo.reset()
    h, da, scale = _t(48, 136), _t(48, 136, seed=7), torch.tensor(0.5, device=DEVICE)
    want = _float8_casts(h, da, scale)
    got = torch.compile(_float8_casts, fullgraph=True, backend="aot_eager")(h, da, scale)
    assert len(got) == len(want)
    for i, (g, e) in enumerate(zip(got, want)):
        assert g.dtype == e.dtype and g.shape == e.shape, f"output {i}: {g.dtype} {g.shape} vs {e.dtype} {e.shape}"
        assert torch.equal(g, e), f"output {i} differs"


def test_compiled_float8_amax_group_is_refused():
    torch._dynamo.reset()
    fn = lambda x: tensor_cast_float8(x, amax_reduction_group=object())[0].amax  # noqa: E731
    with pytest.raises(Exception, match="amax_reduction_group"):
        torch.compile(fn, fullgraph=True, backend="aot_eager")(_t(8, 32))


@pytest.mark.parametrize("recipe,act", [("Float8CurrentScaling", "gelu"), ("Float8BlockScaling", "relu")])
def test_layernorm_mlp_fullgraph_with_fused_float8_casts_equal_eager(recipe, act):
    """LayerNormMLP under an FP8 recipe with its fused casts in the compiled graph (Triton's, on the interpreter:
    backend="triton"; compile_fused_sources, the default): outputs and gradients equal eager's."""
    import mxtrain
    from mxtrain import config

    torch.manual_seed(0)
    m = mxtrain.LayerNormMLP(128, 128, bias=True, activation=act, dtype=torch.bfloat16, device=DEVICE)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x, dy = _t(32, 128, scale=1.0), _t(32, 128, seed=1, scale=1.0)
    rec = getattr(mxtrain, recipe)()

    def step(module, x):
        with mxtrain.mx_autocast(recipe=rec):
            return module(x)

    def run(fn):
        xx = x.clone().requires_grad_()
        m.zero_grad(set_to_none=True)
        y = fn(m, xx)
        y.backward(dy)
        return [y.detach(), xx.grad] + [p.grad.clone() for p in m.parameters()]
    seen = set()

    def backend(gm, example_inputs):  # aot_eager, noting the ops of every graph (backward subgraphs too)
        for mod in gm.modules():
            if isinstance(mod, torch.fx.GraphModule):
                seen.update(str(n.target) for n in mod.graph.nodes if n.op == "call_function")
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)
    with config.override(backend="triton"):
        torch._dynamo.reset()
        compiled = run(torch.compile(step, fullgraph=True, backend=backend))
        eager = run(step)
    op = "mxtrain.tensor_cast_float8" if recipe == "Float8CurrentScaling" else "mxtrain.block_cast_float8"
    assert any(op in t for t in seen), sorted(t for t in seen if "mxtrain" in t)
    for i, (c, e) in enumerate(zip(compiled, eager)):
        assert torch.equal(c, e), f"output/gradient {i} differs"


# On CUDA a compiled per-tensor FP8 cast is the op mxtrain::tensor_cast_float8_triton (torch.library.triton_op):
# its kernels enter the graph and inductor launches them. Eagerly the op runs the same body.


def _triton_op_cases():
    da = _t(40, 72, seed=3)
    return [  # (kwargs of tensor_cast_float8): current scaling, a given amax, delayed scaling; prologues; dbias
        dict(rowwise=True, columnwise=True),
        dict(rowwise=True, columnwise=True, act="gelu"),
        dict(rowwise=False, columnwise=True, act="gelu", grad=da, dbias=True),
        dict(rowwise=True, columnwise=False, amax=torch.tensor(9.0, device=DEVICE)),
        dict(rowwise=True, columnwise=True, act="relu", scale=torch.tensor(0.25, device=DEVICE), dbias=True),
    ]


@pytest.mark.parametrize("case", range(5))
def test_triton_op_tensor_cast_float8_equals_the_cast(case):
    """The triton_op's outputs (``[row?, col?, scale_inv, amax unless given, per-tile dbias?]``) are the eager
    cast's bits; its dbias rows add up (in torch's order) to the cast's dbias."""
    x = _t(40, 72)
    kw = _triton_op_cases()[case]
    q, db = tensor_cast_float8(x, "fp8_e5m2" if kw.get("grad") is not None else "fp8_e4m3", **kw)
    args = (x, q.fmt, kw["rowwise"], kw["columnwise"], kw.get("act"), kw.get("grad"), kw.get("scale"),
            kw.get("amax"), False, 0.0, bool(kw.get("dbias")))
    parts = torch.ops.mxtrain.tensor_cast_float8_triton(*args)
    want = [p.data for p in q.planes] + [q.scale_inv] + ([q.amax] if kw.get("amax") is None else [])
    assert len(parts) == len(want) + bool(db is not None)
    for i, (g, e) in enumerate(zip(parts, want)):
        assert g.dtype == e.dtype and g.shape == e.shape, f"output {i}: {g.dtype} {g.shape} vs {e.dtype} {e.shape}"
        assert torch.equal(g.view(torch.uint8) if g.dtype.itemsize == 1 else g,
                           e.view(torch.uint8) if e.dtype.itemsize == 1 else e), f"output {i} differs"
    if db is not None:
        assert parts[-1].shape[1] == x.shape[1] and torch.equal(parts[-1].sum(0), db)
    for t in parts:  # fresh buffers: no output aliases an input
        assert all(t.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
                   for a in args if isinstance(a, torch.Tensor))


@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA: traced with fake tensors, an interpreted kernel "
                                             "would read their data")
@pytest.mark.parametrize("case", range(5))
def test_opcheck_triton_op_tensor_cast_float8(case):
    x = _t(40, 72)
    kw = _triton_op_cases()[case]
    torch.library.opcheck(torch.ops.mxtrain.tensor_cast_float8_triton.default,
                          (x, "fp8_e4m3", kw["rowwise"], kw["columnwise"], kw.get("act"), kw.get("grad"),
                           kw.get("scale"), kw.get("amax"), False, 0.0, bool(kw.get("dbias"))))


def test_compiled_per_tensor_quantize_float8_traces_to_the_fused_cast():
    """Under torch.compile a per-tensor quantize_float8 whose implementation is Triton's enters the graph as the
    per-tensor cast's op (no mxtrain::quantize_float8 and its Python per call); block scaling keeps that op.
    Same bits as eager."""
    from mxtrain.kernels.dispatch import quantize_float8

    def casts(x, scale):
        q1 = quantize_float8(x, "fp8_e4m3", axes=(1, 0))
        q2 = quantize_float8(x.view(4, 12, 72), "fp8_e5m2", scale=scale)
        q3 = quantize_float8(x, "fp8_e4m3", axes=(1, 0), block=(1, 128))
        return [*_flat8(q1), *_flat8(q2), *_flat8(q3)]
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)
    x, scale = _t(48, 72), torch.tensor(0.5, device=DEVICE)
    from mxtrain import config

    with config.override(backend="triton"):
        torch._dynamo.reset()
        got = torch.compile(casts, fullgraph=True, backend=backend)(x, scale)
        want = casts(x, scale)
    cast_op = "tensor_cast_float8_triton" if DEVICE == "cuda" else "tensor_cast_float8"
    names = sorted(t for t in seen if "mxtrain" in t)
    assert names.count(f"mxtrain.{cast_op}") == 2, names
    assert names.count("mxtrain.quantize_float8") == 1, names  # the block cast
    for i, (g, e) in enumerate(zip(got, want)):
        assert torch.equal(g, e), f"output {i} differs"
