// KDA chunked forward (v4, "staged": DESIGN.md section 9 v1), head dim 128, chunk 64:
//   1. prep_kernel, one CTA per (chunk, head), 2 CTAs per SM: cumsum, anchored operands, L and Aqk on
//      tensor cores, A = (I + L)^-1 in FP32, W = A diag(beta) (K o exp G); writes one record per
//      (chunk, head) (kda_fwd.h): -W, Qg, Kg (bf16), Aqk and A diag(beta) (bf16 hi + lo, lower
//      blocks only), gamma (fp32). 1,096 B per token-head.
//   2. walk_kernel<OUT, NW>, one CTA per (segment, head, value tile of 16 NW columns): the state columns
//      of the tile in registers (mma accumulator layout, S transposed, one warp per 16 columns), chunks in
//      order; per chunk U = A diag(beta) V[:, tile], V_new = U - W S, O = Qg S + Aqk V_new,
//      S = Diag(gamma) S + Kg^T V_new. The record of chunk c + 1 streams in (cp.async, three groups)
//      while chunk c is computed. OUT: writes o. !OUT: [M | E] summary tiles from [I | 0].
//   3. the FP32 affine merge of segment summaries (kda_affine_merge.cuh, shared with the backward).
// Precision (NOTES.md): A diag(beta), Aqk and Aqk's operands, S and V_new carried as bf16 hi + lo.
#include "kda_chunk_prep.cuh"
#include "kda_common.cuh"
#include "kda_fwd.h"
#include "kda_state_tile.cuh"

