"""The one dispatch point between kernels and the reference numerics.

Backends: ``"reference"`` (pure PyTorch, any device) and, once registered by
the GPU kernel modules, ``"triton"`` (:mod:`mxtrain.kernels`) / ``"cuda"`` (the
CUDA C++ kernels of ``mxtrain/csrc``, built on first use: today the MX cast, see
:mod:`mxtrain.kernels.cuda_cast`). ``MXTRAIN_BACKEND`` or the ``backend=`` argument
forces one (what it selects per operation: :mod:`mxtrain.config`); a forced ``"cuda"`` runs Triton's kernel for operations that have no
CUDA C++ one. By default CUDA tensors take the fastest registered kernel (CUDA C++,
then Triton: ``benchmarks/RESULTS.md``) and CPU tensors the reference.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import torch

from mxtrain import config
from mxtrain.quantization import MXTensor, quantize_mx
from mxtrain.quantization.float8 import Float8Tensor, quantize_float8 as quantize_float8_reference

BACKENDS = ("auto", "reference", "triton", "cuda")

# name -> quantize implementation with quantize_mx's signature; filled by kernel modules
_QUANTIZE_IMPLS: dict[str, Callable[..., MXTensor]] = {"reference": quantize_mx}
_GEMM_IMPLS: dict[str, Callable[..., torch.Tensor]] = {}
# name -> dequantize implementation (mxt, dtype, axis) -> tensor; filled by kernel modules
_DEQUANTIZE_IMPLS: dict[str, Callable[..., torch.Tensor]] = {}
# FP8 (mxtrain.recipes.float8): casts with quantize_float8's signature, GEMMs with mx_gemm's
_FLOAT8_QUANTIZE_IMPLS: dict[str, Callable[..., Float8Tensor]] = {"reference": quantize_float8_reference}
_FLOAT8_GEMM_IMPLS: dict[str, Callable[..., torch.Tensor]] = {}
_PREFERENCE = ("cuda", "triton")
_LOADER: Callable[[], None] | None = None


def register_quantize(name: str, fn: Callable[..., MXTensor]) -> None:
    _QUANTIZE_IMPLS[name] = fn


def register_gemm(name: str, fn: Callable[..., torch.Tensor]) -> None:
    _GEMM_IMPLS[name] = fn


def register_dequantize(name: str, fn: Callable[..., torch.Tensor]) -> None:
    _DEQUANTIZE_IMPLS[name] = fn


def register_float8_quantize(name: str, fn: Callable[..., Float8Tensor]) -> None:
    _FLOAT8_QUANTIZE_IMPLS[name] = fn


def register_float8_gemm(name: str, fn: Callable[..., torch.Tensor]) -> None:
    _FLOAT8_GEMM_IMPLS[name] = fn


def set_kernel_loader(loader: Callable[[], None]) -> None:
    """Install the function that imports the kernel modules on first use (``mxtrain/kernels/__init__.py``
    does, so the kernel modules, which register here, never import the file that imports them)."""
    global _LOADER
    _LOADER = loader


def _load_kernels() -> None:
    """Import the kernel modules once, where they can run (they register themselves)."""
    if _LOADER is not None:
        _LOADER()


def _resolve(backend: str | None, device: torch.device, impls: dict) -> str:
    _load_kernels()
    backend = backend or config.current().backend
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; allowed: {', '.join(BACKENDS)} (argument or MXTRAIN_BACKEND)")
    if backend == "auto":
        if device.type == "cuda":
            for name in _PREFERENCE:
                if name in impls:
                    return name
        return "reference"
    if backend == "cuda" and impls is not _QUANTIZE_IMPLS and "triton" in impls:
        return "triton"  # "cuda": the CUDA C++ kernels where an operation has one (the cast), Triton's elsewhere
    if backend != "reference" and backend not in impls:
        raise RuntimeError(f"backend {backend!r} is not available here (registered: {', '.join(impls) or 'none'})")
    return backend


VALUES_DTYPES = (torch.bfloat16, torch.float32, torch.float16)


def values_request(ndim: int, axis, dequantized, keep_codes, dtype) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Normalized ``(dequantized axes, axes whose codes are kept)`` of a quantize call, validated.

    ``dequantized``: axes (among ``axis``) whose dequantized values the result carries;
    ``keep_codes``: axes whose codes+scales it keeps (None: all of ``axis``). Every axis of
    ``axis`` needs its codes or its values. Remembered per argument tuple (every cast of a
    training step asks it, with a handful of distinct requests).
    """
    try:
        return _values_request_cached(ndim, axis, dequantized, keep_codes, dtype)
    except TypeError:  # unhashable arguments (lists): worked out afresh
        return _values_request(ndim, axis, dequantized, keep_codes, dtype)


