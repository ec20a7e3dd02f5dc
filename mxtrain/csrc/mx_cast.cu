// mxtrain/csrc/mx_cast.cu: the CUDA C++ MXFP8 cast.
//
// One read of a row-major [M, K] bf16 / fp16 / fp32 tensor writes its rowwise MX plane (blocks of 32
// along K: codes [M, KP], scale bytes [M, NBK]) and its columnwise plane (blocks of 32 along M,
// stored transposed: codes [K, MP], scale bytes [K, NBM]), and, per plane on request, the plane's
// dequantized values (code * 2^X) as bf16 in the logical [M, K] layout. The same layouts and the
// same bits as mxtrain.quantization.quantize_mx (the specification) and the Triton cast:
//
//   * block amax = max of the fp32 bit patterns with the sign cleared (NaN > Inf > finite);
//   * the E8M0 byte from those bits (scale modes floor / rceil / even), 0xFF for a NaN/Inf block,
//     whose codes are 0;
//   * y = x * 2^(127 - byte): one rounded fp32 multiply (no FTZ: byte 254 gives 2^-127, subnormal);
//   * the element code from the hardware conversion cvt.rn.satfinite.{e4m3,e5m2}x2.f32: round half
//     to even, saturating to +-max_norm (elements of a "floor" block may exceed it).
//
// Only fp8_e4m3 / fp8_e5m2 with round-half-even and block size 32 are built here; every other
// cast takes the Triton kernel (mxtrain/kernels/cuda_cast.py decides, in one place).
//
// Work split: a CTA of 128 threads casts a 64 x 128 tile. Each thread loads eight 16-byte chunks
// (8 elements of one row each, all loads issued before any use). Rowwise: the 4 lanes holding one
// 32-element block reduce its amax with two shuffles and each stores its 8 codes as one 8-byte
// store. Columnwise: the raw tile goes to shared memory; thread t owns the column pair 2*(t%64),
// 2*(t%64)+1 over the 32 rows of block t/64, so the column amax needs no shuffles, reads are one
// 32-bit word per row (conflict-free across a warp), and each column's 32 codes leave as two
// 16-byte stores into the transposed plane. The grid walks M fastest, so neighbouring CTAs fill
// neighbouring bytes of the transposed plane's rows (merged in L2).
//
// The entry point is a plain C function (no PyTorch headers: the extension builds in seconds),
// called through ctypes with raw pointers and the current CUDA stream.

#include "cast_common.cuh"

