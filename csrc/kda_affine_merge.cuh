// The affine merge in FP32 (docs/design.md §4), shared by the forward and the backward programs:
// summaries (M, E) of consecutive segments folded in a fixed order along chains.
//   fold:    X = init (a row of `init`, or zero); for j < count: X = M[first + j] X + E[first + j], each X
//            written to out0[out + j]. The backward folds (M^T, F) listed from the run's end, the same way.
//   compose: the whole chain's map: out0[out] = M_last ... M_first, out1[out] its offset (from [I | 0]).
// One CTA per (chain, head, 16 state columns); warp w owns rows 16 w .. 16 w + 15 of X as mma accumulators.
// The product M X runs on tensor cores as 3xTF32 (M and X each split into hi + lo TF32 parts; lo * lo dropped):
// ~21 bits per product, which docs/design.md §10 asks of the merge (plain TF32's 11 drift over long chains). X is staged
// in shared memory as its split; M streams in (cp.async, two buffers) while the step before computes. The
// FP32-FMA version it replaces was bound by its shared-memory reads of X (H200, H = 4 forward fold: 170 -> 99 us).
// Deterministic: a fixed sequence of mma per output, then fixed-order sums and + E, in FP32.
#pragma once

#include <cuda_runtime.h>
#include <cstdint>

#include "kda_common.cuh"

