// The chunk prep shared by the forward (kda_fwd.cu) and the backward (kda_bwd.cu): one CTA of 8 warps per
// (chunk, head), two CTAs per SM (101 KB of shared memory, <= 128 registers). g and k are read straight into
// registers; the anchored L / Aqk blocks are formed on tensor cores, all ten at once; A = (I + L)^-1 in FP32
// (diagonal blocks by substitution, the others by level in 3xTF32); W = A diag(beta) (K o exp G). The record
// format is the caller's: a record policy `Rec` (FwdRecord in kda_fwd.cu, BwdRecord in kda_bwd.cu) says where each
// piece goes and whether the backward's extras are made (Rec::kBwd: P, A, U, L from K_r hi x Cc hi + lo instead of hi x hi).
// On the way it tests the values against the domain and reports any outside it in the status word (kda_status.cuh):
// g and beta as they are loaded, q and k through the diagonal blocks of Aqk (lq_blocks), the backward's v in the
// fragments of U's products.
#pragma once

#include "kda_common.cuh"
#include "kda_status.cuh"
#include "kda_tile_copy.cuh"

namespace kda {

// Diagonal 16x16 blocks of A = (I + L)^-1 by column-oriented forward substitution: threads 0..63, one
// column c of block I each (x = e_c, x_r -= L_rm x_m); the off-diagonal blocks follow by level.
template <int LD>
__device__ __forceinline__ void invert_diag_blocks(const float* sL, float* sA, int tid) {
  if (tid < 64) {
    const int I = tid >> 4, c = tid & 15;
    const float* Lb = sL + (I * 16) * LD + I * 16;
    float x[16];
#pragma unroll
    for (int r = 0; r < 16; ++r) x[r] = (r == c) ? 1.f : 0.f;
#pragma unroll
    for (int m = 0; m < 15; ++m) {
#pragma unroll
      for (int r = m + 1; r < 16; ++r) x[r] = fmaf(-Lb[r * LD + m], x[m], x[r]);
    }
#pragma unroll
    for (int r = 0; r < 16; ++r) sA[(I * 16 + r) * LD + I * 16 + c] = x[r];
  }
}

namespace chunk_prep {

constexpr int C = 64;    // chunk rows
constexpr int D = 128;   // head dim
constexpr int LDL = 68;  // fp32 row stride of the 64x64 L / A tiles
constexpr int NT = 256;  // threads per CTA

// ---- shared memory (bytes) ----
// phase A: anchored operands
constexpr int P_KR = 0;        // bf16 sw128 [64][128] K o exp(G - G_anchor)
constexpr int P_QRH = 16384;   // Q o exp(G - G_anchor), hi
constexpr int P_QRL = 32768;   //                         lo
constexpr int P_CCH = 49152;   // K o exp(G_anchor - G), hi
constexpr int P_CCL = 65536;   //                      lo
constexpr int P_AEND = 81920;
// phase B (aliases phase A once L and Aqk are done)
constexpr int P_X = 0;         // bf16 sw128 K o exp(G)
constexpr int P_A = 16384;     // fp32 [64][LDL]
constexpr int P_ABH = P_A + C * LDL * 4;  // bf16 sw64 [64][64]
constexpr int P_ABL = P_ABH + 8192;
static_assert(P_ABL + 8192 <= P_AEND, "phase B overflows phase A");
constexpr int P_QGS = P_CCH;             // forward: bf16 sw128 Qg staging (the Cc tiles are dead by then)
constexpr int P_KGS = P_CCL;             // forward: bf16 sw128 Kg staging
constexpr int P_V = P_CCL;               // backward: bf16 sw128 V (for U), loaded after L and Aqk
static_assert(P_ABL + 8192 <= P_V, "phase B overlaps V");
constexpr int P_L = P_AEND;              // fp32 [64][LDL]; before the products, q (bf16 [64][128])
constexpr int P_BETA = P_L + C * LDL * 4;
constexpr int P_TOT = P_BETA + 256;      // fp32 [4][128]
constexpr int P_CF = P_TOT;              // per-block anchors: bf16 pair factors [6][64] (the totals are dead by then)
constexpr int P_GA = P_TOT + 2048;       // fp32 [4][128]
constexpr int P_GL = P_GA + 2048;        // fp32 [128]
constexpr int SMEM = P_GL + 512;

// The map above as typed tiles, one accessor each: what the tile holds, its type and layout (sw128 / sw64: the
// swizzled rows of kda_common.cuh), who makes and who reads it, and which dead tile it lies over. The prep's functions
// reach shared memory only through it.
struct PrepSmem {
  char* base;
  // ---- phase A (rows_and_blocks writes them, lq_block reads them) ----
  // K_r = K o exp(G - G_a), bf16 sw128 [64][128]
  __device__ __forceinline__ __nv_bfloat16* kr() const { return reinterpret_cast<__nv_bfloat16*>(base + P_KR); }
  // Q_r = Q o exp(G - G_a), bf16 sw128 [64][128], hi and lo parts
  __device__ __forceinline__ __nv_bfloat16* qr_hi() const { return reinterpret_cast<__nv_bfloat16*>(base + P_QRH); }
  __device__ __forceinline__ __nv_bfloat16* qr_lo() const { return reinterpret_cast<__nv_bfloat16*>(base + P_QRL); }
  // Cc = K o exp(G_a - G), bf16 sw128 [64][128], hi and lo parts
  __device__ __forceinline__ __nv_bfloat16* cc_hi() const { return reinterpret_cast<__nv_bfloat16*>(base + P_CCH); }
  __device__ __forceinline__ __nv_bfloat16* cc_lo() const { return reinterpret_cast<__nv_bfloat16*>(base + P_CCL); }
  // ---- phase B (over phase A's tiles, dead once L and Aqk are done) ----
  // X = K o exp(G), bf16 sw128 [64][128], over K_r: staged by rows_and_blocks, W's B operand
  __device__ __forceinline__ __nv_bfloat16* x() const { return reinterpret_cast<__nv_bfloat16*>(base + P_X); }
  // A = (I + L)^-1, fp32 [64][LDL], over Q_r hi and the start of lo: the inverse writes it, A diag(beta) reads it
  __device__ __forceinline__ float* a_inv() const { return reinterpret_cast<float*>(base + P_A); }
  // A diag(beta), bf16 sw64 [64][64], hi and lo parts, over Q_r lo and the start of Cc hi (the forward's staged Qg:
  // written once that is copied out): W's (and U's) A operand
  __device__ __forceinline__ __nv_bfloat16* ab_hi() const { return reinterpret_cast<__nv_bfloat16*>(base + P_ABH); }
  __device__ __forceinline__ __nv_bfloat16* ab_lo() const { return reinterpret_cast<__nv_bfloat16*>(base + P_ABL); }
  // the forward's Qg = s Q o exp(G) and Kg = K o exp(G_63 - G), fp16 sw128 [64][128], over Cc hi / lo: staged by
  // rows_and_blocks, copied to the record during the inverse's diagonal blocks
  __device__ __forceinline__ __half* qg_stage() const { return reinterpret_cast<__half*>(base + P_QGS); }
  __device__ __forceinline__ __half* kg_stage() const { return reinterpret_cast<__half*>(base + P_KGS); }
  // the backward's V, bf16 sw128 [64][128], over Cc lo: cp.async after L and Aqk, U's B operand
  __device__ __forceinline__ __nv_bfloat16* v() const { return reinterpret_cast<__nv_bfloat16*>(base + P_V); }
  // ---- past phase A's region (P_AEND ..) ----
  // q, bf16 row-major [64][128], over L (unused until the products): cp.async at the start, read into Q_r
  __device__ __forceinline__ __nv_bfloat16* q() const { return reinterpret_cast<__nv_bfloat16*>(base + P_L); }
  // L = diag(beta) (K_r Cc^T) strictly below the diagonal, fp32 [64][LDL], over q: lq_block writes it, the inverse
  // reads it
  __device__ __forceinline__ float* l() const { return reinterpret_cast<float*>(base + P_L); }
  // beta, fp32 [64]: loaded at the start, read into L and A diag(beta)
  __device__ __forceinline__ float* beta() const { return reinterpret_cast<float*>(base + P_BETA); }
  // the gates' per-block totals, fp32 [4][128]: live only for the cumsum's block offsets
  __device__ __forceinline__ float* tot() const { return reinterpret_cast<float*>(base + P_TOT); }
  // per-block anchors' factors 2^(m_I - m_J), bf16 pairs [6][64] at cf_word, over the dead totals: rows_and_blocks
  // writes them, lq_block reads them
  __device__ __forceinline__ uint32_t* cf() const { return reinterpret_cast<uint32_t*>(base + P_CF); }
  // the backward's per-warp max |U|, fp32 [8], over the dead totals (the factors are dead too by then)
  __device__ __forceinline__ float* u_max() const { return reinterpret_cast<float*>(base + P_TOT); }
  // the cumulative gates at each row block's first row (the anchors' G_a), fp32 [4][128]: made by the cumsum
  __device__ __forceinline__ float* g_first() const { return reinterpret_cast<float*>(base + P_GA); }
  // G_63, the chunk's last cumulative gates, fp32 [128]: made by the cumsum, Kg's factor
  __device__ __forceinline__ float* g_last() const { return reinterpret_cast<float*>(base + P_GL); }
};

// d += (ah + al) b in 3xTF32 (hi x hi + hi x lo + lo x hi), b = this thread's two k slots of a B fragment (b.x: slot
// t, b.y: slot t + 4), split by truncation.
__device__ __forceinline__ void mma_3xtf32(float (&d)[4], const uint32_t (&ah)[4], const uint32_t (&al)[4], float2 b) {
  uint32_t bh0, bl0, bh1, bl1;
  split_tf32_trunc(b.x, bh0, bl0);
  split_tf32_trunc(b.y, bh1, bl1);
  mma_tf32(d, al, bh0, bh1);
  mma_tf32(d, ah, bl0, bl1);
  mma_tf32(d, ah, bh0, bh1);
}

// The blocked inverse's off-diagonal blocks on tensor cores, in two levels: A_IJ = -A_II P with
// P = sum_{J <= m < I} L_Im A_mJ for the first subdiagonal (A_10, A_21, A_32), then A_20, A_31 the same way and A_30
// from the 32 x 32 halves, A_30 = -(A_32 X_20 + A_33 X_30) with X_n0 = L_n0 A_00 + L_n1 A_10, so that it needs no
// block of its own level (three levels, one warp busy in the last, took ~15 % of the prep's samples). One warp per
// block, products in 3xTF32 (each operand split into tf32 hi + lo by truncation, lo x lo dropped: ~2^-19 relative).
// Computed transposed, A_IJ^T = -P^T A_II^T, with the k slots of every m16n8k8 permuted alike in A and B (slot t holds
// k = 2t, slot t + 4 holds k = 2t + 1; the sum is the same): then every fragment is one conflict-free 32- or 64-bit
// shared load at LDL = 68, and P^T's accumulators are the second product's A fragments as they stand.

// P_n^T += sum_{m in [m0, m0 + 8 KS)} A_mJ^T L_{I0 + n, m}^T for NI row blocks (they share the A fragments);
// p[n][nt]: rows = the columns g, g + 8 of block J, columns 8 nt + 2t, + 1 = rows of block I0 + n
template <int KS, int NI>
__device__ __forceinline__ void inv_lsum(float (&p)[NI][2][4], const float* sL, const float* sA, int I0, int J, int m0,
                                         int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    const int m = m0 + 8 * ks + 2 * t;  // this thread's k slots: m, m + 1
    uint32_t ah[4], al[4];              // A_{m, J}^T
    split_tf32_trunc(sA[m * LDL + 16 * J + g], ah[0], al[0]);
    split_tf32_trunc(sA[m * LDL + 16 * J + g + 8], ah[1], al[1]);
    split_tf32_trunc(sA[(m + 1) * LDL + 16 * J + g], ah[2], al[2]);
    split_tf32_trunc(sA[(m + 1) * LDL + 16 * J + g + 8], ah[3], al[3]);
#pragma unroll
    for (int n = 0; n < NI; ++n)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {  // L_{I, m}^T
        const float2 b = *reinterpret_cast<const float2*>(sL + (16 * (I0 + n) + 8 * nt + g) * LDL + m);
        mma_3xtf32(p[n][nt], ah, al, b);
      }
  }
}

// d += P^T A_IK^T, k = the rows of block K: P^T's n-tile kk is the A fragment (c0, c2, c1, c3)
__device__ __forceinline__ void inv_rmul(float (&d)[2][4], const float (&p)[2][4], const float* sA, int I, int K, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int kk = 0; kk < 2; ++kk) {
    uint32_t ah[4], al[4];
    split_tf32_trunc(p[kk][0], ah[0], al[0]);
    split_tf32_trunc(p[kk][2], ah[1], al[1]);
    split_tf32_trunc(p[kk][1], ah[2], al[2]);
    split_tf32_trunc(p[kk][3], ah[3], al[3]);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const float2 b = *reinterpret_cast<const float2*>(sA + (16 * I + 8 * nt + g) * LDL + 16 * K + 8 * kk + 2 * t);
      mma_3xtf32(d[nt], ah, al, b);
    }
  }
}

