// KDA chunked backward, head dim 128, chunk 64 (v1, staged). Four kernels (the segment summaries are folded
// by the affine merge (FP32 states, 3xTF32 products) shared with the forward, kda_affine_merge.cuh, exported by the binding):
//
//   prep_kernel      (chunk, head):        G = cumsum g, P, L, Aqk by anchored pairwise products on tensor
//                                          cores, A = (I + L)^-1 in FP32 (blocked substitution), W, U, Kg,
//                                          s Qg, gamma -> one record per chunk-head in the workspace
//                                          (two 8-warp CTAs per SM, the forward prep's shape).
//   fwd_walk_kernel  (run, head):          S^T in registers (FP32 accumulators), serial over the run's
//                                          chunks: writes h (state entering each chunk, bf16 hi only,
//                                          kHiStateBytes) and V_new (fp16 at a power of two per warp, over U
//                                          in the record).
//   rev_walk_kernel  (run, head):          dS^T in registers, serial from the run's end: writes dh
//                                          (gradient of the state leaving each chunk) and dV_new (into the
//                                          record), both fp16 at a power of two per warp, or the backward summary
//                                          (M^T | F) of a run from a zero dS.
//                                          Both walks: their stages come through a ring filled by a producer
//                                          warpgroup (WalkRing: FwdRing, RevRing); the state products by wgmma
//                                          on sm_90a (WalkShape::WGMMA), mma.sync elsewhere; bitwise the same
//                                          results.
//   grads_kernel     (chunk, head):        the per-chunk backward of kda_kcp/chunk.py (chunk_grads)
//                                          from the record, h, dh and the walks' V_new / dV_new,
//                                          every product on tensor cores, bf16 hi + lo operands
//                                          (three products) wherever an operand is not exact in bf16;
//                                          on sm_90a the state products (phase A) and, on one-anchor
//                                          chunks, the pairwise rows and columns (B4') by wgmma, one
//                                          warpgroup per product at 16 warps; B2 / B3's by wgmma too.
//
// No atomics anywhere; every reduction has a fixed order, so the result is bitwise repeatable, and the
// same kernels serve both packages (det and nondet).
#include "kda_bwd.h"
#include "kda_chunk_prep.cuh"
#include "kda_common.cuh"
#include "kda_state_tile.cuh"
#include "kda_tile_copy.cuh"
#include "kda_tile_ring.cuh"

namespace kda {
namespace bwd {
namespace {

using bf16 = __nv_bfloat16;
constexpr int C = 64;
constexpr int D = 128;

// ------------------------------------------------------------------------------------------------
// warp-level GEMM on swizzled bf16 shared tiles:
//   acc[MI][NI] (rows m0 + 16 mi, cols n0 + 8 ni) += sum_{kk < nk} A(m, ka + kk) B(kb + kk, n)
// A storage [m][k] (AT = false) or [k][m] (AT = true), row length RLA; B storage [n][k] (BT = false)
// or [k][n] (BT = true), row length RLB. SA / SB: a lo tile exists (hi*hi + lo*hi + hi*lo).
// ------------------------------------------------------------------------------------------------
template <int MI, int NI, int RLA, bool AT, bool SA, int RLB, bool BT, bool SB>
__device__ __forceinline__ void wgemm(float (&acc)[MI][NI][4], const bf16* Ah, const bf16* Al, int m0, int ka,
                                      const bf16* Bh, const bf16* Bl, int n0, int kb, int nk, int lane) {
  static_assert(NI % 2 == 0, "NI must be even");
  for (int kk = 0; kk < nk; kk += 16) {
    uint32_t ah[MI][4], al[MI][4];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
      if constexpr (AT) {
        lda_t<RLA>(ah[mi], Ah, m0 + 16 * mi, ka + kk, lane);
        if constexpr (SA) lda_t<RLA>(al[mi], Al, m0 + 16 * mi, ka + kk, lane);
      } else {
        lda<RLA>(ah[mi], Ah, m0 + 16 * mi, ka + kk, lane);
        if constexpr (SA) lda<RLA>(al[mi], Al, m0 + 16 * mi, ka + kk, lane);
      }
    }
#pragma unroll
    for (int nj = 0; nj < NI / 2; ++nj) {
      uint32_t bh[4], bl[4];
      if constexpr (BT) {
        ldb_t<RLB>(bh, Bh, kb + kk, n0 + 16 * nj, lane);
        if constexpr (SB) ldb_t<RLB>(bl, Bl, kb + kk, n0 + 16 * nj, lane);
      } else {
        ldb<RLB>(bh, Bh, kb + kk, n0 + 16 * nj, lane);
        if constexpr (SB) ldb<RLB>(bl, Bl, kb + kk, n0 + 16 * nj, lane);
      }
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        mma_n16(acc[mi][2 * nj], acc[mi][2 * nj + 1], ah[mi], bh);
        if constexpr (SA) mma_n16(acc[mi][2 * nj], acc[mi][2 * nj + 1], al[mi], bh);
        if constexpr (SB) mma_n16(acc[mi][2 * nj], acc[mi][2 * nj + 1], ah[mi], bl);
      }
    }
  }
}

template <int MI, int NI>
__device__ __forceinline__ void zero(float (&acc)[MI][NI][4]) {
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < NI; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0.f;
}

// f(row, col, x0, x1): the pair (row, col), (row, col + 1) of the accumulator tile.
template <int MI, int NI, class F>
__device__ __forceinline__ void epi(float (&acc)[MI][NI][4], int m0, int n0, int lane, F&& f) {
  const int g4 = lane >> 2, l4 = lane & 3;
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < NI; ++ni)
#pragma unroll
      for (int e2 = 0; e2 < 2; ++e2)
        f(m0 + 16 * mi + g4 + 8 * e2, n0 + 8 * ni + 2 * l4, acc[mi][ni][2 * e2], acc[mi][ni][2 * e2 + 1]);
}

// Byte offsets of epi's pairs (rows m0 + g4 + 8 e2, columns n0 + 8 ni + 2 l4) in a tile whose swizzle XORs a column's
// 8-element group with a key of the row that repeats every 8 rows: ES-byte elements, RL a row, key r & KM (sw128 and
// sw64: 7; f32_at<true> and the fp32 [64][64] tile: 3); SWH: sw64 halves of 4096 elements (swh). The key is the
// thread's (g4 & KM), so pair (ni, e2) lies at the thread's first pair's offset with 8 ni XORed into the column (a half
// further per 8 groups, SWH) and 8 rows on per e2: a LOP3 per column group, not a swizzle computed per pair.
// Needs n0 + 8 ni = n0 | 8 ni over the ni taken (n0 a multiple of 8 NI, of 64 where SWH and NI > 8).
template <int ES, int RL, int KM, bool SWH = false>
struct PairOff {
  int b;
  __device__ __forceinline__ PairOff(int m0, int n0, int lane) {
    const int r = m0 + (lane >> 2), c = n0 + 2 * (lane & 3);
    b = ES * (SWH ? ((c >> 6) << 12) + r * 64 + ((c & 63) ^ ((r & 7) << 3)) : r * RL + (c ^ ((r & KM) << 3)));
  }
  __device__ __forceinline__ int operator()(int ni, int e2) const {
    if constexpr (SWH) return (b ^ (8 * ES * (ni & 7))) + ES * (((ni >> 3) << 12) + 8 * 64 * e2);
    else return (b ^ (8 * ES * ni)) + ES * 8 * RL * e2;
  }
};
using OffF32 = PairOff<4, 128, 3>;       // fp32 [64][128], f32_at<true>
using OffF64 = PairOff<4, 64, 3>;        // fp32 [64][64], the same swizzle
using Off64 = PairOff<2, 64, 7>;         // bf16 sw64
using OffSwh = PairOff<2, 64, 7, true>;  // bf16 swh
// epi with each pair's offset in layout L: f(o, r, cc, x0, x1)
template <class L, int NI, class F>
__device__ __forceinline__ void epi_at(float (&acc)[1][NI][4], int m0, int n0, int lane, F&& f) {
  const L at(m0, n0, lane);
  const int g4 = lane >> 2, l4 = lane & 3;
#pragma unroll
  for (int ni = 0; ni < NI; ++ni)
#pragma unroll
    for (int e2 = 0; e2 < 2; ++e2)
      f(at(ni, e2), m0 + g4 + 8 * e2, n0 + 8 * ni + 2 * l4, acc[0][ni][2 * e2], acc[0][ni][2 * e2 + 1]);
}
// the T at byte offset o of a tile
template <class T, class P>
__device__ __forceinline__ T& at_byte(P* t, int o) {
  return *reinterpret_cast<T*>(reinterpret_cast<char*>(t) + o);
}
template <class T, class P>
__device__ __forceinline__ const T& at_byte(const P* t, int o) {
  return *reinterpret_cast<const T*>(reinterpret_cast<const char*>(t) + o);
}

// store a pair as bf16 hi (+ lo) into swizzled tiles
template <int RL>
__device__ __forceinline__ void st2(bf16* th, bf16* tl, int r, int c, float x0, float x1) {
  uint32_t hi, lo;
  split2(x0, x1, hi, lo);
  *reinterpret_cast<uint32_t*>(th + swz<RL>(r, c)) = hi;
  if (tl != nullptr) *reinterpret_cast<uint32_t*>(tl + swz<RL>(r, c)) = lo;
}
template <int RL>
__device__ __forceinline__ float2 ld2(const bf16* t, int r, int c) {
  return bf2_to_f2(*reinterpret_cast<const uint32_t*>(t + swz<RL>(r, c)));
}
// the same at an element offset o that the caller keeps (both tiles of st2_at share it)
__device__ __forceinline__ float2 ld2_at(const bf16* t, int o) { return bf2_to_f2(*reinterpret_cast<const uint32_t*>(t + o)); }
__device__ __forceinline__ void st2_at(bf16* th, bf16* tl, int o, float x0, float x1) {
  uint32_t hi, lo;
  split2(x0, x1, hi, lo);
  *reinterpret_cast<uint32_t*>(th + o) = hi;
  *reinterpret_cast<uint32_t*>(tl + o) = lo;
}
// ld2 / st2 at a byte offset o (tl may be null: no caller passes null, but with the test ptxas allocates
// grads_kernel<16> with 52 / 100 bytes of spill stores / loads, without it 80 / 156)
__device__ __forceinline__ float2 ld2_b(const bf16* t, int o) { return bf2_to_f2(at_byte<uint32_t>(t, o)); }
__device__ __forceinline__ void st2_b(bf16* th, bf16* tl, int o, float x0, float x1) {
  uint32_t hi, lo;
  split2(x0, x1, hi, lo);
  at_byte<uint32_t>(th, o) = hi;
  if (tl != nullptr) at_byte<uint32_t>(tl, o) = lo;
}

// The C rows of a bf16 matrix with RL columns -> swizzled tile (swz<RL>: repeats every 8 rows).
template <int RL, int NT, bool LOWER = false>
__device__ __forceinline__ void load_bf16(bf16* dst, const bf16* src, int64_t gstride, int nvalid, int tid) {
  static_assert((NT / (RL / 8)) % 8 == 0, "a pass keeps row & 7");
  load_rows<NT, C, RL / 8, LOWER>(dst, RL, src, gstride, nvalid, tid, [](int r, int c) { return swz<RL>(r, c); });
}
// A record's block lower triangular [64][64] bf16 matrix (Aqk, A hi or lo: kda_bwd.h) -> sw64 tile, upper blocks 0
template <int NT>
__device__ __forceinline__ void load_lower_bf16(bf16* dst, const bf16* src, int tid) {
  load_bf16<64, NT, true>(dst, src, C, C, tid);
}

// Index of (row, col) in an fp32 [64][128] tile: row-major (SWZ = false), or with the 8-column groups
// XOR-swizzled by (row & 3) (SWZ = true). The gradient kernel reads its G and dG tiles in the mma
// accumulator pattern (8 rows x 4 column pairs per warp instruction): row-major, those reads hit 4
// banks 8 ways; swizzled, 16 banks 2 ways. A row stays one 128-float block (permuted within 32-float
// groups), so row-wise loops and 16-byte copies of 4 columns are unchanged in cost.
template <bool SWZ>
__device__ __forceinline__ int f32_at(int r, int c) {
  if constexpr (SWZ) return r * D + (c ^ ((r & 3) << 3));
  else return r * D + c;
}

// The pair (r, c), (r, c + 1), c even, of an fp32 [64][128] tile in the f32_at<SWZ> layout: one 8-byte load (a
// pair stays adjacent inside its 8-column group).
template <bool SWZ>
__device__ __forceinline__ float2 ld2_f32(const float* t, int r, int c) {
  return *reinterpret_cast<const float2*>(t + f32_at<SWZ>(r, c));
}

// fp32 [ROWS][COLS] -> plain tile with row stride ld (LOWER: block lower triangular, upper blocks zero-filled).
template <int NT, int ROWS, int COLS, bool LOWER = false>
__device__ __forceinline__ void load_f32(float* dst, int ld, const float* src, int64_t gstride, int nvalid, int tid) {
  load_rows<NT, ROWS, COLS / 4, LOWER>(dst, ld, src, gstride, nvalid, tid, [ld](int r, int c) { return r * ld + c; });
}
// fp32 [64][128] -> swizzled tile (f32_at<true>: repeats every 4 rows).
template <int NT>
__device__ __forceinline__ void load_f32_swz(float* dst, const float* src, int64_t gstride, int nvalid, int tid) {
  static_assert((NT / (D / 4)) % 4 == 0, "a pass keeps row & 3");
  load_rows<NT, C, D / 4>(dst, D, src, gstride, nvalid, tid, [](int r, int c) { return f32_at<true>(r, c); });
}

// f(r, d, at) over a thread's column pair d = 2 (tid % 64) and rows tid / 64 + (NT / 64) s + 8 g, g = 0 .. 7 (a loop
// that stages a [64][128] tile by column pair), at = the pair's element offsets in an f32_at<true> tile, an sw128 one
// and an swh one. The swizzles repeat every 8 rows, so a row's offsets are its first group's plus 8 g
// rows: an add per layout and group, where swz on the row index cost a chain of integer ops per tile.
struct PairAt {
  int f32, b128, bswh;
};
template <int NT, class F>
__device__ __forceinline__ void each_pair_row(int tid, F&& f) {
  constexpr int RS = NT / 64;  // rows per pass
  static_assert(8 % RS == 0, "a pass keeps row & 7 within 8 rows");
  const int j0 = tid >> 6, d = 2 * (tid & 63);
#pragma unroll 1
  for (int g = 0; g < C / 8; ++g)
#pragma unroll
    for (int s = 0; s < 8 / RS; ++s) {
      const int j = j0 + RS * s;
      f(8 * g + j, d, PairAt{f32_at<true>(j, d) + 8 * g * D, sw128(j, d) + 8 * g * 128, swh(j, d) + 8 * g * 64});
    }
}

