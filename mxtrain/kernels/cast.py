"""Triton MX cast: one read of a [M, K] tensor writes its rowwise and columnwise MX planes.

Bit-for-bit the reference :func:`mxtrain.quantization.quantize_mx` (``pack=True`` layout included) for
``nearest`` / ``floor`` / ``even`` rounding; ``stochastic`` rounding draws its own random bits (Triton's
Philox), so it is unbiased and reproducible for a seed but not the reference's bits. What it does not take
is said in one place, :func:`_fallback_reason` (its ``supports`` in :mod:`mxtrain.kernels.registry`, which
then runs the reference). How the bits are kept: docs/kernels.md.
"""

from __future__ import annotations


import torch

from mxtrain import config
from mxtrain.formats import ElemFormat
from mxtrain.activations import GATE_ACTIVATION
from mxtrain.kernels.ids import ACTIVATION_IDS, DTYPE_IDS
from mxtrain.kernels._triton_utils import (
    HAVE_TRITON, ROUNDING_IDS, SCALE_MODE_IDS, device_supported, format_consts, interpret_mode, is_pow2,
    launch_options, tl, triton,
)
from mxtrain.kernels import registry
from mxtrain.kernels.calls import QuantizeCall
from mxtrain.quantization import MXPlane, MXTensor
from mxtrain.quantization._validate import make_generator
from mxtrain.quantization.packing import packed_length

__all__ = ["triton_quantize", "assemble_mxtensor", "MAX_BLOCK_SIZE"]

MAX_BLOCK_SIZE = 256
# both planes from one tile up to this block size; above it the [bs, bs] tile outgrows shared
# memory (256 KiB at 256) and each plane gets its own launch (the input is read twice)
MAX_FUSED_BLOCK_SIZE = 128
# hardware fp32->fp8 conversion for fp8 formats with round-half-even (GPU only)
# tests set this to fill outputs with a pattern first, so unwritten bytes show up
POISON_OUTPUTS = False
# tile configs at block size 32: (rows, cols) -> (BLOCK_M, BLOCK_K, num_warps). Wide tiles keep
# a thread's 8-element vectors on many rows, so the columnwise amax is mostly in-thread (few shuffles).
# choice: benchmarks/NOTES_casts.md; the benchmark overrides them
TILE_CONFIGS = {
    (True, True): (32, 256, 4),
    (True, False): (32, 256, 4),
    (False, True): (32, 256, 4),
}

