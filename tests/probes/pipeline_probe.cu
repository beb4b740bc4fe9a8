// Probe of the pipeline pieces (csrc/kda_pipeline.cuh, csrc/kda_tile_ring.cuh), built by nvcc for the GPU
// (tests/gpu/test_pipeline_cuda.py) and by g++ against their emulation (tests/test_pipeline_emulation.py).
//
// Each CTA streams its tiles (blockIdx.x, + gridDim.x, ...) of 16 KiB through a ring of 4 slots: warpgroup 0 gives
// its registers back and one of its warps fills the slots by 32 row copies a tile; warpgroups 1 and 2 claim the
// registers, wait for a tile, write 2 x + t of their half into a staging tile, release the slot, and store the half
// by one bulk store behind named barriers of their own. Usage: pipeline_probe MODE GRID TILES; it prints
// "mode M: W of N values wrong". Modes 1 and 2 leave out one wait each (the consumers' wait for tile 1; the wait
// before a staging tile is written again): the emulation must then give wrong values (on the GPU they are races).
// Modes 3 and 4 fill the slots by 16-byte cp.async pieces from the producer warp's 32 lanes instead, each lane
// completing the slot's phase by cp.async.mbarrier.arrive (the reverse walk's producer); mode 4 leaves out the
// consumers' wait for tile 1.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kda_tile_ring.cuh"

using namespace kda::pipe;

constexpr int kSlots = 4;
constexpr int kTile = 4096;      // floats: 16 KiB
constexpr int kRow = 128;        // floats a bulk copy: one 512-byte row per producer lane
constexpr int kConsumers = 2;    // consumer warpgroups, each over half of every tile
constexpr int kHalf = kTile / kConsumers;
constexpr int kThreads = 128 * (1 + kConsumers);
static_assert(kRow * 32 == kTile, "one row per lane of the producer warp");

struct ProbeSmem {
  alignas(128) float slot[kSlots][kTile];
  alignas(128) float stage[kConsumers][kHalf];
  RingBarriers<kSlots> ring;
};
constexpr int kSmem = static_cast<int>(sizeof(ProbeSmem));

enum Mode { kCorrect = 0, kSkipWait = 1, kEarlyOverwrite = 2, kCpAsync = 3, kCpAsyncSkipWait = 4 };

struct ProbeArgs {
  const float* in;
  float* out;
  int tiles;
};

template <int MODE>
__global__ void __launch_bounds__(kThreads, 1) ring_probe(const ProbeArgs a) {
  extern __shared__ __align__(128) char smem[];
  ProbeSmem& s = *reinterpret_cast<ProbeSmem*>(smem);
  constexpr bool kByPieces = MODE == kCpAsync || MODE == kCpAsyncSkipWait;
  const int tid = threadIdx.x, wg = tid / 128, lane = tid & 31;
  if (tid == 0) {
    // every consumer thread releases every slot; the slot fills with one arrival (bulk) or one per producer lane
    s.ring.init(128 * kConsumers, kByPieces ? 32 : 1);
    fence_mbarrier_init();
  }
  __syncthreads();
  if (wg == 0) {
    regs_release<40>();
    if (tid < 32) {
      RingPos<kSlots> pos;
      for (int t = blockIdx.x; t < a.tiles; t += gridDim.x) {
        const float* src = a.in + static_cast<int64_t>(t) * kTile;
        if constexpr (kByPieces) {
          ring_acquire_cp_async(s.ring, pos);
          for (int p = lane; p < kTile / 4; p += 32) kda::cp_async16(s.slot[pos.slot] + 4 * p, src + 4 * p, true);
          ring_commit_cp_async(s.ring, pos);
        } else {
          if (lane == 0) ring_acquire(s.ring, pos, kTile * 4);
          __syncwarp();  // the slot's bytes are expected before any row lands
          bulk_load(s.slot[pos.slot] + kRow * lane, src + kRow * lane, kRow * 4, &s.ring.full[pos.slot]);
        }
        pos.advance();
      }
      if constexpr (kByPieces) kda::cp_async_wait_all();  // none of a thread's pieces may be left at its exit
    }
  } else {
    regs_claim<232>();
    const int c = wg - 1, ct = tid - 128 * wg;
    RingPos<kSlots> pos;
    int i = 0;
    for (int t = blockIdx.x; t < a.tiles; t += gridDim.x, ++i) {
      if (!((MODE == kSkipWait || MODE == kCpAsyncSkipWait) && i == 1)) ring_wait(s.ring, pos);
      const float* x = s.slot[pos.slot] + kHalf * c;
      for (int j = ct; j < kHalf; j += 128) s.stage[c][j] = 2.f * x[j] + static_cast<float>(t);
      // the slot's reads and the staging writes (ordinary accesses), then the next copy into the slot and the bulk
      // store's reads (the async proxy)
      fence_proxy_async();
      ring_release(s.ring, pos);
      pos.advance();
      named_sync(1 + c, 128);
      // the staging tile is free again once the store has read it: warp 0 (whose thread 0 stores) arrives at a
      // second barrier without waiting, the other warps wait there (a barrier of its own, so that warp 0's next
      // arrival, after the next tile's first barrier, cannot count towards this one)
      if (ct < 32) {
        if (ct == 0) {
          bulk_store(a.out + static_cast<int64_t>(t) * kTile + kHalf * c, s.stage[c], kHalf * 4);
          bulk_commit();
          if (MODE != kEarlyOverwrite) bulk_wait_read<0>();
        }
        __syncwarp();
        named_arrive(1 + kConsumers + c, 128);
      } else {
        named_sync(1 + kConsumers + c, 128);
      }
    }
    if (ct == 0) bulk_wait<0>();
  }
}

