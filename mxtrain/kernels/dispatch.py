"""The one dispatch point between kernels and the reference numerics.

Backends: ``"reference"`` (pure PyTorch, any device) and, once registered by
the GPU kernel modules, ``"triton"`` / ``"cuda"``. ``MXTRAIN_BACKEND`` or the
``backend=`` argument forces one; by default CUDA tensors take the fastest
registered kernel and CPU tensors the reference.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from mxtrain.quantization import MXTensor, quantize_mx

BACKENDS = ("auto", "reference", "triton", "cuda")

# name -> quantize implementation with quantize_mx's signature; filled by kernel modules
_QUANTIZE_IMPLS: dict[str, Callable[..., MXTensor]] = {"reference": quantize_mx}
_GEMM_IMPLS: dict[str, Callable[..., torch.Tensor]] = {}
# name -> dequantize implementation (mxt, dtype, axis) -> tensor; filled by kernel modules
_DEQUANTIZE_IMPLS: dict[str, Callable[..., torch.Tensor]] = {}
_PREFERENCE = ("cuda", "triton")
_KERNELS_LOADED = False


def register_quantize(name: str, fn: Callable[..., MXTensor]) -> None:
    _QUANTIZE_IMPLS[name] = fn


def register_gemm(name: str, fn: Callable[..., torch.Tensor]) -> None:
    _GEMM_IMPLS[name] = fn


def register_dequantize(name: str, fn: Callable[..., torch.Tensor]) -> None:
    _DEQUANTIZE_IMPLS[name] = fn


def _load_kernels() -> None:
    """Import the Triton kernel modules once, where they can run (they register themselves).

    Only with CUDA or ``TRITON_INTERPRET=1``: CPU-only users never pay for importing Triton.
    """
    global _KERNELS_LOADED
    if _KERNELS_LOADED or not (os.environ.get("TRITON_INTERPRET", "0") == "1" or torch.cuda.is_available()):
        return
    _KERNELS_LOADED = True
    try:
        import mxtrain.kernels.cast  # noqa: F401
        import mxtrain.kernels.dequantize  # noqa: F401
        if torch.cuda.is_available():
            import mxtrain.kernels.gemm  # noqa: F401
    except ImportError:  # no (working) triton: the reference serves every call
        pass


def _resolve(backend: str | None, device: torch.device, impls: dict) -> str:
    _load_kernels()
    backend = backend or os.environ.get("MXTRAIN_BACKEND", "auto")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; allowed: {', '.join(BACKENDS)} (argument or MXTRAIN_BACKEND)")
    if backend == "auto":
        if device.type == "cuda":
            for name in _PREFERENCE:
                if name in impls:
                    return name
        return "reference"
    if backend != "reference" and backend not in impls:
        raise RuntimeError(f"backend {backend!r} is not available here (registered: {', '.join(impls) or 'none'})")
    return backend


def quantize(x: torch.Tensor, fmt, block_size: int = 32, axis=-1, scale_mode: str = "floor",
             rounding: str = "even", seed=None, pack: bool = True, backend: str | None = None) -> MXTensor:
    """``quantize_mx`` through the selected backend (bit-identical across backends)."""
    name = _resolve(backend, x.device, _QUANTIZE_IMPLS)
    return _QUANTIZE_IMPLS[name](x, fmt, block_size=block_size, axis=axis, scale_mode=scale_mode,
                                 rounding=rounding, seed=seed, pack=pack)


def dequantize(mxt: MXTensor, dtype: torch.dtype | None = None, axis: int | None = None,
               backend: str | None = None) -> torch.Tensor:
    """``mxt.dequantize(dtype, axis)`` through the selected backend (bit-identical across backends)."""
    name = _resolve(backend, mxt.device, _DEQUANTIZE_IMPLS)
    if name == "reference":
        return mxt.dequantize(dtype, axis)
    return _DEQUANTIZE_IMPLS[name](mxt, dtype, axis)


def gemm_operand(t: "MXTensor | torch.Tensor", axis: int) -> torch.Tensor:
    """fp32 values of a 2-D GEMM operand with its reduction axis ``axis`` moved last.

    An :class:`MXTensor` must have a plane blocked along ``axis`` (blocks run
    along the reduction dim); a plain tensor is used as is (high precision).
    """
    if isinstance(t, MXTensor):
        if t.ndim != 2:
            raise ValueError(f"GEMM operands must be 2-D, got an MXTensor of shape {list(t.shape)}")
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
    the cuBLAS path of :mod:`mxtrain.kernels.gemm`; others the reference.
    """
    device = a.device if isinstance(a, (MXTensor, torch.Tensor)) else torch.device("cpu")
    # a forced kernel backend names the casts; the GEMM then takes whatever GPU GEMM exists
    requested = backend or os.environ.get("MXTRAIN_BACKEND", "auto")
    name = _resolve("reference" if requested == "reference" else "auto", device, _GEMM_IMPLS)
    if name != "reference":
        return _GEMM_IMPLS[name](a, b, a_axis=a_axis, b_axis=b_axis, out_dtype=out_dtype, bias=bias)
    av, bv = gemm_operand(a, a_axis), gemm_operand(b, b_axis)
    if av.shape[1] != bv.shape[1]:
        raise ValueError(f"GEMM reduction sizes differ: {av.shape[1]} vs {bv.shape[1]}")
    out = av @ bv.t()
    if bias is not None:
        out += bias.float()
    return out.to(out_dtype)
