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
// Work split: a CTA of 256 threads casts a 128 x 128 tile. Each thread loads eight 16-byte chunks
// (8 elements of one row each, all loads issued before any use; with a source, straight into shared
// memory, see the kernel). Rowwise: the 4 lanes holding one
// 32-element block reduce its amax with two shuffles and each stores its 8 codes as one 8-byte
// store. Columnwise: the raw tile goes to shared memory; thread t owns the column pair 2*(t%64),
// 2*(t%64)+1 over the 32 rows of block t/64 (x2: 4 blocks, 256 threads), so the column amax needs no shuffles, reads are one
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

// kGammaBf16: a norm's gamma / beta are bf16 (else fp32). kRoundBf16: an fp32 input is rounded to bf16
// (nearest-even, as x.to(torch.bfloat16)) before the cast, in the plain kernel: the cast of the bf16
// copy of fp32 master weights without writing that copy (FSDP2's MX all-gather)
enum Flags : int { kRowCodes = 1, kRowVals = 2, kColCodes = 4, kColVals = 8, kGammaBf16 = 16, kRoundBf16 = 32 };

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
  // 6 LayerNorm fma(fma(x, rstd, -(mean * rstd)), gamma, beta or 0), 7 RMSNorm (x * rstd) * gamma; rounded to x's
  // dtype, and written to y when y is not null. The source is a compile-time choice: a run-time switch
  // over five inlined activations in the unrolled loops made the kernel big enough to thrash the
  // instruction cache (speed: benchmarks/NOTES_casts.md)
  int act;
  float* mean;
  float* rstd;
  const void* gamma;  // [K] fp32, or bf16 with kGammaBf16 (the parameters as they are: no conversion pass)
  const void* beta;   // [K] like gamma, or null
  void* y;             // [M, K] in x's dtype, row stride ld_y, or null
  long long ld_y;
  // norms: the statistics are computed inside the kernel (see mx_source_cast_kernel), written to
  // mean (LayerNorm) / rstd [M]; work is a zeroed int32 workspace [1 + bands] (the item counter, then
  // per band of kTileM rows the number of its statistics items done); lookahead in bands
  float eps;
  int* work;
  int lookahead;
  // the activation gradient (the plain kernel's GRAD template argument 1-5, act_bwd's ids): the cast of
  // g * act'(x) rounded to x's dtype, g [M, K] in x's dtype with row stride ldg (y, when not null, gets it)
  const void* g;
  long long ldg;
  bool vec_gb;  // gamma (and beta) 16-byte aligned: loaded as two float4 (fp32) or one uint4 (bf16)
  bool gb_bf16;  // flags & kGammaBf16
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
__host__ __device__ constexpr int smem_bytes() {
  return kTileM * kTileK * (int)sizeof(T) + kTileK * kTileM + kTileK * (kTileM / 32);
}

// 16-byte global -> shared copy that bypasses registers (zero-filled when !in)
__device__ __forceinline__ void cp_async16(void* smem_dst, const void* gmem_src, bool in) {
  const unsigned dst = (unsigned)__cvta_generic_to_shared(smem_dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(in ? 16 : 0));
}