template <int MODE>
static int launch(int grid, const ProbeArgs& a) {
  if (cudaFuncSetAttribute(ring_probe<MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem) != cudaSuccess) return 1;
  ring_probe<MODE><<<grid, kThreads, kSmem, 0>>>(a);
  return cudaGetLastError() != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess;
}

int main(int argc, char** argv) {
  const int mode = argc > 1 ? std::atoi(argv[1]) : 0;
  const int grid = argc > 2 ? std::atoi(argv[2]) : 2;
  const int tiles = argc > 3 ? std::atoi(argv[3]) : 12;
  const size_t n = static_cast<size_t>(tiles) * kTile;
  std::vector<float> in(n), out(n);
  uint32_t r = 12345u;
  for (float& x : in) {  // multiples of 2^-12 in [-1, 1): 2 x + t is exact
    r = r * 1664525u + 1013904223u;
    x = static_cast<float>(static_cast<int>(r >> 19) - 4096) / 4096.f;
  }
  float *din = nullptr, *dout = nullptr;
  if (cudaMalloc(reinterpret_cast<void**>(&din), n * 4) != cudaSuccess ||
      cudaMalloc(reinterpret_cast<void**>(&dout), n * 4) != cudaSuccess) {
    std::printf("cudaMalloc failed\n");
    return 2;
  }
  cudaMemcpy(din, in.data(), n * 4, cudaMemcpyHostToDevice);
  cudaMemset(dout, 0, n * 4);
  const ProbeArgs a{din, dout, tiles};
  const int err = mode == kSkipWait           ? launch<kSkipWait>(grid, a)
                  : mode == kEarlyOverwrite   ? launch<kEarlyOverwrite>(grid, a)
                  : mode == kCpAsync          ? launch<kCpAsync>(grid, a)
                  : mode == kCpAsyncSkipWait ? launch<kCpAsyncSkipWait>(grid, a)
                                              : launch<kCorrect>(grid, a);
  if (err) {
    std::printf("launch failed: %s\n", cudaGetErrorString(cudaGetLastError()));
    return 2;
  }
  cudaMemcpy(out.data(), dout, n * 4, cudaMemcpyDeviceToHost);
  size_t wrong = 0;
  for (size_t e = 0; e < n; ++e) wrong += out[e] != 2.f * in[e] + static_cast<float>(e / kTile);
  std::printf("mode %d: %zu of %zu values wrong\n", mode, wrong, n);
  cudaFree(din);
  cudaFree(dout);
  return 0;
}
