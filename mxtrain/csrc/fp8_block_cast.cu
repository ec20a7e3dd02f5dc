// mxtrain/csrc/fp8_block_cast.cu: the CUDA C++ FP8 block-scaling cast (Float8BlockScaling).
//
// One read of a row-major [M, N] source writes its rowwise FP8 plane ([M, N], scale-inverses per 1x128
// block [M, N/128], or per 128x128 block [M/128, N/128]) and its columnwise plane (the transpose [N, M],
// scale-inverses [N, M/128] or [N/128, M/128]), and the fp32 column sums of the source (a bias
// gradient, as per-tile partial sums [M/128, N]). The source is x itself (PRE 0), act(x) rounded to
// x's dtype (PRE 1), or g * act'(x) rounded to that dtype (PRE 2): what torch's unfused ops write.
// The same bits as mxtrain/kernels/float8_cast.py's Triton block cast and the reference
// (mxtrain.quantization.float8), which this file follows step by step:
//
//   * block amax = max |v| with NaN counted as +Inf;
//   * s = fp32(FMAX / max(amax, eps)) (round to nearest), FLT_MAX if that overflows, 1 for a zero or
//     Inf amax, the exponent bits only with power-of-2 scales; scale-inverse = fp32(1 / s);
//   * code = cvt.rn.satfinite(v * s) (one rounded fp32 product): ties to even, saturating to +-FMAX;
//     a +-Inf source value gives NaN (scaled<true>: non-finite values propagate, docs/float8.md).
//
// The activations use the CUDA math library (erff, expf, tanhf: the functions torch's CUDA kernels
// call, and libdevice's, which Triton calls), with the operation order of float8_cast.py and every
// product and sum of ours an explicit rounded intrinsic (no FMA contraction, as in the Triton kernels).
//
// Work split: a CTA of 256 threads handles a 128 x 128 tile (one block along each axis). Each thread
// loads eight 8-element chunks (16 lanes per tile row), computes the source, keeps it in shared
// memory (in the source dtype: exact), and reduces its row's amax with four shuffles. Columnwise:
// thread t owns columns 2*(t%64), +1 over rows 32*(t/64) +[0, 32); the four partial amaxes (and
// column sums) meet in shared memory; the codes go to a transposed tile that leaves as 128-byte
// rows, as in mx_cast.cu.

#include "cast_common.cuh"

namespace {

using namespace mxtrain_cuda;

constexpr int kB = 128;  // block length = tile side
constexpr int kThreads = 256;
constexpr int kChunks = kB * (kB / 8) / kThreads;  // 8

enum Flags : int { kRow = 1, kCol = 2, kDbias = 4, kSquare = 8, kPow2 = 16 };

struct Fp8Args {
  const void* x;
  const void* g;
  long long ldx, ldg, M, N;
  uint8_t* row;  // [M, N]
  float* rsi;
  uint8_t* col;  // [N, M]
  float* csi;
  float* dbias;  // [ceil(M/128), N]
  long long nb_n, nb_m;
  float fmax, eps;
  int act;  // PRE 1: 1 gelu, 2 gelu_tanh, 3 relu, 4 squared_relu, 5 silu; PRE 2: 1 gelu, 3 relu, 5 silu
  int flags;
};

// ---- the source: act_fwd / act_bwd of cast_common.cuh (PRE 2 is launched for gelu, relu and silu) ----

// ---- the scale -----------------------------------------------------------------------------

__device__ __forceinline__ float block_scale(uint32_t amax_bits, const Fp8Args& a) {
  float amax = amax_bits > 0x7F800000u ? __uint_as_float(0x7F800000u) : __uint_as_float(amax_bits);  // NaN -> Inf
  if (a.eps > 0.0f) amax = fmaxf(amax, a.eps);
  float s = __fdiv_rn(a.fmax, amax);  // (no product feeds a sum anywhere here: nothing to contract)
  if (s == __uint_as_float(0x7F800000u)) s = 3.4028234663852886e38f;
  if (amax == 0.0f || amax == __uint_as_float(0x7F800000u)) s = 1.0f;
  if (a.flags & kPow2) s = __uint_as_float(__float_as_uint(s) & 0xFF800000u);
  return s;
}

// ---- the kernel ----------------------------------------------------------------------------

template <typename T>
constexpr int fp8_smem_bytes() {
  return kB * kB * (int)sizeof(T) + kB * kB + 2 * 4 * kB * 4 + 16;
}

template <typename T, int FMT, int PRE>
__global__ void __launch_bounds__(kThreads) fp8_block_cast_kernel(const Fp8Args a) {
  constexpr int W = Elem<T>::kWords;
  extern __shared__ __align__(16) unsigned char smem[];
  T (*tile)[kB] = reinterpret_cast<T (*)[kB]>(smem);
  uint8_t* ctile = smem + kB * kB * sizeof(T);                             // [kB n][kB m], swizzled
  uint32_t* pamax = reinterpret_cast<uint32_t*>(ctile + kB * kB);          // [4][kB] column partial amax
  float* psum = reinterpret_cast<float*>(pamax + 4 * kB);                  // [4][kB] column partial sums
  uint32_t* tamax = reinterpret_cast<uint32_t*>(psum + 4 * kB);            // [1] tile amax (square)

  const int tid = threadIdx.x;
  const long long m0 = (long long)blockIdx.x * kB;
  const long long n0 = (long long)blockIdx.y * kB;
  const bool square = a.flags & kSquare;
  const int cc = (tid % 16) * 8;
  const long long col = n0 + cc;
  if (tid == 0) *tamax = 0u;

  // 1. loads (all in flight), then the source, into shared memory; each chunk's row amax
  uint4 rx[kChunks][W];
  uint4 rg[PRE == 2 ? kChunks : 1][W];
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const long long row = m0 + i * 16 + tid / 16;
    const bool in = row < a.M && col < a.N;
#pragma unroll
    for (int w = 0; w < W; ++w) {
      rx[i][w] = in ? __ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(a.x) + row * a.ldx + col) + w)
                    : make_uint4(0u, 0u, 0u, 0u);
      if constexpr (PRE == 2)
        rg[i][w] = in ? __ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(a.g) + row * a.ldg + col) + w)
                      : make_uint4(0u, 0u, 0u, 0u);
    }
  }
  uint32_t row_amax[kChunks];
  uint32_t my_amax = 0;
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const long long row = m0 + i * 16 + tid / 16;
    const bool in = row < a.M && col < a.N;
    float v[8];
    widen8<T>(rx[i], v);
    if constexpr (PRE != 0) {
      float gv[8];
      if constexpr (PRE == 2) widen8<T>(rg[i], gv);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float s = PRE == 1 ? act_fwd(v[j], a.act) : act_bwd(v[j], gv[j], a.act);
        v[j] = in ? round_to<T>(s) : 0.0f;
      }
      narrow8<T>(v, rx[i]);
    }
