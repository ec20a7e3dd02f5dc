// mxtrain/csrc/mx_dequantize.cu: MXFP8 planes (fp8_e4m3 / fp8_e5m2 codes, block 32, E8M0 scale bytes)
// dequantized to bf16, for the host's hot path: one plain C call per launch instead of a Triton launch
// (the FSDP2 MX all-gather dequantizes each gathered plane: every weight, in forward and in backward).
//
// The values are those of the cast's values outputs (mx_cast.cu), the same arithmetic and bits as
// mxtrain.quantization (the specification) and the Triton dequantize (mxtrain/kernels/dequantize.py):
// the code decoded exactly to fp32 (NaN / Inf codes to NaN / Inf), one rounded fp32 multiply by the
// scale 2^(byte - 127) (byte 0 gives the subnormal 2^-127, 255 NaN), rounded to bf16 to nearest even
// (NaN as torch's 0x7FC0).
//
// A plane is read as [rows, length] (block axis last, row stride data_ld, scale bytes [rows, *] with
// row stride scale_ld) and element (r, l) is written at out + r * out_stride_r + l * out_stride_l:
//   * rowwise (out_stride_l == 1): each thread converts 8 consecutive codes of a row (one 8-byte load,
//     one 16-byte store; speed: benchmarks/NOTES_casts.md);
//   * transposed (out_stride_r == 1, the columnwise plane of a row-major weight): a CTA converts a
//     128 x 64 tile (plane rows x block-axis elements) into shared memory, each thread one block of 32
//     codes of one plane row (a warp: 32 consecutive plane rows, so its shared-memory stores hit distinct
//     words), and writes it out transposed, 8 outputs (16 bytes) a thread, 256 contiguous bytes per output row.
//     Speed, and the tile before it: benchmarks/NOTES_casts.md.
// count > 1 repeats the launch for shards whose codes, scales and outputs lie data_step / scale_step /
// out_step elements further each (gridDim.y): the rank chunks of an all-gather buffer.

#include "cast_common.cuh"

namespace {

using namespace mxtrain_cuda;

struct DequantArgs {
  const uint8_t* data;
  const uint8_t* scale;
  uint16_t* out;  // bf16 bits
  long long rows, length, data_ld, scale_ld, out_stride_r, out_stride_l;
  long long data_step, scale_step, out_step;
};

// fp32 2^(byte - 127) (NaN for 255; byte 0 the subnormal 2^-127), as mx_cast.cu's scale_value
__device__ __forceinline__ float dq_scale(uint32_t s) {
  return __uint_as_float(s == 255 ? 0x7FC00000u : (s == 0 ? 0x00400000u : s << 23));
}

template <int FMT>
__device__ __forceinline__ uint32_t dq_pair(uint32_t word, int k, float sv) {  // codes k, k+1 of a 4-byte word
  const uint32_t a = (word >> (8 * k)) & 0xFF, b = (word >> (8 * (k + 1))) & 0xFF;
  return bf16_bits(__fmul_rn(decode<FMT>(a), sv)) | (bf16_bits(__fmul_rn(decode<FMT>(b), sv)) << 16);
}

// One block of 32 codes (or the row's last, shorter run: length is a multiple of 8) of plane row r from
// element l: four 8-byte loads, issued before any is used; the words of chunks past the end stay 0.
__device__ __forceinline__ void load_block(const uint8_t* row, long long l, long long length, uint2 (&w)[4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) w[j] = l + 8 * j < length ? *reinterpret_cast<const uint2*>(row + l + 8 * j) : make_uint2(0, 0);
}

template <int FMT>
__device__ __forceinline__ uint4 dq_eight(uint2 codes, float sv) {
  return make_uint4(dq_pair<FMT>(codes.x, 0, sv), dq_pair<FMT>(codes.x, 2, sv), dq_pair<FMT>(codes.y, 0, sv),
                    dq_pair<FMT>(codes.y, 2, sv));
}

template <int FMT>
__global__ void __launch_bounds__(256) dequantize_rows_kernel(DequantArgs a) {
  const long long shard = blockIdx.y;
  const uint8_t* data = a.data + shard * a.data_step;
  const uint8_t* scale = a.scale + shard * a.scale_step;
  uint16_t* out = a.out + shard * a.out_step;
  const long long per_row = a.length / 8;
  const long long total = a.rows * per_row;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x) {
    const long long r = i / per_row, c = (i - r * per_row) * 8;
    const uint2 codes = *reinterpret_cast<const uint2*>(data + r * a.data_ld + c);
    const float sv = dq_scale(scale[r * a.scale_ld + c / 32]);
    *reinterpret_cast<uint4*>(out + r * a.out_stride_r + c) = dq_eight<FMT>(codes, sv);
  }
}

constexpr int kTR = 128, kTL = 64;  // the transposed kernel's tile: plane rows x block-axis elements

