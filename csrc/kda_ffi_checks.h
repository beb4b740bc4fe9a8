// Host-side tensor checks shared by the TVM-FFI wrappers of the forward and the backward
// (kda_fwd_binding.cu, kda_bwd_binding.cu). A failed check raises a Python exception.
#pragma once

#include <cuda_runtime.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>

#include <cstdint>

namespace kda {
namespace ffi_checks {

using tvm::ffi::TensorView;

constexpr int kD = 128;  // head dim (K = V)

inline bool is_dtype(const TensorView& t, int code, int bits) {
  return t.dtype().code == code && t.dtype().bits == bits && t.dtype().lanes == 1;
}

inline void check_cuda(const TensorView& t, const char* name, int dev) {
  TVM_FFI_CHECK(t.device().device_type == kDLCUDA, ValueError) << name << " must be a CUDA tensor";
  TVM_FFI_CHECK(t.device().device_id == dev, ValueError) << name << " is on another device";
  TVM_FFI_CHECK(t.IsContiguous(), ValueError) << name << " must be contiguous";
}

// int32 [n, cols]
inline void check_table(const TensorView& t, const char* name, int cols, int dev) {
  check_cuda(t, name, dev);
  TVM_FFI_CHECK(t.ndim() == 2 && t.size(1) == cols && is_dtype(t, kDLInt, 32), ValueError)
      << name << " must be int32 [n, " << cols << "]";
}

// fp32 [n, H, 128, 128]; n < 0: any n
inline void check_state(const TensorView& s, const char* name, int64_t n, int64_t H, int dev) {
  check_cuda(s, name, dev);
  TVM_FFI_CHECK(is_dtype(s, kDLFloat, 32), TypeError) << name << " must be float32";
  TVM_FFI_CHECK(s.ndim() == 4 && (n < 0 || s.size(0) == n) && s.size(1) == H && s.size(2) == kD && s.size(3) == kD,
                ValueError)
      << name << " must be [n, H, 128, 128]";
}

// An optional state input: numel 0 stands for none (null), else checked as [n, H, 128, 128].
inline const float* optional_state(const TensorView& s, const char* name, int64_t H, int dev) {
  if (s.numel() == 0) return nullptr;
  check_state(s, name, -1, H, dev);
  return static_cast<const float*>(s.data_ptr());
}

inline cudaStream_t stream_of(const TensorView& t) {
  return static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, t.device().device_id));
}

inline void raise_on(cudaError_t err, const char* what) {
  TVM_FFI_CHECK(err == cudaSuccess, RuntimeError) << what << ": " << cudaGetErrorString(err);
}

}  // namespace ffi_checks
}  // namespace kda
