"""The kernel registry (mxtrain/kernels/registry.py): the walk in preference order, supports() reasons, the
MXTRAIN_* switches routed through it, explain(), the decision cache, a kernel that fails at run time, and
that no implementation calls another (the registry is the one place that lists fallbacks)."""

import ast
import inspect
import pathlib
import textwrap

import pytest
import torch

from mxtrain import config
from mxtrain.kernels import calls, dispatch, explain, registry
from mxtrain.quantization import quantize_mx

CUDA = torch.device("cuda")
CPU = torch.device("cpu")


class _Call:
    """A throwaway operation's call: ``rows`` decides which fake kernels take it."""

    def __init__(self, rows, device=CPU):
        self.rows, self.device = rows, device

    def key(self):
        return (self.rows, self.device)


@pytest.fixture
def fake_op():
    """An operation ``fake`` with a kernel per backend; each kernel records the calls it runs and its
    supports() the calls it was asked about."""
    log = {"ran": [], "asked": []}

    def kernel(name, takes):
        def fn(call):
            log["ran"].append(name)
            return name

        def supports(call):
            log["asked"].append(name)
            return None if takes(call.rows) else f"{name} takes {takes.__doc__}, got {call.rows} rows"
        return fn, supports

    def rows8(n):
        """8 rows"""
        return n == 8

    def even(n):
        """an even number of rows"""
        return n % 2 == 0

    registry.define(registry.Operation("fake", lambda rows, device=CPU: _Call(rows, device), _Call.key))
    for backend, takes in (("cuda", rows8), ("triton", even)):
        fn, supports = kernel(f"{backend}-kernel", takes)
        registry.register("fake", backend, fn, supports=supports, name=f"{backend}-kernel")
    registry.register("fake", "reference", lambda call: log["ran"].append("reference") or "reference")
    yield log
    registry.undefine("fake")


def test_cuda_tensors_walk_cuda_then_triton_then_reference(fake_op):
    assert [k.backend for k in registry.chain("fake", CUDA)] == ["cuda", "triton", "reference"]
    assert [k.backend for k in registry.chain("fake", CPU)] == ["reference"]
    assert registry.run("fake", _Call(8, CUDA), CUDA) == "cuda-kernel"
    assert registry.run("fake", _Call(6, CUDA), CUDA) == "triton-kernel"
    assert registry.run("fake", _Call(5, CUDA), CUDA) == "reference"
    assert registry.run("fake", _Call(8), CPU) == "reference"  # CPU tensors: the reference unless forced


def test_forced_backend_starts_the_walk_there(fake_op):
    assert registry.run("fake", _Call(8), CPU, backend="triton") == "triton-kernel"
    assert registry.run("fake", _Call(5), CPU, backend="triton") == "reference"
    assert registry.run("fake", _Call(8), CPU, backend="cuda") == "cuda-kernel"
    with config.override(backend="reference"):
        assert registry.run("fake", _Call(8, CUDA), CUDA) == "reference"
    with config.override(backend="triton"):
        assert registry.run("fake", _Call(8, CUDA), CUDA) == "triton-kernel"
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        registry.run("fake", _Call(8), CPU, backend="tpu")


def test_a_forced_backend_that_is_not_registered_is_a_clear_error(fake_op):
    registry.unregister("fake", "triton")
    with pytest.raises(RuntimeError, match="backend 'triton' is not available here"):
        registry.run("fake", _Call(8), CPU, backend="triton")
    registry.unregister("fake", "cuda")  # not strict_cuda: a forced "cuda" then means Triton's, here none
    with pytest.raises(RuntimeError, match="backend 'triton' is not available here"):
        registry.run("fake", _Call(8), CPU, backend="cuda")


def test_explain_names_the_kernel_that_runs_and_why_the_others_do_not(fake_op):
    got = explain("fake", rows=6, device=CUDA)
    assert got == [("cuda:cuda-kernel", "cuda-kernel takes 8 rows, got 6 rows"),
                   ("triton:triton-kernel", None),
                   ("reference:reference", "not reached: triton:triton-kernel takes the call first")]
    got = dict(explain("fake", rows=6, device=CPU))
    assert got["reference:reference"] is None
    assert got["cuda:cuda-kernel"].startswith("not tried: backend 'auto' on cpu walks reference")


def test_decisions_are_cached_per_key_and_per_settings(fake_op):
    call = _Call(6, CUDA)
    registry.run("fake", call, CUDA)
    asked = len(fake_op["asked"])
    for _ in range(3):
        assert registry.run("fake", _Call(6, CUDA), CUDA) == "triton-kernel"
    assert len(fake_op["asked"]) == asked  # no supports() on the hot path once decided
    with config.override(fp8_fast_accum="all"):  # other settings: decided again
        registry.run("fake", call, CUDA)
    assert len(fake_op["asked"]) > asked


