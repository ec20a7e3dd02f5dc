"""The CUDA C++ MX cast (``mxtrain/csrc/mx_cast.cu``): built on first use, registered as backend ``"cuda"``.

It covers ``fp8_e4m3`` / ``fp8_e5m2``, block 32, round-half-even, any scale mode, bf16 / fp16 / fp32 input;
what it does not take is said in one place (:func:`unsupported_reason`, its ``supports`` in
:mod:`mxtrain.kernels.registry`, which then walks on to the Triton cast and the reference). Built with ninja into torch's extension cache on first use; without a
compiler, a warning says why once and Triton serves every call. Switches and build: docs/kernels.md.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import threading
import warnings
from pathlib import Path

import torch

from mxtrain import config
from mxtrain.formats import ElemFormat
from mxtrain.kernels import registry
from mxtrain.kernels.calls import QuantizeCall
from mxtrain.quantization import MXPlane, MXTensor
from mxtrain.kernels.ids import ACTIVATION_IDS, DTYPE_IDS, PLAIN_ACTIVATION_IDS, Prologue
from mxtrain.quantization.float8 import FP8_MAX

__all__ = ["cuda_quantize", "fp8_block_cast", "norm_cast", "activation_cast", "fused_sources_selected",
           "dequantize_fp8", "dequantize_fp8_at", "cuda_selected", "cast_planes_into",
           "unsupported_reason", "toolchain_problem", "extension_error", "CSRC_DIR"]

CSRC_DIR = Path(__file__).resolve().parent.parent / "csrc"
SOURCE = CSRC_DIR / "mx_cast.cu"
SOURCES = (SOURCE, CSRC_DIR / "fp8_block_cast.cu", CSRC_DIR / "mx_dequantize.cu")
HEADERS = (CSRC_DIR / "cast_common.cuh",)
_ABI_VERSION = 6
# the kernel's output / input switches (mx_cast.cu's Flags)
_ROW_CODES, _ROW_VALS, _COL_CODES, _COL_VALS, _GAMMA_BF16, _ROUND_BF16 = 1, 2, 4, 8, 16, 32
_DTYPES = DTYPE_IDS  # the csrc entry points' dtype argument
_FORMATS = {"fp8_e4m3": 0, "fp8_e5m2": 1}
_SCALE_MODES = {"floor": 0, "rceil": 1, "even": 2}

_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_ERROR: str | None = None  # why the extension is not there (set once, warned once)


def toolchain_problem() -> str | None:
    """Why the extension cannot be built here (no CUDA, no compiler, no ninja), or None."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None or not (Path(cpp_extension.CUDA_HOME) / "bin" / "nvcc").exists():
        if shutil.which("nvcc") is None:
            return "no CUDA compiler (nvcc) found: install the CUDA toolkit or set CUDA_HOME"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    missing = [str(f) for f in SOURCES + HEADERS if not f.exists()]
    if missing:
        return f"kernel sources missing from this installation: {', '.join(missing)}"
    return None


def extension_error() -> str | None:
    """Why the CUDA extension is unavailable, once a build was attempted (None while it works)."""
    return _ERROR


def _build() -> ctypes.CDLL:
    from torch.utils.cpp_extension import _get_build_directory, load

    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}"
    name = f"mxtrain_csrc_sm{arch}"
    flags = ["-O3", f"-gencode=arch=compute_{arch},code=sm_{arch}",
             # the numerics rely on IEEE fp32: denormals kept (2^-127 scales), exact division; FMA
             # contraction stays on for the CUDA math library (erff, expf: their FMAs make them equal
             # libdevice's), the kernels' own arithmetic uses explicit __fmul_rn / __fadd_rn
             "--ftz=false", "--prec-div=true", "--prec-sqrt=true"]
    verbose = config.current().cuda_verbose
    path = load(name=name, sources=[str(f) for f in SOURCES], extra_cuda_cflags=flags,
                extra_include_paths=[str(CSRC_DIR)], is_python_module=False, verbose=verbose)
    if not path:  # older torch returned nothing: the library sits in the build directory
        path = os.path.join(_get_build_directory(name, verbose), f"{name}.so")
    lib = ctypes.CDLL(path)
    if lib.mxtrain_cast_abi_version() != _ABI_VERSION:
        raise RuntimeError(f"{path} has entry-point version {lib.mxtrain_cast_abi_version()}, expected "
                           f"{_ABI_VERSION}; clear the torch extension cache")
    ll, vp, i = ctypes.c_longlong, ctypes.c_void_p, ctypes.c_int
    lib.mxtrain_mx_cast_fp8.argtypes = [vp, ll, ll, ll, i, i, i, i, i, ctypes.c_uint, i,
                                        vp, ll, vp, ll, vp, ll, vp, ll, vp, vp, ll, ll, ll,
                                        i, i, vp, vp, vp, vp, vp, ll, ctypes.c_float, vp, i, vp, ll, vp]
    lib.mxtrain_mx_cast_fp8.restype = i
    f32 = ctypes.c_float
    lib.mxtrain_fp8_block_cast.argtypes = [vp, vp, ll, ll, ll, ll, i, i, i, i, i, f32, f32, vp, vp, vp, vp, vp, ll, ll,
                                           vp]
    lib.mxtrain_fp8_block_cast.restype = i
    lib.mxtrain_mx_dequantize_fp8.argtypes = [vp, vp, vp, ll, ll, ll, ll, ll, ll, i, ll, ll, ll, i, vp]
    lib.mxtrain_mx_dequantize_fp8.restype = i
    lib.mxtrain_cuda_error_string.argtypes = [i]
    lib.mxtrain_cuda_error_string.restype = ctypes.c_char_p
    return lib