namespace kda {

namespace {

constexpr int C = 64;    // chunk rows
constexpr int D = 128;   // head dim
constexpr int LDL = 68;  // fp32 row stride of the 64x64 L / A tiles

// ---- record offsets (bytes) ----
constexpr int R_W = 0;
constexpr int R_QG = 16384;
constexpr int R_KG = 32768;
constexpr int R_AQH = 49152;
constexpr int R_AQL = 54272;
constexpr int R_GAM = 59392;
constexpr int R_ABH = 59904;
constexpr int R_ABL = 65024;
constexpr int R_END = 70144;
static_assert(R_END == kFwdRecordBytes, "record layout");
constexpr int TRI = 5120;  // bytes of 10 lower 16x16 bf16 blocks

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
__device__ __forceinline__ void ldb_tri(uint32_t (&b)[4], const __nv_bfloat16* t, int blk, int lane) {
  ldsm4(b, t + tri_off(blk, (lane & 7) + ((lane >> 4) << 3), ((lane >> 3) & 1) << 3));
}
// A fragment (16x16) from storage [k][m] of a tile with RL-element rows
template <int RL>
__device__ __forceinline__ void lda_tv(uint32_t (&a)[4], const __nv_bfloat16* t, int m0, int k0, int lane) {
  ldsm4t(a, t + swv<RL>(k0 + (lane & 7) + ((lane >> 4) << 3), m0 + (((lane >> 3) & 1) << 3)));
}

// =====================================================================================================
// 1. prep
// =====================================================================================================
constexpr int PT = 256;
// phase A: anchored operands
constexpr int P_KR = 0;        // bf16 sw128 [64][128] K o exp(G - G_anchor)
constexpr int P_QRH = 16384;   // Q o exp(G - G_anchor), hi
constexpr int P_QRL = 32768;   //                         lo
constexpr int P_CCH = 49152;   // K o exp(G_anchor(I) - G), rows 0 .. 16 I + 15, hi
constexpr int P_CCL = 65536;   //                                              lo
constexpr int P_AEND = 81920;
// phase B (aliases phase A once L and Aqk are done)
constexpr int P_X = 0;         // bf16 sw128 K o exp(G)
constexpr int P_A = 16384;     // fp32 [64][LDL]
constexpr int P_PT = P_A + C * LDL * 4;  // fp32 [3][16][16]
constexpr int P_ABH = P_PT + 3072;       // bf16 sw64 [64][64]
constexpr int P_ABL = P_ABH + 8192;
static_assert(P_ABL + 8192 <= P_AEND, "phase B overflows phase A");
constexpr int P_QGS = P_CCH;             // bf16 sw128 Qg staging (the Cc tiles are dead by then)
constexpr int P_KGS = P_CCL;             // bf16 sw128 Kg staging
constexpr int P_L = P_AEND;              // fp32 [64][LDL]
constexpr int P_BETA = P_L + C * LDL * 4;
constexpr int P_TOT = P_BETA + 256;      // fp32 [4][128]
constexpr int P_GA = P_TOT + 2048;       // fp32 [4][128]
constexpr int P_GL = P_GA + 2048;        // fp32 [128]
constexpr int PREP_SMEM = P_GL + 512;

// One level of the blocked inverse (as v3): for I - J = LEV, P = sum_{J <= m < I} L_Im A_mJ, A_IJ = -A_II P.
template <int LEV>
__device__ __forceinline__ void inv_level(const float* sL, float* sA, float* sPt, int tid) {
  constexpr int NP = 4 - LEV;
#pragma unroll
  for (int it = 0; it < NP; ++it) {
    const int e = tid + it * PT;
    const int p = e >> 8, r = (e >> 4) & 15, c = e & 15;
    const int I = LEV + p, J = p;
    const float* lrow = sL + (I * 16 + r) * LDL + J * 16;
    const float* acol = sA + (J * 16) * LDL + J * 16 + c;
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma unroll
    for (int m = 0; m < 16 * LEV; m += 4) {
      s0 = fmaf(lrow[m + 0], acol[(m + 0) * LDL], s0);
      s1 = fmaf(lrow[m + 1], acol[(m + 1) * LDL], s1);
      s2 = fmaf(lrow[m + 2], acol[(m + 2) * LDL], s2);
      s3 = fmaf(lrow[m + 3], acol[(m + 3) * LDL], s3);
    }
    sPt[p * 256 + r * 16 + c] = (s0 + s1) + (s2 + s3);
  }
  __syncthreads();
#pragma unroll
  for (int it = 0; it < NP; ++it) {
    const int e = tid + it * PT;
    const int p = e >> 8, r = (e >> 4) & 15, c = e & 15;
    const int I = LEV + p, J = p;
    const float* arow = sA + (I * 16 + r) * LDL + I * 16;
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma unroll
    for (int m = 0; m < 16; m += 4) {
      s0 = fmaf(arow[m + 0], sPt[p * 256 + (m + 0) * 16 + c], s0);
      s1 = fmaf(arow[m + 1], sPt[p * 256 + (m + 1) * 16 + c], s1);
      s2 = fmaf(arow[m + 2], sPt[p * 256 + (m + 2) * 16 + c], s2);
      s3 = fmaf(arow[m + 3], sPt[p * 256 + (m + 3) * 16 + c], s3);
    }
    sA[(I * 16 + r) * LDL + J * 16 + c] = -((s0 + s1) + (s2 + s3));
  }
  __syncthreads();
}

__device__ __forceinline__ void st_u32(char* base, int elem, uint32_t x) {
  *reinterpret_cast<uint32_t*>(base + elem * 2) = x;
}

__global__ void __launch_bounds__(PT, 2) prep_kernel(const PrepArgs a) {
  extern __shared__ __align__(128) char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int ci = blockIdx.x, h = blockIdx.y, H = a.H;
  const int64_t tok = a.chunks[2 * ci];
  const int nrows = a.chunks[2 * ci + 1];
  char* rec = static_cast<char*>(a.ws) + (static_cast<int64_t>(ci) * H + h) * kFwdRecordBytes;
  const __nv_bfloat16* q = static_cast<const __nv_bfloat16*>(a.q);
  const __nv_bfloat16* k = static_cast<const __nv_bfloat16*>(a.k);
  const __nv_bfloat16* beta = static_cast<const __nv_bfloat16*>(a.beta);

  __nv_bfloat16* sKr = reinterpret_cast<__nv_bfloat16*>(smem + P_KR);
  __nv_bfloat16* sQrh = reinterpret_cast<__nv_bfloat16*>(smem + P_QRH);
  __nv_bfloat16* sQrl = reinterpret_cast<__nv_bfloat16*>(smem + P_QRL);
  __nv_bfloat16* sCch = reinterpret_cast<__nv_bfloat16*>(smem + P_CCH);
  __nv_bfloat16* sCcl = reinterpret_cast<__nv_bfloat16*>(smem + P_CCL);
  __nv_bfloat16* sX = reinterpret_cast<__nv_bfloat16*>(smem + P_X);
  float* sA = reinterpret_cast<float*>(smem + P_A);
  float* sPt = reinterpret_cast<float*>(smem + P_PT);
  __nv_bfloat16* sAbh = reinterpret_cast<__nv_bfloat16*>(smem + P_ABH);
  __nv_bfloat16* sAbl = reinterpret_cast<__nv_bfloat16*>(smem + P_ABL);
  float* sL = reinterpret_cast<float*>(smem + P_L);
  __nv_bfloat16* sQgS = reinterpret_cast<__nv_bfloat16*>(smem + P_QGS);
  __nv_bfloat16* sKgS = reinterpret_cast<__nv_bfloat16*>(smem + P_KGS);
  float* sBeta = reinterpret_cast<float*>(smem + P_BETA);
  float* sTot = reinterpret_cast<float*>(smem + P_TOT);
  float* sGa = reinterpret_cast<float*>(smem + P_GA);
  float* sGl = reinterpret_cast<float*>(smem + P_GL);

  const int cp = tid & 63, rq = tid >> 6;  // columns 2cp, 2cp + 1 of rows 16 rq .. 16 rq + 15
  const int d0 = cp * 2;
  const int g4 = lane >> 2, l4 = lane & 3;

  // ---- loads straight to registers (rows past the chunk's end read as zero) ----
  float G0[16], G1[16];
  uint32_t kk[16];
  const int64_t off0 = ((tok + rq * 16) * H + h) * D + d0;  // row 16 rq of this thread's columns
  const int rstride = H * D;                                 // elements per token row (< 2^31)
  const float* gp = a.g + off0;
  const __nv_bfloat16* kp = k + off0;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int j = rq * 16 + i;
    const bool ok = j < nrows;
    float2 gg = make_float2(0.f, 0.f);
    uint32_t kv = 0u;
    if (ok) {
      gg = __ldg(reinterpret_cast<const float2*>(gp + i * rstride));
      kv = __ldg(reinterpret_cast<const unsigned int*>(kp + i * rstride));
    }
    G0[i] = gg.x;
    G1[i] = gg.y;
    kk[i] = kv;
  }
  if (tid < C) sBeta[tid] = (tid < nrows) ? __bfloat162float(beta[(tok + tid) * H + h]) : 0.f;