// rs[e2]: this lane's partial sums of rows g4 + 8 e2 of an m16 tile; the four lanes of a row add theirs
// (fixed order) and dst[row0 + row] receives the total.
__device__ __forceinline__ void store_row_sums(float* dst, int row0, const float (&rs)[2], int lane) {
#pragma unroll
  for (int e2 = 0; e2 < 2; ++e2) {
    float s = rs[e2];
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    if ((lane & 3) == 0) dst[row0 + (lane >> 2) + 8 * e2] = s;
  }
}

// Row scans of an fp32 [64][128] f32_at<true> tile (G = cumsum g; dg = the reverse cumsum of dG) in the prep's order
// (kda_chunk_prep.cuh): each thread holds 16 rows of 512 / NT columns in registers (v, row block rq = 16-row block)
// and scans them there; the blocks' totals meet in `tot` (fp32 [3][128]); each block then adds the totals of the blocks
// before it (REV: after it) from the chunk's first (last) block on. So the kernel's G is the prep's G, bit for bit.
// (A thread per column walking 32 rows, then 32 more, was a chain of dependent shared-memory round trips: ptxas cannot
// hoist a load above the previous row's store. ~2,000 cycles a scan, twice per chunk-head, with the block waiting.)
template <int NT>
struct RowBlocks {
  static constexpr int CPT = 512 / NT;  // columns per thread
  static constexpr int TPB = D / CPT;   // threads per row block
  static_assert(CPT == 1 || CPT == 2, "8 or 16 warps");
  int rq, d0;  // this thread's row block and first column
  float v[CPT][16];
  __device__ __forceinline__ explicit RowBlocks(int tid) : rq(tid / TPB), d0((tid % TPB) * CPT) {}
  __device__ __forceinline__ void load(const float* t) {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      if constexpr (CPT == 2) {
        const float2 x = ld2_f32<true>(t, 16 * rq + i, d0);
        v[0][i] = x.x, v[1][i] = x.y;
      } else {
        v[0][i] = t[f32_at<true>(16 * rq + i, d0)];
      }
    }
  }
  // f(row, column, value) for each element this thread holds
  template <class F>
  __device__ __forceinline__ void each(F&& f) const {
#pragma unroll
    for (int i = 0; i < 16; ++i)
#pragma unroll
      for (int c = 0; c < CPT; ++c) f(16 * rq + i, d0 + c, v[c][i]);
  }
  // the scan (synchronizes: every thread of the block calls it)
  template <bool REV>
  __device__ __forceinline__ void scan(float* tot) {
#pragma unroll
    for (int c = 0; c < CPT; ++c)
#pragma unroll
      for (int i = 1; i < 16; ++i) {
        if constexpr (REV) v[c][15 - i] += v[c][16 - i];
        else v[c][i] += v[c][i - 1];
      }
    if (REV ? rq > 0 : rq < 3)
#pragma unroll
      for (int c = 0; c < CPT; ++c) tot[(REV ? rq - 1 : rq) * D + d0 + c] = v[c][REV ? 0 : 15];
    __syncthreads();
#pragma unroll
    for (int c = 0; c < CPT; ++c) {
      float o = 0.f;
      if constexpr (REV) {
        for (int qb = 3; qb > rq; --qb) o += tot[(qb - 1) * D + d0 + c];
      } else {
        for (int qb = 0; qb < rq; ++qb) o += tot[qb * D + d0 + c];
      }
#pragma unroll
      for (int i = 0; i < 16; ++i) v[c][i] += o;
    }
  }
};

// The prep and the gradient kernel launch chunk-major (the H heads of a chunk side by side): CTAs that run at once
// read neighbouring bytes of the same token rows and the prep writes neighbouring records, c H + h (the forward prep's
// order too; head-major measured slower, docs/kernels.md).
inline dim3 prep_grid(int nchunks, int H) {  // chunk_prep::own_chunk_head's order
  return dim3(static_cast<unsigned>(nchunks) * H);
}

// ================================================================================================
// prep (kda_chunk_prep.cuh, the forward's kernel shape) into the backward's record
// ================================================================================================
struct BwdRecord {
  static constexpr bool kBwd = true;
  static __device__ __forceinline__ float* gamma(char* rec) { return reinterpret_cast<float*>(rec + kRecGam); }
  static __device__ __forceinline__ bf16* qg(char* rec) { return reinterpret_cast<bf16*>(rec + kRecQg); }
  static __device__ __forceinline__ bf16* kg(char* rec) { return reinterpret_cast<bf16*>(rec + kRecKg); }
  static __device__ __forceinline__ float* p(char* rec) { return reinterpret_cast<float*>(rec + kRecP); }
  static __device__ __forceinline__ bf16* a_hi(char* rec) { return reinterpret_cast<bf16*>(rec + kRecAH); }
  // U pair (i, j), (i, j + 1), j even, already scaled: fp16 at row i, value half j / 64 (kda_bwd.h kRecU)
  static __device__ __forceinline__ void u(char* rec, int i, int j, float x0, float x1) {
    *reinterpret_cast<uint32_t*>(rec + kRecU + kURowBytes * i + 256 * (j >> 6) + 2 * (j & 63)) = pack_f16(x0, x1);
  }
  // The stores' scale 2^-e for a chunk-head whose max |U| is umax: umax 2^-e in [2^14, 2^15) (< fp16's 65504),
  // e in [-114, 114] so that 2^-e and 2^e are normal FP32 (a umax below 2^-100 is as good as zero; an inf or NaN in
  // U stays one). With `store`, 2^e goes to both halves' scale slots.
  static __device__ __forceinline__ float u_scale(char* rec, float umax, bool store) {
    int e = static_cast<int>((__float_as_uint(umax) >> 23) & 0xffu) - 127;  // floor(log2 umax), for a normal umax
    e = (e < -100 ? -100 : e) - 14;  // (e <= 128: an inf or NaN umax gives 114, still in range)
    if (store) {
      const float4 inv = make_float4(__uint_as_float(static_cast<unsigned>(127 + e) << 23), 0.f, 0.f, 0.f);
      *reinterpret_cast<float4*>(rec + kRecU + kUScaleOff) = inv;
      *reinterpret_cast<float4*>(rec + kRecU + kUScaleOff + 256) = inv;
    }
    return __uint_as_float(static_cast<unsigned>(127 - e) << 23);
  }
  static __device__ __forceinline__ void aqk(char* rec, int I, int J, int r, int c, uint32_t hi, uint32_t lo) {
    const int e = (16 * I + r) * C + 16 * J + c;
    reinterpret_cast<uint32_t*>(rec + kRecAqkH)[e / 2] = hi;
    reinterpret_cast<uint32_t*>(rec + kRecAqkL)[e / 2] = lo;
  }
  static __device__ __forceinline__ void w(char* rec, int i, int j, float x0, float x1) {
    *reinterpret_cast<uint32_t*>(rec + kRecW + 2 * (i * D + j)) = pack_bf16(x0, x1);
  }
};

__global__ void __launch_bounds__(chunk_prep::NT, 2) prep_kernel(const Args a) {
  extern __shared__ __align__(128) char smem[];
  const chunk_prep::Inputs in{a.q, a.k, a.v, a.g, a.beta, a.chunks, a.H, a.scale, a.status};
  const int2 at = chunk_prep::own_chunk_head(a.H);
  char* rec = a.prep + (static_cast<int64_t>(at.x) * a.H + at.y) * kPrepBytes;
  chunk_prep::prep_chunk<BwdRecord>(in, rec, smem, at.x, at.y);
}

// ================================================================================================
// walks: one CTA per (run or segment, head, WCOLS state columns: value columns, or virtual [M^T | F] /
// [M | E] columns in summary mode); the state is held transposed, ST[v][d], as mma accumulators.
// NW warps per CTA (4 or 8, chosen per launch), each owning 16 columns x all 128 keys.
//
// 8 warps cover the whole state of a (run, head) (128 value columns) in one CTA. With 4 (64 columns, two CTAs per
// (run, head)) both CTAs load the same W, Kg, Qg, Aqk and gamma every step, and a reverse-walk CTA (a ring of three
// stages on 1024-byte groups, 219 KiB of shared memory) takes an SM alone: at H = 16 the 128 reverse and 128 forward
// walk CTAs of the benchmark batch could not all be resident, and the longest run's reverse walk started 2 ms late
// (scripts/profiling/timeline_step.py).
// With 8 warps 64 + 64 CTAs fit and the records are read once per step. But an 8-warp CTA steps slower than a
// 4-warp one alone on its SM (two warps per SM sub-partition): a launch of few CTAs (the KCP exchange's run
// summaries) is a chain of latency-bound steps, and there 4 warps are faster. kda_kcp/cuda/backward.py chooses.
// ================================================================================================
template <int NW>
struct WalkShape {
  static_assert(NW == 4 || NW == 8, "4 or 8 walk warps");
  static constexpr int NT = NW * 32;      // threads per walk CTA
  static constexpr int COLS = 16 * NW;    // state columns per walk CTA
  static constexpr int UL = COLS + 8;     // fp16 row stride of the U tile (rows 2 l4 apart: 4 bank groups)
  // The state products by wgmma (sm_90a; whole warpgroups): a warpgroup's four warps read each W, Kg, Qg and Aqk
  // fragment once from shared memory instead of once per warp, and issue a 64 x N product per instruction. W, Kg
  // and Qg are then staged as two 64-key halves (swh: K-major for Kg^T and W^T, MN-major for Kg, Qg and W, as in the
  // forward's walk); mma.sync (sm_100a / sm_103a) reads them as sw128 rows.
  static constexpr bool WGMMA = KDA_HAS_WGMMA && NW % 4 == 0;
  // forward stage: W, Kg (bf16), U tile (fp16 [64][UL], scaled), U's scale (16 bytes: 2^e, 0, 0, 0), gamma
  static constexpr int FW_W = 0, FW_KG = 16384, FW_U = 32768;
  static constexpr int FW_USC = FW_U + C * UL * 2;
  static constexpr int FW_GAM = FW_USC + 16;
  static constexpr int FW_STAGE = (FW_GAM + 512 + 1023) / 1024 * 1024;  // stage 1's tiles on 1024-byte groups
  // reverse stage: W, Kg, Qg (bf16), Aqk hi / lo (sw64), dO tile (bf16 [64][COLS], swizzled), gamma
  static constexpr int RW_W = 0, RW_KG = 16384, RW_QG = 32768, RW_AQH = 49152, RW_AQL = 57344, RW_DO = 65536;
  static constexpr int RW_GAM = RW_DO + C * COLS * 2;
  static constexpr int RW_STAGE = (RW_GAM + 512 + 1023) / 1024 * 1024;
  static_assert(2 * RW_STAGE <= 232448 && 2 * FW_STAGE <= 232448, "walk shared memory");
};

// A record's bf16 [64][128] W, Kg or Qg into a walk stage: swh (the wgmma layouts) or sw128 rows (mma.sync).
template <int NT, bool SWH>
__device__ __forceinline__ void load_walk_operand(bf16* dst, const bf16* src, int tid) {
  if constexpr (SWH) load_rows<NT, C, D / 8>(dst, 64, src, D, C, tid, [](int r, int c) { return swh(r, c); });
  else load_bf16<128, NT>(dst, src, D, C, tid);
}

// The power of two sc with m sc in [2^14, 2^15) for a finite m > 0 (1 for m = 0): values up to m stored as fp16 times
// sc keep fp16's 11 significant bits down to 2^-14 of m and cannot overflow (kda_bwd.h, V_new, dV_new and dh).
__device__ __forceinline__ float store_scale(float m) {
  if (!(m > 0.f)) return 1.f;
  const int e = static_cast<int>((__float_as_uint(m) >> 23) & 0xff) - 127;  // floor(log2 m) for a normal m
  const int k = 14 - e < -126 ? -126 : (14 - e > 127 ? 127 : 14 - e);
  return __uint_as_float(static_cast<uint32_t>(k + 127) << 23);
}
// the largest |x| of a warp's accumulator tiles (four independent chains, then the lanes)
template <int N>
__device__ __forceinline__ float frag_absmax(const float (&t)[N][4]) {
  float m[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) m[e] = fmaxf(m[e], fabsf(t[n][e]));
  return warp_max(fmaxf(fmaxf(m[0], m[1]), fmaxf(m[2], m[3])));
}

// One warp's V_new^T or dV_new^T (16 value columns, the 64 tokens of a chunk; t = its accumulators, token step ks in
// t[2 ks], t[2 ks + 1]) as fp16 A-fragment words at the warp's power of two, into its half of a record slot (kRecVn /
// kRecDvn layout, kda_bwd.h; `half` = the slot + 256 z bytes): each store writes the warp's 32 words contiguously.
// The gradient kernel loads them (load_walk_tiles, convert_walk_tiles) instead of recomputing both products. Pinned stores
// (st_global_pinned): plain ones, sunk by the compiler, keep the words live (the reverse walk spilled 120 bytes
// instead of 4 with plain stores of the hi + lo words).
__device__ __forceinline__ void store_half_f16(char* half, const float (&t)[8][4], int warp, int lane) {
  const float sc = store_scale(frag_absmax(t));
  char* row0 = half + 16 * warp * kWalkRowBytes + 4 * lane;  // rows 16 warp + 4 ks + i: offsets in the instructions
  static_for<16>([&](auto u) {
    constexpr int ks = decltype(u)::value / 4, i = decltype(u)::value % 4;
    const float(&x)[4] = t[2 * ks + (i >> 1)];
    st_global_pinned_at<(4 * ks + i) * kWalkRowBytes>(row0, pack_f16(x[2 * (i & 1)] * sc, x[2 * (i & 1) + 1] * sc));
  });
  if (lane == 0) *reinterpret_cast<float*>(half + kVnScaleOff + 4 * warp) = 1.f / sc;  // exact: a power of two
}
// h (hi only: bf16, !F16) or dh (F16: fp16 at the warp's power of two, its inverse to *scale) of one chunk-head, value
// half z (`half` = the chunk-head's state + its half's offset): the warp's 16 value columns x 128 keys as words of
// adjacent keys, each store 128 contiguous bytes (kda_bwd.h). The gradient kernel reads them with stage_states.
template <bool F16>
__device__ __forceinline__ void store_state(char* half, float* scale, const float (&ST)[16][4], int warp, int lane) {
  const float sc = F16 ? store_scale(frag_absmax(ST)) : 1.f;
  char* row0 = half + 32 * warp * 128 + 4 * lane;  // rows 32 warp + u, u = 2 nt + eh
  static_for<32>([&](auto u) {
    constexpr int nt = decltype(u)::value / 2, eh = decltype(u)::value % 2, off = decltype(u)::value * 128;
    const float x0 = ST[nt][2 * eh], x1 = ST[nt][2 * eh + 1];
    st_global_pinned_at<off>(row0, F16 ? pack_f16(x0 * sc, x1 * sc) : pack_bf16(x0, x1));
  });
  if (F16 && lane == 0) scale[warp] = 1.f / sc;
}
// chunk-head c, h of a state array of `bytes` per chunk-head whose value halves are `half_bytes` apart
__device__ __forceinline__ char* state_half(char* base, int c, int h, int H, int col0, int bytes, int half_bytes) {
  return base + (static_cast<int64_t>(c) * H + h) * bytes + half_bytes * (col0 / 64);
}