namespace {

using namespace mxtrain_cuda;

constexpr int kTileM = 128;
constexpr int kTileK = 128;
constexpr int kThreads = 256;
constexpr int kChunks = kTileM * (kTileK / 8) / kThreads;  // 8-element chunks per thread: 8

enum Flags : int { kRowCodes = 1, kRowVals = 2, kColCodes = 4, kColVals = 8 };

struct CastArgs {
  const void* x;
  long long ldx, M, K;
  uint8_t* row_data;
  long long row_data_ld;
  uint8_t* row_scale;
  long long row_scale_ld;
  uint8_t* col_data;
  long long col_data_ld;
  uint8_t* col_scale;
  long long col_scale_ld;
  uint16_t* row_vals;  // bf16 bits, [M, K] with row stride ld_vals
  uint16_t* col_vals;
  long long ld_vals, KP, MP;
  int scale_mode;  // 0 floor, 1 rceil, 2 even
  int emax, mbits;
  uint32_t inv_max_bits;  // fp32 bits of fp32(1 / max_norm)
  int flags;
  // the source (the kernel's PRE template argument): 0 x; 1-5 act(x) (cast_common.cuh's act_fwd ids);
  // 6 LayerNorm ((x - mean) * rstd) * gamma (+ beta), 7 RMSNorm (x * rstd) * gamma; rounded to x's
  // dtype, and written to y when y is not null. The source is a compile-time choice: a run-time switch
  // over five inlined activations in the unrolled loops made the kernel big enough to thrash the
  // instruction cache (gelu + cast ran at 0.36x of the unfused ops)
  int act;
  const float* mean;
  const float* rstd;
  const float* gamma;  // [K] fp32
  const float* beta;   // [K] fp32 or null
  void* y;             // [M, K] in x's dtype, row stride ld_y, or null
  long long ld_y;
};

// ---- the MX numerics (as mxtrain.quantization and kernels/cast.py) ----------------------------

// E8M0 byte from a block's amax bit pattern
__device__ __forceinline__ int shared_scale(uint32_t amax, const CastArgs& a) {
  int exp;
  if (a.scale_mode == 1) {  // rceil: ceil(log2(amax * fp32(1/max_norm)))
    const float d = __fmul_rn(__uint_as_float(amax), __uint_as_float(a.inv_max_bits));
    const uint32_t db = __float_as_uint(d);
    const int biased = (int)(db >> 23);
    const uint32_t mant = db & 0x7FFFFFu;
    const int up = biased == 0 ? (mant > 0x400000u) : (mant != 0u);
    exp = biased - 127 + up;
  } else {
    int bits = (int)amax;
    if (a.scale_mode == 2) bits += 1 << (22 - a.mbits);  // even: round amax to mbits first
    const int biased = bits >> 23;
    exp = (biased == 0 ? (amax == 0u ? -126 : -127) : biased - 127) - a.emax;
  }
  exp = min(max(exp, -127), 127);
  return amax >= 0x7F800000u ? 255 : exp + 127;
}

// fp32 2^(127 - byte); byte 254 gives the subnormal 2^-127 (byte 255 is masked by the caller)
__device__ __forceinline__ float inverse_scale(int s) {
  return __uint_as_float(s == 254 ? 0x00400000u : (uint32_t)(254 - s) << 23);
}

// fp32 2^(byte - 127) (NaN for 255), what a code is multiplied by to dequantize it
__device__ __forceinline__ float scale_value(int s) {
  return __uint_as_float(s == 255 ? 0x7FC00000u : (s == 0 ? 0x00400000u : (uint32_t)s << 23));
}

// ---- the kernel ----------------------------------------------------------------------------

// Dynamic shared memory of a tile: the raw input [kTileM][kTileK], the columnwise codes of the tile
// transposed [kTileK][kTileM] (16-byte chunks XOR-swizzled), its columnwise scales [kTileK][4]
template <typename T>
__host__ __device__ constexpr int smem_bytes() {  // + the norm's gamma / beta of the tile's columns (fp32) at the end
  return kTileM * kTileK * (int)sizeof(T) + kTileK * kTileM + kTileK * (kTileM / 32) + 2 * kTileK * 4;
}

template <typename T, int FMT, int PRE>
__global__ void __launch_bounds__(kThreads, PRE != 0 ? 2 : 1) mx_cast_fp8_kernel(const CastArgs a) {
  constexpr int W = Elem<T>::kWords;
  extern __shared__ __align__(16) unsigned char smem[];
  T (*tile)[kTileK] = reinterpret_cast<T (*)[kTileK]>(smem);
  uint8_t* ctile = smem + kTileM * kTileK * sizeof(T);  // [kTileK][kTileM]
  uint8_t* cscale = ctile + kTileK * kTileM;            // [kTileK][kTileM / 32]

  const int tid = threadIdx.x;
  const long long m0 = (long long)blockIdx.x * kTileM;
  const long long k0 = (long long)blockIdx.y * kTileK;
  const bool row_plane = a.flags & (kRowCodes | kRowVals);
  const bool col_plane = a.flags & (kColCodes | kColVals);

  // 1. all loads in flight at once: chunk i of this thread is row i*16 + tid/16, columns (tid%16)*8 +[0, 8)
  const int cc = (tid % 16) * 8;
  const long long col = k0 + cc;
  uint4 raw[kChunks][W];
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const long long row = m0 + i * 16 + tid / 16;
    if (row < a.M && col < a.K) {
      const uint4* src = reinterpret_cast<const uint4*>(static_cast<const T*>(a.x) + row * a.ldx + col);
#pragma unroll
      for (int w = 0; w < W; ++w) raw[i][w] = __ldg(src + w);
    } else {
#pragma unroll
      for (int w = 0; w < W; ++w) raw[i][w] = make_uint4(0u, 0u, 0u, 0u);
    }
  }

