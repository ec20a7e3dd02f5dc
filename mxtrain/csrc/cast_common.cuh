// mxtrain/csrc/cast_common.cuh: pieces shared by the CUDA casts (mx_cast.cu, fp8_block_cast.cu).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace mxtrain_cuda {

// ---- element types: raw 16-byte words <-> fp32 ------------------------------------------------

template <typename T>
struct Elem;

template <>
struct Elem<__nv_bfloat16> {
  static constexpr int kWords = 1;  // uint4 words per 8 elements
  static constexpr bool kIsHalf = false;
  __device__ static float lo(uint32_t w) { return __uint_as_float(w << 16); }
  __device__ static float hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }
};

template <>
struct Elem<__half> {
  static constexpr int kWords = 1;
  static constexpr bool kIsHalf = true;
  __device__ static float lo(uint32_t w) { return __half2float(__ushort_as_half((unsigned short)(w & 0xFFFF))); }
  __device__ static float hi(uint32_t w) { return __half2float(__ushort_as_half((unsigned short)(w >> 16))); }
};

template <>
struct Elem<float> {
  static constexpr int kWords = 2;
  static constexpr bool kIsHalf = false;
};

template <typename T>
__device__ __forceinline__ void widen8(const uint4* raw, float v[8]) {
  if constexpr (Elem<T>::kWords == 2) {
    const uint32_t w[8] = {raw[0].x, raw[0].y, raw[0].z, raw[0].w, raw[1].x, raw[1].y, raw[1].z, raw[1].w};
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = __uint_as_float(w[j]);
  } else {
    const uint32_t w[4] = {raw[0].x, raw[0].y, raw[0].z, raw[0].w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      v[2 * j] = Elem<T>::lo(w[j]);
      v[2 * j + 1] = Elem<T>::hi(w[j]);
    }
  }
}

// two adjacent elements of a shared-memory row, as fp32
template <typename T>
__device__ __forceinline__ void load_pair(const T* p, float& a, float& b) {
  if constexpr (Elem<T>::kWords == 2) {
    const float2 f = *reinterpret_cast<const float2*>(p);
    a = f.x;
    b = f.y;
  } else {
    const uint32_t w = *reinterpret_cast<const uint32_t*>(p);
    a = Elem<T>::lo(w);
    b = Elem<T>::hi(w);
  }
}

// two fp8 codes (low byte = a) of fp32 values already divided by the block scale
template <int FMT>
__device__ __forceinline__ uint32_t codes2(float a, float b) {
  return (uint32_t)__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, FMT == 0 ? __NV_E4M3 : __NV_E5M2);
}

template <int FMT>
__device__ __forceinline__ float decode(uint32_t code) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)code, FMT == 0 ? __NV_E4M3 : __NV_E5M2);
  return __half2float(__half(h));
}

// fp32 -> bf16 bits, round to nearest even; NaN as torch's canonical 0x7FC0
__device__ __forceinline__ uint32_t bf16_bits(float v) {
  if (v != v) return 0x7FC0u;
  return (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(v));
}

// the 16-byte chunk c of row r of the transposed code tile lives at chunk c ^ ((r / 2) % 8): the
// column phase's stores (rows 2p, 2p+1 of 8 lanes p at a time) then hit 8 distinct bank groups
__device__ __forceinline__ int swz(int r, int c) { return c ^ ((r >> 1) & 7); }

__device__ __forceinline__ uint32_t abs_bits(float v) { return __float_as_uint(v) & 0x7FFFFFFFu; }

// v * mul (one rounded product); with INF_NAN, NaN where v is +-Inf: the FP8 casts keep a non-finite
// source value non-finite (satfinite would make it +-FMAX), as float8_cast.py's _scaled and the
// reference's cast_to_fp8 (the MX cast needs no such step: a block with an Inf has a NaN scale)
template <bool INF_NAN>
__device__ __forceinline__ float scaled(float v, float mul) {
  return (INF_NAN && isinf(v)) ? __uint_as_float(0x7FC00000u) : __fmul_rn(v, mul);
}

// ---- the columnwise plane through a transposed code tile (both casts) ------------------------