if HAVE_TRITON:
    from triton.language.extra import libdevice

    from mxtrain.kernels._triton_utils import decode_codes as _decode

    # the ids of mxtrain.kernels.ids as constexprs the jit functions can read (ACT 0: no activation)
    _BF16 = tl.constexpr(DTYPE_IDS[torch.bfloat16])
    _FP16 = tl.constexpr(DTYPE_IDS[torch.float16])
    _GELU = tl.constexpr(ACTIVATION_IDS["gelu"])
    _GELU_TANH = tl.constexpr(ACTIVATION_IDS["gelu_tanh"])
    _RELU = tl.constexpr(ACTIVATION_IDS["relu"])
    _SQUARED_RELU = tl.constexpr(ACTIVATION_IDS["squared_relu"])
    _SILU = tl.constexpr(ACTIVATION_IDS["silu"])
    _SWIGLU = tl.constexpr(ACTIVATION_IDS["swiglu"])
    _GEGLU = tl.constexpr(ACTIVATION_IDS["geglu"])
    _GEGLU_TANH = tl.constexpr(ACTIVATION_IDS["geglu_tanh"])
    _FIRST_GATED = tl.constexpr(min(ACTIVATION_IDS[name] for name in GATE_ACTIVATION))  # gated ids come last

    @triton.jit
    def _inverse_scale(scale):
        """fp32 ``2**(127 - byte)`` (byte 254 gives the fp32 subnormal 2**-127; 255 is garbage, masked)."""
        bits = tl.where(scale == 254, 0x00400000, (254 - scale) << 23)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _shared_scale(amax, SCALE_MODE: tl.constexpr, EMAX: tl.constexpr, MBITS: tl.constexpr,
                      INV_MAX_BITS: tl.constexpr):
        """E8M0 bytes (int32) from block amax bit patterns, as ``shared_exponent_bytes``."""
        if SCALE_MODE == 1:  # rceil: ceil(log2(amax * fp32(1/max_norm)))
            inv_max = tl.full(amax.shape, INV_MAX_BITS, tl.int32).to(tl.float32, bitcast=True)
            d = amax.to(tl.float32, bitcast=True) * inv_max
            db = d.to(tl.int32, bitcast=True)
            biased = db >> 23
            mant = db & 0x7FFFFF
            round_up = tl.where(biased == 0, mant > 0x400000, mant != 0)
            exp = biased - 127 + round_up.to(tl.int32)
        else:
            bits = amax
            if SCALE_MODE == 2:  # even: round amax to mbits mantissa bits first
                bits = bits + (1 << (22 - MBITS))
            biased = bits >> 23
            exp = tl.where(biased == 0, tl.where(amax == 0, -126, -127), biased - 127) - EMAX
        exp = tl.minimum(tl.maximum(exp, -127), 127)
        return tl.where(amax >= 0x7F800000, 255, exp + 127)

    @triton.jit
    def _element_codes(y, u, IS_INT: tl.constexpr, BITS: tl.constexpr, MBITS: tl.constexpr,
                       EMIN: tl.constexpr, MAX_CODE: tl.constexpr, MAX_NORM: tl.constexpr,
                       ROUNDING: tl.constexpr, HW_FP8: tl.constexpr):
        """int32 codes of fp32 ``y`` (already divided by the block scale), as ``element_codes``."""
        if HW_FP8:
            # cvt.rn.satfinite: round half to even, saturating to +-max_norm (NaN blocks are masked later)
            if MBITS == 3:
                f8 = y.to(tl.float8e4nv)
            else:
                f8 = y.to(tl.float8e5)
            code = f8.to(tl.uint8, bitcast=True).to(tl.int32)
        else:
            yb = y.to(tl.int32, bitcast=True)
            mag = yb & 0x7FFFFFFF
            absy = mag.to(tl.float32, bitcast=True)
            if IS_INT:
                t = absy * (2.0 ** MBITS)
            else:
                eb = tl.maximum(mag >> 23, EMIN + 127)  # biased element exponent
                # 2**(mbits - e) built from bits; in range for every MX element format
                t = absy * ((MBITS + 254 - eb) << 23).to(tl.float32, bitcast=True)
            # legit blocks have t < 2**(mbits+2); saturate anything else below 2**22, where the
            # rounding below stays exact (the codes clamp to max_code); NaN/Inf blocks are masked later
            t = tl.minimum(t, 4194304.0)
            r = t + 8388608.0
            q = r.to(tl.int32, bitcast=True) - 0x4B000000  # round half to even
            if ROUNDING != 0:
                rf = r - 8388608.0  # exact
                over = rf > t
                fl = q - over.to(tl.int32)
                if ROUNDING == 2:
                    q = fl
                else:
                    frac = t - (rf - tl.where(over, 1.0, 0.0))  # exact
                    if ROUNDING == 1:
                        q = fl + (frac >= 0.5).to(tl.int32)
                    else:
                        q = fl + (u < frac).to(tl.int32)
            neg = yb < 0
            if IS_INT:
                qi = tl.minimum(q, MAX_CODE)
                code = tl.where(neg, -qi, qi) & ((1 << BITS) - 1)
            else:
                code = tl.minimum(((eb - (EMIN + 127)) << MBITS) + q, MAX_CODE)
                code = code | (neg.to(tl.int32) << (BITS - 1))
        return code

    @triton.jit
    def _quantize_blocks(x3, offs3, seed, AXIS: tl.constexpr, SCALE_MODE: tl.constexpr, ROUNDING: tl.constexpr,
                         HW_FP8: tl.constexpr, IS_INT: tl.constexpr, BITS: tl.constexpr, MBITS: tl.constexpr,
                         EMIN: tl.constexpr, EMAX: tl.constexpr, MAX_CODE: tl.constexpr, MAX_NORM: tl.constexpr,
                         INV_MAX_BITS: tl.constexpr):
        """Codes (same shape as ``x3``) and scale bytes of fp32 blocks lying along ``AXIS`` of ``x3``."""
        amax = tl.max(x3.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=AXIS)
        scale = _shared_scale(amax, SCALE_MODE, EMAX, MBITS, INV_MAX_BITS)
        y = x3 * tl.expand_dims(_inverse_scale(scale), AXIS)
        if ROUNDING == 3:
            u = tl.rand(seed, offs3)
        else:
            u = 0.0
        code = _element_codes(y, u, IS_INT, BITS, MBITS, EMIN, MAX_CODE, MAX_NORM, ROUNDING, HW_FP8)
        code = tl.where(tl.expand_dims(scale == 255, AXIS), 0, code)  # a NaN block's codes are 0
        return code, scale

    @triton.jit
    def _plane_values(codes, scale, AXIS: tl.constexpr, HW_FP8: tl.constexpr, IS_INT: tl.constexpr,
                      BITS: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, BIAS: tl.constexpr,
                      NAN_KIND: tl.constexpr):
        """fp32 ``code * 2**X`` of a plane's codes (blocks along ``AXIS``), as the dequantize kernel computes it."""
        if HW_FP8:  # the codes came from cvt.rn.satfinite: decode them back with the hardware (exact)
            if MBITS == 3:
                v = codes.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
            else:
                v = codes.to(tl.uint8).to(tl.float8e5, bitcast=True).to(tl.float32)
        else:
            v = _decode(codes, IS_INT, BITS, MBITS, EMIN, BIAS, NAN_KIND)
        s = tl.where(scale == 255, 0x7FC00000, tl.where(scale == 0, 0x00400000, scale << 23))
        return v * tl.expand_dims(s.to(tl.float32, bitcast=True), AXIS)

    @triton.jit
    def _store_values(ptr, v, mask, SOFT_BF16: tl.constexpr):
        """Store fp32 ``v`` in the values' dtype (round to nearest even), as the dequantize kernel does."""
        if SOFT_BF16:  # ptr is an int16 view: the interpreter's fp32->bf16 cast mishandles subnormals
            vb = v.to(tl.int32, bitcast=True)
            hb = (vb + 0x7FFF + ((vb >> 16) & 1)) >> 16
            hb = tl.where(v != v, 0x7FC0, hb)
            tl.store(ptr, hb.to(tl.int16), mask=mask)
        else:
            tl.store(ptr, v.to(ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _widen(raw, BF16_BITS: tl.constexpr):
        """fp32 of a loaded tile; bf16 arrives as int16 bits and widens exactly (the interpreter's
        own bf16 cast drops subnormals)."""
        if BF16_BITS:
            return (raw.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        return raw.to(tl.float32)

    @triton.jit
    def _round_to_dtype(v, OUT_KIND: tl.constexpr):
        """fp32 ``v`` rounded (to nearest even) to the output dtype (its ``DTYPE_IDS`` id), as fp32."""
        if OUT_KIND == _BF16:
            vb = v.to(tl.int32, bitcast=True)
            hb = (vb + 0x7FFF + ((vb >> 16) & 1)) & -65536
            return tl.where(v != v, v, hb.to(tl.float32, bitcast=True))
        elif OUT_KIND == _FP16:
            return v.to(tl.float16).to(tl.float32)
        else:
            return v

    @triton.jit
    def _store_out(ptr, v, mask, OUT_KIND: tl.constexpr):
        """Store fp32 ``v`` (already rounded to the output dtype) in that dtype; bf16 goes as its int16 bits
        (through an int16 pointer in the interpreter, a bf16 one on the GPU)."""
        if OUT_KIND == _BF16:
            tl.store(ptr, (v.to(tl.int32, bitcast=True) >> 16).to(tl.int16).to(ptr.dtype.element_ty, bitcast=True),
                     mask=mask)
        elif OUT_KIND == _FP16:
            tl.store(ptr, v.to(tl.float16), mask=mask)
        else:
            tl.store(ptr, v, mask=mask)

    @triton.jit
    def _exp(x, TORCH_CUDA: tl.constexpr):
        """fp32 exp: libdevice's ``expf`` (what torch's CUDA kernels call) or Triton's fast ``tl.exp``."""
        if TORCH_CUDA:
            return libdevice.exp(x)
        else:
            return tl.exp(x)

    @triton.jit
    def _activation(x, ACT: tl.constexpr, TORCH_CUDA: tl.constexpr):
        """fp32 activation in torch's formulas, ACT a plain id of ``ACTIVATION_IDS`` (silu: any other).

        TORCH_CUDA (compiled kernels only: libdevice has no interpreter version) follows torch's
        CUDA kernels where they differ from torch's CPU ones: libdevice ``expf`` / ``tanhf``, and
        relu(-0.0) = +0.0; otherwise fast ``tl.exp``, tanh via a sigmoid, relu(-0.0) = -0.0."""
        if ACT == _GELU:
            return (x * 0.5) * (1.0 + tl.math.erf(x * 0.7071067811865476))
        elif ACT == _GELU_TANH:
            inner = 0.7978845608028654 * (x + 0.044715 * (x * x * x))
            if TORCH_CUDA:
                t = libdevice.tanh(inner)
            else:
                t = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
            return (0.5 * x) * (1.0 + t)
        elif ACT == _RELU:  # NaN stays NaN, as torch
            if TORCH_CUDA:
                return tl.where(x <= 0.0, 0.0, x)
            else:
                return tl.where(x < 0.0, 0.0, x)
        elif ACT == _SQUARED_RELU:
            r = tl.where(x < 0.0, 0.0, x)
            return r * r
        else:
            return tl.div_rn(x, 1.0 + _exp(-x, TORCH_CUDA))

    @triton.jit
    def _act_bwd(x, g, ACT: tl.constexpr, GPU: tl.constexpr):
        """``g * act'(x)`` in fp32 as torch's CUDA backward kernels write it (ACT as :func:`_activation`);
        squared_relu is autograd's of ``square(relu(x))``: ``g * (2 * r)``, then relu's threshold."""
        if ACT == _GELU:
            cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
            pdf = _exp(-0.5 * x * x, GPU) * 0.3989422804014327
            return g * (cdf + x * pdf)
        elif ACT == _GELU_TANH:  # gelu_backward(approximate="tanh"), term by term
            x_sq = x * x
            inner = 0.7978845608028654 * (x + 0.044715 * (x_sq * x))
            if GPU:
                t = libdevice.tanh(inner)
            else:
                t = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
            left_derivative = 0.5 * (1.0 + t)
            inner_derivative = 0.7978845608028654 * (1.0 + 0.13414499163627625 * x_sq)  # fp32(3) * fp32(0.044715)
            right_derivative = (0.5 * x) * (1.0 - t * t) * inner_derivative
            return g * (left_derivative + right_derivative)
        elif ACT == _RELU:
            return tl.where(x <= 0.0, 0.0, g)  # threshold_backward: x <= 0 -> 0 (NaN x passes g)
        elif ACT == _SQUARED_RELU:
            r = _activation(x, _RELU, GPU)
            return tl.where(r <= 0.0, 0.0, g * (2.0 * r))
        else:
            s = tl.math.div_rn(1.0, 1.0 + _exp(-x, GPU))
            return g * s * (1.0 + x * (1.0 - s))

    @triton.jit
    def _gate_activation(x, ACT: tl.constexpr, GPU: tl.constexpr):
        """The gate's activation of a gated ACT (``GATE_ACTIVATION``: swiglu silu, geglu gelu, reglu relu,
        geglu_tanh gelu_tanh)."""
        if ACT == _SWIGLU:
            return _activation(x, _SILU, GPU)
        elif ACT == _GEGLU:
            return _activation(x, _GELU, GPU)
        elif ACT == _GEGLU_TANH:
            return _activation(x, _GELU_TANH, GPU)
        else:
            return _activation(x, _RELU, GPU)

    @triton.jit
    def _gate_act_bwd(x, g, ACT: tl.constexpr, GPU: tl.constexpr):
        """``g * act'(x)`` of the gate's activation of a gated ACT (as :func:`_gate_activation`)."""
        if ACT == _SWIGLU:
            return _act_bwd(x, g, _SILU, GPU)
        elif ACT == _GEGLU:
            return _act_bwd(x, g, _GELU, GPU)
        elif ACT == _GEGLU_TANH:
            return _act_bwd(x, g, _GELU_TANH, GPU)
        else:
            return _act_bwd(x, g, _RELU, GPU)

    @triton.jit
    def _store_codes(codes, base_ptr, rows, row_stride, row_mask, c0, LP, R: tl.constexpr, C: tl.constexpr,
                     BITS: tl.constexpr):
        """Store int32 codes [R, C] (columns c0.. of a plane whose padded length is LP), packed."""
        row_off = rows[:, None] * row_stride
        if BITS == 8:
            cols = c0 + tl.arange(0, C)
            tl.store(base_ptr + row_off + cols[None, :], codes.to(tl.uint8),
                     mask=row_mask[:, None] & (cols < LP)[None, :])
        elif BITS == 4:
            lo, hi = tl.split(tl.reshape(codes, (R, C // 2, 2)))
            cols = c0 // 2 + tl.arange(0, C // 2)
            tl.store(base_ptr + row_off + cols[None, :], (lo | (hi << 4)).to(tl.uint8),
                     mask=row_mask[:, None] & (cols < LP // 2)[None, :])
        else:
            even, odd = tl.split(tl.reshape(codes, (R, C // 4, 2, 2)))
            a0, a2 = tl.split(even)
            a1, a3 = tl.split(odd)
            g = c0 // 4 + tl.arange(0, C // 4)
            mask = row_mask[:, None] & (g < LP // 4)[None, :]
            if BITS == 2:
                packed = a0 | (a1 << 2) | (a2 << 4) | (a3 << 6)
                tl.store(base_ptr + row_off + g[None, :], packed.to(tl.uint8), mask=mask)
            else:  # 6-bit: 4 codes in 3 bytes, split 4+2 (see quantization/packing.py)
                ptr = base_ptr + row_off + (g * 3)[None, :]
                tl.store(ptr, ((a0 & 15) | ((a1 & 15) << 4)).to(tl.uint8), mask=mask)
                tl.store(ptr + 1, ((a2 & 15) | ((a3 & 15) << 4)).to(tl.uint8), mask=mask)
                hi = (a0 >> 4) | ((a1 >> 4) << 2) | ((a2 >> 4) << 4) | ((a3 >> 4) << 6)
                tl.store(ptr + 2, hi.to(tl.uint8), mask=mask)

    @triton.jit
    def _quantize_plane(x, rm, rk, lane_in, c0, seed, data_ptr, data_stride, scale_ptr, scale_stride, LP, NB,
                        AXIS: tl.constexpr, STORE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                        BS: tl.constexpr, SCALE_MODE: tl.constexpr, ROUNDING: tl.constexpr, HW_FP8: tl.constexpr,
                        IS_INT: tl.constexpr, BITS: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr,
                        EMAX: tl.constexpr, MAX_CODE: tl.constexpr, MAX_NORM: tl.constexpr,
                        INV_MAX_BITS: tl.constexpr, PACK_BITS: tl.constexpr):
        """MX-quantize a [BLOCK_M, BLOCK_K] tile in blocks along its rows (AXIS 2) or columns (AXIS 1);
        with STORE write the plane's scale bytes and packed codes (columnwise: transposed). ``lane_in``,
        ``c0``, ``LP``, ``NB``: the plane's valid rows, first column, padded length and block count (rowwise
        m_in, k0, KP, NBK; columnwise k_in, m0, MP, NBM). Returns (codes, scale) of the blocks."""
        if AXIS == 2:
            x3 = tl.reshape(x, (BLOCK_M, BLOCK_K // BS, BS))
            if ROUNDING == 3:
                offs3 = tl.reshape(rm[:, None] * LP + rk[None, :], (BLOCK_M, BLOCK_K // BS, BS))
            else:
                offs3 = 0
            key = seed
        else:
            x3 = tl.reshape(x, (BLOCK_M // BS, BS, BLOCK_K))
            if ROUNDING == 3:
                offs3 = tl.reshape(rk[None, :] * LP + rm[:, None], (BLOCK_M // BS, BS, BLOCK_K))
            else:
                offs3 = 0
            key = seed ^ 0x2545F491  # another Philox key for the columnwise plane
        codes, scale = _quantize_blocks(x3, offs3, key, AXIS, SCALE_MODE, ROUNDING, HW_FP8, IS_INT, BITS, MBITS,
                                        EMIN, EMAX, MAX_CODE, MAX_NORM, INV_MAX_BITS)
        if STORE:
            if AXIS == 2:
                blk = c0 // BS + tl.arange(0, BLOCK_K // BS)
                tl.store(scale_ptr + rm[:, None] * scale_stride + blk[None, :], scale.to(tl.uint8),
                         mask=lane_in[:, None] & (blk < NB)[None, :])
                _store_codes(tl.reshape(codes, (BLOCK_M, BLOCK_K)), data_ptr, rm, data_stride, lane_in, c0, LP,
                             BLOCK_M, BLOCK_K, PACK_BITS)
            else:
                blk = c0 // BS + tl.arange(0, BLOCK_M // BS)
                tl.store(scale_ptr + rk[:, None] * scale_stride + blk[None, :], tl.trans(scale).to(tl.uint8),
                         mask=lane_in[:, None] & (blk < NB)[None, :])
                _store_codes(tl.trans(tl.reshape(codes, (BLOCK_M, BLOCK_K))), data_ptr, rk, data_stride, lane_in,
                             c0, LP, BLOCK_K, BLOCK_M, PACK_BITS)
        return codes, scale

    @triton.jit
    def _mx_cast_kernel(
        x_ptr, row_data_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr, seed_ptr,
        M, K, stride_xm, stride_xk,
        row_data_stride, row_scale_stride, KP, NBK,
        col_data_stride, col_scale_stride, MP, NBM,
        ROW: tl.constexpr, COL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BS: tl.constexpr,
        SCALE_MODE: tl.constexpr, ROUNDING: tl.constexpr, HW_FP8: tl.constexpr, INDEX64: tl.constexpr,
        IS_INT: tl.constexpr, BITS: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr,
        BIAS: tl.constexpr, MAX_CODE: tl.constexpr, MAX_NORM: tl.constexpr, INV_MAX_BITS: tl.constexpr,
        NAN_KIND: tl.constexpr, PACK_BITS: tl.constexpr, BF16_BITS: tl.constexpr,
        y_ptr=None, stride_ym=0, GATE_OFF=0, ACT: tl.constexpr = 0, OUT_KIND: tl.constexpr = DTYPE_IDS[torch.float32],
        WRITE_Y: tl.constexpr = False,
        row_val_ptr=None, col_val_ptr=None, stride_vm=0, ROW_CODES: tl.constexpr = True,
        COL_CODES: tl.constexpr = True, ROW_VALS: tl.constexpr = False, COL_VALS: tl.constexpr = False,
        SOFT_BF16: tl.constexpr = False,
        g_ptr=None, stride_gm=0, GRAD: tl.constexpr = False, GPU: tl.constexpr = False,
        dbias_ptr=None, DBIAS: tl.constexpr = False,
    ):
        """Cast a [M, K] tile grid; with ACT > 0 the input is first mapped through an activation
        (6 swiglu, 7 geglu, 8 reglu, 9 geglu_tanh take act(x[:, :K]) * x[:, K:], K = GATE_OFF) and rounded to
        the output dtype (OUT_KIND), optionally written to ``y_ptr``, and that is what gets cast.
        GRAD: the activation's gradient ``g * act'(x)`` instead (every ACT; ``g`` at ``g_ptr``, row stride
        ``stride_gm``; gated: the output is [M, 2N] with GATE_OFF = N, ``g`` [M, N]; GPU: libdevice as
        torch's CUDA kernels); DBIAS: the
        tile's fp32 column sums of that output go to ``dbias[pm, :]`` (summed over pm after).

        Per plane: ``*_CODES`` stores its codes and scale bytes, ``*_VALS`` its dequantized values
        ``code * 2**X`` in the logical [M, K] layout (row stride ``stride_vm``) at ``*_val_ptr``."""
        # the grid covers MP rows when the columnwise codes are written (their zero padding
        # is stored) and KP columns when the rowwise ones are
        k_extent = KP if (ROW and ROW_CODES) else K
        n_k = tl.cdiv(k_extent, BLOCK_K)
        pid = tl.program_id(0)
        pm = pid // n_k
        pk = pid % n_k
        rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
        rk = pk * BLOCK_K + tl.arange(0, BLOCK_K)
        if INDEX64:
            rm = rm.to(tl.int64)
            rk = rk.to(tl.int64)
        m_in = rm < M
        k_in = rk < K
        in_mask = m_in[:, None] & k_in[None, :]
        if GRAD and ACT >= _FIRST_GATED:
            # gated gradient: columns [0, N) of dh are the gate's, [N, 2N) the up half's (N = GATE_OFF); each
            # column reads its gate a, its up value and its g. As autograd of act(a) * up in h's dtype:
            # d_up = g * act(a) (act(a) rounded), d_a = act'(a) applied to g * up (rounded)
            first = rk < GATE_OFF
            cg = tl.where(first, rk, rk - GATE_OFF)
            a = _widen(tl.load(x_ptr + rm[:, None] * stride_xm + cg[None, :] * stride_xk, mask=in_mask, other=0),
                       BF16_BITS)
            up = _widen(tl.load(x_ptr + rm[:, None] * stride_xm + (cg[None, :] + GATE_OFF) * stride_xk,
                                mask=in_mask, other=0), BF16_BITS)
            g = _widen(tl.load(g_ptr + rm[:, None] * stride_gm + cg[None, :], mask=in_mask, other=0), BF16_BITS)
            act_a = _round_to_dtype(_gate_activation(a, ACT, GPU), OUT_KIND)
            d_a = _gate_act_bwd(a, _round_to_dtype(g * up, OUT_KIND), ACT, GPU)
            x = tl.where(first[None, :], d_a, g * act_a)
        else:
            x = _widen(tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :] * stride_xk, mask=in_mask, other=0),
                       BF16_BITS)
        if ACT != 0:
            if GRAD and ACT >= _FIRST_GATED:
                x = _round_to_dtype(x, OUT_KIND)
            elif GRAD:
                g = _widen(tl.load(g_ptr + rm[:, None] * stride_gm + rk[None, :], mask=in_mask, other=0), BF16_BITS)
                x = _round_to_dtype(_act_bwd(x, g, ACT, GPU), OUT_KIND)
            elif ACT >= _FIRST_GATED:  # gated: act(gate) rounded to the dtype, times up, rounded again (as torch in bf16)
                up = _widen(tl.load(x_ptr + rm[:, None] * stride_xm + (rk[None, :] + GATE_OFF) * stride_xk,
                                    mask=in_mask, other=0), BF16_BITS)
                a = _round_to_dtype(_gate_activation(x, ACT, False), OUT_KIND)
                x = _round_to_dtype(a * up, OUT_KIND)
            else:
                x = _round_to_dtype(_activation(x, ACT, False), OUT_KIND)
            x = tl.where(in_mask, x, 0.0)  # the zero padding of ragged blocks
            if WRITE_Y:
                _store_out(y_ptr + rm[:, None] * stride_ym + rk[None, :], x, in_mask, OUT_KIND)
            if DBIAS:
                tl.store(dbias_ptr + pm * K + rk, tl.sum(x, axis=0), mask=k_in)
        if ROUNDING == 3:
            seed = tl.load(seed_ptr)
        else:
            seed = 0
        if ROW:
            codes, scale = _quantize_plane(x, rm, rk, m_in, pk * BLOCK_K, seed, row_data_ptr, row_data_stride,
                                           row_scale_ptr, row_scale_stride, KP, NBK, 2, ROW_CODES, BLOCK_M, BLOCK_K,
                                           BS, SCALE_MODE, ROUNDING, HW_FP8, IS_INT, BITS, MBITS, EMIN, EMAX,
                                           MAX_CODE, MAX_NORM, INV_MAX_BITS, PACK_BITS)
            if ROW_VALS:
                v = tl.reshape(_plane_values(codes, scale, 2, HW_FP8, IS_INT, BITS, MBITS, EMIN, BIAS, NAN_KIND),
                               (BLOCK_M, BLOCK_K))
                _store_values(row_val_ptr + rm[:, None] * stride_vm + rk[None, :], v, in_mask, SOFT_BF16)
        if COL:
            codes, scale = _quantize_plane(x, rm, rk, k_in, pm * BLOCK_M, seed, col_data_ptr, col_data_stride,
                                           col_scale_ptr, col_scale_stride, MP, NBM, 1, COL_CODES, BLOCK_M, BLOCK_K,
                                           BS, SCALE_MODE, ROUNDING, HW_FP8, IS_INT, BITS, MBITS, EMIN, EMAX,
                                           MAX_CODE, MAX_NORM, INV_MAX_BITS, PACK_BITS)
            if COL_VALS:
                v = tl.reshape(_plane_values(codes, scale, 1, HW_FP8, IS_INT, BITS, MBITS, EMIN, BIAS, NAN_KIND),
                               (BLOCK_M, BLOCK_K))
                _store_values(col_val_ptr + rm[:, None] * stride_vm + rk[None, :], v, in_mask, SOFT_BF16)


    @triton.jit
    def _mx_cast_strip_kernel(
        x_ptr, row_data_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr, seed_ptr,
        M, K, stride_xm, stride_xk,
        row_data_stride, row_scale_stride, KP, NBK,
        col_data_stride, col_scale_stride, MP, NBM,
        row_val_ptr, col_val_ptr, stride_vm,
        ROW: tl.constexpr, COL: tl.constexpr, REP: tl.constexpr, J: tl.constexpr, BLOCK_K: tl.constexpr,
        BS: tl.constexpr,
        SCALE_MODE: tl.constexpr, ROUNDING: tl.constexpr, HW_FP8: tl.constexpr, INDEX64: tl.constexpr,
        IS_INT: tl.constexpr, BITS: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr,
        BIAS: tl.constexpr, MAX_CODE: tl.constexpr, MAX_NORM: tl.constexpr, INV_MAX_BITS: tl.constexpr,
        NAN_KIND: tl.constexpr, PACK_BITS: tl.constexpr, BF16_BITS: tl.constexpr,
        ROW_CODES: tl.constexpr, COL_CODES: tl.constexpr, ROW_VALS: tl.constexpr, COL_VALS: tl.constexpr,
        SOFT_BF16: tl.constexpr,
    ):
        """Both planes of a [REP*J, BLOCK_K] strip whose rows are taken in the order ``j*REP + rep``
        (tile dims [REP, J, BLOCK_K]): a thread's register repetitions run over REP consecutive rows
        and the lanes over J, so a columnwise block (BS = G*REP consecutive rows, G = BS // REP
        consecutive j) reduces in-thread over REP and across G lanes of one warp, with no
        cross-warp step; the columnwise codes of the strip are REP*J bytes long per column (one
        128-byte line at 128 rows) and its scales REP*J // BS bytes. Same bits as _mx_cast_kernel."""
        BLOCK_M: tl.constexpr = REP * J
        G: tl.constexpr = BS // REP
        NBT: tl.constexpr = J // G  # columnwise blocks in the strip
        k_extent = KP if (ROW and ROW_CODES) else K
        n_k = tl.cdiv(k_extent, BLOCK_K)
        pid = tl.program_id(0)
        pm = pid // n_k
        pk = pid % n_k
        rep = tl.arange(0, REP)
        jj = tl.arange(0, J)
        rows = pm * BLOCK_M + jj[None, :] * REP + rep[:, None]  # [REP, J]
        rk = pk * BLOCK_K + tl.arange(0, BLOCK_K)
        if INDEX64:
            rows = rows.to(tl.int64)
            rk = rk.to(tl.int64)
        rows3 = rows[:, :, None]
        rk3 = rk[None, None, :]
        m_in3 = rows3 < M
        k_in = rk < K
        in_mask = m_in3 & (rk3 < K)
        x = _widen(tl.load(x_ptr + rows3 * stride_xm + rk3 * stride_xk, mask=in_mask, other=0), BF16_BITS)
        if ROUNDING == 3:
            seed = tl.load(seed_ptr)
        else:
            seed = 0
        # ---- rowwise: blocks along the last dim
        if ROW:
            x4 = tl.reshape(x, (REP, J, BLOCK_K // BS, BS))
            if ROUNDING == 3:
                offs4 = tl.reshape(rows3 * KP + rk3, (REP, J, BLOCK_K // BS, BS))
            else:
                offs4 = 0
            codes, scale = _quantize_blocks(x4, offs4, seed, 3, SCALE_MODE, ROUNDING, HW_FP8, IS_INT, BITS, MBITS,
                                            EMIN, EMAX, MAX_CODE, MAX_NORM, INV_MAX_BITS)
            if ROW_VALS:
                v = tl.reshape(_plane_values(codes, scale, 3, HW_FP8, IS_INT, BITS, MBITS, EMIN, BIAS, NAN_KIND),
                               (REP, J, BLOCK_K))
                _store_values(row_val_ptr + rows3 * stride_vm + rk3, v, in_mask, SOFT_BF16)
            if ROW_CODES:
                blk = pk * (BLOCK_K // BS) + tl.arange(0, BLOCK_K // BS)
                tl.store(row_scale_ptr + rows3 * row_scale_stride + blk[None, None, :], scale.to(tl.uint8),
                         mask=m_in3 & (blk < NBK)[None, None, :])
                rflat = tl.reshape(rows, (BLOCK_M,))
                _store_codes(tl.reshape(codes, (BLOCK_M, BLOCK_K)), row_data_ptr, rflat, row_data_stride, rflat < M,
                             pk * BLOCK_K, KP, BLOCK_M, BLOCK_K, PACK_BITS)
        # ---- columnwise: blocks of BS rows = REP (in-thread) x G consecutive j (lanes)
        if COL:
            amax = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=0)  # [J, BK]
            amax = tl.max(tl.reshape(amax, (NBT, G, BLOCK_K)), axis=1)  # [NBT, BK]
            cscale = _shared_scale(amax, SCALE_MODE, EMAX, MBITS, INV_MAX_BITS)
            inv = tl.reshape(tl.broadcast_to(tl.expand_dims(_inverse_scale(cscale), 1), (NBT, G, BLOCK_K)),
                             (J, BLOCK_K))
            nanb = tl.reshape(tl.broadcast_to(tl.expand_dims(cscale == 255, 1), (NBT, G, BLOCK_K)), (J, BLOCK_K))
            y = x * inv[None, :, :]
            if ROUNDING == 3:
                u = tl.rand(seed ^ 0x2545F491, rk3 * MP + rows3)
            else:
                u = 0.0
            ccodes = _element_codes(y, u, IS_INT, BITS, MBITS, EMIN, MAX_CODE, MAX_NORM, ROUNDING, HW_FP8)
            ccodes = tl.where(nanb[None, :, :], 0, ccodes)
            if COL_VALS:
                sfull = tl.reshape(tl.broadcast_to(tl.expand_dims(cscale, 1), (NBT, G, BLOCK_K)), (J, BLOCK_K))
                v = _plane_values(ccodes, sfull, 0, HW_FP8, IS_INT, BITS, MBITS, EMIN, BIAS, NAN_KIND)
                _store_values(col_val_ptr + rows3 * stride_vm + rk3, v, in_mask, SOFT_BF16)
            if COL_CODES:
                blk = pm * NBT + tl.arange(0, NBT)
                tl.store(col_scale_ptr + rk[:, None] * col_scale_stride + blk[None, :], tl.trans(cscale).to(tl.uint8),
                         mask=k_in[:, None] & (blk < NBM)[None, :])
                codes_t = tl.reshape(tl.permute(ccodes, (2, 1, 0)), (BLOCK_K, BLOCK_M))  # [BK, j*REP + rep]
                _store_codes(codes_t, col_data_ptr, rk, col_data_stride, k_in, pm * BLOCK_M, MP, BLOCK_K, BLOCK_M,
                             PACK_BITS)


_GROUP = {8: 1, 6: 4, 4: 2, 2: 4}


def _fallback_reason(x: torch.Tensor, fmt: ElemFormat, block_size: int, axes: tuple[int, ...], pack: bool):
    """Why the kernel cannot take this call (then the registry walks on to the reference), or None."""
    if not HAVE_TRITON:
        return "triton is not importable"
    if not device_supported(x.device):
        return f"tensor on {x.device} (kernels need CUDA, or a CPU tensor with TRITON_INTERPRET=1)"
    if x.numel() == 0:
        return "empty tensor"
    if block_size == 0:
        return "block_size 0 (one block per axis)"
    if not is_pow2(block_size) or block_size < 2 or block_size > MAX_BLOCK_SIZE:
        return f"block_size {block_size} is not a power of two in [2, {MAX_BLOCK_SIZE}]"
    if pack and fmt.bits < 8 and block_size % _GROUP[fmt.bits]:
        return f"packing {fmt.name} needs block_size to be a multiple of {_GROUP[fmt.bits]}"
    if any(a not in (0, x.ndim - 1) for a in axes):
        return f"axes {axes}: the kernel blocks along the first or the last axis only"
    return None


def _philox_seed(seed, device: torch.device) -> torch.Tensor:
    """A 1-element int32 tensor seeding the in-kernel Philox: int as is, Generator / None (global RNG) drawn from."""
    if isinstance(seed, torch.Generator):
        s = torch.randint(0, 2**31 - 1, (1,), generator=seed, device=seed.device, dtype=torch.int64)
    elif seed is None:
        s = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64)
    else:
        make_generator(seed, torch.device("cpu"))  # same type checks as the reference
        s = torch.tensor([seed & 0x7FFFFFFF], dtype=torch.int64)
    return s.to(device=device, dtype=torch.int32)


# the strip kernel for casts with a columnwise plane (see _mx_cast_strip_kernel) runs only when
# config.current().cast_strip names its (REP, J, BLOCK_K, num_warps): off by default, kept bit-exact and
# tested (speed: benchmarks/NOTES_casts.md)
# the activation-gradient cast's tile (two or three inputs per tile): (BLOCK_M, BLOCK_K, num_warps), None:
# TILE_CONFIGS; one for launches that write a plane's dequantized values (what LayerNormMLP asks for), one for
# codes only (speed: benchmarks/NOTES_casts.md)
GRAD_TILE_CONFIG: tuple[int, int, int] | None = (32, 64, 4)
GRAD_TILE_CONFIG_CODES: tuple[int, int, int] | None = (32, 128, 4)


def _strip_config(rows: bool, cols: bool, bs: int, act: int) -> tuple[int, int, int, int] | None:
    """The strip kernel's config when it takes this launch (a columnwise plane, no activation, fitting block size)."""
    cfg = config.current().cast_strip
    if cfg is None or not cols or act:
        return None
    rep, j, bk, _ = cfg
    if bs % rep or (rep * j) % bs or (rows and bk % bs):
        return None
    return cfg


def _tile_config(rows: bool, cols: bool, bs: int) -> tuple[int, int, int]:
    bm, bk, warps = TILE_CONFIGS[(rows, cols)]
    if cols:
        bm = max(bm, bs)
    if rows:
        bk = max(bk, bs)
    while bm * bk > 8192 and bk > max(bs if rows else 1, 32):  # large blocks: keep the tile's size
        bk //= 2
    if bm * bk > 8192:
        warps = max(warps, 8)
    return bm, bk, warps


_SCRATCH: dict = {}


def scratch(device: torch.device, kind: str) -> torch.Tensor:
    """A per-device 1-element tensor that kernels are handed but never write: ``"dummy"`` (uint8) stands
    for a plane a launch does not write, ``"seed"`` (int32 zero) for the Philox seed of a
    round-to-nearest launch (read only under stochastic rounding). Made once per device instead of per
    launch (a launch's host time is what a small layer's step time is made of)."""
    key = (device.type, device.index, kind)
    t = _SCRATCH.get(key)
    if t is None:
        t = torch.zeros(1, dtype=torch.uint8 if kind == "dummy" else torch.int32, device=device)
        _SCRATCH[key] = t
    return t


def _alloc(shape, fill: int = 0xA5, device=None) -> torch.Tensor:
    if POISON_OUTPUTS:
        return torch.full(shape, fill, dtype=torch.uint8, device=device)
    return torch.empty(shape, dtype=torch.uint8, device=device)




def _alloc_values(shape, dtype, device) -> torch.Tensor:
    if POISON_OUTPUTS:
        return torch.full(shape, -7.75, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


# Dynamo stays out of the launch: traced as a user-defined Triton kernel under torch.compile on CUDA, the
# launch's computed keyword arguments reached Triton's launcher incomplete (docs/kernels.md); a compiled
# model calls the cast as an opaque function, as it calls the reference.
@torch.compiler.disable(recursive=True)
def _launch(x2: torch.Tensor, fmt: ElemFormat, bs: int, rows: bool, cols: bool, scale_mode: str, rounding: str,
            seed_t: torch.Tensor | None, pack: bool = True, act: int = 0, y: torch.Tensor | None = None,
            row_codes: bool = True, col_codes: bool = True, row_vals: torch.dtype | None = None,
            col_vals: torch.dtype | None = None, grad: torch.Tensor | None = None, dbias: bool = False,
            row_vals_into_grad: bool = False):
    """Run the cast on a 2-D tensor; returns (row, col), each None or (data | None, scale | None, values | None).

    ``act`` > 0 casts ``act(x2)`` instead (gated ones: x2 is [M, 2K]); ``y`` receives that output.
    With ``grad`` (the activation output's shape: [M, K], or [M, K/2] for gated ones; rows contiguous,
    x2's dtype) it casts the input gradient ``grad * act'(x2)`` ([M, K], any act);
    ``dbias`` then also returns that output's fp32 column sums: ``(row, col, dbias)``;
    ``row_vals_into_grad`` writes the rowwise values over ``grad`` (contiguous, [M, K], of the values' dtype):
    each tile reads its gradient before it writes its values there, and tiles are disjoint.
    ``row_codes`` / ``col_codes`` False skip a plane's codes and scales; ``row_vals`` / ``col_vals``
    (a dtype) also write its dequantized values, [M, K] in that dtype.
    """
    M, K = x2.shape
    if act >= 6 and grad is None:  # a gated forward's output is half as wide; its gradient is x2's width
        K //= 2
    dev = x2.device
    nbk, nbm = -(-K // bs), -(-M // bs)
    kp, mp = nbk * bs, nbm * bs
    dummy = scratch(dev, "dummy")
    row_codes, col_codes = rows and row_codes, cols and col_codes
    row_vals, col_vals = (row_vals if rows else None), (col_vals if cols else None)
    row = col = None
    plen = (lambda n: packed_length(n, fmt)) if pack else (lambda n: n)
    if rows:
        row = ((_alloc((M, plen(kp)), device=dev), _alloc((M, nbk), device=dev)) if row_codes else (None, None))
        if row_vals_into_grad:
            if (grad is None or row_vals is None or grad.dtype != row_vals or grad.shape != (M, K)
                    or not grad.is_contiguous()):
                raise ValueError("row_vals_into_grad needs a contiguous gradient of the rowwise values' dtype")
            row += (grad,)
        else:
            row += (None if row_vals is None else _alloc_values((M, K), row_vals, dev),)
    if cols:
        col = ((_alloc((K, plen(mp)), device=dev), _alloc((K, nbm), device=dev)) if col_codes else (None, None))
        col += (None if col_vals is None else _alloc_values((M, K), col_vals, dev),)
    strip = _strip_config(rows, cols, bs, act)
    bm, bk, warps = _tile_config(rows, cols, bs) if strip is None else (strip[0] * strip[1], strip[2], strip[3])
    grad_cfg = GRAD_TILE_CONFIG if (row_vals is not None or col_vals is not None) else GRAD_TILE_CONFIG_CODES
    if grad is not None and grad_cfg is not None and bs <= grad_cfg[0] and bs <= grad_cfg[1]:
        bm, bk, warps = grad_cfg
    m_extent = mp if col_codes else M
    k_extent = kp if row_codes else K
    grid = (triton.cdiv(m_extent, bm) * triton.cdiv(k_extent, bk),)
    index64 = max(m_extent * max(abs(x2.stride(0)), 1), k_extent * max(abs(x2.stride(1)), 1),
                  M * plen(kp) if rows else 0, K * plen(mp) if cols else 0,
                  m_extent * k_extent) >= 2**31 - 1
    consts = format_consts(fmt)
    hw = (config.current().triton_hw_fp8 and not interpret_mode() and fmt.is_float and fmt.bits == 8 and rounding == "even")
    if seed_t is None:
        seed_t = scratch(dev, "seed")
    bf16 = x2.dtype == torch.bfloat16
    grad_args, parts = {}, None
    if grad is not None:
        g_shape = (M, K // 2) if act >= 6 else (M, K)
        if not 1 <= act <= 9 or (act >= 6 and K % 2) or tuple(grad.shape) != g_shape or grad.dtype != x2.dtype \
                or grad.stride(1) != 1:
            raise ValueError(f"the activation gradient cast takes an activation id 1-9 and a gradient of shape "
                             f"{list(g_shape)} (the activation output's) in the input's dtype with contiguous "
                             f"rows; got act {act}, {list(grad.shape)} {grad.dtype}, strides {grad.stride()}")
        parts = torch.empty(triton.cdiv(m_extent, bm), K, dtype=torch.float32, device=dev) if dbias else None
        grad_args = dict(g_ptr=grad.view(torch.int16) if bf16 else grad, stride_gm=grad.stride(0), GRAD=True,
                         GPU=not interpret_mode(), dbias_ptr=parts, DBIAS=dbias)
    if strip is not None:
        vals = _values_args(row if row_vals is not None else None, col if col_vals is not None else None,
                            row_codes, col_codes, K) or dict(ROW_CODES=True, COL_CODES=True, ROW_VALS=False,
                                                             COL_VALS=False, SOFT_BF16=False)
        vals.setdefault("row_val_ptr", None)
        vals.setdefault("col_val_ptr", None)
        vals.setdefault("stride_vm", 0)
        _mx_cast_strip_kernel[grid](
            x2.view(torch.int16) if bf16 else x2, row[0] if row_codes else dummy, row[1] if row_codes else dummy,
            col[0] if col_codes else dummy, col[1] if col_codes else dummy, seed_t,
            M, K, x2.stride(0), x2.stride(1),
            row[0].stride(0) if row_codes else 0, row[1].stride(0) if row_codes else 0, kp, nbk,
            col[0].stride(0) if col_codes else 0, col[1].stride(0) if col_codes else 0, mp, nbm,
            ROW=rows, COL=cols, REP=strip[0], J=strip[1], BLOCK_K=strip[2], BS=bs,
            SCALE_MODE=SCALE_MODE_IDS[scale_mode], ROUNDING=ROUNDING_IDS[rounding], HW_FP8=hw, INDEX64=index64,
            PACK_BITS=fmt.bits if pack else 8, BF16_BITS=bf16, num_warps=warps, **consts, **launch_options(),
            **vals,
        )
        return row, col
    _mx_cast_kernel[grid](
        x2.view(torch.int16) if bf16 else x2, row[0] if row_codes else dummy, row[1] if row_codes else dummy,
        col[0] if col_codes else dummy, col[1] if col_codes else dummy, seed_t,
        M, K, x2.stride(0), x2.stride(1),
        row[0].stride(0) if row_codes else 0, row[1].stride(0) if row_codes else 0, kp, nbk,
        col[0].stride(0) if col_codes else 0, col[1].stride(0) if col_codes else 0, mp, nbm,
        ROW=rows, COL=cols, BLOCK_M=bm, BLOCK_K=bk, BS=bs,
        SCALE_MODE=SCALE_MODE_IDS[scale_mode], ROUNDING=ROUNDING_IDS[rounding], HW_FP8=hw, INDEX64=index64,
        PACK_BITS=fmt.bits if pack else 8, BF16_BITS=bf16, num_warps=warps, **consts, **launch_options(),
        **_activation_args(x2, act, y, K // 2 if grad is not None and act >= 6 else K), **grad_args,
        **_values_args(row if row_vals is not None else None, col if col_vals is not None else None,
                       row_codes, col_codes, K),
    )
    return (row, col, parts.sum(0)) if dbias else (row, col)


def _values_args(row, col, row_codes: bool, col_codes: bool, k: int) -> dict:
    """Kernel arguments for the dequantized-values outputs (nothing when none is asked for)."""
    if row is None and col is None and row_codes and col_codes:
        return {}
    vals = [t[2] for t in (row, col) if t is not None]
    soft = interpret_mode() and any(v.dtype == torch.bfloat16 for v in vals)

    def arg(v):  # the interpreter gets bf16 as int16 bits (rounded by hand in the kernel)
        return v.view(torch.int16) if soft and v.dtype == torch.bfloat16 else v
    return dict(row_val_ptr=None if row is None else arg(row[2]), col_val_ptr=None if col is None else arg(col[2]),
                stride_vm=k, ROW_CODES=row_codes, COL_CODES=col_codes, ROW_VALS=row is not None,
                COL_VALS=col is not None, SOFT_BF16=soft)


def _activation_args(x2, act, y, k):
    if act == 0:
        return {}
    if y is not None and (y.stride(1) != 1 or y.dtype != x2.dtype):
        raise ValueError("the activation output must be row-contiguous in the input dtype")
    out_kind = DTYPE_IDS[x2.dtype]
    y_arg = None if y is None else (y.view(torch.int16) if y.dtype == torch.bfloat16 else y)
    return dict(y_ptr=y_arg, stride_ym=0 if y is None else y.stride(0), GATE_OFF=k, ACT=act, OUT_KIND=out_kind,
                WRITE_Y=y is not None)


def plane_outputs(last: int, keep: tuple[int, ...], deq: tuple[int, ...], dtype: torch.dtype) -> dict:
    """A cast launch's output switches (``_launch`` here, ``cuda_cast._launch``): the codes + scales of the
    ``keep`` axes and the dequantized values (in ``dtype``) of the ``deq`` axes; ``last`` is the rowwise
    axis, 0 the columnwise one (as :func:`mxtrain.kernels.dispatch.values_request` normalizes them)."""
    return dict(row_codes=last in keep, col_codes=0 in keep, row_vals=dtype if last in deq else None,
                col_vals=dtype if 0 in deq else None)


def triton_quantize(x: torch.Tensor, fmt, block_size: int = 32, axis=-1, scale_mode: str = "floor",
                    rounding: str = "even", seed=None, pack: bool = True, dequantized=(),
                    dequantized_dtype: torch.dtype = torch.bfloat16, keep_codes=None) -> MXTensor:
    """:func:`mxtrain.quantization.quantize_mx` on the Triton cast kernel (same signature, same bits).

    Blocks along the last axis (rowwise, any ndim) and/or the first axis
    (columnwise); a 2-D tensor asked for both (``axis=(-1, 0)``) gets both planes
    from one read. The registry walks from this kernel on: what it does not take
    (:func:`_fallback_reason`) runs the reference. ``pack=False`` stores one code
    per byte. Stochastic rounding uses an in-kernel Philox stream (reproducible per
    seed, not the reference's bits).

    ``dequantized`` / ``dequantized_dtype`` / ``keep_codes``: as
    :func:`mxtrain.kernels.dispatch.quantize`; the same pass writes the dequantized
    values of the ``dequantized`` planes (logical layout) and skips the codes and
    scales of planes not in ``keep_codes``.
    """
    call = QuantizeCall(x, fmt, block_size, axis, scale_mode, rounding, seed, pack, dequantized, dequantized_dtype,
                        keep_codes)
    return registry.run_from("quantize", call, x.device, "triton")


def _supports(call: QuantizeCall) -> str | None:
    s = call.spec()
    return _fallback_reason(call.x, s.fmt, s.block_size, s.axes, call.pack)


def _triton_cast(call: QuantizeCall) -> MXTensor:
    """The registered Triton implementation of ``quantize`` (``_supports`` said it takes ``call``)."""
    x, pack = call.x, call.pack
    fmt, block_size, axes, scale_mode, rounding, deq, keep = call.spec()
    seed_t = _philox_seed(call.seed, x.device) if rounding == "stochastic" else None
    last = x.ndim - 1
    want_row, want_col = last in axes, (0 in axes and x.ndim >= 2)
    opts = plane_outputs(last, keep, deq, call.dequantized_dtype)
    if x.ndim == 2 and want_row and want_col and block_size <= MAX_FUSED_BLOCK_SIZE:
        row, col = _launch(x, fmt, block_size, True, True, scale_mode, rounding, seed_t, pack, **opts)
    else:
        row = col = None
        if want_row:
            row, _ = _launch(x.reshape(-1, x.shape[-1]), fmt, block_size, True, False, scale_mode, rounding,
                             seed_t, pack, **opts)
        if want_col:
            _, col = _launch(x.reshape(x.shape[0], -1), fmt, block_size, False, True, scale_mode, rounding,
                             seed_t, pack, **opts)
    return assemble_mxtensor(x, fmt, block_size, axes, scale_mode, rounding, pack, row, col)


def assemble_mxtensor(x: torch.Tensor, fmt: ElemFormat, block_size: int, axes: tuple[int, ...], scale_mode: str,
                      rounding: str, pack: bool, row, col) -> MXTensor:
    """The MXTensor of a cast's outputs: ``row`` / ``col`` are None or (data | None, scale | None,
    values | None) of the 2-D launch (rows flattened for the rowwise plane, columns for the
    columnwise one), reshaped to ``x``'s shape. Shared by the Triton and CUDA casts."""
    last = x.ndim - 1
    shape = tuple(x.shape)
    planes: dict[int, MXPlane] = {}
    values: dict[int, torch.Tensor] = {}
    flat = x.ndim == 2  # the launch's 2-D outputs are already in place (no reshape: the host's hot path)
    if row is not None:
        lead = shape[:-1]
        if row[0] is not None:
            planes[last] = MXPlane(row[0] if flat else row[0].reshape(*lead, row[0].shape[-1]),
                                   row[1] if flat else row[1].reshape(*lead, row[1].shape[-1]), last, pack)
        if row[2] is not None:
            values[last] = row[2] if flat else row[2].reshape(shape)
    if col is not None:
        rest = shape[1:]
        if col[0] is not None:
            planes[0] = MXPlane(col[0] if flat else col[0].reshape(*rest, col[0].shape[-1]),
                                col[1] if flat else col[1].reshape(*rest, col[1].shape[-1]), 0, pack)
        if col[2] is not None:
            values[0] = col[2] if flat else col[2].reshape(shape)
    return MXTensor._unchecked(tuple(planes[a] for a in axes if a in planes), fmt.name, block_size, shape, x.dtype,
                               scale_mode, rounding, False, tuple((a, values[a]) for a in axes if a in values))


def _register() -> None:
    from mxtrain.kernels._triton_utils import kernels_available

    if kernels_available():
        registry.register("quantize", "triton", _triton_cast, supports=_supports)


_register()
