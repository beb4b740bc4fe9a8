// Chunk-prep device code shared by the forward (kda_fwd.cu) and the backward prep
// (kda_bwd.cu): pieces of A = (I + L)^-1 in FP32 for a 64-row chunk, L strictly lower (fp32 tiles of row
// stride LD in shared memory).
#pragma once

#include "kda_common.cuh"

namespace kda {

// Diagonal 16x16 blocks of A = (I + L)^-1 by forward substitution, all NT threads: 16 lanes per column
// c of block I, lane r holding x_r (x = e_c; step m: x_r -= L_rm x_m for r > m, x_m from lane m by a
// shuffle). The same fmaf sequence per element as a one-thread-per-column solve, so the same bits, but
// the chain runs on every warp instead of two (with two warps the rest of the CTA sat at the barrier:
// 13 % of the backward prep's samples, session 4 ncu). The off-diagonal blocks follow by level.
template <int LD, int NT>
__device__ __forceinline__ void invert_diag_blocks(const float* sL, float* sA, int tid) {
  static_assert(NT % 32 == 0 && 64 % (NT / 16) == 0, "whole warps, columns evenly spread");
  const int lane = tid & 31, r = lane & 15;
  for (int col = tid >> 4; col < 64; col += NT / 16) {  // col = 16 I + c, the same trip count per warp
    const int I = col >> 4, c = col & 15;
    const float* Lr = sL + (I * 16 + r) * LD + I * 16;
    float x = (r == c) ? 1.f : 0.f;
#pragma unroll
    for (int m = 0; m < 15; ++m) {
      const float xm = __shfl_sync(0xffffffffu, x, (lane & 16) | m);
      if (r > m) x = fmaf(-Lr[m], xm, x);
    }
    sA[(I * 16 + r) * LD + I * 16 + c] = x;
  }
}

}  // namespace kda