  // the source, in place of the raw input (rounded to T: exact in its bits), and y if asked for
  if constexpr (PRE != 0) {
    const bool col_in = col < a.K;
    if constexpr (PRE >= 6) {  // the tile's gamma / beta, staged once in shared memory
      float* gs = reinterpret_cast<float*>(smem + smem_bytes<T>() - 2 * kTileK * 4);
      if (tid < kTileK) {
        gs[tid] = k0 + tid < a.K ? __ldg(a.gamma + k0 + tid) : 0.0f;
        gs[kTileK + tid] = (k0 + tid < a.K && a.beta) ? __ldg(a.beta + k0 + tid) : 0.0f;
      }
      __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const long long row = m0 + i * 16 + tid / 16;
      const bool in = row < a.M && col_in;
      float v[8];
      widen8<T>(raw[i], v);
      float mu = 0.0f, rs = 0.0f;
      float gw[8], bw[8];
      if constexpr (PRE >= 6) {
        if (in) {
          rs = a.rstd[row];
          if (PRE == 6) mu = a.mean[row];
        }
        const float4* gs = reinterpret_cast<const float4*>(smem + smem_bytes<T>() - 2 * kTileK * 4);
        const float4 g0 = gs[cc / 4], g1 = gs[cc / 4 + 1], b0 = gs[kTileK / 4 + cc / 4], b1 = gs[kTileK / 4 + cc / 4 + 1];
        gw[0] = g0.x; gw[1] = g0.y; gw[2] = g0.z; gw[3] = g0.w; gw[4] = g1.x; gw[5] = g1.y; gw[6] = g1.z; gw[7] = g1.w;
        bw[0] = b0.x; bw[1] = b0.y; bw[2] = b0.z; bw[3] = b0.w; bw[4] = b1.x; bw[5] = b1.y; bw[6] = b1.z; bw[7] = b1.w;
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        float s;
        if constexpr (PRE < 6) {
          s = act_fwd(v[j], PRE);
        } else {
          s = PRE == 6 ? __fmul_rn(__fmul_rn(__fsub_rn(v[j], mu), rs), gw[j]) : __fmul_rn(__fmul_rn(v[j], rs), gw[j]);
          if (a.beta) s = __fadd_rn(s, bw[j]);
        }
        v[j] = in ? round_to<T>(s) : 0.0f;
      }
      narrow8<T>(v, raw[i]);
      if (a.y && in) {
        uint4* dst = reinterpret_cast<uint4*>(static_cast<T*>(a.y) + row * a.ld_y + col);
#pragma unroll
        for (int w = 0; w < W; ++w) dst[w] = raw[i][w];
      }
    }
  }

