// Device helpers shared by the kda_kcp kernels: bf16 (and fp16) tensor-core mma (m16n8k16, portable to
// sm_90a / sm_100a / sm_103a), ldmatrix fragment loads from XOR-swizzled shared tiles, cp.async, and the
// sm_90a warpgroup mma (wgmma) where a kernel has one.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <utility>

namespace kda {

constexpr float kLog2e = 1.4426950408889634f;
// CUDA's bound on gridDim.y (and gridDim.z; gridDim.x's is 2^31 - 1): a launch whose count can pass it folds the
// count into y and z (kda_bwd.cu launch_grads_nw) or is cut into launches of at most this many (kda_fwd.cu launch_walk).
constexpr int kMaxGridY = 65535;

// exp(x) through the special-function unit (relative error ~2^-22 plus |x| * 2^-24 from the scaling).
__device__ __forceinline__ float fexp(float x) {
  float y;
  asm("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x * kLog2e));
  return y;
}
// e^x with results below FP32's normal range (x < -87.3) flushed to zero: one MUFU.EX2, where ex2.approx.f32 adds a
// range test and two predicated multiplies. For factors whose flushed values are negligible beside the sums they
// enter (the chunk prep's gates: an exp below 1.2e-38 meets factors of at most e^75 there).
__device__ __forceinline__ float fexp_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * kLog2e));
  return y;
}
// 2^x with results below FP32's normal range flushed to zero: one MUFU.EX2 (no scaling, so 2^n for an integer n
// is a power of two once rounded to bf16, whatever the approximation's last bits).
__device__ __forceinline__ float fex2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// 1 / x in one MUFU.RCP (rcp.approx.ftz: ~1 ulp), for x of magnitude in [2^-126, 2^126].
__device__ __forceinline__ float frcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Element offset of (r, c) in a bf16 tile whose rows hold 128 (or 64) elements, stored with the 16-byte
// chunk index XOR-ed with (r & 7): ldmatrix over 8 consecutive rows then hits 8 distinct bank groups.
__device__ __forceinline__ int sw128(int r, int c) { return r * 128 + ((((c >> 3) ^ (r & 7))) << 3) + (c & 7); }
__device__ __forceinline__ int sw64(int r, int c) { return r * 64 + ((((c >> 3) ^ (r & 7))) << 3) + (c & 7); }
// Element offset of (r, c) in a [rows][128] bf16 tile stored as two [rows][64] halves (c < 64 first) of
// sw64 rows: the wgmma layout of 128 columns when the tile has 64 rows (a half is 4096 elements).
__device__ __forceinline__ int swh(int r, int c) { return ((c >> 6) << 12) + sw64(r, c & 63); }

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldsm4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm4t(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}

// D += A * B, A 16x16 (row), B 16x8 (col), D 16x8 fp32; operands bf16, or fp16 when F16 (the forward walk's,
// csrc/kda_fwd.cu).
template <bool F16 = false>
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (F16)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// D0 | D1 += A * B over a k16 x n16 B fragment pair (b[0], b[1]: cols 0..7; b[2], b[3]: cols 8..15).
template <bool F16 = false>
__device__ __forceinline__ void mma_n16(float (&d0)[4], float (&d1)[4], const uint32_t (&a)[4], const uint32_t (&b)[4]) {
  mma<F16>(d0, a, b[0], b[1]);
  mma<F16>(d1, a, b[2], b[3]);
}

// FP32 as TF32 (cvt.rna: round to nearest, ties away from zero; the low 13 bits zero), and x split into
// hi + lo TF32 parts: hi * b + lo * b carries ~21 bits of x where one TF32 product carries 11 (3xTF32).
__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
  hi = to_tf32(x);
  lo = to_tf32(x - __uint_as_float(hi));
}
// The same split by truncation (3 instructions where cvt.rna costs 3 each on sm_90: a range test, an add, a mask):
// hi = x with its low 13 bits cleared, lo = x - hi (exact) likewise; |x - hi - lo| < 2^-20 |x|.
__device__ __forceinline__ void split_tf32_trunc(float x, uint32_t& hi, uint32_t& lo) {
  hi = __float_as_uint(x) & 0xffffe000u;
  lo = __float_as_uint(x - __uint_as_float(hi)) & 0xffffe000u;
}

