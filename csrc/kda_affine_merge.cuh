// The affine merge in FP32 (DESIGN.md section 2), shared by the forward and the backward programs:
// summaries (M, E) of consecutive segments folded in a fixed order along chains.
//   fold:    X = init (a row of `init`, or zero); for j < count: X = M[first + j] X + E[first + j], each X
//            written to out0[out + j]. The backward folds (M^T, F) listed from the run's end, the same way.
//   compose: the whole chain's map: out0[out] = M_last ... M_first, out1[out] its offset (from [I | 0]).
// One CTA per (chain, head, 32 state columns); X (128 x 32) lives in shared memory. Deterministic.
#pragma once

#include <cuda_runtime.h>
#include <cstdint>

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

template <bool COMPOSE>
__global__ void __launch_bounds__(256) merge_kernel(const MergeArgs a) {
  __shared__ float X[D][33];
  const int c = blockIdx.x, h = blockIdx.y, tile = blockIdx.z;
  const int first = a.chains[c * 4 + 0], cnt = a.chains[c * 4 + 1];
  const int init = a.chains[c * 4 + 2], outi = a.chains[c * 4 + 3];
  const bool mpart = COMPOSE && tile < 4;  // compose: tiles 0-3 carry the M columns, 4-7 the E columns
  const int col0 = (tile & 3) * 32;
  const int t = threadIdx.x, d = t >> 1, cb = (t & 1) * 16;
  const int H = a.H;
#pragma unroll
  for (int cc = 0; cc < 16; ++cc) {
    const int col = col0 + cb + cc;
    float x = 0.f;
    if (COMPOSE) x = (mpart && d == col) ? 1.f : 0.f;
    else if (init >= 0 && a.init != nullptr)
      x = a.init[((static_cast<int64_t>(init) * H + h) * D + d) * D + col];
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

}  // namespace merge_detail

inline cudaError_t launch_merge_fold(const MergeArgs& a, cudaStream_t stream) {
  if (a.nchain == 0 || a.H == 0) return cudaSuccess;
  merge_detail::merge_kernel<false><<<dim3(a.nchain, a.H, 4), 256, 0, stream>>>(a);
  return cudaGetLastError();
}

inline cudaError_t launch_merge_compose(const MergeArgs& a, cudaStream_t stream) {
  if (a.nchain == 0 || a.H == 0) return cudaSuccess;
  merge_detail::merge_kernel<true><<<dim3(a.nchain, a.H, 8), 256, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace kda