  // ---- cumsum of g per 16-row block, then block offsets ----
#pragma unroll
  for (int i = 1; i < 16; ++i) {
    G0[i] += G0[i - 1];
    G1[i] += G1[i - 1];
  }
  sTot[rq * D + d0] = G0[15];
  sTot[rq * D + d0 + 1] = G1[15];
  __syncthreads();
  {
    float o0 = 0.f, o1 = 0.f;
    for (int qb = 0; qb < rq; ++qb) {
      o0 += sTot[qb * D + d0];
      o1 += sTot[qb * D + d0 + 1];
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      G0[i] += o0;
      G1[i] += o1;
    }
    sGa[rq * D + d0] = G0[0];
    sGa[rq * D + d0 + 1] = G1[0];
    if (rq == 3) {
      sGl[d0] = G0[15];
      sGl[d0 + 1] = G1[15];
      *reinterpret_cast<float2*>(rec + R_GAM + d0 * 4) = make_float2(fexp(G0[15]), fexp(G1[15]));
    }
  }
  __syncthreads();

  // ---- anchored Q/K rows of L and Aqk ----
  {
    uint32_t qq[16];  // q is read here, not with g and k, to keep the prep under 128 registers
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int j = rq * 16 + i;
      qq[i] = (j < nrows) ? __ldg(reinterpret_cast<const unsigned int*>(q + off0 + i * rstride)) : 0u;
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int j = rq * 16 + i;
      const float2 kf = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&kk[i]));
      const float2 qf = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&qq[i]));
      const float e0 = fexp(G0[i] - G0[0]), e1 = fexp(G1[i] - G1[0]);  // <= 1
      *reinterpret_cast<uint32_t*>(sKr + sw128(j, d0)) = pack_bf16(kf.x * e0, kf.y * e1);
      uint32_t hi, lo;
      split2(qf.x * e0, qf.y * e1, hi, lo);
      *reinterpret_cast<uint32_t*>(sQrh + sw128(j, d0)) = hi;
      *reinterpret_cast<uint32_t*>(sQrl + sw128(j, d0)) = lo;
    }
  }

  // ---- L and Aqk by anchor row block I: Cc_I = K o exp(G_anchor(I) - G) on rows 0 .. 16 I + 15 ----
  //      warp w < 4: Aqk block (I, w); w >= 4: L block (I, w - 4); blocks above the diagonal idle.
