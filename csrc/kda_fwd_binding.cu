// TVM-FFI entry points of the forward (kda_fwd.cu, kda_affine_merge.cuh). Checks first (they raise Python exceptions), then the
// launch on the caller's current stream. Nothing is allocated here: Python hands in every buffer,
// including the workspace of (chunk, head) records.
#include <tvm/ffi/function.h>

#include "kda_affine_merge_binding.h"
#include "kda_ffi_checks.h"
#include "kda_fwd.h"
#include "kda_status_binding.h"

#include "kda_build_identity.h"
KDA_EXPORT_BUILD_IDENTITY();

namespace {

using namespace kda::ffi_checks;

void check_thd(const TensorView& t, const char* name, int64_t T, int64_t H, int code, int bits, int dev) {
  check_cuda(t, name, dev);
  TVM_FFI_CHECK(t.ndim() == 3 && t.size(0) == T && t.size(1) == H && t.size(2) == kD, ValueError)
      << name << " must be [T, H, 128]";
  TVM_FFI_CHECK(is_dtype(t, code, bits), TypeError)
      << name << (code == kDLFloat ? " must be float32" : " must be bfloat16");
}

void check_ws(const TensorView& ws, int64_t records, int dev) {
  check_cuda(ws, "workspace", dev);
  TVM_FFI_CHECK(is_dtype(ws, kDLUInt, 8) && ws.ndim() == 1, TypeError) << "workspace must be uint8 [n]";
  TVM_FFI_CHECK(ws.size(0) >= records * kda::kFwdRecordBytes, ValueError)
      << "workspace holds " << ws.size(0) << " bytes, needs " << records * kda::kFwdRecordBytes;
}

// Records of the chunks in `chunks` (rows (tok_start, nrows)) into ws, record index chunk * H + head; values outside
// the domain set bits of the status word (kda_status.cuh).
void fwd_prep(TensorView q, TensorView k, TensorView g, TensorView beta, TensorView chunks, TensorView ws,
                 double scale, TensorView status) {
  const int dev = q.device().device_id;
  TVM_FFI_CHECK(q.ndim() == 3, ValueError) << "q must be [T, H, 128]";
  const int64_t T = q.size(0), H = q.size(1);
  check_thd(q, "q", T, H, kDLBfloat, 16, dev);
  check_thd(k, "k", T, H, kDLBfloat, 16, dev);
  check_thd(g, "g", T, H, kDLFloat, 32, dev);
  check_cuda(beta, "beta", dev);
  TVM_FFI_CHECK(beta.ndim() == 2 && beta.size(0) == T && beta.size(1) == H && is_dtype(beta, kDLBfloat, 16),
                ValueError)
      << "beta must be bfloat16 [T, H]";
  check_table(chunks, "chunk table", 2, dev);
  TVM_FFI_CHECK(H >= 1 && H <= 65535, ValueError) << "H must be in [1, 65535]";
  TVM_FFI_CHECK(chunks.size(0) * H <= 0x7fffffff, ValueError)
      << "too many (chunk, head) records for one launch (a 1-D grid)";
  check_ws(ws, chunks.size(0) * H, dev);
  kda::PrepArgs a{};
  a.q = q.data_ptr();
  a.k = k.data_ptr();
  a.g = static_cast<const float*>(g.data_ptr());
  a.beta = beta.data_ptr();
  a.chunks = static_cast<const int32_t*>(chunks.data_ptr());
  a.nchunk = static_cast<int>(chunks.size(0));
  a.H = static_cast<int>(H);
  a.scale = static_cast<float>(scale);
  a.ws = ws.data_ptr();
  a.status = status_word(status, dev);
  raise_on(kda::launch_fwd_prep(a, stream_of(q)), "kda fwd_prep launch");
}

kda::WalkArgs walk_args(const TensorView& v, const TensorView& ws, const TensorView& chunks, const TensorView& segs) {
  const int dev = v.device().device_id;
  TVM_FFI_CHECK(v.ndim() == 3, ValueError) << "v must be [T, H, 128]";
  check_thd(v, "v", v.size(0), v.size(1), kDLBfloat, 16, dev);
  check_table(chunks, "chunk table", 2, dev);
  check_table(segs, "segment table", 8, dev);
  TVM_FFI_CHECK(v.size(1) >= 1 && v.size(1) <= 65535, ValueError) << "H must be in [1, 65535]";  // gridDim.z
  TVM_FFI_CHECK(segs.size(0) <= 0x7fffffff, ValueError) << "segment table longer than 2^31 - 1 rows";
  check_ws(ws, chunks.size(0) * v.size(1), dev);
  kda::WalkArgs a{};
  a.v = v.data_ptr();
  a.ws = ws.data_ptr();
  a.chunks = static_cast<const int32_t*>(chunks.data_ptr());
  a.segs = static_cast<const int32_t*>(segs.data_ptr());
  a.nseg = static_cast<int>(segs.size(0));
  a.H = static_cast<int>(v.size(1));
  return a;
}

// o of the segments in segs (rows (tok_start, ntok, first chunk, idx, kind, chunks, ...)); chunks = the
// chunk table the records of ws were made from; state_in [R,H,K,V] (numel 0 = none); sin [slots,H,K,V]
// (numel 0 = none).
void fwd_walk_output(TensorView v, TensorView ws, TensorView chunks, TensorView segs, TensorView state_in,
                        TensorView sin, TensorView o, int64_t warps) {
  kda::WalkArgs a = walk_args(v, ws, chunks, segs);
  const int dev = v.device().device_id;
  const int64_t H = v.size(1);
  check_thd(o, "o", v.size(0), H, kDLBfloat, 16, dev);
  a.state_in = optional_state(state_in, "state_in", H, dev);
  a.sin = optional_state(sin, "segment states", H, dev);
  a.o = o.data_ptr();
  TVM_FFI_CHECK(warps == 2 || warps == 4 || warps == 8, ValueError) << "warps must be 2, 4 or 8";
  raise_on(kda::launch_fwd_walk_output(a, static_cast<int>(warps), stream_of(v)), "kda fwd_walk_output launch");
}

// Summaries (M, E) from a zero state of the segments in segs (idx = output slot).
void fwd_walk_summary(TensorView v, TensorView ws, TensorView chunks, TensorView segs, TensorView m_out,
                         TensorView e_out, int64_t warps) {
  kda::WalkArgs a = walk_args(v, ws, chunks, segs);
  const int dev = v.device().device_id;
  const int64_t H = v.size(1);
  check_state(m_out, "M", -1, H, dev);
  check_state(e_out, "E", -1, H, dev);
  TVM_FFI_CHECK(m_out.size(0) == e_out.size(0), ValueError) << "M and E must have the same length";
  a.m_out = static_cast<float*>(m_out.data_ptr());
  a.e_out = static_cast<float*>(e_out.data_ptr());
  TVM_FFI_CHECK(warps == 2 || warps == 4 || warps == 8, ValueError) << "warps must be 2, 4 or 8";
  raise_on(kda::launch_fwd_walk_summary(a, static_cast<int>(warps), stream_of(v)),
           "kda fwd_walk_summary launch");
}

int64_t fwd_record_bytes() { return kda::kFwdRecordBytes; }

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(fwd_prep, fwd_prep);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(fwd_walk_output, fwd_walk_output);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(fwd_walk_summary, fwd_walk_summary);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(merge_fold, kda::ffi_checks::merge_fold);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(merge_compose, kda::ffi_checks::merge_compose);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(fwd_record_bytes, fwd_record_bytes);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(status_fill, kda::ffi_checks::status_fill);
