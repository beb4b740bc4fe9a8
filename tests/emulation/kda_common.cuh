// CPU emulation of csrc/kda_common.cuh: the same helpers with the PTX semantics of ldmatrix (x4, .trans),
// mma.m16n8k16 (bf16 or fp16 in, FP32 accumulators; the products summed in FP64, so not bitwise the GPU) and
// cp.async (deferred to its wait, below). The kernels themselves are compiled from csrc unchanged.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>
namespace kda {
constexpr float kLog2e = 1.4426950408889634f;
constexpr int kMaxGridY = kEmuMaxGridY;  // the emulated device's bound (cuda_runtime.h)
inline float fexp(float x) { return std::exp2(x * kLog2e); }
inline float fexp_ftz(float x) { const float y = std::exp2(x * kLog2e); return y < 1.17549435e-38f ? 0.f : y; }
inline float fex2_ftz(float x) { const float y = std::exp2(x); return y < 1.17549435e-38f ? 0.f : y; }
inline float frcp(float x) { return 1.f / x; }
inline int sw128(int r, int c) { return r * 128 + ((((c >> 3) ^ (r & 7))) << 3) + (c & 7); }
inline int sw64(int r, int c) { return r * 64 + ((((c >> 3) ^ (r & 7))) << 3) + (c & 7); }
inline uint16_t b16at(const void* p, int i) { return static_cast<const uint16_t*>(p)[i]; }
inline uint32_t pk(uint16_t lo, uint16_t hi) { return uint32_t(lo) | (uint32_t(hi) << 16); }
template <bool TRANS>
inline void ldsm(uint32_t (&r)[4], const void* p) {
  WarpCtx* w = t_warp;
  const int l = t_lane;
  w->addr[l] = p;
  w->bar.arrive_and_wait();
  for (int j = 0; j < 4; ++j) {
    if (!TRANS) {
      const void* row = w->addr[j * 8 + l / 4];
      r[j] = pk(b16at(row, 2 * (l % 4)), b16at(row, 2 * (l % 4) + 1));
    } else {
      const void* r0 = w->addr[j * 8 + 2 * (l % 4)];
      const void* r1 = w->addr[j * 8 + 2 * (l % 4) + 1];
      r[j] = pk(b16at(r0, l / 4), b16at(r1, l / 4));
    }
  }
  w->bar.arrive_and_wait();
}
inline void ldsm4(uint32_t (&r)[4], const void* p) { ldsm<false>(r, p); }
inline void ldsm4t(uint32_t (&r)[4], const void* p) { ldsm<true>(r, p); }
inline float bf(uint32_t v, int hi) { __nv_bfloat16 b{uint16_t(hi ? v >> 16 : v & 0xffff)}; return __bfloat162float(b); }
inline float hf(uint32_t v, int hi) { return f16_bits_to_f32(uint16_t(hi ? v >> 16 : v & 0xffff)); }
// the 16-bit element e of a 32-bit operand word: bf16, or fp16 when F16
template <bool F16> inline float elem(uint32_t v, int e) { return F16 ? hf(v, e) : bf(v, e); }
// The warp's 16 x 16 A operand from its lanes' fragments (w->u[lane][0..3], the m16n8k16 A layout).
template <bool F16 = false>
inline void gather_a(const WarpCtx* w, float (&A)[16][16]) {
  for (int L = 0; L < 32; ++L) {
    const int g = L >> 2, t = L & 3;
    const uint32_t* u = w->u[L];
    for (int e = 0; e < 2; ++e) {
      A[g][2 * t + e] = elem<F16>(u[0], e);
      A[g + 8][2 * t + e] = elem<F16>(u[1], e);
      A[g][2 * t + 8 + e] = elem<F16>(u[2], e);
      A[g + 8][2 * t + 8 + e] = elem<F16>(u[3], e);
    }
  }
}
// An mma's operands through the warp context: every lane posts its A words and its B pair, then all lanes read
// every lane's (gather); mma_acc's barrier then frees the context for the next mma.
inline void post_frags(const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  WarpCtx* w = t_warp;
  const int l = t_lane;
  for (int i = 0; i < 4; ++i) w->u[l][i] = a[i];
  w->u[l][4] = b0;
  w->u[l][5] = b1;
  w->bar.arrive_and_wait();
}
// d += A B at this lane's m16n8 accumulator elements, the K products summed in FP64 and rounded once
template <int K>
inline void mma_acc(float (&d)[4], const float (&A)[16][K], const float (&B)[K][8]) {
  t_warp->bar.arrive_and_wait();
  const int g = t_lane >> 2, t = t_lane & 3;
  for (int e = 0; e < 4; ++e) {
    const int row = g + 8 * (e >> 1), col = 2 * t + (e & 1);
    double s = d[e];
    for (int k = 0; k < K; ++k) s += double(A[row][k]) * double(B[k][col]);
    d[e] = float(s);
  }
}
template <bool F16 = false>
inline void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  post_frags(a, b0, b1);
  WarpCtx* w = t_warp;
  float A[16][16], B[16][8];
  gather_a<F16>(w, A);
  for (int L = 0; L < 32; ++L) {
    const int g = L >> 2, t = L & 3;
    for (int e = 0; e < 2; ++e) {
      B[2 * t + e][g] = elem<F16>(w->u[L][4], e);
      B[2 * t + 8 + e][g] = elem<F16>(w->u[L][5], e);
    }
  }
  mma_acc(d, A, B);
}
// cvt.rna.tf32.f32 on finite values: the magnitude rounded to 10 mantissa bits, ties away from zero
inline uint32_t to_tf32(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return (u + 0x1000u) & 0xffffe000u;
}
inline float tf32_value(uint32_t u) { float x; std::memcpy(&x, &u, 4); return x; }
inline void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
  hi = to_tf32(x);
  lo = to_tf32(x - tf32_value(hi));
}
inline void split_tf32_trunc(float x, uint32_t& hi, uint32_t& lo) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  hi = u & 0xffffe000u;
  const float r = x - tf32_value(hi);
  std::memcpy(&u, &r, 4);
  lo = u & 0xffffe000u;
}
// mma.m16n8k8 tf32 (the m16n8k8 fragment layouts; products summed in FP64 onto the FP32 accumulator)
inline void mma_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  post_frags(a, b0, b1);
  WarpCtx* w = t_warp;
  float A[16][8], B[8][8];
  for (int L = 0; L < 32; ++L) {
    const int g = L >> 2, t = L & 3;
    A[g][t] = tf32_value(w->u[L][0]);
    A[g + 8][t] = tf32_value(w->u[L][1]);
    A[g][t + 4] = tf32_value(w->u[L][2]);
    A[g + 8][t + 4] = tf32_value(w->u[L][3]);
    B[t][g] = tf32_value(w->u[L][4]);
    B[t + 4][g] = tf32_value(w->u[L][5]);
  }
  mma_acc(d, A, B);
}
inline uint32_t pack_bf16(float lo, float hi) { return pk(__float2bfloat16_rn(lo).x, __float2bfloat16_rn(hi).x); }
inline float2 bf2_to_f2(uint32_t w) { return make_float2(bf(w, 0), bf(w, 1)); }
// the products of two bf16 are exact in FP32, so one rounding to bf16 is the hardware's
inline uint32_t bf16x2_mul(uint32_t a, uint32_t b) { return pack_bf16(bf(a, 0) * bf(b, 0), bf(a, 1) * bf(b, 1)); }
inline uint32_t pack_f16(float x, float y) { return pk(f32_to_f16_bits(x), f32_to_f16_bits(y)); }
inline float f16_to_f32(uint16_t b) { return f16_bits_to_f32(b); }
inline uint32_t bf16x2_to_f16x2(uint32_t w, float sc) { return pack_f16(bf(w, 0) * sc, bf(w, 1) * sc); }
inline float warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = std::fmax(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
inline float operand_scale(float m) {
  uint32_t u; std::memcpy(&u, &m, 4);
  const int e = static_cast<int>((u >> 23) & 0xff) - 127;
  const int k = std::min(std::max(5 - e, -126), 127);
  const uint32_t r = static_cast<uint32_t>(k + 127) << 23;
  float out; std::memcpy(&out, &r, 4);
  return out;
}
inline void split2_f16(float x, float y, uint32_t& hi, uint32_t& lo) {
  hi = pack_f16(x, y);
  lo = pack_f16(x - hf(hi, 0), y - hf(hi, 1));
}
inline void afrag_f16(const float (&t0)[4], const float (&t1)[4], uint32_t (&a)[4]) {
  a[0] = pack_f16(t0[0], t0[1]);
  a[1] = pack_f16(t0[2], t0[3]);
  a[2] = pack_f16(t1[0], t1[1]);
  a[3] = pack_f16(t1[2], t1[3]);
}
inline void split2(float x, float y, uint32_t& hi, uint32_t& lo) {
  __nv_bfloat16 hx = __float2bfloat16_rn(x), hy = __float2bfloat16_rn(y);
  hi = pk(hx.x, hy.x);
  lo = pack_bf16(x - __bfloat162float(hx), y - __bfloat162float(hy));
}
inline int swh(int r, int c) { return ((c >> 6) << 12) + sw64(r, c & 63); }
constexpr int kRowsSwh = 0;  // csrc's row-length code of a swh tile
template <int RL> inline int swz(int r, int c) {
  if constexpr (RL == kRowsSwh) return swh(r, c);
  else if constexpr (RL == 128) return sw128(r, c);
  else return sw64(r, c);
}
// csrc's frag_ptr (the lane part XOR 2 c0, plus the row part), checked on every load against the plain
// swizzle of the full indices: a caller whose block corner breaks its preconditions aborts the emulation.
template <int RL, class T> inline const T* frag_ptr(const T* t, int r0, int c0, int rl, int ch) {
  if constexpr (RL == kRowsSwh) return frag_ptr<64>(t + ((c0 >> 6) << 12), r0, c0 & 63, rl, ch);
  const int lane_part = rl * (2 * RL) + ((ch ^ (rl & 7)) << 4);
  const char* p = reinterpret_cast<const char*>(t) + ((lane_part ^ (2 * c0)) + r0 * (2 * RL));
  if (p != reinterpret_cast<const char*>(t + swz<RL>(r0 + rl, c0 + 8 * ch))) {
    std::fprintf(stderr, "frag_ptr<%d>: corner (%d, %d) breaks its preconditions\n", RL, r0, c0);
    std::abort();
  }
  return reinterpret_cast<const T*>(p);
}
template <int RL, class T> inline void lda(uint32_t (&a)[4], const T* t, int m0, int k0, int lane) {
  ldsm4(a, frag_ptr<RL>(t, m0, k0, lane & 15, lane >> 4));
}
template <int RL, class T> inline void lda_t(uint32_t (&a)[4], const T* t, int m0, int k0, int lane) {
  ldsm4t(a, frag_ptr<RL>(t, k0, m0, (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1));
}
template <int RL, class T> inline void ldb(uint32_t (&b)[4], const T* t, int k0, int n0, int lane) {
  ldsm4(b, frag_ptr<RL>(t, n0, k0, (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1));
}
template <int RL, class T> inline void ldb_t(uint32_t (&b)[4], const T* t, int k0, int n0, int lane) {
  ldsm4t(b, frag_ptr<RL>(t, k0, n0, (lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4));
}
inline void st_global_pinned(void* p, uint32_t x) { std::memcpy(p, &x, 4); }
template <int OFF> inline void st_global_pinned_at(void* p, uint32_t x) { std::memcpy(static_cast<char*>(p) + OFF, &x, 4); }
template <class F, int... I> inline void static_for_seq(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>()), ...);
}
template <int N, class F> inline void static_for(F&& f) { static_for_seq(f, std::make_integer_sequence<int, N>()); }
inline void prefetch_l2(const void*) {}
inline unsigned sm_count() { return 132; }
inline int2 ld_global_pinned_int2(const int32_t* p) { return make_int2(p[0], p[1]); }
// cp.async with its ordering: a copy lands only when its thread waits for its group (wait_group N leaves the
// N newest committed groups in flight, wait_all lands everything, uncommitted copies included), so a kernel
// that reads a tile before waiting for it reads stale shared memory here too. The source is read at issue.
// With KDA_EMU_CP_ASYNC_EAGER a copy also lands at its issue (and again at its wait): a kernel that requests
// into a tile other threads still read then reads the new data too early.
struct AsyncCopy { void* dst; unsigned char bytes[16]; };
struct AsyncGroups {
  std::vector<AsyncCopy> open;                  // issued, not yet committed
  std::vector<std::vector<AsyncCopy>> pending;  // committed, oldest first
  static void land(const std::vector<AsyncCopy>& g) { for (const AsyncCopy& c : g) std::memcpy(c.dst, c.bytes, 16); }
  void wait(std::size_t keep) {
    while (pending.size() > keep) { land(pending.front()); pending.erase(pending.begin()); }
  }
};
inline thread_local AsyncGroups t_async;
inline int thread_index() { return static_cast<int>(threadIdx.x); }
inline void cp_async16(void* dst, const void* src, bool valid) {
  AsyncCopy c{dst, {}};
  if (valid) std::memcpy(c.bytes, src, 16);
#ifdef KDA_EMU_CP_ASYNC_EAGER
  // the other extreme: every copy lands at its issue, so a request into a tile that is still read fails
  std::memcpy(dst, c.bytes, 16);
#endif
  t_async.open.push_back(c);
}
template <int DOFF, int SOFF> inline void cp_async16_at(void* dst, const void* src, bool valid) {
  cp_async16(static_cast<char*>(dst) + DOFF, static_cast<const char*>(src) + SOFF, valid);
}
inline void cp_async_commit() { t_async.pending.push_back(std::move(t_async.open)); t_async.open.clear(); }
inline void cp_async_wait_all() { cp_async_commit(); t_async.wait(0); }
template <bool F16 = false>
inline void mma_n16(float (&d0)[4], float (&d1)[4], const uint32_t (&a)[4], const uint32_t (&b)[4]) {
  mma<F16>(d0, a, b[0], b[1]);
  mma<F16>(d1, a, b[2], b[3]);
}
template <int N> inline void zero_frags(float (&t)[N][4]) { for (int n = 0; n < N; ++n) for (int e = 0; e < 4; ++e) t[n][e] = 0.f; }
template <bool F16 = false>
inline void split_afrag(const float (&t0)[4], const float (&t1)[4], uint32_t (&hi)[4], uint32_t (&lo)[4]) {
  for (int i = 0; i < 4; ++i) {  // register i: elements 2 (i & 1), + 1 of tile i >> 1
    const float* x = (i < 2 ? t0 : t1) + 2 * (i & 1);
    if constexpr (F16) split2_f16(x[0], x[1], hi[i], lo[i]);
    else split2(x[0], x[1], hi[i], lo[i]);
  }
}
inline void negate_split(uint32_t (&hi)[4], uint32_t (&lo)[4]) { for (int e = 0; e < 4; ++e) { hi[e] ^= 0x80008000u; lo[e] ^= 0x80008000u; } }
inline void cp_async_wait1() { t_async.wait(1); }
// ---- wgmma: each warp's 16 rows of the warpgroup's 64 x N product are independent of the other warps'
// (A from the warp's own registers, B shared), so a warp computes its part alone. B is read through the
// descriptor as the hardware reads it: start address, 8-row groups SBO bytes apart, rows 128 bytes apart,
// (MN-major: 64-column halves of N LBO bytes apart), then the 128-byte swizzle applied to the address bits
// (bits 4-6 XOR bits 7-9). A descriptor this code does not model (another layout or group stride, a start
// outside the first row of a 1024-byte group) aborts.
// The emulation runs it synchronously: a missing fence or wait is not caught here.
#ifndef KDA_HAS_WGMMA  // -DKDA_HAS_WGMMA=0: the kernels' mma.sync paths (sm_100a / sm_103a), tests/test_kernel_emulation.py
#define KDA_HAS_WGMMA 1
#endif
inline uint32_t smem_u32(const void* p) { return uint32_t(static_cast<const char*>(p) - g_smem); }
inline uint64_t sw128_desc(const void* tile, uint32_t lbo = 16) {
  return uint64_t((smem_u32(tile) & 0x3FFFF) >> 4) | (uint64_t(lbo >> 4) << 16) | (uint64_t(1024 >> 4) << 32) |
         (uint64_t(1) << 62);
}
inline void fence_reg(float&) {}
inline void fence_reg(uint32_t&) {}
template <int N, class T> inline void fence_frags(T (&)[N][4]) {}
inline void fence_async_smem() {}
inline void wgmma_fence() {}
inline void wgmma_commit() {}
inline void wgmma_wait0() {}
// A shared-memory operand through its descriptor, decoded once: at(mn, k, n) is B(k, n) (or A(m = n, k)), element
// (row, col) of the stored tile, where a K-major tile's rows are N (M) and an MN-major tile's rows are K (its
// 64-column halves LBO bytes apart)
struct Desc {
  uint32_t start, sbo, lbo;
  explicit Desc(uint64_t desc)
      : start(uint32_t(desc & 0x3FFF) << 4), sbo(uint32_t((desc >> 32) & 0x3FFF) << 4),
        lbo(uint32_t((desc >> 16) & 0x3FFF) << 4) {
    if ((desc >> 62) != 1 || sbo != 1024 || (start & 0x380) != 0) {
      std::fprintf(stderr, "wgmma: descriptor %llx not modelled\n", static_cast<unsigned long long>(desc));
      std::abort();
    }
  }
  template <bool F16 = false>
  float at(bool mn, int k, int n) const {
    uint32_t addr = mn ? start + uint32_t(n >> 6) * lbo + uint32_t(k >> 3) * sbo + uint32_t(k & 7) * 128 + 2 * (n & 63)
                       : start + uint32_t(n >> 3) * sbo + uint32_t(n & 7) * 128 + 2 * k;
    addr ^= ((addr >> 7) & 7) << 4;
    return elem<F16>(b16at(g_smem, addr / 2), 0);
  }
};
template <int N8, bool MN, bool F16>
inline void wgmma_rs(float (&d)[N8][4], const uint32_t (&a)[4], uint64_t desc) {
  const Desc db(desc);
  WarpCtx* w = t_warp;
  const int l = t_lane;
  for (int i = 0; i < 4; ++i) w->u[l][i] = a[i];
  w->bar.arrive_and_wait();
  float A[16][16];
  gather_a<F16>(w, A);
  w->bar.arrive_and_wait();
  const int g = l >> 2, t = l & 3;
  for (int n8 = 0; n8 < N8; ++n8)
    for (int e = 0; e < 4; ++e) {
      const int row = g + 8 * (e >> 1), col = n8 * 8 + 2 * t + (e & 1);
      double s = d[n8][e];
      for (int k = 0; k < 16; ++k) s += double(A[row][k]) * double(db.at<F16>(MN, k, col));
      d[n8][e] = float(s);
    }
}
// Both operands from shared memory (bf16): this warp's 16 rows of A are rows 16 (warp % 4) .. of the group's 64.
// An MN-major start may lie inside the first row of a 1024-byte group (an N or M offset of 16-byte multiples): the
// swizzle is on the address bits, so it is the same tile read from a later column (an H200 probe agrees:
// docs/kernels.md).
template <int N8, bool TA, bool TB>
inline void wgmma_ss(float (&d)[N8][4], uint64_t da, uint64_t db) {
  const Desc a(da), b(db);
  const int l = t_lane, m0 = 16 * ((threadIdx.x / 32) % 4);
  const int g = l >> 2, t = l & 3;
  for (int n8 = 0; n8 < N8; ++n8)
    for (int e = 0; e < 4; ++e) {
      const int row = m0 + g + 8 * (e >> 1), col = n8 * 8 + 2 * t + (e & 1);
      double s = d[n8][e];
      for (int k = 0; k < 16; ++k) s += double(a.at(TA, k, row)) * double(b.at(TB, k, col));
      d[n8][e] = float(s);
    }
}
template <bool F16 = false>
inline void wgmma_n64_rs(float (&d)[8][4], const uint32_t (&a)[4], uint64_t desc) { wgmma_rs<8, false, F16>(d, a, desc); }
template <bool F16 = false>
inline void wgmma_n64_rs_mn(float (&d)[8][4], const uint32_t (&a)[4], uint64_t desc) { wgmma_rs<8, true, F16>(d, a, desc); }
template <bool F16 = false>
inline void wgmma_n128_rs_mn(float (&d)[16][4], const uint32_t (&a)[4], uint64_t desc) { wgmma_rs<16, true, F16>(d, a, desc); }
}  // namespace kda
