// Timing proxy of Kernels v2's producer / tile-ring layout (docs/kernels.md, B2's structure): a producer warpgroup
// streams 14 tiles of 16 KiB per item through a ring of mbarrier-guarded slots by 1-D bulk copies, three consumer
// warpgroups each run 7 dependent 64 x 128 x 128 wgmma products per item (A = the previous product's bf16 output,
// B = two fresh tiles), an epilogue into a working tile and a consumer-wide named barrier per product, and bulk-store
// the last two outputs (96 KiB per item). Operands are garbage: only time counts. One variant per build:
//   -DNO_MMA (no products), -DNO_LOAD (no copies), -DNSLOT=n (ring slots, 8), -DONE_COPY (one 16 KiB copy per
//   tile instead of 64 row copies of 256 B from one warp), -DNO_XBAR (a warpgroup barrier instead of the consumer-wide
//   one), -DMIX=1|4|9 (6 of the 14 tiles are 64 rows of one head of a [rows][16][128] bf16 tensor, 4 KiB apart, the
//   other 8 one copy each; the strided ones by row copies from 1 or 4 producer warps, or 9: two 3-D TMA boxes).
// Build and run (sm_90a; prints the SM time per item):
//   nvcc -O3 -std=c++20 -gencode arch=compute_90a,code=sm_90a -Icsrc -DMIX=4 -o /tmp/ring \
//       scripts/profiling/ring_proxy.cu && /tmp/ring 64
#include <cstdio>
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda.h>
#include "kda_common.cuh"
using namespace kda;
#ifndef NSLOT
#define NSLOT 8
#endif
constexpr int SLOT = 16384, NLOAD = 14, NPH = 7;
struct Smem {
  alignas(1024) char slot[NSLOT][SLOT];
  alignas(1024) char work[3][2][SLOT];
  uint64_t full[NSLOT], empty[NSLOT];
};
__device__ __forceinline__ void mb_init(uint64_t* b, int n) { asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(b)), "r"(n)); }
__device__ __forceinline__ void mb_arrive(uint64_t* b) { asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(b)) : "memory"); }
__device__ __forceinline__ void mb_expect(uint64_t* b, int tx) { asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(b)), "r"(tx) : "memory"); }
__device__ __forceinline__ void mb_wait(uint64_t* b, int parity) {
  asm volatile("{\n.reg .pred p;\nW: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra W;\n}\n" ::"r"(smem_u32(b)), "r"(parity) : "memory");
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, int bytes, uint64_t* b) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(b)) : "memory");
}
__device__ __forceinline__ void bulk_store(void* dst, const void* src, int bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(smem_u32(src)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
__device__ __forceinline__ void named_sync(int id, int n) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory"); }

#ifndef MIX
#define MIX 0
#endif
__device__ __forceinline__ bool strided_tile(int t) { return MIX && (t == 2 || t == 3 || t == 6 || t == 9 || t == 10 || t == 12); }
__device__ __forceinline__ int strided_index(int t) { return t == 2 ? 0 : t == 3 ? 1 : t == 6 ? 2 : t == 9 ? 3 : t == 10 ? 4 : 5; }
__device__ __forceinline__ void tma3d(void* dst, const CUtensorMap* map, int c0, int c1, int c2, uint64_t* b) {
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
               ::"r"(smem_u32(dst)), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(smem_u32(b)) : "memory");
}
__global__ void __launch_bounds__(512, 1) proxy(const char* __restrict__ in, char* __restrict__ out, int items,
                                                const char* __restrict__ rows, const __grid_constant__ CUtensorMap map) {
  extern __shared__ char raw[];
  Smem& s = *reinterpret_cast<Smem*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
  const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31;
  if (tid == 0) {
    for (int i = 0; i < NSLOT; ++i) mb_init(&s.full[i], 1), mb_init(&s.empty[i], 384);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (tid < (MIX == 4 ? 128 : 32)) {
      int c = 0;
      for (int it = blockIdx.x; it < items; it += gridDim.x)
        for (int t = 0; t < NLOAD; ++t, ++c) {
          const int sl = c % NSLOT, par = (c / NSLOT) & 1;
          mb_wait(&s.empty[sl], par ^ 1);
#ifdef NO_LOAD
          if (tid == 0) mb_arrive(&s.full[sl]);
#else
          if (tid == 0) mb_expect(&s.full[sl], SLOT);
          if (strided_tile(t)) {
            const int j = (it * 6 + strided_index(t)), head = j & 15, rb = j >> 4;
            if constexpr (MIX == 9) {
              if (tid == 0) {
                tma3d(s.slot[sl], &map, 0, head, 64 * rb, &s.full[sl]);
                tma3d(s.slot[sl] + 8192, &map, 64, head, 64 * rb, &s.full[sl]);
              }
            } else {
              const char* src = rows + (static_cast<int64_t>(64 * rb) * 16 + head) * 256;
              for (int r = tid; r < 64; r += (MIX == 4 ? 128 : 32))
                bulk_load(s.slot[sl] + 256 * r, src + static_cast<int64_t>(r) * 4096, 256, &s.full[sl]);
            }
          } else {
            const char* src = in + (static_cast<int64_t>(it) * NLOAD + t) * SLOT;
#if defined(ONE_COPY) || MIX
            if (tid == 0) bulk_load(s.slot[sl], src, SLOT, &s.full[sl]);
#else
            bulk_load(s.slot[sl] + 512 * lane, src + 512 * lane, 256, &s.full[sl]);
            bulk_load(s.slot[sl] + 512 * lane + 256, src + 512 * lane + 256, 256, &s.full[sl]);
#endif
          }
#endif
        }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 152;");
  const int wc = wg - 1, t = tid & 127;
  float acc[16][4];
  int c = 0, n = 0;
  for (int it = blockIdx.x; it < items; it += gridDim.x, ++n) {
    for (int k = 0; k < NPH; ++k, c += 2) {
      const int s0 = c % NSLOT, p0 = (c / NSLOT) & 1, s1 = (c + 1) % NSLOT, p1 = ((c + 1) / NSLOT) & 1;
      mb_wait(&s.full[s0], p0);
      mb_wait(&s.full[s1], p1);
      const char* A = k == 0 ? s.slot[s0] : s.work[wc][(k - 1) & 1];
#pragma unroll
      for (int i = 0; i < 16; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
#ifndef NO_MMA
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < 8; ++ks) {
        const uint64_t da = sw128_desc(A + 8192 * (ks >> 2)) + 2 * (ks & 3);
        const uint64_t db = sw128_desc((ks >> 2) ? s.slot[s1] : s.slot[s0]) + 2 * (ks & 3);
        wgmma_ss<16, false, false>(acc, da, db);
      }
      wgmma_commit();
      wgmma_wait0();
#endif
      mb_arrive(&s.empty[s0]);
      mb_arrive(&s.empty[s1]);
      char* dst = s.work[wc][k & 1];
      if (k <= 1 && n > 0) {  // the tile's previous bulk store must have read it
        if (t == 0) bulk_wait_read();
        named_sync(2 + wc, 128);
      }
      const int w = t >> 5;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const int r = 16 * w + (lane >> 2), cc = 8 * i + 2 * (lane & 3);
        *reinterpret_cast<uint32_t*>(dst + 2 * swh(r, cc)) = pack_bf16(acc[i][0], acc[i][1]);
        *reinterpret_cast<uint32_t*>(dst + 2 * swh(r + 8, cc)) = pack_bf16(acc[i][2], acc[i][3]);
      }
      fence_async_smem();
#ifndef NO_XBAR
      named_sync(1, 384);
#else
      named_sync(2 + wc, 128);
#endif
      if (k >= NPH - 2 && t == 0)
        bulk_store(out + ((static_cast<int64_t>(it) * 3 + wc) * 2 + (k & 1)) * SLOT, dst, SLOT);
    }
  }
  if (t == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

__global__ void fill(uint32_t* p, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = 0x3c003c00u ^ (uint32_t(i * 2654435761u) & 0x007f007fu);  // small bf16 values
}

int main(int argc, char** argv) {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const int per = argc > 1 ? atoi(argv[1]) : 64, items = sms * per;
  char *in, *out;
  const int64_t inb = int64_t(items) * NLOAD * SLOT, outb = int64_t(items) * 6 * SLOT;
  cudaMalloc(&in, inb); cudaMalloc(&out, outb);
  fill<<<1024, 256>>>(reinterpret_cast<uint32_t*>(in), inb / 4);
  // the strided tensor: [R rows][16 heads][128] bf16, R = 64 x ceil(6 items / 16)
  const int64_t R = 64 * ((int64_t(items) * 6 + 15) / 16), rowsb = R * 16 * 256;
  char* rows;
  cudaMalloc(&rows, rowsb);
  fill<<<1024, 256>>>(reinterpret_cast<uint32_t*>(rows), rowsb / 4);
  CUtensorMap map{};
  {
    cuuint64_t dims[3] = {128, 16, cuuint64_t(R)}, strides[2] = {256, 4096};
    cuuint32_t box[3] = {64, 1, 64}, estr[3] = {1, 1, 1};
    using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*, const cuuint64_t*,
                                const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) != cudaSuccess || !fn) {
      printf("no cuTensorMapEncodeTiled\n"); return 1;
    }
    CUresult r = reinterpret_cast<Encode>(fn)(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, rows, dims, strides, box, estr,
                                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) { printf("cuTensorMapEncodeTiled failed: %d\n", int(r)); return 1; }
  }
  const int smem = sizeof(Smem) + 1024;
  cudaFuncSetAttribute(proxy, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  for (int rep = 0; rep < 2; ++rep) proxy<<<sms, 512, smem>>>(in, out, items, rows, map);
  cudaEventRecord(a);
  for (int rep = 0; rep < 5; ++rep) proxy<<<sms, 512, smem>>>(in, out, items, rows, map);
  cudaEventRecord(b); cudaEventSynchronize(b);
  float ms; cudaEventElapsedTime(&ms, a, b); ms /= 5;
  cudaError_t e = cudaGetLastError();
  printf("%s slots=%d items=%d smem=%d: %.3f ms, %.2f us of an SM per item, %.2f TB/s moved, err=%s\n",
#if defined(NO_MMA)
         "no_mma",
#elif defined(NO_LOAD)
         "no_load",
#elif defined(ONE_COPY)
         "one_copy",
#elif defined(NO_XBAR)
         "no_xbar",
#elif MIX == 1
         "mix rows by 1 warp",
#elif MIX == 4
         "mix rows by 4 warps",
#elif MIX == 9
         "mix tma 3-d",
#else
         "full",
#endif
         NSLOT, items, smem, ms, ms * 1e3 * sms / items, (inb + outb) / (ms * 1e-3) / 1e12, cudaGetErrorString(e));
  return e != cudaSuccess;
}
