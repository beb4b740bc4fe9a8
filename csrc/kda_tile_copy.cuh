// Copies of row blocks from global to shared memory by cp.async, each thread's addresses fixed once per call (the
// forward's and the backward's walks and preps).
#pragma once
#include "kda_common.cuh"

namespace kda {

// ROWS rows of a matrix of T (PR 16-byte pieces per row, global row stride gstride elements) -> a shared tile whose
// layout `at(r, c)` (element offset) repeats every ld elements per row across a pass: rows >= nvalid are zero-filled.
// A thread's pieces p = tid + NT k keep their column, so the tile offset and the source advance by constants: the
// address arithmetic is done once per call, not per piece (per piece it was most of the walks' stage-load
// instructions, by ncu). RPI rows per pass; a swizzled layout must repeat within RPI rows.
// LOWER: a block lower triangular matrix (16 x 16 blocks) whose strictly upper blocks are not in memory: their
// pieces are zero-filled without a read (the backward's Aqk, A and P, kda_bwd.h).
template <int NT, int ROWS, int PR, bool LOWER = false, class T, class At>
__device__ __forceinline__ void load_rows(T* dst, int ld, const T* src, int64_t gstride, int nvalid, int tid, At at) {
  constexpr int E = 16 / sizeof(T), TOTAL = ROWS * PR;  // elements per piece, pieces in all
  constexpr int RPI = TOTAL <= NT ? ROWS : NT / PR, PASSES = TOTAL <= NT ? 1 : TOTAL / NT;
  static_assert(TOTAL <= NT || (NT % PR == 0 && TOTAL % NT == 0), "whole passes");
  if (TOTAL < NT && tid >= TOTAL) return;
  const int r0 = tid / PR, c = (tid % PR) * E;
  T* d = dst + at(r0, c);
  const T* s = src + r0 * gstride + c;
#pragma unroll
  for (int k = 0; k < PASSES; ++k) {
    const int r = r0 + RPI * k;
    const bool ok = r < nvalid && (!LOWER || (c >> 4) <= (r >> 4));
    cp_async16(d + RPI * k * ld, ok ? s + RPI * k * gstride : src, ok);
  }
}

}  // namespace kda