// The 32 codes of each column of the pair at p[0], p[1] (rows r at p[r * LD]), every value times its
// column's multiplier (see scaled for INF_NAN): 4 codes per word, in row order
template <typename T, int FMT, int LD, bool INF_NAN = false>
__device__ __forceinline__ void pair_codes(const T* p, float mul_a, float mul_b, uint32_t ca[8], uint32_t cb[8]) {
#pragma unroll
  for (int r = 0; r < 32; r += 4) {
    float a0, b0, a1, b1, a2, b2, a3, b3;
    load_pair<T>(p + r * LD, a0, b0);
    load_pair<T>(p + (r + 1) * LD, a1, b1);
    load_pair<T>(p + (r + 2) * LD, a2, b2);
    load_pair<T>(p + (r + 3) * LD, a3, b3);
    ca[r / 4] = codes2<FMT>(scaled<INF_NAN>(a0, mul_a), scaled<INF_NAN>(a1, mul_a)) |
                (codes2<FMT>(scaled<INF_NAN>(a2, mul_a), scaled<INF_NAN>(a3, mul_a)) << 16);
    cb[r / 4] = codes2<FMT>(scaled<INF_NAN>(b0, mul_b), scaled<INF_NAN>(b1, mul_b)) |
                (codes2<FMT>(scaled<INF_NAN>(b2, mul_b), scaled<INF_NAN>(b3, mul_b)) << 16);
  }
}

// Those codes into the transposed code tile (rows of TILE_M bytes): rows ra and ra + 1, 16-byte chunks
// 2h and 2h + 1 (32 rows of block h), swizzled
template <int TILE_M>
__device__ __forceinline__ void put_pair_codes(uint8_t* ctile, int ra, int h, const uint32_t ca[8],
                                               const uint32_t cb[8]) {
  const int rb = ra + 1;
  *reinterpret_cast<uint4*>(ctile + ra * TILE_M + swz(ra, 2 * h) * 16) = make_uint4(ca[0], ca[1], ca[2], ca[3]);
  *reinterpret_cast<uint4*>(ctile + ra * TILE_M + swz(ra, 2 * h + 1) * 16) = make_uint4(ca[4], ca[5], ca[6], ca[7]);
  *reinterpret_cast<uint4*>(ctile + rb * TILE_M + swz(rb, 2 * h) * 16) = make_uint4(cb[0], cb[1], cb[2], cb[3]);
  *reinterpret_cast<uint4*>(ctile + rb * TILE_M + swz(rb, 2 * h + 1) * 16) = make_uint4(cb[4], cb[5], cb[6], cb[7]);
}

// The code tile (ROWS rows of TILE_M bytes) out to dst[(r0 + r) * ld + c0 + ...] as whole rows, 16 bytes
// a lane (TILE_M / 16 lanes a row): rows below r_end, 16-byte chunks starting below c_end
template <int ROWS, int TILE_M, int THREADS>
__device__ __forceinline__ void write_code_tile(const uint8_t* ctile, uint8_t* dst, long long ld, long long r0,
                                                long long c0, long long r_end, long long c_end, int tid) {
  constexpr int kPerRow = TILE_M / 16;
#pragma unroll
  for (int j = 0; j < ROWS * kPerRow / THREADS; ++j) {
    const int idx = j * THREADS + tid;
    const int r = idx / kPerRow, c = idx % kPerRow;
    const long long row = r0 + r, col = c0 + 16 * c;
    if (row < r_end && col < c_end)
      *reinterpret_cast<uint4*>(dst + row * ld + col) = *reinterpret_cast<const uint4*>(ctile + r * TILE_M + swz(r, c) * 16);
  }
}

// ---- sources: activations, rounding to the input dtype -----------------------------------

// Every product and sum is an explicit round-to-nearest intrinsic: the build leaves FMA contraction on
// (the CUDA math library's erff / expf / tanhf are written for it, and only then match the libdevice
// versions that Triton and torch's kernels run), so nothing of ours may be contracted.
__device__ __forceinline__ float act_fwd(float x, int act) {
  switch (act) {
    case 1:
      return __fmul_rn(__fmul_rn(x, 0.5f), __fadd_rn(1.0f, erff(__fmul_rn(x, 0.7071067811865476f))));
    case 2: {
      const float cube = __fmul_rn(__fmul_rn(x, x), x);
      const float inner = __fmul_rn(0.7978845608028654f, __fadd_rn(x, __fmul_rn(0.044715f, cube)));
      return __fmul_rn(__fmul_rn(0.5f, x), __fadd_rn(1.0f, tanhf(inner)));
    }
    case 3:
      return x <= 0.0f ? 0.0f : x;  // torch's CUDA relu: -0 -> +0, NaN stays NaN
    case 4: {
      const float r = x < 0.0f ? 0.0f : x;
      return __fmul_rn(r, r);
    }
    default:
      return __fdiv_rn(x, __fadd_rn(1.0f, expf(-x)));
  }
}

