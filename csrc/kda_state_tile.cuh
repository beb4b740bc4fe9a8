// The walks' state tile, shared by the forward walk (kda_fwd.cu) and the backward walks
// (kda_bwd.cu): each warp holds 16 columns of a 128x128 state transposed, ST[nt][e] = S[d][v] with
// v = vcol + g4 + 8 (e >> 1), d = 8 nt + 2 l4 + (e & 1) (g4 = lane / 4, l4 = lane % 4): the mma
// accumulator layout of sixteen m16n8 tiles, so S^T is a ready A operand and a ready accumulator.
// The helpers take g4, l4 from the caller: recomputing them inside reorders the generated code.
// (The forward walk keeps its own load / store loops for the same reason: written through these helpers
// its PTX changes.)
#pragma once

#include "kda_common.cuh"

namespace kda {

constexpr int kStateDim = 128;  // K = V = head dim

// The backward's walks carry S (in V_new = U - W S) and V_new (in the rank-16 update S += V_new^T Kg) as bf16
// hi + lo, two tensor-core products each: with hi only, segmentations of one run and KCP pieces disagree by
// 1.7-2.9e-3 (bound 1e-3; docs/kernels.md §4). (The forward's walk takes fp16 operands: kda_fwd.cu.)

// ST from src (fp32 [K][V], null: zero) when FROM_SRC, else the columns of the identity when `identity`
// (summary from a zero state: the M part starts as I, the offset part as 0).
template <bool FROM_SRC>
__device__ __forceinline__ void state_tile_init(float (&ST)[16][4], const float* src, bool identity, int vcol,
                                                int g4, int l4) {
#pragma unroll
  for (int nt = 0; nt < 16; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int v = vcol + g4 + 8 * (e >> 1), d = nt * 8 + 2 * l4 + (e & 1);
      float x = 0.f;
      if constexpr (FROM_SRC) {
        if (src != nullptr) x = src[d * kStateDim + v];
      } else {
        x = (identity && v == d) ? 1.f : 0.f;
      }
      ST[nt][e] = x;
    }
}

// ST -> dst (fp32 [K][V]).
__device__ __forceinline__ void state_tile_store(float* dst, const float (&ST)[16][4], int vcol, int g4, int l4) {
#pragma unroll
  for (int nt = 0; nt < 16; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int v = vcol + g4 + 8 * (e >> 1), d = nt * 8 + 2 * l4 + (e & 1);
      dst[d * kStateDim + v] = ST[nt][e];
    }
}

// ST += V^T B for one 16-token step ks: V^T the A operand (hi + lo), B bf16 stored [token][key], sw128 rows
// (HALVES: two 64-key halves of sw64 rows, swh). F16: V^T and B fp16 (the forward walk's operands).
template <bool HALVES = false, bool F16 = false, class T>
__device__ __forceinline__ void state_tile_rank16(float (&ST)[16][4], const uint32_t (&vh)[4], const uint32_t (&vl)[4],
                                                  const T* B, int ks, int lane) {
#pragma unroll
  for (int np = 0; np < 8; ++np) {
    uint32_t b[4];
    if constexpr (HALVES) ldb_t<64>(b, B + (np >> 2) * 4096, ks * 16, (np & 3) * 16, lane);
    else ldb_t<128>(b, B, ks * 16, np * 16, lane);
    mma<F16>(ST[2 * np], vh, b[0], b[1]);
    mma<F16>(ST[2 * np + 1], vh, b[2], b[3]);
    mma<F16>(ST[2 * np], vl, b[0], b[1]);
    mma<F16>(ST[2 * np + 1], vl, b[2], b[3]);
  }
}

// acc (16 rows x 64 columns, mma accumulators) += (-1)^NEG S^T B, S^T the A operand carried as hi + lo,
// B bf16 sw128 stored [column][key] (W or Kg of the backward walks).
template <bool NEG>
__device__ __forceinline__ void state_tile_mul(float (&acc)[8][4], const float (&ST)[16][4], const __nv_bfloat16* B,
                                               int lane) {
#pragma unroll
  for (int ks = 0; ks < 8; ++ks) {
    uint32_t sh[4], sl[4];
    split_afrag(ST[2 * ks], ST[2 * ks + 1], sh, sl);
    if constexpr (NEG) negate_split(sh, sl);
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      uint32_t b[4];
      ldb<128>(b, B, ks * 16, np * 16, lane);
      mma_n16(acc[2 * np], acc[2 * np + 1], sh, b);
      mma_n16(acc[2 * np], acc[2 * np + 1], sl, b);
    }
  }
}

}  // namespace kda