def test_a_kernel_that_fails_at_run_time_is_skipped_after_once(fake_op):
    def broken(call):
        fake_op["ran"].append("broken")
        raise registry.KernelUnavailable("no kernel for this case in this library")
    registry.register("fake", "cuda", broken, name="broken", first=True)
    assert registry.run("fake", _Call(8, CUDA), CUDA) == "cuda-kernel"
    assert registry.run("fake", _Call(8, CUDA), CUDA) == "cuda-kernel"
    assert fake_op["ran"].count("broken") == 1
    assert dict(explain("fake", rows=8, device=CUDA))["cuda:broken"].startswith("failed here before: no kernel")
    assert registry.broken("fake") == {f"cuda:broken on {CUDA}": "no kernel for this case in this library"}
    assert registry.broken("quantize") == {}


def test_a_kernel_that_declines_one_call_stays_in_use_for_the_others(fake_op):
    """KernelDeclined (one call refused after supports() let it through) walks on for that call only;
    KernelUnavailable would turn the kernel off for the device."""
    def picky(call):
        fake_op["ran"].append("picky")
        if call.rows == 8:
            raise registry.KernelDeclined("not this one")
        return "picky"
    registry.register("fake", "cuda", picky, name="picky", first=True)
    assert registry.run("fake", _Call(8, CUDA), CUDA) == "cuda-kernel"
    assert registry.run("fake", _Call(6, CUDA), CUDA) == "picky"
    assert registry.run("fake", _Call(8, CUDA), CUDA) == "cuda-kernel"
    assert fake_op["ran"].count("picky") == 3
    assert dict(explain("fake", rows=6, device=CUDA))["cuda:picky"] is None


def test_a_fake_quantize_backend_is_picked_or_refused_as_its_supports_says():
    """A kernel registered for the real MX cast: taken where it says so, refused (with its reason) elsewhere."""
    ran = []

    def fake(call):
        ran.append(call.x.shape)
        return dispatch.reference_quantize(call)

    def supports(call):
        return None if call.x.shape[0] == 8 else f"{call.x.shape[0]} rows (the fake kernel casts 8)"
    registry.register("quantize", "cuda", fake, supports=supports, name="fake", first=True)
    try:
        x8, x16 = torch.randn(8, 64), torch.randn(16, 64)
        got = dispatch.quantize(x8, "fp8_e4m3", axis=(-1, 0), backend="cuda")
        assert ran == [x8.shape]
        want = quantize_mx(x8, "fp8_e4m3", axis=(-1, 0))
        assert all(torch.equal(a.data, b.data) and torch.equal(a.scale, b.scale) for a, b in zip(got.planes, want.planes))
        got = dispatch.quantize(x16, "fp8_e4m3", backend="cuda")  # refused: the walk goes on, same bits
        assert ran == [x8.shape] and torch.equal(got.planes[0].data, quantize_mx(x16, "fp8_e4m3").planes[0].data)
        reasons = dict(explain("quantize", x=x16, fmt="fp8_e4m3", backend="cuda"))
        assert reasons["cuda:fake"] == "16 rows (the fake kernel casts 8)"
        assert dispatch.quantize(x8, "fp8_e4m3").planes[0].data is not None and len(ran) == 1  # auto on CPU
    finally:
        registry.unregister("quantize", "cuda", "fake")


def test_explain_on_the_real_cast_gives_the_kernels_reason():
    x = torch.randn(8, 48, device="cuda" if torch.cuda.is_available() else "cpu")
    triton_registered = any(k.backend == "triton" for k in registry.kernels("quantize"))
    got = dict(explain("quantize", x=x, fmt="fp8_e4m3", block_size=24, backend="triton" if triton_registered
                       else "reference"))
    assert got["reference:reference"] is None
    if triton_registered:
        assert "block_size 24 is not a power of two" in got["triton:triton"]


def test_switches_are_supports_reasons():
    """MXTRAIN_CUDA_DEQUANTIZE, MXTRAIN_MX_SCALED_MM, MXTRAIN_FP8_BLOCK_CAST / _CUDA_KERNELS turn kernels off
    through their supports(), so explain() names them."""
    from mxtrain.formats import parse_format
    from mxtrain.kernels import cuda_cast, gemm

    e4m3 = parse_format("fp8_e4m3")
    with config.override(cuda_dequantize=False):
        assert "MXTRAIN_CUDA_DEQUANTIZE=0" in cuda_cast.dequantize_unsupported(
            e4m3, 32, torch.bfloat16, CUDA, 64, 64, 64, 0, 64, 1, 0)
    assert "output on cpu" in cuda_cast.dequantize_unsupported(e4m3, 32, torch.bfloat16, CPU, 64, 64, 64, 0, 64, 1, 0)
    mx = dispatch.quantize(torch.randn(64, 64), "fp8_e4m3", axis=(-1, 0))
    with config.override(mx_scaled_mm=False):
        assert "MXTRAIN_MX_SCALED_MM=0" in gemm._scaled_mm_supports(calls.GemmCall(mx, mx))
    f8 = pytest.importorskip("mxtrain.kernels.float8_cast")
    call = calls.BlockCastCall(torch.randn(128, 128), None, "fp8_e4m3", (1, 128), True, True, None, False, 0.0, False)
    with config.override(fp8_block_cast="triton"):
        assert f8._cuda_block_supports(call) == "off (MXTRAIN_FP8_BLOCK_CAST=triton)"
    with config.override(cuda_kernels=False):
        assert f8._cuda_block_supports(call) == "off (MXTRAIN_CUDA_KERNELS=0)"
    assert f8._cuda_block_supports(call) == "tensor on cpu"