// The rowwise plane of one 8-element chunk (4 lanes hold a 32-element block, 16 lanes a row of the
// tile): the block's scale, the 8 codes as one 8-byte store, the row's 4 scale bytes of the tile as a
// word from its first lane, and on request the dequantized bf16 values. Every lane of the warp calls it.
template <int FMT>
__device__ __forceinline__ void row_chunk(const CastArgs& a, const float v[8], long long row, long long col,
                                          long long k0, int tid, bool word_scales, long long nbk) {
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

// The columnwise plane of a tile held in shared memory (tile[kTileM][kTileK], the source values):
// thread t owns columns 2p, 2p+1 over the 32 rows of block h; the codes go through the transposed
// code tile and leave as whole 128-byte rows, the scales as words. Starts and ends with a barrier
// (the tile is complete before it; ctile / cscale are free again after it). Every thread calls it.
template <typename T, int FMT>
__device__ __forceinline__ void col_tile(const CastArgs& a, const T (*tile)[kTileK], uint8_t* ctile, uint8_t* cscale,
                                         long long m0, long long k0, int tid) {
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
  __syncthreads();
  if (!(a.flags & kColCodes)) return;
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

// fp32 bits rounded to the nearest bf16 (ties to even; NaN stays NaN, overflow goes to inf), as fp32 bits
__device__ __forceinline__ uint32_t round_bf16_bits(uint32_t b) {
  return __float_as_uint(__bfloat162float(__float2bfloat16_rn(__uint_as_float(b))));
}

// The plain cast: every load of the thread in flight at once into registers, the rowwise plane from
// the registers, the tile to shared memory for the columnwise plane. One tile per CTA.
template <typename T, int FMT, int GRAD>
__global__ void __launch_bounds__(kThreads, GRAD ? 2 : 1) mx_cast_fp8_kernel(const CastArgs a) {
  constexpr int W = Elem<T>::kWords;
  static_assert(GRAD == 0 || W == 1, "the activation gradient is built for 16-bit inputs");
  extern __shared__ __align__(16) unsigned char smem[];
  T (*tile)[kTileK] = reinterpret_cast<T (*)[kTileK]>(smem);
  uint8_t* ctile = smem + kTileM * kTileK * sizeof(T);  // [kTileK][kTileM]
  uint8_t* cscale = ctile + kTileK * kTileM;            // [kTileK][kTileM / 32]

  const int tid = threadIdx.x;
  const long long m0 = (long long)blockIdx.x * kTileM;
  const long long k0 = (long long)blockIdx.y * kTileK;
  const bool col_plane = a.flags & (kColCodes | kColVals);
  const long long nbk = a.KP / 32;
  const bool word_scales = (nbk % 4 == 0) && (k0 / 32 + 4 <= nbk);
  // chunk i of this thread is row i*16 + tid/16, columns (tid%16)*8 +[0, 8)
  const int cc = (tid % 16) * 8;
  const long long col = k0 + cc;

  // 1. all loads in flight at once
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
  if constexpr (GRAD != 0) {
    // dh = g * act'(x) rounded to T, chunk by chunk, in place of x: both planes (and y) then see dh. g is read
    // with plain loads: the rowwise values may be written over it (each element by the thread that read it)
    uint4 graw[kChunks];
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const long long row = m0 + i * 16 + tid / 16;
      graw[i] = (row < a.M && col < a.K)
                    ? *reinterpret_cast<const uint4*>(static_cast<const T*>(a.g) + row * a.ldg + col)
                    : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const long long row = m0 + i * 16 + tid / 16;
      if (row < a.M && col < a.K) {
        float xv[8], gv[8], d[8];
        widen8<T>(raw[i], xv);
        widen8<T>(&graw[i], gv);
#pragma unroll
        for (int j = 0; j < 8; ++j) d[j] = act_bwd(xv[j], gv[j], GRAD);
        if constexpr (GRAD == 3) {  // relu passes g through: its bits as they are (a NaN keeps its payload)
#pragma unroll
          for (int j = 0; j < 8; ++j) d[j] = round_to<T>(d[j]);
          narrow8<T>(d, &raw[i][0]);
        } else {
          raw[i][0] = round_pack8<T>(d);  // fp32 arithmetic: NaN is the canonical one
        }
        if (a.y) *reinterpret_cast<uint4*>(static_cast<T*>(a.y) + row * a.ld_y + col) = raw[i][0];
      }
    }
  }
  if constexpr (W == 2) {  // fp32 input
    if (a.flags & kRoundBf16) {  // both planes then see the bf16 values (the tile below, the rows after it)
#pragma unroll
      for (int i = 0; i < kChunks; ++i) {
#pragma unroll
        for (int w = 0; w < W; ++w) {
          const uint4 u = raw[i][w];
          raw[i][w] = make_uint4(round_bf16_bits(u.x), round_bf16_bits(u.y), round_bf16_bits(u.z),
                                 round_bf16_bits(u.w));
        }
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
  // 2. rowwise plane
  if (a.flags & (kRowCodes | kRowVals)) {
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      float v[8];
      widen8<T>(raw[i], v);
      row_chunk<FMT>(a, v, m0 + i * 16 + tid / 16, col, k0, tid, word_scales, nbk);
    }
  }
  // 3. columnwise plane
  if (col_plane) col_tile<T, FMT>(a, tile, ctile, cscale, m0, k0, tid);
}

// ---- casts of a source: act(x), LayerNorm(x), RMSNorm(x) --------------------------------------

// One activation value, rounded to T: the one copy of the code that both the table below and the
// values outside it run (not inlined), so the two give the same bits by construction
template <typename T, int PRE>
__device__ __noinline__ float act_rounded(float x) {
  return round_to<T>(act_fwd(x, PRE));
}

// The bf16 activation table: every bf16 input with 2^-16 <= |x| < 2^8 (exponent fields 111-134, both
// signs: 2 x 24 x 128 entries, 12 KB) and its activation's bf16 bits. A bf16 input has only 65536 values;
// the table holds the ones where nearly all of the work is, so most elements cost a shared-memory
// lookup instead of erff / tanhf / expf (about 30 instructions each, which made the fused cast
// compute-bound). Zeros give themselves (gelu, gelu_tanh
// and silu of +-0 are +-0, which is also what the zero padding of a ragged tile needs); other inputs
// outside the table run act_rounded itself.
constexpr int kLutLo = 111 << 7, kLutSpan = 24 << 7, kLutEntries = 2 * kLutSpan;

// a bf16 input's place in the table (valid when lut_holds(b)), and whether the table holds it
__device__ __forceinline__ uint32_t lut_slot(uint32_t b) {
  return (b & 0x7FFFu) - (uint32_t)kLutLo + (b >> 15) * (uint32_t)kLutSpan;
}
__device__ __forceinline__ bool lut_holds(uint32_t b) { return (b & 0x7FFFu) - (uint32_t)kLutLo < (uint32_t)kLutSpan; }

// A chunk of 8 bf16 inputs with at least one outside the table: each from the table, kept (zeros), or
// computed (out of line: the unrolled walk keeps one call site per chunk, not eight)
template <typename T, int PRE>
__device__ __noinline__ uint4 lut_chunk(uint4 raw, const uint16_t* lut) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
  uint32_t o[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint32_t half[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const uint32_t b = (w[j] >> (16 * k)) & 0xFFFFu;
      if (lut_holds(b)) {
        half[k] = lut[lut_slot(b)];
      } else if ((b & 0x7FFFu) == 0u) {
        half[k] = b;
      } else {
        half[k] = bf16_bits(act_rounded<T, PRE>(__uint_as_float(b << 16)));
      }
    }
    o[j] = half[0] | (half[1] << 16);
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}

// ---- work items of the source kernel ----------------------------------------------------------

constexpr int kStatRows = 8;                        // rows of one statistics item (1 per warp)
constexpr int kStatItems = kTileM / kStatRows;      // statistics items per band of kTileM rows

struct Item {
  bool stats;
  long long tm, tk;  // cast: the tile; statistics: band tm, rows tm * kTileM + tk * kStatRows + [0, kStatRows)
};

// Activations: item t is tile t (M fastest). Norms: the items of band b are its kStatItems statistics
// items and its tiles (K fastest); the statistics of band b + L are issued just after the tiles of band
// b, the first L bands' first: a band's tiles come a few bands after its statistics, whose reads of x
// are then still in L2 when the tiles read x again (one pass over x from DRAM, not two), and every
// item waits only on items with smaller numbers (fetched in order from a counter by running CTAs: no
// deadlock, whatever else runs on the GPU).
// (32-bit arithmetic: every thread decodes every item, and a 64-bit division is a long software
// routine; the launch checks that the item count fits.)
__device__ __forceinline__ Item decode_item(long long i64, bool norm, long long ntm64, long long ntk64, long long L64) {
  const uint32_t i = (uint32_t)i64, ntm = (uint32_t)ntm64, ntk = (uint32_t)ntk64, L = (uint32_t)L64;
  if (!norm) return Item{false, i % ntm, i / ntm};
  const uint32_t prefix = L * kStatItems;
  if (i < prefix) return Item{true, i / kStatItems, i % kStatItems};
  const uint32_t j = i - prefix, full = ntm - L, gs = ntk + kStatItems;
  if (j < full * gs) {
    const uint32_t g = j / gs, r = j - g * gs;
    return r < ntk ? Item{false, g, r} : Item{true, g + L, r - ntk};
  }
  const uint32_t j2 = j - full * gs, q = j2 / ntk;
  return Item{false, full + q, j2 - q * ntk};
}

// A strong load with no ordering (no L1 invalidation, no stall of the issuing warp until its value is
// used): the early look at a band's counter; load_acquire confirms a count that was not yet reached.
__device__ __forceinline__ int load_relaxed(const int* p) {
  int v;
  asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Running statistics of a row, per lane in four independent chains (a lane's values never wait on one
// long chain of dependent operations). RMSNorm: partial sums of squares q[0..3]. LayerNorm: partial sums
// of d = x - k and of d^2 around the lane's shift k, the mean of its first 8 values; a lane's mean and
// squared deviations follow as k + S/n and Q - S^2/n, and the lanes combine by Chan et al. Shifted sums
// need 3 operations per value where a Chan step per chunk needs 3.6 in two dependent chains. Their
// cancellation is bounded: (k - the lane's mean)^2 <= (n/8) * the lane's variance, so Q - S^2/n loses at
// most log2(1 + n/8) bits (5 for a lane's 256 values of an 8192-wide row; typically well under 1).
struct RowStats {
  float n, k;  // LayerNorm: the lane's count of values and its shift
  float s[4], q[4];
};

template <bool RMS, int N>
__device__ __forceinline__ void add_chunk(RowStats& st, const float v[N]) {
#pragma unroll
  for (int j = 0; j < N; j += 4) {
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      if constexpr (RMS) {
        st.q[t] = __fmaf_rn(v[j + t], v[j + t], st.q[t]);
      } else {
        const float d = __fsub_rn(v[j + t], st.k);
        st.s[t] = __fadd_rn(st.s[t], d);
        st.q[t] = __fmaf_rn(d, d, st.q[t]);
      }
    }
  }
  if constexpr (!RMS) st.n = __fadd_rn(st.n, (float)N);
}

// The row's mean (LayerNorm) and sum of squared deviations (RMSNorm: of squares) from its lanes' partial
// sums, in every lane (xor butterflies: a fixed tree, the same bits in every run and lane). LayerNorm: the
// mean from the lanes' sums, then the lanes' m2 plus n * (their mean - the mean)^2 summed.
template <bool RMS>
__device__ __forceinline__ float2 warp_combine(const RowStats& st, long long K) {
  float q = __fadd_rn(__fadd_rn(st.q[0], st.q[1]), __fadd_rn(st.q[2], st.q[3]));
  if constexpr (RMS) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) q = __fadd_rn(q, __shfl_xor_sync(0xFFFFFFFFu, q, o));
    return make_float2(0.0f, q);
  } else {
    const float s = __fadd_rn(__fadd_rn(st.s[0], st.s[1]), __fadd_rn(st.s[2], st.s[3]));
    float lmean = 0.0f, lm2 = 0.0f;  // a lane without values: n = 0, and it adds nothing below
    if (st.n > 0.0f) {
      const float a = __fdiv_rn(s, st.n);
      lmean = __fadd_rn(st.k, a);
      lm2 = fmaxf(__fmaf_rn(-s, a, q), 0.0f);
    }
    float sum = __fmul_rn(st.n, lmean);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum = __fadd_rn(sum, __shfl_xor_sync(0xFFFFFFFFu, sum, o));
    const float mean = __fdiv_rn(sum, (float)K);
    const float d = __fsub_rn(lmean, mean);
    float m2 = __fmaf_rn(__fmul_rn(d, d), st.n, lm2);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m2 = __fadd_rn(m2, __shfl_xor_sync(0xFFFFFFFFu, m2, o));
    return make_float2(mean, m2);
  }
}

// One statistics item: rows band * kTileM + sub * kStatRows + [0, 8), a warp per row (one pass,
// kStatBatch 16-byte loads in flight per lane, L2-only: the row's tiles read x again from L2, and L1
// is left to the tiles). rstd = 1 / sqrt(m2 / K + eps); LayerNorm also writes the mean. (Variants measured
// and not kept: benchmarks/NOTES_casts.md.)
constexpr int kStatBatch = 8;

template <typename T, bool RMS>
__device__ __forceinline__ void stats_item(const CastArgs& a, long long band, long long sub, int tid) {
  const int warp = tid / 32, lane = tid % 32;
  const long long row = band * kTileM + sub * kStatRows + warp;
  if (row < a.M) {
    const T* xr = static_cast<const T*>(a.x) + row * a.ldx;
    RowStats st{0.0f, 0.0f, {0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
    for (long long c0 = lane * 8; c0 < a.K; c0 += 256 * kStatBatch) {
      uint4 w[kStatBatch];
#pragma unroll
      for (int b = 0; b < kStatBatch; ++b) {
        const long long c = c0 + b * 256;
        w[b] = c < a.K ? __ldcg(reinterpret_cast<const uint4*>(xr + c)) : make_uint4(0u, 0u, 0u, 0u);
      }
      if (!RMS && c0 == lane * 8) {  // the lane's first batch (w[0] is inside the row): its shift
        float f[8];
        widen8<T>(&w[0], f);
        st.k = __fmul_rn(__fadd_rn(__fadd_rn(__fadd_rn(f[0], f[1]), __fadd_rn(f[2], f[3])),
                                   __fadd_rn(__fadd_rn(f[4], f[5]), __fadd_rn(f[6], f[7]))), 0.125f);
      }
#pragma unroll
      for (int b = 0; b < kStatBatch; b += 2) {  // two chunks (16 values) per step, in column order
        float v[16];
        widen8<T>(&w[b], v);
        widen8<T>(&w[b + 1], v + 8);
        if (c0 + (b + 1) * 256 < a.K) {
          add_chunk<RMS, 16>(st, v);
        } else if (c0 + b * 256 < a.K) {
          add_chunk<RMS, 8>(st, v);
        }
      }
    }
    const float2 mm2 = warp_combine<RMS>(st, a.K);
    if (lane == 0) {
      a.rstd[row] = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(mm2.y, (float)a.K), a.eps)));
      if (!RMS) a.mean[row] = mm2.x;
    }
  }
  __syncthreads();  // every row of the item written
  if (tid == 0) {
    __threadfence();
    atomicAdd(a.work + 1 + band, 1);
  }
}

// One 16-byte global store (the launch checks that y's rows keep 16-byte alignment). Written as a plain
// uint4 store, the compiler split y's into four 32-bit stores.
__device__ __forceinline__ void store16(void* p, uint4 v) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// 8 consecutive fp32 parameters from column col (zeros when p is null or the columns are outside):
// two 16-byte loads where the pointer allows (vec), else eight
__device__ __forceinline__ void load8(const float* p, long long col, bool in, bool vec, float out[8]) {
  if (p == nullptr || !in) {
#pragma unroll
    for (int j = 0; j < 8; ++j) out[j] = 0.0f;
  } else if (vec) {
    const float4 lo = __ldg(reinterpret_cast<const float4*>(p + col));
    const float4 hi = __ldg(reinterpret_cast<const float4*>(p + col + 4));
    out[0] = lo.x, out[1] = lo.y, out[2] = lo.z, out[3] = lo.w;
    out[4] = hi.x, out[5] = hi.y, out[6] = hi.z, out[7] = hi.w;
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) out[j] = __ldg(p + col + j);
  }
}