def _values_request(ndim: int, axis, dequantized, keep_codes, dtype) -> tuple[tuple[int, ...], tuple[int, ...]]:
    axes = axis if isinstance(axis, tuple) else (axis,)
    norm = lambda a: a % ndim if ndim and -ndim <= a < ndim else a  # noqa: E731  (bad axes: quantize_mx says)
    axes = tuple(norm(a) for a in axes)
    deq = dequantized if isinstance(dequantized, (tuple, list)) else (dequantized,)
    deq = tuple(dict.fromkeys(norm(a) for a in deq))
    keep = axes if keep_codes is None else (keep_codes if isinstance(keep_codes, (tuple, list)) else (keep_codes,))
    keep = tuple(dict.fromkeys(norm(a) for a in keep))
    for what, sub in (("dequantized", deq), ("keep_codes", keep)):
        if any(a not in axes for a in sub):
            raise ValueError(f"{what} axes {sub} must be among the quantized axes {axes}")
    if any(a not in keep and a not in deq for a in axes):
        raise ValueError(f"axes {axes}: each needs its codes kept or its values dequantized "
                         f"(keep_codes={keep}, dequantized={deq})")
    if deq and dtype not in VALUES_DTYPES:
        raise ValueError(f"dequantized_dtype must be one of {VALUES_DTYPES}, got {dtype}")
    return deq, keep


_values_request_cached = functools.lru_cache(maxsize=1024, typed=True)(_values_request)


def attach_values(mxt: MXTensor, dequantized: tuple[int, ...], dtype: torch.dtype,
                  keep_codes: tuple[int, ...], backend: str | None = None) -> MXTensor:
    """``mxt`` with the dequantized values of the ``dequantized`` axes attached and only the planes of
    ``keep_codes`` kept: the semantics of ``quantize(..., dequantized=...)`` (quantize, then dequantize)."""
    values = tuple((a, dequantize(mxt, dtype, a, backend=backend)) for a in dequantized)
    planes = tuple(p for p in mxt.planes if p.axis in keep_codes)
    return dataclasses.replace(mxt, planes=planes, values=values)


def quantize(x: torch.Tensor, fmt, block_size: int = 32, axis=-1, scale_mode: str = "floor",
             rounding: str = "even", seed=None, pack: bool = True, backend: str | None = None,
             dequantized=(), dequantized_dtype: torch.dtype = torch.bfloat16, keep_codes=None) -> MXTensor:
    """``quantize_mx`` through the selected backend (bit-identical across backends).

    ``dequantized``: axes (among ``axis``) whose plane the result also carries as
    dequantized values in ``dequantized_dtype`` (logical layout; see
    :attr:`MXTensor.values`), bit-identical to ``result.dequantize(dtype, axis)``.
    The Triton cast writes them in the same pass (no separate dequantize pass);
    other backends quantize, then dequantize. ``keep_codes``: axes whose codes and
    scales are kept (default: all); a plane needed only as a GEMM operand right
    away can skip its codes (``keep_codes`` without that axis).
    """
    name = _resolve(backend, x.device, _QUANTIZE_IMPLS)
    fn = _QUANTIZE_IMPLS[name]
    kw = dict(block_size=block_size, axis=axis, scale_mode=scale_mode, rounding=rounding, seed=seed, pack=pack)
    if dequantized == () and keep_codes is None:
        return fn(x, fmt, **kw)
    deq, keep = values_request(x.ndim, axis, dequantized, keep_codes, dequantized_dtype)
    if getattr(fn, "supports_values", False):
        return fn(x, fmt, **kw, dequantized=deq, dequantized_dtype=dequantized_dtype, keep_codes=keep)
    return attach_values(fn(x, fmt, **kw), deq, dequantized_dtype, keep,
                         backend="reference" if name == "reference" else None)


def dequantize(mxt: MXTensor, dtype: torch.dtype | None = None, axis: int | None = None,
               backend: str | None = None) -> torch.Tensor:
    """``mxt.dequantize(dtype, axis)`` through the selected backend (bit-identical across backends)."""
    name = _resolve(backend, mxt.device, _DEQUANTIZE_IMPLS)
    if name == "reference" or mxt.values_only(axis) is not None:  # values without codes: cast them
        return mxt.dequantize(dtype, axis)
    return _DEQUANTIZE_IMPLS[name](mxt, dtype, axis)


