// Chunk-prep device code shared by the forward (kda_fwd.cu) and the backward prep
// (kda_bwd.cu): pieces of A = (I + L)^-1 in FP32 for a 64-row chunk, L strictly lower (fp32 tiles of row
// stride LD in shared memory).
#pragma once

#include "kda_common.cuh"

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

}  // namespace kda
