// TVM-FFI entry points of the fused activations (kda_act.cu). Checks first (they raise Python exceptions), then the
// launch on the caller's current stream. Nothing is allocated here: Python hands in every buffer. An absent tensor
// is one of numel 0 (an activation that is off, a gate without A_log or dt_bias).
#include <tvm/ffi/function.h>

#include <utility>

#include "kda_act.h"
#include "kda_ffi_checks.h"

#include "kda_build_identity.h"
KDA_EXPORT_BUILD_IDENTITY();

namespace {

using namespace kda::ffi_checks;
namespace A = kda::act;

bool present(const TensorView& t) { return t.numel() != 0; }

// shape [d0, d1] or [d0, d1, 128]
void check_shape(const TensorView& t, const char* name, int64_t d0, int64_t d1, bool rows, int dev) {
  check_cuda(t, name, dev);
  const bool ok = rows ? t.ndim() == 3 && t.size(0) == d0 && t.size(1) == d1 && t.size(2) == kD
                       : t.ndim() == 2 && t.size(0) == d0 && t.size(1) == d1;
  TVM_FFI_CHECK(ok, ValueError) << name << " must be [" << d0 << ", " << d1 << (rows ? ", 128]" : "]");
}

void check_typed(const TensorView& t, const char* name, int code, int bits) {
  TVM_FFI_CHECK(is_dtype(t, code, bits), TypeError)
      << name << (code == kDLFloat ? " must be float32" : " must be bfloat16");
}

// bf16 or fp32 (kda_act.h Dtype)
int raw_dtype(const TensorView& t, const char* name) {
  TVM_FFI_CHECK(is_dtype(t, kDLBfloat, 16) || is_dtype(t, kDLFloat, 32), TypeError)
      << name << " must be bfloat16 or float32";
  return is_dtype(t, kDLFloat, 32) ? A::kF32 : A::kBf16;
}

// The raw inputs and options, checked: q, k [N, H, 128], g [N, HV, 128], beta [N, HV] (absent: off),
// A_log [HV] and dt_bias [HV, 128] fp32 (absent: not in the gate). gate_form: kda_act.h GateForm.
A::Inputs inputs(const TensorView& q, const TensorView& k, const TensorView& g, const TensorView& beta,
                 const TensorView& a_log, const TensorView& dt_bias, int64_t N, int64_t H, int64_t HV,
                 int64_t gate_form, double lower_bound, double beta_scale, int dev) {
  TVM_FFI_CHECK(N >= 0 && H >= 1 && HV >= H && HV % H == 0 && HV <= 65535, ValueError)
      << "need N >= 0 and 1 <= H <= HV <= 65535 with HV a multiple of H";
  TVM_FFI_CHECK(A::num_items(N) * HV <= 0x7fffffffLL * A::kWarps, ValueError)
      << "too many (64-token, head) items for one launch (a 1-D grid)";
  TVM_FFI_CHECK(present(q) || present(g) || present(beta), ValueError) << "no activation is asked for";
  A::Inputs in{};
  in.N = N;
  in.H = static_cast<int>(H);
  in.HV = static_cast<int>(HV);
  TVM_FFI_CHECK(present(q) == present(k), ValueError) << "q and k are both given or both absent";
  if (present(q)) {
    check_shape(q, "q", N, H, true, dev);
    check_shape(k, "k", N, H, true, dev);
    in.qk_dtype = raw_dtype(q, "q");
    TVM_FFI_CHECK(raw_dtype(k, "k") == in.qk_dtype, TypeError) << "k must have q's dtype";
    in.q = q.data_ptr();
    in.k = k.data_ptr();
  }
  if (present(g)) {
    check_shape(g, "g", N, HV, true, dev);
    in.g_dtype = raw_dtype(g, "g");
    in.g = g.data_ptr();
    TVM_FFI_CHECK(gate_form >= A::kSoftplus && gate_form <= A::kBounded, ValueError) << "unknown gate form";
    in.gate_form = static_cast<int>(gate_form);
    in.lower_bound = static_cast<float>(lower_bound);
    TVM_FFI_CHECK(present(a_log) == (gate_form != A::kBounded), ValueError)
        << "A_log is given exactly when the gate form reads it";
    if (present(a_log)) {
      check_cuda(a_log, "A_log", dev);
      check_typed(a_log, "A_log", kDLFloat, 32);
      TVM_FFI_CHECK(a_log.numel() == HV, ValueError) << "A_log must hold HV = " << HV << " values";
      in.a_log = static_cast<const float*>(a_log.data_ptr());
    }
    if (present(dt_bias)) {
      check_cuda(dt_bias, "dt_bias", dev);
      check_typed(dt_bias, "dt_bias", kDLFloat, 32);
      TVM_FFI_CHECK(dt_bias.numel() == HV * kD, ValueError) << "dt_bias must hold HV * 128 = " << HV * kD << " values";
      in.dt_bias = static_cast<const float*>(dt_bias.data_ptr());
    }
  } else {
    TVM_FFI_CHECK(!present(a_log) && !present(dt_bias), ValueError) << "A_log and dt_bias need g";
  }
  if (present(beta)) {
    check_shape(beta, "beta", N, HV, false, dev);
    in.beta_dtype = raw_dtype(beta, "beta");
    in.beta = beta.data_ptr();
    TVM_FFI_CHECK(beta_scale == 1.0 || beta_scale == 2.0, ValueError) << "beta_scale must be 1 or 2";
    in.beta_scale = static_cast<float>(beta_scale);
  }
  return in;
}

int device_of(const TensorView& q, const TensorView& g, const TensorView& beta) {
  const TensorView& t = present(q) ? q : present(g) ? g : beta;
  return t.device().device_id;
}

// Outputs: qn, kn bf16 [N, HV, 128] and rq, rk fp32 [N, H] with q; g_out fp32 [N, HV, 128] with g; beta_out bf16
// [N, HV] with beta (absent otherwise).
void act_fwd(TensorView q, TensorView k, TensorView g, TensorView beta, TensorView a_log, TensorView dt_bias,
             TensorView qn, TensorView kn, TensorView rq, TensorView rk, TensorView g_out, TensorView beta_out,
             int64_t N, int64_t H, int64_t HV, int64_t gate_form, double lower_bound, double beta_scale) {
  const int dev = device_of(q, g, beta);
  A::FwdArgs a{};
  a.in = inputs(q, k, g, beta, a_log, dt_bias, N, H, HV, gate_form, lower_bound, beta_scale, dev);
  if (a.in.q != nullptr) {
    for (auto [t, name] : {std::pair{&qn, "qn"}, std::pair{&kn, "kn"}}) {
      check_shape(*t, name, N, HV, true, dev);
      check_typed(*t, name, kDLBfloat, 16);
    }
    for (auto [t, name] : {std::pair{&rq, "rq"}, std::pair{&rk, "rk"}}) {
      check_shape(*t, name, N, H, false, dev);
      check_typed(*t, name, kDLFloat, 32);
    }
    a.qn = qn.data_ptr();
    a.kn = kn.data_ptr();
    a.rq = static_cast<float*>(rq.data_ptr());
    a.rk = static_cast<float*>(rk.data_ptr());
  }
  if (a.in.g != nullptr) {
    check_shape(g_out, "g_out", N, HV, true, dev);
    check_typed(g_out, "g_out", kDLFloat, 32);
    a.g_out = static_cast<float*>(g_out.data_ptr());
  }
  if (a.in.beta != nullptr) {
    check_shape(beta_out, "beta_out", N, HV, false, dev);
    check_typed(beta_out, "beta_out", kDLBfloat, 16);
    a.beta_out = beta_out.data_ptr();
  }
  const TensorView& any = present(q) ? q : present(g) ? g : beta;
  raise_on(A::launch_act_fwd(a, stream_of(any)), "kda act_fwd launch");
}

// Gradients of the activated tensors in (dqn, dkn bf16 [N, HV, 128], dg_out fp32 [N, HV, 128], dbeta_out bf16
// [N, HV]), of the raw ones out (dq, dk, dg, dbeta in the raw inputs' dtypes and shapes); part_a [ceil(N / 64), HV]
// with A_log and part_dt [ceil(N / 64), HV, 128] with dt_bias, fp32: the per-item partial sums.
void act_bwd(TensorView q, TensorView k, TensorView g, TensorView beta, TensorView a_log, TensorView dt_bias,
             TensorView rq, TensorView rk, TensorView dqn, TensorView dkn, TensorView dg_out, TensorView dbeta_out,
             TensorView dq, TensorView dk, TensorView dg, TensorView dbeta, TensorView part_a, TensorView part_dt,
             int64_t N, int64_t H, int64_t HV, int64_t gate_form, double lower_bound, double beta_scale) {
  const int dev = device_of(q, g, beta);
  A::BwdArgs a{};
  a.in = inputs(q, k, g, beta, a_log, dt_bias, N, H, HV, gate_form, lower_bound, beta_scale, dev);
  const int64_t items = A::num_items(N);
  if (a.in.q != nullptr) {
    for (auto [t, name] : {std::pair{&rq, "rq"}, std::pair{&rk, "rk"}}) {
      check_shape(*t, name, N, H, false, dev);
      check_typed(*t, name, kDLFloat, 32);
    }
    for (auto [t, name] : {std::pair{&dqn, "dqn"}, std::pair{&dkn, "dkn"}}) {
      check_shape(*t, name, N, HV, true, dev);
      check_typed(*t, name, kDLBfloat, 16);
    }
    for (auto [t, name] : {std::pair{&dq, "dq"}, std::pair{&dk, "dk"}}) {
      check_shape(*t, name, N, H, true, dev);
      TVM_FFI_CHECK(raw_dtype(*t, name) == a.in.qk_dtype, TypeError) << name << " must have q's dtype";
    }
    a.rq = static_cast<const float*>(rq.data_ptr());
    a.rk = static_cast<const float*>(rk.data_ptr());
    a.dqn = dqn.data_ptr();
    a.dkn = dkn.data_ptr();
    a.dq = dq.data_ptr();
    a.dk = dk.data_ptr();
  }
  if (a.in.g != nullptr) {
    check_shape(dg_out, "dg_out", N, HV, true, dev);
    check_typed(dg_out, "dg_out", kDLFloat, 32);
    check_shape(dg, "dg", N, HV, true, dev);
    TVM_FFI_CHECK(raw_dtype(dg, "dg") == a.in.g_dtype, TypeError) << "dg must have g's dtype";
    a.dg_out = static_cast<const float*>(dg_out.data_ptr());
    a.dg = dg.data_ptr();
    TVM_FFI_CHECK(present(part_a) == (a.in.a_log != nullptr) && present(part_dt) == (a.in.dt_bias != nullptr),
                  ValueError)
        << "the partial sums are given exactly for A_log and dt_bias";
    if (present(part_a)) {
      check_shape(part_a, "part_a", items, HV, false, dev);
      check_typed(part_a, "part_a", kDLFloat, 32);
      a.part_a = static_cast<float*>(part_a.data_ptr());
    }
    if (present(part_dt)) {
      check_shape(part_dt, "part_dt", items, HV, true, dev);
      check_typed(part_dt, "part_dt", kDLFloat, 32);
      a.part_dt = static_cast<float*>(part_dt.data_ptr());
    }
  }
  if (a.in.beta != nullptr) {
    check_shape(dbeta_out, "dbeta_out", N, HV, false, dev);
    check_typed(dbeta_out, "dbeta_out", kDLBfloat, 16);
    check_shape(dbeta, "dbeta", N, HV, false, dev);
    TVM_FFI_CHECK(raw_dtype(dbeta, "dbeta") == a.in.beta_dtype, TypeError) << "dbeta must have beta's dtype";
    a.dbeta_out = dbeta_out.data_ptr();
    a.dbeta = dbeta.data_ptr();
  }
  const TensorView& any = present(q) ? q : present(g) ? g : beta;
  raise_on(A::launch_act_bwd(a, stream_of(any)), "kda act_bwd launch");
}

int64_t act_rows_per_item() { return A::kRowsPerItem; }

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(act_fwd, act_fwd);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(act_bwd, act_bwd);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(act_rows_per_item, act_rows_per_item);