#pragma unroll
  for (int I = 0; I < 4; ++I) {
    if (rq <= I) {
      const float f0 = (I > rq) ? fexp(sGa[I * D + d0] - G0[0]) : 1.f;
      const float f1 = (I > rq) ? fexp(sGa[I * D + d0 + 1] - G1[0]) : 1.f;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const int j = rq * 16 + i;
        const float2 kf = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&kk[i]));
        const float r0 = fexp(G0[0] - G0[i]) * f0, r1 = fexp(G1[0] - G1[i]) * f1;  // exp(G_aI - G_j)
        uint32_t hi, lo;
        split2(kf.x * r0, kf.y * r1, hi, lo);
        *reinterpret_cast<uint32_t*>(sCch + sw128(j, d0)) = hi;
        *reinterpret_cast<uint32_t*>(sCcl + sw128(j, d0)) = lo;
      }
    }
    __syncthreads();
    const int J = warp & 3;
    const bool isL = warp >= 4;
    if (J <= I) {
      float acc[2][4];
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;
#pragma unroll
      for (int ks = 0; ks < 8; ++ks) {
        uint32_t bh[4];
        ldb<128>(bh, sCch, ks * 16, J * 16, lane);
        if (isL) {
          uint32_t af[4];
          lda<128>(af, sKr, I * 16, ks * 16, lane);
          mma_n16(acc[0], acc[1], af, bh);
        } else {
          uint32_t bl[4], ah[4], al[4];
          ldb<128>(bl, sCcl, ks * 16, J * 16, lane);
          lda<128>(ah, sQrh, I * 16, ks * 16, lane);
          lda<128>(al, sQrl, I * 16, ks * 16, lane);
          mma_n16(acc[0], acc[1], ah, bh);
          mma_n16(acc[0], acc[1], ah, bl);
          mma_n16(acc[0], acc[1], al, bh);
        }
      }
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e2 = 0; e2 < 2; ++e2) {
          const int r = g4 + e2 * 8, c = n * 8 + l4 * 2;
          const int i = I * 16 + r, j = J * 16 + c;
          float x0 = acc[n][e2 * 2], x1 = acc[n][e2 * 2 + 1];
          if (isL) {
            const float bi = sBeta[i];
            x0 = (I > J || j < i) ? x0 * bi : 0.f;
            x1 = (I > J || j + 1 < i) ? x1 * bi : 0.f;
            *reinterpret_cast<float2*>(sL + i * LDL + j) = make_float2(x0, x1);
          } else {
            x0 = (I > J || j <= i) ? x0 * a.scale : 0.f;
            x1 = (I > J || j + 1 <= i) ? x1 * a.scale : 0.f;
            uint32_t hi, lo;
            split2(x0, x1, hi, lo);
            st_u32(rec + R_AQH, tri_off(tri_blk(I, J), r, c), hi);
            st_u32(rec + R_AQL, tri_off(tri_blk(I, J), r, c), lo);
          }
        }
    }
    __syncthreads();
  }

  // ---- Qg = s Q o exp(G) = s (Q o exp(G - G_anchor)) exp(G_anchor), from the hi + lo anchored rows
  //      (Q and G0/G1 are not held for it), staged in the dead Cc tiles ----
  {
    const float ea0 = a.scale * fexp(G0[0]), ea1 = a.scale * fexp(G1[0]);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int j = rq * 16 + i;
      const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(sQrh + sw128(j, d0)));
      const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(sQrl + sw128(j, d0)));
      *reinterpret_cast<uint32_t*>(sQgS + sw128(j, d0)) = pack_bf16((hi.x + lo.x) * ea0, (hi.y + lo.y) * ea1);
    }
  }
  // ---- X = K o exp(G) over the dead Kr tile; Kg = K o exp(G_63 - G), staged ----
  {
    const float gl0 = sGl[d0], gl1 = sGl[d0 + 1];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int j = rq * 16 + i;
      const float2 kf = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&kk[i]));
      *reinterpret_cast<uint32_t*>(sX + sw128(j, d0)) = pack_bf16(kf.x * fexp(G0[i]), kf.y * fexp(G1[i]));
      *reinterpret_cast<uint32_t*>(sKgS + sw128(j, d0)) = pack_bf16(kf.x * fexp(gl0 - G0[i]), kf.y * fexp(gl1 - G1[i]));
    }
  }

  __syncthreads();  // Qr is read (Qg) before A overwrites it
  // ---- A = (I + L)^-1 in FP32: diagonal blocks (column-oriented substitution), then levels ----
  // (threads 0 .. 63, a serial chain; meanwhile the other warps copy the staged Qg and Kg to the record in
  // 16-byte pieces, before A diag(beta) and the inverse's levels touch shared memory near them)
  if (tid < 64) {
    invert_diag_blocks<LDL>(sL, sA, tid);
  } else {
    for (int p = tid - 64; p < C * D * 2 / 16; p += PT - 64) {
      *reinterpret_cast<uint4*>(rec + R_QG + p * 16) = *reinterpret_cast<const uint4*>(smem + P_QGS + p * 16);
      *reinterpret_cast<uint4*>(rec + R_KG + p * 16) = *reinterpret_cast<const uint4*>(smem + P_KGS + p * 16);
    }
  }
  __syncthreads();
  inv_level<1>(sL, sA, sPt, tid);
  inv_level<2>(sL, sA, sPt, tid);
  inv_level<3>(sL, sA, sPt, tid);
  // A diag(beta) as bf16 hi + lo: sw64 tiles for W below, lower blocks to the record
  for (int e = tid; e < C * C / 2; e += PT) {
    const int i = e >> 5, j = (e & 31) * 2;
    const float x0 = (j <= i) ? sA[i * LDL + j] * sBeta[j] : 0.f;
    const float x1 = (j + 1 <= i) ? sA[i * LDL + j + 1] * sBeta[j + 1] : 0.f;
    uint32_t hi, lo;
    split2(x0, x1, hi, lo);
    *reinterpret_cast<uint32_t*>(sAbh + sw64(i, j)) = hi;
    *reinterpret_cast<uint32_t*>(sAbl + sw64(i, j)) = lo;
    const int I = i >> 4, J = j >> 4;
    if (J <= I) {
      st_u32(rec + R_ABH, tri_off(tri_blk(I, J), i & 15, j & 15), hi);
      st_u32(rec + R_ABL, tri_off(tri_blk(I, J), i & 15, j & 15), lo);
    }
  }
  __syncthreads();

  // ---- W = A diag(beta) X, stored negated. Warp: row blocks {mp, 3 - mp}, columns 32 nq .. ----
  {
    const int mp = warp & 1, nq = warp >> 1;
    float acc[2][4][4];
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[u][n][e] = 0.f;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int m = u == 0 ? mp : 3 - mp;
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        if (ks <= m) {
          uint32_t ah[4], al[4];
          lda<64>(ah, sAbh, m * 16, ks * 16, lane);
          lda<64>(al, sAbl, m * 16, ks * 16, lane);
#pragma unroll
          for (int np = 0; np < 2; ++np) {
            uint32_t b[4];
            ldb_t<128>(b, sX, ks * 16, nq * 32 + np * 16, lane);
            mma_n16(acc[u][2 * np], acc[u][2 * np + 1], ah, b);
            mma_n16(acc[u][2 * np], acc[u][2 * np + 1], al, b);
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int m = u == 0 ? mp : 3 - mp;
#pragma unroll
      for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int e2 = 0; e2 < 2; ++e2) {
          const int i = m * 16 + g4 + e2 * 8;
          const int j = nq * 32 + n * 8 + l4 * 2;
          st_u32(rec + R_W, sw128(i, j), pack_bf16(-acc[u][n][e2 * 2], -acc[u][n][e2 * 2 + 1]));
        }
    }
  }
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
};

