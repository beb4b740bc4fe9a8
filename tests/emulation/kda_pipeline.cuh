// CPU emulation of csrc/kda_pipeline.cuh (tests/test_pipeline_emulation.py), with the same names and arguments
// (csrc/kda_tile_ring.cuh compiles unchanged on top of it).
// Deliberately late where the hardware may be late, so that a kernel missing a wait reads or writes the wrong data:
// - a bulk copy reads its source at issue but lands in shared memory only when its mbarrier is next used (waited on
//   by any thread, or arrived at for its next phase), and its bytes count against the phase until then; so do the
//   cp.async pieces a thread hands to a barrier with cp_async_mbar_arrive;
// - a bulk store reads its shared-memory source only when its thread waits for its group (bulk_wait_read /
//   bulk_wait), so a staging tile written again before that wait reaches global memory with the new data;
// - a thread that ends with bulk stores still pending aborts (the hardware needs the wait before the CTA exits);
// - named barriers are real barriers of their thread count; id 0 (__syncthreads's) aborts.
// setmaxnreg and the proxy fences change no value here; the probe on the GPU covers them.
#pragma once

#include <condition_variable>
#include <cstdlib>
#include <map>
#include <vector>

#include "kda_common.cuh"

namespace kda::pipe {

struct EmuCopy {
  void* dst;
  std::vector<unsigned char> bytes;
};
struct EmuMbar {
  uint32_t count = 0, pending = 0;
  int64_t tx = 0;      // bytes expected and not landed
  uint32_t phase = 0;  // phases completed
  std::vector<EmuCopy> copies;
};
struct EmuPipeBlock {
  std::mutex mu;
  std::condition_variable cv;
  std::map<const void*, EmuMbar> mbar;
  std::map<int, std::unique_ptr<std::barrier<>>> named;
};
inline EmuPipeBlock& emu_pipe() {
  std::lock_guard<std::mutex> g(g_block->mu);
  if (!g_block->pipe) g_block->pipe = std::make_shared<EmuPipeBlock>();
  return *static_cast<EmuPipeBlock*>(g_block->pipe.get());
}
inline EmuMbar& emu_mbar(EmuPipeBlock& p, const uint64_t* bar) {
  auto it = p.mbar.find(bar);
  if (it == p.mbar.end()) std::abort();  // used before mbar_init
  return it->second;
}
// (p.mu held) once every arrival is in, the phase's copies issued so far land; the phase completes when no expected
// byte is missing (copies still to be issued keep it open)
inline void emu_settle(EmuPipeBlock& p, EmuMbar& m) {
  if (m.pending != 0) return;
  for (EmuCopy& c : m.copies) {
    std::memcpy(c.dst, c.bytes.data(), c.bytes.size());
    m.tx -= static_cast<int64_t>(c.bytes.size());
  }
  m.copies.clear();
  if (m.tx < 0) std::abort();  // more bytes landed than the phase expected
  if (m.tx > 0) return;
  ++m.phase;
  m.pending = m.count;
  p.cv.notify_all();
}
// one arrival, with `bytes` more expected of the phase and `copies` (cp.async pieces a thread hands over) to land with
// it, counted among those bytes
inline void emu_arrive(const uint64_t* bar, uint32_t bytes, std::vector<EmuCopy> copies = {}) {
  EmuPipeBlock& p = emu_pipe();
  std::lock_guard<std::mutex> g(p.mu);
  EmuMbar& m = emu_mbar(p, bar);
  if (m.pending == 0) {  // the previous phase, whose copies nobody has waited for yet
    emu_settle(p, m);
    if (m.pending == 0) std::abort();  // it still misses bytes: an arrival past the phase's count
  }
  m.tx += bytes;
  for (EmuCopy& c : copies) {
    m.tx += static_cast<int64_t>(c.bytes.size());
    m.copies.push_back(std::move(c));
  }
  --m.pending;
  p.cv.notify_all();  // a waiter for this phase settles it once the last arrival is in
}

inline void mbar_init(uint64_t* bar, uint32_t count) {
  EmuPipeBlock& p = emu_pipe();
  std::lock_guard<std::mutex> g(p.mu);
  EmuMbar m;
  m.count = m.pending = count;
  p.mbar[bar] = std::move(m);
  std::memset(bar, 0, 8);
}
inline void fence_mbarrier_init() {}
inline void mbar_arrive(uint64_t* bar) { emu_arrive(bar, 0); }
inline void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) { emu_arrive(bar, bytes); }
// this thread's cp.async pieces (committed or not) move to the barrier's phase and land with it, as bulk copies do
inline void cp_async_mbar_arrive(uint64_t* bar) {
  std::vector<EmuCopy> mine;
  auto take = [&](const std::vector<AsyncCopy>& g) {
    for (const AsyncCopy& c : g) mine.push_back({c.dst, std::vector<unsigned char>(c.bytes, c.bytes + 16)});
  };
  for (const auto& g : t_async.pending) take(g);
  take(t_async.open);
  t_async.pending.clear();
  t_async.open.clear();
  emu_arrive(bar, 0, std::move(mine));
}
inline void mbar_wait(uint64_t* bar, uint32_t parity) {
  EmuPipeBlock& p = emu_pipe();
  std::unique_lock<std::mutex> g(p.mu);
  for (;;) {
    EmuMbar& m = emu_mbar(p, bar);
    // the phase of parity `parity` is done once the current phase (m.phase) has the other parity
    if ((m.phase & 1u) != parity) return;
    emu_settle(p, m);
    if ((m.phase & 1u) != parity) return;
    p.cv.wait(g);
  }
}

