// C entry points of the emulated fused activations (csrc/kda_act.cu) for ctypes (tests/test_activations_emulation.py),
// filling kda::act's argument structs as csrc/kda_act_binding.cu does (checks aside). Null pointers: absent.
#include "kda_act.h"
using namespace kda::act;

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
}
