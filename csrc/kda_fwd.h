// Host launchers of the forward kernels (kda_fwd.cu). All pointers are device pointers; nothing here
// allocates. Layouts: q, k, v, o [T, H, 128] bf16; g [T, H, 128] fp32; beta [T, H] bf16;
// states / summaries [n, H, 128, 128] fp32 indexed [.., key, value] (M: [.., key_out, key_in]).
#pragma once

#include <cuda_runtime.h>
#include <cstdint>

namespace kda {

struct ChunkArgs {
  const void* q;
  const void* k;
  const void* v;
  const float* g;
  const void* beta;
  const int32_t* segs;  // [nseg][4]
  int nseg;
  int H;
  float scale;
  // forward (o != nullptr): segs rows = (tok_start, ntok, idx, kind); kind 0: state_in[idx] (the run) or
  // zero when state_in is null; kind 1: sin[idx] (a slot filled by the merge)
  void* o;
  const float* state_in;  // may be null
  const float* sin;       // may be null when no segment has kind 1
  // summary (o == nullptr): segs rows = (tok_start, ntok, out_index, 0)
  float* m_out;
  float* e_out;
};

// Forward output over segments (one CTA per (segment, head)).
cudaError_t launch_fwd_output(const ChunkArgs& a, cudaStream_t stream);
// Affine summaries (M, E) of segments from a zero state.
cudaError_t launch_fwd_summary(const ChunkArgs& a, cudaStream_t stream);

struct MergeArgs {
  const float* m;         // [ns, H, K, K]
  const float* e;         // [ns, H, K, V]
  const int32_t* chains;  // [nchain][4] = (first summary, count, init run or -1, out index)
  int nchain;
  int H;
  const float* state_in;  // [R, H, K, V] or null (fold mode)
  float* out0;            // fold: S_in per segment [nseg, H, K, V]; compose: M_out [n, H, K, K]
  float* out1;            // compose: E_out [n, H, K, V]
};
// fold: S(j+1) = M_j S(j) + E_j along each chain, writing every S(j+1) to out0[out + j].
cudaError_t launch_merge_fold(const MergeArgs& a, cudaStream_t stream);
// compose: the whole chain's (M, E) into out0[out], out1[out].
cudaError_t launch_merge_compose(const MergeArgs& a, cudaStream_t stream);

}  // namespace kda
