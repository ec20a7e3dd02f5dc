"""Triton MX dequantize, fused with the unpacking of fp6/fp4/int4/int2 codes.

One pass reads packed code and scale bytes and writes ``code * 2**X`` in the output dtype straight into the
logical layout, bit-identical to :meth:`mxtrain.quantization.MXTensor.dequantize`. Registered with
:mod:`mxtrain.kernels.registry` beside the CUDA C++ kernel (``mxtrain/csrc/mx_dequantize.cu``: MXFP8 planes of
block 32 into bf16, same bits), which the walk tries first on CUDA where its layout conditions hold.
How: docs/kernels.md.
"""

from __future__ import annotations

import dataclasses

import torch

from mxtrain import config
from mxtrain.kernels import registry
from mxtrain.kernels.calls import DequantizeCall, DequantizeShardsCall
from mxtrain.kernels._triton_utils import (
    HAVE_TRITON, decode_codes as _decode, device_supported, format_consts, interpret_mode, launch_options, tl, triton,
)
from mxtrain.quantization import MXTensor

__all__ = ["triton_dequantize", "triton_dequantize_shards", "TILE_CONFIG"]

# (BLOCK_R, BLOCK_L, num_warps); speed: benchmarks/NOTES_casts.md; the benchmark overrides it
TILE_CONFIG = (4, 1024, 4)
# tests set this to fill outputs with a pattern first, so unwritten elements show up
POISON_OUTPUTS = False

_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