__device__ __forceinline__ char* half_slot(const Args& a, int c, int h, int slot, int col0) {
  return a.prep + (static_cast<int64_t>(c) * a.H + h) * kPrepBytes + slot + 4 * col0;  // col0 = 64 z
}

// ST = ST Diag(gamma) (gamma fp32 [128] in shared memory): S^T's columns are keys.
__device__ __forceinline__ void decay_state(float (&ST)[16][4], const float* sGam, int l4) {
#pragma unroll
  for (int nt = 0; nt < 16; ++nt) {
    const float ga0 = sGam[nt * 8 + 2 * l4], ga1 = sGam[nt * 8 + 2 * l4 + 1];
    ST[nt][0] *= ga0;
    ST[nt][1] *= ga1;
    ST[nt][2] *= ga0;
    ST[nt][3] *= ga1;
  }
}

// acc (this warp's 16 value columns x 64 tokens) += (-1)^NEG S^T B^T by wgmma, after the products `pre` issues into
// the same commit group: S^T from the state's accumulators as hi + lo A operands (eight 16-key steps), B = W or Kg of
// a stage, bf16 [64 tokens][128 keys] as swh, read K-major (rows = N = tokens). The wgmma form of state_tile_mul;
// A registers that `pre` reads stay the caller's to fence after. `post` runs while the products are in flight (stores
// of registers the products do not touch: they leave the step's critical path).
struct NoWork {
  __device__ __forceinline__ void operator()() const {}
};
template <bool NEG, class Pre, class Post = NoWork>
__device__ __forceinline__ void mul64_wgmma(float (&acc)[8][4], const float (&ST)[16][4], const bf16* B, Pre&& pre,
                                            Post&& post = Post{}) {
  uint32_t sh[8][4], sl[8][4];
#pragma unroll
  for (int ks = 0; ks < 8; ++ks) {
    split_afrag(ST[2 * ks], ST[2 * ks + 1], sh[ks], sl[ks]);
    if constexpr (NEG) negate_split(sh[ks], sl[ks]);
  }
  fence_frags(acc);
  wgmma_fence();  // acc and the A registers were written by ordinary instructions
  pre();
  const uint64_t db = sw128_desc(B);
#pragma unroll
  for (int ks = 0; ks < 8; ++ks) {
    const uint64_t k = (ks >> 2) * (8192 >> 4) + (ks & 3) * 2;  // the 64-key half, then 32 bytes per 16 keys
    wgmma_n64_rs(acc, sh[ks], db + k);
    wgmma_n64_rs(acc, sl[ks], db + k);
  }
  wgmma_commit();
  post();
  wgmma_wait0();
  fence_frags(acc);
  fence_frags(sh);
  fence_frags(sl);
}

// ST += V^T B (hi + lo of V^T, four 16-token steps) by wgmma, after the products `pre` issues into the same
// commit group: B = Kg or W of a stage, bf16 [64 tokens][128 keys] as swh, read MN-major (rows = K = tokens, the two
// 64-key halves of N 8192 bytes apart), as the mma.sync path's state_tile_rank16 does. A registers that `pre` reads
// stay the caller's to fence after; `post` as in mul64_wgmma.
template <class Pre, class Post = NoWork>
__device__ __forceinline__ void rank64_wgmma(float (&ST)[16][4], uint32_t (&vh)[4][4], uint32_t (&vl)[4][4],
                                             const bf16* B, Pre&& pre, Post&& post = Post{}) {
  fence_frags(ST);
  fence_frags(vh);
  fence_frags(vl);
  wgmma_fence();  // ST (scaled by gamma) and V^T were written by ordinary instructions
  pre();
  const uint64_t db = sw128_desc(B, 8192);
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    wgmma_n128_rs_mn(ST, vh[ks], db + ks * (2048 >> 4));
    wgmma_n128_rs_mn(ST, vl[ks], db + ks * (2048 >> 4));
  }
  wgmma_commit();
  post();
  wgmma_wait0();
  fence_frags(ST);
  fence_frags(vh);
  fence_frags(vl);
}

// A walk's CTA: NW warps step the state (consumers), a warpgroup after them fills a ring of SLOTS stages of STAGE
// bytes by cp.async, up to SLOTS chunks ahead of the step (kda_tile_ring.cuh); a consumer releases a stage once its
// step's products are done, so no CTA-wide barrier stands between steps.
template <int NW, int STAGE, int MAX_SLOTS, int PRODUCER_REGS, int MIN_CTAS>
struct WalkRing {
  static constexpr int NC = WalkShape<NW>::NT;  // consumer (state) threads
  static constexpr int NP = 128;                // producer threads: a whole warpgroup, setmaxnreg's unit
  static constexpr int NT = NC + NP;
  static constexpr int kStage = STAGE;
  static constexpr int SLOTS = (232448 - 64) / STAGE < MAX_SLOTS ? (232448 - 64) / STAGE : MAX_SLOTS;
  static constexpr int SMEM = SLOTS * STAGE + static_cast<int>(sizeof(pipe::RingBarriers<SLOTS>));
  // Registers: MIN_CTAS CTAs of NT threads per SM start at kLaunchRegs each (the launch bound); when that is below
  // 255 the producer gives back to PRODUCER_REGS and the state warps take the rest (kShareRegs).
  static constexpr int kMinCtas = MIN_CTAS;
  static constexpr int kLaunchRegs = 65536 / (NT * MIN_CTAS) / 8 * 8;
  static constexpr bool kShareRegs = kLaunchRegs < 255;
  static constexpr int kProducerRegs = PRODUCER_REGS;
  static constexpr int kConsumerRegs = (kLaunchRegs * NT - NP * PRODUCER_REGS) / NC / 8 * 8;
  static_assert(SLOTS >= 2 && SMEM * MIN_CTAS <= 232448, "walk shared memory");
  static_assert(!kShareRegs || (kConsumerRegs <= 256 && kProducerRegs < kLaunchRegs), "setmaxnreg's range");
};
// The reverse walk's ring: 3 stages at NW = 4, 2 at NW = 8, one CTA per SM, registers 72 / 216 at NW = 8. The
// forward walk's: 2 stages, two CTAs per SM at NW = 4 (86 KB each, as tuning.WALK_SMS counts), registers 40 / 216
// at NW = 4 and 56 / 224 at NW = 8. The producer's counts are ones it compiles to without a spill on either side.
template <int NW>
using RevRing = WalkRing<NW, WalkShape<NW>::RW_STAGE, 3, 72, 1>;
template <int NW>
using FwdRing = WalkRing<NW, WalkShape<NW>::FW_STAGE, 2, NW == 4 ? 40 : 56, NW == 4 ? 2 : 1>;

// The ring's barriers (after its SLOTS stages), set up by thread 0 before a CTA-wide barrier.
template <class Ring>
__device__ __forceinline__ pipe::RingBarriers<Ring::SLOTS>& walk_ring(char* smem) {
  auto& ring = *reinterpret_cast<pipe::RingBarriers<Ring::SLOTS>*>(smem + Ring::SLOTS * Ring::kStage);
  if (threadIdx.x == 0) {
    ring.init(Ring::NC, Ring::NP);
    pipe::fence_mbarrier_init();
  }
  __syncthreads();
  return ring;
}
// A thread's warpgroup, made warp-uniform for the compiler (a shuffle of lane 0's), so that each side's code is
// allocated the registers its setmaxnreg gives it.
__device__ __forceinline__ int walk_warpgroup() {
  return __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
}

// The producer warpgroup of a walk CTA (threads ring::NC ..): chunk after chunk of the run into the ring, in the
// consumers' order (REVERSE: from the run's last); load(st, c, ptid) stages chunk c by producer thread ptid.
template <class Ring, bool REVERSE, class Load>
__device__ __forceinline__ void walk_produce(pipe::RingBarriers<Ring::SLOTS>& ring, char* smem, int first, int nc,
                                             const Load& load) {
  if constexpr (Ring::kShareRegs) pipe::regs_release<Ring::kProducerRegs>();
  pipe::RingPos<Ring::SLOTS> pos;
  for (int jj = 0; jj < nc; ++jj) {
    pipe::ring_acquire_cp_async(ring, pos);
    load(smem + pos.slot * Ring::kStage, REVERSE ? first + nc - 1 - jj : first + jj,
         static_cast<int>(threadIdx.x) - Ring::NC);
    pipe::ring_commit_cp_async(ring, pos);
    pos.advance();
  }
  cp_async_wait_all();  // (its pieces have landed once the consumers saw them; none may be left at exit)
}

// chunk c's stage of the forward walk, by the producer's thread tid (of FwdRing<NW>::NP)
template <int NW>
__device__ __forceinline__ void fwd_stage_load(char* st, const Args& a, int c, int h, int col0, bool withU, int tid) {
  using Sh = WalkShape<NW>;
  constexpr int NT = FwdRing<NW>::NP;
  const char* rec = a.prep + (static_cast<int64_t>(c) * a.H + h) * kPrepBytes;
  load_walk_operand<NT, Sh::WGMMA>(reinterpret_cast<bf16*>(st + Sh::FW_W), reinterpret_cast<const bf16*>(rec + kRecW), tid);
  load_walk_operand<NT, Sh::WGMMA>(reinterpret_cast<bf16*>(st + Sh::FW_KG), reinterpret_cast<const bf16*>(rec + kRecKg), tid);
  if (withU) {  // U's rows of the CTA's value halves (kda_bwd.h kRecU): "rows" (i, half) of 128 bytes
    constexpr int NZ = Sh::COLS / 64;
    const char* u = rec + kRecU + 4 * col0;  // + 256 z0
    load_rows<NT, C * NZ, 8>(reinterpret_cast<uint16_t*>(st + Sh::FW_U), Sh::UL / NZ,
                             reinterpret_cast<const uint16_t*>(u), kURowBytes / NZ / 2, C * NZ, tid,
                             [](int r, int c) { return (r / NZ) * Sh::UL + (r % NZ) * 64 + c; });
    if (tid == 0) cp_async16(st + Sh::FW_USC, u + kUScaleOff, true);
  }
  load_f32<NT, 1, D>(reinterpret_cast<float*>(st + Sh::FW_GAM), D, reinterpret_cast<const float*>(rec + kRecGam), 0, 1, tid);
}

// A walk CTA's place, the same in both walks and both modes: row r of a.runs (first chunk, chunks nc, idx sidx, src
// ssrc), head h, its state columns (col0 the CTA's first, vcol this warp's) and whether it carries the second part of
// the virtual columns: every walk CTA does, a summary's CTAs on E / F (the part that takes U or dO) do.
// (The entering state's selection and the leaving state's store stay in the kernels: as member functions they compile
// to other instruction orders.)
template <bool SUMMARY, int COLS>
struct WalkCta {
  const int tid, lane, warp, r, h, H, vz;
  const bool carries;
  const int col0, vloc, vcol, g4, l4, first, nc, sidx, ssrc;
  // (threadIdx.x from the kernel itself: only there does the compiler bound it by __launch_bounds__)
  __device__ __forceinline__ WalkCta(const Args& a, int thread)
      : tid(thread), lane(tid & 31), warp(tid >> 5), r(blockIdx.x), h(blockIdx.y), H(a.H),
        vz(blockIdx.z * COLS), carries(!SUMMARY || vz >= D), col0(vz & (D - 1)), vloc(warp * 16), vcol(col0 + vloc),
        g4(lane >> 2), l4(lane & 3), first(a.runs[4 * r]), nc(a.runs[4 * r + 1]), sidx(a.runs[4 * r + 2]),
        ssrc(a.runs[4 * r + 3]) {}
};

// Rows of a.runs: (first chunk, chunks, idx, src). Walk (!SUMMARY): the state enters from a.fold[idx]
// when src == 1, else from a.state_in[idx] (zero when state_in is null or idx < 0); h is written, and the
// state leaving row r to a.walk_out[r] when that is set.
// SUMMARY: virtual columns [M (0..127) | E (128..255)] of the segment's affine map from a zero state,
// grid.z = 256 / (16 NW), written to m_out[idx] / e_out[idx] (M indexed [key_out][key_in]).
// Threads: FwdRing<NW> (NW state warps, then the producer warpgroup).
template <bool SUMMARY, int NW>
__global__ void __launch_bounds__(FwdRing<NW>::NT, FwdRing<NW>::kMinCtas) fwd_walk_kernel(const Args a) {
  using Sh = WalkShape<NW>;
  using Ring = FwdRing<NW>;
  constexpr int WCOLS = Sh::COLS, WUL = Sh::UL, FW_STAGE = Sh::FW_STAGE, SLOTS = Ring::SLOTS;
  extern __shared__ __align__(128) char smem[];
  // wgmma's swizzle is on address bits: its B tiles must start on 1024-byte boundaries of the window
  if (Sh::WGMMA && (smem_u32(smem) & 1023) != 0) __trap();
  const WalkCta<SUMMARY, WCOLS> w(a, threadIdx.x);
  const int lane = w.lane, warp = w.warp, r = w.r, h = w.h, H = w.H, col0 = w.col0, vloc = w.vloc, vcol = w.vcol,
            g4 = w.g4, l4 = w.l4, first = w.first, nc = w.nc, sidx = w.sidx;
  const bool withU = w.carries;  // the E part (or the walk) carries U; the M part does not
  auto& ring = walk_ring<Ring>(smem);
  const int wg = walk_warpgroup();
  if (wg >= Ring::NC / 128) {  // the producer: the run's stages from its first chunk
    walk_produce<Ring, false>(ring, smem, first, nc, [&](char* st, int c, int ptid) {
      fwd_stage_load<NW>(st, a, c, h, col0, withU, ptid);
    });
    return;
  }
  if constexpr (Ring::kShareRegs) pipe::regs_claim<Ring::kConsumerRegs>();
  float ST[16][4];
  {
    const float* src = nullptr;
    if (!SUMMARY) {
      if (w.ssrc == 1) src = a.fold + (static_cast<int64_t>(sidx) * H + h) * D * D;
      else if (a.state_in != nullptr && sidx >= 0) src = a.state_in + (static_cast<int64_t>(sidx) * H + h) * D * D;
    }
    state_tile_init<!SUMMARY>(ST, src, !withU, vcol, g4, l4);
  }
  pipe::RingPos<SLOTS> pos;
  for (int j = 0; j < nc; ++j) {
    pipe::ring_wait(ring, pos);
    if constexpr (Sh::WGMMA) fence_async_smem();  // the stage's cp.async writes, then wgmma's reads
    char* st = smem + pos.slot * FW_STAGE;
    const bf16* sW = reinterpret_cast<const bf16*>(st + Sh::FW_W);
    const bf16* sKg = reinterpret_cast<const bf16*>(st + Sh::FW_KG);
    const uint16_t* sU = reinterpret_cast<const uint16_t*>(st + Sh::FW_U);
    const float* sGam = reinterpret_cast<const float*>(st + Sh::FW_GAM);
    // h of this chunk (the state entering it), stored while V_new's product runs
    auto store_h = [&] {
      if constexpr (!SUMMARY) {
        store_state<false>(state_half(a.h, first + j, h, H, vcol & 64, kHiStateBytes, kHiHalfBytes), nullptr, ST,
                           warp & 3, lane);
      }
    };
    // V_new^T = U^T - S^T W^T
    float VN[8][4];
    const float uinv = withU ? *reinterpret_cast<const float*>(st + Sh::FW_USC) : 0.f;  // exact: a power of two
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        VN[nt][e] = withU ? f16_to_f32(sU[(nt * 8 + 2 * l4 + (e & 1)) * WUL + vloc + g4 + 8 * (e >> 1)]) * uinv : 0.f;
    if constexpr (Sh::WGMMA) {
      mul64_wgmma<true>(VN, ST, sW, [] {}, store_h);
    } else {
      store_h();
      state_tile_mul<true>(VN, ST, sW, lane);
    }
    uint32_t vh[4][4], vl[4][4];
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) split_afrag(VN[2 * ks], VN[2 * ks + 1], vh[ks], vl[ks]);
    // V_new over this chunk's U (read above, from the stage), while the state update runs
    auto store_vn = [&] {
      if constexpr (!SUMMARY) store_half_f16(half_slot(a, first + j, h, kRecVn, vcol & 64), VN, warp & 3, lane);
    };
    // S^T = S^T Diag(gamma) + V_new^T Kg
    decay_state(ST, sGam, l4);
    if constexpr (Sh::WGMMA) {
      rank64_wgmma(ST, vh, vl, sKg, [] {}, store_vn);
    } else {
      store_vn();
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) state_tile_rank16(ST, vh[ks], vl[ks], sKg, ks, lane);
    }
    pipe::ring_release(ring, pos);  // the step's products are done with the stage: the producer may refill it
    pos.advance();
  }
  if constexpr (SUMMARY) {
    float* dst = (withU ? a.e_out : a.m_out) + (static_cast<int64_t>(sidx) * H + h) * D * D;
    state_tile_store(dst, ST, vcol, g4, l4);
  } else if (a.walk_out != nullptr) {  // the state leaving the piece, FP32: the next piece starts from it exactly
    state_tile_store(a.walk_out + (static_cast<int64_t>(r) * H + h) * D * D, ST, vcol, g4, l4);
  }
}