// A_IJ = -d (d = A_IJ^T as accumulators)
__device__ __forceinline__ void inv_store(float* sA, const float (&d)[2][4], int I, int J, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    const int i = 16 * I + 8 * nt + 2 * t;
    sA[i * LDL + 16 * J + g] = -d[nt][0];
    sA[(i + 1) * LDL + 16 * J + g] = -d[nt][1];
    sA[i * LDL + 16 * J + g + 8] = -d[nt][2];
    sA[(i + 1) * LDL + 16 * J + g + 8] = -d[nt][3];
  }
}

// A_IJ = -A_II sum_{J <= m < I} L_Im A_mJ for I = J + LEV (the blocks between them already known)
template <int LEV>
__device__ __forceinline__ void inv_block(const float* sL, float* sA, int J, int lane) {
  const int I = J + LEV;
  float p[1][2][4], d[2][4];
  zero_frags(p[0]), zero_frags(d);
  inv_lsum<2 * LEV, 1>(p, sL, sA, I, J, 16 * J, lane);
  inv_rmul(d, p[0], sA, I, I, lane);
  inv_store(sA, d, I, J, lane);
}

// The off-diagonal blocks of A = (I + L)^-1 given its diagonal blocks (warps 0 .. 2 work; two barriers). The blocks
// a level writes are read by no warp of the same level.
__device__ __forceinline__ void inverse_offdiag(const float* sL, float* sA, int warp, int lane) {
  if (warp < 3) inv_block<1>(sL, sA, warp, lane);  // A_10, A_21, A_32
  __syncthreads();
  if (warp < 2) {
    inv_block<2>(sL, sA, warp, lane);  // A_20, A_31
  } else if (warp == 2) {  // A_30 = -(A_32 X_20 + A_33 X_30)
    float x[2][2][4], d[2][4];
    zero_frags(x[0]), zero_frags(x[1]), zero_frags(d);
    inv_lsum<4, 2>(x, sL, sA, 2, 0, 0, lane);
    inv_rmul(d, x[0], sA, 3, 2, lane);
    inv_rmul(d, x[1], sA, 3, 3, lane);
    inv_store(sA, d, 3, 0, lane);
  }
  __syncthreads();
}

