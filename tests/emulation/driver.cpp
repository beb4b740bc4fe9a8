// C entry points of the emulated kernels (backward, forward, merge, the status fill) for ctypes
// (tests/test_kernel_emulation.py, tests/test_value_status_emulation.py).
#include "kda_bwd.h"
using namespace kda::bwd;
extern "C" {
// status: the value-domain status word (kda_status.cuh) or null
int e_prep(void* q, void* k, void* v, float* g, void* beta, int32_t* chunks, int nchunks, int H, float scale, char* prep, int* status) {
  Args a{}; a.q = q; a.k = k; a.v = v; a.g = g; a.beta = beta; a.chunks = chunks; a.nchunks = nchunks; a.H = H; a.scale = scale; a.prep = prep; a.status = status;
  return launch_prep(a, nullptr);
}
// h, dh: the walks' states (kda_bwd.h kHiStateBytes, kDhStateBytes)
int e_fwd_walk(char* prep, int32_t* chunks, int nchunks, int32_t* runs, int nruns, int H, float* sin, float* fold, float* sout, char* h, int warps) {
  Args a{}; a.prep = prep; a.chunks = chunks; a.nchunks = nchunks; a.runs = runs; a.nruns = nruns; a.H = H; a.state_in = sin; a.fold = fold; a.walk_out = sout; a.h = h;
  return launch_fwd_walk(a, warps, nullptr);
}
int e_fwd_summary(char* prep, int32_t* chunks, int nchunks, int32_t* segs, int nseg, int H, float* m, float* e, int warps) {
  Args a{}; a.prep = prep; a.chunks = chunks; a.nchunks = nchunks; a.runs = segs; a.nruns = nseg; a.H = H; a.m_out = m; a.e_out = e;
  return launch_fwd_summary(a, warps, nullptr);
}
int e_rev_walk(void* dout, char* prep, int32_t* chunks, int nchunks, int32_t* runs, int nruns, int H, float* dso, float* fold, float* dsin, char* dh, int warps) {
  Args a{}; a.dout = dout; a.prep = prep; a.chunks = chunks; a.nchunks = nchunks; a.runs = runs; a.nruns = nruns; a.H = H; a.dstate_out = dso; a.fold = fold; a.walk_out = dsin; a.dh = dh;
  return launch_rev_walk(a, warps, nullptr);
}
int e_rev_summary(void* dout, char* prep, int32_t* chunks, int nchunks, int32_t* segs, int nseg, int H, float* mt, float* f, int warps) {
  Args a{}; a.dout = dout; a.prep = prep; a.chunks = chunks; a.nchunks = nchunks; a.runs = segs; a.nruns = nseg; a.H = H; a.mt_out = mt; a.f_out = f;
  return launch_rev_summary(a, warps, nullptr);
}
int e_grads(void* q, void* k, void* v, float* g, void* beta, void* dout, int32_t* chunks, int nchunks, int H, char* prep,
             char* h, char* dh, void* dq, void* dk, void* dv, float* dg, void* dbeta, float scale, int warps) {
  Args a{}; a.q = q; a.k = k; a.v = v; a.g = g; a.beta = beta; a.dout = dout; a.chunks = chunks; a.nchunks = nchunks; a.H = H;
  a.prep = prep; a.h = h; a.dh = dh; a.dq = dq; a.dk = dk; a.dv = dv; a.dg = dg; a.dbeta = dbeta; a.scale = scale;
  return launch_grads(a, warps, nullptr);
}
}

// ---- the forward (csrc/kda_fwd.cu) and the FP32 affine merge (csrc/kda_affine_merge.cuh) ----
#include "kda_affine_merge.cuh"
#include "kda_fwd.h"
extern "C" {
int e_fwd_prep(void* q, void* k, float* g, void* beta, int32_t* chunks, int nchunk, int H, float scale, void* ws, int* status) {
  kda::PrepArgs a{}; a.q = q; a.k = k; a.g = g; a.beta = beta; a.chunks = chunks; a.nchunk = nchunk; a.H = H; a.scale = scale; a.ws = ws; a.status = status;
  return kda::launch_fwd_prep(a, nullptr);
}
int e_fwd_walk_output(void* v, void* ws, int32_t* chunks, int32_t* segs, int nseg, int H, float* state_in, float* sin, void* o, int warps) {
  kda::WalkArgs a{}; a.v = v; a.ws = ws; a.chunks = chunks; a.segs = segs; a.nseg = nseg; a.H = H; a.state_in = state_in; a.sin = sin; a.o = o;
  return kda::launch_fwd_walk_output(a, warps, nullptr);
}
int e_fwd_walk_summary(void* v, void* ws, int32_t* chunks, int32_t* segs, int nseg, int H, float* m, float* e, int warps) {
  kda::WalkArgs a{}; a.v = v; a.ws = ws; a.chunks = chunks; a.segs = segs; a.nseg = nseg; a.H = H; a.m_out = m; a.e_out = e;
  return kda::launch_fwd_walk_summary(a, warps, nullptr);
}
int e_merge(float* m, float* e, int32_t* chains, int nchain, int H, float* init, float* out0, float* out1, int compose) {
  kda::MergeArgs a{}; a.m = m; a.e = e; a.chains = chains; a.nchain = nchain; a.H = H; a.init = init; a.out0 = out0; a.out1 = out1;
  return compose ? kda::launch_merge_compose(a, nullptr) : kda::launch_merge_fold(a, nullptr);
}
int e_fwd_record_bytes() { return kda::kFwdRecordBytes; }
}

// ---- the NaN fill of the value-domain status (csrc/kda_status.cuh), launched as kda_status_binding.h does ----
#include "kda_status.cuh"
extern "C" {
// report: the host slot (the emulation's device address is the host's) or null; ptrs, n, bytes: kFillSlots entries
// each (n 0: unused)
int e_status_fill(int* word, int* report, void** ptrs, int64_t* n, int* bytes) {
  namespace S = kda::status;
  S::FillArgs a{};
  a.word = word;
  a.report = report;
  int64_t most = 0;
  for (int s = 0; s < S::kFillSlots; ++s) {
    a.ptr[s] = ptrs[s]; a.n[s] = n[s]; a.bytes[s] = bytes[s];
    most = n[s] > most ? n[s] : most;
  }
  if (most > 0 || report != nullptr) emu_launch(S::fill_nan_kernel<S::kFillSlots>, dim3(S::fill_blocks(most)), S::kFillThreads, 0, nullptr, a);
  return 0;
}
}
