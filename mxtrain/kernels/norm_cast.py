"""LayerNorm / RMSNorm forward + MX cast of the output in one kernel (rowwise and columnwise planes).

``norm_cast(x, weight, bias, kind="LayerNorm", fmt="fp8_e4m3", axis=(-1, 0))`` returns a
:class:`NormCastResult`: the MX planes of ``y = norm(x) * gamma + beta`` (``y`` rounded to ``x``'s dtype),
the per-row ``mean`` (LayerNorm) and ``rstd`` in fp32, and optionally ``y``. The codes are bit-identical to
``quantize_mx`` of the kernel's own ``y``; ``y`` equals torch's up to fp32 rounding (one ulp of a half type).
The CUDA C++ and Triton algorithms: docs/kernels.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mxtrain import config
from mxtrain.kernels import cast as _cast
from mxtrain.kernels.ids import DTYPE_IDS
from mxtrain.kernels._triton_utils import (
    HAVE_TRITON, ROUNDING_IDS, SCALE_MODE_IDS, format_consts, interpret_mode, launch_options, tl, triton,
)
from mxtrain.oplib import opaque_op
from mxtrain.quantization import MXPlane, MXTensor, quantize_mx
from mxtrain.quantization._validate import normalize_axis
from mxtrain.quantization.mx import _check_common
from mxtrain.quantization.packing import packed_length

__all__ = ["norm_cast", "NormCastResult", "torch_norm"]

KINDS = ("LayerNorm", "RMSNorm")
# (BLOCK_K, num_warps) of a band's tiles; BLOCK_M is the block size (columnwise) or 32
TILE = (256, 4)


@dataclass
class NormCastResult:
    mx: MXTensor
    mean: torch.Tensor | None  # [rows] fp32 (LayerNorm), None for RMSNorm
    rstd: torch.Tensor         # [rows] fp32
    out: torch.Tensor | None   # y in x's dtype when asked for


if HAVE_TRITON:
    from mxtrain.kernels.cast import _quantize_plane, _round_to_dtype, _store_out, _widen

    @triton.jit
    def _norm_cast_kernel(
        x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr,
        row_data_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr, seed_ptr,
        M, K, stride_xm, stride_ym, eps,
        row_data_stride, row_scale_stride, KP, NBK,
        col_data_stride, col_scale_stride, MP, NBM,
        RMS: tl.constexpr, HAS_BIAS: tl.constexpr, ZERO_CENTERED: tl.constexpr, WRITE_Y: tl.constexpr,
        OUT_KIND: tl.constexpr, W_BF16: tl.constexpr, W_KIND: tl.constexpr,
        ROW: tl.constexpr, COL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BS: tl.constexpr,
        SCALE_MODE: tl.constexpr, ROUNDING: tl.constexpr, HW_FP8: tl.constexpr, INDEX64: tl.constexpr,
        IS_INT: tl.constexpr, BITS: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr,
        BIAS: tl.constexpr, MAX_CODE: tl.constexpr, MAX_NORM: tl.constexpr, INV_MAX_BITS: tl.constexpr,
        NAN_KIND: tl.constexpr, PACK_BITS: tl.constexpr, BF16_BITS: tl.constexpr,
    ):
        pm = tl.program_id(0)
        rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
        if INDEX64:
            rm = rm.to(tl.int64)
        m_in = rm < M
        # ---- pass 1: row statistics, chunk by chunk (Chan et al. combination of chunk means / M2)
        mean = tl.zeros([BLOCK_M], dtype=tl.float32)
        m2 = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            mask = m_in[:, None] & (rk < K)[None, :]
            x = _widen(tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=mask, other=0), BF16_BITS)
            if RMS:
                m2 += tl.sum(x * x, axis=1)
            else:
                n_c = tl.minimum(K - k0, BLOCK_K).to(tl.float32)
                n_new = k0 + n_c
                c_mean = tl.sum(x, axis=1) / n_c
                d = tl.where(mask, x - c_mean[:, None], 0.0)
                c_m2 = tl.sum(d * d, axis=1)
                delta = c_mean - mean
                mean = mean + delta * (n_c / n_new)
                m2 = m2 + c_m2 + delta * delta * (k0 * n_c / n_new)
        rstd = 1.0 / tl.sqrt_rn(m2 / K + eps)
        tl.store(rstd_ptr + rm, rstd, mask=m_in)
        if not RMS:
            tl.store(mean_ptr + rm, mean, mask=m_in)
        if ROUNDING == 3:
            seed = tl.load(seed_ptr)
        else:
            seed = 0
        # ---- pass 2: normalize, round to the dtype, cast; last chunk first, so the chunks that
        # pass 1 read last (the likeliest still in L2) are re-read first
        k_extent = KP if ROW else K
        n_chunks = tl.cdiv(k_extent, BLOCK_K)
        for i in range(0, n_chunks):
            k0 = (n_chunks - 1 - i) * BLOCK_K
            rk = k0 + tl.arange(0, BLOCK_K)
            k_in = rk < K
            mask = m_in[:, None] & k_in[None, :]
            x = _widen(tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=mask, other=0), BF16_BITS)
            w = _widen(tl.load(w_ptr + rk, mask=k_in, other=0), W_BF16)
            if ZERO_CENTERED:  # gamma = weight + 1 in the weight's dtype, as the modules compute it
                w = _round_to_dtype(w + 1.0, W_KIND)
            if RMS:
                y = (x * rstd[:, None]) * w[None, :]
            else:
                y = ((x - mean[:, None]) * rstd[:, None]) * w[None, :]
            if HAS_BIAS:
                y = y + _widen(tl.load(b_ptr + rk, mask=k_in, other=0), W_BF16)[None, :]
            y = tl.where(mask, _round_to_dtype(y, OUT_KIND), 0.0)
            if WRITE_Y:
                _store_out(y_ptr + rm[:, None] * stride_ym + rk[None, :], y, mask, OUT_KIND)
            if ROW:
                _quantize_plane(y, rm, rk, m_in, k0, seed, row_data_ptr, row_data_stride, row_scale_ptr,
                                row_scale_stride, KP, NBK, 2, True, BLOCK_M, BLOCK_K, BS, SCALE_MODE, ROUNDING, HW_FP8,
                                IS_INT, BITS, MBITS, EMIN, EMAX, MAX_CODE, MAX_NORM, INV_MAX_BITS, PACK_BITS)
            if COL:
                _quantize_plane(y, rm, rk, k_in, pm * BLOCK_M, seed, col_data_ptr, col_data_stride, col_scale_ptr,
                                col_scale_stride, MP, NBM, 1, True, BLOCK_M, BLOCK_K, BS, SCALE_MODE, ROUNDING, HW_FP8,
                                IS_INT, BITS, MBITS, EMIN, EMAX, MAX_CODE, MAX_NORM, INV_MAX_BITS, PACK_BITS)


def torch_norm(x, weight, bias=None, kind="LayerNorm", eps=1e-5, zero_centered_gamma=False):
    """The unfused torch norm (as the modules compute it)."""
    gamma = weight + 1 if zero_centered_gamma else weight
    if kind == "LayerNorm":
        return F.layer_norm(x, (x.shape[-1],), gamma, bias, eps)
    return F.rms_norm(x, (x.shape[-1],), gamma, eps)


def _reference(x2, weight, bias, kind, eps, zc, fmt, block_size, axis, scale_mode, rounding, seed, pack, out_shape):
    y = torch_norm(x2, weight, bias, kind, eps, zc)
    xf = x2.float()
    if kind == "LayerNorm":
        var, mean = torch.var_mean(xf, dim=-1, unbiased=False)
    else:
        var, mean = xf.square().mean(-1), None
    rstd = torch.rsqrt(var + eps)
    y = y.reshape(out_shape)
    mxt = quantize_mx(y, fmt, block_size=block_size, axis=axis, scale_mode=scale_mode, rounding=rounding,
                      seed=seed, pack=pack)
    return mxt, mean, rstd, y


def norm_cast(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, kind: str = "LayerNorm",
              eps: float = 1e-5, zero_centered_gamma: bool = False, fmt="fp8_e4m3", block_size: int = 32,
              axis=(-1, 0), scale_mode: str = "floor", rounding: str = "even", seed=None, pack: bool = True,
              return_output: bool = False, dequantized=(), dequantized_dtype: torch.dtype = torch.bfloat16,
              keep_codes=None) -> NormCastResult:
    """Norm over the last dim of ``x`` ([..., K]) and the MX planes of the result.

    ``axis``: -1 (rowwise, any ndim), 0 (columnwise, 2-D) or both (2-D). ``bias`` is
    LayerNorm's beta (RMSNorm takes none). Where the kernel cannot run (CPU without the
    interpreter, unsupported block size or axes), torch's norm and the reference cast
    give the same contract. ``dequantized`` / ``keep_codes`` / ``dequantized_dtype`` as
    :func:`mxtrain.kernels.dispatch.quantize`: planes handed to a GEMM at once can come as their
    dequantized values (the CUDA kernel writes bf16 values in the same pass, no codes needed).
    Under ``torch.compile`` it is one registered op (``mxtrain::norm_cast``), the same bits.
    """
    if torch.compiler.is_compiling():
        return _norm_cast_compiled(x, weight, bias, kind, eps, zero_centered_gamma, fmt, block_size, axis, scale_mode,
                                   rounding, seed, pack, return_output, dequantized, dequantized_dtype, keep_codes)
    return _norm_cast_impl(x, weight, bias, kind, eps, zero_centered_gamma, fmt, block_size, axis, scale_mode,
                           rounding, seed, pack, return_output, dequantized, dequantized_dtype, keep_codes)


def _check_args(x, weight, bias, kind, fmt, block_size, scale_mode, rounding):
    if kind not in KINDS:
        raise ValueError(f"unknown normalization {kind!r}; allowed: {', '.join(KINDS)}")
    if kind == "RMSNorm" and bias is not None:
        raise ValueError("RMSNorm takes no bias")
    checked = _check_common(x, fmt, block_size, scale_mode, rounding)
    K = x.shape[-1]
    if weight.shape != (K,) or (bias is not None and bias.shape != (K,)):
        raise ValueError(f"weight/bias must have shape [{K}]")
    return checked


def _norm_cast_impl(x, weight, bias, kind, eps, zero_centered_gamma, fmt, block_size, axis, scale_mode, rounding,
                    seed, pack, return_output, dequantized, dequantized_dtype, keep_codes) -> NormCastResult:
    from mxtrain.kernels.dispatch import attach_values, values_request

    fmt_, block_size, scale_mode, rounding = _check_args(x, weight, bias, kind, fmt, block_size, scale_mode, rounding)
    K = x.shape[-1]
    axes = axis if isinstance(axis, tuple) else (axis,)
    axes = tuple(normalize_axis(a, x.ndim) for a in axes)
    deq, keep = values_request(x.ndim, axes, dequantized, keep_codes, dequantized_dtype)
    last = x.ndim - 1
    want_row, want_col = last in axes, (0 in axes and x.ndim >= 2)

    def finish(r: NormCastResult) -> NormCastResult:  # values asked for, where the kernel wrote codes
        if deq or set(keep) != set(axes):
            r.mx = attach_values(r.mx, deq, dequantized_dtype, keep)
        return r
    x2 = x.reshape(-1, K)
    reason = _cast._fallback_reason(x, fmt_, block_size, axes, pack)
    if reason is None and want_col and (x.ndim != 2 or block_size > _cast.MAX_FUSED_BLOCK_SIZE):
        reason = "the columnwise plane is fused for 2-D inputs and block_size <= 128 only"
    if reason is None and (weight.dtype not in (x.dtype, torch.float32) or
                           (bias is not None and bias.dtype != weight.dtype) or weight.device != x.device):
        reason = "weight/bias dtype or device"
    if reason is not None:
        mxt, mean, rstd, y = _reference(x2, weight, bias, kind, eps, zero_centered_gamma, fmt_, block_size, axis,
                                        scale_mode, rounding, seed, pack, x.shape)
        return finish(NormCastResult(mxt, mean, rstd, y if return_output else None))
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    from mxtrain.kernels import cuda_cast

    if x.is_cuda and cuda_cast.fused_sources_selected(x.device):  # a statistics pass, then the cast
        native = dequantized_dtype == torch.bfloat16  # the kernel writes bf16 values itself
        res = cuda_cast.norm_cast(x2, weight, bias, kind, eps, zero_centered_gamma, fmt_, block_size, scale_mode,
                                  rounding, pack, want_row, want_col, return_output,
                                  outputs=_cast.plane_outputs(last, keep, deq, dequantized_dtype) if native else None)
        if res is not None:
            row, col, mean, rstd, y = res
            mxt = _cast.assemble_mxtensor(x, fmt_, block_size, axes, scale_mode, rounding, pack, row, col)
            r = NormCastResult(mxt, mean, rstd, y.reshape(x.shape) if y is not None else None)
            return r if native else finish(r)
    M = x2.shape[0]
    dev = x.device
    bs = block_size
    block_k, warps = TILE
    block_k = max(block_k, bs)
    block_m = bs if want_col else 32
    if block_m * block_k > 8192:
        block_k = max(bs, 8192 // block_m)
    nbk, nbm = -(-K // bs), -(-M // bs)
    kp, mp = nbk * bs, nbm * bs
    plen = (lambda n: packed_length(n, fmt_)) if pack else (lambda n: n)
    alloc = _cast._alloc
    row = (alloc((M, plen(kp)), device=dev), alloc((M, nbk), device=dev)) if want_row else None
    col = (alloc((K, plen(mp)), device=dev), alloc((K, nbm), device=dev)) if want_col else None
    dummy = _cast.scratch(dev, "dummy")
    rstd = torch.empty(M, dtype=torch.float32, device=dev)
    mean = torch.empty(M, dtype=torch.float32, device=dev) if kind == "LayerNorm" else None
    y = torch.empty(M, K, dtype=x.dtype, device=dev) if return_output else None
    bf16 = x.dtype == torch.bfloat16
    w_bf16 = weight.dtype == torch.bfloat16
    view = (lambda t: t.view(torch.int16) if t is not None and t.dtype == torch.bfloat16 else t)
    seed_t = _cast._philox_seed(seed, dev) if rounding == "stochastic" else _cast.scratch(dev, "seed")
    m_extent = mp if want_col else M
    grid = (triton.cdiv(m_extent, block_m),)
    index64 = max(m_extent * K, M * plen(kp), K * plen(mp)) >= 2**31 - 1
    hw = (config.current().triton_hw_fp8 and not interpret_mode() and fmt_.is_float and fmt_.bits == 8
          and rounding == "even")
    _norm_cast_kernel[grid](
        view(x2), view(weight), view(bias) if bias is not None else dummy, view(y) if y is not None else dummy,
        mean if mean is not None else rstd, rstd,
        row[0] if row else dummy, row[1] if row else dummy, col[0] if col else dummy, col[1] if col else dummy,
        seed_t, M, K, x2.stride(0), y.stride(0) if y is not None else 0, float(eps),
        row[0].stride(0) if row else 0, row[1].stride(0) if row else 0, kp, nbk,
        col[0].stride(0) if col else 0, col[1].stride(0) if col else 0, mp, nbm,
        RMS=kind == "RMSNorm", HAS_BIAS=bias is not None, ZERO_CENTERED=zero_centered_gamma,
        WRITE_Y=y is not None, OUT_KIND=DTYPE_IDS[x.dtype], W_BF16=w_bf16,
        W_KIND=DTYPE_IDS[weight.dtype],
        ROW=want_row, COL=want_col, BLOCK_M=block_m, BLOCK_K=block_k, BS=bs,
        SCALE_MODE=SCALE_MODE_IDS[scale_mode], ROUNDING=ROUNDING_IDS[rounding], HW_FP8=hw, INDEX64=index64,
        PACK_BITS=fmt_.bits if pack else 8, BF16_BITS=bf16, num_warps=warps,
        **format_consts(fmt_), **launch_options(),
    )
    planes = {}
    if row is not None:
        lead = tuple(x.shape[:-1])
        planes[last] = MXPlane(data=row[0].reshape(*lead, row[0].shape[-1]),
                               scale=row[1].reshape(*lead, row[1].shape[-1]), axis=last, packed=pack)
    if col is not None:
        planes[0] = MXPlane(data=col[0], scale=col[1], axis=0, packed=pack)
    mxt = MXTensor(planes=tuple(planes[a] for a in axes), fmt=fmt_.name, block_size=bs, shape=tuple(x.shape),
                   dtype=x.dtype, scale_mode=scale_mode, rounding=rounding, whole_axis=False)
    return finish(NormCastResult(mxt, mean, rstd, y.reshape(x.shape) if y is not None else None))


# Under torch.compile norm_cast is one registered op of plain tensors (no graph break); inside, the kernel is
# chosen at run time as in eager, so compiled and eager results are the same bits.


def _y_dtype(x_dtype: torch.dtype, w_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the norm's output: ``x``'s, whatever the weight's (what the implementations return)."""
    return x_dtype