  if (col_plane) {
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      uint4* dst = reinterpret_cast<uint4*>(&tile[i * 16 + tid / 16][cc]);
#pragma unroll
      for (int w = 0; w < W; ++w) dst[w] = raw[i][w];
    }
  }

  // 2. rowwise plane: 4 lanes per 32-element block, 16 lanes per row of the tile
  if (row_plane) {
    const long long nbk = a.KP / 32;
    const bool word_scales = (nbk % 4 == 0) && (k0 / 32 + 4 <= nbk);
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const long long row = m0 + i * 16 + tid / 16;
      float v[8];
      widen8<T>(raw[i], v);
      uint32_t amax = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) amax = max(amax, abs_bits(v[j]));
      amax = max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));
      amax = max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 2));
      const int s = shared_scale(amax, a);
      const float inv = inverse_scale(s);
      uint32_t c[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) c[j] = codes2<FMT>(__fmul_rn(v[2 * j], inv), __fmul_rn(v[2 * j + 1], inv));
      const uint32_t w0 = s == 255 ? 0u : (c[0] | (c[1] << 16));
      const uint32_t w1 = s == 255 ? 0u : (c[2] | (c[3] << 16));
      // the row's 4 scale bytes of this tile, gathered in its first lane (lanes 0, 4, 8, 12 of 16)
      const uint32_t s1 = __shfl_down_sync(0xFFFFFFFFu, (uint32_t)s, 4, 16);
      const uint32_t s2 = __shfl_down_sync(0xFFFFFFFFu, (uint32_t)s, 8, 16);
      const uint32_t s3 = __shfl_down_sync(0xFFFFFFFFu, (uint32_t)s, 12, 16);
      if (row < a.M && (a.flags & kRowCodes)) {
        if (col < a.KP) *reinterpret_cast<uint2*>(a.row_data + row * a.row_data_ld + col) = make_uint2(w0, w1);
        if ((tid & 15) == 0) {
          uint8_t* dst = a.row_scale + row * a.row_scale_ld + k0 / 32;
          if (word_scales) {
            *reinterpret_cast<uint32_t*>(dst) = (uint32_t)s | (s1 << 8) | (s2 << 16) | (s3 << 24);
          } else {
            const uint32_t sb[4] = {(uint32_t)s, s1, s2, s3};
#pragma unroll
            for (int j = 0; j < 4; ++j)
              if (k0 / 32 + j < nbk) dst[j] = (uint8_t)sb[j];
          }
        }
      }
      if (row < a.M && col < a.K && (a.flags & kRowVals)) {
        const float sv = scale_value(s);
        const uint32_t wc[2] = {w0, w1};
        uint32_t out[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t word = wc[j / 2] >> (16 * (j % 2));
          const float lo = __fmul_rn(decode<FMT>(word & 0xFF), sv);
          const float hi = __fmul_rn(decode<FMT>((word >> 8) & 0xFF), sv);
          out[j] = bf16_bits(lo) | (bf16_bits(hi) << 16);
        }
        *reinterpret_cast<uint4*>(a.row_vals + row * a.ld_vals + col) = make_uint4(out[0], out[1], out[2], out[3]);
      }
    }
  }
  if (!col_plane) return;

  // 3. columnwise plane: thread t owns columns 2p, 2p+1 over the 32 rows of block h of the tile
  __syncthreads();
  const int p = tid % 64, h = tid / 64;
  const long long kc = k0 + 2 * p;  // K is a multiple of 8: both columns are in or out together
  const long long mb = m0 + 32 * h;
  if (kc < a.K && mb < a.MP) {
    uint32_t amax_a = 0, amax_b = 0;
#pragma unroll
    for (int r = 0; r < 32; ++r) {
      float va, vb;
      load_pair<T>(&tile[32 * h + r][2 * p], va, vb);
      amax_a = max(amax_a, abs_bits(va));
      amax_b = max(amax_b, abs_bits(vb));
    }
    const int sa = shared_scale(amax_a, a), sb = shared_scale(amax_b, a);
    const float inv_a = inverse_scale(sa), inv_b = inverse_scale(sb);
    uint32_t ca[8], cb[8];  // 32 codes per column, 4 per word
    pair_codes<T, FMT, kTileK>(&tile[32 * h][2 * p], inv_a, inv_b, ca, cb);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (sa == 255) ca[j] = 0u;
      if (sb == 255) cb[j] = 0u;
    }
    if (a.flags & kColCodes) {  // into the transposed code tile; leaves in full lines below
      put_pair_codes<kTileM>(ctile, 2 * p, h, ca, cb);
      cscale[2 * p * (kTileM / 32) + h] = (uint8_t)sa;
      cscale[(2 * p + 1) * (kTileM / 32) + h] = (uint8_t)sb;
    }
    if (a.flags & kColVals) {
      const float sva = scale_value(sa), svb = scale_value(sb);
#pragma unroll
      for (int r = 0; r < 32; ++r) {
        const long long row = mb + r;
        if (row < a.M) {
          const uint32_t code_a = (ca[r / 4] >> (8 * (r % 4))) & 0xFF;
          const uint32_t code_b = (cb[r / 4] >> (8 * (r % 4))) & 0xFF;
          const uint32_t pair = bf16_bits(__fmul_rn(decode<FMT>(code_a), sva)) |
                                (bf16_bits(__fmul_rn(decode<FMT>(code_b), svb)) << 16);
          *reinterpret_cast<uint32_t*>(a.col_vals + row * a.ld_vals + kc) = pair;
        }
      }
    }
  }
  if (!(a.flags & kColCodes)) return;

  // 4. the transposed codes leave as whole 128-byte rows (8 lanes per row), the scales as words
  __syncthreads();
  write_code_tile<kTileK, kTileM, kThreads>(ctile, a.col_data, a.col_data_ld, k0, m0, a.K, a.MP, tid);
  if (tid < kTileK && k0 + tid < a.K) {
    const long long nbm = a.MP / 32;
    uint8_t* dst = a.col_scale + (k0 + tid) * a.col_scale_ld + m0 / 32;
    const uint32_t word = *reinterpret_cast<const uint32_t*>(cscale + tid * (kTileM / 32));
    if (nbm % 4 == 0 && m0 / 32 + 4 <= nbm) {
      *reinterpret_cast<uint32_t*>(dst) = word;
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (m0 / 32 + j < nbm) dst[j] = (uint8_t)(word >> (8 * j));
    }
  }
}

