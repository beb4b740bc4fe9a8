// TVM-FFI entry points of the forward kernels. Checks first (they raise Python exceptions), then the
// launch on the caller's current stream. Nothing is allocated here: Python hands in every buffer.
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include "kda_fwd.h"

namespace {

using tvm::ffi::TensorView;

constexpr int kD = 128;

bool is_dtype(const TensorView& t, int code, int bits) {
  return t.dtype().code == code && t.dtype().bits == bits && t.dtype().lanes == 1;
}
constexpr int kFloat = kDLFloat;
constexpr int kBF16 = kDLBfloat;
constexpr int kInt = kDLInt;

void check_cuda(const TensorView& t, const char* name, int dev) {
  TVM_FFI_CHECK(t.device().device_type == kDLCUDA, ValueError) << name << " must be a CUDA tensor";
  TVM_FFI_CHECK(t.device().device_id == dev, ValueError) << name << " is on another device";
  TVM_FFI_CHECK(t.IsContiguous(), ValueError) << name << " must be contiguous";
}

void check_inputs(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& g,
                  const TensorView& beta, const TensorView& segs) {
  const int dev = q.device().device_id;
  check_cuda(q, "q", dev);
  check_cuda(k, "k", dev);
  check_cuda(v, "v", dev);
  check_cuda(g, "g", dev);
  check_cuda(beta, "beta", dev);
  check_cuda(segs, "segment table", dev);
  TVM_FFI_CHECK(q.ndim() == 3 && q.size(2) == kD, ValueError) << "q must be [T, H, 128]";
  const int64_t T = q.size(0), H = q.size(1);
  for (const TensorView* t : {&k, &v, &g}) {
    TVM_FFI_CHECK(t->ndim() == 3 && t->size(0) == T && t->size(1) == H && t->size(2) == kD, ValueError)
        << "k, v, g must be [T, H, 128] like q";
  }
  TVM_FFI_CHECK(beta.ndim() == 2 && beta.size(0) == T && beta.size(1) == H, ValueError) << "beta must be [T, H]";
  TVM_FFI_CHECK(is_dtype(q, kBF16, 16) && is_dtype(k, kBF16, 16) && is_dtype(v, kBF16, 16), TypeError)
      << "q, k, v must be bfloat16";
  TVM_FFI_CHECK(is_dtype(g, kFloat, 32), TypeError) << "g must be float32";
  TVM_FFI_CHECK(is_dtype(beta, kBF16, 16), TypeError) << "beta must be bfloat16";
  TVM_FFI_CHECK(segs.ndim() == 2 && segs.size(1) == 4 && is_dtype(segs, kInt, 32), ValueError)
      << "segment table must be int32 [n, 4]";
  TVM_FFI_CHECK(H <= 65535 && segs.size(0) <= 2147483647, ValueError) << "too many heads or segments";
}

void check_state(const TensorView& s, const char* name, int64_t H, int dev) {
  check_cuda(s, name, dev);
  TVM_FFI_CHECK(is_dtype(s, kFloat, 32), TypeError) << name << " must be float32";
  TVM_FFI_CHECK(s.ndim() == 4 && s.size(1) == H && s.size(2) == kD && s.size(3) == kD, ValueError)
      << name << " must be [n, H, 128, 128]";
}

kda::ChunkArgs make_args(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& g,
                         const TensorView& beta, const TensorView& segs, double scale) {
  kda::ChunkArgs a{};
  a.q = q.data_ptr();
  a.k = k.data_ptr();
  a.v = v.data_ptr();
  a.g = static_cast<const float*>(g.data_ptr());
  a.beta = beta.data_ptr();
  a.segs = static_cast<const int32_t*>(segs.data_ptr());
  a.nseg = static_cast<int>(segs.size(0));
  a.H = static_cast<int>(q.size(1));
  a.scale = static_cast<float>(scale);
  return a;
}

cudaStream_t stream_of(const TensorView& t) {
  return static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, t.device().device_id));
}

void raise_on(cudaError_t err, const char* what) {
  TVM_FFI_CHECK(err == cudaSuccess, RuntimeError) << what << ": " << cudaGetErrorString(err);
}