def _norm_cast_compiled(x, weight, bias, kind, eps, zero_centered_gamma, fmt, block_size, axis, scale_mode,
                        rounding, seed, pack, return_output, dequantized, dequantized_dtype,
                        keep_codes) -> NormCastResult:
    from mxtrain.kernels.dispatch import mx_from_op_outputs, op_seed, values_request

    fmt_, block_size, scale_mode, rounding = _check_args(x, weight, bias, kind, fmt, block_size, scale_mode, rounding)
    axes = axis if isinstance(axis, tuple) else (axis,)
    axes = tuple(normalize_axis(a, x.ndim) for a in axes)
    deq, keep = values_request(x.ndim, axes, dequantized, keep_codes, dequantized_dtype)
    parts = torch.ops.mxtrain.norm_cast(x, weight, bias, kind, float(eps), bool(zero_centered_gamma), fmt_.name,
                                        block_size, list(axes), scale_mode, rounding,
                                        op_seed(seed, rounding, "norm_cast"), bool(pack), bool(return_output),
                                        list(deq), dequantized_dtype, list(keep))
    mxt, i = mx_from_op_outputs(parts, tuple(x.shape), x.dtype, fmt_.name, block_size, axes, keep, deq, scale_mode,
                                rounding, pack)
    mean = None
    if kind == "LayerNorm":
        mean, i = parts[i], i + 1
    return NormCastResult(mxt, mean, parts[i], parts[i + 1] if return_output else None)