// The anchored rows share one anchor, the chunk's first row, when every column's gates sum to >= -kOneAnchor over
// the chunk: then K o exp(G - G_0) >= e^-64 and Cc = K o exp(G_0 - G) <= e^64 sit well inside FP32's and bf16's
// range (a lo part of a hi + lo pair stays a normal number), and no block needs a factor of its own. Gates that fall
// faster (down to -5 per token: -320 over a chunk) anchor each 16-row block at its own first row (<= e^80).
constexpr float kOneAnchor = 64.f;

// A column's anchor: rel(G) = exp(G - anchor), abs() = exp(anchor). One anchor for the chunk (ONE): G_0 itself. Per
// block: the power of two 2^m, m = ceil(G_a log2 e), an integer that sits at most one binade above G_a, so the rows'
// factors stay in [e^-76, 1] and [1, e^76] and the factor between two blocks' anchors, 2^(m_I - m_J), is a power of
// two: it scales a bf16 hi + lo pair exactly (lq_block). Every thread that needs a block's m forms it from the same
// float G_a in the same two instructions, so they agree bit for bit.
template <bool ONE>
struct Anchor;
template <>
struct Anchor<true> {
  float a;
  __device__ __forceinline__ explicit Anchor(float ga) : a(ga) {}
  __device__ __forceinline__ float rel(float G) const { return fexp_ftz(G - a); }
  __device__ __forceinline__ float abs() const { return fexp_ftz(a); }
};
template <>
struct Anchor<false> {
  float m;
  __device__ __forceinline__ explicit Anchor(float ga) : m(ceilf(ga * kLog2e)) {}
  __device__ __forceinline__ float rel(float G) const { return fex2_ftz(fmaf(G, kLog2e, -m)); }
  __device__ __forceinline__ float abs() const { return fex2_ftz(m); }
};

