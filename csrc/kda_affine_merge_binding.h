// TVM-FFI entry points of the FP32 affine merge (kda_affine_merge.cuh), exported by both programs:
// each binding file exports them with TVM_FFI_DLL_EXPORT_TYPED_FUNC. Checks first, then the launch on
// the caller's current stream; nothing is allocated.
#pragma once

#include "kda_affine_merge.cuh"
#include "kda_ffi_checks.h"

namespace kda {
namespace ffi_checks {

// Summaries M [n, H, 128, 128], E of the same shape, chains int32 [c, 4].
inline MergeArgs merge_args(const TensorView& m, const TensorView& e, const TensorView& chains) {
  const int dev = m.device().device_id;
  TVM_FFI_CHECK(m.ndim() == 4, ValueError) << "M must be [n, H, 128, 128]";
  const int64_t H = m.size(1);
  check_state(m, "M", -1, H, dev);
  check_state(e, "E", m.size(0), H, dev);
  check_table(chains, "chain table", 4, dev);
  MergeArgs a{};
  a.m = static_cast<const float*>(m.data_ptr());
  a.e = static_cast<const float*>(e.data_ptr());
  a.chains = static_cast<const int32_t*>(chains.data_ptr());
  a.nchain = static_cast<int>(chains.size(0));
  a.H = static_cast<int>(H);
  return a;
}

// Fold (M, E) along chains (first, count, init row or -1, out) from init (numel 0 = zero) into out,
// every step written. The backward folds (M^T, F) from dstate_out the same way.
inline void merge_fold(TensorView m, TensorView e, TensorView chains, TensorView init, TensorView out) {
  MergeArgs a = merge_args(m, e, chains);
  const int dev = m.device().device_id;
  check_state(out, "fold output", -1, a.H, dev);
  a.out0 = static_cast<float*>(out.data_ptr());
  a.init = optional_state(init, "initial states", a.H, dev);
  raise_on(launch_merge_fold(a, stream_of(m)), "kda merge_fold launch");
}

// Whole-chain summaries: M_out[out] = M_last ... M_first, E_out[out] the composed offset.
inline void merge_compose(TensorView m, TensorView e, TensorView chains, TensorView m_out, TensorView e_out) {
  MergeArgs a = merge_args(m, e, chains);
  const int dev = m.device().device_id;
  check_state(m_out, "M_out", -1, a.H, dev);
  check_state(e_out, "E_out", m_out.size(0), a.H, dev);
  a.out0 = static_cast<float*>(m_out.data_ptr());
  a.out1 = static_cast<float*>(e_out.data_ptr());
  raise_on(launch_merge_compose(a, stream_of(m)), "kda merge_compose launch");
}

}  // namespace ffi_checks
}  // namespace kda