// chunk c's stage, by the producer's thread ptid (of RevRing<NW>::NP)
template <int NW>
__device__ __forceinline__ void rev_stage_load(char* st, const Args& a, int c, int h, int col0, bool withF, int tid) {
  using Sh = WalkShape<NW>;
  constexpr int NT = RevRing<NW>::NP;
  const char* rec = a.prep + (static_cast<int64_t>(c) * a.H + h) * kPrepBytes;
  load_walk_operand<NT, Sh::WGMMA>(reinterpret_cast<bf16*>(st + Sh::RW_W), reinterpret_cast<const bf16*>(rec + kRecW), tid);
  load_walk_operand<NT, Sh::WGMMA>(reinterpret_cast<bf16*>(st + Sh::RW_KG), reinterpret_cast<const bf16*>(rec + kRecKg), tid);
  load_f32<NT, 1, D>(reinterpret_cast<float*>(st + Sh::RW_GAM), D, reinterpret_cast<const float*>(rec + kRecGam), 0, 1, tid);
  if (withF) {
    load_walk_operand<NT, Sh::WGMMA>(reinterpret_cast<bf16*>(st + Sh::RW_QG), reinterpret_cast<const bf16*>(rec + kRecQg), tid);
    load_lower_bf16<NT>(reinterpret_cast<bf16*>(st + Sh::RW_AQH), reinterpret_cast<const bf16*>(rec + kRecAqkH), tid);
    load_lower_bf16<NT>(reinterpret_cast<bf16*>(st + Sh::RW_AQL), reinterpret_cast<const bf16*>(rec + kRecAqkL), tid);
    const int64_t tok = a.chunks[2 * c];
    const int nrows = a.chunks[2 * c + 1];
    load_bf16<Sh::COLS, NT>(reinterpret_cast<bf16*>(st + Sh::RW_DO),
                            static_cast<const bf16*>(a.dout) + (tok * a.H + h) * D + col0, static_cast<int64_t>(a.H) * D,
                            nrows, tid);
  }
}

// SUMMARY: virtual columns [M^T (0..127) | F (128..255)]; else 128 value columns; grid.z = columns / (16 NW).
// Threads: RevRing<NW> (NW state warps, then the producer warpgroup).
template <bool SUMMARY, int NW>
__global__ void __launch_bounds__(RevRing<NW>::NT, RevRing<NW>::kMinCtas) rev_walk_kernel(const Args a) {
  using Sh = WalkShape<NW>;
  using Ring = RevRing<NW>;
  constexpr int WCOLS = Sh::COLS, RW_STAGE = Sh::RW_STAGE, SLOTS = Ring::SLOTS;
  extern __shared__ __align__(128) char smem[];
  // wgmma's swizzle is on address bits: its B tiles must start on 1024-byte boundaries of the window
  if (Sh::WGMMA && (smem_u32(smem) & 1023) != 0) __trap();
  // rows of a.runs as in the forward walk, the state entering from a.dstate_out; a summary writes mt_out / f_out
  const WalkCta<SUMMARY, WCOLS> w(a, threadIdx.x);
  const int lane = w.lane, warp = w.warp, r = w.r, h = w.h, H = w.H, col0 = w.col0, vloc = w.vloc, vcol = w.vcol,
            g4 = w.g4, l4 = w.l4, first = w.first, nc = w.nc, sidx = w.sidx;
  const bool withF = w.carries;  // the F part (dO terms) vs the M^T part
  auto& ring = walk_ring<Ring>(smem);
  const int wg = walk_warpgroup();
  if (wg >= Ring::NC / 128) {  // the producer: the run's stages from its last chunk
    walk_produce<Ring, true>(ring, smem, first, nc, [&](char* st, int c, int ptid) {
      rev_stage_load<NW>(st, a, c, h, col0, withF, ptid);
    });
    return;
  }
  if constexpr (Ring::kShareRegs) pipe::regs_claim<Ring::kConsumerRegs>();
  float ST[16][4];
  {
    const float* src = nullptr;
    if (!SUMMARY) {
      if (w.ssrc == 1) src = a.fold + (static_cast<int64_t>(sidx) * H + h) * D * D;
      else if (a.dstate_out != nullptr && sidx >= 0) src = a.dstate_out + (static_cast<int64_t>(sidx) * H + h) * D * D;
    }
    state_tile_init<!SUMMARY>(ST, src, !withF, vcol, g4, l4);
  }
  pipe::RingPos<SLOTS> pos;
  for (int jj = 0; jj < nc; ++jj) {
    const int j = nc - 1 - jj;
    pipe::ring_wait(ring, pos);
    if constexpr (Sh::WGMMA) fence_async_smem();  // the stage's cp.async writes, then wgmma's reads
    char* st = smem + pos.slot * RW_STAGE;
    const bf16* sW = reinterpret_cast<const bf16*>(st + Sh::RW_W);
    const bf16* sKg = reinterpret_cast<const bf16*>(st + Sh::RW_KG);
    const bf16* sQg = reinterpret_cast<const bf16*>(st + Sh::RW_QG);
    const bf16* sAqh = reinterpret_cast<const bf16*>(st + Sh::RW_AQH);
    const bf16* sAql = reinterpret_cast<const bf16*>(st + Sh::RW_AQL);
    const bf16* sDO = reinterpret_cast<const bf16*>(st + Sh::RW_DO);
    const float* sGam = reinterpret_cast<const float*>(st + Sh::RW_GAM);
    // dh of this chunk (the gradient of the state leaving it), stored while dV_new's products run
    auto store_dh = [&] {
      if constexpr (!SUMMARY) {
        char* dh = a.dh + (static_cast<int64_t>(first + j) * H + h) * kDhStateBytes;
        store_state<true>(dh + kDhHalfBytes * (vcol / 64), reinterpret_cast<float*>(dh + kDhScaleOff + 16 * (vcol / 64)),
                          ST, warp & 3, lane);
      }
    };
    // dV_new for the gradient kernel, stored while dS's update runs
    auto store_dvn = [&](const float (&dv)[8][4]) {
      if constexpr (!SUMMARY) store_half_f16(half_slot(a, first + j, h, kRecDvn, vcol & 64), dv, warp & 3, lane);
    };
    // dV_new^T = dO^T Aqk + dS^T Kg^T
    float DV[8][4];
    zero_frags(DV);
    uint32_t ado[Sh::WGMMA ? 4 : 1][4];  // dO^T as A operands, k = tokens (wgmma: kept for dS^T's update)
    if constexpr (Sh::WGMMA) {
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        if (withF) lda_t<WCOLS>(ado[ks], sDO, vloc, ks * 16, lane);
        else ado[ks][0] = ado[ks][1] = ado[ks][2] = ado[ks][3] = 0u;  // (summary M^T part: unused)
      }
      mul64_wgmma<false>(DV, ST, sKg, [&] {
        if (withF) {  // Aqk read MN-major (rows = K = its rows t); its zero upper blocks add zeros
          const uint64_t dah = sw128_desc(sAqh), dal = sw128_desc(sAql);
#pragma unroll
          for (int ks = 0; ks < 4; ++ks) {
            wgmma_n64_rs_mn(DV, ado[ks], dah + ks * (2048 >> 4));
            wgmma_n64_rs_mn(DV, ado[ks], dal + ks * (2048 >> 4));
          }
        }
      }, store_dh);
      fence_frags(ado);
    } else {
      store_dh();
      if (withF) {
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
          uint32_t ad[4];
          lda_t<WCOLS>(ad, sDO, vloc, ks * 16, lane);
#pragma unroll
          for (int np = 0; np < 4; ++np) {
            if (np <= ks) {
              uint32_t bh[4], bl[4];
              ldb_t<64>(bh, sAqh, ks * 16, np * 16, lane);
              ldb_t<64>(bl, sAql, ks * 16, np * 16, lane);
              mma_n16(DV[2 * np], DV[2 * np + 1], ad, bh);
              mma_n16(DV[2 * np], DV[2 * np + 1], ad, bl);
            }
          }
        }
      }
      state_tile_mul<false>(DV, ST, sKg, lane);
      store_dvn(DV);
    }
    // dS^T = dS^T Diag(gamma) + s dO^T Qg - dV_new^T W
    decay_state(ST, sGam, l4);
    if constexpr (Sh::WGMMA) {
      uint32_t vh[4][4], vl[4][4];  // -dV_new^T, k = tokens
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        split_afrag(DV[2 * ks], DV[2 * ks + 1], vh[ks], vl[ks]);
        negate_split(vh[ks], vl[ks]);
      }
      rank64_wgmma(ST, vh, vl, sW, [&] {
        if (withF) {  // Qg MN-major, like Kg in the forward walk
          const uint64_t dq = sw128_desc(sQg, 8192);
#pragma unroll
          for (int ks = 0; ks < 4; ++ks) wgmma_n128_rs_mn(ST, ado[ks], dq + ks * (2048 >> 4));
        }
      }, [&] { store_dvn(DV); });
      fence_frags(ado);
    } else {
      if (withF) {
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
          uint32_t ad[4];
          lda_t<WCOLS>(ad, sDO, vloc, ks * 16, lane);
#pragma unroll
          for (int np = 0; np < 8; ++np) {
            uint32_t b[4];
            ldb_t<128>(b, sQg, ks * 16, np * 16, lane);
            mma_n16(ST[2 * np], ST[2 * np + 1], ad, b);
          }
        }
      }
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        uint32_t vh[4], vl[4];
        split_afrag(DV[2 * ks], DV[2 * ks + 1], vh, vl);
        negate_split(vh, vl);
        state_tile_rank16(ST, vh, vl, sW, ks, lane);
      }
    }
    pipe::ring_release(ring, pos);  // the step's products are done with the stage: the producer may refill it
    pos.advance();
  }
  if constexpr (SUMMARY) {
    float* dst = (withF ? a.f_out : a.mt_out) + (static_cast<int64_t>(sidx) * H + h) * D * D;
    state_tile_store(dst, ST, vcol, g4, l4);
  } else if (a.walk_out != nullptr) {  // the gradient of the state entering the piece: the next (earlier) piece's
    state_tile_store(a.walk_out + (static_cast<int64_t>(r) * H + h) * D * D, ST, vcol, g4, l4);
  }
}