// Per-block anchors: the word of PrepSmem::cf() that holds the factors 2^(m_I - m_J) of column pair c (columns 2c,
// 2c + 1) for the block pair (I, J), J < I, placed so that an mma B fragment's two column pairs (d, d + 1 and d + 8,
// d + 9 with d = 16 ks + 2 l4) are one 64-bit load
__device__ __forceinline__ int cf_word(int I, int J, int c) {
  return ((I * (I - 1)) / 2 + J) * 64 + (c & ~7) + ((c & 3) << 1) + ((c >> 2) & 1);
}

// L (DO_L) and / or Aqk (DO_Q) of the 16x16 block (I, J), J <= I, by one warp. Both are (the row side of
// block I: K_r, Q_r hi + lo) Cc_J^T, Cc = K o exp(G_a - G) (hi + lo). With one anchor for the chunk that is all;
// anchored per row block (PER_BLOCK: a_I = 16 I), the factor diag(2^(m_I - m_J)) (Anchor<false>: powers of two,
// <= 1, = 1 on the diagonal) is applied to the Cc fragment in registers, one exact bf16 multiply per word of hi and
// of lo, so one Cc tile serves every block and no block waits for another.
template <class Rec, bool PER_BLOCK, bool DO_L, bool DO_Q>
__device__ __forceinline__ float lq_block(int I, int J, PrepSmem sm, char* rec, float scale, int lane) {
  const int g4 = lane >> 2, l4 = lane & 3;
  constexpr bool kLo = DO_Q || Rec::kBwd;  // Cc's lo part enters a product
  float accL[2][4], accQ[2][4];
  zero_frags(accL);
  zero_frags(accQ);
#pragma unroll 2
  for (int ks = 0; ks < 8; ++ks) {
    uint32_t bh[4], bl[4];
    ldb<128>(bh, sm.cc_hi(), ks * 16, J * 16, lane);
    if (kLo) ldb<128>(bl, sm.cc_lo(), ks * 16, J * 16, lane);
    if (PER_BLOCK && I > J) {  // Cc_J o 2^(m_I - m_J) on the fragment's columns d, d + 1 (b[0], b[2]), d + 8, d + 9
      const uint2 f = *reinterpret_cast<const uint2*>(sm.cf() + cf_word(I, J, ks * 8 + l4));
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        bh[e] = bf16x2_mul(bh[e], (e & 1) ? f.y : f.x);
        if (kLo) bl[e] = bf16x2_mul(bl[e], (e & 1) ? f.y : f.x);
      }
    }
    if constexpr (DO_Q) {
      uint32_t ah[4], al[4];
      lda<128>(ah, sm.qr_hi(), I * 16, ks * 16, lane);
      lda<128>(al, sm.qr_lo(), I * 16, ks * 16, lane);
      mma_n16(accQ[0], accQ[1], ah, bh);
      mma_n16(accQ[0], accQ[1], ah, bl);
      mma_n16(accQ[0], accQ[1], al, bh);
    }
    if constexpr (DO_L) {
      uint32_t af[4];
      lda<128>(af, sm.kr(), I * 16, ks * 16, lane);
      mma_n16(accL[0], accL[1], af, bh);
      if constexpr (Rec::kBwd) mma_n16(accL[0], accL[1], af, bl);  // K_r hi x Cc lo too (K_r's lo has no room)
    }
  }
  float probe = 0.f;  // the finiteness probe of the Aqk products (kda_status.cuh; lq_blocks reads it on the diagonal)
  if constexpr (DO_Q)
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) probe = status::probe_f32(probe, accQ[n][e]);
#pragma unroll
  for (int n = 0; n < 2; ++n)
#pragma unroll
    for (int e2 = 0; e2 < 2; ++e2) {
      const int r = g4 + e2 * 8, c = n * 8 + l4 * 2;
      const int i = I * 16 + r, j = J * 16 + c;
      if constexpr (DO_L) {
        float x0 = accL[n][e2 * 2], x1 = accL[n][e2 * 2 + 1];
        const float bi = sm.beta()[i];
        if constexpr (Rec::kBwd) {  // P = L before diag(beta)
          x0 = (I > J || j < i) ? x0 : 0.f;
          x1 = (I > J || j + 1 < i) ? x1 : 0.f;
          *reinterpret_cast<float2*>(Rec::p(rec) + i * C + j) = make_float2(x0, x1);
          x0 *= bi;
          x1 *= bi;
        } else {
          x0 = (I > J || j < i) ? x0 * bi : 0.f;
          x1 = (I > J || j + 1 < i) ? x1 * bi : 0.f;
        }
        *reinterpret_cast<float2*>(sm.l() + i * LDL + j) = make_float2(x0, x1);
      }
      if constexpr (DO_Q) {
        const float x0 = (I > J || j <= i) ? accQ[n][e2 * 2] * scale : 0.f;
        const float x1 = (I > J || j + 1 <= i) ? accQ[n][e2 * 2 + 1] * scale : 0.f;
        if constexpr (Rec::kBwd) {
          uint32_t hi, lo;
          split2(x0, x1, hi, lo);
          Rec::aqk(rec, I, J, r, c, hi, lo);
        } else {
          Rec::aqk(rec, I, J, r, c, pack_f16(x0, x1));
        }
      }
    }
  return probe;
}

