// KDA chunked forward, head dim 128, chunk 64: one fused kernel per (segment, head) that walks the
// chunks of a segment serially (chunk prep, A = (I + L)^-1, W, U, state walk and output all on chip),
// plus a small FP32 kernel that folds segment summaries (the affine merge, DESIGN.md section 2).
//
// Precision (see NOTES.md): bf16 tensor-core products with FP32 accumulation; operands whose rounding
// showed up in the output error are carried as a bf16 hi + lo pair (three products): the anchored q/k
// operands of Aqk, Aqk itself, A diag(beta), the state S and V_new. A is inverted in FP32.
#include "kda_common.cuh"
#include "kda_fwd.h"

namespace kda {

namespace {

constexpr int C = 64;      // chunk rows
constexpr int D = 128;     // head dim (K = V)
constexpr int NTH = 256;   // threads (8 warps)
constexpr int LDL = 68;    // fp32 row stride of the 64x64 L / A tiles
#ifndef KDA_SPLIT_S
#define KDA_SPLIT_S 1      // carry S as bf16 hi + lo in S^T W^T and S^T Qg^T (0: 6% faster, but the
                           // M chain of the summaries loses precision: NOTES.md)
#endif
constexpr bool kSplitS = KDA_SPLIT_S != 0;

// ---- shared memory map (bytes) ----
constexpr int OFF_Q = 0;
constexpr int OFF_K = OFF_Q + C * D * 2;
constexpr int OFF_V = OFF_K + C * D * 2;
constexpr int OFF_G = OFF_V + C * D * 2;            // fp32 [64][128]: g, then G (cumsum)
constexpr int OFF_P = OFF_G + C * D * 4;            // phase region
constexpr int P_SIZE = 131072;
// phase A (prep operands for L / Aqk)
constexpr int OFF_KR = OFF_P + 0;                   // bf16 sw128 [64][128]
constexpr int OFF_QRH = OFF_P + 16384;
constexpr int OFF_QRL = OFF_P + 32768;
constexpr int OFF_CCH = OFF_P + 49152;              // bf16 sw128 [160][128]
constexpr int OFF_CCL = OFF_P + 90112;
// phase B
constexpr int OFF_X = OFF_P + 0;                    // bf16 sw128: K o exp(G), then W
constexpr int OFF_QG = OFF_P + 16384;
constexpr int OFF_KG = OFF_P + 32768;
constexpr int OFF_L = OFF_P + 49152;                // fp32 [64][LDL]; later the o staging tile
constexpr int OFF_A = OFF_L + C * LDL * 4;          // fp32 [64][LDL]
constexpr int OFF_AQH = OFF_A + C * LDL * 4;        // bf16 sw64 [64][64]
constexpr int OFF_AQL = OFF_AQH + 8192;
constexpr int OFF_ABH = OFF_AQL + 8192;
constexpr int OFF_ABL = OFF_ABH + 8192;
constexpr int OFF_PT = OFF_ABL + 8192;              // fp32 [3][16][16]
constexpr int P_END = OFF_PT + 3 * 256 * 4;
static_assert(P_END <= OFF_P + P_SIZE, "phase B overflows the phase region");
static_assert(OFF_CCL + 160 * D * 2 <= OFF_P + P_SIZE, "phase A overflows the phase region");
constexpr int OFF_BETA = OFF_P + P_SIZE;            // fp32 [64]
constexpr int OFF_TOT = OFF_BETA + 256;             // fp32 [4][128]
constexpr int OFF_GA = OFF_TOT + 2048;              // fp32 [4][128]  G at rows 0, 16, 32, 48
constexpr int OFF_GL = OFF_GA + 2048;               // fp32 [128]     G at row 63
constexpr int OFF_GAM = OFF_GL + 512;               // fp32 [128]     exp(G_63)
constexpr int SMEM_BYTES = OFF_GAM + 512;

// Cc section of anchor block I starts at this row (section I holds rows 0 .. 16 I + 15).
__device__ __forceinline__ int cc_sec(int I) { return (I * (I + 1)) * 8; }  // 0, 16, 48, 96

__constant__ int kPairI[10] = {0, 1, 1, 2, 2, 2, 3, 3, 3, 3};
__constant__ int kPairJ[10] = {0, 0, 1, 0, 1, 2, 0, 1, 2, 3};
// phase-2 tasks per warp (forward): t < 10 -> Aqk pair t (3 products), t >= 10 -> L pair t - 10; -1 none.
// Snake order over costs 48, 16 mma: at most 96 mma per warp.
__constant__ int kTaskFwd[8][3] = {{0, 15, 16}, {1, 14, 17}, {2, 13, 18}, {3, 12, 19},
                                   {4, 11, -1}, {5, 10, -1}, {6, 9, -1}, {7, 8, -1}};
// summary: L pairs only
__constant__ int kTaskSum[8][3] = {{10, 18, -1}, {11, 19, -1}, {12, -1, -1}, {13, -1, -1},
                                   {14, -1, -1}, {15, -1, -1}, {16, -1, -1}, {17, -1, -1}};


// One level of the blocked inverse: for I - J = LEV, P = sum_{J <= m < I} L_Im A_mJ, then A_IJ = -A_II P.
// (4 - LEV) blocks of 16x16, 256 threads; fixed summation order (deterministic).
template <int LEV>
__device__ __forceinline__ void inv_level(const float* sL, float* sA, float* sPt, int tid) {
  constexpr int NP = 4 - LEV;
#pragma unroll
  for (int it = 0; it < NP; ++it) {
    const int e = tid + it * NTH;
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
    const int e = tid + it * NTH;
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

// Issue the cp.async loads of rows [0, 64) of chunk starting at token tok (nrows valid) for one head.
__device__ __forceinline__ void load_qkg(char* smem, const ChunkArgs& a, int64_t tok, int nrows, int h, bool fwd) {
  const int tid = threadIdx.x;
  const __nv_bfloat16* q = static_cast<const __nv_bfloat16*>(a.q);
  const __nv_bfloat16* k = static_cast<const __nv_bfloat16*>(a.k);
  __nv_bfloat16* sQ = reinterpret_cast<__nv_bfloat16*>(smem + OFF_Q);
  __nv_bfloat16* sK = reinterpret_cast<__nv_bfloat16*>(smem + OFF_K);
  float* sG = reinterpret_cast<float*>(smem + OFF_G);
#pragma unroll
  for (int it = 0; it < 4; ++it) {
    int piece = tid + it * NTH;  // 1024 pieces of 16 B
    int r = piece >> 4, c = (piece & 15) << 3;
    bool ok = r < nrows;
    int64_t off = ok ? ((tok + r) * a.H + h) * D + c : 0;
    cp_async16(sK + sw128(r, c), k + off, ok);
    if (fwd) cp_async16(sQ + sw128(r, c), q + off, ok);
  }
#pragma unroll
  for (int it = 0; it < 8; ++it) {
    int piece = tid + it * NTH;  // 2048 pieces of 16 B
    int r = piece >> 5, c = (piece & 31) << 2;
    bool ok = r < nrows;
    int64_t off = ok ? ((tok + r) * a.H + h) * D + c : 0;
    cp_async16(sG + r * D + c, a.g + off, ok);
  }
}
__device__ __forceinline__ void load_v(char* smem, const ChunkArgs& a, int64_t tok, int nrows, int h) {
  const int tid = threadIdx.x;
  const __nv_bfloat16* v = static_cast<const __nv_bfloat16*>(a.v);
  __nv_bfloat16* sV = reinterpret_cast<__nv_bfloat16*>(smem + OFF_V);
#pragma unroll
  for (int it = 0; it < 4; ++it) {
    int piece = tid + it * NTH;
    int r = piece >> 4, c = (piece & 15) << 3;
    bool ok = r < nrows;
    int64_t off = ok ? ((tok + r) * a.H + h) * D + c : 0;
    cp_async16(sV + sw128(r, c), v + off, ok);
  }
}

// FWD: emit o from the state entering the segment. !FWD: walk the summary state [M | E] (256 virtual
// columns; CTA z and warp pick 16 * MT of them) from [I | 0] and write it out.
template <bool FWD, int MT>
__global__ void __launch_bounds__(NTH, 1) chunk_kernel(const ChunkArgs a) {
  extern __shared__ __align__(128) char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int seg = blockIdx.x, h = blockIdx.y;
  const int H = a.H;
  const int64_t tok0 = a.segs[seg * 4 + 0];
  const int ntok = a.segs[seg * 4 + 1];
  const int info0 = a.segs[seg * 4 + 2];
  const int info1 = a.segs[seg * 4 + 3];
  const int nchunks = (ntok + C - 1) / C;

  __nv_bfloat16* sQ = reinterpret_cast<__nv_bfloat16*>(smem + OFF_Q);
  __nv_bfloat16* sK = reinterpret_cast<__nv_bfloat16*>(smem + OFF_K);
  __nv_bfloat16* sV = reinterpret_cast<__nv_bfloat16*>(smem + OFF_V);
  float* sG = reinterpret_cast<float*>(smem + OFF_G);
  __nv_bfloat16* sKr = reinterpret_cast<__nv_bfloat16*>(smem + OFF_KR);
  __nv_bfloat16* sQrh = reinterpret_cast<__nv_bfloat16*>(smem + OFF_QRH);
  __nv_bfloat16* sQrl = reinterpret_cast<__nv_bfloat16*>(smem + OFF_QRL);
  __nv_bfloat16* sCch = reinterpret_cast<__nv_bfloat16*>(smem + OFF_CCH);
  __nv_bfloat16* sCcl = reinterpret_cast<__nv_bfloat16*>(smem + OFF_CCL);
  __nv_bfloat16* sX = reinterpret_cast<__nv_bfloat16*>(smem + OFF_X);
  __nv_bfloat16* sQg = reinterpret_cast<__nv_bfloat16*>(smem + OFF_QG);
  __nv_bfloat16* sKg = reinterpret_cast<__nv_bfloat16*>(smem + OFF_KG);
  float* sL = reinterpret_cast<float*>(smem + OFF_L);
  float* sA = reinterpret_cast<float*>(smem + OFF_A);
  __nv_bfloat16* sO = reinterpret_cast<__nv_bfloat16*>(smem + OFF_L);
  __nv_bfloat16* sAqh = reinterpret_cast<__nv_bfloat16*>(smem + OFF_AQH);
  __nv_bfloat16* sAql = reinterpret_cast<__nv_bfloat16*>(smem + OFF_AQL);
  __nv_bfloat16* sAbh = reinterpret_cast<__nv_bfloat16*>(smem + OFF_ABH);
  __nv_bfloat16* sAbl = reinterpret_cast<__nv_bfloat16*>(smem + OFF_ABL);
  float* sPt = reinterpret_cast<float*>(smem + OFF_PT);
  float* sBeta = reinterpret_cast<float*>(smem + OFF_BETA);
  float* sTot = reinterpret_cast<float*>(smem + OFF_TOT);
  float* sGa = reinterpret_cast<float*>(smem + OFF_GA);
  float* sGl = reinterpret_cast<float*>(smem + OFF_GL);
  float* sGam = reinterpret_cast<float*>(smem + OFF_GAM);

  const __nv_bfloat16* beta = static_cast<const __nv_bfloat16*>(a.beta);

  // virtual state columns of this warp: FWD 16 value columns; summary 16*MT of [M (0..127) | E (128..255)]
  const int vbase = FWD ? warp * 16 : (blockIdx.z * 8 + warp) * 16 * MT;
  const bool isE = FWD || vbase >= D;
  const int vcol = vbase & (D - 1);
  const int g4 = lane >> 2, l4 = lane & 3;

  // ---- the state, transposed (rows = value columns, cols = keys), in mma accumulator layout ----
  float ST[MT][16][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < 16; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int v = vcol + mt * 16 + g4 + ((e >> 1) << 3);
        const int d = nt * 8 + l4 * 2 + (e & 1);
        float x = 0.f;
        if constexpr (FWD) {
          const float* src = nullptr;
          if (info1 == 1) src = a.sin + (static_cast<int64_t>(info0) * H + h) * D * D;
          else if (a.state_in != nullptr) src = a.state_in + (static_cast<int64_t>(info0) * H + h) * D * D;
          if (src != nullptr) x = src[d * D + v];
        } else {
          x = (!isE && v == d) ? 1.f : 0.f;
        }
        ST[mt][nt][e] = x;
      }

  // first chunk's loads
  {
    const int nr = min(C, ntok);
    load_qkg(smem, a, tok0, nr, h, FWD);
    load_v(smem, a, tok0, nr, h);
    cp_async_commit();
  }
  float bnext = 0.f;
  if (tid < C && tid < ntok) bnext = __bfloat162float(beta[(tok0 + tid) * H + h]);

  const int cp = tid & 63, rq = tid >> 6;  // elementwise role: columns 2cp, 2cp+1; rows 16rq..16rq+15
  const int d0 = cp * 2;

  for (int ch = 0; ch < nchunks; ++ch) {
    const int64_t tok = tok0 + static_cast<int64_t>(ch) * C;
    const int nrows = min(C, ntok - ch * C);
    const bool has_next = ch + 1 < nchunks;
    const int64_t tokn = tok + C;
    const int nrn = has_next ? min(C, ntok - (ch + 1) * C) : 0;

    cp_async_wait_all();
    if (tid < C) sBeta[tid] = bnext;
    __syncthreads();

    // ---- phase 1: cumsum of g inside the chunk (per row block, then block offsets) ----
    float G0[16], G1[16];
    {
      float r0 = 0.f, r1 = 0.f;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        float2 gg = *reinterpret_cast<const float2*>(sG + (rq * 16 + i) * D + d0);
        r0 += gg.x;
        r1 += gg.y;
        G0[i] = r0;
        G1[i] = r1;
      }
      sTot[rq * D + d0] = r0;
      sTot[rq * D + d0 + 1] = r1;
    }
    __syncthreads();
    {
      float o0 = 0.f, o1 = 0.f;
      for (int qq = 0; qq < rq; ++qq) {
        o0 += sTot[qq * D + d0];
        o1 += sTot[qq * D + d0 + 1];
      }
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        G0[i] += o0;
        G1[i] += o1;
        *reinterpret_cast<float2*>(sG + (rq * 16 + i) * D + d0) = make_float2(G0[i], G1[i]);
      }
      sGa[rq * D + d0] = G0[0];
      sGa[rq * D + d0 + 1] = G1[0];
      if (rq == 3) {
        sGl[d0] = G0[15];
        sGl[d0 + 1] = G1[15];
        sGam[d0] = fexp(G0[15]);
        sGam[d0 + 1] = fexp(G1[15]);
      }
    }
    __syncthreads();
    // ---- phase 1c: anchored operands of L (K rows) and Aqk (Q rows), columns Cc per anchor block ----
    {
      float F0[4], F1[4];  // exp(G_{a_I'} - G_{a_rq}) for later anchor blocks I'
#pragma unroll
      for (int I = 0; I < 4; ++I) {
        F0[I] = (I > rq) ? fexp(sGa[I * D + d0] - G0[0]) : 1.f;
        F1[I] = (I > rq) ? fexp(sGa[I * D + d0 + 1] - G1[0]) : 1.f;
      }
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const int j = rq * 16 + i;
        const float2 kk = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(sK + sw128(j, d0)));
        const float e0 = fexp(G0[i] - G0[0]), e1 = fexp(G1[i] - G1[0]);   // <= 1
        const float r0 = fexp(G0[0] - G0[i]), r1 = fexp(G1[0] - G1[i]);   // in [1, e^75]
        *reinterpret_cast<uint32_t*>(sKr + sw128(j, d0)) = pack_bf16(kk.x * e0, kk.y * e1);
        if constexpr (FWD) {
          const float2 qf = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(sQ + sw128(j, d0)));
          uint32_t hi, lo;
          split2(qf.x * e0, qf.y * e1, hi, lo);
          *reinterpret_cast<uint32_t*>(sQrh + sw128(j, d0)) = hi;
          *reinterpret_cast<uint32_t*>(sQrl + sw128(j, d0)) = lo;
        }
        const float c0 = kk.x * r0, c1 = kk.y * r1;
#pragma unroll
        for (int I = 0; I < 4; ++I) {
          if (I >= rq) {
            uint32_t hi, lo;
            split2(c0 * F0[I], c1 * F1[I], hi, lo);
            const int row = cc_sec(I) + j;
            *reinterpret_cast<uint32_t*>(sCch + sw128(row, d0)) = hi;
            *reinterpret_cast<uint32_t*>(sCcl + sw128(row, d0)) = lo;
          }
        }
      }
    }
    __syncthreads();

