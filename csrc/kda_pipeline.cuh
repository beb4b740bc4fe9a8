// The warp-specialization pieces of the v2 kernels (docs/kernels.md, Kernels v2: B2's structure): mbarriers with
// transaction counts, arrivals on cp.async completion, 1-D bulk copies from global into shared memory that complete
// on an mbarrier, bulk stores from shared memory back, named barriers over part of a CTA, and setmaxnreg.
// kda_tile_ring.cuh builds the tile ring on them.
//
// sm_90a and later (sm_100a, sm_103a have every instruction used here). tests/emulation/kda_pipeline.cuh is the CPU
// emulation of this header (a bulk copy lands only when its mbarrier is next used, a bulk store reads its source only
// at its wait), tests/probes/pipeline_probe.cu the probe kernel both run (tests/test_pipeline_emulation.py on the CPU,
// tests/gpu/test_pipeline_cuda.py on the GPU).
#pragma once

#include <cstdint>

#include "kda_common.cuh"

namespace kda::pipe {

// ---- mbarriers (a 64-bit word in shared memory: the phase, its pending arrivals and its transaction bytes) ----

// `count` arrivals complete a phase (with every expected byte landed). One thread initializes; the CTA then
// fences (fence_mbarrier_init) and synchronizes before any thread or copy uses the barrier.
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
// makes the initialized barriers visible to the async proxy (the bulk copies complete on them)
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// one arrival
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
// one arrival that also makes the phase wait for `bytes` more of bulk copies
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
// One arrival once every cp.async this thread has issued so far has landed (`.noinc`: the arrival is one of the
// phase's count): a producer that fills a slot by 16-byte cp.async pieces (layouts a 1-D bulk copy cannot write,
// such as the swizzled wgmma tiles) completes the slot's phase this way without waiting for its own copies.
__device__ __forceinline__ void cp_async_mbar_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_u32(bar)) : "memory");
}
// Waits until the phase of parity `parity` has completed (a fresh barrier is in phase 0, so waiting on parity 1
// returns at once: a ring's producer passes its first round of empty slots that way).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  const uint32_t addr = smem_u32(bar);
  uint32_t done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
  } while (!done);
}

// ---- bulk copies (the async proxy) ----

// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global memory into shared memory, completing as
// transaction bytes on `bar` (whose phase must expect them: mbar_arrive_expect_tx)
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_u32(dst)),
               "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}
// `bytes` (as bulk_load) from shared memory to global memory, in the thread's open bulk group
__device__ __forceinline__ void bulk_store(void* dst, const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(smem_u32(src)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// until at most N of the thread's committed bulk groups still read their shared-memory sources (a staging tile is
// free to be written again once its group is past this)
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
// until at most N of them are still writing (their global writes done)
template <int N>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}
// Orders this thread's ordinary shared-memory writes before later async-proxy accesses (a bulk store of a tile it
// wrote, a bulk copy into a slot it read): every writing thread fences, then the threads synchronize, then one issues.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// ---- named barriers: `threads` (a multiple of 32) of the CTA meet at barrier `id` (1-15; 0 is __syncthreads's) ----

__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// arrives without waiting (a producer signalling the threads that sync on the same id)
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// ---- setmaxnreg: a whole warpgroup gives registers back to the CTA's pool, or takes them (multiples of 8,
// 24-256; the kernel's launch bound sets what it starts with) ----

template <int R>
__device__ __forceinline__ void regs_release() {
  static_assert(R % 8 == 0 && R >= 24 && R <= 256, "setmaxnreg's range");
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(R));
}
template <int R>
__device__ __forceinline__ void regs_claim() {
  static_assert(R % 8 == 0 && R >= 24 && R <= 256, "setmaxnreg's range");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(R));
}

}  // namespace kda::pipe
