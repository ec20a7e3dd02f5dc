"""The ceiling of an FP8-wgmma MX GEMM on Hopper (variant C of benchmarks/NOTES_gemm.md), measured.

An MX GEMM on sm_90 has no block-scaled tensor-core instruction: it runs one FP8 ``wgmma`` per
32-wide K block into a fresh fp32 tile and promotes that tile into the accumulator with the block's
scales, ``acc += tile * 2^(ea[row] + eb[col])``. This script measures how fast that can go at best:
the operands sit in shared memory (no global loads, no epilogue), so each kernel is bound by the
tensor cores and the promotion arithmetic alone. Kernels (each CTA: warpgroups of 128 threads, every
warpgroup an m64 x N tile; persistent grid, one CTA per SM):

- ``bf16``: bf16 wgmma (k16, two per 32 K), accumulating in place: the ceiling of a bf16 GEMM.
- ``fp8``: e4m3 wgmma (k32), accumulating in place: the FP8 ceiling (what per-tensor FP8 reaches).
- ``fp8_promote128``: e4m3 wgmma, four k32 steps chained, then promoted with a per-row scale times
  one scale per 128 x 128 weight block (DeepGEMM's FP8 recipe: one FFMA per accumulator element
  per 128 K).
- ``mx_promote32``: e4m3 wgmma per 32-wide K block into one of two fresh tiles (the next block's
  wgmma runs while the last one is promoted), promoted with the row's and the column's E8M0 scale
  per element (an FMUL for the scale product and an FFMA: MX's per-column weight scales leave no
  product to hoist).

The per-32 kernels are what an exact MXFP8 GEMM must do on sm_90; the table reports TFLOP/s and the
ratio to the bf16 ceiling measured in the same run. Hopper only (sm_90a); prints the table last.

    python benchmarks/bench_wgmma_promotion.py [--kblocks 4096] [--record]
"""

from __future__ import annotations

import argparse
import datetime

import torch

KT = 128  # bytes of K per operand row held in shared memory (the kernels cycle over it)


def _regs(n: int, first: int = 0) -> str:
    return ", ".join(f"%{first + i}" for i in range(n))


def _wgmma(name: str, n: int, kind: str) -> str:
    """A device function issuing one wgmma ``m64 n{n}`` into ``float (&d)[n/2]`` (scale_d: 0 overwrites)."""
    nacc = n // 2
    if kind == "bf16":
        op = f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16"
        tail = "p, 1, 1, 0, 0"
    else:
        op = f"wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3"
        tail = "p, 1, 1"
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(nacc))
    return f"""
__device__ __forceinline__ void {name}(float (&d)[{nacc}], uint64_t da, uint64_t db, int scale_d) {{
  asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{nacc + 2}, 0;\\n"
               "{op} {{{_regs(nacc)}}}, %{nacc}, %{nacc + 1}, {tail};\\n}}\\n"
               : {outs} : "l"(da), "l"(db), "r"(scale_d));
}}
"""


_COMMON = r"""
#include <cstdint>
#include <torch/extension.h>

__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory");
}
// keeps the compiler from moving reads or writes of accumulator registers across a wgmma fence / wait
template <int R> __device__ __forceinline__ void pin(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}
// shared-memory matrix descriptor, no swizzle: 8-row x 16-byte core matrices, K-major
__device__ __forceinline__ uint64_t desc(const void* smem, uint32_t lbo, uint32_t sbo) {
  uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  return (uint64_t)((a & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32);
}
"""