template <int NT>
__device__ __forceinline__ void copy_range(char* smem, const char* rec, int from, int bytes, int tid) {
  for (int p = tid; p < bytes / 16; p += NT) cp_async16(smem + from + p * 16, rec + from + p * 16, true);
}

template <bool OUT, int NW>
__global__ void __launch_bounds__(32 * NW, NW >= 8 ? 1 : 2) walk_kernel(const WalkArgs a) {
  using Cfg = WalkCfg<OUT, NW>;
  constexpr int VT = Cfg::VT, NT = Cfg::NT;
  extern __shared__ __align__(128) char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int tile = blockIdx.x, seg = blockIdx.y, h = blockIdx.z;
  const int H = a.H;
  const int32_t* row = a.segs + seg * 8;
  const int64_t rec0 = row[2];
  const int idx = row[3], kind = row[4];
  const int nchunks = row[5];
  // a chunk's tokens come from the chunk table: the first chunk of a run that starts inside a document
  // is partial (it ends on the document's 64-token grid, kda_kcp/plan.py)
  auto chunk_tok = [&](int ch) { return static_cast<int64_t>(a.chunks[2 * (rec0 + ch)]); };
  auto chunk_rows = [&](int ch) { return a.chunks[2 * (rec0 + ch) + 1]; };
  const int vbase = tile * VT;           // virtual column: output [0, 128); summary M [0, 128), E [128, 256)
  const bool isE = OUT || vbase >= D;    // columns with a U term
  const int vt0 = vbase & (D - 1);
  const int wcol = warp * 16;            // this warp's columns inside the tile
  const int g4 = lane >> 2, l4 = lane & 3;
  const char* ws = static_cast<const char*>(a.ws);
  const __nv_bfloat16* vin = static_cast<const __nv_bfloat16*>(a.v);

  const __nv_bfloat16* sW = reinterpret_cast<const __nv_bfloat16*>(smem + R_W);
  const __nv_bfloat16* sQg = reinterpret_cast<const __nv_bfloat16*>(smem + R_QG);
  const __nv_bfloat16* sKg = reinterpret_cast<const __nv_bfloat16*>(smem + R_KG);
  const __nv_bfloat16* sAqh = reinterpret_cast<const __nv_bfloat16*>(smem + R_AQH);
  const __nv_bfloat16* sAql = reinterpret_cast<const __nv_bfloat16*>(smem + R_AQL);
  const float* sGam = reinterpret_cast<const float*>(smem + R_GAM);
  const __nv_bfloat16* sAbh = reinterpret_cast<const __nv_bfloat16*>(smem + R_ABH);
  const __nv_bfloat16* sAbl = reinterpret_cast<const __nv_bfloat16*>(smem + R_ABL);
  __nv_bfloat16* sV = reinterpret_cast<__nv_bfloat16*>(smem + Cfg::S_V);
  __nv_bfloat16* sO = reinterpret_cast<__nv_bfloat16*>(smem + Cfg::S_O) + warp * (C * 16);

  auto record = [&](int ch) { return ws + (rec0 + ch) * H * static_cast<int64_t>(kFwdRecordBytes) +
                                     static_cast<int64_t>(h) * kFwdRecordBytes; };
  // group A: A diag(beta) and the V tile (columns with a U term only)
  auto issue_a = [&](int ch) {
    if (isE) {
      copy_range<NT>(smem, record(ch), R_ABH, 2 * TRI, tid);
      const int64_t tok = chunk_tok(ch);
      const int nr = chunk_rows(ch);
      constexpr int PPR = VT / 8;  // 16-byte pieces per row
      for (int p = tid; p < C * PPR; p += NT) {
        const int r = p / PPR, c = (p % PPR) * 8;
        const bool ok = r < nr;
        const int64_t off = ok ? ((tok + r) * H + h) * D + vt0 + c : 0;
        cp_async16(sV + swv<VT>(r, c), vin + off, ok);
      }
    }
  };
  // group WQ: -W (and Qg)
  auto issue_wq = [&](int ch) { copy_range<NT>(smem, record(ch), R_W, OUT ? 32768 : 16384, tid); };
  // group AK: Kg, (Aqk hi + lo,) gamma
  auto issue_ak = [&](int ch) {
    if (OUT) {
      copy_range<NT>(smem, record(ch), R_KG, R_ABH - R_KG, tid);
    } else {
      copy_range<NT>(smem, record(ch), R_KG, 16384, tid);
      copy_range<NT>(smem, record(ch), R_GAM, 512, tid);
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

  if (nchunks > 0) {
    issue_a(0);
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

    // ---- U^T = V^T (A diag(beta))^T ----
    float VN[8][4];
    zero_frags(VN);
    if (isE) {
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        uint32_t va[4];
        lda_tv<VT>(va, sV, wcol, ks * 16, lane);
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          if (ks <= np) {
            uint32_t bh[4], bl[4];
            ldb_tri(bh, sAbh, tri_blk(np, ks), lane);
            ldb_tri(bl, sAbl, tri_blk(np, ks), lane);
            mma_n16(VN[2 * np], VN[2 * np + 1], va, bh);
            mma_n16(VN[2 * np], VN[2 * np + 1], va, bl);
          }
        }
      }
    }
    // B2: WQ(ch) landed; group A is free: stream A(ch + 1) in
    cp_async_wait1();
    __syncthreads();
    if (has_next) issue_a(ch + 1);
    cp_async_commit();

    // ---- V_new^T = U^T + S^T (-W)^T ; O^T = S^T Qg^T (S as hi + lo; hi only under KDA_WALK_HI_ONLY) ----
    float O[8][4];
    zero_frags(O);
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
      uint32_t sh[4], sl[4];
      split_afrag(ST[2 * ks], ST[2 * ks + 1], sh, sl);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t bw[4];
        ldb<128>(bw, sW, ks * 16, np * 16, lane);
        mma_n16(VN[2 * np], VN[2 * np + 1], sh, bw);
        if constexpr (kWalkSLo) mma_n16(VN[2 * np], VN[2 * np + 1], sl, bw);
        if constexpr (OUT) {
          uint32_t bq[4];
          ldb<128>(bq, sQg, ks * 16, np * 16, lane);
          mma_n16(O[2 * np], O[2 * np + 1], sh, bq);
          if constexpr (kWalkSLo) mma_n16(O[2 * np], O[2 * np + 1], sl, bq);
        }
      }
    }
    // B3: AK(ch) landed; WQ is free: stream WQ(ch + 1) in
    cp_async_wait1();
    __syncthreads();
    if (has_next) issue_wq(ch + 1);
    cp_async_commit();

    // V_new^T as A operands (hi, lo), k = tokens
    uint32_t vh[4][4], vl[4][4];
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      split_afrag(VN[2 * ks], VN[2 * ks + 1], vh[ks], vl[ks]);
    }
    if constexpr (OUT) {
      // O^T += V_new^T Aqk^T (lower blocks only)
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          if (ks <= np) {
            uint32_t bh[4], bl[4];
            ldb_tri(bh, sAqh, tri_blk(np, ks), lane);
            ldb_tri(bl, sAql, tri_blk(np, ks), lane);
            mma_n16(O[2 * np], O[2 * np + 1], vh[ks], bh);
            mma_n16(O[2 * np], O[2 * np + 1], vl[ks], bh);
            mma_n16(O[2 * np], O[2 * np + 1], vh[ks], bl);
          }
        }
      }
      // stage this warp's o (rows = tokens, 16 value columns), then 16-byte stores
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = g4 + ((e >> 1) << 3);
          const int t = n * 8 + l4 * 2 + (e & 1);
          sO[swv<16>(t, c)] = __float2bfloat16_rn(O[n][e]);
        }
      __syncwarp();
      const int64_t tok = chunk_tok(ch);
      const int nrows = chunk_rows(ch);
      __nv_bfloat16* o = static_cast<__nv_bfloat16*>(a.o);
