// TVM-FFI side of the value-domain status word (kda_status.cuh), shared by both programs: the check of the word the
// preps take, and status_fill (exported by each binding file), which sets a call's outputs to NaN on the caller's
// current stream when the word is nonzero and stores the word into a mapped pinned host slot.
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

// The device address of the host slot `report` (int32 [1] in pinned host memory; numel 0: none). Pinned memory is
// mapped into the device's address space under unified addressing; memory that is not raises ValueError, which
// kda_kcp/status.py answers by copying the word instead.
inline int* status_report(const TensorView& report) {
  if (report.numel() == 0) return nullptr;
  const int kind = report.device().device_type;
  TVM_FFI_CHECK(kind == kDLCPU || kind == kDLCUDAHost, ValueError)
      << "status report slot must be pinned host memory";
  TVM_FFI_CHECK(is_dtype(report, kDLInt, 32) && report.ndim() == 1 && report.size(0) == 1, ValueError)
      << "status report slot must be int32 [1]";
  void* device_address = nullptr;
  if (cudaHostGetDevicePointer(&device_address, report.data_ptr(), 0) != cudaSuccess) {
    (void)cudaGetLastError();  // not a sticky error: clear it for the caller's next launch
    TVM_FFI_THROW(ValueError) << "status report slot is not mapped pinned host memory";
  }
  return static_cast<int*>(device_address);
}

// Every element of t0 .. t4 (bf16 or fp32, contiguous; numel 0: none) set to NaN if the word is nonzero, else
// nothing written; the word stored into the host slot `report` (numel 0: none). One small launch unless there is
// neither an output nor a slot.
inline void status_fill(TensorView word, TensorView report, TensorView t0, TensorView t1, TensorView t2, TensorView t3,
                        TensorView t4) {
  const int dev = word.device().device_id;
  namespace S = kda::status;
  S::FillArgs a{};
  a.word = status_word(word, dev);
  a.report = status_report(report);
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
  if (most == 0 && a.report == nullptr) return;
  S::fill_nan_kernel<S::kFillSlots><<<S::fill_blocks(most), S::kFillThreads, 0, stream_of(word)>>>(a);
  raise_on(cudaGetLastError(), "kda status_fill launch");
}

}  // namespace ffi_checks
}  // namespace kda