_KERNEL = r"""
// MODE 0 bf16, 1 fp8, 2 fp8 promoted per 128 K (row scale x block scale), 3 MX: fp8 promoted per 32 K
template <int MODE, int N, int WGS>
__global__ void __launch_bounds__(128 * WGS, 1) ceiling_kernel(float* out, int kblocks) {
  constexpr int NACC = N / 2;
  extern __shared__ __align__(1024) uint8_t smem[];
  auto sa = reinterpret_cast<uint8_t (*)[64 * KT]>(smem);                       // [WGS][64 * KT]
  uint8_t* sb = smem + WGS * 64 * KT;                                             // [N * KT]
  auto scale_a = reinterpret_cast<float (*)[WGS * 64]>(sb + N * KT);             // [KT / 32][WGS * 64]
  auto scale_b = reinterpret_cast<float (*)[N]>(sb + N * KT + (KT / 32) * WGS * 64 * 4);  // [KT / 32][N]
  const int tid = threadIdx.x, wg = tid / 128, lane = tid % 32, warp = (tid % 128) / 32;
  // operand bytes: small e4m3 / bf16 values (no NaN or Inf), scales powers of two near 1
  for (int i = tid; i < WGS * 64 * KT; i += blockDim.x)
    (&sa[0][0])[i] = (MODE == 0) ? ((i & 1) ? 0x3c : 0x00) : 0x30 + (i * 7) % 15;
  for (int i = tid; i < N * KT; i += blockDim.x) sb[i] = (MODE == 0) ? ((i & 1) ? 0x3c : 0x00) : 0x30 + (i * 5) % 13;
  for (int i = tid; i < (KT / 32) * WGS * 64; i += blockDim.x) (&scale_a[0][0])[i] = (i % 3) ? 0.5f : 2.0f;
  for (int i = tid; i < (KT / 32) * N; i += blockDim.x) (&scale_b[0][0])[i] = (i % 5) ? 1.0f : 0.25f;
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  // core matrix (8 rows x 16 B) at [row / 8][k / 16]: LBO (next along K) 128 B, SBO (next 8 rows) KT * 8 B
  const uint32_t lbo = 128, sbo = KT * 8;
  float acc[NACC];
#pragma unroll
  for (int i = 0; i < NACC; ++i) acc[i] = 0.f;
  const int r0 = warp * 16 + lane / 4;          // this thread's rows in the warpgroup tile: r0, r0 + 8
  const int c0 = 2 * (lane % 4);                // its columns: c0 + 8 j + {0, 1}
  if constexpr (MODE == 0 || MODE == 1) {
    for (int kb = 0; kb < kblocks; ++kb) {
      const int kk = kb % (KT / 32);
      fence();
      pin(acc);
      if constexpr (MODE == 0) {  // two k16 bf16 steps per 32 K elements (64 bytes of K)
        // bf16: a 32-element K block is 64 bytes: 4 core matrices along K; the tile holds KT / 64 blocks
        const int kh = kb % (KT / 64);
        WGMMA_BF16(acc, desc(&sa[wg][kh * 512], lbo, sbo), desc(&sb[kh * 512], lbo, sbo), 1);
        WGMMA_BF16(acc, desc(&sa[wg][kh * 512 + 256], lbo, sbo), desc(&sb[kh * 512 + 256], lbo, sbo), 1);
      } else {
        WGMMA_FP8(acc, desc(&sa[wg][kk * 256], lbo, sbo), desc(&sb[kk * 256], lbo, sbo), 1);
      }
      commit();
      pin(acc);
    }
    wait<0>();
    pin(acc);
  } else if constexpr (MODE == 2) {  // DeepGEMM-style: 4 chained k32 steps, one promotion per 128 K
    float t[NACC];
    for (int kb = 0; kb < kblocks; kb += 4) {
      fence();
      pin(t);
#pragma unroll
      for (int s = 0; s < 4; ++s)
        WGMMA_FP8(t, desc(&sa[wg][s * 256], lbo, sbo), desc(&sb[s * 256], lbo, sbo), s > 0);
      commit();
      wait<0>();
      pin(t);
      const float s0 = scale_a[0][wg * 64 + r0] * scale_b[0][0], s1 = scale_a[0][wg * 64 + r0 + 8] * scale_b[0][0];
#pragma unroll
      for (int j = 0; j < NACC / 4; ++j) {
        acc[4 * j + 0] = fmaf(t[4 * j + 0], s0, acc[4 * j + 0]);
        acc[4 * j + 1] = fmaf(t[4 * j + 1], s0, acc[4 * j + 1]);
        acc[4 * j + 2] = fmaf(t[4 * j + 2], s1, acc[4 * j + 2]);
        acc[4 * j + 3] = fmaf(t[4 * j + 3], s1, acc[4 * j + 3]);
      }
    }
  } else {  // MX: one fresh tile per 32-K block, two tiles in flight, promoted per element
    float t0[NACC], t1[NACC];
    auto promote = [&](float (&t)[NACC], int kk) {
      const float sa0 = scale_a[kk][wg * 64 + r0], sa1 = scale_a[kk][wg * 64 + r0 + 8];
#pragma unroll
      for (int j = 0; j < NACC / 4; ++j) {
        const float2 sbj = *reinterpret_cast<const float2*>(&scale_b[kk][8 * j + c0]);
        acc[4 * j + 0] = fmaf(t[4 * j + 0], sa0 * sbj.x, acc[4 * j + 0]);
        acc[4 * j + 1] = fmaf(t[4 * j + 1], sa0 * sbj.y, acc[4 * j + 1]);
        acc[4 * j + 2] = fmaf(t[4 * j + 2], sa1 * sbj.x, acc[4 * j + 2]);
        acc[4 * j + 3] = fmaf(t[4 * j + 3], sa1 * sbj.y, acc[4 * j + 3]);
      }
    };
    fence();
    pin(t0);
    WGMMA_FP8(t0, desc(&sa[wg][0], lbo, sbo), desc(&sb[0], lbo, sbo), 0);
    commit();
    for (int kb = 0; kb < kblocks; kb += 2) {
      const int k1 = (kb + 1) % (KT / 32), k2 = (kb + 2) % (KT / 32);
      fence();
      pin(t1);
      WGMMA_FP8(t1, desc(&sa[wg][k1 * 256], lbo, sbo), desc(&sb[k1 * 256], lbo, sbo), 0);
      commit();
      wait<1>();  // block kb is in t0
      pin(t0);
      promote(t0, kb % (KT / 32));
      fence();
      pin(t0);
      if (kb + 2 < kblocks) {
        WGMMA_FP8(t0, desc(&sa[wg][k2 * 256], lbo, sbo), desc(&sb[k2 * 256], lbo, sbo), 0);
      }
      commit();
      wait<1>();  // block kb + 1 is in t1
      pin(t1);
      promote(t1, k1);
    }
    wait<0>();
  }
  float* o = out + ((size_t)blockIdx.x * blockDim.x + tid) * NACC;
#pragma unroll
  for (int i = 0; i < NACC; ++i) o[i] = acc[i];
}

template <int MODE, int N, int WGS>
void launch(torch::Tensor out, int64_t kblocks) {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, out.device().index());
  const int bytes = WGS * 64 * KT + N * KT + (KT / 32) * (WGS * 64 + N) * 4;
  cudaFuncSetAttribute(ceiling_kernel<MODE, N, WGS>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  // the legacy default stream: torch's current stream unless the caller set another (this script does not)
  ceiling_kernel<MODE, N, WGS><<<sms, 128 * WGS, bytes>>>(
      out.data_ptr<float>(), (int)kblocks);
}

void run(torch::Tensor out, int64_t mode, int64_t n, int64_t wgs, int64_t kblocks) {
  TORCH_CHECK(out.is_cuda() && out.dtype() == torch::kFloat32, "out: a CUDA float32 tensor");
  if (mode == 0 && n == 128 && wgs == 2) return launch<0, 128, 2>(out, kblocks);
  if (mode == 0 && n == 256 && wgs == 2) return launch<0, 256, 2>(out, kblocks);
  if (mode == 1 && n == 128 && wgs == 2) return launch<1, 128, 2>(out, kblocks);
  if (mode == 1 && n == 256 && wgs == 2) return launch<1, 256, 2>(out, kblocks);
  if (mode == 2 && n == 128 && wgs == 2) return launch<2, 128, 2>(out, kblocks);
  if (mode == 3 && n == 128 && wgs == 2) return launch<3, 128, 2>(out, kblocks);
  if (mode == 3 && n == 64 && wgs == 3) return launch<3, 64, 3>(out, kblocks);
  if (mode == 3 && n == 64 && wgs == 4) return launch<3, 64, 4>(out, kblocks);
  TORCH_CHECK(false, "no instance for mode ", mode, " n ", n, " warpgroups ", wgs);
}
"""