// L and Aqk of the ten lower 16x16 blocks, all at once. Per warp, in mma_n16 per k-step: warps 0..5 both products
// of one block below the diagonal (4, + 8 bf16 multiplies for the Cc factor when PER_BLOCK), then warps 0..3 the L
// of diagonal block w (1); warps 6, 7 the Aqk of two diagonal blocks each (3 + 3).
// The diagonal blocks' Aqk is also the check that q and k are finite (reported into *status, kda_status.cuh): row i
// of q and of k meet in the entry (i, i), the sum over every column d of Q_r[i][d] Cc[i][d], each factor a hi + lo
// pair of bf16 whose anchored factors lie in [e^-80, e^80], never 0 or Inf. A NaN or Inf in q[i][d] or k[i][d] makes
// a hi or lo part NaN or Inf (the lo part of an Inf is Inf - Inf = NaN), and one NaN or Inf product makes the sum NaN
// or Inf whatever it is multiplied by (0 x Inf is NaN): the entry is finite exactly when both rows are and their
// products do not overflow (bf16 for Cc: |k| of about 1e6 under gates of -5 per token, values whose chunk products
// are garbage anyway). A few FFMA in two warps instead of a probe of every q and k value in every thread.
template <class Rec, bool PER_BLOCK>
__device__ __forceinline__ void lq_blocks(PrepSmem sm, char* rec, float scale, int* status, int warp, int lane) {
  if (warp < 6) {
    const int I = warp < 1 ? 1 : (warp < 3 ? 2 : 3), J = warp - (I * (I - 1)) / 2;
    lq_block<Rec, PER_BLOCK, true, true>(I, J, sm, rec, scale, lane);
    if (warp < 4) lq_block<Rec, PER_BLOCK, true, false>(warp, warp, sm, rec, scale, lane);
  } else {
    const int I = 2 * (warp - 6);
    const float probe = lq_block<Rec, PER_BLOCK, false, true>(I, I, sm, rec, scale, lane) +
                        lq_block<Rec, PER_BLOCK, false, true>(I + 1, I + 1, sm, rec, scale, lane);
    status::report(status, status::probe_code_f32(probe));
  }
}

// What one CTA needs (bf16 q, k, v; fp32 g; bf16 beta; [T, H, 128] / [T, H]).
struct Inputs {
  const void* q;
  const void* k;
  const void* v;  // backward only (U)
  const float* g;
  const void* beta;
  const int32_t* chunks;  // [nchunk][2] = (tok_start, nrows)
  int H;
  float scale;
  int* status;  // the value-domain status word (kda_status.cuh)
};

// A prep CTA's (chunk, head) from its place in launch order (linear block index b). The forward's prep is chunk-major
// (a 1-D grid, every head of a chunk before the next chunk: CTAs that run at once read neighbouring token rows and
// write neighbouring records; H200, ncu, H = 16: the four groups' preps 1.59 / 1.32 / 1.04 / 0.76 -> 1.56 / 1.29 /
// 1.02 / 0.75 ms against head-major), and so is the backward's (kda_bwd.cu prep_grid). 32-bit arithmetic: the
// bindings check chunks x heads < 2^31.
__device__ __forceinline__ unsigned launch_index() { return blockIdx.x; }
__device__ __forceinline__ unsigned launch_count() { return gridDim.x * gridDim.y; }
__device__ __forceinline__ int2 chunk_head(unsigned b, int H) {
  const unsigned c = b / static_cast<unsigned>(H);
  return make_int2(static_cast<int>(c), static_cast<int>(b - c * H));
}
// the same for this CTA
__device__ __forceinline__ int2 own_chunk_head(int H) { return chunk_head(blockIdx.x, H); }

// Pull into L2 the g, k and q rows of the CTA about one wave later in launch order (linear block index + 2 x SMs:
// two prep CTAs fit an SM), so that its loads at its start hit L2. Called before W, a few microseconds before that
// CTA starts: pulling a whole CTA lifetime early loses to evictions; this one measured
// fwd prep 5.1 -> 4.7 ms at H = 16. A hint only: a wrong guess costs bandwidth, never correctness.
__device__ __forceinline__ void prefetch_successor(const Inputs& a, int tid) {
  static_assert(NT == 256, "each thread takes line tid % 8 of rows tid / 8 and tid / 8 + 32");
  const unsigned b = launch_index() + 2 * sm_count();
  if (b >= launch_count()) return;
  const int2 at = chunk_head(b, a.H);
  const int ci = at.x, h = at.y;
  const int64_t tok = a.chunks[2 * ci];
  const int nrows = a.chunks[2 * ci + 1];
  const int r = tid >> 3, l = tid & 7;  // per row: g 4 lines of 128 bytes, k and q 2 each
  const int64_t e = (tok * a.H + h) * D;
  const char* line = l < 4 ? reinterpret_cast<const char*>(a.g + e) + l * 128
                           : reinterpret_cast<const char*>(static_cast<const __nv_bfloat16*>(l < 6 ? a.k : a.q) + e) +
                                 (l & 1) * 128;
  const int64_t row_bytes = static_cast<int64_t>(a.H) * D * (l < 4 ? 4 : 2);
  if (r < nrows) prefetch_l2(line + r * row_bytes);
  if (r + 32 < nrows) prefetch_l2(line + (r + 32) * row_bytes);
}