// ================================================================================================
// chunk gradients
// ================================================================================================
// Precision (docs/kernels.md §5): the products take V_new and dV_new, the phase-B operands (dW, K o e^G, dA, A^T dA,
// dP, s dAqk), the anchored pairwise operands (Cc, the K and Q row operands) and dS in dKg as bf16 hi + lo
// pairs (three products: wgemm's and wg_gemm's SA / SB), S and A as hi only (one). Chosen on the CPU emulation against
// FP64 (each pair dropped raised dq / dk by ~40 %, dg tenfold or dk / dv threefold; pairs of S and A changed nothing
// visible) and on the H200 (V_new / dV_new hi only is 6 % faster, but W = 2 and W = 1 then differ by 2.3e-3 on dbeta,
// past its 2e-3 bound).
// Shared memory map (bytes): phase-B tiles lie over phase-A tiles that are dead by then. G, q and k sit over
// half 0's V_new / dV_new tiles and a gap that phase A leaves free, where they could land while half 1
// computes; requested there, the request code cost ptxas ~80 bytes of spill and the time it saved.
// phase A (state products, two halves of the value columns); V_new / dV_new of each half come from the
// walks (fp16, converted to bf16 hi / lo here; transposed: [value column][token], sw64)
constexpr int A_DO = 0;       // dO, bf16 swh [64][128] (the two value halves are wgmma's K-major A tiles)
constexpr int A_V = 49152;    // v, swh
constexpr int A_SH = 65536;   // S^T hi, dS^T hi / lo of the value half: bf16 swh [64][128] (h holds no lo of S)
constexpr int A_AH = 81920;   // A hi, sw64, kept through phase B3 (the 8 KiB after it unused)
constexpr int A_DH = 98304;
constexpr int A_DL = 114688;
constexpr int A_DGP = 196608; // fp32 [NT][8] dgamma partials (phase A)
// per half z: V_new^T, dV_new^T hi / lo (sw64 [64][64]), half 1 at 16 KiB, half 0 at 128 KiB
__host__ __device__ constexpr int a_vn(int z, int tile) { return (z == 0 ? 131072 : 16384) + 8192 * tile; }
constexpr int kVNH = 0, kVNL = 1, kDVH = 2, kDVL = 3;
// phase B
constexpr int B_G = 131072;   // fp32 [64][128] (f32_at<true>), to the end
constexpr int B_Q = 163840;   // bf16 sw128, to the pairwise columns
constexpr int B_K = 180224;   // to the end
constexpr int B_DWH = 0;      // dW, swh (B1-B2)
constexpr int B_DWL = 16384;
constexpr int B_SDAH = 32768; // s dAqk, sw64 (B1 to the pairwise columns)
constexpr int B_SDAL = 40960;
constexpr int B_XH = 49152;   // K o exp(G), swh (B1-B2)
constexpr int B_XL = 65536;
constexpr int B_DAH = 98304;  // dA, sw64 (B2-B3)
constexpr int B_DAL = 106496;
constexpr int B_T1H = 114688; // A^T dA, sw64 (B3)
constexpr int B_T1L = 122880;
constexpr int B_P = 0;        // P staged, fp32 [64][kPLd] (B3)
constexpr int kPLd = 72;      // padded rows: B3's float2 reads in the accumulator pattern hit distinct banks
constexpr int B_DPH = 196608; // dP, sw64 (B3 to the pairwise columns; over the dgamma partials)
constexpr int B_DPL = 204800;
constexpr int B_DG = 0;       // fp32 [64][128] dG staging (B5)
// B4' (one-anchor chunks): its operands, swh tiles over the dead phase-B tiles, clear of s dAqk, dP, G, q and k;
// B4 (per-block anchors) stages its three operand pairs in the same places (sw128)
constexpr int O_KRH = 0;      // K o e^(G - G_63)
constexpr int O_KRL = 16384;
constexpr int O_CCH = 49152;  // K o e^(G_0 - G)
constexpr int O_CCL = 65536;
constexpr int O_QRH = 81920;  // Q o e^(G - G_63)
constexpr int O_QRL = 98304;
// ... and, by product (16 warps on wgmma), its three accumulators on their way to the warp tiling: fp32 [64][128]
// (f32_at<true>) tiles of the rows of s dAqk, the rows of dP and the columns, over the dead operands, clear of dG (B5)
constexpr int O_T = 32768;
static_assert(O_KRL + C * D * 2 <= B_SDAH && B_SDAL + C * C * 2 <= O_CCH && O_QRL + C * D * 2 <= B_G, "B4' operands");
static_assert(B_DG + C * D * 4 <= O_T && O_T + 3 * C * D * 4 <= B_G, "B4' hand-over");
// phase A by product (16 warps on wgmma): dQg, dKg (fp32 [64][128], f32_at<true>) and dAU (fp32 [64][64]) on their way
// to the warp tiling, over phase-A tiles dead by then and clear of dW / s dAqk (0 .. 48 KiB) and the dgamma partials
constexpr int R_Q = 49152;
constexpr int R_K = 98304;
constexpr int R_U = 131072;
static_assert(R_Q + C * D * 4 <= A_AH && R_K + C * D * 4 <= R_U && R_U + C * C * 4 <= A_DGP, "by-product hand-over");
constexpr int S_BETA = 212992;          // fp32 [64]
constexpr int S_DGAM = S_BETA + 256;    // fp32 [128]
constexpr int S_CS = S_DGAM + 512;      // fp32 [4][128]
constexpr int S_DB = S_CS + 2048;       // fp32 [4 CG][64] partial row sums for dbeta
constexpr int S_CF = S_DB + 4 * 4 * C * 4;  // fp32 [3][128] exp(G_16I - G_16(I-1)), I = 1..3: B4's steps
                                            // (B3-B4); before and after, the row scans' block totals (RowBlocks)
static_assert(B_P + C * kPLd * 4 <= B_SDAH, "staged P overflows");

// Warp tiling of the gradient kernel: NW warps = 4 row blocks of 16 x CG column groups. Each warp owns
// 16 rows x (128 / CG) columns of the 64 x 128 accumulators; more warps, fewer registers per thread.
template <int NW>
struct GradsTiling {
  static_assert(NW == 8 || NW == 16, "8 or 16 warps");
  static constexpr int NTH = NW * 32;
  static constexpr int CG = NW / 4;       // column groups
  static constexpr int NT128 = 16 / CG;   // 8-column mma tiles per warp of a 128-column output
  static constexpr int NT64 = 8 / CG;     // ... of a 64-column output
  static constexpr int SMEM = S_CF + 3 * D * 4;
  static_assert(SMEM <= 232448, "grads smem");
};


// The walks' V_new^T and dV_new^T of value half z (fp16 times the walk warp's 2^e, record slots kRecVn / kRecDvn in the
// walks' fragment order, kda_bwd.h) -> the sw64 tiles a_vn(z, .) [value column 64][token 64] as bf16 hi + lo, in
// two steps: load_walk_tiles requests the fp16 pieces by cp.async into the lo tiles' places
// (a 16-byte piece of unit row R holds lanes 4 g4 .. 4 g4 + 3, i.e. 8 consecutive tokens of one column; piece p = tid
// + NT k sits at the same place in every tile, so a thread's offsets are computed once for the half's tiles), and
// once they have landed, convert_walk_tiles turns each thread's own pieces (visible to it after its wait, no barrier)
// into hi and lo in place. One call per half: the kernel requests half 1's pieces in a cp.async group of their own,
// so that half 0's products do not wait for them.
template <int NT>
constexpr int kWalkPieces = C * 8 / NT;  // 16-byte pieces of one walk tile per thread
template <int NT>
__device__ __forceinline__ int walk_piece_at(int k, int tid, int& R) {  // the piece's byte offset in a tile
  const int p = tid + NT * k, g4 = p & 7;
  R = p >> 3;
  const int w = R >> 4, ks = (R >> 2) & 3, i = R & 3;
  return 2 * sw64(16 * w + g4 + 8 * (i & 1), 16 * ks + 8 * (i >> 1));
}
template <int NT>
__device__ __forceinline__ void load_walk_tiles(char* smem, const char* rec, int z, int tid) {
  static_assert(kWalkPieces<NT> * NT == C * 8, "whole pieces per thread");
#pragma unroll
  for (int k = 0; k < kWalkPieces<NT>; ++k) {
    int R;
    const int so = walk_piece_at<NT>(k, tid, R);
    const char* src = rec + R * kWalkRowBytes + 16 * ((tid + NT * k) & 7) + 256 * z;
    cp_async16(smem + a_vn(z, kVNL) + so, src + kRecVn, true);
    cp_async16(smem + a_vn(z, kDVL) + so, src + kRecDvn, true);
  }
}
// an fp16 pair times inv (a power of two) as bf16 hi + lo words: exact (an fp16 value has 11 significant bits)
__device__ __forceinline__ void f16x2_split(uint32_t w, float inv, uint32_t& hi, uint32_t& lo, float2& x) {
  x = make_float2(f16_to_f32(static_cast<uint16_t>(w & 0xffffu)) * inv, f16_to_f32(static_cast<uint16_t>(w >> 16)) * inv);
  split2(x.x, x.y, hi, lo);
}
// winv: the powers 2^e of this thread's pieces, V_new's [0] and dV_new's [1] (stage_states loads them)
template <int NT>
__device__ __forceinline__ void convert_walk_tiles(char* smem, int z, int tid, const float (&winv)[2][kWalkPieces<NT>]) {
#pragma unroll
  for (int k = 0; k < kWalkPieces<NT>; ++k) {
    int R;
    const int so = walk_piece_at<NT>(k, tid, R);
    auto put = [&](float inv, int hi_tile, int lo_tile) {
      const uint4 x = *reinterpret_cast<const uint4*>(smem + a_vn(z, lo_tile) + so);
      const uint32_t v[4] = {x.x, x.y, x.z, x.w};
      uint32_t hi[4], lo[4];
      float2 t;
#pragma unroll
      for (int e = 0; e < 4; ++e) f16x2_split(v[e], inv, hi[e], lo[e], t);
      *reinterpret_cast<uint4*>(smem + a_vn(z, hi_tile) + so) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
      *reinterpret_cast<uint4*>(smem + a_vn(z, lo_tile) + so) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
    };
    put(winv[0][k], kVNH, kVNL);
    put(winv[1][k], kDVH, kDVL);
  }
}

// Value half z of S (hi, from h) and dS (from dh: fp16 times the walk warp's 2^e, kda_bwd.h) into the swh tiles S^T,
// dS^T [value column 64][key 128], through registers (dS as bf16 hi + lo: exact), and the powers of the half's walk
// tiles into winv: a 16-byte piece holds 8 adjacent keys of one value column, and its S o dS products go into the
// thread's dgamma partials of those keys. Every piece a thread moves has key block nt = (tid / 16) % 16: its 8 partials
// (summed over both halves) stay in shared memory at `mine` (registers are short during the products that follow).
template <int NT>
__device__ __forceinline__ void stage_states(char* smem, const char* S, const char* dS, const char* rec, int z, int tid,
                                             float* mine, float (&winv)[2][kWalkPieces<NT>]) {
  constexpr int KS = C * 16 / NT;  // pieces per thread
  static_assert(KS * NT == C * 16, "whole pieces per thread");
  uint4 sh[KS], dh[KS];
  float dinv[KS];
#pragma unroll
  for (int k = 0; k < KS; ++k) {
    const int p = tid + k * NT, u = p >> 3, g4 = p & 7, w = u >> 5;
    const int off = kHiHalfBytes * z + u * 128 + 16 * g4;  // h and dh share the order (row u = 2 (16 w + nt) + eh)
    sh[k] = *reinterpret_cast<const uint4*>(S + off);
    dh[k] = *reinterpret_cast<const uint4*>(dS + off);
    dinv[k] = *reinterpret_cast<const float*>(dS + kDhScaleOff + 16 * z + 4 * w);
  }
#pragma unroll
  for (int k = 0; k < kWalkPieces<NT>; ++k) {
    const int w = ((tid + NT * k) >> 3) >> 4;  // the walk warp of the piece's unit row
    winv[0][k] = *reinterpret_cast<const float*>(rec + kRecVn + kVnScaleOff + 256 * z + 4 * w);
    winv[1][k] = *reinterpret_cast<const float*>(rec + kRecDvn + kVnScaleOff + 256 * z + 4 * w);
  }
  float dg[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int k = 0; k < KS; ++k) {
    const int p = tid + k * NT, u = p >> 3, g4 = p & 7;
    const int w = u >> 5, nt = (u >> 1) & 15, eh = u & 1;
    const int so = 2 * swh(16 * w + g4 + 8 * eh, 8 * nt);  // bytes
    const uint32_t a[4] = {sh[k].x, sh[k].y, sh[k].z, sh[k].w}, d[4] = {dh[k].x, dh[k].y, dh[k].z, dh[k].w};
    uint32_t th[4], tl[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float2 t;
      f16x2_split(d[i], dinv[k], th[i], tl[i], t);
      const float2 s0 = bf2_to_f2(a[i]);
      dg[2 * i] = fmaf(s0.x, t.x, dg[2 * i]);
      dg[2 * i + 1] = fmaf(s0.y, t.y, dg[2 * i + 1]);
    }
    *reinterpret_cast<uint4*>(smem + A_SH + so) = sh[k];
    *reinterpret_cast<uint4*>(smem + A_DH + so) = make_uint4(th[0], th[1], th[2], th[3]);
    *reinterpret_cast<uint4*>(smem + A_DL + so) = make_uint4(tl[0], tl[1], tl[2], tl[3]);
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) mine[i] = z == 0 ? dg[i] : mine[i] + dg[i];
}

// The products of phase A, B2, B3 and B4' by wgmma on sm_90a (both operands from shared memory). B2, B3 (and phase A
// at 8 warps): warpgroup cg computes the 64 rows x (128 / CG or 64 / CG) columns that its four warps hold in the
// mma.sync tiling (warp w of the group = row block 16 w), so the accumulators and the epilogues are the same. Phase A
// and B4' at 16 warps go by product instead (kByProduct in the kernel): at n32 per group each of the four groups read
// the whole A operand, and the phase stayed bound by its operand bytes (docs/kernels.md); B4' at 8 warps
// stays on mma.sync. No ldmatrix or operand registers either way. Products whose K range skips a row block's zero
// blocks (A lower triangular) take the whole K range here: the added products are exact zeros. mma.sync elsewhere
// (sm_100a / sm_103a); the same products in the same order per element, so the same bits.
constexpr bool kGradsWgmma = KDA_HAS_WGMMA;
// descriptor offset (16-byte units) of k16 step ks: MN-major tiles step by 16 rows; K-major ones by 32 bytes inside
// a 64-column sw64 row, then to the next swh half
template <bool MN>
__device__ __forceinline__ uint32_t k16_step(int ks) {
  return MN ? ks * (2048 >> 4) : (ks >> 2) * (8192 >> 4) + (ks & 3) * 2;
}
// acc (this warp's 16 rows x 8 N8 columns of its group's 64-row block) += A B over KS k16 steps, hi + lo where SA /
// SB (hi*hi, lo*hi, hi*lo per step: wgemm's order); TA / TB: A stored [k][m] / B stored [k][n] (MN-major). The B
// pointers are at the group's first column (a column offset inside an MN-major row, or a row offset K-major).
template <int N8, int KS, bool TA, bool SA, bool TB, bool SB>
__device__ __forceinline__ void wg_gemm(float (&acc)[1][N8][4], const bf16* Ah, const bf16* Al, const bf16* Bh,
                                        const bf16* Bl) {
  // an MN-major tile's 64-column halves are swh's 8192 bytes apart; K-major ones leave the field unused
  auto desc = [](const bf16* t, bool mn) { return sw128_desc(t, mn ? 8192 : 16); };
  const uint64_t ah = desc(Ah, TA), bh = desc(Bh, TB), al = SA ? desc(Al, TA) : 0, bl = SB ? desc(Bl, TB) : 0;
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    const uint32_t ka = k16_step<TA>(ks), kb = k16_step<TB>(ks);
    wgmma_ss<N8, TA, TB>(acc[0], ah + ka, bh + kb);
    if constexpr (SA) wgmma_ss<N8, TA, TB>(acc[0], al + ka, bh + kb);
    if constexpr (SB) wgmma_ss<N8, TA, TB>(acc[0], ah + ka, bl + kb);
  }
}
// Column n0 of a [k][128] swh tile (an MN-major B at column n0: its half, then 2 (n0 % 64) bytes into the rows)
[[maybe_unused]] __device__ __forceinline__ const bf16* swh_col(const bf16* t, int n0) { return t + ((n0 >> 6) << 12) + (n0 & 63); }
// wgmma's accumulators are written asynchronously: the compiler must not touch them between the issue and the wait
template <int N8>
__device__ __forceinline__ void fence_acc(float (&acc)[1][N8][4]) { fence_frags(acc[0]); }
// The C rows of a bf16 [.][128] matrix -> swh tile
template <int NT>
__device__ __forceinline__ void load_bf16_swh(bf16* dst, const bf16* src, int64_t gstride, int nvalid, int tid) {
  load_rows<NT, C, D / 8>(dst, 64, src, gstride, nvalid, tid, [](int r, int c) { return swh(r, c); });
}

