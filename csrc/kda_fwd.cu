// KDA chunked forward (staged: docs/kernels.md §1-3), head dim 128, chunk 64:
//   1. prep_kernel, one CTA per (chunk, head), 2 CTAs per SM: cumsum, anchored operands, L and Aqk on
//      tensor cores, A = (I + L)^-1 in FP32, W = A diag(beta) (K o exp G); writes one record per
//      (chunk, head) (kda_fwd.h): -W, Qg, Kg, Aqk and A diag(beta) (fp16; Aqk and A diag(beta) lower
//      blocks only), gamma (fp32). 936 B per token-head. -W, Qg and Kg are stored as two 64-key halves
//      (swh), the layouts wgmma reads them in (K-major for -W and Qg, MN-major for Kg).
//   2. walk_kernel<OUT, NW>, one CTA per (segment, head, value tile of 16 NW columns): the state columns
//      of the tile in registers (mma accumulator layout, S transposed, one warp per 16 columns), chunks in
//      order; per chunk U = A diag(beta) V[:, tile], V_new = U - W S, O = Qg S + Aqk V_new,
//      S = Diag(gamma) S + Kg^T V_new. On sm_90a (WalkCfg::WGMMA) a warpgroup computes W S, Qg S and
//      Kg^T V_new with wgmma: S^T and V_new^T from the warps' registers, W, Qg and Kg read once from shared
//      memory for all four warps. The record of chunk c + 1 streams in (cp.async, three groups) while
//      chunk c is computed. OUT: writes o. !OUT: [M | E] summary tiles from [I | 0].
//   3. the affine merge of segment summaries (FP32 states, 3xTF32 products; kda_affine_merge.cuh, shared with the
//      backward).
// Precision (docs/kernels.md §2): the walk's operands are fp16 (11 significant bits; bf16 has 8), one
// tensor-core product each where bf16 needed hi + lo pairs (two or three products): W, Qg, Kg, Aqk and
// A diag(beta) from the prep, S and V_new rounded from their FP32 accumulators, V converted from bf16. fp16's range
// is narrow (6e-5 .. 65504), so each warp scales its operands S, V, V_new by a power of two that follows the
// largest |v| and |S_in| it has seen (walk_kernel below): any scale of v works (tests: v times 2^-20 gives o times
// 2^-20 bit for bit). Two roundings feed back into the state at every step and accumulate along a run, S's in
// V_new = U - W S and V_new's in the update. V_new enters the update as fp16 hi + lo (two products): hi only is
// 0.1-0.6 ms faster, but segmentations of one run then disagree by 1.0e-3 (bound 1e-3; 5.0e-4 with the lo half). S
// enters V_new = U - W S as fp16 hi only: hi + lo makes segmentations agree to 1e-4 but costs 0.3-1 ms (H200).
#include "kda_chunk_prep.cuh"
#include "kda_common.cuh"
#include "kda_fwd.h"
#include "kda_state_tile.cuh"
#include "kda_tile_copy.cuh"

