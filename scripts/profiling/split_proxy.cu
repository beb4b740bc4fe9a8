// Timing proxy of a gradient item split into two independent half-item CTAs (docs/kernels.md, Ideas measured and
// rejected). One item is NPH phases; in each, every warpgroup of the item runs its wgmma products (m64n128k16 from
// shared memory; one warpgroup per phase carries 1.5x, as v1's dKg), an epilogue of its 64 accumulators per thread
// (exp, bf16 pack, shared store) and a CTA-wide barrier. LOCK: the item's 4 warpgroups in one 16-warp CTA, one per
// SM (v1's gradient kernel); SPLIT: two independent 8-warp CTAs of 2 warpgroups per item, two per SM, the same work
// per warpgroup. No loads (operands are garbage in shared memory).
// Build and run (sm_90a; -DNPH=n phases, -DBASE=n products per warpgroup and phase):
//   nvcc -O3 -std=c++20 -gencode arch=compute_90a,code=sm_90a -Icsrc -o /tmp/split scripts/profiling/split_proxy.cu \
//       && /tmp/split 64
#include <cstdio>
#include <cstdint>
#include "kda_common.cuh"
using namespace kda;
#ifndef NPH
#define NPH 15
#endif
#ifndef BASE
#define BASE 2
#endif
template <int NWG>
__global__ void __launch_bounds__(NWG * 128, 4 / NWG) proxy(float* out, int units) {
  extern __shared__ char raw[];
  char* sm = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
  const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31, w = (tid >> 5) & 3;
  char* A = sm;                       // 16 KiB
  char* B = sm + 16384;               // 16 KiB
  char* E = sm + 32768 + 16384 * wg;  // this warpgroup's epilogue tile
  float acc[16][4];
  float keep = 0.f;
  for (int u = blockIdx.x; u < units; u += gridDim.x) {
    const int rank = NWG == 4 ? 0 : (u & 1);  // SPLIT: the item's half
    for (int j = 0; j < NPH; ++j) {
      const int gwg = NWG == 4 ? wg : 2 * rank + wg;  // the warpgroup's place in the item
      const int np = BASE + ((j & 3) == gwg ? BASE / 2 : 0);
#pragma unroll
      for (int i = 0; i < 16; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
      wgmma_fence();
      for (int ks = 0; ks < np; ++ks)
        wgmma_ss<16, false, false>(acc, sw128_desc(A + 8192 * (ks & 1)) + 2 * (ks & 3), sw128_desc(B) + 2 * (ks & 3));
      wgmma_commit();
      wgmma_wait0();
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const int r = 16 * w + (lane >> 2), cc = 8 * i + 2 * (lane & 3);
        const float x0 = fexp(acc[i][0] * 1e-3f), x1 = fexp(acc[i][1] * 1e-3f);
        const float x2 = fexp(acc[i][2] * 1e-3f), x3 = fexp(acc[i][3] * 1e-3f);
        *reinterpret_cast<uint32_t*>(E + 2 * swh(r, cc)) = pack_bf16(x0, x1);
        *reinterpret_cast<uint32_t*>(E + 2 * swh(r + 8, cc)) = pack_bf16(x2, x3);
        keep += x0 + x3;
      }
      fence_async_smem();
      __syncthreads();
      keep += __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(E)[(tid * 37 + j) & 8191]);
    }
  }
  if (keep == 12345.f) out[tid] = keep;  // keeps the work
}
__global__ void fill(uint32_t* p, int n) { for (int i = threadIdx.x; i < n; i += blockDim.x) p[i] = 0x3c003c00u; }
int main(int argc, char** argv) {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const int per = argc > 1 ? atoi(argv[1]) : 64, items = sms * per;
  float* out;
  cudaMalloc(&out, 4096 * 4);
  cudaEvent_t a, b;
  cudaEventCreate(&a); cudaEventCreate(&b);
  auto run = [&](auto kern, int threads, int smem, int grid, int units, const char* name) {
    cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    for (int r = 0; r < 2; ++r) kern<<<grid, threads, smem>>>(out, units);
    cudaEventRecord(a);
    for (int r = 0; r < 5; ++r) kern<<<grid, threads, smem>>>(out, units);
    cudaEventRecord(b); cudaEventSynchronize(b);
    float ms; cudaEventElapsedTime(&ms, a, b); ms /= 5;
    printf("%-6s NPH=%d BASE=%d items=%d: %.3f ms, %.2f us of an SM per item, err=%s\n", name, NPH, BASE, items, ms,
           ms * 1e3 * sms / items, cudaGetErrorString(cudaGetLastError()));
  };
  run(proxy<4>, 512, 200 * 1024, sms, items, "LOCK");
  run(proxy<2>, 256, 100 * 1024, 2 * sms, 2 * items, "SPLIT");
  return 0;
}