template <int NW>
__global__ void __launch_bounds__(NW * 32, 1) grads_kernel(const Args a) {
  using T = GradsTiling<NW>;
  constexpr int NT = T::NTH, NT128 = T::NT128, NT64 = T::NT64, CG = T::CG;
  extern __shared__ __align__(128) char smem[];
  if (kGradsWgmma && (smem_u32(smem) & 1023) != 0) __trap();  // wgmma's swizzle is on address bits
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // (chunk-major: grid (H, chunks in pieces of kMaxGridY, pieces), so that c and h stay cheap to re-read; every CTA
  // has a chunk: launch_grads_nw)
  const int c = blockIdx.y + kMaxGridY * blockIdx.z;
  const int h = blockIdx.x, H = a.H;
  const int64_t tok = a.chunks[2 * c];
  const int nrows = a.chunks[2 * c + 1];
  const int64_t gs = static_cast<int64_t>(H) * D;
  const int64_t base = (tok * H + h) * D;
  const char* rec = a.prep + (static_cast<int64_t>(c) * H + h) * kPrepBytes;
  const float* gP = reinterpret_cast<const float*>(rec + kRecP);
  const char* Sg = a.h + (static_cast<int64_t>(c) * H + h) * kHiStateBytes;
  const char* dSg = a.dh + (static_cast<int64_t>(c) * H + h) * kDhStateBytes;

  auto B16 = [&](int off) { return reinterpret_cast<bf16*>(smem + off); };
  float* sBeta = reinterpret_cast<float*>(smem + S_BETA);
  float* sDgam = reinterpret_cast<float*>(smem + S_DGAM);
  float* sCs = reinterpret_cast<float*>(smem + S_CS);
  float* sDb = reinterpret_cast<float*>(smem + S_DB);

  const int m0 = 16 * (warp & 3);
  const int cg = warp >> 2;           // column group: 4 row blocks x CG column groups of warps
  const int n128 = (128 / CG) * cg;   // 64x128 outputs: 16 rows x 128 / CG cols per warp
  const int n64 = (64 / CG) * cg;     // 64x64 outputs: 16 rows x 64 / CG cols per warp

  // ---- phase A loads ----
  load_bf16_swh<NT>(B16(A_DO), static_cast<const bf16*>(a.dout) + base, gs, nrows, tid);
  load_bf16_swh<NT>(B16(A_V), static_cast<const bf16*>(a.v) + base, gs, nrows, tid);
  load_walk_tiles<NT>(smem, rec, 0, tid);
  load_lower_bf16<NT>(B16(A_AH), reinterpret_cast<const bf16*>(rec + kRecAH), tid);
  cp_async_commit();
  load_walk_tiles<NT>(smem, rec, 1, tid);  // a group of its own: half 0 waits for the first group only
  cp_async_commit();
  if (tid < C) sBeta[tid] = tid < nrows ? __bfloat162float(static_cast<const bf16*>(a.beta)[(tok + tid) * H + h]) : 0.f;

  float dQg[1][NT128][4], dW[1][NT128][4], dKg[1][NT128][4], dAqk[1][NT64][4], dAU[1][NT64][4];
  float* dgp = reinterpret_cast<float*>(smem + A_DGP);  // [NT][8] dgamma partials, keys 8 ((tid / 16) % 16) + i
  // Epilogue pieces on accumulator pairs (epi's), whichever warps hold them:
  // dv = beta dVb of value half vh from the pairs ni0 .. ni1 - 1 of acc (columns n0 ..), and the dbeta partials
  // sum(dVb o v) of the thread's two rows into rs (v at OffSwh offsets)
  auto dv_pairs = [&](const auto& acc, int vh, int n0, int ni0, int ni1, float (&rs)[2]) {
    const OffSwh at(m0, n0, lane);
#pragma unroll
    for (int ni = ni0; ni < ni1; ++ni)
#pragma unroll
      for (int e2 = 0; e2 < 2; ++e2) {
        const int r = m0 + (lane >> 2) + 8 * e2, cc = n0 + 8 * ni + 2 * (lane & 3);
        const float x0 = acc[0][ni][2 * e2], x1 = acc[0][ni][2 * e2 + 1];
        const float2 vv = ld2_b(B16(A_V) + 4096 * vh, at(ni, e2));
        rs[e2] += x0 * vv.x + x1 * vv.y;
        if (r < nrows) {
          const float b = sBeta[r];
          *reinterpret_cast<uint32_t*>(static_cast<bf16*>(a.dv) + base + r * gs + 64 * vh + cc) = pack_bf16(b * x0, b * x1);
        }
      }
  };
  // -dW (OffSwh) and s dAqk (strictly lower, Off64) staged for phase B
  auto stage_dw = [&](int o, int, int, float& x0, float& x1) { st2_b(B16(B_DWH), B16(B_DWL), o, -x0, -x1); };
  auto stage_sdaqk = [&](int o, int r, int cc, float& x0, float& x1) {
    st2_b(B16(B_SDAH), B16(B_SDAL), o, cc <= r ? a.scale * x0 : 0.f, cc + 1 <= r ? a.scale * x1 : 0.f);
  };
  // 16 warps on wgmma: phase A by product (kByProduct, below); dQg, dKg and dAU reach the tiling above after it
  constexpr bool kByProduct = kGradsWgmma && NW == 16;
  float P[1][16][4], Q[1][8][4];  // by product: the warpgroup's accumulators
  auto& P0 = *reinterpret_cast<float(*)[1][8][4]>(&P[0][0][0]);  // warpgroup 3: dAqk | dAU
  auto& P1 = *reinterpret_cast<float(*)[1][8][4]>(&P[0][8][0]);
  if constexpr (kByProduct) {
    // Phase A with one warpgroup per product, each over all 64 (128) columns: an operand read once per product,
    // not once per group of 32 (16) columns (wgmma at n32 read the whole A operand four times).
    // Group 0: dQg (P) and dVb (Q, per half); 1: dW; 2: dKg; 3: dAqk (P0) and dAU (P1). The same products in the
    // same order per element as below, so the same bits.
    zero(P);
    const int wg = cg;  // the warpgroup
    for (int vh = 0; vh < 2; ++vh) {
      float winv[2][kWalkPieces<NT>];
      stage_states<NT>(smem, Sg, dSg, rec, vh, tid, dgp + 8 * tid, winv);
      if (vh == 0) cp_async_wait1();
      else cp_async_wait_all();
      convert_walk_tiles<NT>(smem, vh, tid, winv);
      fence_async_smem();
      __syncthreads();
      const bf16 *vnh = B16(a_vn(vh, kVNH)), *vnl = B16(a_vn(vh, kVNL)), *dvh = B16(a_vn(vh, kDVH)), *dvl = B16(a_vn(vh, kDVL));
      const bf16 *dOz = B16(A_DO) + 4096 * vh, *vz = B16(A_V) + 4096 * vh;
      zero(Q);
      fence_acc(P), fence_acc(Q);
      wgmma_fence();
      if (wg == 0) {
        wg_gemm<16, 4, false, false, true, false>(P, dOz, nullptr, B16(A_SH), nullptr);
        wg_gemm<8, 4, true, false, false, true>(Q, B16(A_AH), nullptr, dvh, dvl);
      } else if (wg == 1) {
        wg_gemm<16, 4, true, true, true, false>(P, dvh, dvl, B16(A_SH), nullptr);
      } else if (wg == 2) {
        wg_gemm<16, 4, true, true, true, true>(P, vnh, vnl, B16(A_DH), B16(A_DL));
      } else {
        wg_gemm<8, 4, false, false, true, true>(P0, dOz, nullptr, vnh, vnl);
        wg_gemm<8, 4, true, true, false, false>(P1, dvh, dvl, vz, nullptr);
      }
      wgmma_commit();
      wgmma_wait0();
      fence_acc(P), fence_acc(Q);
      if (wg == 0) {  // dv; the dbeta partials per 16 columns, summed as the tiling below sums them
#pragma unroll
        for (int cgp = 0; cgp < CG; ++cgp) {
          float rs[2] = {0.f, 0.f};
          dv_pairs(Q, vh, 0, (8 / CG) * cgp, (8 / CG) * (cgp + 1), rs);
          store_row_sums(sDb, (vh * CG + cgp) * C + m0, rs, lane);
        }
      }
      __syncthreads();
    }
  } else {
    zero(dQg);
    zero(dW);
    zero(dKg);
    zero(dAqk);
    zero(dAU);
    for (int vh = 0; vh < 2; ++vh) {
      const int voff = 64 * vh;
      // S^T, dS^T of this half (the previous half's products are done: barrier at the end of the loop)
      float winv[2][kWalkPieces<NT>];
      stage_states<NT>(smem, Sg, dSg, rec, vh, tid, dgp + 8 * tid, winv);
      if (vh == 0) cp_async_wait1();
      else cp_async_wait_all();
      convert_walk_tiles<NT>(smem, vh, tid, winv);
      if constexpr (kGradsWgmma) fence_async_smem();  // the tiles' cp.async and stage_states writes, then wgmma's reads
      __syncthreads();
      const bf16 *vnh = B16(a_vn(vh, kVNH)), *vnl = B16(a_vn(vh, kVNL)), *dvh = B16(a_vn(vh, kDVH)), *dvl = B16(a_vn(vh, kDVL));
      // products reduced over the value columns of this half (V_new, dV_new stored transposed); dVb (half) = A^T dV_new
      float acc[1][NT64][4];
      zero(acc);
      if constexpr (kGradsWgmma) {
        const bf16 *dOz = B16(A_DO) + 4096 * vh, *vz = B16(A_V) + 4096 * vh;  // this value half: K-major A / B tiles
        const int g = thread_index() >> 7, n128 = (128 / CG) * g, n64 = (64 / CG) * g;  // formed here, not held
        fence_acc(dQg), fence_acc(dW), fence_acc(dKg), fence_acc(dAqk), fence_acc(dAU), fence_acc(acc);
        wgmma_fence();
        wg_gemm<NT128, 4, false, false, true, false>(dQg, dOz, nullptr, swh_col(B16(A_SH), n128), nullptr);
        wg_gemm<NT128, 4, true, true, true, false>(dW, dvh, dvl, swh_col(B16(A_SH), n128), nullptr);
        wg_gemm<NT128, 4, true, true, true, true>(dKg, vnh, vnl, swh_col(B16(A_DH), n128), swh_col(B16(A_DL), n128));
        wg_gemm<NT64, 4, false, false, true, true>(dAqk, dOz, nullptr, vnh + n64, vnl + n64);
        wg_gemm<NT64, 4, true, true, false, false>(dAU, dvh, dvl, vz + 64 * n64, nullptr);
        wg_gemm<NT64, 4, true, false, false, true>(acc, B16(A_AH), nullptr, dvh + 64 * n64, dvl + 64 * n64);
        wgmma_commit();
        wgmma_wait0();
        fence_acc(dQg), fence_acc(dW), fence_acc(dKg), fence_acc(dAqk), fence_acc(dAU), fence_acc(acc);
      } else {
        constexpr int S = kRowsSwh;
        wgemm<1, NT128, S, false, false, S, true, false>(dQg, B16(A_DO), nullptr, m0, voff, B16(A_SH), nullptr, n128, 0, 64, lane);
        wgemm<1, NT128, 64, true, true, S, true, false>(dW, dvh, dvl, m0, 0, B16(A_SH), nullptr, n128, 0, 64, lane);
        wgemm<1, NT128, 64, true, true, S, true, true>(dKg, vnh, vnl, m0, 0, B16(A_DH), B16(A_DL), n128, 0, 64, lane);
        wgemm<1, NT64, S, false, false, 64, true, true>(dAqk, B16(A_DO), nullptr, m0, voff, vnh, vnl, n64, 0, 64, lane);
        wgemm<1, NT64, 64, true, true, S, false, false>(dAU, dvh, dvl, m0, 0, B16(A_V), nullptr, n64, voff, 64, lane);
        wgemm<1, NT64, 64, true, false, 64, false, true>(acc, B16(A_AH), nullptr, m0, m0, dvh, dvl, n64, m0, C - m0, lane);
      }
      {
        float rs[2] = {0.f, 0.f};
        dv_pairs(acc, vh, n64, 0, NT64, rs);
        store_row_sums(sDb, (vh * CG + cg) * C + m0, rs, lane);
      }
      __syncthreads();
    }
  }
  if (tid < D) {  // dgamma of key tid: the partials of the 16 threads x NT / 256 replicas of its key block, in order
    const float* q = dgp + 8 * (16 * (tid >> 3)) + (tid & 7);
    float sum = 0.f;
    for (int r = 0; r < NT / 256; ++r)
#pragma unroll
      for (int j = 0; j < 16; ++j) sum += q[8 * (256 * r + j)];
    sDgam[tid] = sum;
  }
  if constexpr (kByProduct) {
    // dW and s dAqk to their phase-B tiles (as B1 below stages them); dQg, dKg, dAU through fp32 tiles over the dead
    // phase-A tiles into the warp tiling of the rest of the kernel
    float* rq = reinterpret_cast<float*>(smem + R_Q);
    float* rk = reinterpret_cast<float*>(smem + R_K);
    float* ru = reinterpret_cast<float*>(smem + R_U);
    // (rq, rk: f32_at<true>; ru: fp32 [64][64] in its swizzle)
    const int wg = cg;
    if (wg == 0) {
      epi_at<OffF32>(P, m0, 0, lane, [&](int o, int, int, float& x0, float& x1) { at_byte<float2>(rq, o) = make_float2(x0, x1); });
    } else if (wg == 1) {
      epi_at<OffSwh>(P, m0, 0, lane, stage_dw);
    } else if (wg == 2) {
      epi_at<OffF32>(P, m0, 0, lane, [&](int o, int, int, float& x0, float& x1) { at_byte<float2>(rk, o) = make_float2(x0, x1); });
    } else {
      epi_at<Off64>(P0, m0, 0, lane, stage_sdaqk);
      epi_at<OffF64>(P1, m0, 0, lane, [&](int o, int, int, float& x0, float& x1) { at_byte<float2>(ru, o) = make_float2(x0, x1); });
    }
    __syncthreads();
    epi_at<OffF32>(dQg, m0, n128, lane, [&](int o, int, int, float& x0, float& x1) {
      const float2 t = at_byte<float2>(rq, o);
      x0 = t.x, x1 = t.y;
    });
    epi_at<OffF32>(dKg, m0, n128, lane, [&](int o, int, int, float& x0, float& x1) {
      const float2 t = at_byte<float2>(rk, o);
      x0 = t.x, x1 = t.y;
    });
    epi_at<OffF64>(dAU, m0, n64, lane, [&](int o, int, int, float& x0, float& x1) {
      const float2 t = at_byte<float2>(ru, o);
      x0 = t.x, x1 = t.y;
    });
    __syncthreads();  // R_U lies under G's tile
  }

  // ---- phase B1: G, q, k; consume dQg, dKg; stage dW, s dAqk, K o exp(G) ----
  float* sG = reinterpret_cast<float*>(smem + B_G);
  load_f32_swz<NT>(sG, a.g + base, gs, nrows, tid);
  load_bf16<128, NT>(B16(B_Q), static_cast<const bf16*>(a.q) + base, gs, nrows, tid);
  load_bf16<128, NT>(B16(B_K), static_cast<const bf16*>(a.k) + base, gs, nrows, tid);
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();
  {  // G = cumsum g (the block totals in S_CF, written by B3 later)
    RowBlocks<NT> G(tid);
    G.load(sG);
    G.template scan<false>(reinterpret_cast<float*>(smem + S_CF));
    G.each([&](int r, int d, float x) { sG[f32_at<true>(r, d)] = x; });
  }
  __syncthreads();

  float Rg[1][NT128][4];  // dG accumulator; dQg becomes the dq accumulator, dKg the dk accumulator
  // (the epilogues below read their operands in pairs: an accumulator pair is two adjacent columns)
  epi_at<OffF32>(dQg, m0, n128, lane, [&](int o, int, int, float& x0, float& x1) {
    const float2 gg = at_byte<float2>(sG, o);
    x0 *= a.scale * fexp(gg.x);
    x1 *= a.scale * fexp(gg.y);
  });
  // Rg = dq_partial o q  (dQg o Qg = s dO S^T o q o exp(G))
  {
    const int g4 = lane >> 2, l4 = lane & 3;
#pragma unroll
    for (int ni = 0; ni < NT128; ++ni)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int r = m0 + g4 + 4 * e, cc = n128 + 8 * ni + 2 * l4;
        const float2 qq = ld2<128>(B16(B_Q), r, cc);
        Rg[0][ni][e] = dQg[0][ni][e] * qq.x;
        Rg[0][ni][e + 1] = dQg[0][ni][e + 1] * qq.y;
      }
  }
  {
    float cs[NT128][2];
    epi_at<OffF32>(dKg, m0, n128, lane, [&](int o, int, int cc, float& x0, float& x1) {
      const float2 lg = ld2_f32<true>(sG, 63, cc), gg = at_byte<float2>(sG, o);
      x0 *= fexp(lg.x - gg.x);
      x1 *= fexp(lg.y - gg.y);
    });
    const int g4 = lane >> 2, l4 = lane & 3;
#pragma unroll
    for (int ni = 0; ni < NT128; ++ni) {
      cs[ni][0] = 0.f;
      cs[ni][1] = 0.f;
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int r = m0 + g4 + 4 * e, cc = n128 + 8 * ni + 2 * l4;
        const float2 kq = ld2<128>(B16(B_K), r, cc);
        const float t0 = dKg[0][ni][e] * kq.x, t1 = dKg[0][ni][e + 1] * kq.y;  // dKg o Kg
        Rg[0][ni][e] -= t0;
        Rg[0][ni][e + 1] -= t1;
        cs[ni][0] += t0;
        cs[ni][1] += t1;
      }
    }