KERNEL_DIR = pathlib.Path(dispatch.__file__).parent


def _called_names(fn) -> set[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            names.add(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "")
    return names


def test_no_implementation_calls_another_or_walks_the_registry():
    """The registry is the only place that lists fallbacks: no registered implementation calls one of
    another backend, nor an entry point that walks the registry (run / run_from and their callers)."""
    registry._load()
    ops = ("quantize", "dequantize", "dequantize_shards", "float8_quantize", "float8_block_cast", "gemm",
           "float8_gemm", "grouped_float8_cast")
    impls = [k for op in ops if op in registry._OPS for k in registry.kernels(op)]
    assert len(impls) >= 5
    walkers = {"run", "run_from", "select", "cuda_quantize", "triton_quantize", "triton_dequantize",
               "triton_dequantize_shards", "triton_quantize_float8", "block_cast_float8", "float8_gemm", "mx_gemm_cuda",
               "quantize", "quantize_float8", "mx_gemm", "_quantize_impl", "_quantize_float8_impl", "_mx_gemm_impl"}
    for k in impls:
        others = {o.fn.__name__ for o in impls if o.backend != k.backend}
        called = _called_names(k.fn)
        assert not called & others, f"{k} calls {called & others}"
        assert not called & walkers, f"{k} walks the registry itself through {called & walkers}"
    for path in KERNEL_DIR.glob("*.py"):  # a kernel that cannot run says so by raising; only the registry catches
        if path.name != "registry.py":
            assert "except registry.KernelUnavailable" not in path.read_text() and \
                "except KernelUnavailable" not in path.read_text(), path.name


def test_activation_and_prologue_enums_are_the_kernels_ids():
    from mxtrain.kernels.ids import ACTIVATION_IDS, Activation, Prologue

    assert {a.name.lower(): int(a) for a in Activation} == ACTIVATION_IDS
    assert Activation.of("swiglu") is Activation.SWIGLU and int(Activation.of("gelu")) == 1
    with pytest.raises(ValueError, match="unknown activation 'tanh'"):
        Activation.of("tanh")
    assert [Prologue.of(None, None), Prologue.of("gelu", None), Prologue.of("gelu", torch.ones(1))] == [0, 1, 2]


def test_a_traceable_gemm_enters_the_compiled_graph_as_torch_ops():
    """Under torch.compile, mx_gemm asks the registry while tracing; an implementation registered traceable
    (torch ops only, as the cuBLAS per-tensor FP8 GEMM) is traced into the graph instead of the mxtrain::mx_gemm
    op, and gives the bits eager gives. Here the FP8 reference GEMM (dequantize, fp32 matmul) registered
    traceable on the CPU's backend."""
    from mxtrain.quantization.float8 import quantize_float8

    torch.manual_seed(0)
    a = quantize_float8(torch.randn(32, 64), "fp8_e4m3")
    b = quantize_float8(torch.randn(48, 64), "fp8_e4m3")
    ops = []

    def recording(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    def gemm(a_data, a_si, b_data, b_si):
        from mxtrain.quantization.float8 import Float8Plane, Float8Tensor

        qa = Float8Tensor((Float8Plane(a_data, a_si, 1),), "fp8_e4m3", (32, 64), torch.float32)
        qb = Float8Tensor((Float8Plane(b_data, b_si, 1),), "fp8_e4m3", (48, 64), torch.float32)
        return dispatch.mx_gemm(qa, qb, out_dtype=torch.bfloat16)

    args = (a.plane(1).data, a.scale_inv, b.plane(1).data, b.scale_inv)
    eager = gemm(*args)
    torch._dynamo.reset()
    opaque = torch.compile(gemm, fullgraph=True, backend=recording)(*args)
    assert any("mx_gemm" in t for t in ops) and torch.equal(opaque, eager)
    registry.register("float8_gemm", "reference", dispatch._reference_gemm_call, name="traced", first=True,
                      traceable=True)
    try:
        ops.clear()
        torch._dynamo.reset()
        traced = torch.compile(gemm, fullgraph=True, backend=recording)(*args)
        assert ops and not any("mx_gemm" in t for t in ops), ops
        assert torch.equal(traced, eager)
        assert torch.equal(torch.compile(gemm, fullgraph=True)(*args), eager)  # inductor too
    finally:
        registry.unregister("float8_gemm", "reference", "traced")
        torch._dynamo.reset()