if HAVE_TRITON:

    @triton.jit
    def _load_codes(data_ptr, rows, row_stride, row_mask, c0, LP, R: tl.constexpr, C: tl.constexpr,
                    PACK_BITS: tl.constexpr):
        """int32 codes [R, C] of columns c0.. of a plane (padded code length LP), unpacking as it loads."""
        row_off = rows[:, None] * row_stride
        if PACK_BITS == 8:
            cols = c0 + tl.arange(0, C)
            codes = tl.load(data_ptr + row_off + cols[None, :], mask=row_mask[:, None] & (cols < LP)[None, :],
                            other=0).to(tl.int32)
        elif PACK_BITS == 4:
            cols = c0 // 2 + tl.arange(0, C // 2)
            p = tl.load(data_ptr + row_off + cols[None, :], mask=row_mask[:, None] & (cols < LP // 2)[None, :],
                        other=0).to(tl.int32)
            codes = tl.reshape(tl.join(p & 15, p >> 4), (R, C))
        else:
            g = c0 // 4 + tl.arange(0, C // 4)
            mask = row_mask[:, None] & (g < LP // 4)[None, :]
            if PACK_BITS == 2:
                p = tl.load(data_ptr + row_off + g[None, :], mask=mask, other=0).to(tl.int32)
                a0 = p & 3
                a1 = (p >> 2) & 3
                a2 = (p >> 4) & 3
                a3 = p >> 6
            else:  # 6-bit, 4 codes in 3 bytes (see quantization/packing.py)
                ptr = data_ptr + row_off + (g * 3)[None, :]
                b0 = tl.load(ptr, mask=mask, other=0).to(tl.int32)
                b1 = tl.load(ptr + 1, mask=mask, other=0).to(tl.int32)
                b2 = tl.load(ptr + 2, mask=mask, other=0).to(tl.int32)
                a0 = (b0 & 15) | ((b2 & 3) << 4)
                a1 = (b0 >> 4) | (((b2 >> 2) & 3) << 4)
                a2 = (b1 & 15) | (((b2 >> 4) & 3) << 4)
                a3 = (b1 >> 4) | ((b2 >> 6) << 4)
            codes = tl.reshape(tl.join(tl.join(a0, a2), tl.join(a1, a3)), (R, C))
        return codes

    @triton.jit
    def _mx_dequantize_kernel(
        data_ptr, scale_ptr, out_ptr,
        R, L, LP, NB, data_stride, scale_stride, out_stride_r, out_stride_l,
        shard_data_step, shard_scale_step, shard_out_step,
        BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr, BS: tl.constexpr, PACK_BITS: tl.constexpr,
        INDEX64: tl.constexpr, IS_INT: tl.constexpr, BITS: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr,
        EMAX: tl.constexpr, BIAS: tl.constexpr, MAX_CODE: tl.constexpr, MAX_NORM: tl.constexpr,
        INV_MAX_BITS: tl.constexpr, NAN_KIND: tl.constexpr, SOFT_BF16: tl.constexpr,
    ):
        # grid axis 1: shards of one layout at constant steps (stacked planes, e.g. the ranks of an
        # all-gather buffer), each written to its own part of the output
        shard = tl.program_id(1).to(tl.int64)
        data_ptr += shard * shard_data_step
        scale_ptr += shard * shard_scale_step
        out_ptr += shard * shard_out_step
        n_l = tl.cdiv(L, BLOCK_L)
        pid = tl.program_id(0)
        pr = pid // n_l
        pl = pid % n_l
        rr = pr * BLOCK_R + tl.arange(0, BLOCK_R)
        if INDEX64:
            rr = rr.to(tl.int64)
        r_in = rr < R
        c0 = pl * BLOCK_L
        codes = _load_codes(data_ptr, rr, data_stride, r_in, c0, LP, BLOCK_R, BLOCK_L, PACK_BITS)
        v = _decode(codes, IS_INT, BITS, MBITS, EMIN, BIAS, NAN_KIND)
        NBT: tl.constexpr = BLOCK_L // BS if BLOCK_L >= BS else 1
        if BLOCK_L >= BS:
            blk = pl * NBT + tl.arange(0, NBT)
            sb = tl.load(scale_ptr + rr[:, None] * scale_stride + blk[None, :],
                         mask=r_in[:, None] & (blk < NB)[None, :], other=127).to(tl.int32)
            s = tl.where(sb == 255, 0x7FC00000, tl.where(sb == 0, 0x00400000, sb << 23)).to(tl.float32, bitcast=True)
            v = tl.reshape(tl.reshape(v, (BLOCK_R, NBT, BS)) * s[:, :, None], (BLOCK_R, BLOCK_L))
        else:
            cols = c0 + tl.arange(0, BLOCK_L)
            sb = tl.load(scale_ptr + rr[:, None] * scale_stride + (cols // BS)[None, :],
                         mask=r_in[:, None] & (cols < LP)[None, :], other=127).to(tl.int32)
            s = tl.where(sb == 255, 0x7FC00000, tl.where(sb == 0, 0x00400000, sb << 23)).to(tl.float32, bitcast=True)
            v = v * s
        cols = c0 + tl.arange(0, BLOCK_L)
        if INDEX64:
            cols = cols.to(tl.int64)
        if SOFT_BF16:  # the interpreter's fp32->bf16 cast mishandles subnormals: round to nearest even by hand
            vb = v.to(tl.int32, bitcast=True)
            hb = (vb + 0x7FFF + ((vb >> 16) & 1)) >> 16
            hb = tl.where(v != v, 0x7FC0, hb)
            out = hb.to(tl.int16).to(tl.bfloat16, bitcast=True)
        else:
            out = v.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + rr[:, None] * out_stride_r + cols[None, :] * out_stride_l, out,
                 mask=r_in[:, None] & (cols < L)[None, :])


def _fallback_reason(mxt: MXTensor, plane, dtype) -> str | None:
    """Why the Triton kernel cannot take this call (the registry then walks on to the reference), or None."""
    if not HAVE_TRITON:
        return "triton is not importable"
    if not device_supported(plane.data.device):
        return f"planes on {plane.data.device}"
    if dtype not in _OUT_DTYPES:
        return f"output dtype {dtype}"
    if mxt.whole_axis or mxt.block_size < 1 or mxt.block_size & (mxt.block_size - 1):
        return "block size is not a power of two"
    if plane.axis not in (0, mxt.ndim - 1):
        return f"plane blocked along axis {plane.axis}"
    if any(n == 0 for n in mxt.shape):
        return "empty tensor"
    if plane.packed and mxt.format.bits < 8 and mxt.block_size % (2 if mxt.format.bits == 4 else 4):
        return "block size not a multiple of the packing group"
    return None


def _start(device: torch.device) -> str:
    """Where the public entry points below start the walk: the CUDA C++ kernel where casts on ``device``
    take it (``cuda_cast.cuda_selected``), else Triton's."""
    return "cuda" if device.type == "cuda" and registry.preferred_backend("quantize", device) == "cuda" else "triton"


def triton_dequantize(mxt: MXTensor, dtype: torch.dtype | None = None, axis: int | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """:meth:`MXTensor.dequantize` on the fused unpack + dequantize kernel (same values, same bits).

    ``out``: write into this tensor (the logical shape, ``dtype``, any strides) instead of a new one,
    e.g. a slice of a larger buffer; returned. The registry walks from here on (the CUDA C++ kernel
    first where casts take it, the reference where no kernel applies)."""
    dtype = dtype or mxt.dtype
    plane = mxt.plane(axis)
    if out is not None and (tuple(out.shape) != tuple(mxt.shape) or out.dtype != dtype
                            or out.device != plane.data.device):
        raise ValueError(f"out must be a {dtype} tensor of shape {list(mxt.shape)} on {plane.data.device}, got "
                         f"{out.dtype} {list(out.shape)} on {out.device}")
    device = plane.data.device
    return registry.run_from("dequantize", DequantizeCall(mxt, dtype, axis, out), device, _start(device))


def _layout(mxt: MXTensor, plane, out: torch.Tensor | None) -> tuple[int, int, int, int]:
    """``(rows, length, out_stride_r, out_stride_l)``: the plane read as ``[rows, length]`` (block axis last)
    and where element (r, l) goes in ``out`` (None: a new contiguous tensor of the logical shape)."""
    shape = tuple(mxt.shape)
    length = shape[plane.axis]
    rows = 1
    for i, n in enumerate(shape):
        if i != plane.axis:
            rows *= n
    if out is not None:  # 2-D: plane rows run along the other axis
        last = plane.axis == mxt.ndim - 1
        return (rows, length) + ((out.stride(0), out.stride(1)) if last else (out.stride(1), out.stride(0)))
    if plane.axis == mxt.ndim - 1 or mxt.ndim == 1:
        return rows, length, length, 1
    return rows, length, 1, rows  # axis 0: plane row r = flattened trailing index, column = index along axis 0


def _new_out(mxt: MXTensor, dtype: torch.dtype, device) -> torch.Tensor:
    if POISON_OUTPUTS:
        return torch.full(tuple(mxt.shape), -7.75, dtype=dtype, device=device)
    return torch.empty(tuple(mxt.shape), dtype=dtype, device=device)


def _supports(call: DequantizeCall) -> str | None:
    reason = _fallback_reason(call.mxt, call.mxt.plane(call.axis), call.dtype)
    if reason is None and call.out is not None and call.out.ndim != 2:
        return f"out= of {call.out.ndim} dimensions (the kernel writes 2-D outputs)"
    return reason


def _triton_dequantize(call: DequantizeCall) -> torch.Tensor:
    """The registered Triton implementation of ``dequantize``."""
    mxt, plane = call.mxt, call.mxt.plane(call.axis)
    out = call.out if call.out is not None else _new_out(mxt, call.dtype, plane.data.device)
    rows, length, out_stride_r, out_stride_l = _layout(mxt, plane, call.out)
    _launch(mxt, plane, rows, length, out, out_stride_r, out_stride_l)
    return out


def _plane_2d(plane, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = plane.data if plane.data.ndim == 2 else plane.data.reshape(rows, plane.data.shape[-1])
    scale = plane.scale if plane.scale.ndim == 2 else plane.scale.reshape(rows, plane.scale.shape[-1])
    return data, scale


def _cuda_reason(mxt: MXTensor, plane, dtype, out, count=1, data_step=0, out_step=0, layout=None) -> str | None:
    """Why the CUDA C++ dequantize does not take this plane (``cuda_cast.dequantize_unsupported``), or None."""
    from mxtrain.kernels import cuda_cast

    if mxt.whole_axis or plane.axis not in (0, mxt.ndim - 1) or any(n == 0 for n in mxt.shape):
        return f"a plane blocked along axis {plane.axis} of {list(mxt.shape)} (whole axis: {mxt.whole_axis})"
    if out is not None and out.ndim != 2:
        return f"out= of {out.ndim} dimensions"
    rows, length, out_stride_r, out_stride_l = layout or _layout(mxt, plane, out)
    data, scale = _plane_2d(plane, rows)
    if data.stride(-1) != 1 or scale.stride(-1) != 1:
        return "codes or scales not contiguous along the block axis"
    out_ptr = 0 if out is None else out.data_ptr()  # a new output is allocated aligned
    return cuda_cast.dequantize_unsupported(mxt.format, mxt.block_size, dtype, plane.data.device, rows, length,
                                            data.stride(0), data.data_ptr(), out_stride_r, out_stride_l, out_ptr,
                                            count, data_step, out_step)


def _cuda_supports(call: DequantizeCall) -> str | None:
    return _cuda_reason(call.mxt, call.mxt.plane(call.axis), call.dtype, call.out)


def _cuda_dequantize(call: DequantizeCall) -> torch.Tensor:
    """The registered CUDA C++ implementation of ``dequantize`` (``mxtrain/csrc/mx_dequantize.cu``)."""
    from mxtrain.kernels import cuda_cast

    mxt, plane = call.mxt, call.mxt.plane(call.axis)
    out = call.out if call.out is not None else _new_out(mxt, call.dtype, plane.data.device)
    rows, length, out_stride_r, out_stride_l = _layout(mxt, plane, call.out)
    data, scale = _plane_2d(plane, rows)
    if not cuda_cast.dequantize_fp8(data, scale, out, mxt.format, mxt.block_size, rows, length, out_stride_r,
                                    out_stride_l):
        raise registry.KernelDeclined("the CUDA dequantize refused a call its supports() accepted")
    return out


def _launch(mxt: MXTensor, plane, rows: int, length: int, out: torch.Tensor, out_stride_r: int, out_stride_l: int,
            count: int = 1, data_step: int = 0, scale_step: int = 0, out_step: int = 0) -> None:
    """The kernel over a plane read as ``[rows, length]`` (block axis last), written to ``out`` at
    ``(r, l) -> r * out_stride_r + l * out_stride_l``; ``count`` > 1 repeats it for shards whose codes,
    scales and outputs lie ``data_step`` / ``scale_step`` / ``out_step`` elements further each."""
    fmt, bs = mxt.format, mxt.block_size
    data, scale = _plane_2d(plane, rows)
    nb = scale.shape[-1]
    br, bl, warps = TILE_CONFIG
    if out_stride_r == 1:  # transposed write: square-ish tiles keep both sides coalesced
        br, bl = 64, 64
    bl = max(bl, min(bs, 256))
    grid = (triton.cdiv(rows, br) * triton.cdiv(length, bl), count)
    index64 = max(rows * length, data.numel(), (rows - 1) * abs(out_stride_r) + (length - 1) * abs(out_stride_l) + 1) \
        >= 2**31 - 1
    _mx_dequantize_kernel[grid](
        data, scale, out, rows, length, nb * bs, nb, data.stride(0), scale.stride(0), out_stride_r, out_stride_l,
        data_step, scale_step, out_step, BLOCK_R=br, BLOCK_L=bl, BS=bs, PACK_BITS=fmt.bits if plane.packed else 8,
        INDEX64=index64, SOFT_BF16=interpret_mode() and out.dtype == torch.bfloat16,
        num_warps=warps, **format_consts(fmt), **launch_options(),
    )


def triton_dequantize_shards(shard: MXTensor, count: int, data_step: int, scale_step: int, out: torch.Tensor,
                             axis: int | None = None) -> torch.Tensor:
    """Dequantize ``count`` 2-D MX shards of one layout in one launch, shard ``i`` into rows
    ``i * R .. (i + 1) * R`` of ``out`` ([count * R, C], any strides), where ``shard`` ([R, C]) is the
    first: shard ``i``'s codes and scales lie ``i * data_step`` and ``i * scale_step`` elements after
    ``shard``'s (their storage must hold them all: the per-rank chunks of an FSDP2 all-gather buffer).

    Bit for bit what :func:`triton_dequantize` writes for each shard (``out``'s dtype); the registry walks
    as for it (the CUDA C++ kernel first where casts take it; where no kernel applies, the reference
    dequantizes shard by shard)."""
    plane = shard.plane(axis)
    if shard.ndim != 2 or out.ndim != 2 or count < 1:
        raise ValueError(f"triton_dequantize_shards takes 2-D shards and a 2-D out and count >= 1, got shard "
                         f"{list(shard.shape)}, out {list(out.shape)}, count {count}")
    rows_per, cols = shard.shape
    if tuple(out.shape) != (count * rows_per, cols) or out.device != plane.data.device:
        raise ValueError(f"out must have shape {[count * rows_per, cols]} (count x the shard's rows) on "
                         f"{plane.data.device}, got {list(out.shape)} on {out.device}")
    storage_ok = all(t.untyped_storage().nbytes() >= (t.storage_offset() + (count - 1) * step + t.numel())
                     * t.element_size() and t.is_contiguous()
                     for t, step in ((plane.data, data_step), (plane.scale, scale_step)))
    if not storage_ok:
        raise ValueError(f"the {count} shards' codes and scales, {data_step} and {scale_step} elements apart, "
                         "run past the storage of the first shard's (or its planes are not contiguous)")
    device = plane.data.device
    call = DequantizeShardsCall(shard, count, data_step, scale_step, out, axis)
    return registry.run_from("dequantize_shards", call, device, _start(device))


def _shards_layout(call: DequantizeShardsCall):
    """``(plane, (rows, length, out_stride_r, out_stride_l), out_step)`` of a shards call's launch."""
    shard, out = call.shard, call.out
    plane = shard.plane(call.axis)
    rows_per, cols = shard.shape
    last = plane.axis == 1
    layout = (rows_per if last else cols, cols if last else rows_per) + \
        ((out.stride(0), out.stride(1)) if last else (out.stride(1), out.stride(0)))
    return plane, layout, rows_per * out.stride(0)


def _shards_supports(call: DequantizeShardsCall) -> str | None:
    return _fallback_reason(call.shard, call.shard.plane(call.axis), call.out.dtype)


def _triton_shards(call: DequantizeShardsCall) -> torch.Tensor:
    plane, layout, out_step = _shards_layout(call)
    _launch(call.shard, plane, *layout[:2], call.out, *layout[2:], call.count, call.data_step, call.scale_step,
            out_step)
    return call.out


def _cuda_shards_supports(call: DequantizeShardsCall) -> str | None:
    plane, layout, out_step = _shards_layout(call)
    return _cuda_reason(call.shard, plane, call.out.dtype, call.out, call.count, call.data_step, out_step, layout)


def _cuda_shards(call: DequantizeShardsCall) -> torch.Tensor:
    from mxtrain.kernels import cuda_cast

    plane, (rows, length, sr, sl), out_step = _shards_layout(call)
    data, scale = _plane_2d(plane, rows)
    if not cuda_cast.dequantize_fp8(data, scale, call.out, call.shard.format, call.shard.block_size, rows, length,
                                    sr, sl, call.count, call.data_step, call.scale_step, out_step):
        raise registry.KernelDeclined("the CUDA dequantize refused a call its supports() accepted")
    return call.out


def _reference_shards(call: DequantizeShardsCall) -> torch.Tensor:
    """Each shard dequantized by the reference into its rows of ``out``."""
    shard, plane = call.shard, call.shard.plane(call.axis)
    rows_per = shard.shape[0]
    for i in range(call.count):
        data = plane.data.as_strided(plane.data.shape, plane.data.stride(),
                                     plane.data.storage_offset() + i * call.data_step)
        scale = plane.scale.as_strided(plane.scale.shape, plane.scale.stride(),
                                       plane.scale.storage_offset() + i * call.scale_step)
        one = dataclasses.replace(shard, planes=(dataclasses.replace(plane, data=data, scale=scale),))
        call.out[i * rows_per:(i + 1) * rows_per].copy_(one.dequantize(call.out.dtype, plane.axis))
    return call.out


def _make_shards_call(*, shard, count, data_step, scale_step, out, axis=None) -> DequantizeShardsCall:
    return DequantizeShardsCall(shard, count, data_step, scale_step, out, axis)


def _register() -> None:
    from mxtrain.kernels._triton_utils import kernels_available

    registry.define(registry.Operation("dequantize_shards", _make_shards_call, DequantizeShardsCall.key))
    registry.register("dequantize_shards", "reference", _reference_shards)
    if kernels_available():
        registry.register("dequantize", "triton", _triton_dequantize, supports=_supports)
        registry.register("dequantize_shards", "triton", _triton_shards, supports=_shards_supports)
    if config.current().cuda_kernels and torch.cuda.is_available():
        registry.register("dequantize", "cuda", _cuda_dequantize, supports=_cuda_supports)
        registry.register("dequantize_shards", "cuda", _cuda_shards, supports=_cuda_shards_supports)


_register()
