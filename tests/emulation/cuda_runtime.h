// CPU emulation of the CUDA runtime pieces the kernels in csrc/ use (tests/test_kernel_emulation.py):
// one OS thread per CUDA thread, a barrier per block (__syncthreads) and per warp (shuffles, ldmatrix,
// mma), blocks run one after another over a 256 KiB shared-memory buffer filled with garbage first.
// A launch past the grid's bounds runs nothing and leaves cudaErrorInvalidConfiguration for cudaGetLastError, as
// on the GPU; gridDim.y's bound is CUDA's 65,535 unless -DKDA_EMU_MAX_GRID_Y=n makes it n (the emulated
// kda_common.cuh's kMaxGridY follows it), so that a test reaches the kernels' paths past it with a few blocks
// (tests/test_kernel_grids.py: 2).
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstddef>
#include <cmath>
#include <cstring>
#include <cstdlib>
#include <barrier>
#include <thread>
#include <vector>
#include <memory>
#include <mutex>
typedef int cudaError_t;
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
struct uint2 { uint32_t x, y; };
struct uint4 { uint32_t x, y, z, w; };
inline float2 make_float2(float a, float b) { return {a, b}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
struct int2 { int x, y; };
inline int2 make_int2(int a, int b) { return {a, b}; }
inline uint2 make_uint2(uint32_t a, uint32_t b) { return {a, b}; }
inline uint4 make_uint4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) { return {a, b, c, d}; }
// loads and stores with cache hints: plain accesses here (the hints change no value)
template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline void __stcs(T* p, T v) { *p = v; }
typedef void* cudaStream_t;
constexpr int cudaSuccess = 0;
constexpr int cudaErrorInvalidValue = 1;
constexpr int cudaErrorInvalidConfiguration = 9;
#ifndef KDA_EMU_MAX_GRID_Y
#define KDA_EMU_MAX_GRID_Y 65535
#endif
constexpr unsigned kEmuMaxGridX = 0x7fffffffu, kEmuMaxGridY = KDA_EMU_MAX_GRID_Y, kEmuMaxGridZ = 65535;
constexpr int cudaFuncAttributeMaxDynamicSharedMemorySize = 0;
constexpr int cudaFuncAttributePreferredSharedMemoryCarveout = 1;
constexpr int cudaSharedmemCarveoutMaxShared = 100;
inline const char* cudaGetErrorString(int) { return "emu"; }
// the probes' host code (tests/probes): device memory is host memory here, launches are synchronous
constexpr int cudaMemcpyHostToDevice = 1, cudaMemcpyDeviceToHost = 2;
inline int cudaMalloc(void** p, std::size_t n) { *p = std::malloc(n); return *p ? cudaSuccess : cudaErrorInvalidValue; }
inline int cudaFree(void* p) { std::free(p); return cudaSuccess; }
inline int cudaMemcpy(void* d, const void* s, std::size_t n, int) { std::memcpy(d, s, n); return cudaSuccess; }
inline int cudaMemset(void* d, int v, std::size_t n) { std::memset(d, v, n); return cudaSuccess; }
inline int cudaDeviceSynchronize() { return cudaSuccess; }
inline int g_last_error = 0;  // the latest launch error, cleared by cudaGetLastError
inline int cudaGetLastError() { const int e = g_last_error; g_last_error = 0; return e; }
template <class K> inline int cudaFuncSetAttribute(K, int, int) { return 0; }
struct dim3 { unsigned x, y, z; dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {} };
struct uint3e { unsigned x, y, z; };
inline thread_local uint3e threadIdx, blockIdx, gridDim;
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __shared__ static
#define __constant__ static
[[noreturn]] inline void __trap() { std::abort(); }