namespace kda {

namespace {

constexpr int C = 64;    // chunk rows
constexpr int D = 128;   // head dim

// ---- record offsets (bytes) ----
constexpr int R_W = 0;
constexpr int R_QG = 16384;
constexpr int R_KG = 32768;
constexpr int R_AQK = 49152;
constexpr int R_GAM = 54272;
constexpr int R_AB = 54784;
constexpr int R_END = 59904;
static_assert(R_END == kFwdRecordBytes, "record layout");
constexpr int TRI = 5120;  // bytes of 10 lower 16x16 fp16 blocks

__device__ __forceinline__ int tri_blk(int I, int J) { return (I * (I + 1)) / 2 + J; }

// Element offset of (r, c) in a bf16 tile of RL-element rows, 16-byte chunks XOR-swizzled so that
// ldmatrix over 8 consecutive rows touches 8 distinct bank groups (RL = 16, 32, 64, 128).
template <int RL>
__device__ __forceinline__ int swv(int r, int c) {
  if constexpr (RL >= 64) return r * RL + ((((c >> 3) ^ (r & 7))) << 3) + (c & 7);
  else if constexpr (RL == 32) return r * 32 + ((((c >> 3) ^ ((r >> 1) & 3))) << 3) + (c & 7);
  else return r * 16 + ((((c >> 3) ^ ((r >> 2) & 1))) << 3) + (c & 7);
}
// element offset of (r, c) inside lower block blk of a triangular store
__device__ __forceinline__ int tri_off(int blk, int r, int c) { return blk * 256 + swv<16>(r, c); }

// B fragment (two n8 tiles, k16) of lower block blk, block stored [n][k]
__device__ __forceinline__ void ldb_tri(uint32_t (&b)[4], const __half* t, int blk, int lane) {
  ldsm4(b, t + tri_off(blk, (lane & 7) + ((lane >> 4) << 3), ((lane >> 3) & 1) << 3));
}
// A fragment (16x16) from storage [k][m] of a tile with RL-element rows
template <int RL, class T>
__device__ __forceinline__ void lda_tv(uint32_t (&a)[4], const T* t, int m0, int k0, int lane) {
  ldsm4t(a, t + swv<RL>(k0 + (lane & 7) + ((lane >> 4) << 3), m0 + (((lane >> 3) & 1) << 3)));
}

// =====================================================================================================
// 1. prep (kda_chunk_prep.cuh) into the forward's record
// =====================================================================================================
__device__ __forceinline__ void st_u32(char* base, int elem, uint32_t x) {
  *reinterpret_cast<uint32_t*>(base + elem * 2) = x;
}

struct FwdRecord {
  static constexpr bool kBwd = false;
  static __device__ __forceinline__ float* gamma(char* rec) { return reinterpret_cast<float*>(rec + R_GAM); }
  static __device__ __forceinline__ void aqk(char* rec, int I, int J, int r, int c, uint32_t x) {
    st_u32(rec + R_AQK, tri_off(tri_blk(I, J), r, c), x);
  }
  // piece p of the staged sw128 tile (row p / 16, chunk p % 16) goes to its swh place: the half (chunk / 8),
  // row and in-half chunk keep their values, so the swizzle carries over
  static __device__ __forceinline__ void qg_kg_piece(char* rec, int p, uint4 qg, uint4 kg) {
    const int at = (((p >> 3) & 1) * 512 + (p >> 4) * 8 + (p & 7)) * 16;
    *reinterpret_cast<uint4*>(rec + R_QG + at) = qg;
    *reinterpret_cast<uint4*>(rec + R_KG + at) = kg;
  }
  static __device__ __forceinline__ void ab(char* rec, int I, int J, int r, int c, uint32_t x) {
    st_u32(rec + R_AB, tri_off(tri_blk(I, J), r, c), x);
  }
  static __device__ __forceinline__ void w(char* rec, int i, int j, float x0, float x1) {  // stored negated
    st_u32(rec + R_W, swh(i, j), pack_f16(-x0, -x1));
  }
};

constexpr int PT = chunk_prep::NT;
constexpr int PREP_SMEM = chunk_prep::SMEM;

__global__ void __launch_bounds__(PT, 2) prep_kernel(const PrepArgs a) {
  extern __shared__ __align__(128) char smem[];
  const chunk_prep::Inputs in{a.q, a.k, nullptr, a.g, a.beta, a.chunks, a.H, a.scale, a.status};
  const int2 at = chunk_prep::own_chunk_head(a.H);
  char* rec = static_cast<char*>(a.ws) + (static_cast<int64_t>(at.x) * a.H + at.y) * kFwdRecordBytes;
  chunk_prep::prep_chunk<FwdRecord>(in, rec, smem, at.x, at.y);
}

// =====================================================================================================
// 2. walks
// =====================================================================================================
template <bool OUT, int NW>
struct WalkCfg {
  static constexpr int VT = 16 * NW;                  // value columns per CTA
  static constexpr int NT = 32 * NW;                  // threads
  static constexpr int TILES = (OUT ? D : 2 * D) / VT;  // CTAs per (segment, head)
  static constexpr int S_V = R_END;                   // bf16 [64][VT] swizzled (rows of VT)
  static constexpr int S_O = S_V + C * VT * 2;        // per warp bf16 [64][16] o staging
  static constexpr int SMEM = S_O + (OUT ? NW * 2048 : 0);
  // W S, Qg S and the S update by wgmma: sm_90a and whole warpgroups (NW = 2 keeps mma.sync, like sm_100a /
  // sm_103a)
  static constexpr bool WGMMA = KDA_HAS_WGMMA && NW % 4 == 0;
  static_assert(R_W % 1024 == 0 && R_QG % 1024 == 0 && R_KG % 1024 == 0,
                "wgmma B tiles start on 1024-byte swizzle groups");
};

// ST *= r (a power of two: exact)
__device__ __forceinline__ void rescale(float (&ST)[16][4], float r) {
#pragma unroll
  for (int nt = 0; nt < 16; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) ST[nt][e] *= r;
}

// bytes [FROM, FROM + BYTES) of a record to the same offsets in shared memory, 16-byte pieces tid + NT k: the sizes are
// compile-time, so the loop unrolls into copies at fixed offsets from one pointer pair per thread (a generic loop with
// its bound checks and 64-bit index arithmetic was ~340 of the walk step's instructions)
template <int NT, int FROM, int BYTES>
__device__ __forceinline__ void copy_range(char* smem, const char* rec, int tid) {
  static_assert(FROM % 16 == 0 && BYTES % 16 == 0, "16-byte pieces");
  constexpr int PIECES = BYTES / 16, FULL = PIECES / NT, REST = PIECES % NT;
  char* d = smem + tid * 16;
  const char* s = rec + tid * 16;
  static_for<FULL>([&](auto k) {  // the offsets ride in the instructions
    constexpr int off = FROM + decltype(k)::value * NT * 16;
    cp_async16_at<off, off>(d, s, true);
  });
  if (REST > 0 && tid < REST) cp_async16_at<FROM + FULL * NT * 16, FROM + FULL * NT * 16>(d, s, true);
}

template <bool OUT, int NW>
__global__ void __launch_bounds__(32 * NW, NW >= 8 ? 1 : 2) walk_kernel(const WalkArgs a) {
  using Cfg = WalkCfg<OUT, NW>;
  constexpr int VT = Cfg::VT, NT = Cfg::NT;
  extern __shared__ __align__(128) char smem[];
  // wgmma's swizzle is on address bits: the B tiles must start on 1024-byte boundaries of the shared window
  // (dynamic shared memory starts on one when the kernel has no static shared memory, as here)
  if (Cfg::WGMMA && (smem_u32(smem) & 1023) != 0) __trap();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int tile = blockIdx.x, seg = blockIdx.y, h = blockIdx.z;
  const int H = a.H;
  const int32_t* row = a.segs + seg * 8;
  const int64_t rec0 = row[2];
  const int idx = row[3], kind = row[4];
  const int nchunks = row[5];
  // a chunk's (first token, rows) from the chunk table (the first chunk of a run that starts inside a document is
  // partial: it ends on the document's 64-token grid, kda_kcp/plan.py), read a step before its use: the V copies
  // and the o stores would wait on it otherwise
  auto chunk_at = [&](int ch) { return ld_global_pinned_int2(a.chunks + 2 * (rec0 + ch)); };
  const int vbase = tile * VT;           // virtual column: output [0, 128); summary M [0, 128), E [128, 256)
  const bool isE = OUT || vbase >= D;    // columns with a U term
  const int vt0 = vbase & (D - 1);
  const int wcol = warp * 16;            // this warp's columns inside the tile
  const int g4 = lane >> 2, l4 = lane & 3;
  const char* ws = static_cast<const char*>(a.ws);
  const __nv_bfloat16* vin = static_cast<const __nv_bfloat16*>(a.v);

  // the record's fp16 tiles (ldmatrix and the descriptors move 16-bit words: the element type only names them)
  const __half* sW = reinterpret_cast<const __half*>(smem + R_W);
  const __half* sQg = reinterpret_cast<const __half*>(smem + R_QG);
  const __half* sKg = reinterpret_cast<const __half*>(smem + R_KG);
  const __half* sAqk = reinterpret_cast<const __half*>(smem + R_AQK);
  const float* sGam = reinterpret_cast<const float*>(smem + R_GAM);
  const __half* sAb = reinterpret_cast<const __half*>(smem + R_AB);
  __nv_bfloat16* sV = reinterpret_cast<__nv_bfloat16*>(smem + Cfg::S_V);
  __nv_bfloat16* sO = reinterpret_cast<__nv_bfloat16*>(smem + Cfg::S_O) + warp * (C * 16);

  const int64_t row_elems = static_cast<int64_t>(H) * D;  // elements per token row of v and o
  // the V tile's columns of token row 0 (load_rows: a pass of NT / (VT / 8) = 16 rows keeps swv's row & 7)
  static_assert((NT / (VT / 8)) % 8 == 0 && C % (NT / (VT / 8)) == 0, "V tile: whole passes of 8-row multiples");
  const __nv_bfloat16* v_tile = vin + h * D + vt0;
  // this lane's o pieces (rows lane / 2 + 16 it of its warp's 16 columns; + token x row_elems)
  __nv_bfloat16* o_piece = OUT ? static_cast<__nv_bfloat16*>(a.o) + (lane >> 1) * row_elems + h * D + vt0 + wcol +
                                     ((lane & 1) << 3)
                               : nullptr;
  auto record = [&](int ch) { return ws + (rec0 + ch) * H * static_cast<int64_t>(kFwdRecordBytes) +
                                     static_cast<int64_t>(h) * kFwdRecordBytes; };
  // group A: A diag(beta) and the V tile (columns with a U term only)
  auto issue_a = [&](int ch, int2 ck) {
    if (isE) {
      copy_range<NT, R_AB, TRI>(smem, record(ch), tid);
      load_rows<NT, C, VT / 8>(sV, VT, v_tile + ck.x * row_elems, row_elems, ck.y, tid,
                               [](int r, int c) { return swv<Cfg::VT>(r, c); });
    }
  };
  // group WQ: -W (and Qg)
  auto issue_wq = [&](int ch) { copy_range<NT, R_W, OUT ? 32768 : 16384>(smem, record(ch), tid); };
  // group AK: Kg, (Aqk,) gamma
  auto issue_ak = [&](int ch) {
    if (OUT) {
      copy_range<NT, R_KG, R_AB - R_KG>(smem, record(ch), tid);
    } else {
      copy_range<NT, R_KG, 16384>(smem, record(ch), tid);
      copy_range<NT, R_GAM, 512>(smem, record(ch), tid);
    }
  };

  // ---- the state columns of this warp, transposed (rows = value columns, cols = keys) ----
  float ST[16][4];
  {
    const float* src = nullptr;
    if (OUT) {
      if (kind == 1) src = a.sin + (static_cast<int64_t>(idx) * H + h) * D * D;
      else if (a.state_in != nullptr) src = a.state_in + (static_cast<int64_t>(idx) * H + h) * D * D;
    }
#pragma unroll
    for (int nt = 0; nt < 16; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int v = vt0 + wcol + g4 + ((e >> 1) << 3);
        const int d = nt * 8 + l4 * 2 + (e & 1);
        float x = 0.f;
        if (OUT) {
          if (src != nullptr) x = src[d * D + v];
        } else {
          x = (!isE && v == d) ? 1.f : 0.f;
        }
        ST[nt][e] = x;
      }
  }
  // The fp16 operands' scale sc, a power of two per warp (a warp's value columns evolve apart from the others'):
  // it holds the running max of |S_in| and of the V rows walked so far in [32, 64), so whatever v's scale the
  // operands neither overflow (the state stays within ~2^10 of that max) nor fall into fp16's subnormals. ST holds
  // S sc; o and the summaries leave unscaled. Powers of two scale exactly: results equal the unscaled walk's
  // wherever that one's operands are normal fp16 numbers. A chunk whose V raises the max takes the new scale at
  // the next chunk (the vote is then off the U products' path), unless its V would leave the old scale's
  // headroom or no scale was set yet: then its U is formed again at the new scale (H200: fwd +0.0 / +0.13 / +0.0
  // ms at H = 4 / 16 / 64 against no scale; the first form, a warp max before every chunk's U, cost +2-3 %).
  float vmax = 0.f, sc = 1.f;
  float sc_next = 1.f;  // the scale for the running max, taken up at the next chunk
  {
    float m = 0.f;
#pragma unroll
    for (int nt = 0; nt < 16; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) m = fmaxf(m, fabsf(ST[nt][e]));
    m = warp_max(m);
    if (m > 0.f) {
      vmax = m;
      sc = operand_scale(m);
      rescale(ST, sc);
    }
    sc_next = sc;
  }

  int2 cur = make_int2(0, 0);  // chunk ch's (first token, rows)
  if (nchunks > 0) {
    cur = chunk_at(0);
    issue_a(0, cur);
    cp_async_commit();
    issue_wq(0);
    cp_async_commit();
  }
  for (int ch = 0; ch < nchunks; ++ch) {
    const bool has_next = ch + 1 < nchunks;
    // B1: group A(ch) landed; every warp is done with AK(ch - 1): stream AK(ch) in
    cp_async_wait1();
    __syncthreads();
    issue_ak(ch);
    cp_async_commit();
    const int2 next = has_next ? chunk_at(ch + 1) : make_int2(0, 0);  // used after B2 and in the next step

    // ---- U^T = V^T (A diag(beta))^T ----
    float VN[8][4];
    zero_frags(VN);
    if (isE) {
      if (sc_next != sc) {  // the running max grew last chunk: S at the new scale (exact)
        rescale(ST, sc_next / sc);
        sc = sc_next;
      }
      uint32_t va[4][4];
      uint32_t mb = 0;  // this lane's largest |V| as bf16 bits (for bf16 pairs the magnitude orders as the bits)
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        lda_tv<VT>(va[ks], sV, wcol, ks * 16, lane);
#pragma unroll
        for (int e = 0; e < 4; ++e) mb = __vmaxu2(mb, va[ks][e] & 0x7fff7fffu);
      }
      const float2 mf = bf2_to_f2(mb);
      const float m = fmaxf(mf.x, mf.y);
      auto u_product = [&]() {
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
          uint32_t vf[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) vf[e] = bf16x2_to_f16x2(va[ks][e], sc);
#pragma unroll
          for (int np = 0; np < 4; ++np) {
            if (ks <= np) {
              uint32_t b[4];
              ldb_tri(b, sAb, tri_blk(np, ks), lane);
              mma_n16<true>(VN[2 * np], VN[2 * np + 1], vf, b);
            }
          }
        }
      };
      u_product();
      if (__any_sync(0xffffffffu, m > vmax)) {  // a larger V than any before (rare after the first chunks)
        const bool first = vmax == 0.f;  // nothing seen yet (no incoming state): sc = 1 may suit nothing
        vmax = warp_max(fmaxf(m, vmax));
        sc_next = operand_scale(vmax);
        if (first || vmax * sc >= 512.f) {  // else the headroom at the old scale holds this V: U stands
          rescale(ST, sc_next / sc);
          sc = sc_next;
          zero_frags(VN);
          u_product();
        }
      }
    }
    // B2: WQ(ch) landed (and, for wgmma, made visible to the async proxy); group A is free: stream A(ch + 1) in
    cp_async_wait1();
    if constexpr (Cfg::WGMMA) fence_async_smem();
    __syncthreads();
    if (has_next) issue_a(ch + 1, next);
    cp_async_commit();