    // ---- phase 2: L (10 blocks) and Aqk (10 blocks) of 16x16 on tensor cores ----
    float acc2[3][2][4];
#pragma unroll
    for (int s = 0; s < 3; ++s)
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc2[s][n][e] = 0.f;
#pragma unroll
    for (int s = 0; s < 3; ++s) {
      const int task = FWD ? kTaskFwd[warp][s] : kTaskSum[warp][s];
      if (task >= 0) {
        const bool isL = task >= 10;
        const int pr = isL ? task - 10 : task;
        const int I = kPairI[pr], J = kPairJ[pr];
        const int brow = cc_sec(I) + 16 * J;
#pragma unroll
        for (int ks = 0; ks < 8; ++ks) {
          uint32_t bh[4], bl[4];
          ldb<128>(bh, sCch, ks * 16, brow, lane);
          if (isL) {
            uint32_t af[4];
            lda<128>(af, sKr, I * 16, ks * 16, lane);
            mma(acc2[s][0], af, bh[0], bh[1]);
            mma(acc2[s][1], af, bh[2], bh[3]);
          } else {
            uint32_t ah[4], al[4];
            ldb<128>(bl, sCcl, ks * 16, brow, lane);
            lda<128>(ah, sQrh, I * 16, ks * 16, lane);
            lda<128>(al, sQrl, I * 16, ks * 16, lane);
            mma(acc2[s][0], ah, bh[0], bh[1]);
            mma(acc2[s][1], ah, bh[2], bh[3]);
            mma(acc2[s][0], ah, bl[0], bl[1]);
            mma(acc2[s][1], ah, bl[2], bl[3]);
            mma(acc2[s][0], al, bh[0], bh[1]);
            mma(acc2[s][1], al, bh[2], bh[3]);
          }
        }
      }
    }
    __syncthreads();
#pragma unroll
    for (int s = 0; s < 3; ++s) {
      const int task = FWD ? kTaskFwd[warp][s] : kTaskSum[warp][s];
      if (task >= 0) {
        const bool isL = task >= 10;
        const int pr = isL ? task - 10 : task;
        const int I = kPairI[pr], J = kPairJ[pr];
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
          for (int e2 = 0; e2 < 2; ++e2) {
            const int i = I * 16 + g4 + e2 * 8;
            const int j = J * 16 + n * 8 + l4 * 2;
            float x0 = acc2[s][n][e2 * 2], x1 = acc2[s][n][e2 * 2 + 1];
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
              *reinterpret_cast<uint32_t*>(sAqh + sw64(i, j)) = hi;
              *reinterpret_cast<uint32_t*>(sAql + sw64(i, j)) = lo;
            }
          }
      }
    }
    // ---- phase 1d: X = K o exp(G), Qg = s Q o exp(G), Kg = K o exp(G_last - G) ----
    {
      const float gl0 = sGl[d0], gl1 = sGl[d0 + 1];
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const int j = rq * 16 + i;
        const float2 kk = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(sK + sw128(j, d0)));
        const float x0 = fexp(G0[i]), x1 = fexp(G1[i]);
        *reinterpret_cast<uint32_t*>(sX + sw128(j, d0)) = pack_bf16(kk.x * x0, kk.y * x1);
        *reinterpret_cast<uint32_t*>(sKg + sw128(j, d0)) =
            pack_bf16(kk.x * fexp(gl0 - G0[i]), kk.y * fexp(gl1 - G1[i]));
        if constexpr (FWD) {
          const float2 qf = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(sQ + sw128(j, d0)));
          *reinterpret_cast<uint32_t*>(sQg + sw128(j, d0)) = pack_bf16(a.scale * qf.x * x0, a.scale * qf.y * x1);
        }
      }
    }
    __syncthreads();
    // q, k, g of this chunk are consumed: prefetch the next chunk's
    if (has_next) {
      load_qkg(smem, a, tokn, nrn, h, FWD);
      cp_async_commit();
      bnext = (tid < nrn) ? __bfloat162float(beta[(tokn + tid) * H + h]) : 0.f;
    }

    // ---- phase 3: A = (I + L)^-1 in FP32: diagonal 16x16 blocks, then off-diagonal blocks by level ----
    if (tid < 64) {
      // column c of the inverse of block I, by column-oriented forward substitution (depth 15)
      const int I = tid >> 4, c = tid & 15;
      const float* Lb = sL + (I * 16) * LDL + I * 16;
      float x[16];
#pragma unroll
      for (int r = 0; r < 16; ++r) x[r] = (r == c) ? 1.f : 0.f;
#pragma unroll
      for (int m = 0; m < 15; ++m) {
#pragma unroll
        for (int r = m + 1; r < 16; ++r) x[r] = fmaf(-Lb[r * LDL + m], x[m], x[r]);
      }
#pragma unroll
      for (int r = 0; r < 16; ++r) sA[(I * 16 + r) * LDL + I * 16 + c] = x[r];
    }
    __syncthreads();
    inv_level<1>(sL, sA, sPt, tid);
    inv_level<2>(sL, sA, sPt, tid);
    inv_level<3>(sL, sA, sPt, tid);
    // A diag(beta) as bf16 hi + lo (zero above the diagonal)
    for (int e = tid; e < C * C / 2; e += NTH) {
      const int i = e >> 5, j = (e & 31) * 2;
      const float x0 = (j <= i) ? sA[i * LDL + j] * sBeta[j] : 0.f;
      const float x1 = (j + 1 <= i) ? sA[i * LDL + j + 1] * sBeta[j + 1] : 0.f;
      uint32_t hi, lo;
      split2(x0, x1, hi, lo);
      *reinterpret_cast<uint32_t*>(sAbh + sw64(i, j)) = hi;
      *reinterpret_cast<uint32_t*>(sAbl + sw64(i, j)) = lo;
    }
    __syncthreads();

    // ---- phase 4: W = A diag(beta) X -> -W as bf16 in place of X. Warp: row blocks {mp, 3 - mp}
    //      (5 k-steps in all, balanced), columns 32 nq ..
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
              mma(acc[u][2 * np], ah, b[0], b[1]);
              mma(acc[u][2 * np + 1], ah, b[2], b[3]);
              mma(acc[u][2 * np], al, b[0], b[1]);
              mma(acc[u][2 * np + 1], al, b[2], b[3]);
            }
          }
        }
      }
      __syncthreads();
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int m = u == 0 ? mp : 3 - mp;
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
          for (int e2 = 0; e2 < 2; ++e2) {
            const int i = m * 16 + g4 + e2 * 8;
            const int j = nq * 32 + n * 8 + l4 * 2;
            // stored negated: the walk then adds S^T (-W)^T with the same S fragments as S^T Qg^T
            *reinterpret_cast<uint32_t*>(sX + sw128(i, j)) = pack_bf16(-acc[u][n][e2 * 2], -acc[u][n][e2 * 2 + 1]);
          }
      }
      __syncthreads();
    }

    // ---- phase 5: the walk, each warp on its own value columns ----
    {
      float VN[MT][8][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) VN[mt][n][e] = 0.f;
      // U^T = V^T (A diag(beta))^T
      if (isE) {
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            uint32_t va[4];
            lda_t<128>(va, sV, vcol + mt * 16, ks * 16, lane);
#pragma unroll
            for (int np = 0; np < 4; ++np) {
              if (ks <= np) {
                uint32_t bh[4], bl[4];
                ldb<64>(bh, sAbh, ks * 16, np * 16, lane);
                ldb<64>(bl, sAbl, ks * 16, np * 16, lane);
                mma(VN[mt][2 * np], va, bh[0], bh[1]);
                mma(VN[mt][2 * np + 1], va, bh[2], bh[3]);
                mma(VN[mt][2 * np], va, bl[0], bl[1]);
                mma(VN[mt][2 * np + 1], va, bl[2], bl[3]);
              }
            }
          }
        }
      }
      // every warp is done with V: prefetch the next chunk's
      __syncthreads();
      if (has_next) {
        load_v(smem, a, tokn, nrn, h);
        cp_async_commit();
      }
      // V_new^T = U^T - S^T W^T ; O^T = S^T Qg^T
      float O[8][4];
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) O[n][e] = 0.f;
#pragma unroll
      for (int ks = 0; ks < 8; ++ks) {
        uint32_t sh[MT][4], sl[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          split2(ST[mt][2 * ks][0], ST[mt][2 * ks][1], sh[mt][0], sl[mt][0]);
          split2(ST[mt][2 * ks][2], ST[mt][2 * ks][3], sh[mt][1], sl[mt][1]);
          split2(ST[mt][2 * ks + 1][0], ST[mt][2 * ks + 1][1], sh[mt][2], sl[mt][2]);
          split2(ST[mt][2 * ks + 1][2], ST[mt][2 * ks + 1][3], sh[mt][3], sl[mt][3]);
        }
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          uint32_t bw[4];
          ldb<128>(bw, sX, ks * 16, np * 16, lane);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma(VN[mt][2 * np], sh[mt], bw[0], bw[1]);
            mma(VN[mt][2 * np + 1], sh[mt], bw[2], bw[3]);
            if constexpr (kSplitS) {
              mma(VN[mt][2 * np], sl[mt], bw[0], bw[1]);
              mma(VN[mt][2 * np + 1], sl[mt], bw[2], bw[3]);
            }
          }
          if constexpr (FWD) {
            uint32_t bq[4];
            ldb<128>(bq, sQg, ks * 16, np * 16, lane);
            mma(O[2 * np], sh[0], bq[0], bq[1]);
            mma(O[2 * np + 1], sh[0], bq[2], bq[3]);
            if constexpr (kSplitS) {
              mma(O[2 * np], sl[0], bq[0], bq[1]);
              mma(O[2 * np + 1], sl[0], bq[2], bq[3]);
            }
          }
        }
      }
      // V_new^T as A operands (hi, lo), k = token blocks
      uint32_t vh[MT][4][4], vl[MT][4][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
          split2(VN[mt][2 * ks][0], VN[mt][2 * ks][1], vh[mt][ks][0], vl[mt][ks][0]);
          split2(VN[mt][2 * ks][2], VN[mt][2 * ks][3], vh[mt][ks][1], vl[mt][ks][1]);
          split2(VN[mt][2 * ks + 1][0], VN[mt][2 * ks + 1][1], vh[mt][ks][2], vl[mt][ks][2]);
          split2(VN[mt][2 * ks + 1][2], VN[mt][2 * ks + 1][3], vh[mt][ks][3], vl[mt][ks][3]);
        }
      if constexpr (FWD) {
        // O^T += V_new^T Aqk^T (causal blocks only)
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
#pragma unroll
          for (int np = 0; np < 4; ++np) {
            if (ks <= np) {
              uint32_t bh[4], bl[4];
              ldb<64>(bh, sAqh, ks * 16, np * 16, lane);
              ldb<64>(bl, sAql, ks * 16, np * 16, lane);
              mma(O[2 * np], vh[0][ks], bh[0], bh[1]);
              mma(O[2 * np + 1], vh[0][ks], bh[2], bh[3]);
              mma(O[2 * np], vl[0][ks], bh[0], bh[1]);
              mma(O[2 * np + 1], vl[0][ks], bh[2], bh[3]);
              mma(O[2 * np], vh[0][ks], bl[0], bl[1]);
              mma(O[2 * np + 1], vh[0][ks], bl[2], bl[3]);
            }
          }
        }
        // stage O (rows = tokens, cols = value) for a coalesced store
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int v = vcol + g4 + ((e >> 1) << 3);
            const int t = n * 8 + l4 * 2 + (e & 1);
            sO[sw128(t, v)] = __float2bfloat16_rn(O[n][e]);
          }
      }
      // S^T = S^T Diag(gamma) + V_new^T Kg