// The activation's input gradient g * act'(x) in fp32, with the formulas of torch's CUDA backward kernels
// (and the Triton cast's _act_bwd): 1 gelu, 2 gelu_tanh, 3 relu (threshold_backward: x <= 0 -> 0, NaN x
// passes g), 4 squared_relu (autograd of square(relu(x)): g * (2 * r), then relu's threshold), 5 silu.
// Explicit round-to-nearest operations as act_fwd; the library's erff / expf / tanhf as there.
__device__ __forceinline__ float act_bwd(float x, float g, int act) {
  switch (act) {
    case 1: {
      const float cdf = __fmul_rn(0.5f, __fadd_rn(1.0f, erff(__fmul_rn(x, 0.7071067811865476f))));
      const float pdf = __fmul_rn(expf(__fmul_rn(__fmul_rn(-0.5f, x), x)), 0.3989422804014327f);
      return __fmul_rn(g, __fadd_rn(cdf, __fmul_rn(x, pdf)));
    }
    case 2: {
      const float x_sq = __fmul_rn(x, x);
      const float inner = __fmul_rn(0.7978845608028654f, __fadd_rn(x, __fmul_rn(0.044715f, __fmul_rn(x_sq, x))));
      const float t = tanhf(inner);
      const float left = __fmul_rn(0.5f, __fadd_rn(1.0f, t));
      const float inner_d = __fmul_rn(0.7978845608028654f, __fadd_rn(1.0f, __fmul_rn(0.13414499163627625f, x_sq)));
      const float right = __fmul_rn(__fmul_rn(__fmul_rn(0.5f, x), __fsub_rn(1.0f, __fmul_rn(t, t))), inner_d);
      return __fmul_rn(g, __fadd_rn(left, right));
    }
    case 3:
      return x <= 0.0f ? 0.0f : g;
    case 4: {
      const float r = x <= 0.0f ? 0.0f : x;  // relu (NaN stays NaN)
      return r <= 0.0f ? 0.0f : __fmul_rn(g, __fmul_rn(2.0f, r));
    }
    default: {
      const float s = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-x)));
      return __fmul_rn(__fmul_rn(g, s), __fadd_rn(1.0f, __fmul_rn(x, __fsub_rn(1.0f, s))));
    }
  }
}

// fp32 rounded to T (ties to even), back as fp32; NaN kept
template <typename T>
__device__ __forceinline__ float round_to(float v) {
  if constexpr (Elem<T>::kWords == 2) {
    return v;
  } else if constexpr (sizeof(T) == 2 && Elem<T>::kIsHalf) {
    return __half2float(__float2half_rn(v));
  } else {
    if (v != v) return v;
    return __bfloat162float(__float2bfloat16_rn(v));
  }
}

// 8 fp32 results of fp32 arithmetic rounded to 16-bit T (ties to even), one conversion per pair: the raw T
// bits. For such results this is round_to's value, bit for bit: the GPU's fp32 arithmetic returns the
// canonical NaN (0x7FFFFFFF), whose top half is bf16's canonical NaN 0x7FFF, and fp16's conversion
// is canonical anyway. (round_to with narrow8 took a NaN test, a conversion and a shift per value and a
// merge per pair.) Not for values passed through unchanged (relu's NaN keeps its payload in round_to).
template <typename T>
__device__ __forceinline__ uint4 round_pack8(const float s[8]) {
  static_assert(Elem<T>::kWords == 1, "16-bit element types only");
  uint32_t w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if constexpr (Elem<T>::kIsHalf) {
      const __half2 h = __floats2half2_rn(s[2 * j], s[2 * j + 1]);
      w[j] = *reinterpret_cast<const uint32_t*>(&h);
    } else {
      const __nv_bfloat162 b = __floats2bfloat162_rn(s[2 * j], s[2 * j + 1]);
      w[j] = *reinterpret_cast<const uint32_t*>(&b);
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// fp32 values -> raw T bits of one 8-element chunk (exact: the values are already rounded to T)
template <typename T>
__device__ __forceinline__ void narrow8(const float v[8], uint4* raw) {
  if constexpr (Elem<T>::kWords == 2) {
    raw[0] = make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]), __float_as_uint(v[3]));
    raw[1] = make_uint4(__float_as_uint(v[4]), __float_as_uint(v[5]), __float_as_uint(v[6]), __float_as_uint(v[7]));
  } else {
    uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t lo, hi;
      if constexpr (Elem<T>::kIsHalf) {
        lo = __half_as_ushort(__float2half_rn(v[2 * j]));
        hi = __half_as_ushort(__float2half_rn(v[2 * j + 1]));
      } else {
        lo = __float_as_uint(v[2 * j]) >> 16;  // exact: bf16 values
        hi = __float_as_uint(v[2 * j + 1]) >> 16;
      }
      w[j] = lo | (hi << 16);
    }
    raw[0] = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

}  // namespace mxtrain_cuda