    // ---- V_new^T = U^T + S^T (-W)^T ; O^T = S^T Qg^T ----
    float O[8][4];
    zero_frags(O);
    if constexpr (Cfg::WGMMA) {
      uint32_t sa[8][4];
#pragma unroll
      for (int ks = 0; ks < 8; ++ks) afrag_f16(ST[2 * ks], ST[2 * ks + 1], sa[ks]);
      fence_frags(VN);
      fence_frags(O);
      wgmma_fence();  // VN (U) and the A registers were written by ordinary instructions
      const uint64_t dw = sw128_desc(sW), dq = sw128_desc(sQg);
#pragma unroll
      for (int ks = 0; ks < 8; ++ks) {
        const uint64_t k = (ks >> 2) * (8192 >> 4) + (ks & 3) * 2;  // half, then 32 bytes per 16 keys
        wgmma_n64_rs<true>(VN, sa[ks], dw + k);
        if constexpr (OUT) wgmma_n64_rs<true>(O, sa[ks], dq + k);
      }
      wgmma_commit();
      wgmma_wait0();
      fence_frags(VN);
      fence_frags(O);
      fence_frags(sa);
    } else {
#pragma unroll
      for (int ks = 0; ks < 8; ++ks) {
        uint32_t sa[4];
        afrag_f16(ST[2 * ks], ST[2 * ks + 1], sa);
        const int hk = (ks >> 2) * 4096, k0 = (ks & 3) * 16;  // the 64-key half and the step inside it
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          uint32_t bw[4];
          ldb<64>(bw, sW + hk, k0, np * 16, lane);
          mma_n16<true>(VN[2 * np], VN[2 * np + 1], sa, bw);
          if constexpr (OUT) {
            uint32_t bq[4];
            ldb<64>(bq, sQg + hk, k0, np * 16, lane);
            mma_n16<true>(O[2 * np], O[2 * np + 1], sa, bq);
          }
        }
      }
    }
    // B3: AK(ch) landed (Kg made visible to wgmma); WQ is free: stream WQ(ch + 1) in
    cp_async_wait1();
    if constexpr (Cfg::WGMMA) fence_async_smem();
    __syncthreads();
    if (has_next) issue_wq(ch + 1);
    cp_async_commit();