template <typename T, int FMT, int PRE>
cudaError_t launch_kernel(const CastArgs& a, dim3 grid, cudaStream_t stream) {
  const bool col_plane = a.flags & (kColCodes | kColVals);
  const int smem = (col_plane || PRE >= 6) ? smem_bytes<T>() : 0;
  static bool configured = false;  // per instantiation: allow more than 48 KB of dynamic shared memory
  if (!configured) {
    const cudaError_t err = cudaFuncSetAttribute(mx_cast_fp8_kernel<T, FMT, PRE>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes<T>());
    if (err != cudaSuccess) return err;
    configured = true;
  }
  mx_cast_fp8_kernel<T, FMT, PRE><<<grid, kThreads, smem, stream>>>(a);
  return cudaGetLastError();
}

template <typename T, int FMT>
cudaError_t launch_pre(const CastArgs& a, int pre, dim3 grid, cudaStream_t stream) {
  if constexpr (Elem<T>::kWords == 2) {  // fused sources are built for bf16 / fp16 inputs only
    return pre == 0 ? launch_kernel<T, FMT, 0>(a, grid, stream) : cudaErrorInvalidValue;
  } else {
    switch (pre) {
      case 0:
        return launch_kernel<T, FMT, 0>(a, grid, stream);
      case 1:
        return launch_kernel<T, FMT, 1>(a, grid, stream);
      case 2:
        return launch_kernel<T, FMT, 2>(a, grid, stream);
      case 3:
        return launch_kernel<T, FMT, 3>(a, grid, stream);
      case 4:
        return launch_kernel<T, FMT, 4>(a, grid, stream);
      case 5:
        return launch_kernel<T, FMT, 5>(a, grid, stream);
      case 6:
        return launch_kernel<T, FMT, 6>(a, grid, stream);
      default:
        return launch_kernel<T, FMT, 7>(a, grid, stream);
    }
  }
}

template <typename T>
cudaError_t launch_typed(const CastArgs& a, int fmt, int pre, cudaStream_t stream) {
  const long long m_extent = (a.flags & kColCodes) ? a.MP : a.M;
  const long long k_extent = (a.flags & kRowCodes) ? a.KP : a.K;
  const dim3 grid((unsigned)((m_extent + kTileM - 1) / kTileM), (unsigned)((k_extent + kTileK - 1) / kTileK));
  return fmt == 0 ? launch_pre<T, 0>(a, pre, grid, stream) : launch_pre<T, 1>(a, pre, grid, stream);
}

// ---- per-row statistics of a norm (the prologue's mean / rstd) -----------------------------

constexpr int kStatsThreads = 256;

__device__ __forceinline__ float block_sum(float v, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // red is reused
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float t = 0.0f;
#pragma unroll
  for (int w = 0; w < kStatsThreads / 32; ++w) t = __fadd_rn(t, red[w]);
  return t;
}

// One CTA per row: LayerNorm (mean non-null): mean = sum(x) / K, var = sum((x - mean)^2) / K, two
// passes over the row (the second from L1/L2); RMSNorm: var = sum(x^2) / K. rstd = 1 / sqrt(var + eps).
template <typename T>
__global__ void __launch_bounds__(kStatsThreads) row_stats_kernel(const void* x, long long ldx, long long K, float eps,
                                                                  float* mean, float* rstd) {
  constexpr int W = Elem<T>::kWords;
  __shared__ float red[kStatsThreads / 32];
  const T* xr = static_cast<const T*>(x) + (long long)blockIdx.x * ldx;
  float s = 0.0f;
  for (long long c = threadIdx.x * 8; c < K; c += kStatsThreads * 8) {
    uint4 raw[W];
#pragma unroll
    for (int w = 0; w < W; ++w) raw[w] = __ldg(reinterpret_cast<const uint4*>(xr + c) + w);
    float v[8];
    widen8<T>(raw, v);
#pragma unroll
    for (int j = 0; j < 8; ++j) s = mean ? __fadd_rn(s, v[j]) : __fadd_rn(s, __fmul_rn(v[j], v[j]));
  }
  const float kf = (float)K;
  float var;
  if (mean) {
    const float mu = __fdiv_rn(block_sum(s, red), kf);
    float s2 = 0.0f;
    for (long long c = threadIdx.x * 8; c < K; c += kStatsThreads * 8) {
      uint4 raw[W];
#pragma unroll
      for (int w = 0; w < W; ++w) raw[w] = __ldg(reinterpret_cast<const uint4*>(xr + c) + w);
      float v[8];
      widen8<T>(raw, v);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float d = __fsub_rn(v[j], mu);
        s2 = __fadd_rn(s2, __fmul_rn(d, d));
      }
    }
    var = __fdiv_rn(block_sum(s2, red), kf);
    if (threadIdx.x == 0) mean[blockIdx.x] = mu;
  } else {
    var = __fdiv_rn(block_sum(s, red), kf);
  }
  if (threadIdx.x == 0) rstd[blockIdx.x] = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(var, eps)));
}

}  // namespace