def library() -> ctypes.CDLL | None:
    """The built extension (building it on the first call), or None with a one-time warning saying why."""
    global _LIB, _ERROR
    if _LIB is not None or _ERROR is not None:
        return _LIB
    with _LOCK:
        if _LIB is not None or _ERROR is not None:
            return _LIB
        problem = toolchain_problem()
        if problem is None:
            try:
                _LIB = _build()
            except Exception as exc:  # a compiler error, a missing header: say so, keep working
                names = ", ".join(f.name for f in SOURCES)
                problem = f"building {names} failed: {type(exc).__name__}: {str(exc).strip()[-2000:]}"
        if problem is not None:
            _ERROR = problem
            warnings.warn(f"mxtrain: the CUDA C++ kernels are unavailable ({problem}); the Triton kernels "
                          f"serve every cast", RuntimeWarning, stacklevel=3)
    return _LIB


def unsupported_reason(x: torch.Tensor, fmt: ElemFormat, block_size: int, axes: tuple[int, ...], scale_mode: str,
                       rounding: str, deq: tuple[int, ...], dequantized_dtype: torch.dtype) -> str | None:
    """Why the CUDA kernel does not take this cast (the registry then walks on to the Triton cast), or None."""
    if fmt.name not in _FORMATS:
        return f"format {fmt.name} (the CUDA kernel casts {', '.join(_FORMATS)})"
    if block_size != 32:
        return f"block_size {block_size} (the CUDA kernel uses 32)"
    if rounding != "even":
        return f"rounding {rounding!r} (the CUDA kernel rounds half to even)"
    if x.dtype not in _DTYPES:
        return f"input dtype {x.dtype}"
    if deq and dequantized_dtype != torch.bfloat16:
        return f"dequantized values in {dequantized_dtype} (the CUDA kernel writes bf16)"
    last = x.ndim - 1
    if any(a not in (0, last) for a in axes):
        return f"axes {axes}: the kernel blocks along the first or the last axis only"
    if x.numel() == 0:
        return "empty tensor"
    if x.device.type != "cuda":
        return f"tensor on {x.device}"
    for view in _views(x, axes):
        if view is None:
            return "the input is not viewable as a row-major 2-D tensor"
        k, ld = view.shape[1], view.stride(0)
        if view.stride(1) != 1 or k % 8 or ld % 8 or view.data_ptr() % 16:
            return f"a [{view.shape[0]}, {k}] view with strides {tuple(view.stride())}: the kernel needs rows of " \
                   f"a multiple of 8 contiguous elements, 16-byte aligned"
    return None


def _views(x: torch.Tensor, axes) -> list[torch.Tensor | None]:
    """The 2-D views the launches read: [M, K] for both planes of a 2-D tensor, else one per plane."""
    last = x.ndim - 1
    want_row, want_col = last in axes, (0 in axes and x.ndim >= 2)

    def view(shape):
        try:
            return x.view(shape)
        except RuntimeError:
            return None
    if x.ndim == 2 or not (want_row and want_col):
        if want_col and not want_row:
            return [view((x.shape[0], -1))]
        return [view((-1, x.shape[-1])) if x.ndim != 2 else x]
    return [view((-1, x.shape[-1])), view((x.shape[0], -1))]