// ---- block / warp context ----
struct WarpCtx {
  std::barrier<> bar{32};
  uint32_t u[32][8];
  const void* addr[32];
  float f[32];
};
struct BlockCtx {
  std::unique_ptr<std::barrier<>> bar;
  std::vector<std::unique_ptr<WarpCtx>> warps;
  std::atomic<int> vote[3] = {0, 0, 0};  // __syncthreads_or: call n votes into slot n % 3
  std::mutex mu;                          // guards `pipe`
  std::shared_ptr<void> pipe;             // the emulated pipeline pieces' state (kda_pipeline.cuh), made on first use
};
inline BlockCtx* g_block = nullptr;
inline thread_local WarpCtx* t_warp = nullptr;
inline thread_local int t_lane = 0;
alignas(1024) inline char g_smem[256 * 1024];
inline void __syncthreads() { g_block->bar->arrive_and_wait(); }
inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline thread_local int t_votes = 0;  // this thread's __syncthreads_or calls so far (threads are made per block)
// Slot n % 3 of call n: thread 0 clears the next call's slot before the barrier (its readers, two calls back, are past
// the previous barrier; its writers come after this one).
inline int __syncthreads_or(int pred) {
  const int n = t_votes++;
  if (threadIdx.x == 0) g_block->vote[(n + 1) % 3].store(0);
  if (pred) g_block->vote[n % 3].store(1);
  g_block->bar->arrive_and_wait();
  return g_block->vote[n % 3].load();
}
inline void __syncwarp() { t_warp->bar.arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int m) {
  WarpCtx* w = t_warp;
  w->f[t_lane] = v;
  w->bar.arrive_and_wait();
  float r = w->f[t_lane ^ m];
  w->bar.arrive_and_wait();
  return r;
}
inline float __shfl_sync(unsigned, float v, int src) {
  WarpCtx* w = t_warp;
  w->f[t_lane] = v;
  w->bar.arrive_and_wait();
  float r = w->f[src & 31];
  w->bar.arrive_and_wait();
  return r;
}
inline bool __any_sync(unsigned, bool pred) {
  WarpCtx* w = t_warp;
  w->f[t_lane] = pred ? 1.f : 0.f;
  w->bar.arrive_and_wait();
  bool any = false;
  for (int l = 0; l < 32; ++l) any = any || w->f[l] != 0.f;
  w->bar.arrive_and_wait();
  return any;
}
// the OR of the warp's values (WarpCtx::u[lane][7]: no mma of the same warp is in flight between these barriers)
inline unsigned __reduce_or_sync(unsigned, unsigned v) {
  WarpCtx* w = t_warp;
  w->u[t_lane][7] = v;
  w->bar.arrive_and_wait();
  unsigned r = 0;
  for (int l = 0; l < 32; ++l) r |= w->u[l][7];
  w->bar.arrive_and_wait();
  return r;
}
// the threads of a block run at once (OS threads): a real atomic
inline int atomicOr(int* p, int v) { return std::atomic_ref<int>(*p).fetch_or(v); }
// per 16-bit half: the larger unsigned value
inline unsigned __vmaxu2(unsigned a, unsigned b) {
  const unsigned lo = std::max(a & 0xffffu, b & 0xffffu), hi = std::max(a >> 16, b >> 16);
  return lo | (hi << 16);
}
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
template <class K, class A>
inline void emu_launch(K kern, dim3 grid, int threads, int, cudaStream_t, const A& a) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > kEmuMaxGridX || grid.y > kEmuMaxGridY ||
      grid.z > kEmuMaxGridZ || threads < 1 || threads > 1024) {
    g_last_error = cudaErrorInvalidConfiguration;
    return;
  }
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        BlockCtx b;
        b.bar = std::make_unique<std::barrier<>>(threads);
        for (int w = 0; w < threads / 32; ++w) b.warps.push_back(std::make_unique<WarpCtx>());
        g_block = &b;
        std::memset(g_smem, 0xCD, sizeof(g_smem));  // garbage, like real shared memory
        std::vector<std::thread> ts;
        for (int t = 0; t < threads; ++t)
          ts.emplace_back([&, t] {
            threadIdx = {unsigned(t), 0, 0};
            blockIdx = {x, y, z};
            gridDim = {grid.x, grid.y, grid.z};
            t_warp = b.warps[t / 32].get();
            t_lane = t % 32;
            kern(a);
          });
        for (auto& th : ts) th.join();
      }
}