extern "C" {

// Version of this entry point's argument list; the Python side checks it.
int mxtrain_cast_abi_version() { return 3; }

// Cast a row-major [M, K] tensor (dtype 0 bf16, 1 fp16, 2 fp32; row stride ldx elements, K and ldx
// multiples of 8, x 16-byte aligned) to MXFP8 (fmt 0 e4m3, 1 e5m2), block size 32. Outputs that a
// flag does not ask for may be null. Returns a cudaError_t (0 on success).
int mxtrain_mx_cast_fp8(const void* x, long long M, long long K, long long ldx, int dtype, int fmt,
                        int scale_mode, int emax, int mbits, unsigned int inv_max_bits, int flags,
                        uint8_t* row_data, long long row_data_ld, uint8_t* row_scale, long long row_scale_ld,
                        uint8_t* col_data, long long col_data_ld, uint8_t* col_scale, long long col_scale_ld,
                        uint16_t* row_vals, uint16_t* col_vals, long long ld_vals, long long KP, long long MP,
                        int pre, int act, const float* mean, const float* rstd, const float* gamma, const float* beta,
                        void* y, long long ld_y, void* stream) {
  CastArgs a;
  a.x = x;
  a.ldx = ldx;
  a.M = M;
  a.K = K;
  a.row_data = row_data;
  a.row_data_ld = row_data_ld;
  a.row_scale = row_scale;
  a.row_scale_ld = row_scale_ld;
  a.col_data = col_data;
  a.col_data_ld = col_data_ld;
  a.col_scale = col_scale;
  a.col_scale_ld = col_scale_ld;
  a.row_vals = row_vals;
  a.col_vals = col_vals;
  a.ld_vals = ld_vals;
  a.KP = KP;
  a.MP = MP;
  a.scale_mode = scale_mode;
  a.emax = emax;
  a.mbits = mbits;
  a.inv_max_bits = inv_max_bits;
  a.flags = flags;
  a.act = act;
  a.mean = mean;
  a.rstd = rstd;
  a.gamma = gamma;
  a.beta = beta;
  a.y = y;
  a.ld_y = ld_y;
  if (M <= 0 || K <= 0 || (K % 8) || (ldx % 8) || fmt < 0 || fmt > 1 || scale_mode < 0 || scale_mode > 2 ||
      pre < 0 || pre > 7 || (pre >= 6 && (!rstd || !gamma)) || (pre == 6 && !mean) || (y && (ld_y % 8)))
    return (int)cudaErrorInvalidValue;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case 0:
      return (int)launch_typed<__nv_bfloat16>(a, fmt, pre, s);
    case 1:
      return (int)launch_typed<__half>(a, fmt, pre, s);
    case 2:
      return (int)launch_typed<float>(a, fmt, pre, s);
    default:
      return (int)cudaErrorInvalidValue;
  }
}

// Per-row norm statistics of a row-major [M, K] tensor (K, ldx multiples of 8): mean (LayerNorm; null
// for RMSNorm) and rstd, fp32 [M]. Returns a cudaError_t.
int mxtrain_row_stats(const void* x, long long M, long long K, long long ldx, int dtype, float eps, float* mean,
                      float* rstd, void* stream) {
  if (M <= 0 || K <= 0 || (K % 8) || (ldx % 8) || M > 2147483647LL) return (int)cudaErrorInvalidValue;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const dim3 grid((unsigned)M);
  switch (dtype) {
    case 0:
      row_stats_kernel<__nv_bfloat16><<<grid, kStatsThreads, 0, s>>>(x, ldx, K, eps, mean, rstd);
      break;
    case 1:
      row_stats_kernel<__half><<<grid, kStatsThreads, 0, s>>>(x, ldx, K, eps, mean, rstd);
      break;
    case 2:
      row_stats_kernel<float><<<grid, kStatsThreads, 0, s>>>(x, ldx, K, eps, mean, rstd);
      break;
    default:
      return (int)cudaErrorInvalidValue;
  }
  return (int)cudaGetLastError();
}

const char* mxtrain_cuda_error_string(int err) { return cudaGetErrorString((cudaError_t)err); }

}  // extern "C"
