"""The CUDA C++ cast's host side, checked without a GPU: which casts it takes, the fallback to the
Triton cast (and so to the reference) with a clear warning when the extension cannot be built, and,
where ``nvcc`` is installed, that ``mxtrain/csrc/mx_cast.cu`` compiles for sm_90 without spills.
The kernel's bits are checked against the reference on a GPU in tests/gpu/test_cuda_cast_gpu.py."""

import ctypes
import re
import shutil
import subprocess
import warnings

import pytest
import torch

from mxtrain import config
from mxtrain.formats import parse_format
from mxtrain.kernels import cuda_cast, dispatch
from mxtrain.quantization import quantize_mx

E4M3 = parse_format("fp8_e4m3")


def reason(x, fmt=E4M3, block=32, axes=(1, 0), mode="floor", rounding="even", deq=(), ddt=torch.bfloat16):
    return cuda_cast.unsupported_reason(x, fmt, block, axes, mode, rounding, deq, ddt)


@pytest.mark.parametrize("kw, words", [
    (dict(fmt=parse_format("fp6_e2m3")), "format fp6_e2m3"),
    (dict(fmt=parse_format("int8")), "format int8"),
    (dict(block=16), "block_size 16"),
    (dict(rounding="stochastic"), "rounding 'stochastic'"),
    (dict(deq=(1,), ddt=torch.float16), "dequantized values in torch.float16"),
])
def test_unsupported_reasons_name_the_cause(kw, words):
    assert words in reason(torch.zeros(64, 64), **kw)


def test_unsupported_dtype_axes_and_device():
    assert "input dtype torch.float64" in reason(torch.zeros(64, 64, dtype=torch.float64))
    assert "first or the last axis" in reason(torch.zeros(4, 64, 64), axes=(1,))
    assert "empty tensor" in reason(torch.zeros(0, 64))
    assert reason(torch.zeros(64, 64)) == "tensor on cpu"  # every other condition holds


@pytest.mark.parametrize("mode", ["floor", "rceil", "even"])
def test_cpu_tensors_fall_back_bit_identical(mode):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 96, generator=g) * 1e3).to(torch.bfloat16)
    got = cuda_cast.cuda_quantize(x, "fp8_e4m3", axis=(-1, 0), scale_mode=mode)
    want = quantize_mx(x, "fp8_e4m3", axis=(-1, 0), scale_mode=mode)
    for a, b in zip(got.planes, want.planes):
        assert a.axis == b.axis and torch.equal(a.data, b.data) and torch.equal(a.scale, b.scale)


def test_bad_arguments_raise_before_any_kernel():
    with pytest.raises(ValueError, match="scale_mode"):
        cuda_cast.cuda_quantize(torch.zeros(32, 32), "fp8_e4m3", scale_mode="ceil")
    with pytest.raises(ValueError, match="names an axis twice"):
        cuda_cast.cuda_quantize(torch.zeros(32, 32), "fp8_e4m3", axis=(1, -1))


def test_failed_build_warns_once_and_falls_back(monkeypatch):
    monkeypatch.setattr(cuda_cast, "_LIB", None)
    monkeypatch.setattr(cuda_cast, "_ERROR", None)
    monkeypatch.setattr(cuda_cast, "toolchain_problem", lambda: "no CUDA compiler (nvcc) found: install it")
    with pytest.warns(RuntimeWarning, match=r"CUDA C\+\+ kernels are unavailable \(no CUDA compiler"):
        assert cuda_cast.library() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once only
        assert cuda_cast.library() is None
    assert "nvcc" in cuda_cast.extension_error()


def test_toolchain_problem_without_gpu():
    if not torch.cuda.is_available():
        assert cuda_cast.toolchain_problem() == "no CUDA device"


def test_forced_cuda_backend_without_gpu_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match="backend 'cuda' is not available here"):
        dispatch.quantize(torch.zeros(32, 32), "fp8_e4m3", backend="cuda")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")
def test_source_compiles_for_sm90_without_spills(tmp_path):
    lib = tmp_path / "mx_cast.so"
    cmd = ["nvcc", "-O3", "-gencode=arch=compute_90,code=sm_90", "-Xptxas", "-v", "--shared", "-Xcompiler",
           "-fPIC", "--ftz=false", "--fmad=false", "-D__CUDA_NO_HALF_CONVERSIONS__",
           "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF_OPERATORS__", "-o", str(lib),
           str(cuda_cast.SOURCE)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    # no instance may spill: the plain cast (3 dtypes x 2 formats, and bf16 / fp16 x 2 formats x 5 activation
    # gradients) and the source kernel (bf16 / fp16 x 2 formats x 7 sources: 5 activations, LayerNorm, RMSNorm)
    entries = re.split(r"Compiling entry function", res.stderr)[1:]
    kernels = [e for e in entries if "kernel" in e.split("\n")[0]]
    assert len([e for e in kernels if "mx_cast_fp8_kernel" in e.split("\n")[0]]) == 6 + 20, res.stderr
    assert len([e for e in kernels if "mx_source_cast_kernel" in e.split("\n")[0]]) == 28, res.stderr
    for e in kernels:
        spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", e)]
        assert spills and not any(spills), e  # (a called function reports its own line)
    so = ctypes.CDLL(str(lib))
    assert so.mxtrain_cast_abi_version() == cuda_cast._ABI_VERSION


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")
def test_dequantize_source_compiles_for_sm90_without_spills(tmp_path):
    lib = tmp_path / "mx_dequantize.so"
    src = cuda_cast.CSRC_DIR / "mx_dequantize.cu"
    assert src in cuda_cast.SOURCES
    cmd = ["nvcc", "-O3", "-gencode=arch=compute_90,code=sm_90", "-Xptxas", "-v", "--shared", "-Xcompiler",
           "-fPIC", "--ftz=false", f"-I{cuda_cast.CSRC_DIR}", "-o", str(lib), str(src)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    entries = re.split(r"Compiling entry function", res.stderr)[1:]
    kernels = [e for e in entries if "dequantize" in e.split("\n")[0]]
    assert len(kernels) == 4, res.stderr  # rowwise and transposed, for e4m3 and e5m2
    for e in kernels:
        spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", e)]
        assert spills and not any(spills), e
    assert hasattr(ctypes.CDLL(str(lib)), "mxtrain_mx_dequantize_fp8")


def test_norm_lookahead_env_is_checked():
    with pytest.raises(ValueError, match="MXTRAIN_NORM_LOOKAHEAD must be a positive integer"):
        config.from_environ({"MXTRAIN_NORM_LOOKAHEAD": "0"})
    with pytest.raises(ValueError, match="got 'many'"):
        config.from_environ({"MXTRAIN_NORM_LOOKAHEAD": "many"})
    assert config.from_environ({"MXTRAIN_NORM_LOOKAHEAD": "8"}).norm_lookahead == 8


def test_cast_planes_into_declines_cpu_tensors():
    """FSDP2's one-buffer cast is CUDA only: on the CPU it hands back None (the caller casts as usual)."""
    x = torch.randn(64, 64)
    assert cuda_cast.cast_planes_into(x, parse_format("fp8_e4m3"), 32, (1,), "floor", "even", torch.bfloat16) is None