def quantize_float8(x: torch.Tensor, fmt, *, axes=-1, scale: torch.Tensor | None = None, block=None,
                    power_of_2_scales: bool = False, amax_epsilon: float = 0.0, amax_reduction_group=None,
                    backend: str | None = None) -> Float8Tensor:
    """``mxtrain.quantization.float8.quantize_float8`` through the selected backend (bit-identical)."""
    name = _resolve(backend, x.device, _FLOAT8_QUANTIZE_IMPLS)
    return _FLOAT8_QUANTIZE_IMPLS[name](x, fmt, axes=axes, scale=scale, block=block,
                                        power_of_2_scales=power_of_2_scales, amax_epsilon=amax_epsilon,
                                        amax_reduction_group=amax_reduction_group)


def gemm_operand(t: "MXTensor | torch.Tensor", axis: int) -> torch.Tensor:
    """fp32 values of a 2-D GEMM operand with its reduction axis ``axis`` moved last.

    An :class:`MXTensor` must have a plane blocked along ``axis`` (blocks run
    along the reduction dim); a plain tensor is used as is (high precision).
    """
    if isinstance(t, (MXTensor, Float8Tensor)):
        if t.ndim != 2:
            raise ValueError(f"GEMM operands must be 2-D, got an {type(t).__name__} of shape {list(t.shape)}")
        return t.dequantize_blocked(torch.float32, axis=axis)
    if t.ndim != 2:
        raise ValueError(f"GEMM operands must be 2-D, got shape {list(t.shape)}")
    t = t.float()
    return t if axis % 2 == 1 else t.t()


def mx_gemm(a: "MXTensor | torch.Tensor", b: "MXTensor | torch.Tensor", *, a_axis: int = 1, b_axis: int = 1,
            out_dtype: torch.dtype = torch.float32, bias: torch.Tensor | None = None,
            backend: str | None = None) -> torch.Tensor:
    """``A @ B.T (+ bias)`` with fp32 accumulation, reducing along ``a_axis`` of a and ``b_axis`` of b.

    The result equals the fp32-accumulated product of the dequantized operands
    (the order of accumulation is free), plus ``bias`` in fp32, rounded once to
    ``out_dtype``. Fprop ``X W^T``: ``(x, 1), (w, 1)``; dgrad ``dY W``:
    ``(dy, 1), (w, 0)``; wgrad ``dY^T X``: ``(dy, 0), (x, 0)``. CUDA operands take
    the cuBLAS path of :mod:`mxtrain.kernels.gemm` (``Float8Tensor`` operands: the FP8
    GEMMs of :mod:`mxtrain.kernels.float8_gemm`); others the reference.
    """
    device = a.device if isinstance(a, (MXTensor, Float8Tensor, torch.Tensor)) else torch.device("cpu")
    # FP8 operands (Float8Tensor) have GEMMs of their own (mxtrain/kernels/float8_gemm.py)
    impls = _FLOAT8_GEMM_IMPLS if isinstance(a, Float8Tensor) or isinstance(b, Float8Tensor) else _GEMM_IMPLS
    # a forced kernel backend names the casts; the GEMM then takes whatever GPU GEMM exists
    requested = backend or config.current().backend
    name = _resolve("reference" if requested == "reference" else "auto", device, impls)
    if name != "reference":
        return impls[name](a, b, a_axis=a_axis, b_axis=b_axis, out_dtype=out_dtype, bias=bias)
    return reference_gemm(a, b, a_axis=a_axis, b_axis=b_axis, out_dtype=out_dtype, bias=bias)


def reference_gemm(a, b, *, a_axis: int, b_axis: int, out_dtype: torch.dtype, bias=None) -> torch.Tensor:
    """The reference of :func:`mx_gemm`: the fp32 GEMM of the dequantized operands, fp32 bias, one rounding."""
    av, bv = gemm_operand(a, a_axis), gemm_operand(b, b_axis)
    if av.shape[1] != bv.shape[1]:
        raise ValueError(f"GEMM reduction sizes differ: {av.shape[1]} vs {bv.shape[1]}")
    out = av @ bv.t()
    if bias is not None:
        out += bias.float()
    return out.to(out_dtype)