// From the cumulative gates (G0, G1: this thread's columns d0, d0 + 1 of rows 16 rq ..; k in kk) to the staged
// tiles the inverse and W read: the anchored rows, L and Aqk, then X = K o exp(G) over the dead Kr tile and, in the
// forward, Qg = s Q o exp(G) and Kg = K o exp(G_63 - G) staged in the dead Cc tiles. Anchored at the chunk's first
// row (ONE: kOneAnchor holds) or each row block I at its first row a_I = 16 I (G is non-increasing; per block the
// anchor is the power of two just above, Anchor<false>): K_r = K o exp(G - G_a) and Q_r (hi + lo) <= 1;
// Cc = K o exp(G_a - G) (hi + lo), the column side.
// X, Qg and Kg are products of the anchored rows' factors with per-column constants, no exp per element: exp(G) =
// exp(G - G_a) exp(G_a) (where exp(G_a) underflows so does exp(G), G <= G_a), and exp(G_63 - G) =
// exp(G_a - G) exp(G_63 - G_a) with ONE (>= e^-64) or, per block, exp(G_a - G) exp(G_e - G_a) exp(G_63 - G_e) with
// G_e the block's last row (G_63 - G_a reaches -320 where G_63 - G stays small; the first two factors' product is
// exp(G_e - G) in [e^-80, 1], and where exp(G_63 - G_e) underflows so does exp(G_63 - G)). A thread's 16 rows are
// one row block, so its anchor and G_e are its own first and last rows. X (and the forward's Qg, Kg: 48 words)
// wait in registers, packed, while L and Aqk take the tiles, and k and G die early.
template <class Rec, bool ONE>
__device__ __forceinline__ void rows_and_blocks(const Inputs& a, char* rec, PrepSmem sm, const float (&G0)[16],
                                                const float (&G1)[16], const uint32_t (&kk)[16], int64_t tok,
                                                int nrows, int h) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int H = a.H;
  const int cp = tid & 63, rq = tid >> 6;
  const int d0 = cp * 2;

  const Anchor<ONE> an0(ONE ? sm.g_first()[d0] : G0[0]), an1(ONE ? sm.g_first()[d0 + 1] : G1[0]);
  const float gl0 = sm.g_last()[d0], gl1 = sm.g_last()[d0 + 1];
  const float ex0 = an0.abs(), ex1 = an1.abs();                    // exp(G_a)
  const float eq0 = a.scale * ex0, eq1 = a.scale * ex1;           // s exp(G_a)
  // Kg = Cc o ek o el: ek = exp(G_63 - G_a), el = 1 (ONE); ek = exp(G_e - G_a), el = exp(G_63 - G_e) (per block)
  const float ek0 = an0.rel(ONE ? gl0 : G0[15]), ek1 = an1.rel(ONE ? gl1 : G1[15]);
  const float el0 = ONE ? 1.f : fexp_ftz(gl0 - G0[15]), el1 = ONE ? 1.f : fexp_ftz(gl1 - G1[15]);
  if constexpr (!ONE) {  // the factors 2^(m_I - m_J) of this thread's column pair, I = rq, for every J < I (lq_block)
#pragma unroll
    for (int J = 0; J < 3; ++J) {
      if (J < rq) {
        const float2 ga = *reinterpret_cast<const float2*>(sm.g_first() + J * D + d0);
        sm.cf()[cf_word(rq, J, cp)] =
            pack_bf16(fex2_ftz(an0.m - Anchor<false>(ga.x).m), fex2_ftz(an1.m - Anchor<false>(ga.y).m));
      }
    }
  }
  uint32_t xr[16], qgr[Rec::kBwd ? 1 : 16], kgr[Rec::kBwd ? 1 : 16];
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int j = rq * 16 + i;
    const float2 kf = bf2_to_f2(kk[i]);
    const uint32_t qw = *reinterpret_cast<const uint32_t*>(sm.q() + j * D + d0);
    const float2 qf = bf2_to_f2(qw);
    const float e0 = an0.rel(G0[i]), e1 = an1.rel(G1[i]);  // <= 1
    const float kr0 = kf.x * e0, kr1 = kf.y * e1, qr0 = qf.x * e0, qr1 = qf.y * e1;
    *reinterpret_cast<uint32_t*>(sm.kr() + sw128(j, d0)) = pack_bf16(kr0, kr1);
    uint32_t hi, lo;
    split2(qr0, qr1, hi, lo);
    *reinterpret_cast<uint32_t*>(sm.qr_hi() + sw128(j, d0)) = hi;
    *reinterpret_cast<uint32_t*>(sm.qr_lo() + sw128(j, d0)) = lo;
    const float cc0 = kf.x * frcp(e0), cc1 = kf.y * frcp(e1);  // K o exp(G_a - G) >= 1 (e0, e1 >= e^-80)
    split2(cc0, cc1, hi, lo);
    *reinterpret_cast<uint32_t*>(sm.cc_hi() + sw128(j, d0)) = hi;
    *reinterpret_cast<uint32_t*>(sm.cc_lo() + sw128(j, d0)) = lo;
    xr[i] = pack_bf16(kr0 * ex0, kr1 * ex1);  // X = K o exp(G - G_a) exp(G_a), either path
    if constexpr (!Rec::kBwd) {
      qgr[i] = pack_f16(qr0 * eq0, qr1 * eq1);
      kgr[i] = pack_f16((cc0 * ek0) * el0, (cc1 * ek1) * el1);
    }
    if constexpr (Rec::kBwd) {
      *reinterpret_cast<uint32_t*>(Rec::qg(rec) + j * D + d0) = pack_bf16(qr0 * eq0, qr1 * eq1);
      *reinterpret_cast<uint32_t*>(Rec::kg(rec) + j * D + d0) = pack_bf16((cc0 * ek0) * el0, (cc1 * ek1) * el1);
    }
  }
  __syncthreads();

  // ---- L and Aqk by 16x16 block (I, J), J <= I, all at once (and the q / k finiteness check) ----
  lq_blocks<Rec, !ONE>(sm, rec, a.scale, a.status, warp, lane);
  __syncthreads();

  if constexpr (Rec::kBwd) {  // V (for U) lands while X is formed and A inverted
    load_rows<NT, C, D / 8>(sm.v(), D, static_cast<const __nv_bfloat16*>(a.v) + (tok * H + h) * D,
                            static_cast<int64_t>(H) * D, nrows, tid, [](int r, int c) { return sw128(r, c); });
    cp_async_commit();
  }
  // ---- X over the dead Kr tile; the forward's Qg and Kg staged in the dead Cc tiles ----
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int j = rq * 16 + i;
    *reinterpret_cast<uint32_t*>(sm.x() + sw128(j, d0)) = xr[i];
    if constexpr (!Rec::kBwd) {
      *reinterpret_cast<uint32_t*>(sm.qg_stage() + sw128(j, d0)) = qgr[i];
      *reinterpret_cast<uint32_t*>(sm.kg_stage() + sw128(j, d0)) = kgr[i];
    }
  }
}