// gamma / beta: fp32, or bf16 widened exactly (its bits in the upper half of the fp32)
__device__ __forceinline__ void load8_gb(const void* p, bool bf16, long long col, bool in, bool vec, float out[8]) {
  if (!bf16) {
    load8(static_cast<const float*>(p), col, in, vec, out);
    return;
  }
  const uint16_t* q = static_cast<const uint16_t*>(p);
  if (p == nullptr || !in) {
#pragma unroll
    for (int j = 0; j < 8; ++j) out[j] = 0.0f;
  } else if (vec) {
    const uint4 r = __ldg(reinterpret_cast<const uint4*>(q + col));
    const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      out[2 * j] = __uint_as_float(w[j] << 16);
      out[2 * j + 1] = __uint_as_float(w[j] & 0xFFFF0000u);
    }
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) out[j] = __uint_as_float(static_cast<uint32_t>(__ldg(q + col + j)) << 16);
  }
}

// The source kernel: persistent CTAs (about two per multiprocessor) walk the work items, each tile
// copied straight to shared memory (cp.async, zero outside the tensor) one item ahead, so the next
// tile's loads overlap this one's arithmetic. Per tile: the source of each of the thread's chunks from
// shared memory (unrolled), rounded to T, written back there (for the columnwise plane) and to y, and
// its rowwise plane; then the columnwise plane. Norms compute their row statistics as items of the
// same walk (decode_item). Shapes tried before this one: benchmarks/NOTES_casts.md.
template <typename T, int FMT, int PRE>
__global__ void __launch_bounds__(kThreads, 2) mx_source_cast_kernel(const CastArgs a) {
  static_assert(Elem<T>::kWords == 1, "sources are built for 16-bit inputs");
  constexpr bool kLut = (PRE == 1 || PRE == 2 || PRE == 5) && !Elem<T>::kIsHalf;  // gelu, gelu_tanh, silu
  constexpr bool kNorm = PRE >= 6;
  extern __shared__ __align__(16) unsigned char smem[];
  T (*tiles)[kTileM][kTileK] = reinterpret_cast<T (*)[kTileM][kTileK]>(smem);  // two buffers
  uint8_t* ctile = smem + 2 * kTileM * kTileK * sizeof(T);
  uint8_t* cscale = ctile + kTileK * kTileM;
  uint16_t* lut = reinterpret_cast<uint16_t*>(cscale + kTileK * (kTileM / 32));
  __shared__ long long next_item[2];

  const int tid = threadIdx.x;
  const bool row_plane = a.flags & (kRowCodes | kRowVals);
  const bool col_plane = a.flags & (kColCodes | kColVals);
  const long long nbk = a.KP / 32;
  const long long m_extent = (a.flags & kColCodes) ? a.MP : a.M;
  const long long k_extent = (a.flags & kRowCodes) ? a.KP : a.K;
  const long long ntm = (m_extent + kTileM - 1) / kTileM;
  const long long ntk = (k_extent + kTileK - 1) / kTileK;
  const long long L = kNorm ? (a.lookahead < ntm ? a.lookahead : ntm) : 0;
  const long long nitems = ntm * ntk + (kNorm ? ntm * kStatItems : 0);
  const int cc = (tid % 16) * 8;

  float mu[kChunks], rs[kChunks];  // norms: the statistics of the current tile's rows (this thread's 8)
  // One tile: its source, rowwise plane and columnwise plane (norms: mu / rs already hold its rows'
  // statistics)
  auto tile_item = [&](const Item& it, int buf) {
    asm volatile("cp.async.wait_group 1;\n" ::: "memory");  // this tile's copies (this thread's) are in
    const long long m0 = it.tm * kTileM, k0 = it.tk * kTileK;
    const long long col = k0 + cc;
    const bool col_in = col < a.K;
    const bool word_scales = (nbk % 4 == 0) && (k0 / 32 + 4 <= nbk);
    float gw[8], bw[8];  // the norm's gamma / beta of this thread's 8 columns (the same in every chunk)
    if constexpr (kNorm) {
      load8_gb(a.gamma, a.gb_bf16, col, col_in, a.vec_gb, gw);  // K is a multiple of 8: the 8 columns are in
      load8_gb(a.beta, a.gb_bf16, col, col_in, a.vec_gb, bw);    // or out together
    }
    // Unrolled (independent chunks interleave: a rolled loop left each warp waiting on one chain of
    // shared-memory loads and shuffles at a time); the source's code stays small: a table lookup, the
    // norm's two fused operations, relu, or a call. The thread reads only what its own cp.async wrote: no
    // barrier before col_tile's.
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const long long row = m0 + i * 16 + tid / 16;
      const bool in = row < a.M && col_in;
      uint4* cell = reinterpret_cast<uint4*>(&tiles[buf][i * 16 + tid / 16][cc]);
      uint4 raw = *cell;
      float v[8];
      if constexpr (kLut) {
        // the common case first: all 8 inputs inside the table, 8 lookups and no per-element branch
        const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
        uint32_t e[8];
        bool inside = true;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const uint32_t b = (w[j / 2] >> (16 * (j % 2))) & 0xFFFFu;
          e[j] = lut_slot(b);
          inside &= lut_holds(b);
        }
        if (inside) {
          uint32_t o[4];
#pragma unroll
          for (int j = 0; j < 4; ++j) o[j] = (uint32_t)lut[e[2 * j]] | ((uint32_t)lut[e[2 * j + 1]] << 16);
          raw = make_uint4(o[0], o[1], o[2], o[3]);
        } else {
          raw = lut_chunk<T, PRE>(raw, lut);
        }
        widen8<T>(&raw, v);
      } else if constexpr (kNorm) {
        // LayerNorm: x * rstd - mean * rstd in one fused operation (-(mean * rstd) rounded once per row),
        // then * gamma + beta in another (beta 0 without one); RMSNorm (x * rstd) * gamma. Rounded to T
        // a pair at a time (round_pack8: every value here is an fp32 result), then widened back.
        widen8<T>(&raw, v);
        float s[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          s[j] = PRE == 6 ? __fmaf_rn(__fmaf_rn(v[j], rs[i], -__fmul_rn(mu[i], rs[i])), gw[j], bw[j])
                          : __fmul_rn(__fmul_rn(v[j], rs[i]), gw[j]);
        }
        raw = in ? round_pack8<T>(s) : make_uint4(0u, 0u, 0u, 0u);
        widen8<T>(&raw, v);
      } else {
        widen8<T>(&raw, v);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          float s;
          if constexpr (PRE == 3) {
            s = act_fwd(v[j], PRE);  // relu: the 16-bit input or 0, already in T (NaN kept)
          } else if constexpr (PRE == 4) {
            s = round_to<T>(act_fwd(v[j], PRE));
          } else {  // fp16 gelu / gelu_tanh / silu: no table, one copy of the code
            s = act_rounded<T, PRE>(v[j]);
          }
          v[j] = in ? s : 0.0f;
        }
        narrow8<T>(v, &raw);
      }
      if (col_plane) *cell = raw;
      if (a.y && in) store16(static_cast<T*>(a.y) + row * a.ld_y + col, raw);
      if (row_plane) row_chunk<FMT>(a, v, row, col, k0, tid, word_scales, nbk);
    }
    if (col_plane) {
      col_tile<T, FMT>(a, tiles[buf], ctile, cscale, m0, k0, tid);
    } else {
      __syncthreads();  // every thread is done with tiles[buf] before the next prefetch refills it
    }
  };
  // The walk. Activations: item t of CTA c is c + t * grid. Norms: items come from the counter, two
  // ahead: while an item runs, thread 0's atomic already takes the item after the next one and its
  // relaxed load already looks at the next tile's statistics counter; the end of the item publishes
  // both (one barrier), and every thread then loads the next tile's mean / rstd, whose L2 latency
  // overlaps the next item's start. (Fetched one at a time, each tile began with the atomic, a
  // barrier, an acquire load, a second barrier and the statistics loads, one after the other.) An
  // item's wait is still only on items with smaller numbers: no deadlock.
  long long fetched = 0;  // items fetched by this CTA
  auto fetch_static = [&]() -> long long { return blockIdx.x + (fetched++) * (long long)gridDim.x; };
  auto fetch_sync = [&]() -> long long {  // norms, before the walk
    const int slot = (int)(fetched++ & 1);
    if (tid == 0) next_item[slot] = atomicAdd(a.work, 1);
    __syncthreads();
    return next_item[slot];
  };
  auto prefetch = [&](const Item& it, bool valid, int buf) {  // the tile's copies (an empty group otherwise)
    if (valid && !it.stats) {
      const long long m0 = it.tm * kTileM, col = it.tk * kTileK + cc;
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const long long row = m0 + c * 16 + tid / 16;
        const bool in = row < a.M && col < a.K;
        const T* src = static_cast<const T*>(a.x) + (in ? row * a.ldx + col : 0);
        cp_async16(&tiles[buf][c * 16 + tid / 16][cc], src, in);
      }
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
  // norms: the statistics of a tile's rows (this thread's 8), written during this launch by other
  // CTAs: read from L2 (__ldcg, never L1) after thread 0 saw the band's count (a barrier between).
  // The producers store them, __threadfence, then count; L2 is the point of coherence of both.
  auto load_stats = [&](const Item& t) {
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const long long row = t.tm * kTileM + i * 16 + tid / 16;
      rs[i] = row < a.M ? __ldcg(a.rstd + row) : 0.0f;
      mu[i] = (PRE == 6 && row < a.M) ? __ldcg(a.mean + row) : 0.0f;
    }
  };

  long long cur = kNorm ? fetch_sync() : fetch_static();
  Item it = decode_item(cur, kNorm, ntm, ntk, L);
  prefetch(it, cur < nitems, 0);
  long long nxt = kNorm ? fetch_sync() : 0;
  if constexpr (kLut) {
    for (int e = tid; e < kLutEntries; e += kThreads) {
      const uint32_t bits = (uint32_t)(kLutLo + e % kLutSpan) | (e >= kLutSpan ? 0x8000u : 0u);
      lut[e] = (uint16_t)bf16_bits(act_rounded<T, PRE>(__uint_as_float(bits << 16)));
    }
    __syncthreads();
  }
  auto wait_stats = [&](long long band, unsigned sleep_ns) {  // thread 0: until the band's items are all counted
    while (load_acquire(a.work + 1 + band) < kStatItems) __nanosleep(sleep_ns);
  };
  if constexpr (kNorm) {
    if (cur < nitems && !it.stats) {
      if (tid == 0) wait_stats(it.tm, 100);
      __syncthreads();
      load_stats(it);
    }
  }
  for (int buf = 0; cur < nitems; buf ^= 1) {
    long long after = 0;  // norms: thread 0's fetch of the item after nxt
    int ready = kStatItems;  // norms: thread 0's early look at nxt's band
    if constexpr (!kNorm) nxt = fetch_static();
    const Item nxt_it = decode_item(nxt, kNorm, ntm, ntk, L);
    const bool nxt_tile = nxt < nitems && !nxt_it.stats;
    if constexpr (kNorm) {
      if (tid == 0) {
        after = atomicAdd(a.work, 1);
        if (nxt_tile) ready = load_relaxed(a.work + 1 + nxt_it.tm);
      }
    }
    prefetch(nxt_it, nxt < nitems, buf ^ 1);
    if (kNorm && it.stats) {
      stats_item<T, PRE == 7>(a, it.tm, it.tk, tid);
    } else {
      tile_item(it, buf);
    }
    if constexpr (kNorm) {
      const int slot = (int)(fetched++ & 1);
      if (tid == 0) {
        if (nxt_tile && ready < kStatItems) wait_stats(nxt_it.tm, 64);
        next_item[slot] = after;
      }
      __syncthreads();
      after = next_item[slot];
      if (nxt_tile) load_stats(nxt_it);
    }
    cur = nxt;
    it = nxt_it;
    if constexpr (kNorm) nxt = after;
  }
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