def _raw_stream(device: torch.device) -> int:
    """The current CUDA stream's handle on ``device`` (what ``torch.cuda.current_stream(device).cuda_stream``
    returns, without building the Stream object; speed: benchmarks/NOTES_casts.md)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch._C._cuda_getCurrentRawStream(index)


def _alloc(shape, device) -> torch.Tensor:
    if _cast_module().POISON_OUTPUTS:  # tests: unwritten bytes show up
        return torch.full(shape, 0xA5, dtype=torch.uint8, device=device)
    return torch.empty(shape, dtype=torch.uint8, device=device)


@functools.cache
def _cast_module():
    from mxtrain.kernels import cast

    return cast


@functools.cache
def _format_args(fmt: ElemFormat) -> tuple[int, int, int, int]:
    """The kernel's format arguments (format id, emax, mantissa bits, 1/max as fp32 bits), once per format."""
    return _FORMATS[fmt.name], fmt.emax, fmt.mbits, _inv_max_bits(fmt)


def _launch(lib: ctypes.CDLL, x2: torch.Tensor, fmt: ElemFormat, scale_mode: str, rows: bool, cols: bool,
            row_codes: bool = True, row_vals=None, col_codes: bool = True, col_vals=None, pre: int = 0, act: int = 0,
            mean=None, rstd=None, gamma=None, beta=None, y=None, eps: float = 0.0, gamma_bf16: bool = False,
            codes_out=None, round_bf16: bool = False, grad=None, row_vals_into=None):
    """One kernel launch on a 2-D view; returns (row, col) as the Triton ``_launch`` does.

    ``pre`` 1-5: cast ``act(x2)`` (the ids of :data:`CUDA_ACTIVATIONS`); 6: LayerNorm
    ``fma(fma(x2, rstd, -(mean * rstd)), gamma, beta or 0)``; 7: RMSNorm ``(x2 * rstd) * gamma``, the
    kernel computing ``mean`` / ``rstd`` (fp32 [M] outputs) itself; rounded to x2's dtype (bf16 / fp16
    only) and written to ``y`` if given; ``gamma`` / ``beta`` fp32, or bf16 with ``gamma_bf16``.
    ``codes_out``: (row data, row scale, col data, col scale) to write instead of allocating (the
    planes asked for; the others None). ``round_bf16``: an fp32 ``x2`` is rounded to bf16 first (``pre``
    0 only). ``pre`` 11-15 with ``grad`` (``x2``'s dtype and layout): the gradient ``grad * act'(x2)`` of
    activation ``pre - 10``, rounded to ``x2``'s dtype (to ``y`` if given); ``row_vals_into``: the tensor the
    rowwise values are written to (``grad`` itself: it is read before). Written
    for the host's hot path (one call per cast of a training step): no per-call work beyond the outputs'
    allocation and the kernel's arguments."""
    M, K = x2.shape
    dev = x2.device
    kp, mp = -(-K // 32) * 32, -(-M // 32) * 32
    row_codes, row_vals = rows and row_codes, rows and bool(row_vals)  # values: a dtype (bf16) or a flag
    col_codes, col_vals = cols and col_codes, cols and bool(col_vals)
    rd = rs = rv = cd = cs = cv = None
    if codes_out is not None:
        rd, rs, cd, cs = codes_out
    elif row_codes:
        rd, rs = _alloc((M, kp), dev), _alloc((M, kp // 32), dev)
    if row_vals:
        rv = row_vals_into if row_vals_into is not None else torch.empty((M, K), dtype=torch.bfloat16, device=dev)
    if col_codes and codes_out is None:
        cd, cs = _alloc((K, mp), dev), _alloc((K, mp // 32), dev)
    if col_vals:
        cv = torch.empty((M, K), dtype=torch.bfloat16, device=dev)
    flags = (_ROW_CODES * row_codes | _ROW_VALS * row_vals | _COL_CODES * col_codes | _COL_VALS * col_vals
             | _GAMMA_BF16 * gamma_bf16 | _ROUND_BF16 * round_bf16)
    # a norm's workspace (zeroed by the entry point): the kernel's item counter, then per band of 128 rows
    # its statistics items done
    work = (torch.empty(1 + -(-(mp if col_codes else M) // 128), dtype=torch.int32, device=dev)
            if pre in (6, 7) else None)
    fmt_id, emax, mbits, inv_max = _format_args(fmt)
    err = lib.mxtrain_mx_cast_fp8(
        x2.data_ptr(), M, K, x2.stride(0), _DTYPES[x2.dtype], fmt_id, _SCALE_MODES[scale_mode], emax, mbits,
        inv_max, flags, rd.data_ptr() if row_codes else None, kp, rs.data_ptr() if row_codes else None, kp // 32,
        cd.data_ptr() if col_codes else None, mp, cs.data_ptr() if col_codes else None, mp // 32,
        rv.data_ptr() if row_vals else None, cv.data_ptr() if col_vals else None, K, kp, mp, pre, act,
        None if mean is None else mean.data_ptr(), None if rstd is None else rstd.data_ptr(),
        None if gamma is None else gamma.data_ptr(), None if beta is None else beta.data_ptr(),
        None if y is None else y.data_ptr(), 0 if y is None else y.stride(0), float(eps),
        None if work is None else work.data_ptr(), max(1, config.current().norm_lookahead),
        None if grad is None else grad.data_ptr(), 0 if grad is None else grad.stride(0), _raw_stream(dev))
    if err:
        raise RuntimeError(f"mxtrain CUDA cast failed: {lib.mxtrain_cuda_error_string(err).decode()}")
    return ((rd, rs, rv) if rows else None), ((cd, cs, cv) if cols else None)


# ---- fused sources: activation + cast, norm + cast -------------------------------------------

# activation ids of the CUDA prologue (cast_common.cuh act_fwd); gated activations stay with Triton
CUDA_ACTIVATIONS = PLAIN_ACTIVATION_IDS  # act_fwd / act_bwd of csrc/cast_common.cuh
# Norm + cast and activation + cast on the CUDA kernel (mx_source_cast_kernel): on by default, faster
# than Triton's fused kernels (benchmarks/RESULTS.md); MXTRAIN_CUDA_FUSED_SOURCES=0 keeps Triton's.
# A norm's statistics run MXTRAIN_NORM_LOOKAHEAD bands of 128 rows ahead of the tiles that use them (their
# reads of x are then still in L2 when the tiles read x again)


def fused_sources_selected(device: torch.device) -> bool:
    """Whether norm + cast and activation + cast take the CUDA kernel on ``device``: enabled
    (``config.current().cuda_fused_sources``, the default) and the dispatch point picks ``"cuda"`` there (``MXTRAIN_BACKEND=triton``
    keeps Triton). The callers (:mod:`~mxtrain.kernels.norm_cast`, :mod:`~mxtrain.kernels.activation_cast`)
    ask first, so the default path does no more than read a flag."""
    return config.current().cuda_fused_sources and cuda_selected(device)


def cuda_selected(device: torch.device) -> bool:
    """Whether a cast on ``device`` tries the ``"cuda"`` backend first (``MXTRAIN_BACKEND=triton`` keeps
    the Triton kernels)."""
    try:
        return registry.preferred_backend("quantize", device) == "cuda"
    except RuntimeError:
        return False


def _fused_unsupported(x2: torch.Tensor, fmt: ElemFormat, block_size: int, scale_mode: str, rounding: str,
                       pack: bool) -> str | None:
    if x2.dtype not in (torch.bfloat16, torch.float16):
        return f"fused sources are built for bf16 / fp16 inputs, got {x2.dtype}"
    return unsupported_reason(x2, fmt, block_size, (1, 0), scale_mode, rounding, (), torch.bfloat16)


def activation_cast(h2: torch.Tensor, act: str, fmt: ElemFormat, block_size: int, scale_mode: str, rounding: str,
                    pack: bool, rows: bool, cols: bool, return_output: bool, outputs: dict | None = None):
    """``act(h2)`` cast to MXFP8 in one pass on the CUDA kernel: ``(row, col, y)`` as the Triton
    ``_launch`` returns them (plus the activation output when asked for), or None where it does not apply.
    ``outputs``: :func:`mxtrain.kernels.cast.plane_outputs` (values in bf16); None writes both planes' codes."""
    if act not in CUDA_ACTIVATIONS or _fused_unsupported(h2, fmt, block_size, scale_mode, rounding, pack):
        return None
    lib = library()
    if lib is None:
        return None
    y = torch.empty_like(h2) if return_output else None
    row, col = _launch(lib, h2, fmt, scale_mode, rows, cols, **(outputs or {}), pre=CUDA_ACTIVATIONS[act], y=y)
    return row, col, y


def norm_cast(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kind: str, eps: float,
              zero_centered_gamma: bool, fmt: ElemFormat, block_size: int, scale_mode: str, rounding: str,
              pack: bool, rows: bool, cols: bool, return_output: bool, outputs: dict | None = None):
    """LayerNorm / RMSNorm of ``x2`` [M, K] cast to MXFP8 in one CUDA kernel that also computes the row
    statistics (fp32 mean, then the mean of squared deviations; see ``mx_source_cast_kernel``).
    Returns ``(row, col, mean, rstd, y)`` or None where it does not apply. ``outputs`` as
    :func:`activation_cast`."""
    if _fused_unsupported(x2, fmt, block_size, scale_mode, rounding, pack):
        return None
    if weight.dtype not in (x2.dtype, torch.float32) or (bias is not None and bias.dtype != weight.dtype):
        return None
    lib = library()
    if lib is None:
        return None
    M, K = x2.shape
    dev = x2.device
    gamma = (weight + 1) if zero_centered_gamma else weight  # in the weight's dtype, as the modules compute it
    # bf16 parameters go in as they are (the kernel widens them exactly); others as fp32
    gamma_bf16 = gamma.dtype == torch.bfloat16
    gamma = gamma.contiguous() if gamma_bf16 else gamma.float().contiguous()
    beta = None if bias is None else (bias.contiguous() if gamma_bf16 else bias.float().contiguous())
    rstd = torch.empty(M, dtype=torch.float32, device=dev)
    mean = torch.empty(M, dtype=torch.float32, device=dev) if kind == "LayerNorm" else None
    y = torch.empty_like(x2) if return_output else None
    row, col = _launch(lib, x2, fmt, scale_mode, rows, cols, **(outputs or {}),
                       pre=6 if kind == "LayerNorm" else 7, mean=mean, rstd=rstd, gamma=gamma, beta=beta, y=y,
                       eps=eps, gamma_bf16=gamma_bf16)
    return row, col, mean, rstd, y


def activation_backward_cast(h2: torch.Tensor, g2: torch.Tensor, act: str, fmt: ElemFormat, block_size: int,
                             scale_mode: str, rounding: str, pack: bool, rows: bool, cols: bool, return_output: bool,
                             outputs: dict, into_grad: bool):
    """The MXFP8 planes of ``dh = g2 * act'(h2)`` (rounded to ``h2``'s dtype) in one pass of the CUDA kernel:
    ``(row, col, y)`` as :func:`activation_cast` returns them, or None where it does not apply (gated
    activations, another cast, layouts the kernel does not read). ``outputs``:
    :func:`mxtrain.kernels.cast.plane_outputs` (values in bf16); ``into_grad``: the rowwise values are written
    over ``g2`` (contiguous, bf16), which the caller gives up. No bias gradient: the Triton cast sums it."""
    if act not in CUDA_ACTIVATIONS or _fused_unsupported(h2, fmt, block_size, scale_mode, rounding, pack):
        return None
    if (g2.dtype != h2.dtype or g2.shape != h2.shape or g2.stride(1) != 1 or g2.stride(0) % 8
            or g2.data_ptr() % 16):
        return None
    if outputs.get("row_vals") not in (None, torch.bfloat16) or outputs.get("col_vals") not in (None, torch.bfloat16):
        return None
    lib = library()
    if lib is None:
        return None
    y = torch.empty_like(h2) if return_output else None
    row, col = _launch(lib, h2, fmt, scale_mode, rows, cols, **outputs, pre=10 + CUDA_ACTIVATIONS[act], y=y,
                       grad=g2, row_vals_into=g2 if into_grad else None)
    return row, col, y


def _inv_max_bits(fmt: ElemFormat) -> int:
    from mxtrain.kernels._triton_utils import format_consts

    return format_consts(fmt)["INV_MAX_BITS"] & 0xFFFFFFFF


def cuda_quantize(x: torch.Tensor, fmt, block_size: int = 32, axis=-1, scale_mode: str = "floor",
                  rounding: str = "even", seed=None, pack: bool = True, dequantized=(),
                  dequantized_dtype: torch.dtype = torch.bfloat16, keep_codes=None) -> MXTensor:
    """:func:`mxtrain.quantization.quantize_mx` walked from the CUDA C++ cast on (the registry then tries
    the Triton cast and the reference where it does not apply).

    Same signature, same bits (codes, scale bytes and values). ``axis=(-1, 0)`` on a 2-D tensor
    writes both planes from one read; ``dequantized`` / ``keep_codes`` as
    :func:`mxtrain.kernels.dispatch.quantize`.
    """
    call = QuantizeCall(x, fmt, block_size, axis, scale_mode, rounding, seed, pack, dequantized, dequantized_dtype,
                        keep_codes)
    return registry.run_from("quantize", call, x.device, "cuda")


def _supports(call: QuantizeCall) -> str | None:
    s = call.spec()
    reason = unsupported_reason(call.x, s.fmt, s.block_size, s.axes, s.scale_mode, s.rounding, s.deq,
                                call.dequantized_dtype)
    if reason is None and library() is None:
        return f"the CUDA extension is unavailable ({extension_error()})"
    return reason


def _cuda_cast(call: QuantizeCall) -> MXTensor:
    """The registered CUDA C++ implementation of ``quantize`` (``_supports`` said it takes ``call``)."""
    from mxtrain.kernels.cast import assemble_mxtensor, plane_outputs

    x, lib = call.x, library()
    fmt, block_size, axes, scale_mode, rounding, deq, keep = call.spec()
    last = x.ndim - 1
    want_row, want_col = last in axes, (0 in axes and x.ndim >= 2)
    opts = plane_outputs(last, keep, deq, call.dequantized_dtype)
    if x.ndim == 2 and want_row and want_col:
        row, col = _launch(lib, x, fmt, scale_mode, True, True, **opts)
    else:
        row = col = None
        if want_row:
            row, _ = _launch(lib, x.view(-1, x.shape[-1]), fmt, scale_mode, True, False, **opts)
        if want_col:
            _, col = _launch(lib, x.view(x.shape[0], -1), fmt, scale_mode, False, True, **opts)
    return assemble_mxtensor(x, fmt, block_size, axes, scale_mode, rounding, call.pack, row, col)


def cast_planes_into(x: torch.Tensor, fmt: ElemFormat, block_size: int, axes: tuple[int, ...], scale_mode: str,
                     rounding: str, dtype: torch.dtype) -> tuple[torch.Tensor, MXTensor] | None:
    """``x.to(dtype)`` [M, K] cast to MXFP8 with its planes' codes and scale bytes written one after another
    into one uint8 buffer, in the order of ``axes`` (1 rowwise, 0 columnwise): for each plane its data,
    then its scales, flattened, so the buffer is ``torch.cat`` of ``[p.data.reshape(-1), p.scale.reshape(-1)
    for p in mx.planes]`` of :func:`cuda_quantize`'s result, bit for bit. FSDP2's MX all-gather sends it
    as it is (no concatenation), and the conversion of fp32 master weights to bf16 parameters happens
    inside the kernel (``dtype`` bf16 from fp32 ``x``: no bf16 copy is written). Returns ``(buffer, mx)``,
    ``mx`` the MXTensor whose planes are views into the buffer (dtype ``dtype``), or None where the CUDA
    kernel does not take the cast (:func:`unsupported_reason`, another dtype conversion, a second plane
    that would start at an address not a multiple of 16 bytes, no extension)."""
    if x.ndim != 2 or not set(axes) <= {0, 1} or len(set(axes)) != len(axes) or not axes:
        return None
    if dtype != x.dtype and not (dtype == torch.bfloat16 and x.dtype == torch.float32):
        return None
    if not cuda_selected(x.device) or unsupported_reason(x, fmt, block_size, axes, scale_mode, rounding, (),
                                                         torch.bfloat16) is not None:
        return None
    lib = library()
    if lib is None:
        return None
    M, K = x.shape
    kp, mp = -(-K // 32) * 32, -(-M // 32) * 32
    shapes = {1: ((M, kp), (M, kp // 32)), 0: ((K, mp), (K, mp // 32))}
    layout, off = [], 0  # (axis, shape, start) of each piece: data, then scales, plane by plane
    for ax in axes:
        for shape in shapes[ax]:
            layout.append((ax, shape, off))
            off += shape[0] * shape[1]
    if any(start % 16 for _, _, start in layout):
        # the kernel stores codes and scale words aligned: a plane after one whose scale bytes are not a
        # multiple of 16 (rows * ceil(cols / 32)) would start misaligned; the caller concatenates instead
        return None
    buf = _alloc((off,), x.device)
    views: dict = {}
    for ax, shape, start in layout:
        views.setdefault(ax, []).append(buf[start:start + shape[0] * shape[1]].view(shape))
    rd, rs = views.get(1, (None, None))
    cd, cs = views.get(0, (None, None))
    _launch(lib, x, fmt, scale_mode, 1 in axes, 0 in axes, codes_out=(rd, rs, cd, cs), round_bf16=dtype != x.dtype)
    planes = tuple(MXPlane(views[ax][0], views[ax][1], ax, True) for ax in axes)  # (as cuda_quantize's pack=True)
    return buf, MXTensor._unchecked(planes, fmt.name, block_size, (M, K), dtype, scale_mode, rounding)


# ---- MXFP8 dequantize (mxtrain/csrc/mx_dequantize.cu) -------------------------------------------

# The CUDA dequantize: MXFP8 planes of block 32 into bf16, rowwise or transposed, one launch for all of an
# FSDP2 gather's shards; registered as the "cuda" implementation of dequantize (mxtrain.kernels.dequantize).
# On by default (about a third of a Triton launch's host time); MXTRAIN_CUDA_DEQUANTIZE=0 keeps Triton's.


def dequantize_unsupported(fmt: ElemFormat, block_size: int, out_dtype: torch.dtype, device: torch.device, rows: int,
                           length: int, data_ld: int, data_ptr: int, out_stride_r: int, out_stride_l: int,
                           out_ptr: int, count: int = 1, data_step: int = 0, out_step: int = 0) -> str | None:
    """Why the CUDA dequantize does not take a plane read as ``[rows, length]`` (rows ``data_ld`` bytes
    apart) written at ``r * out_stride_r + l * out_stride_l`` (as :func:`dequantize_fp8` takes it), or None."""
    if not config.current().cuda_dequantize:
        return "off (MXTRAIN_CUDA_DEQUANTIZE=0)"
    if device.type != "cuda":
        return f"output on {device}"
    if out_dtype != torch.bfloat16:
        return f"output dtype {out_dtype} (the CUDA kernel writes bf16)"
    if block_size != 32 or fmt.name not in _FORMATS:  # (fp8 codes are one a byte: "packed" changes nothing)
        return f"{fmt.name} with block size {block_size} (the CUDA kernel reads MXFP8 of block 32)"
    transposed = out_stride_r == 1 and out_stride_l != 1
    ld_out = out_stride_l if transposed else out_stride_r
    if (length % 8 or data_ld % 8 or data_step % 8 or out_step % 8 or ld_out % 8
            or (not transposed and out_stride_l != 1) or (transposed and rows % 8) or data_ptr % 8
            or out_ptr % 16 or not 1 <= count <= 65535):
        return (f"a layout the CUDA kernel does not read ([{rows}, {length}] codes {data_ld} bytes a row, output "
                f"strides ({out_stride_r}, {out_stride_l}): multiples of 8 elements, 16-byte aligned, are needed)")
    if library() is None:
        return f"the CUDA extension is unavailable ({extension_error()})"
    return None


def dequantize_fp8(data: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, fmt: ElemFormat, block_size: int,
                   rows: int, length: int, out_stride_r: int, out_stride_l: int, count: int = 1,
                   data_step: int = 0, scale_step: int = 0, out_step: int = 0) -> bool:
    """Run the CUDA dequantize on a plane read as ``[rows, length]`` (``data`` / ``scale`` 2-D, block axis
    last), written to ``out`` at ``r * out_stride_r + l * out_stride_l`` (``count`` shards, as
    :func:`mxtrain.kernels.dequantize._launch` takes them). Returns False, launching nothing, where it does
    not apply (:func:`dequantize_unsupported`, or planes not contiguous along the block axis)."""
    if data.stride(-1) != 1 or scale.stride(-1) != 1:
        return False
    return dequantize_fp8_at(data.data_ptr(), scale.data_ptr(), data.stride(0), scale.stride(0), out, fmt,
                             block_size, rows, length, out_stride_r, out_stride_l, count, data_step, scale_step,
                             out_step)


def dequantize_fp8_at(data_ptr: int, scale_ptr: int, data_ld: int, scale_ld: int, out: torch.Tensor,
                      fmt: ElemFormat, block_size: int, rows: int, length: int, out_stride_r: int, out_stride_l: int,
                      count: int = 1, data_step: int = 0, scale_step: int = 0, out_step: int = 0) -> bool:
    """:func:`dequantize_fp8` on codes and scale bytes given by address (rows ``data_ld`` / ``scale_ld`` bytes
    apart, contiguous along the block axis), for callers that laid them out themselves. Same checks, same
    False where it does not apply."""
    if dequantize_unsupported(fmt, block_size, out.dtype, out.device, rows, length, data_ld, data_ptr, out_stride_r,
                              out_stride_l, out.data_ptr(), count, data_step, out_step) is not None:
        return False
    lib = library()
    err = lib.mxtrain_mx_dequantize_fp8(data_ptr, scale_ptr, out.data_ptr(), rows, length, data_ld, scale_ld,
                                        out_stride_r, out_stride_l, count, data_step, scale_step, out_step,
                                        _FORMATS[fmt.name], _raw_stream(out.device))
    if err:
        raise RuntimeError(f"mxtrain CUDA dequantize failed: {lib.mxtrain_cuda_error_string(err).decode()}")
    return True


# ---- FP8 block scaling (mxtrain/csrc/fp8_block_cast.cu) ------------------------------------------

# what fp8_block_cast.cu casts: act(x) (PRE 1) and g * act'(x) (PRE 2) of these activations
FP8_BLOCK_ACTIVATIONS = (tuple(PLAIN_ACTIVATION_IDS), ("gelu", "relu", "silu"))


def fp8_block_unsupported(x: torch.Tensor, grad: torch.Tensor | None, columnwise: bool) -> str | None:
    """Why the CUDA FP8 block cast does not take this source (the Triton one then does), or None."""
    if x.dtype not in _DTYPES:
        return f"input dtype {x.dtype}"
    if x.ndim != 2 or x.numel() == 0:
        return "not a non-empty 2-D tensor"
    if x.device.type != "cuda":
        return f"tensor on {x.device}"
    for t in (x,) if grad is None else (x, grad):
        if t.stride(1) != 1 or t.shape[1] % 8 or t.stride(0) % 8 or t.data_ptr() % 16:
            return f"a [{t.shape[0]}, {t.shape[1]}] source with strides {tuple(t.stride())}: rows of a multiple " \
                   f"of 8 contiguous elements, 16-byte aligned, are needed"
    if x.shape[0] % 16:  # (for the columnwise plane's 16-byte stores; asked of both planes alike, so
        # that one source takes one backend whichever planes are cast: gelu's erff differs by an ulp)
        return f"the CUDA block cast needs a multiple of 16 rows, got {x.shape[0]}"
    return None


def fp8_block_cast(x: torch.Tensor, grad: torch.Tensor | None, fmt: str, square: bool, act: str | None,
                   row: torch.Tensor | None, rsi: torch.Tensor | None, col: torch.Tensor | None,
                   csi: torch.Tensor | None, dbias: torch.Tensor | None, power_of_2_scales: bool,
                   amax_epsilon: float) -> bool:
    """Run the CUDA FP8 128-block cast into the given outputs (as ``float8_cast.block_cast_float8``
    allocates them; ``dbias``: [ceil(M/128), N] fp32 partial column sums). Returns False, writing
    nothing, where it does not apply (:func:`fp8_block_unsupported`, no extension)."""
    if fp8_block_unsupported(x, grad, col is not None) is not None:
        return False
    pre = Prologue.of(act, grad)
    acts = FP8_BLOCK_ACTIVATIONS[0 if pre == Prologue.ACTIVATION else 1]
    if pre and act not in acts:
        return False
    lib = library()
    if lib is None:
        return False
    M, N = x.shape
    flags = (1 * (row is not None) | 2 * (col is not None) | 4 * (dbias is not None) | 8 * bool(square)
             | 16 * bool(power_of_2_scales))
    g = grad if grad is not None else x

    def ptr(t):
        return None if t is None else t.data_ptr()
    err = lib.mxtrain_fp8_block_cast(
        x.data_ptr(), g.data_ptr(), M, N, x.stride(0), g.stride(0), _DTYPES[x.dtype], _FORMATS[fmt], int(pre),
        ACTIVATION_IDS[act] if pre else 0, flags, FP8_MAX[fmt], float(amax_epsilon), ptr(row), ptr(rsi), ptr(col), ptr(csi),
        ptr(dbias), -(-N // 128), -(-M // 128), _raw_stream(x.device))
    if err:
        raise RuntimeError(f"mxtrain CUDA FP8 block cast failed: {lib.mxtrain_cuda_error_string(err).decode()}")
    return True


def _register() -> None:
    if config.current().cuda_kernels and torch.cuda.is_available():
        registry.register("quantize", "cuda", _cuda_cast, supports=_supports)


_register()