#pragma unroll
      for (int it = 0; it < 4; ++it) {
        const int p = lane + it * 32;
        const int r = p >> 1, c = (p & 1) << 3;
        if (r < nrows) {
          const uint4 val = *reinterpret_cast<const uint4*>(sO + swv<16>(r, c));
          *reinterpret_cast<uint4*>(o + ((tok + r) * H + h) * D + vt0 + wcol + c) = val;
        }
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
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) state_tile_rank16(ST, vh[ks], vl[ks], sKg, ks, lane);
  }
  cp_async_wait_all();

  if constexpr (!OUT) {
    float* dst = (isE ? a.e_out : a.m_out) + (static_cast<int64_t>(idx) * H + h) * D * D;
#pragma unroll
    for (int nt = 0; nt < 16; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int v = vt0 + wcol + g4 + ((e >> 1) << 3);
        const int d = nt * 8 + l4 * 2 + (e & 1);
        dst[d * D + v] = ST[nt][e];
      }
  }
}

template <bool OUT, int NW>
cudaError_t launch_walk(const WalkArgs& a, cudaStream_t stream) {
  using Cfg = WalkCfg<OUT, NW>;
  if (a.nseg == 0 || a.H == 0) return cudaSuccess;
  auto kern = walk_kernel<OUT, NW>;
  cudaError_t err = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::SMEM);
  if (err != cudaSuccess) return err;
  kern<<<dim3(Cfg::TILES, a.nseg, a.H), Cfg::NT, Cfg::SMEM, stream>>>(a);
  return cudaGetLastError();
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
  if (err != cudaSuccess) return err;
  prep_kernel<<<dim3(a.nchunk, a.H), PT, PREP_SMEM, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t launch_fwd_walk_output(const WalkArgs& a, int warps, cudaStream_t stream) {
  return launch_walk_nw<true>(a, warps, stream);
}
cudaError_t launch_fwd_walk_summary(const WalkArgs& a, int warps, cudaStream_t stream) {
  return launch_walk_nw<false>(a, warps, stream);
}

}  // namespace kda