#pragma unroll
    for (int ni = 0; ni < NT128; ++ni)
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        float s = cs[ni][b];
        s += __shfl_xor_sync(0xffffffffu, s, 4);
        s += __shfl_xor_sync(0xffffffffu, s, 8);
        s += __shfl_xor_sync(0xffffffffu, s, 16);
        if (g4 == 0) sCs[(warp & 3) * D + n128 + 8 * ni + 2 * l4 + b] = s;
      }
  }
  if constexpr (!kByProduct) {  // (by product, their owners staged them after phase A)
    epi_at<OffSwh>(dW, m0, n128, lane, stage_dw);
    epi_at<Off64>(dAqk, m0, n64, lane, stage_sdaqk);
  }
  for (int p = tid; p < C * D / 2; p += NT) {
    const int r = p >> 6, d = (p & 63) * 2;
    const float2 kk = ld2<128>(B16(B_K), r, d), gg = ld2_f32<true>(sG, r, d);
    st2<kRowsSwh>(B16(B_XH), B16(B_XL), r, d, kk.x * fexp(gg.x), kk.y * fexp(gg.y));
  }
  if constexpr (kGradsWgmma) fence_async_smem();
  __syncthreads();

  // ---- B2: dA = (dV_new v^T + dW Kexp^T) diag(beta); dKb = A^T dW ----
  {
    float acc[1][NT128][4];
    zero(acc);
    if constexpr (kGradsWgmma) {
      const int g = thread_index() >> 7, n128 = (128 / CG) * g, n64 = (64 / CG) * g;
      fence_acc(dAU), fence_acc(acc);
      wgmma_fence();
      wg_gemm<NT64, 8, false, true, false, true>(dAU, B16(B_DWH), B16(B_DWL), B16(B_XH) + 64 * n64, B16(B_XL) + 64 * n64);
      wg_gemm<NT128, 4, true, false, true, true>(acc, B16(A_AH), nullptr, swh_col(B16(B_DWH), n128), swh_col(B16(B_DWL), n128));
      wgmma_commit();
      wgmma_wait0();
      fence_acc(dAU), fence_acc(acc);
    } else {
      constexpr int S = kRowsSwh;
      wgemm<1, NT64, S, false, true, S, false, true>(dAU, B16(B_DWH), B16(B_DWL), m0, 0, B16(B_XH), B16(B_XL), n64, 0, D, lane);
      wgemm<1, NT128, 64, true, false, S, true, true>(acc, B16(A_AH), nullptr, m0, m0, B16(B_DWH), B16(B_DWL), n128, m0,
                                                 C - m0, lane);
    }
    epi_at<Off64>(dAU, m0, n64, lane, [&](int o, int, int cc, float& x0, float& x1) {
      st2_b(B16(B_DAH), B16(B_DAL), o, x0 * sBeta[cc], x1 * sBeta[cc + 1]);
    });
    float rs[2] = {0.f, 0.f};
    const int g4 = lane >> 2, l4 = lane & 3;
#pragma unroll
    for (int ni = 0; ni < NT128; ++ni)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int r = m0 + g4 + 4 * e, cc = n128 + 8 * ni + 2 * l4;
        const float2 gg = ld2_f32<true>(sG, r, cc), kq = ld2<128>(B16(B_K), r, cc);
        const float b = sBeta[r];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const float x = acc[0][ni][e + u];
          const float eg = fexp(u ? gg.y : gg.x);
          const float kx = (u ? kq.y : kq.x) * eg;  // Kexp
          dKg[0][ni][e + u] += b * x * eg;
          Rg[0][ni][e + u] += b * x * kx;
          rs[e >> 1] += x * kx;
        }
      }
    store_row_sums(sDb, (2 * CG + cg) * C + m0, rs, lane);
  }
  if constexpr (kGradsWgmma) fence_async_smem();  // dA, then B3's wgmma
  __syncthreads();
  // ---- B3: T1 = A^T dA; dL = -(T1 A^T) strictly lower; dP = beta dL; dbeta partial sum(dL o P) ----
  const float* sP = reinterpret_cast<const float*>(smem + B_P);  // P lands while T1 is formed
  load_f32<NT, C, C, true>(reinterpret_cast<float*>(smem + B_P), kPLd, gP, C, C, tid);
  cp_async_commit();
  {
    float acc[1][NT64][4];
    zero(acc);
    if constexpr (kGradsWgmma) {
      const int n64 = (64 / CG) * (thread_index() >> 7);
      fence_acc(acc);
      wgmma_fence();
      wg_gemm<NT64, 4, true, false, true, true>(acc, B16(A_AH), nullptr, B16(B_DAH) + n64, B16(B_DAL) + n64);
      wgmma_commit();
      wgmma_wait0();
      fence_acc(acc);
    } else {
      wgemm<1, NT64, 64, true, false, 64, true, true>(acc, B16(A_AH), nullptr, m0, m0, B16(B_DAH), B16(B_DAL), n64, m0,
                                                  C - m0, lane);
    }
    epi_at<Off64>(acc, m0, n64, lane, [&](int o, int, int, float& x0, float& x1) { st2_b(B16(B_T1H), B16(B_T1L), o, x0, x1); });
    cp_async_wait_all();
    if constexpr (kGradsWgmma) fence_async_smem();
    __syncthreads();
    zero(acc);
    if constexpr (kGradsWgmma) {
      const int n64 = (64 / CG) * (thread_index() >> 7);
      fence_acc(acc);
      wgmma_fence();
      wg_gemm<NT64, 4, false, true, false, false>(acc, B16(B_T1H), B16(B_T1L), B16(A_AH) + 64 * n64, nullptr);
      wgmma_commit();
      wgmma_wait0();
      fence_acc(acc);
    } else {
      wgemm<1, NT64, 64, false, true, 64, false, false>(acc, B16(B_T1H), B16(B_T1L), m0, 0, B16(A_AH), nullptr, n64, 0, C, lane);
    }
    float rs[2] = {0.f, 0.f};
    epi_at<Off64>(acc, m0, n64, lane, [&](int o, int r, int cc, float& x0, float& x1) {
      const float l0 = cc < r ? -x0 : 0.f, l1 = cc + 1 < r ? -x1 : 0.f;
      const float2 pp = *reinterpret_cast<const float2*>(sP + r * kPLd + cc);
      rs[(r - m0) >> 3] += l0 * pp.x + l1 * pp.y;
      const float b = sBeta[r];
      st2_b(B16(B_DPH), B16(B_DPL), o, b * l0, b * l1);
    });
    store_row_sums(sDb, (3 * CG + cg) * C + m0, rs, lane);
  }
  float* sCF = reinterpret_cast<float*>(smem + S_CF);
  for (int t = tid; t < 3 * D; t += NT) {
    const int I = t / D + 1, d = t % D;
    sCF[t] = fexp(sG[f32_at<true>(16 * I, d)] - sG[f32_at<true>(16 * (I - 1), d)]);
  }
  // One anchor for the chunk where every column's gates sum to >= -kOneAnchor (G_63 includes row 0's gate, so it
  // bounds G_0 - G_63; kda_chunk_prep.cuh): the pairwise rows and columns are then one product each (B4' below);
  // otherwise they go by 16-row block (B4 and the columns after it).
  const bool one_anchor = !__syncthreads_or(tid < D && sG[f32_at<true>(63, tid)] < -chunk_prep::kOneAnchor);
  const int g4 = lane >> 2, l4 = lane & 3;
  bf16* dq = static_cast<bf16*>(a.dq);
  bf16* dk = static_cast<bf16*>(a.dk);
  // rows: y = acc o exp(G_r - G_ar): dX += y, Rg += x o y (x the bf16 row operand, q or k)
  auto add_pairwise_rows = [&](const float (&acc)[1][NT128][4], int ar, float (&dX)[1][NT128][4], const bf16* x) {
#pragma unroll
    for (int ni = 0; ni < NT128; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = m0 + g4 + 8 * (e >> 1), cc = n128 + 8 * ni + 2 * l4 + (e & 1);
        const float y = acc[0][ni][e] * fexp(sG[f32_at<true>(r, cc)] - sG[f32_at<true>(ar, cc)]);
        dX[0][ni][e] += y;
        Rg[0][ni][e] += __bfloat162float(x[sw128(r, cc)]) * y;
      }
  };
  // columns: z = acc o e^(G_ar - G) (row r, column cc) goes into dk, and -k o z into dG; `ftz`: B4''s factors lie in
  // [e^-64, 1] and take the exponential that flushes below FP32's normals, B4's the full-range one
  auto add_columns = [&](const float (&acc)[1][NT128][4], int ar, bool ftz) {
#pragma unroll
    for (int ni = 0; ni < NT128; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = m0 + g4 + 8 * (e >> 1), cc = n128 + 8 * ni + 2 * l4 + (e & 1);
        const float x = sG[f32_at<true>(ar, cc)] - sG[f32_at<true>(r, cc)];
        const float z = acc[0][ni][e] * (ftz ? fexp_ftz(x) : fexp(x));
        dKg[0][ni][e] += z;
        Rg[0][ni][e] -= __bfloat162float(B16(B_K)[sw128(r, cc)]) * z;
      }
  };
  // dq or dk from this warp's accumulators (epi's pairs, in its order): each of the thread's two rows m0 + g4 + 8 e2 a
  // row pointer and one test, its pairs at constant offsets from it (no 64-bit r * gs + cc per pair)
  auto store_rows = [&](const float (&acc)[1][NT128][4], bf16* out) {
    const int r = m0 + g4;
    uint32_t* row[2] = {reinterpret_cast<uint32_t*>(out + base + r * gs + n128 + 2 * l4),
                        reinterpret_cast<uint32_t*>(out + base + (r + 8) * gs + n128 + 2 * l4)};
    const bool in[2] = {r < nrows, r + 8 < nrows};
#pragma unroll
    for (int ni = 0; ni < NT128; ++ni)
#pragma unroll
      for (int e2 = 0; e2 < 2; ++e2)
        if (in[e2]) row[e2][4 * ni] = pack_bf16(acc[0][ni][2 * e2], acc[0][ni][2 * e2 + 1]);
  };
  auto store_dq = [&] { store_rows(dQg, dq); };
  if (one_anchor) {
    // ---- B4' (one anchor): rows(X) = X (K o e^(G_0 - G)), X = s dAqk (dq) or dP (dk), and columns
    // dP^T (K o e^(G - G_63)) + s dAqk^T (Q o e^(G - G_63)) (dk), each a 64 x 128 product over the chunk's 64 keys ----
    // Every factor lies in [1, e^64] and every output scale in [e^-64, 1] (the rows' Cc as before; the columns
    // anchored at the last row, so small gradients meet large operands and no product leaves FP32's normal range).
    {
      const int d = 2 * (tid & 63);  // NT is a multiple of 64: a thread keeps its column pair
      const float2 ga = ld2_f32<true>(sG, 0, d), gz = ld2_f32<true>(sG, 63, d);
      each_pair_row<NT>(tid, [&](int, int, PairAt at) {
        const float2 gj = *reinterpret_cast<const float2*>(sG + at.f32), kk = ld2_at(B16(B_K), at.b128), qq = ld2_at(B16(B_Q), at.b128);
        const float u0 = fexp_ftz(ga.x - gj.x), u1 = fexp_ftz(ga.y - gj.y);
        const float w0 = fexp_ftz(gj.x - gz.x), w1 = fexp_ftz(gj.y - gz.y);
        st2_at(B16(O_CCH), B16(O_CCL), at.bswh, kk.x * u0, kk.y * u1);
        st2_at(B16(O_KRH), B16(O_KRL), at.bswh, kk.x * w0, kk.y * w1);
        st2_at(B16(O_QRH), B16(O_QRL), at.bswh, qq.x * w0, qq.y * w1);
      });
    }
    if constexpr (kGradsWgmma) fence_async_smem();
    __syncthreads();
    float acc[1][NT128][4];
    if constexpr (kByProduct) {
      // By product, as phase A: warpgroup 0 the rows of s dAqk, 1 the rows of dP (n128 each), 2 and 3 the columns
      // (n64 each, both products); every operand read once per product. The accumulators reach the warp tiling
      // through fp32 tiles over the dead operands.
      const int wg = cg;
      zero(P);
      fence_acc(P);
      wgmma_fence();
      if (wg == 0) {
        wg_gemm<16, 4, false, true, true, true>(P, B16(B_SDAH), B16(B_SDAL), B16(O_CCH), B16(O_CCL));
      } else if (wg == 1) {
        wg_gemm<16, 4, false, true, true, true>(P, B16(B_DPH), B16(B_DPL), B16(O_CCH), B16(O_CCL));
      } else {
        const int n0 = 64 * (wg - 2);
        wg_gemm<8, 4, true, true, true, true>(P0, B16(B_DPH), B16(B_DPL), swh_col(B16(O_KRH), n0), swh_col(B16(O_KRL), n0));
        wg_gemm<8, 4, true, true, true, true>(P0, B16(B_SDAH), B16(B_SDAL), swh_col(B16(O_QRH), n0), swh_col(B16(O_QRL), n0));
      }
      wgmma_commit();
      wgmma_wait0();
      fence_acc(P);
      __syncthreads();  // every product done: the operand tiles are dead
      float* t = reinterpret_cast<float*>(smem + O_T + C * D * 4 * (wg < 2 ? wg : 2));  // tile i = min(wg, 2)
      auto put = [&](int r, int cc, float& x0, float& x1) { *reinterpret_cast<float2*>(t + f32_at<true>(r, cc)) = make_float2(x0, x1); };
      if (wg < 2) epi(P, m0, 0, lane, put);
      else epi(P0, m0, 64 * (wg - 2), lane, put);
      __syncthreads();
    }
    // this warp's part of handed-over accumulator i (by product)
    auto take = [&](int i) {
      const float* t = reinterpret_cast<const float*>(smem + O_T + C * D * 4 * i);
      epi(acc, m0, n128, lane, [&](int r, int cc, float& x0, float& x1) {
        const float2 v = ld2_f32<true>(t, r, cc);
        x0 = v.x, x1 = v.y;
      });
    };
    // the rows of X = s dAqk (accumulator 0) or dP (1): handed over, or formed here by each row block J = warp & 3
    // over the keys its rows meet (up to its diagonal block; the columns below from it)
    auto rows = [&](int i, const bf16* xh, const bf16* xl) {
      if constexpr (kByProduct) {
        take(i);
      } else {
        zero(acc);
        wgemm<1, NT128, 64, false, true, kRowsSwh, true, true>(acc, xh, xl, m0, 0, B16(O_CCH), B16(O_CCL), n128, 0, m0 + 16, lane);
      }
    };
    rows(0, B16(B_SDAH), B16(B_SDAL));
    add_pairwise_rows(acc, 0, dQg, B16(B_Q));
    store_dq();
    rows(1, B16(B_DPH), B16(B_DPL));
    add_pairwise_rows(acc, 0, dKg, B16(B_K));
    if constexpr (kByProduct) {
      take(2);
    } else {
      zero(acc);
      constexpr int S = kRowsSwh;
      wgemm<1, NT128, 64, true, true, S, true, true>(acc, B16(B_DPH), B16(B_DPL), m0, m0, B16(O_KRH), B16(O_KRL), n128, m0, C - m0, lane);
      wgemm<1, NT128, 64, true, true, S, true, true>(acc, B16(B_SDAH), B16(B_SDAL), m0, m0, B16(O_QRH), B16(O_QRL), n128, m0, C - m0, lane);
      __syncthreads();  // B5's dG tile lies over K o e^(G - G_63)
    }
    add_columns(acc, 63, true);
  } else {
    // ---- B4 (per-block anchors): every key and query row anchored at its own 16-row block's first row a ----
    // Cc = K o e^(G_a - G) (the rows' keys, factors in [1, e^80]); K o e^(G - G_a) and Q o e^(G - G_a) (the columns'
    // queries, in [e^-80, 1]); staged at once in B4''s places, so the rows and the columns follow without a barrier.
    for (int p = tid; p < C * (D / 2); p += NT) {
      const int j = p >> 6, d = (p & 63) * 2, a = j & ~15;  // a warp's 32 pieces share j
      const float2 ga = ld2_f32<true>(sG, a, d), gj = ld2_f32<true>(sG, j, d);
      const float2 kk = ld2<128>(B16(B_K), j, d), qq = ld2<128>(B16(B_Q), j, d);
      const float u0 = fexp(ga.x - gj.x), u1 = fexp(ga.y - gj.y);
      const float w0 = fexp(gj.x - ga.x), w1 = fexp(gj.y - ga.y);
      st2<128>(B16(O_CCH), B16(O_CCL), j, d, kk.x * u0, kk.y * u1);
      st2<128>(B16(O_KRH), B16(O_KRL), j, d, kk.x * w0, kk.y * w1);
      st2<128>(B16(O_QRH), B16(O_QRL), j, d, qq.x * w0, qq.y * w1);
    }
    __syncthreads();
    // acc o= e^(G_16J - G_16(J-1)) per column (J = 1 .. 3)
    auto step = [&](float (&acc)[1][NT128][4], int J) {
      const float* f = sCF + (J - 1) * D;
#pragma unroll
      for (int ni = 0; ni < NT128; ++ni) {
        const float2 s2 = *reinterpret_cast<const float2*>(f + n128 + 8 * ni + 2 * l4);
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[0][ni][e] *= (e & 1) ? s2.y : s2.x;
      }
    };
    // Row block I's rows meet the key blocks J <= I and its keys the query blocks J >= I: I + 1 and 4 - I blocks,
    // 5 for every warp, so the SM's four sub-partitions (row block = warp & 3) carry equal work.
    const int I = warp & 3;
    float acc[1][NT128][4];
    // rows = e^(G_r - G_aI) sum_(J <= I) e^(G_aI - G_aJ) (X_IJ Cc_J): the per-column factors applied to the FP32
    // accumulator between the key blocks' products (Horner, each step in [e^-80, 1])
    auto rows = [&](const bf16* xh, const bf16* xl) {
      zero(acc);
      for (int J = 0; J <= I; ++J) {
        if (J > 0) step(acc, J);
        wgemm<1, NT128, 64, false, true, 128, true, true>(acc, xh, xl, m0, 16 * J, B16(O_CCH), B16(O_CCL), n128, 16 * J,
                                                         16, lane);
      }
    };
    rows(B16(B_SDAH), B16(B_SDAL));
    add_pairwise_rows(acc, 16 * I, dQg, B16(B_Q));
    store_dq();
    rows(B16(B_DPH), B16(B_DPL));
    add_pairwise_rows(acc, 16 * I, dKg, B16(B_K));
    // columns: z = e^(G_aI - G_r) sum_(J >= I) e^(G_aJ - G_aI) (dP^T (K o e^(G - G_aJ)) + s dAqk^T (Q o e^(G - G_aJ)))_J,
    // by Horner from the last query block down (the same steps), one exponential per element at the end
    zero(acc);
    for (int J = 3; J >= I; --J) {
      if (J < 3) step(acc, J + 1);
      wgemm<1, NT128, 64, true, true, 128, true, true>(acc, B16(B_DPH), B16(B_DPL), m0, 16 * J, B16(O_KRH), B16(O_KRL),
                                                   n128, 16 * J, 16, lane);
      wgemm<1, NT128, 64, true, true, 128, true, true>(acc, B16(B_SDAH), B16(B_SDAL), m0, 16 * J, B16(O_QRH), B16(O_QRL),
                                                   n128, 16 * J, 16, lane);
    }
    add_columns(acc, 16 * I, false);
    __syncthreads();  // B5's dG tile lies over K o e^(G - G_a)
  }
  store_rows(dKg, dk);
  // ---- B5: dG -> dg (reverse cumsum), dbeta ----
  float* sDG = reinterpret_cast<float*>(smem + B_DG);
  epi(Rg, m0, n128, lane, [&](int r, int cc, float& x0, float& x1) {
    *reinterpret_cast<float2*>(sDG + f32_at<true>(r, cc)) = make_float2(x0, x1);  // cc even: the pair stays adjacent
  });
  __syncthreads();
  {  // dg = the reverse cumsum of dG, row 63 with the chunk's gamma terms; straight from registers to dg
    RowBlocks<NT> R(tid);
    R.load(sDG);
    if (R.rq == 3) {
#pragma unroll
      for (int c = 0; c < RowBlocks<NT>::CPT; ++c) {
        const int d = R.d0 + c;
        R.v[c][15] += ((sCs[d] + sCs[D + d]) + (sCs[2 * D + d] + sCs[3 * D + d])) +
                      sDgam[d] * fexp(sG[f32_at<true>(63, d)]);
      }
    }
    R.template scan<true>(reinterpret_cast<float*>(smem + S_CF));  // (S_CF: B4's, dead)
    // a running row pointer and the block's row count: a predicated store per row, no 64-bit address or branch
    float* dg = a.dg + base + 16 * R.rq * gs + R.d0;
    const int rows = nrows - 16 * R.rq;
#pragma unroll
    for (int i = 0; i < 16; ++i, dg += gs) {
      if (i < rows) {
        if constexpr (RowBlocks<NT>::CPT == 2) *reinterpret_cast<float2*>(dg) = make_float2(R.v[0][i], R.v[1][i]);
        else *dg = R.v[0][i];
      }
    }
  }
  if (tid < C && tid < nrows) {
    const float* b = sDb;
    float s;
    if constexpr (CG == 2) {
      s = ((b[0 * C + tid] + b[1 * C + tid]) + (b[2 * C + tid] + b[3 * C + tid])) +
          ((b[4 * C + tid] + b[5 * C + tid]) + (b[6 * C + tid] + b[7 * C + tid]));
    } else {  // the 4 CG partial row sums in a fixed pairwise order
      float part[4 * CG];
#pragma unroll
      for (int i = 0; i < 4 * CG; ++i) part[i] = b[i * C + tid];
#pragma unroll
      for (int w = 1; w < 4 * CG; w <<= 1)
#pragma unroll
        for (int i = 0; i + w < 4 * CG; i += 2 * w) part[i] += part[i + w];
      s = part[0];
    }
    static_cast<bf16*>(a.dbeta)[(tok + tid) * H + h] = __float2bfloat16_rn(s);
  }
}

