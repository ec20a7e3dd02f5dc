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

}  // namespace mxtrain_cuda
