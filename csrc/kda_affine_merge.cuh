// The affine merge in FP32 (DESIGN.md section 2), shared by the forward and the backward programs:
// summaries (M, E) of consecutive segments folded in a fixed order along chains.
//   fold:    X = init (a row of `init`, or zero); for j < count: X = M[first + j] X + E[first + j], each X
//            written to out0[out + j]. The backward folds (M^T, F) listed from the run's end, the same way.
//   compose: the whole chain's map: out0[out] = M_last ... M_first, out1[out] its offset (from [I | 0]).
// One CTA per (chain, head, 16 state columns); X (128 x 16) lives in shared memory, and so does M: step j + 1's
// M streams in (cp.async, two buffers) while step j computes. Deterministic: every output is
// E + sum over k ascending of M[d][k] X[k][c], in FP32.
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
constexpr int kMRow = D + 4;          // fp32 row stride of a staged M: the 16 rows a warp reads hit 8 bank groups twice
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

// Thread t owns row d = t / 2 and the 8 columns cb = 8 (t % 2) of the tile: per 4 keys one 16-byte shared read
// of its M row, two 16-byte reads of each X row (every lane of a warp reads one of the same two addresses:
// broadcasts), 32 FMA.
__device__ __forceinline__ void row_fma(float (&acc)[8], float m, const float* x) {
  const float4 x0 = *reinterpret_cast<const float4*>(x), x1 = *reinterpret_cast<const float4*>(x + 4);
  acc[0] = fmaf(m, x0.x, acc[0]);
  acc[1] = fmaf(m, x0.y, acc[1]);
  acc[2] = fmaf(m, x0.z, acc[2]);
  acc[3] = fmaf(m, x0.w, acc[3]);
  acc[4] = fmaf(m, x1.x, acc[4]);
  acc[5] = fmaf(m, x1.y, acc[5]);
  acc[6] = fmaf(m, x1.z, acc[6]);
  acc[7] = fmaf(m, x1.w, acc[7]);
}

template <bool COMPOSE>
__global__ void __launch_bounds__(256) merge_kernel(const MergeArgs a) {
  __align__(16) __shared__ float X[D][kCols];
  extern __shared__ __align__(128) char smem[];
  float* sM = reinterpret_cast<float*>(smem);
  const int c = blockIdx.x, h = blockIdx.y, tile = blockIdx.z;
  const int first = a.chains[c * 4 + 0], cnt = a.chains[c * 4 + 1];
  const int init = a.chains[c * 4 + 2], outi = a.chains[c * 4 + 3];
  const bool mpart = COMPOSE && tile < kTiles;  // compose: the first kTiles tiles carry M's columns, the rest E's
  const int col0 = (tile % kTiles) * kCols;
  const int t = threadIdx.x, d = t >> 1, cb = (t & 1) * 8;
  const int H = a.H;
  auto step_base = [&](int j) { return (static_cast<int64_t>(first + j) * H + h) * D * D; };
  if (cnt > 0) stage_m(sM, a.m + step_base(0), t);
#pragma unroll
  for (int cc = 0; cc < 8; ++cc) {
    const int col = col0 + cb + cc;
    float x = 0.f;
    if (COMPOSE) x = (mpart && d == col) ? 1.f : 0.f;
    else if (init >= 0 && a.init != nullptr)
      x = a.init[((static_cast<int64_t>(init) * H + h) * D + d) * D + col];
    X[d][cb + cc] = x;
  }
  for (int j = 0; j < cnt; ++j) {
    const int64_t base = step_base(j);
    float acc[8];
#pragma unroll
    for (int cc = 0; cc < 8; ++cc) acc[cc] = mpart ? 0.f : a.e[base + d * D + col0 + cb + cc];
    // the buffer of step j + 1 was last read in step j - 1 (barriers since)
    if (j + 1 < cnt) {
      stage_m(sM + ((j + 1) & 1) * D * kMRow, a.m + step_base(j + 1), t);
      cp_async_wait1();
    } else {
      cp_async_wait_all();
    }
    __syncthreads();  // step j's M and the X of step j - 1 are in place
    const float4* mrow = reinterpret_cast<const float4*>(sM + (j & 1) * D * kMRow + d * kMRow);
#pragma unroll 8
    for (int k4 = 0; k4 < D / 4; ++k4) {
      const float4 mv = mrow[k4];
      row_fma(acc, mv.x, &X[4 * k4 + 0][cb]);
      row_fma(acc, mv.y, &X[4 * k4 + 1][cb]);
      row_fma(acc, mv.z, &X[4 * k4 + 2][cb]);
      row_fma(acc, mv.w, &X[4 * k4 + 3][cb]);
    }
    __syncthreads();
#pragma unroll
    for (int cc = 0; cc < 8; ++cc) X[d][cb + cc] = acc[cc];
    if (!COMPOSE) {
      float* dst = a.out0 + (static_cast<int64_t>(outi + j) * H + h) * D * D + d * D + col0 + cb;
#pragma unroll
      for (int cc = 0; cc < 8; ++cc) dst[cc] = acc[cc];
    }
  }
  __syncthreads();
  if (COMPOSE) {
    float* dst = (mpart ? a.out0 : a.out1) + (static_cast<int64_t>(outi) * H + h) * D * D + d * D + col0 + cb;
#pragma unroll
    for (int cc = 0; cc < 8; ++cc) dst[cc] = X[d][cb + cc];
  }
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