// o = forward output; segs rows (tok_start, ntok, idx, kind); state_in [R,H,K,V] (numel 0 = none);
// sin [slots,H,K,V] (numel 0 when no segment reads it).
void fwd_output(TensorView q, TensorView k, TensorView v, TensorView g, TensorView beta, TensorView segs,
                TensorView state_in, TensorView sin, TensorView o, double scale) {
  check_inputs(q, k, v, g, beta, segs);
  const int dev = q.device().device_id;
  const int64_t H = q.size(1);
  check_cuda(o, "o", dev);
  TVM_FFI_CHECK(is_dtype(o, kBF16, 16) && o.ndim() == 3 && o.size(0) == q.size(0) && o.size(1) == H &&
                    o.size(2) == kD,
                ValueError)
      << "o must be bfloat16 [T, H, 128]";
  kda::ChunkArgs a = make_args(q, k, v, g, beta, segs, scale);
  a.o = o.data_ptr();
  if (state_in.numel() > 0) {
    check_state(state_in, "state_in", H, dev);
    a.state_in = static_cast<const float*>(state_in.data_ptr());
  }
  if (sin.numel() > 0) {
    check_state(sin, "segment states", H, dev);
    a.sin = static_cast<const float*>(sin.data_ptr());
  }
  raise_on(kda::launch_fwd_output(a, stream_of(q)), "kda fwd_output launch");
}

// Summaries (M, E) of the segments in segs (rows (tok_start, ntok, out_index, 0)) from a zero state.
void fwd_summary(TensorView q, TensorView k, TensorView v, TensorView g, TensorView beta, TensorView segs,
                 TensorView m_out, TensorView e_out, double scale) {
  check_inputs(q, k, v, g, beta, segs);
  const int dev = q.device().device_id;
  const int64_t H = q.size(1);
  check_state(m_out, "M", H, dev);
  check_state(e_out, "E", H, dev);
  TVM_FFI_CHECK(m_out.size(0) == e_out.size(0), ValueError) << "M and E must have the same length";
  kda::ChunkArgs a = make_args(q, k, v, g, beta, segs, scale);
  a.m_out = static_cast<float*>(m_out.data_ptr());
  a.e_out = static_cast<float*>(e_out.data_ptr());
  raise_on(kda::launch_fwd_summary(a, stream_of(q)), "kda fwd_summary launch");
}

kda::MergeArgs merge_args(const TensorView& m, const TensorView& e, const TensorView& chains) {
  const int dev = m.device().device_id;
  const int64_t H = m.size(1);
  check_state(m, "M", H, dev);
  check_state(e, "E", H, dev);
  check_cuda(chains, "chains", dev);
  TVM_FFI_CHECK(chains.ndim() == 2 && chains.size(1) == 4 && is_dtype(chains, kInt, 32), ValueError)
      << "chain table must be int32 [n, 4]";
  kda::MergeArgs a{};
  a.m = static_cast<const float*>(m.data_ptr());
  a.e = static_cast<const float*>(e.data_ptr());
  a.chains = static_cast<const int32_t*>(chains.data_ptr());
  a.nchain = static_cast<int>(chains.size(0));
  a.H = static_cast<int>(H);
  return a;
}

// S_in of each later segment: fold (M, E) along chains (first, count, init run or -1, out) into sin_out.
void merge_fold(TensorView m, TensorView e, TensorView chains, TensorView state_in, TensorView sin_out) {
  kda::MergeArgs a = merge_args(m, e, chains);
  const int dev = m.device().device_id;
  check_state(sin_out, "segment states", a.H, dev);
  a.out0 = static_cast<float*>(sin_out.data_ptr());
  if (state_in.numel() > 0) {
    check_state(state_in, "state_in", a.H, dev);
    a.state_in = static_cast<const float*>(state_in.data_ptr());
  }
  raise_on(kda::launch_merge_fold(a, stream_of(m)), "kda merge_fold launch");
}

// Whole-chain summaries: M_out[out] = M_last ... M_first, E_out[out] the composed offset.
void merge_compose(TensorView m, TensorView e, TensorView chains, TensorView m_out, TensorView e_out) {
  kda::MergeArgs a = merge_args(m, e, chains);
  const int dev = m.device().device_id;
  check_state(m_out, "M_out", a.H, dev);
  check_state(e_out, "E_out", a.H, dev);
  a.out0 = static_cast<float*>(m_out.data_ptr());
  a.out1 = static_cast<float*>(e_out.data_ptr());
  raise_on(kda::launch_merge_compose(a, stream_of(m)), "kda merge_compose launch");
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(fwd_output, fwd_output);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(fwd_summary, fwd_summary);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(merge_fold, merge_fold);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(merge_compose, merge_compose);