template <class K>
cudaError_t launch(K kern, dim3 grid, int threads, int smem, const Args& a, cudaStream_t s) {
  cudaError_t err = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  kern<<<grid, threads, smem, s>>>(a);
  return cudaGetLastError();
}

// A walk or summary kernel of NW state warps and a producer warpgroup over grid (rows, heads, columns / (16 NW)).
// REV: the reverse walk, else the forward walk; SUMMARY: the 256 virtual columns [M^T | F] or [M | E], else 128.
template <bool REV, bool SUMMARY, int NW>
cudaError_t launch_walk_nw(const Args& a, cudaStream_t s) {
  using Sh = WalkShape<NW>;
  const int zdim = (SUMMARY ? 2 * D : D) / Sh::COLS;
  const dim3 grid(a.nruns, a.H, zdim);
  if constexpr (REV) return launch(rev_walk_kernel<SUMMARY, NW>, grid, RevRing<NW>::NT, RevRing<NW>::SMEM, a, s);
  else return launch(fwd_walk_kernel<SUMMARY, NW>, grid, FwdRing<NW>::NT, FwdRing<NW>::SMEM, a, s);
}
// The gradient kernel of NW warps over every chunk of a. Chunk-major: grid (H, kMaxGridY, pieces) over the whole
// pieces of kMaxGridY chunks, then (H, the rest) over the rest (its chunk rows, records, h and dh from its first
// chunk on), so that every CTA has a chunk. (A grid rounded up would need a bounds test in the kernel, and its early
// exit moves ptxas' register allocation: grads_kernel<16> spills 152 / 352 bytes (stores / loads) instead of 92 / 212.)
template <int NW>
cudaError_t launch_grads_nw(const Args& a, cudaStream_t s) {
  using T = GradsTiling<NW>;
  const int whole = a.nchunks / kMaxGridY, rest = a.nchunks % kMaxGridY;
  if (whole > 0) {
    const cudaError_t err = launch(grads_kernel<NW>, dim3(a.H, kMaxGridY, whole), T::NTH, T::SMEM, a, s);
    if (err != cudaSuccess || rest == 0) return err;
  }
  Args r = a;
  const int64_t c0 = static_cast<int64_t>(whole) * kMaxGridY, at = c0 * a.H;  // the rest's first chunk-head
  r.chunks = a.chunks + 2 * c0;
  r.prep = a.prep + at * kPrepBytes;
  r.h = a.h + at * kHiStateBytes;
  r.dh = a.dh + at * kDhStateBytes;
  r.nchunks = rest;
  return launch(grads_kernel<NW>, dim3(a.H, rest), T::NTH, T::SMEM, r, s);
}

template <bool REV, bool SUMMARY>
cudaError_t launch_walk(const Args& a, int warps, cudaStream_t s) {
  if (a.nruns == 0 || a.H == 0) return cudaSuccess;
  if (warps == 8) return launch_walk_nw<REV, SUMMARY, 8>(a, s);
  if (warps == 4) return launch_walk_nw<REV, SUMMARY, 4>(a, s);
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_prep(const Args& a, cudaStream_t s) {
  if (a.nchunks == 0 || a.H == 0) return cudaSuccess;
  return launch(prep_kernel, prep_grid(a.nchunks, a.H), chunk_prep::NT, chunk_prep::SMEM, a, s);
}
cudaError_t launch_fwd_walk(const Args& a, int warps, cudaStream_t s) { return launch_walk<false, false>(a, warps, s); }
cudaError_t launch_fwd_summary(const Args& a, int warps, cudaStream_t s) { return launch_walk<false, true>(a, warps, s); }
cudaError_t launch_rev_walk(const Args& a, int warps, cudaStream_t s) { return launch_walk<true, false>(a, warps, s); }
cudaError_t launch_rev_summary(const Args& a, int warps, cudaStream_t s) { return launch_walk<true, true>(a, warps, s); }
cudaError_t launch_grads(const Args& a, int warps, cudaStream_t s) {
  if (a.nchunks == 0 || a.H == 0) return cudaSuccess;
  return warps == 16 ? launch_grads_nw<16>(a, s) : launch_grads_nw<8>(a, s);
}

}  // namespace bwd
}  // namespace kda