    // V_new^T as A operands, k = tokens (va; vl its lo half, for the state update)
    uint32_t va[4][4], vl[4][4];
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) split_afrag<true>(VN[2 * ks], VN[2 * ks + 1], va[ks], vl[ks]);
    if constexpr (OUT) {
      // O^T += V_new^T Aqk^T (lower blocks only)
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          if (ks <= np) {
            uint32_t b[4];
            ldb_tri(b, sAqk, tri_blk(np, ks), lane);
            mma_n16<true>(O[2 * np], O[2 * np + 1], va[ks], b);
          }
        }
      }
      // stage this warp's o (rows = tokens, 16 value columns; unscaled), then 16-byte stores
      const float inv = 1.f / sc;
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = g4 + ((e >> 1) << 3);
          const int t = n * 8 + l4 * 2 + (e & 1);
          sO[swv<16>(t, c)] = __float2bfloat16_rn(O[n][e] * inv);
        }
      __syncwarp();
      // lane: rows lane / 2 + 16 it, 8 columns; 16 rows apart the swizzle repeats
      __nv_bfloat16* dst = o_piece + cur.x * row_elems;
      const __nv_bfloat16* so = sO + swv<16>(lane >> 1, (lane & 1) << 3);
#pragma unroll
      for (int it = 0; it < 4; ++it) {
        if ((lane >> 1) + 16 * it < cur.y)
          *reinterpret_cast<uint4*>(dst + 16 * it * row_elems) = *reinterpret_cast<const uint4*>(so + 16 * it * 16);
      }
      __syncwarp();
    }
    // ---- S^T = S^T Diag(gamma) + V_new^T Kg ----
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) {
      const float2 ga = *reinterpret_cast<const float2*>(sGam + nt * 8 + l4 * 2);
      ST[nt][0] *= ga.x;
      ST[nt][1] *= ga.y;
      ST[nt][2] *= ga.x;
      ST[nt][3] *= ga.y;
    }
    if constexpr (Cfg::WGMMA) {
      fence_frags(ST);
      fence_frags(va);
      fence_frags(vl);
      wgmma_fence();  // ST (scaled by gamma) and V_new^T were written by ordinary instructions
      const uint64_t dk = sw128_desc(sKg, 8192);  // MN-major: the 64-key halves 8192 bytes apart
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        wgmma_n128_rs_mn<true>(ST, va[ks], dk + ks * (2048 >> 4));
        wgmma_n128_rs_mn<true>(ST, vl[ks], dk + ks * (2048 >> 4));
      }
      wgmma_commit();
      wgmma_wait0();
      fence_frags(ST);
      fence_frags(va);
      fence_frags(vl);
    } else {
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) state_tile_rank16<true, true>(ST, va[ks], vl[ks], sKg, ks, lane);
    }
    cur = next;
  }
  cp_async_wait_all();

  if constexpr (!OUT) {
    float* dst = (isE ? a.e_out : a.m_out) + (static_cast<int64_t>(idx) * H + h) * D * D;
    const float inv = 1.f / sc;
#pragma unroll
    for (int nt = 0; nt < 16; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int v = vt0 + wcol + g4 + ((e >> 1) << 3);
        const int d = nt * 8 + l4 * 2 + (e & 1);
        dst[d * D + v] = ST[nt][e] * inv;
      }
  }
}