#pragma unroll
    for (int w = 0; w < W; ++w) reinterpret_cast<uint4*>(&tile[i * 16 + tid / 16][cc])[w] = rx[i][w];
    uint32_t am = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) am = max(am, abs_bits(v[j]));
#pragma unroll
    for (int o = 1; o < 16; o <<= 1) am = max(am, __shfl_xor_sync(0xFFFFFFFFu, am, o));
    row_amax[i] = am;
    my_amax = max(my_amax, am);
  }
  if (square) {
#pragma unroll
    for (int o = 16; o < 32; o <<= 1) my_amax = max(my_amax, __shfl_xor_sync(0xFFFFFFFFu, my_amax, o));
    __syncthreads();  // tamax initialised
    if ((tid & 31) == 0) atomicMax(tamax, my_amax);
  }
  __syncthreads();
  const uint32_t tile_amax = square ? *tamax : 0u;
  const float tile_s = square ? block_scale(tile_amax, a) : 0.0f;

  // 2. rowwise plane (from registers: the source of each chunk is in rx)
  if (a.flags & kRow) {
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const long long row = m0 + i * 16 + tid / 16;
      float v[8];
      widen8<T>(rx[i], v);
      const float s = square ? tile_s : block_scale(row_amax[i], a);
      uint32_t c[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) c[j] = codes2<FMT>(scaled<true>(v[2 * j], s), scaled<true>(v[2 * j + 1], s));
      if (row < a.M && col < a.N) {
        *reinterpret_cast<uint2*>(a.row + row * a.N + col) = make_uint2(c[0] | (c[1] << 16), c[2] | (c[3] << 16));
        if (!square && (tid & 15) == 0) a.rsi[row * a.nb_n + blockIdx.y] = __fdiv_rn(1.0f, s);
      }
    }
    if (square && tid == 0) a.rsi[blockIdx.x * a.nb_n + blockIdx.y] = __fdiv_rn(1.0f, tile_s);
  }
  if (!(a.flags & (kCol | kDbias))) return;

  // 3. columnwise: partial amax / sums of 32 rows per thread, met in shared memory
  const int p = tid % 64, h = tid / 64;
  const int ca_ = 2 * p, cb_ = 2 * p + 1;
  uint32_t am_a = 0, am_b = 0;
  float sum_a = 0.0f, sum_b = 0.0f;
