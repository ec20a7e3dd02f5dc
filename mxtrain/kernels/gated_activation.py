"""Gated MLP activations ``act(h[:, :F]) * h[:, F:]`` and their gradient, one Triton pass each.

Eager torch runs the gate's activation and the product as separate kernels over strided halves of
``h`` (non-vectorised), and its backward recomputes the activation and runs four more; these read
``h`` (and the gradient) once and write the result once. The roundings are torch's: the activation
is rounded to ``h``'s dtype before the product, as are ``g * up`` and ``g * act(gate)`` before the
activation's derivative; the fp32 formulas are :mod:`mxtrain.kernels.cast`'s (torch's CUDA ones on
the GPU), so results are torch's up to an ulp where CUDA's libm differs.
"""

from __future__ import annotations

import torch

from mxtrain.activations import GATED
from mxtrain.kernels.ids import DTYPE_IDS, gate_activation_id
from mxtrain.kernels._triton_utils import (HAVE_TRITON, bf16_bits, device_supported, interpret_mode, launch_options,
                                            tl, triton)

__all__ = ["GATE_IDS", "gated_activation", "gated_activation_backward", "supports"]

# gated activation -> the gate's activation id in cast._activation / cast._act_bwd
GATE_IDS = {name: gate_activation_id(name) for name in GATED}
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

if HAVE_TRITON:
    from mxtrain.kernels.cast import _BF16, _act_bwd, _activation, _round_to_dtype, _store_out, _widen

    @triton.jit
    def _gated_forward_kernel(h_ptr, y_ptr, F, stride_h, stride_y, ACT: tl.constexpr, OUT_KIND: tl.constexpr,
                              GPU: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < F
        gate = _widen(tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0), OUT_KIND == _BF16)
        up = _widen(tl.load(h_ptr + row * stride_h + F + cols, mask=mask, other=0), OUT_KIND == _BF16)
        a = _round_to_dtype(_activation(gate, ACT, GPU), OUT_KIND)
        _store_out(y_ptr + row * stride_y + cols, _round_to_dtype(a * up, OUT_KIND), mask, OUT_KIND)

    @triton.jit
    def _gated_backward_kernel(h_ptr, g_ptr, dh_ptr, F, stride_h, stride_g, stride_dh, ACT: tl.constexpr,
                               OUT_KIND: tl.constexpr, GPU: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < F
        gate = _widen(tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0), OUT_KIND == _BF16)
        up = _widen(tl.load(h_ptr + row * stride_h + F + cols, mask=mask, other=0), OUT_KIND == _BF16)
        g = _widen(tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0), OUT_KIND == _BF16)
        a = _round_to_dtype(_activation(gate, ACT, GPU), OUT_KIND)
        d_up = _round_to_dtype(g * a, OUT_KIND)
        d_gate = _round_to_dtype(_act_bwd(gate, _round_to_dtype(g * up, OUT_KIND), ACT, GPU), OUT_KIND)
        _store_out(dh_ptr + row * stride_dh + cols, d_gate, mask, OUT_KIND)
        _store_out(dh_ptr + row * stride_dh + F + cols, d_up, mask, OUT_KIND)


def supports(h: torch.Tensor, name: str, grad: torch.Tensor | None = None) -> str | None:
    """None where the kernels take ``h`` (and ``grad``), else why not."""
    if name not in GATE_IDS:
        return f"{name!r} is not a gated activation"
    if not HAVE_TRITON or not device_supported(h.device):
        return f"no Triton kernels for {h.device.type} tensors here"
    if h.ndim != 2 or h.shape[1] % 2 or h.stride(1) != 1 or h.dtype not in _DTYPES:
        return "h must be a row-contiguous [tokens, 2 * ffn] float32/bfloat16/float16 tensor"
    if grad is not None and (grad.shape != (h.shape[0], h.shape[1] // 2) or grad.dtype != h.dtype
                             or grad.stride(1) != 1):
        return "grad must be a row-contiguous [tokens, ffn] tensor of h's dtype"
    return None


def _grid(rows: int, f: int, block: int):
    return rows, triton.cdiv(f, block)


def gated_activation(h: torch.Tensor, name: str) -> torch.Tensor:
    """``act(h[:, :F]) * h[:, F:]`` for a gated activation ``name`` (see :data:`GATE_IDS`)."""
    why = supports(h, name)
    if why is not None:
        raise ValueError(f"gated_activation: {why}")
    f = h.shape[1] // 2
    y = torch.empty(h.shape[0], f, dtype=h.dtype, device=h.device)
    if y.numel():
        block = min(1024, triton.next_power_of_2(f))
        _gated_forward_kernel[_grid(h.shape[0], f, block)](
            bf16_bits(h), bf16_bits(y), f, h.stride(0), y.stride(0), ACT=GATE_IDS[name], OUT_KIND=DTYPE_IDS[h.dtype],
            GPU=not interpret_mode(), BLOCK=block, **launch_options())
    return y


def gated_activation_backward(h: torch.Tensor, grad: torch.Tensor, name: str) -> torch.Tensor:
    """``dh`` of :func:`gated_activation` for the output gradient ``grad``: ``[tokens, 2 * F]``, h's dtype."""
    why = supports(h, name, grad)
    if why is not None:
        raise ValueError(f"gated_activation_backward: {why}")
    f = h.shape[1] // 2
    dh = torch.empty_like(h, memory_format=torch.contiguous_format)
    if dh.numel():
        block = min(1024, triton.next_power_of_2(f))
        _gated_backward_kernel[_grid(h.shape[0], f, block)](
            bf16_bits(h), bf16_bits(grad), bf16_bits(dh), f, h.stride(0), grad.stride(0), dh.stride(0),
            ACT=GATE_IDS[name],
            OUT_KIND=DTYPE_IDS[h.dtype], GPU=not interpret_mode(), BLOCK=block, **launch_options())
    return dh