// D += A * B, A 16x8 tf32 (row), B 8x8 tf32 (col), D 16x8 fp32.
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// N m16n8 accumulator tiles = 0
template <int N>
__device__ __forceinline__ void zero_frags(float (&t)[N][4]) {
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) t[n][e] = 0.f;
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
// The two bf16 of a 32-bit word (low half first) as floats, by a shift and a mask: bf16 -> FP32 is exact, and
// __bfloat1622float2 costs a PRMT and two shifts per word where this costs one IMAD.U32 and one LOP3.
__device__ __forceinline__ float2 bf2_to_f2(uint32_t w) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}
// Two bf16 pairs multiplied elementwise (one HMUL2.BF16, rounded to nearest): exact when b holds powers of two and
// the products stay in bf16's normal range.
__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
// x ~= hi + lo with both bf16 (about 16 significant bits together).
__device__ __forceinline__ void split2(float x, float y, uint32_t& hi, uint32_t& lo) {
  hi = pack_bf16(x, y);
  const float2 h = bf2_to_f2(hi);
  lo = pack_bf16(x - h.x, y - h.y);
}
// Two floats as an fp16 pair (round to nearest even; x in the low half), the word an f16 mma operand holds.
__device__ __forceinline__ uint32_t pack_f16(float x, float y) {
  uint32_t r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(y), "f"(x));
  return r;
}
// An fp16 value from its bits (as a shared-memory tile of uint16_t holds it).
__device__ __forceinline__ float f16_to_f32(uint16_t b) { return __half2float(__ushort_as_half(b)); }
// x ~= hi + lo with both fp16 (about 22 significant bits together, fewer where lo is subnormal: |x| < 2^-3).
__device__ __forceinline__ void split2_f16(float x, float y, uint32_t& hi, uint32_t& lo) {
  hi = pack_f16(x, y);
  const float2 h = __half22float2(*reinterpret_cast<const __half2*>(&hi));
  lo = pack_f16(x - h.x, y - h.y);
}
// A operand (16x16, hi + lo; bf16, or fp16 when F16) from two adjacent m16n8 accumulator tiles t0 (cols 0..7),
// t1 (cols 8..15): the accumulator layout of D is the register layout of an A fragment, so no shuffles are needed.
template <bool F16 = false>
__device__ __forceinline__ void split_afrag(const float (&t0)[4], const float (&t1)[4], uint32_t (&hi)[4],
                                            uint32_t (&lo)[4]) {
  auto split = [](float x, float y, uint32_t& h, uint32_t& l) {
    if constexpr (F16) split2_f16(x, y, h, l);
    else split2(x, y, h, l);
  };
  split(t0[0], t0[1], hi[0], lo[0]);
  split(t0[2], t0[3], hi[1], lo[1]);
  split(t1[0], t1[1], hi[2], lo[2]);
  split(t1[2], t1[3], hi[3], lo[3]);
}
// A bf16 pair times sc (a power of two) as an fp16 pair: exact while |x sc| lies in [2^-14, 65504]. Widened by
// __bfloat1622float2, not bf2_to_f2: in the forward walk's step (its one caller) the shift and mask took ptxas from
// 179-206 to 199-222 registers.
__device__ __forceinline__ uint32_t bf16x2_to_f16x2(uint32_t w, float sc) {
  const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w));
  return pack_f16(f.x * sc, f.y * sc);
}
// The largest |x| over the warp's lanes (every lane gets it).
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
// The power of two sc with m sc in [32, 64), for a finite m > 0: scaled by it, values up to m sit 2^10 below fp16's
// largest and 2^19 above its smallest normal number (the forward walk's operand scale, kda_fwd.cu).
__device__ __forceinline__ float operand_scale(float m) {
  const int e = static_cast<int>((__float_as_uint(m) >> 23) & 0xff) - 127;  // floor(log2 m) for a normal m
  const int k = min(max(5 - e, -126), 127);
  return __uint_as_float(static_cast<uint32_t>(k + 127) << 23);
}
// A operand (16x16, fp16) from two adjacent m16n8 accumulator tiles, as split_afrag without the lo half.
__device__ __forceinline__ void afrag_f16(const float (&t0)[4], const float (&t1)[4], uint32_t (&a)[4]) {
  a[0] = pack_f16(t0[0], t0[1]);
  a[1] = pack_f16(t0[2], t0[3]);
  a[2] = pack_f16(t1[0], t1[1]);
  a[3] = pack_f16(t1[2], t1[3]);
}
// Negate a hi + lo operand pair: flips the sign bit of every bf16 (exact), so that an mma subtracts.
__device__ __forceinline__ void negate_split(uint32_t (&hi)[4], uint32_t (&lo)[4]) {
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    hi[e] ^= 0x80008000u;
    lo[e] ^= 0x80008000u;
  }
}

