// The value-domain status word (kda_kcp/status.py): one int32 per device that the chunk preps (kda_chunk_prep.cuh)
// OR a bit into when a value they hold lies outside the domain (every value finite, g in [-5, 0], beta in [0, 2]),
// and the kernel that then sets a call's outputs to NaN (exported by both programs through kda_status_binding.h).
// Clean inputs cost the preps one instruction per gate a thread holds, eight FFMA per lane of the two warps that
// form Aqk's diagonal blocks (q and k: kda_chunk_prep.cuh lq_blocks), in the backward one HFMA2 per pair of v in
// half the warps, and a warp vote per check; a bad value costs an atomicOr per warp that saw one. No host
// synchronization: the fill kernel that ends each call also stores the word into a slot of mapped pinned host
// memory that Python polls behind an event, and a later call raises (or kda_kcp.check_status).
//
// Only CUDA's own headers here: the CPU emulation (tests/emulation/) stands for them in
// tests/test_value_status_emulation.py.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstdint>

namespace kda {
namespace status {

// the bits (kda_kcp/status.py decodes them)
constexpr unsigned kNonFinite = 1u;  // a NaN or Inf in q, k, g, beta (and v in the backward)
constexpr unsigned kGateAbove = 2u;  // a finite g > 0
constexpr unsigned kGateBelow = 4u;  // a finite g < -5
constexpr unsigned kBetaRange = 8u;  // a finite beta outside [0, 2]

constexpr float kFloatMax = 3.402823466e38f;

// The gates' range on their bits, two integer maxima (three-input: one instruction per two gates each). As signed
// integers the positive floats (+Inf, then the positive NaNs, above them) lie above +0 and every negative float, so
// the signed max is > 0 exactly when a gate is > 0. As unsigned integers the negative floats lie above +0 and every
// positive float, ordered by magnitude from -0 (then -Inf and the negative NaNs), so the unsigned max is above -5's
// bits exactly when a gate is below -5. Start both from the bits of +0, inside the domain.
struct GateRange {
  int hi = 0;
  unsigned lo = 0u;
  __device__ __forceinline__ void add(float a, float b) {
    const int ia = static_cast<int>(__float_as_uint(a)), ib = static_cast<int>(__float_as_uint(b));
    const int h = ia > ib ? ia : ib;
    hi = h > hi ? h : hi;
    const unsigned ua = __float_as_uint(a), ub = __float_as_uint(b);
    const unsigned l = ua > ub ? ua : ub;
    lo = l > lo ? l : lo;
  }
  __device__ __forceinline__ unsigned code() const {
    unsigned c = 0u;
    if (hi > 0) c |= hi >= 0x7F800000 ? kNonFinite : kGateAbove;        // +Inf, a positive NaN
    if (lo > 0xC0A00000u) c |= lo >= 0xFF800000u ? kNonFinite : kGateBelow;  // -5.0f; -Inf, a negative NaN
    return c;
  }
};

__device__ __forceinline__ unsigned beta_code(float b) {
  if (b >= 0.f && b <= 2.f) return 0u;  // 2: allow_neg_eigval doubles beta
  return fabsf(b) <= kFloatMax ? kBetaRange : kNonFinite;
}

// A finiteness probe over bf16 pairs, one HFMA2 per pair: x * 0 + acc is acc while x is finite and NaN when x is
// Inf or NaN. Folded over values from acc = 0u it stays a pair of zeros until the first Inf or NaN; probe_code reads
// the verdict. (probe_bf16x2(k, q) is k, or NaN if q is not finite: q and k in one chain of half the length.)
__device__ __forceinline__ uint32_t probe_bf16x2(uint32_t acc, uint32_t x) {
  const uint32_t zero = 0u;
  const __nv_bfloat162 r = __hfma2(*reinterpret_cast<const __nv_bfloat162*>(&x),
                                   *reinterpret_cast<const __nv_bfloat162*>(&zero),
                                   *reinterpret_cast<const __nv_bfloat162*>(&acc));
  return *reinterpret_cast<const uint32_t*>(&r);
}
__device__ __forceinline__ unsigned probe_code(uint32_t acc) { return (acc & 0x7fff7fffu) != 0u ? kNonFinite : 0u; }

// The same over fp32 values, one FFMA each: x * 0 + acc stays +0 while x is finite, and is NaN from the first Inf or
// NaN on (the intrinsic is not folded: x * 0 is not 0 for those).
__device__ __forceinline__ float probe_f32(float acc, float x) { return __fmaf_rn(x, 0.f, acc); }
__device__ __forceinline__ unsigned probe_code_f32(float acc) { return acc != 0.f ? kNonFinite : 0u; }  // NaN != 0

// Each warp's codes ORed into *word (null: not reported): one vote; a warp that saw something reduces its codes and
// lane 0 ORs them in. Every lane of the warp calls it.
__device__ __forceinline__ void report(int* word, unsigned code) {
  if (__any_sync(0xffffffffu, code != 0u)) {
    code = __reduce_or_sync(0xffffffffu, code);
    if ((threadIdx.x & 31u) == 0u && word != nullptr) atomicOr(word, static_cast<int>(code));
  }
}

// ---- the NaN fill: a call's outputs (up to kFillSlots tensors, bf16 or fp32) when the word is nonzero ----
constexpr int kFillSlots = 5;
constexpr int kFillThreads = 256;
constexpr int kFillMaxBlocks = 256;
struct FillArgs {
  const int* word;
  int* report;  // the device address of a mapped pinned host int that receives the word, or null
  void* ptr[kFillSlots];
  int64_t n[kFillSlots];   // elements (0: an unused slot)
  int bytes[kFillSlots];   // 2: bf16, 4: fp32
};

// A template so that the programs' two translation units may both see it (the bindings instantiate it). With a
// clean word every CTA ends after one load. CTA 0 publishes the word to the host slot: no copy on the stream, and
// the event Python records after this kernel orders the host's read after the store.
template <int SLOTS>
__global__ void __launch_bounds__(kFillThreads) fill_nan_kernel(const FillArgs a) {
  const int w = *a.word;
  if (a.report != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
    *static_cast<volatile int*>(a.report) = w;
    __threadfence_system();
  }
  if (w == 0) return;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kFillThreads;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kFillThreads + threadIdx.x;
#pragma unroll 1
  for (int s = 0; s < SLOTS; ++s) {
    if (a.bytes[s] == 2) {
      uint16_t* p = static_cast<uint16_t*>(a.ptr[s]);
      for (int64_t i = first; i < a.n[s]; i += stride) p[i] = 0x7FC0u;  // bf16 NaN
    } else {
      uint32_t* p = static_cast<uint32_t*>(a.ptr[s]);
      for (int64_t i = first; i < a.n[s]; i += stride) p[i] = 0x7FC00000u;  // fp32 NaN
    }
  }
}

// CTAs for n elements at most
inline unsigned fill_blocks(int64_t n) {
  const int64_t b = (n + kFillThreads - 1) / kFillThreads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > kFillMaxBlocks ? kFillMaxBlocks : b));
}

}  // namespace status
}  // namespace kda
