"""The transpose of a 2-D tensor of one-byte elements (FP8 codes), written contiguous.

A gathered FP8 weight's dgrad plane is the transpose of its rowwise codes (cuBLAS on Hopper reads both FP8
operands along the reduction axis). torch's ``out.copy_(src.t())`` moves one-byte elements with a strided
elementwise kernel at a tenth of the copy bandwidth: about 13 ms a step for a 1B Llama under FSDP2 (2 x H100).
The Triton kernel reads a tile along rows and writes it along the transposed rows.

One operation of the kernel registry, ``transpose_bytes``: ``reference`` (torch's copy, any device) and
``triton``. Same bytes by construction (no arithmetic). ``transpose_bytes_many`` transposes several tensors,
up to ``GROUP`` of them in one launch (an FSDP2 group's dgrad planes after its backward all-gather: the host
launches once for the group, not once a weight).
"""

from __future__ import annotations

import torch

from mxtrain.kernels import registry
from mxtrain.kernels.calls import TransposeCall, TransposeManyCall
from mxtrain.kernels._triton_utils import HAVE_TRITON, device_supported, tl, triton

__all__ = ["transpose_bytes", "transpose_bytes_many", "TRANSPOSE_TILE", "GROUP"]

TRANSPOSE_TILE = (128, 128, 8)  # (rows, cols, warps) of a program's tile (H100: 2.0-2.3 TB/s, torch 0.29)
GROUP = 4  # tensors one launch of the grouped kernel transposes


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

    @triton.jit
    def _tile_transpose(src_ptr, out_ptr, M, N, stride_s, stride_o, t, BM: tl.constexpr, BN: tl.constexpr):
        """Tile ``t`` (row-major over the tiles of ``src``) of ``out = src.t()``."""
        tiles_n = tl.cdiv(N, BN)
        rm = (t // tiles_n) * BM + tl.arange(0, BM)
        rn = (t % tiles_n) * BN + tl.arange(0, BN)
        tile = tl.load(src_ptr + rm[:, None].to(tl.int64) * stride_s + rn[None, :],
                       mask=(rm[:, None] < M) & (rn[None, :] < N))
        tl.store(out_ptr + rn[:, None].to(tl.int64) * stride_o + rm[None, :], tl.trans(tile),
                 mask=(rn[:, None] < N) & (rm[None, :] < M))

    @triton.jit
    def _transpose_group_kernel(s0, o0, m0, n0, ss0, so0, s1, o1, m1, n1, ss1, so1, s2, o2, m2, n2, ss2, so2,
                                s3, o3, m3, n3, ss3, so3, E1, E2, E3, BM: tl.constexpr, BN: tl.constexpr):
        """Four transposes in one 1-D grid: programs [0, E1) tile the first, [E1, E2) the second, and so on."""
        pid = tl.program_id(0)
        if pid < E1:
            _tile_transpose(s0, o0, m0, n0, ss0, so0, pid, BM, BN)
        elif pid < E2:
            _tile_transpose(s1, o1, m1, n1, ss1, so1, pid - E1, BM, BN)
        elif pid < E3:
            _tile_transpose(s2, o2, m2, n2, ss2, so2, pid - E2, BM, BN)
        else:
            _tile_transpose(s3, o3, m3, n3, ss3, so3, pid - E3, BM, BN)

    def _triton_many_supports(call: TransposeManyCall) -> str | None:
        for src, out in zip(call.srcs, call.outs):
            why = _triton_supports(TransposeCall(src, out))
            if why is not None:
                return why
        return None

    def _triton_many(call: TransposeManyCall) -> tuple:
        bm, bn, warps = TRANSPOSE_TILE
        pairs = [(s, o) for s, o in zip(call.srcs, call.outs) if s.numel()]
        for i in range(0, len(pairs), GROUP):
            group = pairs[i:i + GROUP]
            args, ends, total = [], [], 0
            for j in range(GROUP):  # a spare slot: the group's first tensor again, with no tiles
                src, out = group[j] if j < len(group) else group[0]
                m, n = src.shape if j < len(group) else (0, 0)
                args += [src.view(torch.uint8), out.view(torch.uint8), m, n, src.stride(0), out.stride(0)]
                total += triton.cdiv(m, bm) * triton.cdiv(n, bn)
                ends.append(total)
            _transpose_group_kernel[(total,)](*args, ends[0], ends[1], ends[2], BM=bm, BN=bn, num_warps=warps)
        device = call.device
        if device not in _VERIFIED and pairs:
            # the first launch on a device checks its bytes against torch's transpose, once (a synchronisation):
            # a grouped kernel that computes wrong here is never used again (the registry walks on to torch's copy)
            if not all(torch.equal(out.view(torch.uint8), src.view(torch.uint8).t()) for src, out in pairs):
                raise registry.KernelUnavailable("the grouped Triton transpose wrote wrong bytes on its first launch")
            _VERIFIED.add(device)
        return call.outs

    _VERIFIED: set = set()  # devices where a grouped launch was checked against torch's transpose

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


def _make_many_call(*, srcs, outs):
    return TransposeManyCall(srcs, outs)


def _reference_many(call: TransposeManyCall) -> tuple:
    for src, out in zip(call.srcs, call.outs):
        out.copy_(src.t())
    return call.outs


registry.define(registry.Operation("transpose_bytes_many", _make_many_call))
registry.register("transpose_bytes_many", "reference", _reference_many)
if HAVE_TRITON:
    registry.register("transpose_bytes_many", "triton", _triton_many, supports=_triton_many_supports)


def _check_pair(op: str, src: torch.Tensor, src_name: str, out: torch.Tensor | None, out_name: str,
                device: torch.device) -> None:
    """A source of one-byte elements, 2-D; an output (where given) of its transposed shape and dtype on ``device``."""
    if src.ndim != 2 or src.element_size() != 1:
        raise ValueError(f"{op}: {src_name} must be a 2-D tensor of one-byte elements (FP8, uint8, int8), "
                         f"got {src.dtype} of shape {tuple(src.shape)}")
    if out is not None and (out.shape != (src.shape[1], src.shape[0]) or out.dtype != src.dtype
                            or out.device != device):
        raise ValueError(f"{op}: {out_name} must be {src.dtype} of shape {(src.shape[1], src.shape[0])} on "
                         f"{device}, got {out.dtype} of shape {tuple(out.shape)} on {out.device}")


def transpose_bytes(src: torch.Tensor, out: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
    """``src.t()`` as a contiguous tensor (written into ``out`` if given: ``[N, M]``, ``src``'s dtype and
    device, rows contiguous). ``src``: ``[M, N]``, a one-byte dtype (FP8 codes, uint8, int8), rows contiguous."""
    _check_pair("transpose_bytes", src, "src", out, "out", src.device)
    if out is None:
        out = torch.empty((src.shape[1], src.shape[0]), dtype=src.dtype, device=src.device)
    return registry.run("transpose_bytes", TransposeCall(src, out), src.device, backend)


def transpose_bytes_many(srcs: list, outs: list, backend: str | None = None) -> list:
    """``outs[i] = srcs[i].t()`` for every ``i``, as :func:`transpose_bytes` makes each (``srcs[i]``: ``[M, N]``,
    one-byte elements, rows contiguous; ``outs[i]``: ``[N, M]``, its dtype, rows contiguous), all on one device.
    Triton transposes up to ``GROUP`` tensors in one launch. Returns ``outs``."""
    srcs, outs = list(srcs), list(outs)
    if len(srcs) != len(outs):
        raise ValueError(f"transpose_bytes_many: {len(srcs)} sources but {len(outs)} outputs")
    for i, (src, out) in enumerate(zip(srcs, outs)):
        _check_pair("transpose_bytes_many", src, f"source {i}", out, f"output {i}", srcs[0].device)
        if src.device != srcs[0].device:
            raise ValueError(f"transpose_bytes_many: every tensor must be on one device, source {i} is on "
                             f"{src.device}, source 0 on {srcs[0].device}")
    if not srcs:
        return outs
    registry.run("transpose_bytes_many", TransposeManyCall(srcs, outs), srcs[0].device, backend)
    return outs
