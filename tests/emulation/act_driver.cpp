// C entry points of the emulated fused activations (csrc/kda_act.cu) for ctypes (tests/test_activations_emulation.py),
// filling kda::act's argument structs as csrc/kda_act_binding.cu does (checks aside). Null pointers: absent. Also one
// warp's warp_sum_rows beside warp_sum on the same partials (csrc/kda_warp_rows.cuh).
#include "kda_act.h"
#include "kda_warp_rows.cuh"
using namespace kda::act;

struct WarpSumArgs {
  const float* p;  // [R, 32]: row r's partial on lane l at p[32 r + l]
  float* rows;     // [R, 32]: warp_sum_rows' sum of row r as lane l has it
  float* own;      // [32]: what warp_sum_rows returns on lane l (its own row's sum)
  float* single;   // [R, 32]: warp_sum of row r on lane l
};
template <int R>
void warp_sums_kernel(const WarpSumArgs a) {
  const int l = static_cast<int>(threadIdx.x);
  float p[R];
  for (int r = 0; r < R; ++r) p[r] = a.p[32 * r + l];
  a.own[l] = warp_sum_rows(p, [](float v) { return v; });
  for (int r = 0; r < R; ++r) {
    a.rows[32 * r + l] = p[r];
    a.single[32 * r + l] = warp_sum(a.p[32 * r + l]);
  }
}

static Inputs act_inputs(const void* q, const void* k, int qk_dtype, const void* g, int g_dtype, const void* beta,
                         int beta_dtype, const float* a_log, const float* dt_bias, int64_t N, int H, int HV,
                         int gate_form, float lower_bound, float beta_scale) {
  Inputs in{};
  in.q = q; in.k = k; in.qk_dtype = qk_dtype; in.g = g; in.g_dtype = g_dtype; in.beta = beta; in.beta_dtype = beta_dtype;
  in.a_log = a_log; in.dt_bias = dt_bias; in.N = N; in.H = H; in.HV = HV; in.gate_form = gate_form;
  in.lower_bound = lower_bound; in.beta_scale = beta_scale;
  return in;
}

extern "C" {
int e_act_fwd(const void* q, const void* k, int qk_dtype, const void* g, int g_dtype, const void* beta, int beta_dtype,
              const float* a_log, const float* dt_bias, int64_t N, int H, int HV, int gate_form, float lower_bound,
              float beta_scale, void* qn, void* kn, float* rq, float* rk, float* g_out, void* beta_out) {
  FwdArgs a{};
  a.in = act_inputs(q, k, qk_dtype, g, g_dtype, beta, beta_dtype, a_log, dt_bias, N, H, HV, gate_form, lower_bound,
                    beta_scale);
  a.qn = qn; a.kn = kn; a.rq = rq; a.rk = rk; a.g_out = g_out; a.beta_out = beta_out;
  return launch_act_fwd(a, nullptr);
}
int e_act_bwd(const void* q, const void* k, int qk_dtype, const void* g, int g_dtype, const void* beta, int beta_dtype,
              const float* a_log, const float* dt_bias, int64_t N, int H, int HV, int gate_form, float lower_bound,
              float beta_scale, const float* rq, const float* rk, const void* dqn, const void* dkn,
              const float* dg_out, const void* dbeta_out, void* dq, void* dk, void* dg, void* dbeta, float* part_a,
              float* part_dt) {
  BwdArgs a{};
  a.in = act_inputs(q, k, qk_dtype, g, g_dtype, beta, beta_dtype, a_log, dt_bias, N, H, HV, gate_form, lower_bound,
                    beta_scale);
  a.rq = rq; a.rk = rk; a.dqn = dqn; a.dkn = dkn; a.dg_out = dg_out; a.dbeta_out = dbeta_out;
  a.dq = dq; a.dk = dk; a.dg = dg; a.dbeta = dbeta; a.part_a = part_a; a.part_dt = part_dt;
  return launch_act_bwd(a, nullptr);
}
int e_act_rows_per_item() { return kRowsPerItem; }
int e_warp_sums(const float* p, int R, float* rows, float* own, float* single) {
  const WarpSumArgs a{p, rows, own, single};
  switch (R) {
    case 1: emu_launch(warp_sums_kernel<1>, dim3(1), 32, 0, nullptr, a); break;
    case 2: emu_launch(warp_sums_kernel<2>, dim3(1), 32, 0, nullptr, a); break;
    case 4: emu_launch(warp_sums_kernel<4>, dim3(1), 32, 0, nullptr, a); break;
    case 8: emu_launch(warp_sums_kernel<8>, dim3(1), 32, 0, nullptr, a); break;
    case 16: emu_launch(warp_sums_kernel<16>, dim3(1), 32, 0, nullptr, a); break;
    case 32: emu_launch(warp_sums_kernel<32>, dim3(1), 32, 0, nullptr, a); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}
}