inline void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  if (bytes % 16 || reinterpret_cast<uintptr_t>(dst) % 16 || reinterpret_cast<uintptr_t>(src) % 16) std::abort();
  EmuCopy c{dst, std::vector<unsigned char>(bytes)};
  std::memcpy(c.bytes.data(), src, bytes);
  EmuPipeBlock& p = emu_pipe();
  std::lock_guard<std::mutex> g(p.mu);
  emu_mbar(p, bar).copies.push_back(std::move(c));
  p.cv.notify_all();  // a waiter whose phase missed these bytes looks again
}

struct EmuStore {
  void* dst;
  const void* src;
  uint32_t bytes;
};
struct EmuBulkGroups {
  std::vector<EmuStore> open;
  std::vector<std::vector<EmuStore>> pending;  // committed, oldest first
  void wait(std::size_t keep) {
    while (pending.size() > keep) {
      for (const EmuStore& s : pending.front()) std::memcpy(s.dst, s.src, s.bytes);
      pending.erase(pending.begin());
    }
  }
  ~EmuBulkGroups() {
    if (!open.empty() || !pending.empty()) std::abort();  // the thread ended with bulk stores not waited for
  }
};
inline thread_local EmuBulkGroups t_bulk;
inline void bulk_store(void* dst, const void* src, uint32_t bytes) {
  if (bytes % 16 || reinterpret_cast<uintptr_t>(dst) % 16 || reinterpret_cast<uintptr_t>(src) % 16) std::abort();
  t_bulk.open.push_back({dst, src, bytes});
}
inline void bulk_commit() {
  t_bulk.pending.push_back(std::move(t_bulk.open));
  t_bulk.open.clear();
}
template <int N> inline void bulk_wait_read() { t_bulk.wait(N); }
template <int N> inline void bulk_wait() { t_bulk.wait(N); }
inline void fence_proxy_async() {}

inline std::barrier<>& emu_named(int id, int threads) {
  if (id < 1 || id > 15 || threads % 32) std::abort();
  EmuPipeBlock& p = emu_pipe();
  std::lock_guard<std::mutex> g(p.mu);
  auto& b = p.named[id];
  if (!b) b = std::make_unique<std::barrier<>>(threads);
  return *b;
}
inline void named_sync(int id, int threads) { emu_named(id, threads).arrive_and_wait(); }
inline void named_arrive(int id, int threads) { (void)emu_named(id, threads).arrive(); }

template <int R> inline void regs_release() { static_assert(R % 8 == 0 && R >= 24 && R <= 256, "setmaxnreg's range"); }
template <int R> inline void regs_claim() { static_assert(R % 8 == 0 && R >= 24 && R <= 256, "setmaxnreg's range"); }

}  // namespace kda::pipe
