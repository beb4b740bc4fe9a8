// TVM-FFI entry points of the backward kernels (kda_bwd.cu). Checks first (they raise Python
// exceptions), then the launch on the caller's current stream. Nothing is allocated here: Python hands
// in every buffer (the prep workspace, h, dh and the gradients).
#include <tvm/ffi/function.h>

#include "kda_bwd.h"
#include "kda_affine_merge_binding.h"
#include "kda_ffi_checks.h"
#include "kda_status_binding.h"

#include "kda_build_identity.h"
KDA_EXPORT_BUILD_IDENTITY();

namespace {

using namespace kda::ffi_checks;
namespace B = kda::bwd;

void check_tok(const TensorView& t, const char* name, int64_t T, int64_t H, int code, int bits, int dev) {
  check_cuda(t, name, dev);
  TVM_FFI_CHECK(is_dtype(t, code, bits), TypeError) << name << " has the wrong dtype";
  TVM_FFI_CHECK(t.ndim() == 3 && t.size(0) == T && t.size(1) == H && t.size(2) == kD, ValueError)
      << name << " must be [T, H, 128]";
}

void check_beta(const TensorView& t, const char* name, int64_t T, int64_t H, int dev) {
  check_cuda(t, name, dev);
  TVM_FFI_CHECK(is_dtype(t, kDLBfloat, 16), TypeError) << name << " must be bfloat16";
  TVM_FFI_CHECK(t.ndim() == 2 && t.size(0) == T && t.size(1) == H, ValueError) << name << " must be [T, H]";
}

void check_prep(const TensorView& p, int64_t nchunks, int64_t H, int dev) {
  check_cuda(p, "prep workspace", dev);
  TVM_FFI_CHECK(is_dtype(p, kDLUInt, 8) && p.ndim() == 1, TypeError) << "prep workspace must be uint8 [n]";
  TVM_FFI_CHECK(p.size(0) >= nchunks * H * static_cast<int64_t>(B::kPrepBytes), ValueError)
      << "prep workspace too small: need " << nchunks * H * static_cast<int64_t>(B::kPrepBytes) << " bytes";
}

// q, k, v bf16 and g fp32 [T, H, 128], beta bf16 [T, H]
void check_chunk_inputs(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& g,
                        const TensorView& beta, int64_t T, int64_t H, int dev) {
  check_tok(q, "q", T, H, kDLBfloat, 16, dev);
  check_tok(k, "k", T, H, kDLBfloat, 16, dev);
  check_tok(v, "v", T, H, kDLBfloat, 16, dev);
  check_tok(g, "g", T, H, kDLFloat, 32, dev);
  check_beta(beta, "beta", T, H, dev);
}

B::Args base_args(const TensorView& chunks, const TensorView& runs, int64_t H, TensorView prep) {
  B::Args a{};
  a.chunks = static_cast<const int32_t*>(chunks.data_ptr());
  a.nchunks = static_cast<int>(chunks.size(0));
  a.runs = static_cast<const int32_t*>(runs.data_ptr());
  a.nruns = static_cast<int>(runs.size(0));
  a.H = static_cast<int>(H);
  a.prep = static_cast<char*>(prep.data_ptr());
  return a;
}

// h: bf16 [Nc, H, 128, 128], the state as hi only; dh: uint8 [Nc, H, kDhStateBytes], the state gradient as fp16 at a
// power of two per walk warp, with the powers (kda_bwd.h)
char* check_walk_state(const TensorView& t, const char* name, int64_t nchunks, int64_t H, bool scaled, int dev) {
  check_cuda(t, name, dev);
  if (scaled) {
    TVM_FFI_CHECK(is_dtype(t, kDLUInt, 8), TypeError) << name << " must be uint8";
    TVM_FFI_CHECK(t.ndim() == 3 && t.size(0) == nchunks && t.size(1) == H && t.size(2) == B::kDhStateBytes, ValueError)
        << name << " must be [Nc, H, " << B::kDhStateBytes << "]";
  } else {
    TVM_FFI_CHECK(is_dtype(t, kDLBfloat, 16), TypeError) << name << " must be bfloat16";
    TVM_FFI_CHECK(t.ndim() == 4 && t.size(0) == nchunks && t.size(1) == H && t.size(2) == kD && t.size(3) == kD, ValueError)
        << name << " must be [Nc, H, 128, 128]";
  }
  return static_cast<char*>(t.data_ptr());
}

// warps per walk or summary CTA: 4 (64 state columns) or 8 (128)
void check_walk_warps(int64_t warps) {
  TVM_FFI_CHECK(warps == 4 || warps == 8, ValueError) << "walk warps must be 4 or 8, got " << warps;
}

// Args of the walk and summary kernels: the chunk table, the row table (rows_name) and the prep records
// checked first.
B::Args walk_args(const TensorView& prep, const TensorView& chunks, const TensorView& rows, const char* rows_name,
                  int64_t H, int dev) {
  check_table(chunks, "chunk table", 2, dev);
  check_table(rows, rows_name, 4, dev);
  TVM_FFI_CHECK(H >= 1 && H <= 65535, ValueError) << "H must be in [1, 65535]";  // gridDim.y
  TVM_FFI_CHECK(rows.size(0) <= 0x7fffffff, ValueError) << rows_name << " longer than 2^31 - 1 rows";
  check_prep(prep, chunks.size(0), H, dev);
  return base_args(chunks, rows, H, prep);
}

// A walk's optional output: numel 0 for none, else fp32 [rows, H, 128, 128], one state per walk row.
float* walk_out(const TensorView& s, const char* name, int64_t rows, int64_t H, int dev) {
  if (s.numel() == 0) return nullptr;
  check_state(s, name, rows, H, dev);
  return static_cast<float*>(s.data_ptr());
}

// do bf16 [T, H, 128] (T from do itself: the walks read it through the chunk table)
void check_dout(const TensorView& dout, int64_t H, int dev) {
  TVM_FFI_CHECK(dout.ndim() == 3, ValueError) << "do must be [T, H, 128]";
  check_tok(dout, "do", dout.size(0), H, kDLBfloat, 16, dev);
}

// Args of the per-chunk kernels (prep, grads): no run table.
B::Args chunk_args(const TensorView& chunks, TensorView prep, int64_t H, const TensorView& q, const TensorView& k,
                   const TensorView& v, const TensorView& g, const TensorView& beta, double scale) {
  B::Args a = base_args(chunks, chunks, H, prep);
  a.nruns = 0;
  a.q = q.data_ptr();
  a.k = k.data_ptr();
  a.v = v.data_ptr();
  a.g = static_cast<const float*>(g.data_ptr());
  a.beta = beta.data_ptr();
  a.scale = static_cast<float>(scale);
  return a;
}

// prep records of every chunk in `chunks` (rows (first token, rows)); values outside the domain set bits of the
// status word (kda_status.cuh).
void bwd_prep(TensorView q, TensorView k, TensorView v, TensorView g, TensorView beta, TensorView chunks,
              TensorView prep, double scale, TensorView status) {
  const int dev = q.device().device_id;
  TVM_FFI_CHECK(q.ndim() == 3, ValueError) << "q must be [T, H, 128]";
  const int64_t T = q.size(0), H = q.size(1);
  TVM_FFI_CHECK(H >= 1 && H <= 65535, ValueError) << "H must be in [1, 65535]";
  check_chunk_inputs(q, k, v, g, beta, T, H, dev);
  check_table(chunks, "chunk table", 2, dev);
  TVM_FFI_CHECK(chunks.size(0) * H <= 0x7fffffff, ValueError)
      << "too many (chunk, head) records for one launch (the prep's 32-bit block index)";
  check_prep(prep, chunks.size(0), H, dev);
  B::Args a = chunk_args(chunks, prep, H, q, k, v, g, beta, scale);
  a.status = status_word(status, dev);
  raise_on(B::launch_prep(a, stream_of(q)), "kda bwd_prep launch");
}

// h[c] = state entering chunk c (bf16 hi only, kda_bwd.h) of every walk row (first chunk, count, idx, src): from
// fold[idx] when src == 1, else state_in[idx] (numel 0 = zeros); state_out[row] = the state leaving the row (numel
// 0: not written).
void bwd_fwd_walk(TensorView prep, TensorView chunks, TensorView runs, TensorView state_in, TensorView fold,
                  TensorView state_out, TensorView h, int64_t warps) {
  const int dev = prep.device().device_id;
  check_walk_warps(warps);
  TVM_FFI_CHECK(h.ndim() == 4, ValueError) << "h must be [Nc, H, 128, 128]";
  const int64_t H = h.size(1);
  char* hp = check_walk_state(h, "h", chunks.size(0), H, false, dev);
  B::Args a = walk_args(prep, chunks, runs, "run table", H, dev);
  a.h = hp;
  a.state_in = optional_state(state_in, "state_in", H, dev);
  a.fold = optional_state(fold, "segment states", H, dev);
  a.walk_out = walk_out(state_out, "state_out", runs.size(0), H, dev);
  raise_on(B::launch_fwd_walk(a, static_cast<int>(warps), stream_of(h)), "kda bwd_fwd_walk launch");
}

// dh[c] = gradient of the state leaving chunk c (fp16 at a power of two per walk warp, kda_bwd.h), walking every run from its end
// (dstate_out or zero); dstate_in[row] = the gradient of the state entering the row (numel 0: not written).
void bwd_rev_walk(TensorView dout, TensorView prep, TensorView chunks, TensorView runs, TensorView dstate_out,
                  TensorView fold, TensorView dstate_in, TensorView dh, int64_t warps) {
  const int dev = prep.device().device_id;
  check_walk_warps(warps);
  TVM_FFI_CHECK(dh.ndim() == 3, ValueError) << "dh must be [Nc, H, " << B::kDhStateBytes << "]";
  const int64_t H = dh.size(1);
  char* dhp = check_walk_state(dh, "dh", chunks.size(0), H, true, dev);
  check_dout(dout, H, dev);
  B::Args a = walk_args(prep, chunks, runs, "run table", H, dev);
  a.dout = dout.data_ptr();
  a.dh = dhp;
  a.dstate_out = optional_state(dstate_out, "dstate_out", H, dev);
  a.fold = optional_state(fold, "segment state gradients", H, dev);
  a.walk_out = walk_out(dstate_in, "dstate_in", runs.size(0), H, dev);
  raise_on(B::launch_rev_walk(a, static_cast<int>(warps), stream_of(dh)), "kda bwd_rev_walk launch");
}

// Forward summaries (M, E) of segments (rows (first chunk, count, out idx, 0)) from a zero state.
void bwd_fwd_summary(TensorView prep, TensorView chunks, TensorView segs, TensorView m, TensorView e,
                     int64_t warps) {
  const int dev = prep.device().device_id;
  check_walk_warps(warps);
  TVM_FFI_CHECK(m.ndim() == 4, ValueError) << "M must be [n, H, 128, 128]";
  const int64_t H = m.size(1);
  check_state(m, "M", -1, H, dev);
  check_state(e, "E", m.size(0), H, dev);
  B::Args a = walk_args(prep, chunks, segs, "segment table", H, dev);
  a.m_out = static_cast<float*>(m.data_ptr());
  a.e_out = static_cast<float*>(e.data_ptr());
  raise_on(B::launch_fwd_summary(a, static_cast<int>(warps), stream_of(m)), "kda bwd_fwd_summary launch");
}

// Backward summaries of runs or segments (rows (first chunk, count, out index, 0)) from a zero dS:
// dS_in = Mt dS_out + F.
void bwd_rev_summary(TensorView dout, TensorView prep, TensorView chunks, TensorView runs, TensorView mt,
                     TensorView f, int64_t warps) {
  const int dev = prep.device().device_id;
  check_walk_warps(warps);
  TVM_FFI_CHECK(mt.ndim() == 4, ValueError) << "Mt must be [n, H, 128, 128]";
  const int64_t H = mt.size(1);
  check_state(mt, "Mt", -1, H, dev);
  check_state(f, "F", mt.size(0), H, dev);
  check_dout(dout, H, dev);
  B::Args a = walk_args(prep, chunks, runs, "run table", H, dev);
  a.dout = dout.data_ptr();
  a.mt_out = static_cast<float*>(mt.data_ptr());
  a.f_out = static_cast<float*>(f.data_ptr());
  raise_on(B::launch_rev_summary(a, static_cast<int>(warps), stream_of(mt)), "kda bwd_rev_summary launch");
}

// Per-chunk gradients from the prep records, h and dh; warps (8 or 16) per CTA.
void bwd_grads(TensorView q, TensorView k, TensorView v, TensorView g, TensorView beta, TensorView dout,
               TensorView chunks, TensorView prep, TensorView h, TensorView dh, TensorView dq, TensorView dk,
               TensorView dv, TensorView dg, TensorView dbeta, double scale, int64_t warps) {
  const int dev = q.device().device_id;
  TVM_FFI_CHECK(q.ndim() == 3, ValueError) << "q must be [T, H, 128]";
  const int64_t T = q.size(0), H = q.size(1);
  check_chunk_inputs(q, k, v, g, beta, T, H, dev);
  check_tok(dout, "do", T, H, kDLBfloat, 16, dev);
  check_tok(dq, "dq", T, H, kDLBfloat, 16, dev);
  check_tok(dk, "dk", T, H, kDLBfloat, 16, dev);
  check_tok(dv, "dv", T, H, kDLBfloat, 16, dev);
  check_tok(dg, "dg", T, H, kDLFloat, 32, dev);
  check_beta(dbeta, "dbeta", T, H, dev);
  check_table(chunks, "chunk table", 2, dev);
  char* hp = check_walk_state(h, "h", chunks.size(0), H, false, dev);
  char* dhp = check_walk_state(dh, "dh", chunks.size(0), H, true, dev);
  check_prep(prep, chunks.size(0), H, dev);
  B::Args a = chunk_args(chunks, prep, H, q, k, v, g, beta, scale);
  a.dout = dout.data_ptr();
  a.h = hp;
  a.dh = dhp;
  a.dq = dq.data_ptr();
  a.dk = dk.data_ptr();
  a.dv = dv.data_ptr();
  a.dg = static_cast<float*>(dg.data_ptr());
  a.dbeta = dbeta.data_ptr();
  TVM_FFI_CHECK(warps == 8 || warps == 16, ValueError) << "warps must be 8 or 16";
  raise_on(B::launch_grads(a, static_cast<int>(warps), stream_of(q)), "kda bwd_grads launch");
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(bwd_prep, bwd_prep);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(bwd_fwd_walk, bwd_fwd_walk);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(bwd_rev_walk, bwd_rev_walk);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(bwd_rev_summary, bwd_rev_summary);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(bwd_fwd_summary, bwd_fwd_summary);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(merge_fold, kda::ffi_checks::merge_fold);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(bwd_grads, bwd_grads);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(status_fill, kda::ffi_checks::status_fill);
