// The tile ring of the v2 kernels (docs/kernels.md, B2's structure) on the pieces of kda_pipeline.cuh: SLOTS slots of
// shared memory that a producer fills (by bulk copies, or by cp.async pieces) in a fixed order of tiles and consumer
// threads release once read. The same source runs in the CPU emulation (tests/emulation/kda_pipeline.cuh stands for
// the pieces).
#pragma once

#include <cstdint>

#include "kda_pipeline.cuh"

namespace kda::pipe {

// A `full` barrier per slot (one producer arrival plus the slot's bytes, or one arrival per producer thread that fills
// the slot by cp.async) and an `empty` one (one arrival per consumer thread that reads the slot: an arrival releases
// only its own thread's reads, so every reader arrives). Producer and consumers walk the same fixed order of tiles,
// each with its own RingPos.
template <int SLOTS>
struct RingBarriers {
  uint64_t full[SLOTS];
  uint64_t empty[SLOTS];
  // by one thread, then fence_mbarrier_init and a CTA-wide barrier
  __device__ __forceinline__ void init(uint32_t consumer_threads, uint32_t producer_threads = 1) {
    for (int s = 0; s < SLOTS; ++s) {
      mbar_init(&full[s], producer_threads);
      mbar_init(&empty[s], consumer_threads);
    }
  }
};

// the slot of the next tile and the parity of its round (round r uses parity r & 1)
template <int SLOTS>
struct RingPos {
  int slot = 0;
  uint32_t parity = 0;
  __device__ __forceinline__ void advance() {
    if (++slot == SLOTS) slot = 0, parity ^= 1u;
  }
};

// Producer: waits until the consumers have released the slot (the first round passes), then expects `bytes` on its
// full barrier; the caller issues bulk_load(..., &rb.full[pos.slot]) for exactly those bytes and advances.
template <int SLOTS>
__device__ __forceinline__ void ring_acquire(RingBarriers<SLOTS>& rb, const RingPos<SLOTS>& pos, uint32_t bytes) {
  mbar_wait(&rb.empty[pos.slot], pos.parity ^ 1u);
  mbar_arrive_expect_tx(&rb.full[pos.slot], bytes);
}
// Producer thread filling the slot by cp.async (every thread of the producer): waits until the consumers have released
// it, issues its pieces, then ring_commit_cp_async; the slot's phase completes when every producer thread's pieces
// have landed.
template <int SLOTS>
__device__ __forceinline__ void ring_acquire_cp_async(RingBarriers<SLOTS>& rb, const RingPos<SLOTS>& pos) {
  mbar_wait(&rb.empty[pos.slot], pos.parity ^ 1u);
}
template <int SLOTS>
__device__ __forceinline__ void ring_commit_cp_async(RingBarriers<SLOTS>& rb, const RingPos<SLOTS>& pos) {
  cp_async_mbar_arrive(&rb.full[pos.slot]);
}
// Consumer: waits until the slot's tile has landed
template <int SLOTS>
__device__ __forceinline__ void ring_wait(RingBarriers<SLOTS>& rb, const RingPos<SLOTS>& pos) {
  mbar_wait(&rb.full[pos.slot], pos.parity);
}
// Consumer thread, after its last read of the slot: the slot may be refilled once every reader has released it
template <int SLOTS>
__device__ __forceinline__ void ring_release(RingBarriers<SLOTS>& rb, const RingPos<SLOTS>& pos) {
  mbar_arrive(&rb.empty[pos.slot]);
}

}  // namespace kda::pipe