template <int FMT>
__global__ void __launch_bounds__(256) dequantize_transposed_kernel(DequantArgs a) {
  __shared__ __align__(16) uint16_t tile[kTL][kTR + 8];  // [l][r] (rows of 272 bytes: 16-byte aligned)
  const long long shard = blockIdx.y;
  const uint8_t* data = a.data + shard * a.data_step;
  const uint8_t* scale = a.scale + shard * a.scale_step;
  uint16_t* out = a.out + shard * a.out_step;
  const long long ntr = (a.rows + kTR - 1) / kTR;
  const long long ntiles = ntr * ((a.length + kTL - 1) / kTL);
  const int t = threadIdx.x;
  for (long long tile_id = blockIdx.x; tile_id < ntiles; tile_id += gridDim.x) {
    const long long r0 = (tile_id % ntr) * kTR, l0 = (tile_id / ntr) * kTL;
    {  // thread t: plane row r0 + t % 128, codes l0 + 32 * (t / 128) .. + 31 (one block)
      const int pr = t % kTR, lc = (t / kTR) * 32;
      const long long r = r0 + pr, l = l0 + lc;
      if (r < a.rows && l < a.length) {
        uint2 w[4];
        load_block(data + r * a.data_ld, l, a.length, w);
        const float sv = dq_scale(scale[r * a.scale_ld + l / 32]);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint4 v = dq_eight<FMT>(w[j], sv);
          const uint32_t p[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            tile[lc + 8 * j + 2 * k][pr] = (uint16_t)(p[k] & 0xFFFF);
            tile[lc + 8 * j + 2 * k + 1][pr] = (uint16_t)(p[k] >> 16);
          }
        }
      }
    }
    __syncthreads();
#pragma unroll
    for (int pass = 0; pass < kTL / 16; ++pass) {  // 16 threads write the 128 outputs (plane rows) of one l
      const int ll = pass * 16 + t / 16, rc = (t % 16) * 8;
      const long long l = l0 + ll, r = r0 + rc;
      if (l < a.length && r < a.rows)  // rows is a multiple of 8: the 8 plane rows are in or out together
        *reinterpret_cast<uint4*>(out + l * a.out_stride_l + r) = *reinterpret_cast<const uint4*>(&tile[ll][rc]);
    }
    __syncthreads();
  }
}

template <int FMT>
cudaError_t launch_dequantize(const DequantArgs& a, int count, bool transposed, cudaStream_t s) {
  const long long work = transposed ? ((a.rows + kTR - 1) / kTR) * ((a.length + kTL - 1) / kTL)
                                    : (a.rows * (a.length / 8) + 255) / 256;
  const unsigned int grid = (unsigned int)(work < (1LL << 20) ? work : (1LL << 20));
  if (transposed)
    dequantize_transposed_kernel<FMT><<<dim3(grid, count), 256, 0, s>>>(a);
  else
    dequantize_rows_kernel<FMT><<<dim3(grid, count), 256, 0, s>>>(a);
  return cudaGetLastError();
}

}  // namespace

extern "C" {

// Dequantize count MXFP8 planes (fmt 0 e4m3, 1 e5m2; block 32) to bf16. Layout (see the file's head):
// out_stride_l == 1 (rowwise) or out_stride_r == 1 (transposed); length, data_ld, data_step and the
// output's non-unit stride and out_step multiples of 8; the transposed layout also needs rows % 8 == 0;
// data 8-byte and out 16-byte aligned. Returns a cudaError_t (0 on success; cudaErrorInvalidValue for
// a layout outside these, which the Python side never sends).
int mxtrain_mx_dequantize_fp8(const uint8_t* data, const uint8_t* scale, uint16_t* out, long long rows,
                              long long length, long long data_ld, long long scale_ld, long long out_stride_r,
                              long long out_stride_l, int count, long long data_step, long long scale_step,
                              long long out_step, int fmt, void* stream) {
  const bool transposed = out_stride_r == 1 && out_stride_l != 1;
  const long long ld_out = transposed ? out_stride_l : out_stride_r;
  if (rows <= 0 || length <= 0 || count < 1 || count > 65535 || fmt < 0 || fmt > 1 || length % 8 ||
      data_ld % 8 || data_step % 8 || out_step % 8 || ld_out % 8 || (!transposed && out_stride_l != 1) ||
      (transposed && rows % 8) || reinterpret_cast<uintptr_t>(data) % 8 || reinterpret_cast<uintptr_t>(out) % 16)
    return (int)cudaErrorInvalidValue;
  DequantArgs a{data, scale, out, rows, length, data_ld, scale_ld, out_stride_r, out_stride_l,
                data_step, scale_step, out_step};
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return (int)(fmt == 0 ? launch_dequantize<0>(a, count, transposed, s) : launch_dequantize<1>(a, count, transposed, s));
}

}  // extern "C"