#pragma unroll
      for (int nt = 0; nt < 16; ++nt) {
        const float ga0 = sGam[nt * 8 + l4 * 2], ga1 = sGam[nt * 8 + l4 * 2 + 1];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          ST[mt][nt][0] *= ga0;
          ST[mt][nt][1] *= ga1;
          ST[mt][nt][2] *= ga0;
          ST[mt][nt][3] *= ga1;
        }
      }
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
#pragma unroll
        for (int np = 0; np < 8; ++np) {
          uint32_t b[4];
          ldb_t<128>(b, sKg, ks * 16, np * 16, lane);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma(ST[mt][2 * np], vh[mt][ks], b[0], b[1]);
            mma(ST[mt][2 * np + 1], vh[mt][ks], b[2], b[3]);
            mma(ST[mt][2 * np], vl[mt][ks], b[0], b[1]);
            mma(ST[mt][2 * np + 1], vl[mt][ks], b[2], b[3]);
          }
        }
      }
    }
    __syncthreads();
    if constexpr (FWD) {
      __nv_bfloat16* o = static_cast<__nv_bfloat16*>(a.o);
#pragma unroll
      for (int it = 0; it < 4; ++it) {
        const int piece = tid + it * NTH;
        const int r = piece >> 4, c = (piece & 15) << 3;
        if (r < nrows) {
          const uint4 val = *reinterpret_cast<const uint4*>(sO + sw128(r, c));
          *reinterpret_cast<uint4*>(o + ((tok + r) * H + h) * D + c) = val;
        }
      }
    }
  }

  if constexpr (!FWD) {
    float* dst = (isE ? a.e_out : a.m_out) + (static_cast<int64_t>(info0) * H + h) * D * D;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < 16; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int v = vcol + mt * 16 + g4 + ((e >> 1) << 3);
          const int d = nt * 8 + l4 * 2 + (e & 1);
          dst[d * D + v] = ST[mt][nt][e];
        }
  }
}