// ---- fragment loads (tile pointers are bf16 bases of swizzled tiles; RL = row length 128 or 64) ----
// RL = kRowsSwh: a [rows][128] tile stored as two [rows][64] sw64 halves (swh: the wgmma layout of 128 columns)
constexpr int kRowsSwh = 0;
template <int RL>
__device__ __forceinline__ int swz(int r, int c) {
  if constexpr (RL == kRowsSwh) return swh(r, c);
  else if constexpr (RL == 128) return sw128(r, c);
  else return sw64(r, c);
}
// Address of the 16-byte row chunk a lane hands to ldmatrix.x4 in a swizzled tile of RL-element rows: tile
// row r0 + rl, column chunk (c0 / 8 + ch) ^ (rl & 7), for r0 a multiple of 8 and c0 a multiple of 16
// (every caller's block corner). Then the chunk is (c0 / 8) ^ ch ^ (rl & 7) and, since the swizzle
// permutes chunks within a row, the byte offset is (lane part) ^ (2 c0) + (row part): the lane part is
// computed once per kernel and each fragment load costs one XOR, where swz<RL> on the full indices cost
// a chain of integer ops per load (a third of the walks' issued instructions, by ncu).
template <int RL, class T>
__device__ __forceinline__ const T* frag_ptr(const T* t, int r0, int c0, int rl, int ch) {
  if constexpr (RL == kRowsSwh) return frag_ptr<64>(t + ((c0 >> 6) << 12), r0, c0 & 63, rl, ch);  // a 16-column block lies in one half
  const int lane_part = rl * (2 * RL) + ((ch ^ (rl & 7)) << 4);
  return reinterpret_cast<const T*>(reinterpret_cast<const char*>(t) + ((lane_part ^ (2 * c0)) + r0 * (2 * RL)));
}
// A (16x16, rows m0.., cols k0..) from storage [m][k]; T: any 16-bit element type (bf16, fp16).
template <int RL, class T>
__device__ __forceinline__ void lda(uint32_t (&a)[4], const T* t, int m0, int k0, int lane) {
  ldsm4(a, frag_ptr<RL>(t, m0, k0, lane & 15, lane >> 4));
}
// A (16x16) from storage [k][m] (the tile holds A transposed).
template <int RL, class T>
__device__ __forceinline__ void lda_t(uint32_t (&a)[4], const T* t, int m0, int k0, int lane) {
  ldsm4t(a, frag_ptr<RL>(t, k0, m0, (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1));
}
// B for two n-tiles (k16 x n16): b[0],b[1] = tile n0..n0+7, b[2],b[3] = tile n0+8.. ; storage [n][k].
template <int RL, class T>
__device__ __forceinline__ void ldb(uint32_t (&b)[4], const T* t, int k0, int n0, int lane) {
  ldsm4(b, frag_ptr<RL>(t, n0, k0, (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1));
}
// Same from storage [k][n].
template <int RL, class T>
__device__ __forceinline__ void ldb_t(uint32_t (&b)[4], const T* t, int k0, int n0, int lane) {
  ldsm4t(b, frag_ptr<RL>(t, k0, n0, (lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4));
}

// A 32-bit global store that the compiler keeps in program order with the other volatile asm (the mma):
// issued where it is written, so its value need not stay live until a later point the compiler picks.
__device__ __forceinline__ void st_global_pinned(void* p, uint32_t x) {
  asm volatile("st.global.b32 [%0], %1;\n" ::"l"(p), "r"(x));
}
// The same at byte OFF from p, the offset carried in the instruction: an asm address operand is a register, so an
// offset added in C++ costs a 64-bit add per store (two IADD3; 128 per step in the reverse walk).
template <int OFF>
__device__ __forceinline__ void st_global_pinned_at(void* p, uint32_t x) {
  asm volatile("st.global.b32 [%0+%2], %1;\n" ::"l"(p), "r"(x), "n"(OFF));
}

// f(std::integral_constant<int, I>()) for I = 0 .. N - 1 in order: an unrolled loop whose index is a constant
// expression (a template argument such as st_global_pinned_at's offset)
template <class F, int... I>
__device__ __forceinline__ void static_for_seq(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>()), ...);
}
template <int N, class F>
__device__ __forceinline__ void static_for(F&& f) {
  static_for_seq(f, std::make_integer_sequence<int, N>());
}

// An 8-byte global load issued where it is written (asm volatile keeps it in order with the mma): a value needed
// a phase later is requested early, not at its first use
__device__ __forceinline__ int2 ld_global_pinned_int2(const int32_t* p) {
  int2 v;
  asm volatile("ld.global.nc.v2.s32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}
// threadIdx.x as an opaque value: what derives from it is formed where it is used, never hoisted out of a loop
// and held in registers across it (asm volatile is re-executed at each call)
__device__ __forceinline__ int thread_index() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(t));
  return t;
}

// ---- wgmma (sm_90a only; KDA_HAS_WGMMA says whether this compilation has it) ----
// A warpgroup (4 consecutive warps) computes a 64 x N product: A from registers, warp w of the group
// supplying rows 16 w .. 16 w + 15 in the m16n8k16 A-fragment layout (so an S^T held as mma accumulators is
// a ready A operand), B (16 x N) from shared memory through a descriptor, D in the accumulator layout of N / 8
// m16n8 tiles per warp. B tiles are K-major in the canonical 128-byte swizzle: rows (the N index) of 64
// bf16 (128 bytes) with the 16-byte chunk index XOR-ed with (row & 7), i.e. sw64, in 1024-byte groups of
// 8 rows; a tile with 128 keys is stored as two such 64-key halves (swh above).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KDA_HAS_WGMMA 1
#else
#define KDA_HAS_WGMMA 0
#endif
// Descriptor of a 128-byte-swizzled B tile at `tile` (1024-byte aligned), layout 1 = 128-byte swizzle, 8-row
// groups 1024 bytes apart. K-major (rows = N): the leading byte offset is unused (16); the k-th 16-key step
// inside a 64-key half starts 32 k bytes later (add 2 k to the descriptor). MN-major (rows = K, 64 N-values per
// row; wgmma's transposed B): `lbo` bytes between the 64-column halves of N, and a 16-row K step starts 2048
// bytes later.
__device__ __forceinline__ uint64_t sw128_desc(const void* tile, uint32_t lbo = 16) {
  return static_cast<uint64_t>((smem_u32(tile) & 0x3FFFF) >> 4) | (uint64_t(lbo >> 4) << 16) |
         (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}
// Keeps a register live and in place across this point (the compiler cannot move its reads or writes over
// it): wgmma reads its A registers and writes its accumulators asynchronously, until wgmma_wait0.
__device__ __forceinline__ void fence_reg(float& x) { asm volatile("" : "+f"(x)::"memory"); }
__device__ __forceinline__ void fence_reg(uint32_t& x) { asm volatile("" : "+r"(x)::"memory"); }
template <int N, class T>  // T = float (accumulators) or uint32_t (A operands)
__device__ __forceinline__ void fence_frags(T (&t)[N][4]) {
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) fence_reg(t[n][e]);
}
#if KDA_HAS_WGMMA
// the accumulator operands of a wgmma: the 4 of m16n8 tile i of d, 8 tiles for n64, 16 for n128
#define KDA_WGMMA_TILE(d, i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
#define KDA_WGMMA_ACC32(d) KDA_WGMMA_TILE(d, 0), KDA_WGMMA_TILE(d, 1), KDA_WGMMA_TILE(d, 2), KDA_WGMMA_TILE(d, 3), \
    KDA_WGMMA_TILE(d, 4), KDA_WGMMA_TILE(d, 5), KDA_WGMMA_TILE(d, 6), KDA_WGMMA_TILE(d, 7)
#define KDA_WGMMA_ACC64(d) KDA_WGMMA_ACC32(d), KDA_WGMMA_TILE(d, 8), KDA_WGMMA_TILE(d, 9), KDA_WGMMA_TILE(d, 10), \
    KDA_WGMMA_TILE(d, 11), KDA_WGMMA_TILE(d, 12), KDA_WGMMA_TILE(d, 13), KDA_WGMMA_TILE(d, 14), KDA_WGMMA_TILE(d, 15)
// shared memory written by ordinary stores or cp.async, then read by wgmma (the async proxy)
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// D (this warp's 16 rows x 64 columns) += A (16 x 16, registers) B (16 x 64 via desc), FP32 accumulators;
// operands bf16, or fp16 when F16
#define KDA_WGMMA_N64(T, TNSPB)                                                                       \
  asm volatile(                                                                                        \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                      \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." T "." T " "                                         \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                        \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "              \
      "{%32, %33, %34, %35}, %36, p, 1, 1, " TNSPB ";\n}\n"                                             \
      : KDA_WGMMA_ACC32(d)                                                                             \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(1))
template <bool F16 = false>
__device__ __forceinline__ void wgmma_n64_rs(float (&d)[8][4], const uint32_t (&a)[4], uint64_t desc) {
  if constexpr (F16) KDA_WGMMA_N64("f16", "0");
  else KDA_WGMMA_N64("bf16", "0");
}
// the same with B MN-major (rows = K, the 64 N-values of a row contiguous; the backward walks' Aqk)
template <bool F16 = false>
__device__ __forceinline__ void wgmma_n64_rs_mn(float (&d)[8][4], const uint32_t (&a)[4], uint64_t desc) {
  if constexpr (F16) KDA_WGMMA_N64("f16", "1");
  else KDA_WGMMA_N64("bf16", "1");
}
// D (this warp's 16 rows x 128 columns) += A (16 x 16, registers) B (16 x 128, MN-major via desc)
#define KDA_WGMMA_N128_MN(T)                                                                          \
  asm volatile(                                                                                        \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                                      \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." T "." T " "                                        \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                        \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "               \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "               \
      "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"                                                     \
      : KDA_WGMMA_ACC64(d)                                                                             \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(1))
template <bool F16 = false>
__device__ __forceinline__ void wgmma_n128_rs_mn(float (&d)[16][4], const uint32_t (&a)[4], uint64_t desc) {
  if constexpr (F16) KDA_WGMMA_N128_MN("f16");
  else KDA_WGMMA_N128_MN("bf16");
}
// D (this warp's 16 rows x 8 N8 columns) += A (64 x 16 via da) B (16 x 8 N8 via db), both from shared memory: warp w
// of the group gets rows 16 w .. 16 w + 15 of A's 64. TA / TB: A / B MN-major (A stored [k][m], B [k][n]), else
// K-major (A [m][k], B [n][k]); the tiles in the 128-byte swizzle of sw128_desc. N8 = 2, 4, 8 or 16 (n16 .. n128;
// an MN-major B of 128 columns is two 64-column halves LBO bytes apart).
template <int N8, bool TA, bool TB>
__device__ __forceinline__ void wgmma_ss(float (&d)[N8][4], uint64_t da, uint64_t db) {
  static_assert(N8 == 2 || N8 == 4 || N8 == 8 || N8 == 16, "n16, n32, n64 or n128");
  if constexpr (N8 == 2)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, %11, %12;\n}\n"
        : KDA_WGMMA_TILE(d, 0), KDA_WGMMA_TILE(d, 1)
        : "l"(da), "l"(db), "n"(1), "n"(int(TA)), "n"(int(TB)));
  else if constexpr (N8 == 4)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, %19, %20;\n}\n"
        : KDA_WGMMA_TILE(d, 0), KDA_WGMMA_TILE(d, 1), KDA_WGMMA_TILE(d, 2), KDA_WGMMA_TILE(d, 3)
        : "l"(da), "l"(db), "n"(1), "n"(int(TA)), "n"(int(TB)));
  else if constexpr (N8 == 8)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, %35, %36;\n}\n"
        : KDA_WGMMA_ACC32(d)
        : "l"(da), "l"(db), "n"(1), "n"(int(TA)), "n"(int(TB)));
  else
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, %67, %68;\n}\n"
        : KDA_WGMMA_ACC64(d)
        : "l"(da), "l"(db), "n"(1), "n"(int(TA)), "n"(int(TB)));
}
#undef KDA_WGMMA_N128_MN
#undef KDA_WGMMA_N64
#undef KDA_WGMMA_ACC64
#undef KDA_WGMMA_ACC32
#undef KDA_WGMMA_TILE
#else
// Declarations only: a kernel names them in `if constexpr` branches that other archs discard (never defined or
// called there), so the kernels need no preprocessor branches of their own.
__device__ void fence_async_smem();
__device__ void wgmma_fence();
__device__ void wgmma_commit();
__device__ void wgmma_wait0();
template <bool F16 = false>
__device__ void wgmma_n64_rs(float (&d)[8][4], const uint32_t (&a)[4], uint64_t desc);
template <bool F16 = false>
__device__ void wgmma_n64_rs_mn(float (&d)[8][4], const uint32_t (&a)[4], uint64_t desc);
template <bool F16 = false>
__device__ void wgmma_n128_rs_mn(float (&d)[16][4], const uint32_t (&a)[4], uint64_t desc);
template <int N8, bool TA, bool TB>
__device__ void wgmma_ss(float (&d)[N8][4], uint64_t da, uint64_t db);
#endif
// %nsmid: one more than the largest SM id (at least the SM count; only used to aim L2 hints)
__device__ __forceinline__ unsigned sm_count() {
  unsigned n;
  asm("mov.u32 %0, %%nsmid;" : "=r"(n));
  return n;
}
// Ask L2 for the 128-byte line at p (no data comes back; a hint, not a load).
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p)); }
// ---- cp.async (16 bytes, zero-filled when !valid) ----
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
// The same with byte offsets DOFF (shared) and SOFF (global) from dst and src carried in the instruction: unrolled
// copies from one pointer pair need no address arithmetic per piece (an asm address operand is a register).
template <int DOFF, int SOFF>
__device__ __forceinline__ void cp_async16_at(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0+%3], [%1+%4], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(valid ? 16 : 0), "n"(DOFF), "n"(SOFF));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
// all but the most recently committed group have landed (double-buffered stage loads)
__device__ __forceinline__ void cp_async_wait1() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }

}  // namespace kda