# (label, mode, N, warpgroups)
VARIANTS = [
    ("bf16 m64n256, 2 WG", 0, 256, 2),
    ("bf16 m64n128, 2 WG", 0, 128, 2),
    ("fp8 m64n256, 2 WG", 1, 256, 2),
    ("fp8 m64n128, 2 WG", 1, 128, 2),
    ("fp8_promote128 m64n128, 2 WG", 2, 128, 2),
    ("mx_promote32 m64n128, 2 WG", 3, 128, 2),
    ("mx_promote32 m64n64, 3 WG", 3, 64, 3),
    ("mx_promote32 m64n64, 4 WG", 3, 64, 4),
]


def build():
    from torch.utils.cpp_extension import load_inline

    src = (_COMMON + f"constexpr int KT = {KT};\n"
           + _wgmma("wgmma_bf16_n256", 256, "bf16") + _wgmma("wgmma_bf16_n128", 128, "bf16")
           + _wgmma("wgmma_bf16_n64", 64, "bf16")
           + _wgmma("wgmma_fp8_n256", 256, "fp8") + _wgmma("wgmma_fp8_n128", 128, "fp8")
           + _wgmma("wgmma_fp8_n64", 64, "fp8")
           + "#define WGMMA_BF16(d, a, b, s) wgmma_bf16_dispatch<N>(d, a, b, s)\n"
           + "#define WGMMA_FP8(d, a, b, s) wgmma_fp8_dispatch<N>(d, a, b, s)\n"
           + _DISPATCH + _KERNEL)
    return load_inline(name="mxtrain_wgmma_ceiling", cpp_sources=_DECL, cuda_sources=src, functions=["run"],
                       extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17",
                                          "-Xptxas=-v"], verbose=False)


