// Warp sums of rows spread over the 32 lanes of a warp (kda_act.cu: a 128-wide row, lane l on channels 4l .. 4l + 3):
// one row's (`warp_sum`) and several rows' at once (`warp_sum_rows`), which adds exactly what `warp_sum` adds, in
// its order, for each row. A header of its own so that the CPU emulation's test can run both on the same partials
// (tests/test_activations_emulation.py).
#pragma once

#include <cuda_runtime.h>

namespace kda {
namespace act {

// The sum over the warp in a fixed butterfly order (every lane gets it, bitwise the same from run to run).
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// The warp sums of R rows' partials p[0 .. R), then f of each: p[r] becomes f(sum of row r) on every lane, and the
// return value is f of this lane's own row, row lane / (32 / R) (the lanes r (32 / R) can store row r's value).
// Bitwise `warp_sum` per row: every step adds, for one row, a lane's partial and its butterfly partner's (own +
// partner's, as `warp_sum` adds them) over the offsets 16, 8, .., 1. The first log2 R steps also halve the rows a
// lane carries (the lane whose offset bit is clear keeps the lower half of its rows, its partner the upper half), so
// R rows take R - 1 + 5 - log2 R butterfly shuffles and R broadcasts instead of 5 R shuffles, and f runs once for
// all R rows instead of once per row.
template <int R, class F>
__device__ __forceinline__ float warp_sum_rows(float (&p)[R], F f) {
  static_assert(R >= 1 && R <= 32 && (R & (R - 1)) == 0, "R is a power of two up to 32");
  const int lane = static_cast<int>(threadIdx.x & 31);
  float v[R];
#pragma unroll
  for (int i = 0; i < R; ++i) v[i] = p[i];
  int o = 16;
#pragma unroll
  for (int n = R; n > 1; n >>= 1, o >>= 1) {
    const bool upper = (lane & o) != 0;
#pragma unroll
    for (int i = 0; i < n / 2; ++i) {
      const float keep = upper ? v[i + n / 2] : v[i];
      const float give = upper ? v[i] : v[i + n / 2];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, give, o);
    }
  }
#pragma unroll
  for (; o > 0; o >>= 1) v[0] += __shfl_xor_sync(0xffffffffu, v[0], o);
  const float mine = f(v[0]);
#pragma unroll
  for (int r = 0; r < R; ++r) p[r] = __shfl_sync(0xffffffffu, mine, r * (32 / R));
  return mine;
}

}  // namespace act
}  // namespace kda