// The prep of chunk ci, head h (chunk_head of the CTA) into `rec`. Rec (static members):
//   kBwd                                       the backward's record (P, A, U; L from K_r x Cc hi + lo)
//   gamma(rec)                                 fp32 [128] exp(G_63)
//   aqk(rec, I, J, r, c, hi, lo)               Aqk pair (r, c), (r, c + 1) of lower block (I, J), bf16 hi + lo;
//                                              the forward's: aqk(rec, I, J, r, c, x), one fp16 pair
//   w(rec, i, j, x0, x1)                       W pair (i, j), (i, j + 1)
// forward only (its walk's operands are fp16, kda_fwd.cu):
//               qg_kg_piece(rec, p, qg, kg)   16-byte piece p of the staged sw128 Qg, Kg tiles (fp16)
//               ab(rec, I, J, r, c, x)        A diag(beta) pair of lower block (I, J), fp16
// backward only: qg(rec), kg(rec) (bf16 [64][128]), p(rec) (fp32 [64][64]), a_hi(rec) (bf16 [64][64]),
//               u(rec, i, j, x0, x1) (a U pair, scaled, as fp16) and
//               u_scale(rec, max |U|, store) (the scale for u, its inverse stored when `store`); P, Aqk and A in
//               their lower 16 x 16 blocks only (kda_bwd.h)
template <class Rec>
__device__ __forceinline__ void prep_chunk(const Inputs& a, char* rec, char* smem, int ci, int h) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int H = a.H;
  const int64_t tok = a.chunks[2 * ci];
  const int nrows = a.chunks[2 * ci + 1];
  const __nv_bfloat16* q = static_cast<const __nv_bfloat16*>(a.q);
  const __nv_bfloat16* k = static_cast<const __nv_bfloat16*>(a.k);
  const __nv_bfloat16* beta = static_cast<const __nv_bfloat16*>(a.beta);

  const PrepSmem sm{smem};

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
  // q lands in shared memory (the L tile, unused until the products) while g is summed: row-major [64][128]
  // bf16 in 16-byte pieces, rows past the chunk zero-filled; waited for at the second barrier
  load_rows<NT, C, D / 8>(sm.q(), D, q + (tok * H + h) * D, rstride, nrows, tid,
                          [](int r, int c) { return r * D + c; });
  cp_async_commit();
  unsigned bad = 0u;  // the domain check of the gates and beta this thread holds (kda_status.cuh)
  if (tid < C) {
    const float b = (tid < nrows) ? __bfloat162float(beta[(tok + tid) * H + h]) : 0.f;
    sm.beta()[tid] = b;
    bad = status::beta_code(b);
  }
  {
    status::GateRange range;
#pragma unroll
    for (int i = 0; i < 16; ++i) range.add(G0[i], G1[i]);
    status::report(a.status, bad | range.code());
  }

  // ---- cumsum of g per 16-row block, then block offsets ----