_DECL = "void run(torch::Tensor out, int64_t mode, int64_t n, int64_t wgs, int64_t kblocks);"

_DISPATCH = r"""
template <int N> __device__ __forceinline__ void wgmma_bf16_dispatch(float (&d)[N / 2], uint64_t a, uint64_t b, int s) {
  if constexpr (N == 256) wgmma_bf16_n256(d, a, b, s);
  else if constexpr (N == 128) wgmma_bf16_n128(d, a, b, s);
  else wgmma_bf16_n64(d, a, b, s);
}
template <int N> __device__ __forceinline__ void wgmma_fp8_dispatch(float (&d)[N / 2], uint64_t a, uint64_t b, int s) {
  if constexpr (N == 256) wgmma_fp8_n256(d, a, b, s);
  else if constexpr (N == 128) wgmma_fp8_n128(d, a, b, s);
  else wgmma_fp8_n64(d, a, b, s);
}
"""


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kblocks", type=int, default=8192, help="32-wide K blocks per CTA per launch")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--record", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = p.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        raise SystemExit("needs a Hopper GPU (sm_90)")
    ext = build()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for label, mode, n, wgs in VARIANTS:
        out = torch.empty(sms * 128 * wgs * n // 2, device="cuda")
        def fn(out=out, mode=mode, n=n, wgs=wgs):
            ext.run(out, mode, n, wgs, args.kblocks)
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(args.repeats):
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        t = sorted(times)[len(times) // 2]
        assert torch.isfinite(out).all(), label
        flops = 2.0 * sms * wgs * 64 * n * 32 * args.kblocks
        rows.append((label, t * 1e3, flops / t / 1e12))
    base = rows[0][2]
    title = (f"wgmma ceilings, {args.kblocks} K blocks of 32 per CTA, one CTA per SM ({sms}), operands in shared "
             "memory")
    lines = [title, "", "| kernel | ms | TFLOP/s | vs bf16 m64n256 |", "|---|---|---|---|"]
    lines += [f"| {label} | {ms:.3f} | {tf:.0f} | {tf / base:.2f} |" for label, ms, tf in rows]
    table = "\n".join(lines)
    print(table)
    if args.record:
        with open("benchmarks/RESULTS.md", "a") as f:
            f.write(f"\n## bench_wgmma_promotion.py — {datetime.date.today()} — {torch.cuda.get_device_name()}, "
                    f"torch {torch.__version__}\n\n{table}\n")


if __name__ == "__main__":
    main()
