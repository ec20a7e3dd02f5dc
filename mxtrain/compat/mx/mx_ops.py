"""MX block fake quantization from mx_specs: :func:`quantize_mx_op`.

Shared exponent ``floor(log2 amax) - emax`` from the exponent bits (exact),
clamped to ``+-(2**(scale_bits-1)-1)`` (``scale_bits=0`` means 8); elements
rounded per ``round`` and saturated; blocks of ``block_size`` along ``axes``
(``block_size=0``: the whole axis, or the whole tensor when ``axes`` is None).
This is ``mxtrain.fake_quantize_mx(..., scale_mode="floor")`` (on the CPU its lookup tables),
through :func:`mxtrain.elementwise.fake_quantize_mx_floor` for microxcaling's scale options; with
``custom_cuda=True`` on a CUDA tensor the quantize/dequantize kernels of
:mod:`mxtrain.kernels.dispatch` run (the same bits).
"""

from __future__ import annotations


import torch

from mxtrain import config
from mxtrain.compat.mx.formats import mx_elem_format, rounding_of
from mxtrain.compat.mx.specs import mx_assert_test
from mxtrain.emulation.rounding import FAST_ROUNDINGS, fake_quantize_mx_floor
from mxtrain.formats import MX_FORMAT_NAMES
from mxtrain.quantization import fake_quantize_mx

__all__ = ["quantize_mx_op", "fake_quantize"]

# MXTRAIN_COMPAT_REFERENCE=1 runs the reference quantizer itself (slower, same bits)


def fake_quantize(A: torch.Tensor, fmt, block_size: int, axis: int, rounding: str, scale_bits: int = 8,
                  flush_fp32_subnorms: bool = False, custom_cuda: bool = False) -> torch.Tensor:
    """MX fake quantization along one axis with the floor shared exponent (mxtrain rounding names)."""
    plain = scale_bits == 8 and not flush_fp32_subnorms
    if custom_cuda and A.is_cuda and plain and fmt.name in MX_FORMAT_NAMES and rounding in FAST_ROUNDINGS:
        from mxtrain.kernels import dispatch
        mxt = dispatch.quantize(A, fmt, block_size=block_size, axis=axis, scale_mode="floor", rounding=rounding,
                                pack=False)
        return dispatch.dequantize(mxt, A.dtype)
    if config.current().compat_reference and plain:
        return fake_quantize_mx(A, fmt, block_size=block_size, axis=axis, scale_mode="floor", rounding=rounding)
    return fake_quantize_mx_floor(A, fmt, block_size, axis, rounding, scale_bits, flush_fp32_subnorms)


def quantize_mx_op(A, mx_specs: dict, elem_format=None, block_size=None, axes=None, round="nearest",
                   expand_and_reshape=False):
    """MX-quantize ``A`` (returned dequantized, same shape and dtype), as microxcaling's ``quantize_mx_op``."""
    mx_assert_test(mx_specs)
    if elem_format is None:
        return A
    fmt = mx_elem_format(elem_format)
    if block_size is None:
        block_size = mx_specs["block_size"]
    scale_bits = mx_specs["scale_bits"] or 8
    if not 2 <= scale_bits <= 8:
        raise ValueError(f"mx_specs['scale_bits'] must be 0 (= 8) or 2..8, got {scale_bits}")
    method = mx_specs["shared_exp_method"]
    if method not in ("max", "none"):
        raise ValueError(f"Unrecognized shared exponent selection method {method!r}; use 'max' or 'none'")
    rounding = rounding_of(round)
    common = dict(rounding=rounding, scale_bits=scale_bits, flush_fp32_subnorms=bool(mx_specs["mx_flush_fp32_subnorms"]),
                  custom_cuda=bool(mx_specs["custom_cuda"]))
    if A.ndim == 0:
        return fake_quantize(A.reshape(1), fmt, 1, 0, **common).reshape(())
    if method == "none":  # one exponent per element
        return fake_quantize(A, fmt, 1, -1, **common)
    if axes is None:
        if block_size:
            raise ValueError("axes required in order to determine which dimension to apply block size to")
        return fake_quantize(A.reshape(-1), fmt, 0, 0, **common).view(A.shape)
    axes = [axes] if isinstance(axes, int) else list(axes)
    axes = sorted({a % A.ndim for a in axes})
    if len(axes) == 1:
        return fake_quantize(A, fmt, block_size, axes[0], **common)
    if block_size:
        raise NotImplementedError(f"MX tiles over several axes ({axes}) with block_size={block_size} are not "
                                  "supported; quantize along one axis or use block_size=0")
    # block_size 0 over several axes: one scale per slice spanning all of them
    rest = [d for d in range(A.ndim) if d not in axes]
    perm = rest + axes
    moved = A.permute(perm)
    lead = moved.shape[:len(rest)]
    out = fake_quantize(moved.reshape(*lead, -1), fmt, 0, -1, **common).view(moved.shape)
    return out.permute([perm.index(d) for d in range(A.ndim)])
