// Host launchers of the backward kernels (kda_bwd.cu). All pointers are device pointers; nothing here
// allocates. Layouts: q, k, v, do, dq, dk, dv [T, H, 128] bf16; g, dg [T, H, 128] fp32; beta, dbeta
// [T, H] bf16; states and their gradients [n, H, 128, 128] fp32 indexed [.., key, value], except h
// (kHiStateBytes below) and dh (kDhStateBytes).
//
// Tables (int32): chunks [Nc][2] = (first token, rows); walk rows [n][4] = (first chunk row, chunk count,
// idx, src): the state enters from fold[idx] when src == 1, else from state_in / dstate_out[idx]
// (zero when null or idx < 0); summary rows (first chunk row, chunk count, out idx, 0); fold chains
// (first summary, count, init idx or -1, first out slot). A walk with walk_out also writes, per row, the FP32
// state it ends with: a run walked as consecutive pieces (launches) hands it to the next piece as fold[row].
//
// The prep workspace holds one record of kPrepBytes per (chunk row, head), record index c * H + h.
#pragma once

#include <cuda_runtime.h>
#include <cstdint>

namespace kda {
namespace bwd {

// ---- one prep record (bytes) ----
constexpr int kRecW = 0;          // bf16 [64][128]  W = A diag(beta) (K o exp G)
constexpr int kRecKg = 16384;     // bf16 [64][128]  Kg = K o exp(G_last - G)
constexpr int kRecQg = 32768;     // bf16 [64][128]  s Q o exp(G)
constexpr int kRecAqkH = 49152;   // bf16 [64][64]   Aqk (scaled, causal) hi
constexpr int kRecAqkL = 57344;   // bf16 [64][64]   Aqk lo
constexpr int kRecAH = 65536;     // bf16 [64][64]   A = (I + L)^-1 hi; the 8 KiB after it unused (A is read as hi
                                  // only: its lo changed no gradient visibly)
constexpr int kRecU = 81920;      // fp16 U = A diag(beta) V times 2^-e (kURowBytes below); the forward walk
                                  // then writes V_new over it (kRecVn: U is read by no later kernel)
constexpr int kRecP = 114688;     // fp32 [64][64]   P (strictly lower part)
constexpr int kRecGam = 131072;   // fp32 [128]      gamma = exp(G_last)
constexpr int kRecDvn = 131584;   // dV_new, written by the reverse walk (layout of kRecVn)
constexpr int kPrepBytes = 164352;
// Aqk, A and P are block lower triangular (16 x 16 blocks): the prep writes their 10 lower blocks (zeros above the
// diagonal inside the diagonal blocks) and leaves the 6 strictly upper ones unwritten (18 KB of the record's
// 128.5 KB); their readers copy the lower blocks and zero-fill the rest (load_rows<..., LOWER>).
// V_new (over U) and dV_new as fp16 at a power of two per walk warp and chunk-head, in the walks' fragment order so
// that every store of a walk warp writes 128 contiguous bytes: for the walk CTA of half z (value columns 64 z ..),
// warp w (16 columns), token step ks and A-fragment register i, "row" R = 16 w + 4 ks + i of 512 bytes holds at
// byte 256 z the 32 lanes' fp16 words (value x 2^-e, max |value| 2^-e of the warp's 16 x 64 in [2^14, 2^15)); 2^e
// as fp32 at byte kVnScaleOff + 256 z + 4 w. A half lies in the bytes of U's columns of that half (U rows are 512
// bytes too), so the walk CTA of one half never writes what the other half's CTA reads; bytes 256 z + 128 .. 255 of
// each row hold no U (row 0's hold U's scale, row 1's the warps' scales). fp16 instead of bf16 hi + lo:
// half the bytes the walks store and the gradient kernel loads, at 11 significant bits (the gradients move by ~2e-4
// of their RMS, docs/kernels.md §4, against ~1.7e-3 from the bf16 inputs and outputs).
constexpr int kRecVn = kRecU;
constexpr int kWalkRowBytes = 512;
constexpr int kVnScaleOff = kWalkRowBytes + 128;
// U in fp16 (16 of the slot's 32 KB: the forward walk, bound by bytes at H >= 16, reads 16 KB less, the prep writes
// 16 KB less; U comes from bf16 V, 4 times coarser than fp16). Row i, value half z: 64 fp16 at byte kWalkRowBytes i +
// 256 z, so that half z's U lies in the bytes half z's V_new overwrites (as above). Scaled per chunk-head by 2^-e, e
// chosen by the prep so that max |U| 2^-e lies in [2^14, 2^15): fp16's 11 significant bits wherever |U| is within
// 2^-14 of the max, and no overflow for any finite U. 2^e as fp32 at byte kUScaleOff + 256 z (a copy per half, 16
// bytes: 2^e, 0, 0, 0): the walk multiplies by it exactly (a power of two).
constexpr int kURowBytes = kWalkRowBytes;
constexpr int kUScaleOff = 128;

// h and dh as the walks write them and the gradient kernel reads them: per (chunk, head) the state S[key][value]
// in the walks' fragment order, so that each warp store writes 128 contiguous bytes and the gradient kernel moves
// 16-byte pieces into its swizzled S^T tiles. dh holds the state gradient as fp16 at a power of two per walk warp
// (value half z, warp w: 16 value columns x 128 keys; max |dS| 2^-e in [2^14, 2^15)): at byte 16384 z + 128 (2 (16 w
// + nt) + eh) the 32 lanes' fp16 words (lane 4 g + l: keys 8 nt + 2 l, + 1 of value column 64 z + 16 w + 8 eh + g),
// and 2^e as fp32 at byte kDhScaleOff + 16 z + 4 w (32 KiB + 128 bytes per chunk-head; bf16 hi + lo
// would take 64 KiB and be no more precise for the gradients: docs/kernels.md §4).
constexpr int kDhStateBytes = 32768 + 128;
constexpr int kDhHalfBytes = 16384;
constexpr int kDhScaleOff = 32768;
// h holds S as bf16 hi only, the same order without the lo words (32 KiB per chunk-head): at byte 16384 z +
// 128 (2 (16 w + nt) + eh) the 32 lanes' hi words. The gradient kernel's products take S as hi only and dgamma
// takes S hi x dS; dS enters as hi + lo of its fp16 value (dKg needs it).
constexpr int kHiStateBytes = 32768;
constexpr int kHiHalfBytes = 16384;

struct Args {
  const void* q;
  const void* k;
  const void* v;
  const float* g;
  const void* beta;
  const void* dout;
  const int32_t* chunks;
  int nchunks;
  const int32_t* runs;
  int nruns;
  int H;
  float scale;
  char* prep;               // [Nc * H * kPrepBytes]
  char* h;                  // [Nc, H] x kHiStateBytes: state entering each chunk (hi only, below)
  char* dh;                 // [Nc, H] x kDhStateBytes: gradient of the state leaving each chunk
  const float* state_in;    // [*, H, K, V] or null
  const float* dstate_out;  // [*, H, K, V] or null
  float* mt_out;            // backward summaries: [n, H, K, K]
  float* f_out;             // backward summaries: [n, H, K, V]
  float* m_out;             // forward segment summaries: [n, H, K, K]
  float* e_out;             // forward segment summaries: [n, H, K, V]
  const float* fold;        // walks: incoming states of segments with src == 1 [n, H, K, V]
  float* walk_out;          // walks: the state (forward) or state gradient (reverse) leaving row i, to
                            // walk_out[i] [nruns, H, K, V], or null (a split walk's hand-off to its next piece)
  void* dq;
  void* dk;
  void* dv;
  float* dg;
  void* dbeta;
  int* status;  // prep: the value-domain status word (kda_status.cuh)
};

cudaError_t launch_prep(const Args& a, cudaStream_t s);
// walks and summaries: warps = 4 or 8 per CTA (WalkShape in kda_bwd.cu)
cudaError_t launch_fwd_walk(const Args& a, int warps, cudaStream_t s);     // writes h (and walk_out)
cudaError_t launch_rev_walk(const Args& a, int warps, cudaStream_t s);     // writes dh (and walk_out)
cudaError_t launch_rev_summary(const Args& a, int warps, cudaStream_t s);  // writes mt_out, f_out
cudaError_t launch_fwd_summary(const Args& a, int warps, cudaStream_t s);  // writes m_out, e_out
// warps: 8 or 16 per CTA (GradsTiling in kda_bwd.cu)
cudaError_t launch_grads(const Args& a, int warps, cudaStream_t s);

}  // namespace bwd
}  // namespace kda