// ---- affine merge in FP32: 32 state columns per CTA, X (128 x 32) in shared memory ----
template <bool COMPOSE>
__global__ void __launch_bounds__(256) merge_kernel(const MergeArgs a) {
  __shared__ float X[D][33];
  const int c = blockIdx.x, h = blockIdx.y, tile = blockIdx.z;
  const int first = a.chains[c * 4 + 0], cnt = a.chains[c * 4 + 1];
  const int init = a.chains[c * 4 + 2], outi = a.chains[c * 4 + 3];
  const bool mpart = COMPOSE && tile < 4;
  const int col0 = (tile & 3) * 32;
  const int t = threadIdx.x, d = t >> 1, cb = (t & 1) * 16;
  const int H = a.H;
#pragma unroll
  for (int cc = 0; cc < 16; ++cc) {
    const int col = col0 + cb + cc;
    float x = 0.f;
    if (COMPOSE) x = (mpart && d == col) ? 1.f : 0.f;
    else if (init >= 0 && a.state_in != nullptr)
      x = a.state_in[((static_cast<int64_t>(init) * H + h) * D + d) * D + col];
    X[d][cb + cc] = x;
  }
  __syncthreads();
  for (int j = 0; j < cnt; ++j) {
    const int64_t base = (static_cast<int64_t>(first + j) * H + h) * D * D;
    float acc[16];
#pragma unroll
    for (int cc = 0; cc < 16; ++cc) acc[cc] = mpart ? 0.f : a.e[base + d * D + col0 + cb + cc];
    const float4* mrow = reinterpret_cast<const float4*>(a.m + base + d * D);
#pragma unroll 4
    for (int m4 = 0; m4 < D / 4; ++m4) {
      const float4 mv = mrow[m4];
#pragma unroll
      for (int cc = 0; cc < 16; ++cc) {
        float s = acc[cc];
        s = fmaf(mv.x, X[m4 * 4 + 0][cb + cc], s);
        s = fmaf(mv.y, X[m4 * 4 + 1][cb + cc], s);
        s = fmaf(mv.z, X[m4 * 4 + 2][cb + cc], s);
        s = fmaf(mv.w, X[m4 * 4 + 3][cb + cc], s);
        acc[cc] = s;
      }
    }
    __syncthreads();
#pragma unroll
    for (int cc = 0; cc < 16; ++cc) X[d][cb + cc] = acc[cc];
    __syncthreads();
    if (!COMPOSE) {
      float* dst = a.out0 + (static_cast<int64_t>(outi + j) * H + h) * D * D + d * D + col0 + cb;
#pragma unroll
      for (int cc = 0; cc < 16; ++cc) dst[cc] = acc[cc];
    }
  }
  if (COMPOSE) {
    float* dst = (mpart ? a.out0 : a.out1) + (static_cast<int64_t>(outi) * H + h) * D * D + d * D + col0 + cb;
#pragma unroll
    for (int cc = 0; cc < 16; ++cc) dst[cc] = X[d][cb + cc];
  }
}