#pragma unroll
  for (int r = 0; r < 32; ++r) {
    float va, vb;
    load_pair<T>(&tile[32 * h + r][ca_], va, vb);
    am_a = max(am_a, abs_bits(va));
    am_b = max(am_b, abs_bits(vb));
    sum_a += va;
    sum_b += vb;
  }
  pamax[h * kB + ca_] = am_a;
  pamax[h * kB + cb_] = am_b;
  psum[h * kB + ca_] = sum_a;
  psum[h * kB + cb_] = sum_b;
  __syncthreads();
  const bool n_in = n0 + ca_ < a.N;  // N is a multiple of 8: both columns in or out
  if ((a.flags & kDbias) && h == 0 && n_in) {
    a.dbias[blockIdx.x * a.N + n0 + ca_] = ((psum[ca_] + psum[kB + ca_]) + psum[2 * kB + ca_]) + psum[3 * kB + ca_];
    a.dbias[blockIdx.x * a.N + n0 + cb_] = ((psum[cb_] + psum[kB + cb_]) + psum[2 * kB + cb_]) + psum[3 * kB + cb_];
  }
  if (!(a.flags & kCol)) return;
  float sa, sb;
  if (square) {
    sa = sb = tile_s;
  } else {
    sa = block_scale(max(max(pamax[ca_], pamax[kB + ca_]), max(pamax[2 * kB + ca_], pamax[3 * kB + ca_])), a);
    sb = block_scale(max(max(pamax[cb_], pamax[kB + cb_]), max(pamax[2 * kB + cb_], pamax[3 * kB + cb_])), a);
  }
  uint32_t wa[8], wb[8];
  pair_codes<T, FMT, kB, true>(&tile[32 * h][ca_], sa, sb, wa, wb);
  put_pair_codes<kB>(ctile, ca_, h, wa, wb);
  if (h == 0 && n_in) {
    if (!square) {
      a.csi[(n0 + ca_) * a.nb_m + blockIdx.x] = __fdiv_rn(1.0f, sa);
      a.csi[(n0 + cb_) * a.nb_m + blockIdx.x] = __fdiv_rn(1.0f, sb);
    } else if (tid == 0) {
      a.csi[blockIdx.y * a.nb_m + blockIdx.x] = __fdiv_rn(1.0f, tile_s);
    }
  }
  __syncthreads();
  // 4. the transposed codes leave as 128-byte rows (M is a multiple of 16: whole chunks)
  write_code_tile<kB, kB, kThreads>(ctile, a.col, a.M, n0, m0, a.N, a.M, tid);
}

template <typename T, int FMT, int PRE>
cudaError_t launch3(const Fp8Args& a, dim3 grid, cudaStream_t stream) {
  static bool configured = false;
  if (!configured) {
    const cudaError_t err = cudaFuncSetAttribute(fp8_block_cast_kernel<T, FMT, PRE>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize, fp8_smem_bytes<T>());
    if (err != cudaSuccess) return err;
    configured = true;
  }
  fp8_block_cast_kernel<T, FMT, PRE><<<grid, kThreads, fp8_smem_bytes<T>(), stream>>>(a);
  return cudaGetLastError();
}

template <typename T, int FMT>
cudaError_t launch2(const Fp8Args& a, int pre, dim3 grid, cudaStream_t stream) {
  switch (pre) {
    case 0:
      return launch3<T, FMT, 0>(a, grid, stream);
    case 1:
      return launch3<T, FMT, 1>(a, grid, stream);
    default:
      return launch3<T, FMT, 2>(a, grid, stream);
  }
}

template <typename T>
cudaError_t launch1(const Fp8Args& a, int fmt, int pre, dim3 grid, cudaStream_t stream) {
  return fmt == 0 ? launch2<T, 0>(a, pre, grid, stream) : launch2<T, 1>(a, pre, grid, stream);
}

}  // namespace

extern "C" {

// FP8 128-block cast of a row-major [M, N] source (dtype 0 bf16, 1 fp16, 2 fp32; N, ldx, ldg multiples
// of 8; M a multiple of 16 when the columnwise plane is written), fmt 0 e4m3 / 1 e5m2, pre 0/1/2 with
// act as above, flags: 1 rowwise, 2 columnwise, 4 dbias partial sums, 8 128x128 blocks, 16 power-of-2
// scales. Returns a cudaError_t (0 on success).
int mxtrain_fp8_block_cast(const void* x, const void* g, long long M, long long N, long long ldx, long long ldg,
                           int dtype, int fmt, int pre, int act, int flags, float fmax, float eps, uint8_t* row,
                           float* rsi, uint8_t* col, float* csi, float* dbias, long long nb_n, long long nb_m,
                           void* stream) {
  Fp8Args a;
  a.x = x;
  a.g = g;
  a.ldx = ldx;
  a.ldg = ldg;
  a.M = M;
  a.N = N;
  a.row = row;
  a.rsi = rsi;
  a.col = col;
  a.csi = csi;
  a.dbias = dbias;
  a.nb_n = nb_n;
  a.nb_m = nb_m;
  a.fmax = fmax;
  a.eps = eps;
  a.act = act;
  a.flags = flags;
  if (M <= 0 || N <= 0 || (N % 8) || (ldx % 8) || (pre == 2 && (ldg % 8)) || ((flags & kCol) && (M % 16)) ||
      fmt < 0 || fmt > 1 || pre < 0 || pre > 2)
    return (int)cudaErrorInvalidValue;
  const dim3 grid((unsigned)((M + kB - 1) / kB), (unsigned)((N + kB - 1) / kB));
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case 0:
      return (int)launch1<__nv_bfloat16>(a, fmt, pre, grid, s);
    case 1:
      return (int)launch1<__half>(a, fmt, pre, grid, s);
    case 2:
      return (int)launch1<float>(a, fmt, pre, grid, s);
    default:
      return (int)cudaErrorInvalidValue;
  }
}

}  // extern "C"