#pragma unroll
  for (int i = 1; i < 16; ++i) {
    G0[i] += G0[i - 1];
    G1[i] += G1[i - 1];
  }
  sm.tot()[rq * D + d0] = G0[15];
  sm.tot()[rq * D + d0 + 1] = G1[15];
  __syncthreads();
  {
    float o0 = 0.f, o1 = 0.f;
    for (int qb = 0; qb < rq; ++qb) {
      o0 += sm.tot()[qb * D + d0];
      o1 += sm.tot()[qb * D + d0 + 1];
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      G0[i] += o0;
      G1[i] += o1;
    }
    sm.g_first()[rq * D + d0] = G0[0];
    sm.g_first()[rq * D + d0 + 1] = G1[0];
    if (rq == 3) {  // G_63 (the sums include row 0's gate, so -G_63 bounds G_0 - G_63)
      sm.g_last()[d0] = G0[15];
      sm.g_last()[d0 + 1] = G1[15];
      *reinterpret_cast<float2*>(Rec::gamma(rec) + d0) = make_float2(fexp_ftz(G0[15]), fexp_ftz(G1[15]));
    }
  }
  cp_async_wait_all();  // this thread's q pieces, visible to all after the barrier
  const bool one_anchor = !__syncthreads_or(rq == 3 && fminf(G0[15], G1[15]) < -kOneAnchor);

  if (one_anchor) rows_and_blocks<Rec, true>(a, rec, sm, G0, G1, kk, tok, nrows, h);
  else rows_and_blocks<Rec, false>(a, rec, sm, G0, G1, kk, tok, nrows, h);

  __syncthreads();  // the staged tiles are complete before A overwrites Qr
  // ---- A = (I + L)^-1: diagonal blocks (column-oriented substitution, FP32), then levels (3xTF32) ----
  // (threads 0 .. 63, a serial chain; meanwhile the forward's other warps copy the staged Qg and Kg to the
  // record in 16-byte pieces, before A diag(beta) and the inverse's levels touch shared memory near them)
  if (tid < 64) {
    invert_diag_blocks<LDL>(sm.l(), sm.a_inv(), tid);
  } else if constexpr (!Rec::kBwd) {
    for (int p = tid - 64; p < C * D * 2 / 16; p += NT - 64)
      Rec::qg_kg_piece(rec, p, reinterpret_cast<const uint4*>(sm.qg_stage())[p],
                       reinterpret_cast<const uint4*>(sm.kg_stage())[p]);
  }
  __syncthreads();
  inverse_offdiag(sm.l(), sm.a_inv(), warp, lane);
  // A diag(beta) as bf16 hi + lo: sw64 tiles for W below; to the record the forward's lower blocks of it,
  // the backward's A (before diag(beta)) as a whole [64][64]
  for (int e = tid; e < C * C / 2; e += NT) {
    const int i = e >> 5, j = (e & 31) * 2;
    uint32_t hi, lo;
    float x0, x1;
    if constexpr (Rec::kBwd) {
      const float a0 = (j <= i) ? sm.a_inv()[i * LDL + j] : 0.f;
      const float a1 = (j + 1 <= i) ? sm.a_inv()[i * LDL + j + 1] : 0.f;
      split2(a0, a1, hi, lo);
      if ((j >> 4) <= (i >> 4))  // the lower blocks only (kda_bwd.h); A as hi only (the gradient kernel's A)
        *reinterpret_cast<uint32_t*>(Rec::a_hi(rec) + i * C + j) = hi;
      x0 = a0 * sm.beta()[j];
      x1 = a1 * sm.beta()[j + 1];
    } else {
      x0 = (j <= i) ? sm.a_inv()[i * LDL + j] * sm.beta()[j] : 0.f;
      x1 = (j + 1 <= i) ? sm.a_inv()[i * LDL + j + 1] * sm.beta()[j + 1] : 0.f;
    }
    split2(x0, x1, hi, lo);
    *reinterpret_cast<uint32_t*>(sm.ab_hi() + sw64(i, j)) = hi;
    *reinterpret_cast<uint32_t*>(sm.ab_lo() + sw64(i, j)) = lo;
    if constexpr (!Rec::kBwd) {
      const int I = i >> 4, J = j >> 4;
      if (J <= I) Rec::ab(rec, I, J, i & 15, j & 15, pack_f16(x0, x1));
    }
  }
  if constexpr (Rec::kBwd) cp_async_wait_all();
  __syncthreads();

  prefetch_successor(a, tid);
  // ---- W = A diag(beta) X (and the backward's U = A diag(beta) V). Warp: row blocks {mp, 3 - mp},
  //      columns 32 nq .. ----
  const int mp = warp & 1, nq = warp >> 1;
  uint32_t v_finite = 0u;  // the backward's V pairs' finiteness probe over the B fragments of row block 3, which
                           // hold every row of V's columns 32 nq .. (the warps of mp = 0; kda_status.cuh)
#pragma unroll
  for (int which = 0; which < (Rec::kBwd ? 2 : 1); ++which) {
    const __nv_bfloat16* B = which == 0 ? sm.x() : sm.v();
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
          lda<64>(ah, sm.ab_hi(), m * 16, ks * 16, lane);
          lda<64>(al, sm.ab_lo(), m * 16, ks * 16, lane);
#pragma unroll
          for (int np = 0; np < 2; ++np) {
            uint32_t b[4];
            ldb_t<128>(b, B, ks * 16, nq * 32 + np * 16, lane);
            if (Rec::kBwd && which == 1 && mp == 0 && u == 1)  // block 3: every row of V's columns 32 nq ..
#pragma unroll
              for (int e = 0; e < 4; ++e) v_finite = status::probe_bf16x2(v_finite, b[e]);
            mma_n16(acc[u][2 * np], acc[u][2 * np + 1], ah, b);
            mma_n16(acc[u][2 * np], acc[u][2 * np + 1], al, b);
          }
        }
      }
    }
    // the backward's U goes to the record in fp16 at one power-of-two scale per chunk-head (kda_bwd.h kRecU):
    // the CTA's max |U| first (exact, so the scale and the bits do not depend on the order of the reduction)
    float us = 1.f;
    if constexpr (Rec::kBwd) {
      if (which == 1) {
        status::report(a.status, status::probe_code(v_finite));
        float m = 0.f;
#pragma unroll
        for (int u = 0; u < 2; ++u)
#pragma unroll
          for (int n = 0; n < 4; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) m = fmaxf(m, fabsf(acc[u][n][e]));
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        if (lane == 0) sm.u_max()[warp] = m;
        __syncthreads();
        m = sm.u_max()[0];
#pragma unroll
        for (int w = 1; w < NT / 32; ++w) m = fmaxf(m, sm.u_max()[w]);
        us = Rec::u_scale(rec, m, tid == 0);
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
          const float x0 = acc[u][n][e2 * 2], x1 = acc[u][n][e2 * 2 + 1];
          if (which == 0) {
            Rec::w(rec, i, j, x0, x1);
          } else if constexpr (Rec::kBwd) {
            Rec::u(rec, i, j, x0 * us, x1 * us);
          }
        }
    }
  }
}

}  // namespace chunk_prep
}  // namespace kda
