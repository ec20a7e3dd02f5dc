"""The transpose of a 2-D tensor of one-byte elements (FP8 codes), written contiguous.

A gathered FP8 weight's dgrad plane is the transpose of its rowwise codes (cuBLAS on Hopper reads both FP8
operands along the reduction axis). torch's ``out.copy_(src.t())`` moves one-byte elements with a strided
elementwise kernel at a tenth of the copy bandwidth: about 13 ms a step for a 1B Llama under FSDP2 (2 x H100).
The Triton kernel reads a tile along rows and writes it along the transposed rows.

One operation of the kernel registry, ``transpose_bytes``: ``reference`` (torch's copy, any device) and
``triton``. Same bytes by construction (no arithmetic).
"""

from __future__ import annotations

import torch

from mxtrain.kernels import registry
from mxtrain.kernels.calls import TransposeCall
from mxtrain.kernels._triton_utils import HAVE_TRITON, device_supported, tl, triton

__all__ = ["transpose_bytes", "TRANSPOSE_TILE"]

TRANSPOSE_TILE = (128, 128, 8)  # (rows, cols, warps) of a program's tile (H100: 2.0-2.3 TB/s, torch 0.29)


def _make_call(*, src, out=None):
    return TransposeCall(src, out)


def _reference(call: TransposeCall) -> torch.Tensor:
    return call.out.copy_(call.src.t())


if HAVE_TRITON:
    @triton.jit
    def _transpose_kernel(src_ptr, out_ptr, M, N, stride_s, stride_o, BM: tl.constexpr, BN: tl.constexpr):
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        tile = tl.load(src_ptr + rm[:, None].to(tl.int64) * stride_s + rn[None, :],
                       mask=(rm[:, None] < M) & (rn[None, :] < N))
        tl.store(out_ptr + rn[:, None].to(tl.int64) * stride_o + rm[None, :], tl.trans(tile),
                 mask=(rn[:, None] < N) & (rm[None, :] < M))

    def _triton_supports(call: TransposeCall) -> str | None:
        if not device_supported(call.src.device):
            return f"no Triton kernels for {call.src.device.type} tensors here"
        if call.src.stride(1) != 1 or call.out.stride(1) != 1:
            return "rows must be contiguous (source and output)"
        return None

    def _triton(call: TransposeCall) -> torch.Tensor:
        src, out = call.src, call.out
        m, n = src.shape
        if src.numel():
            bm, bn, warps = TRANSPOSE_TILE
            _transpose_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
                src.view(torch.uint8), out.view(torch.uint8), m, n, src.stride(0), out.stride(0), BM=bm, BN=bn,
                num_warps=warps)
        return out


registry.define(registry.Operation("transpose_bytes", _make_call, TransposeCall.key))
registry.register("transpose_bytes", "reference", _reference)
if HAVE_TRITON:
    registry.register("transpose_bytes", "triton", _triton, supports=_triton_supports)


def transpose_bytes(src: torch.Tensor, out: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
    """``src.t()`` as a contiguous tensor (written into ``out`` if given: ``[N, M]``, ``src``'s dtype and
    device, rows contiguous). ``src``: ``[M, N]``, a one-byte dtype (FP8 codes, uint8, int8), rows contiguous."""
    if src.ndim != 2 or src.element_size() != 1:
        raise ValueError(f"transpose_bytes: src must be a 2-D tensor of one-byte elements (FP8, uint8, int8), "
                         f"got {src.dtype} of shape {tuple(src.shape)}")
    if out is None:
        out = torch.empty((src.shape[1], src.shape[0]), dtype=src.dtype, device=src.device)
    elif out.shape != (src.shape[1], src.shape[0]) or out.dtype != src.dtype or out.device != src.device:
        raise ValueError(f"transpose_bytes: out must be {src.dtype} of shape {(src.shape[1], src.shape[0])} on "
                         f"{src.device}, got {out.dtype} of shape {tuple(out.shape)} on {out.device}")
    return registry.run("transpose_bytes", TransposeCall(src, out), src.device, backend)