template <bool FWD, int MT>
cudaError_t launch_chunk(const ChunkArgs& a, cudaStream_t stream) {
  if (a.nseg == 0 || a.H == 0) return cudaSuccess;
  auto kern = chunk_kernel<FWD, MT>;
  cudaError_t err = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES);
  if (err != cudaSuccess) return err;
  dim3 grid(a.nseg, a.H, FWD ? 1 : (2 / MT));
  kern<<<grid, NTH, SMEM_BYTES, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

// summary state columns per warp: 2 (one CTA walks [M | E] together) or 1 (two CTAs, prep twice)
#ifndef KDA_SUMMARY_MT
#define KDA_SUMMARY_MT 2
#endif

cudaError_t launch_fwd_output(const ChunkArgs& a, cudaStream_t stream) { return launch_chunk<true, 1>(a, stream); }
cudaError_t launch_fwd_summary(const ChunkArgs& a, cudaStream_t stream) {
  return launch_chunk<false, KDA_SUMMARY_MT>(a, stream);
}

cudaError_t launch_merge_fold(const MergeArgs& a, cudaStream_t stream) {
  if (a.nchain == 0 || a.H == 0) return cudaSuccess;
  merge_kernel<false><<<dim3(a.nchain, a.H, 4), 256, 0, stream>>>(a);
  return cudaGetLastError();
}
cudaError_t launch_merge_compose(const MergeArgs& a, cudaStream_t stream) {
  if (a.nchain == 0 || a.H == 0) return cudaSuccess;
  merge_kernel<true><<<dim3(a.nchain, a.H, 8), 256, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace kda
