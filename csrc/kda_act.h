// Host launchers of the fused in-call activations of kda_kcp.chunk_kda (kda_act.cu): FLA's q/k L2 norm, the KDA
// gate (A_log, dt_bias, lower_bound) and the beta sigmoid, one pass each way. All pointers are device pointers;
// nothing here allocates. Layouts (N token rows, H q/k heads, HV = G H value heads, head dim 128):
//   raw q, k [N, H, 128], g [N, HV, 128], beta [N, HV]: bf16 or fp32 each (q and k alike);
//   A_log [HV] fp32, dt_bias [HV, 128] fp32;
//   activated q, k [N, HV, 128] bf16 (head h's row repeated for its G value heads), g [N, HV, 128] fp32,
//   beta [N, HV] bf16; the inverse norms of q, k [N, H] fp32 (saved for the backward);
//   the backward's partial sums of dA_log [nitem, HV] and of ddt_bias [nitem, HV, 128] fp32, nitem = ceil(N / 64):
//   summed over their first axis by the caller (a fixed order: no atomics anywhere).
// A null raw q (k), g or beta turns that activation off; a null A_log or dt_bias is absent from the gate.
#pragma once

#include <cuda_runtime.h>
#include <cstdint>

namespace kda {
namespace act {

constexpr int kHeadDim = 128;
constexpr int kRowsPerItem = 64;  // token rows one warp walks per item: the granularity of the partial sums
constexpr int kWarps = 4;         // warps per CTA (kda_act.cu: more CTAs per SM, a smaller tail)
constexpr float kNormEps = 1e-6f;  // FLA's l2norm epsilon, added to the sum of squares

enum Dtype : int { kBf16 = 0, kF32 = 1 };

// the gate's form: -exp(A_log) softplus(x), lower_bound sigmoid(exp(A_log) x), lower_bound sigmoid(x);
// x = g + dt_bias
enum GateForm : int { kSoftplus = 0, kBoundedRate = 1, kBounded = 2 };

struct Inputs {
  const void* q;  // null: no norm
  const void* k;
  int qk_dtype;
  const void* g;  // null: no gate
  int g_dtype;
  const void* beta;  // null: no beta sigmoid
  int beta_dtype;
  const float* a_log;    // null unless the gate form reads it
  const float* dt_bias;  // null: no bias
  int64_t N;
  int H;
  int HV;
  int gate_form;
  float lower_bound;
  float beta_scale;  // 1, or 2 with allow_neg_eigval
};

struct FwdArgs {
  Inputs in;
  void* qn;  // bf16 [N, HV, 128]
  void* kn;
  float* rq;  // [N, H]
  float* rk;
  float* g_out;    // fp32 [N, HV, 128]
  void* beta_out;  // bf16 [N, HV]
};

struct BwdArgs {
  Inputs in;
  const float* rq;  // the forward's inverse norms
  const float* rk;
  const void* dqn;  // bf16 [N, HV, 128]: the gradient of the activated q
  const void* dkn;
  const float* dg_out;     // fp32 [N, HV, 128]
  const void* dbeta_out;   // bf16 [N, HV]
  void* dq;     // [N, H, 128] in q's dtype
  void* dk;
  void* dg;     // [N, HV, 128] in g's dtype
  void* dbeta;  // [N, HV] in beta's dtype
  float* part_a;   // [nitem, HV] or null (no A_log in the gate)
  float* part_dt;  // [nitem, HV, 128] or null (no dt_bias)
};

__host__ __device__ inline int64_t num_items(int64_t N) { return (N + kRowsPerItem - 1) / kRowsPerItem; }

// CTAs of kWarps warps; warp w of the grid takes item w: (w / H, w % H) of the q/k rows and (w / HV, w % HV) of
// the g / beta rows, i.e. kRowsPerItem consecutive tokens of one head each.
int64_t num_blocks(const Inputs& in);
cudaError_t launch_act_fwd(const FwdArgs& a, cudaStream_t stream);
cudaError_t launch_act_bwd(const BwdArgs& a, cudaStream_t stream);

}  // namespace act
}  // namespace kda
