// Host launchers of the forward (kda_fwd.cu). All pointers are device pointers; nothing
// here allocates. Layouts: q, k, v, o [T, H, 128] bf16; g [T, H, 128] fp32; beta [T, H] bf16;
// states / summaries [n, H, 128, 128] fp32 indexed [.., key, value] (M: [.., key_out, key_in]);
// workspace: one record of kFwdRecordBytes per (chunk, head), record index chunk * H + head.
#pragma once

#include <cuda_runtime.h>
#include <cstdint>

namespace kda {

// Record of one (chunk, head), written by the prep kernel, read by the walks (byte offsets). Every matrix is
// fp16, the walk's operand type (kda_fwd.cu):
//   0      -W      fp16 [64][128], 16-byte chunks XOR-swizzled by row (sw128)
//   16384  Qg      fp16 [64][128] sw128, = s q o exp(G)
//   32768  Kg      fp16 [64][128] sw128, = k o exp(G_63 - G)
//   49152  Aqk     fp16, the 10 lower 16x16 blocks (block I(I+1)/2 + J), rows of 32 B, chunk ^ ((r >> 2) & 1)
//   54272  gamma   fp32 [128] = exp(G_63)
//   54784  A diag(beta)  fp16 (10 lower blocks as for Aqk)
constexpr int kFwdRecordBytes = 59904;

struct PrepArgs {
  const void* q;
  const void* k;
  const float* g;
  const void* beta;
  const int32_t* chunks;  // [nchunk][2] = (tok_start, nrows)
  int nchunk;
  int H;
  float scale;
  void* ws;     // [nchunk * H] records
  int* status;  // the value-domain status word (kda_status.cuh)
};

struct WalkArgs {
  const void* v;
  const void* ws;
  const int32_t* chunks;  // [nchunk][2] = (tok_start, rows): the chunk table the records were made from
  const int32_t* segs;    // [nseg][8] = (tok_start, ntok, first chunk, idx, kind, chunks, 0, 0)
  int nseg;
  int H;
  // output walk: kind 0: state_in[idx] (null: zero), kind 1: sin[idx]
  void* o;
  const float* state_in;
  const float* sin;
  // summary walk (from a zero state): M and E written to slot idx
  float* m_out;
  float* e_out;
};

// Chunk prep, one CTA per (chunk, head).
cudaError_t launch_fwd_prep(const PrepArgs& a, cudaStream_t stream);
// Output walk, one CTA per (segment, head, 16 * warps value columns); warps in {2, 4, 8}.
cudaError_t launch_fwd_walk_output(const WalkArgs& a, int warps, cudaStream_t stream);
// Summary walk [M | E] from [I | 0], one CTA per (segment, head, 16 * warps of the 256 virtual columns).
cudaError_t launch_fwd_walk_summary(const WalkArgs& a, int warps, cudaStream_t stream);

}  // namespace kda