template <typename T>
__host__ __device__ constexpr int source_smem_bytes() {
  return 2 * kTileM * kTileK * (int)sizeof(T) + kTileK * kTileM + kTileK * (kTileM / 32) + kLutEntries * 2;
}

template <typename K>
cudaError_t allow_smem(K kernel, int bytes) {  // more than 48 KB of dynamic shared memory
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

template <typename T, int FMT, int GRAD = 0>
cudaError_t launch_plain(const CastArgs& a, dim3 grid, cudaStream_t stream) {
  const bool col_plane = a.flags & (kColCodes | kColVals);
  static cudaError_t configured = allow_smem(mx_cast_fp8_kernel<T, FMT, GRAD>, smem_bytes<T>());
  if (configured != cudaSuccess) return configured;
  mx_cast_fp8_kernel<T, FMT, GRAD><<<grid, kThreads, col_plane ? smem_bytes<T>() : 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename T, int FMT, int PRE>
cudaError_t launch_source(const CastArgs& a, long long nitems, cudaStream_t stream) {
  static cudaError_t configured = allow_smem(mx_source_cast_kernel<T, FMT, PRE>, source_smem_bytes<T>());
  if (configured != cudaSuccess) return configured;
  static int ctas = 0;  // persistent grid: as many CTAs as fit on the device at once
  if (ctas == 0) {
    int dev = 0, sms = 0, per_sm = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, mx_source_cast_kernel<T, FMT, PRE>, kThreads,
                                                  source_smem_bytes<T>());
    ctas = max(1, sms * max(1, per_sm));
  }
  // items are numbered in 32 bits (decode_item; the norms' int32 counter runs up to 2 fetches per CTA past them)
  if (nitems + 2LL * ctas >= (1LL << 31)) return cudaErrorInvalidValue;
  const unsigned grid = (unsigned)(nitems < ctas ? nitems : (long long)ctas);
  mx_source_cast_kernel<T, FMT, PRE><<<grid, kThreads, source_smem_bytes<T>(), stream>>>(a);
  return cudaGetLastError();
}

template <typename T, int FMT>
cudaError_t launch_pre(const CastArgs& a, int pre, dim3 grid, cudaStream_t stream) {
  if constexpr (Elem<T>::kWords == 2) {  // fused sources are built for bf16 / fp16 inputs only
    return pre == 0 ? launch_plain<T, FMT>(a, grid, stream) : cudaErrorInvalidValue;
  } else {
    const long long ntiles = (long long)grid.x * grid.y;  // + the statistics items of a norm
    const long long nitems = ntiles + (pre == 6 || pre == 7 ? (long long)grid.x * kStatItems : 0);
    switch (pre) {
      case 0:
        return launch_plain<T, FMT>(a, grid, stream);
      case 11:
        return launch_plain<T, FMT, 1>(a, grid, stream);
      case 12:
        return launch_plain<T, FMT, 2>(a, grid, stream);
      case 13:
        return launch_plain<T, FMT, 3>(a, grid, stream);
      case 14:
        return launch_plain<T, FMT, 4>(a, grid, stream);
      case 15:
        return launch_plain<T, FMT, 5>(a, grid, stream);
      case 1:
        return launch_source<T, FMT, 1>(a, nitems, stream);
      case 2:
        return launch_source<T, FMT, 2>(a, nitems, stream);
      case 3:
        return launch_source<T, FMT, 3>(a, nitems, stream);
      case 4:
        return launch_source<T, FMT, 4>(a, nitems, stream);
      case 5:
        return launch_source<T, FMT, 5>(a, nitems, stream);
      case 6:
        return launch_source<T, FMT, 6>(a, nitems, stream);
      default:
        return launch_source<T, FMT, 7>(a, nitems, stream);
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

}  // namespace

extern "C" {

// Version of this entry point's argument list; the Python side checks it.
int mxtrain_cast_abi_version() { return 6; }

// Cast a row-major [M, K] tensor (dtype 0 bf16, 1 fp16, 2 fp32; row stride ldx elements, K and ldx
// multiples of 8, x 16-byte aligned) to MXFP8 (fmt 0 e4m3, 1 e5m2), block size 32 (an fp32 x rounded
// to bf16 first with flags & kRoundBf16, pre 0 only). Outputs that a
// flag does not ask for may be null. pre: the source (0 x; 1-5 act(x); 6 LayerNorm, 7 RMSNorm with
// gamma / beta fp32 [K] (bf16 with flags & kGammaBf16), the statistics written to mean / rstd [M]
// fp32, eps, work an int32 workspace of 1 + ceil((MP if the columnwise codes are asked for, else M) /
// 128) entries, zeroed here on the stream, lookahead >= 1 bands; 11-15 the gradient g * act'(x) of
// activation pre - 10 (act_bwd), g [M, K] in x's dtype (bf16 / fp16) with row stride ldg, a multiple of 8,
// 16-byte aligned; y gets it when not null; the rowwise values may be written over g). Returns a
// cudaError_t (0 on success).
int mxtrain_mx_cast_fp8(const void* x, long long M, long long K, long long ldx, int dtype, int fmt,
                        int scale_mode, int emax, int mbits, unsigned int inv_max_bits, int flags,
                        uint8_t* row_data, long long row_data_ld, uint8_t* row_scale, long long row_scale_ld,
                        uint8_t* col_data, long long col_data_ld, uint8_t* col_scale, long long col_scale_ld,
                        uint16_t* row_vals, uint16_t* col_vals, long long ld_vals, long long KP, long long MP,
                        int pre, int act, float* mean, float* rstd, const void* gamma, const void* beta,
                        void* y, long long ld_y, float eps, int* work, int lookahead, const void* g,
                        long long ldg, void* stream) {
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
  a.eps = eps;
  a.work = work;
  a.lookahead = lookahead;
  a.g = g;
  a.ldg = ldg;
  a.vec_gb = (reinterpret_cast<uintptr_t>(gamma) % 16 == 0) && (reinterpret_cast<uintptr_t>(beta) % 16 == 0);
  a.gb_bf16 = (flags & kGammaBf16) != 0;
  if (M <= 0 || K <= 0 || (K % 8) || (ldx % 8) || fmt < 0 || fmt > 1 || scale_mode < 0 || scale_mode > 2 ||
      pre < 0 || (pre > 7 && pre < 11) || pre > 15 || ((flags & kRoundBf16) && (pre != 0 || dtype != 2)) ||
      ((pre == 6 || pre == 7) && (!rstd || !gamma || !work || lookahead < 1)) || (pre == 6 && !mean) ||
      (pre >= 11 && (!g || (ldg % 8) || dtype == 2)) || (y && (ld_y % 8)))
    return (int)cudaErrorInvalidValue;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (pre == 6 || pre == 7) {  // the norm's item counter and per-band statistics counters start at zero
    const long long bands = (((flags & 4) ? MP : M) + 127) / 128;
    cudaError_t err = cudaMemsetAsync(work, 0, sizeof(int) * (size_t)(1 + bands), s);
    if (err != cudaSuccess) return (int)err;
  }
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

const char* mxtrain_cuda_error_string(int err) { return cudaGetErrorString((cudaError_t)err); }

}  // extern "C"