// The walks run beside prep CTAs of later run groups (kda_kcp/cuda/forward.py): an SM takes the L1 / shared split
// the first kernel placed on it asks for, and a walk CTA's 75 KB alone would leave no room there for a 102 KB prep
// CTA beside it. Both kernels ask for the whole of shared memory, so a walk and a prep always fit one SM.
template <class K>
cudaError_t set_max_shared_carveout(K kern) {
  return cudaFuncSetAttribute(kern, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
}

template <bool OUT, int NW>
cudaError_t launch_walk(const WalkArgs& a, cudaStream_t stream) {
  using Cfg = WalkCfg<OUT, NW>;
  if (a.nseg == 0 || a.H == 0) return cudaSuccess;
  auto kern = walk_kernel<OUT, NW>;
  cudaError_t err = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::SMEM);
  if (err == cudaSuccess) err = set_max_shared_carveout(kern);
  if (err != cudaSuccess) return err;
  // segments on gridDim.y: one launch per kMaxGridY rows of the table (a row holds all a CTA reads of it)
  for (int64_t s0 = 0; s0 < a.nseg; s0 += kMaxGridY) {
    WalkArgs rows = a;
    rows.segs = a.segs + 8 * s0;
    rows.nseg = static_cast<int>(a.nseg - s0 < kMaxGridY ? a.nseg - s0 : kMaxGridY);
    kern<<<dim3(Cfg::TILES, rows.nseg, a.H), Cfg::NT, Cfg::SMEM, stream>>>(rows);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

template <bool OUT>
cudaError_t launch_walk_nw(const WalkArgs& a, int warps, cudaStream_t stream) {
  switch (warps) {
    case 2: return launch_walk<OUT, 2>(a, stream);
    case 4: return launch_walk<OUT, 4>(a, stream);
    case 8: return launch_walk<OUT, 8>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t launch_fwd_prep(const PrepArgs& a, cudaStream_t stream) {
  if (a.nchunk == 0 || a.H == 0) return cudaSuccess;
  cudaError_t err = cudaFuncSetAttribute(prep_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, PREP_SMEM);
  if (err == cudaSuccess) err = set_max_shared_carveout(prep_kernel);
  if (err != cudaSuccess) return err;
  prep_kernel<<<dim3(static_cast<unsigned>(static_cast<int64_t>(a.nchunk) * a.H)), PT, PREP_SMEM, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t launch_fwd_walk_output(const WalkArgs& a, int warps, cudaStream_t stream) {
  return launch_walk_nw<true>(a, warps, stream);
}
cudaError_t launch_fwd_walk_summary(const WalkArgs& a, int warps, cudaStream_t stream) {
  return launch_walk_nw<false>(a, warps, stream);
}

}  // namespace kda