@opaque_op("mxtrain::norm_cast")
def _norm_cast_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kind: str, eps: float,
                  zero_centered_gamma: bool, fmt: str, block_size: int, axes: list[int], scale_mode: str,
                  rounding: str, seed: int | None, pack: bool, return_output: bool, dequantized: list[int],
                  dequantized_dtype: torch.dtype, keep_codes: list[int]) -> list[torch.Tensor]:
    """The planes of each axis (see :func:`mxtrain.kernels.dispatch.mx_op_outputs`), then ``mean`` (LayerNorm),
    ``rstd`` and, with ``return_output``, ``y``."""
    from mxtrain.kernels.dispatch import _distinct, mx_op_outputs

    r = _norm_cast_impl(x, weight, bias, kind, eps, zero_centered_gamma, fmt, block_size, tuple(axes), scale_mode,
                        rounding, seed, pack, return_output, tuple(dequantized), dequantized_dtype, tuple(keep_codes))
    out = mx_op_outputs(r.mx, axes, keep_codes, dequantized, pack, "norm_cast")
    out += [r.mean] if kind == "LayerNorm" else []
    out += [r.rstd] + ([r.out.contiguous()] if return_output else [])
    return _distinct(out, x, weight, bias)


@_norm_cast_op.register_fake
def _(x, weight, bias, kind, eps, zero_centered_gamma, fmt, block_size, axes, scale_mode, rounding, seed, pack,
      return_output, dequantized, dequantized_dtype, keep_codes):
    from mxtrain.kernels.dispatch import mx_op_fake_outputs

    out = mx_op_fake_outputs(x, x.shape, fmt, block_size, axes, keep_codes, dequantized, pack, dequantized_dtype)
    rows = math.prod(x.shape[:-1])
    out += [x.new_empty(rows, dtype=torch.float32) for _ in range(2 if kind == "LayerNorm" else 1)]
    if return_output:
        out.append(x.new_empty(x.shape, dtype=_y_dtype(x.dtype, weight.dtype)))
    return out