namespace kda {

struct MergeArgs {
  const float* m;         // [ns, H, K, K]
  const float* e;         // [ns, H, K, V]
  const int32_t* chains;  // [nchain][4] = (first summary, count, init row or -1, out index)
  int nchain;
  int H;
  const float* init;      // fold: [R, H, K, V] initial states, or null (zero)
  float* out0;            // fold: X after each step [n, H, K, V]; compose: M_out [n, H, K, K]
  float* out1;            // compose: E_out [n, H, K, V]
};

namespace merge_detail {

constexpr int D = 128;
constexpr int kCols = 16;             // state columns per CTA: 8 CTAs per (chain, head) for a fold
constexpr int kTiles = D / kCols;
constexpr int kN8 = kCols / 8;        // m16n8 accumulator tiles per warp
constexpr int kMRow = D + 4;          // fp32 row stride of a staged M: an A fragment's 32 lanes hit 32 banks
constexpr int kXRow = kCols + 8;      // word row stride of the split X: a B fragment's 32 lanes hit 32 banks
constexpr int kSmem = 2 * D * kMRow * 4;  // two M buffers (dynamic shared memory)

// M of one step -> a buffer, 16-byte pieces (the whole CTA; one cp.async group)
__device__ __forceinline__ void stage_m(float* buf, const float* m, int t) {
#pragma unroll 4
  for (int p = t; p < D * D / 4; p += 256) {
    const int r = p >> 5, c4 = (p & 31) * 4;
    cp_async16(buf + r * kMRow + c4, m + r * D + c4, true);
  }
  cp_async_commit();
}

// A lane's accumulator element (n, e) is X[r0 + 8 (e >> 1)][8 n + 2 q + (e & 1)] of the CTA's columns.
__device__ __forceinline__ int frag_row(int r0, int e) { return r0 + 8 * (e >> 1); }
__device__ __forceinline__ int frag_col(int q, int n, int e) { return 8 * n + 2 * q + (e & 1); }

template <bool COMPOSE>
__global__ void __launch_bounds__(256) merge_kernel(const MergeArgs a) {
  __align__(16) __shared__ uint32_t Xh[D][kXRow];  // X as TF32 hi, then lo parts
  __align__(16) __shared__ uint32_t Xl[D][kXRow];
  extern __shared__ __align__(128) char smem[];
  float* sM = reinterpret_cast<float*>(smem);
  const int c = blockIdx.x, h = blockIdx.y, tile = blockIdx.z;
  const int first = a.chains[c * 4 + 0], cnt = a.chains[c * 4 + 1];
  const int init = a.chains[c * 4 + 2], outi = a.chains[c * 4 + 3];
  const bool mpart = COMPOSE && tile < kTiles;  // compose: the first kTiles tiles carry M's columns, the rest E's
  const int col0 = (tile % kTiles) * kCols;
  const int t = threadIdx.x, lane = t & 31, g = lane >> 2, q = lane & 3;
  const int r0 = 16 * (t >> 5) + g;
  const int H = a.H;
  auto step_base = [&](int j) { return (static_cast<int64_t>(first + j) * H + h) * D * D; };
  // E of a step at this lane's accumulator elements (zero for compose's M columns)
  auto load_e = [&](int j, float (&v)[kN8][4]) {
#pragma unroll
    for (int n = 0; n < kN8; ++n)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        float2 p = make_float2(0.f, 0.f);
        if (!mpart) p = *reinterpret_cast<const float2*>(a.e + step_base(j) + frag_row(r0, e) * D + col0 + frag_col(q, n, e));
        v[n][e] = p.x;
        v[n][e + 1] = p.y;
      }
  };
  auto put_x = [&](const float (&x)[kN8][4]) {
#pragma unroll
    for (int n = 0; n < kN8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = frag_row(r0, e), cc = frag_col(q, n, e);
        split_tf32(x[n][e], Xh[r][cc], Xl[r][cc]);
      }
  };
  // X at this lane's elements -> state [index] of `out` (fp32 [n, H, D, D])
  auto store_x = [&](float* out, int64_t index, const float (&x)[kN8][4]) {
    float* dst = out + (index * H + h) * D * D + col0;
#pragma unroll
    for (int n = 0; n < kN8; ++n)
#pragma unroll
      for (int e = 0; e < 4; e += 2)
        *reinterpret_cast<float2*>(dst + frag_row(r0, e) * D + frag_col(q, n, e)) = make_float2(x[n][e], x[n][e + 1]);
  };
  if (cnt > 0) stage_m(sM, a.m + step_base(0), t);
  float x[kN8][4];  // X at this lane's elements: the chain's state after the last step
#pragma unroll
  for (int n = 0; n < kN8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = frag_row(r0, e), col = col0 + frag_col(q, n, e);
      float v = 0.f;
      if (COMPOSE) v = (mpart && r == col) ? 1.f : 0.f;
      else if (init >= 0 && a.init != nullptr) v = a.init[((static_cast<int64_t>(init) * H + h) * D + r) * D + col];
      x[n][e] = v;
    }
  put_x(x);
  float e_next[kN8][4];
  if (cnt > 0) load_e(0, e_next);
  for (int j = 0; j < cnt; ++j) {
    float e_cur[kN8][4];
#pragma unroll
    for (int n = 0; n < kN8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) e_cur[n][e] = e_next[n][e];
    // the buffer of step j + 1 was last read in step j - 1 (barriers since)
    if (j + 1 < cnt) {
      stage_m(sM + ((j + 1) & 1) * D * kMRow, a.m + step_base(j + 1), t);
      load_e(j + 1, e_next);
      cp_async_wait1();
    } else {
      cp_async_wait_all();
    }
    __syncthreads();  // step j's M and the split X of step j - 1 are in place
    const float* mrow = sM + (j & 1) * D * kMRow + r0 * kMRow + q;
    // four accumulators per tile: even / odd k8 steps, hi * hi apart from the small products. Tensor cores add
    // into an FP32 accumulator with truncation; summing the small products apart keeps their bits (one accumulator
    // for all three: 3.2e-5 against FP64 over a 40-step chain on the H200; apart: 6.2e-6; FP32 FMA: 1.3e-6).
    float acc[4][kN8][4];
#pragma unroll
    for (int i = 0; i < 4; ++i) zero_frags(acc[i]);
#pragma unroll 4
    for (int s = 0; s < D / 8; ++s) {
      uint32_t ah[4], al[4];
      split_tf32(mrow[8 * s], ah[0], al[0]);
      split_tf32(mrow[8 * kMRow + 8 * s], ah[1], al[1]);
      split_tf32(mrow[8 * s + 4], ah[2], al[2]);
      split_tf32(mrow[8 * kMRow + 8 * s + 4], ah[3], al[3]);
#pragma unroll
      for (int n = 0; n < kN8; ++n) {
        const uint32_t bh0 = Xh[8 * s + q][8 * n + g], bh1 = Xh[8 * s + q + 4][8 * n + g];
        const uint32_t bl0 = Xl[8 * s + q][8 * n + g], bl1 = Xl[8 * s + q + 4][8 * n + g];
        mma_tf32(acc[2 + (s & 1)][n], al, bh0, bh1);
        mma_tf32(acc[2 + (s & 1)][n], ah, bl0, bl1);
        mma_tf32(acc[s & 1][n], ah, bh0, bh1);
      }
    }
#pragma unroll
    for (int n = 0; n < kN8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) x[n][e] = ((acc[2][n][e] + acc[3][n][e]) + (acc[0][n][e] + acc[1][n][e])) + e_cur[n][e];
    __syncthreads();  // every warp has read the split X of step j - 1
    put_x(x);
    if (!COMPOSE) store_x(a.out0, outi + j, x);
  }
  if (COMPOSE) store_x(mpart ? a.out0 : a.out1, outi, x);
}

// one CTA per (chain, head, state-column tile); compose also covers E's columns
template <bool COMPOSE>
inline cudaError_t launch(const MergeArgs& a, cudaStream_t stream) {
  if (a.nchain == 0 || a.H == 0) return cudaSuccess;
  const cudaError_t err = cudaFuncSetAttribute(merge_kernel<COMPOSE>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return err;
  merge_kernel<COMPOSE><<<dim3(a.nchain, a.H, COMPOSE ? 2 * kTiles : kTiles), 256, kSmem, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace merge_detail

inline cudaError_t launch_merge_fold(const MergeArgs& a, cudaStream_t stream) {
  return merge_detail::launch<false>(a, stream);
}

inline cudaError_t launch_merge_compose(const MergeArgs& a, cudaStream_t stream) {
  return merge_detail::launch<true>(a, stream);
}

}  // namespace kda
