// TVM-FFI side of the value-domain status word (kda_status.cuh), shared by both programs: the check of the word the
// preps take, and status_fill (exported by each binding file), which sets a call's outputs to NaN on the caller's
// current stream when the word is nonzero.
#pragma once

#include "kda_ffi_checks.h"
#include "kda_status.cuh"

namespace kda {
namespace ffi_checks {

// the status word: int32 [1] on the device of the call
inline int* status_word(const TensorView& s, int dev) {
  check_cuda(s, "status word", dev);
  TVM_FFI_CHECK(is_dtype(s, kDLInt, 32) && s.ndim() == 1 && s.size(0) == 1, ValueError)
      << "status word must be int32 [1]";
  return static_cast<int*>(s.data_ptr());
}

// Every element of t0 .. t4 (bf16 or fp32, contiguous; numel 0: none) set to NaN if the word is nonzero, else
// nothing written (one small launch either way).
inline void status_fill(TensorView word, TensorView t0, TensorView t1, TensorView t2, TensorView t3, TensorView t4) {
  const int dev = word.device().device_id;
  namespace S = kda::status;
  S::FillArgs a{};
  a.word = status_word(word, dev);
  const TensorView* ts[S::kFillSlots] = {&t0, &t1, &t2, &t3, &t4};
  int64_t most = 0;
  for (int s = 0; s < S::kFillSlots; ++s) {
    const TensorView& t = *ts[s];
    if (t.numel() == 0) continue;
    check_cuda(t, "status_fill output", dev);
    TVM_FFI_CHECK(is_dtype(t, kDLBfloat, 16) || is_dtype(t, kDLFloat, 32), TypeError)
        << "status_fill outputs must be bfloat16 or float32";
    a.ptr[s] = t.data_ptr();
    a.n[s] = t.numel();
    a.bytes[s] = t.dtype().bits / 8;
    most = a.n[s] > most ? a.n[s] : most;
  }
  if (most == 0) return;
  S::fill_nan_kernel<S::kFillSlots><<<S::fill_blocks(most), S::kFillThreads, 0, stream_of(word)>>>(a);
  raise_on(cudaGetLastError(), "kda status_fill launch");
}

}  // namespace ffi_checks
}  // namespace kda
