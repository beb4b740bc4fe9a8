// The in-call activations of kda_kcp.chunk_kda (FLA's use_qk_l2norm_in_kernel, use_gate_in_kernel,
// use_beta_sigmoid_in_kernel) as one pass each way (docs/kernels.md, "Activations"): memory-bound elementwise
// work with one warp reduction per q/k row, in FP32.
//   act_fwd_kernel: q, k -> x / sqrt(sum x^2 + 1e-6) in bf16 (each head's row written for its G value heads) and
//     the inverse norms; g -> the gate (kda_act.h GateForm) in fp32; beta -> sigmoid(beta) (times 2) in bf16.
//   act_bwd_kernel: dq = (dy - y <y, dy>) r with y = q r, dy the sum of the G value heads' gradients (same for k);
//     the gate's and the sigmoid's chain rule elementwise; per item, the partial sums of dA_log and ddt_bias.
// One warp per item (64 tokens of one head), lane l on channels 4l .. 4l + 3 of each 128-wide row (8 or 16 bytes:
// a warp reads a row in one coalesced request); the betas of an item, one token per lane. The options are runtime
// values, uniform over the grid: a branch per row costs nothing beside the row's memory traffic, and the
// instantiations stay those of the input dtypes (bf16 / fp32 for q and k, g and beta: eight per direction).
// NaN and Inf propagate as in the torch ops (no fmin/fmax, no clamps), so the KDA preps' value check still sees them.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cmath>
#include <cstdint>

#include "kda_act.h"
#include "kda_common.cuh"

namespace kda {
namespace act {
namespace {

constexpr int kThreads = kWarps * 32;
constexpr float kSoftplusThreshold = 20.f;  // torch's softplus: x itself above it (gradient 1)

// Four consecutive values of a row as floats, in the row's storage type.
template <class T>
struct Row4;
template <>
struct Row4<float> {
  static __device__ __forceinline__ void load(const void* base, int64_t off, float (&x)[4]) {
    const float4 v = *reinterpret_cast<const float4*>(static_cast<const float*>(base) + off);
    x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
  }
  static __device__ __forceinline__ void store(void* base, int64_t off, const float (&x)[4]) {
    *reinterpret_cast<float4*>(static_cast<float*>(base) + off) = make_float4(x[0], x[1], x[2], x[3]);
  }
  static __device__ __forceinline__ float load1(const void* base, int64_t off) {
    return static_cast<const float*>(base)[off];
  }
  static __device__ __forceinline__ void store1(void* base, int64_t off, float x) { static_cast<float*>(base)[off] = x; }
};
struct alignas(8) Bf16x4 {
  uint32_t lo, hi;  // two bf16 pairs, the lower channel in the low half
};
template <>
struct Row4<__nv_bfloat16> {
  static __device__ __forceinline__ void load(const void* base, int64_t off, float (&x)[4]) {
    const Bf16x4 v = *reinterpret_cast<const Bf16x4*>(static_cast<const __nv_bfloat16*>(base) + off);
    const float2 a = bf2_to_f2(v.lo), b = bf2_to_f2(v.hi);
    x[0] = a.x, x[1] = a.y, x[2] = b.x, x[3] = b.y;
  }
  static __device__ __forceinline__ void store(void* base, int64_t off, const float (&x)[4]) {
    Bf16x4 v;
    v.lo = pack_bf16(x[0], x[1]);
    v.hi = pack_bf16(x[2], x[3]);
    *reinterpret_cast<Bf16x4*>(static_cast<__nv_bfloat16*>(base) + off) = v;
  }
  static __device__ __forceinline__ float load1(const void* base, int64_t off) {
    return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[off]);
  }
  static __device__ __forceinline__ void store1(void* base, int64_t off, float x) {
    static_cast<__nv_bfloat16*>(base)[off] = __float2bfloat16_rn(x);
  }
};
using Bf16Row = Row4<__nv_bfloat16>;

// The sum over the warp in a fixed butterfly order (every lane gets it, bitwise the same from run to run).
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float softplus(float x) { return x > kSoftplusThreshold ? x : log1pf(expf(x)); }

// The gate's per-head constants: rate = exp(A_log) (when the form reads it), this lane's four dt_bias values.
struct GateHead {
  float rate;
  float bias[4];
  __device__ __forceinline__ GateHead(const Inputs& in, int hv, int lane) {
    rate = in.a_log != nullptr ? expf(in.a_log[hv]) : 1.f;
#pragma unroll
    for (int e = 0; e < 4; ++e) bias[e] = in.dt_bias != nullptr ? in.dt_bias[hv * kHeadDim + 4 * lane + e] : 0.f;
  }
};

// the gate of the pre-activation x (= g + dt_bias)
__device__ __forceinline__ float gate_value(const Inputs& in, const GateHead& h, float x) {
  if (in.gate_form == kSoftplus) return -h.rate * softplus(x);
  if (in.gate_form == kBoundedRate) return in.lower_bound * sigmoid(h.rate * x);
  return in.lower_bound * sigmoid(x);
}

// (d gate / dx, d gate / dA_log) at x
__device__ __forceinline__ float2 gate_slopes(const Inputs& in, const GateHead& h, float x) {
  if (in.gate_form == kSoftplus) {
    const float s = x > kSoftplusThreshold ? 1.f : sigmoid(x);
    return make_float2(-h.rate * s, -h.rate * softplus(x));
  }
  const float z = in.gate_form == kBoundedRate ? h.rate * x : x;
  const float s = sigmoid(z);
  const float ds = in.lower_bound * (1.f - s) * s;  // d (lower_bound sigmoid(z)) / dz
  return in.gate_form == kBoundedRate ? make_float2(ds * h.rate, ds * h.rate * x) : make_float2(ds, 0.f);
}

// Where a warp is in the grid: warp w takes item w, i.e. kRowsPerItem consecutive tokens of one head.
struct WarpItem {
  int lane;
  int64_t item;
  int64_t nitem;  // items per head
  __device__ __forceinline__ WarpItem(int64_t N)
      : lane(threadIdx.x & 31), item(static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5)), nitem(num_items(N)) {}
  __device__ __forceinline__ bool within(int heads) const { return item < nitem * heads; }
};

struct Item {
  int64_t t0, t1;  // token rows [t0, t1)
  int head;
  __device__ __forceinline__ Item(int64_t item, int heads, int64_t N) {
    const int64_t c = item / heads;
    head = static_cast<int>(item - c * heads);
    t0 = c * kRowsPerItem;
    t1 = t0 + kRowsPerItem < N ? t0 + kRowsPerItem : N;
  }
};

// An item's rows are taken kBatch at a time, every load of a batch issued before any of its stores: the pointers
// may alias for all the compiler knows, so row by row each load would wait behind the previous row's store, one
// row in flight per warp. The arithmetic of each row is the same either way.
constexpr int kBatch = 4;
// The gate's backward reads an fp32 gradient row beside each gate row, twice a bf16 q row's bytes: half the rows
// per batch keep as many bytes in flight (and at 4 its bf16 variants spill registers).
constexpr int kGateGradBatch = 2;

// The q or k rows of an item: normalised, written for the G value heads of their head; the inverse norms to r.
template <class TQ>
__device__ __forceinline__ void normalize_rows(const void* x_raw, void* y_out, float* r_out, const Item& it,
                                               const Inputs& in, int lane) {
  const int G = in.HV / in.H;
  for (int64_t t0 = it.t0; t0 < it.t1; t0 += kBatch) {
    float x[kBatch][4];
#pragma unroll
    for (int b = 0; b < kBatch; ++b)
      if (t0 + b < it.t1) Row4<TQ>::load(x_raw, ((t0 + b) * in.H + it.head) * kHeadDim + 4 * lane, x[b]);
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int64_t t = t0 + b;
      if (t >= it.t1) break;
      const float ss = warp_sum(x[b][0] * x[b][0] + x[b][1] * x[b][1] + x[b][2] * x[b][2] + x[b][3] * x[b][3]);
      const float r = 1.f / sqrtf(ss + kNormEps);
#pragma unroll
      for (int e = 0; e < 4; ++e) x[b][e] *= r;
      for (int j = 0; j < G; ++j) Bf16Row::store(y_out, (t * in.HV + it.head * G + j) * kHeadDim + 4 * lane, x[b]);
      if (lane == 0) r_out[t * in.H + it.head] = r;
    }
  }
}

// The betas of an item, one token per lane: sigmoid(beta) beta_scale (forward) or its chain rule (backward).
template <class TB>
__device__ __forceinline__ void beta_rows(const Inputs& in, const Item& it, int lane, const void* dbeta_out,
                                          void* out) {
  for (int64_t t = it.t0 + lane; t < it.t1; t += 32) {
    const int64_t off = t * in.HV + it.head;
    const float s = sigmoid(Row4<TB>::load1(in.beta, off));
    if (dbeta_out == nullptr)
      Bf16Row::store1(out, off, in.beta_scale * s);
    else
      Row4<TB>::store1(out, off, Bf16Row::load1(dbeta_out, off) * in.beta_scale * (1.f - s) * s);
  }
}

template <class TQ, class TG, class TB>
__global__ void __launch_bounds__(kThreads) act_fwd_kernel(const FwdArgs a) {
  const Inputs& in = a.in;
  const WarpItem w(in.N);
  if (in.q != nullptr && w.within(in.H)) {
    const Item it(w.item, in.H, in.N);
    normalize_rows<TQ>(in.q, a.qn, a.rq, it, in, w.lane);
    normalize_rows<TQ>(in.k, a.kn, a.rk, it, in, w.lane);
  }
  if (!w.within(in.HV)) return;
  const Item it(w.item, in.HV, in.N);
  if (in.g != nullptr) {
    const GateHead gh(in, it.head, w.lane);
    for (int64_t t0 = it.t0; t0 < it.t1; t0 += kBatch) {
      float x[kBatch][4];
#pragma unroll
      for (int b = 0; b < kBatch; ++b)
        if (t0 + b < it.t1) Row4<TG>::load(in.g, ((t0 + b) * in.HV + it.head) * kHeadDim + 4 * w.lane, x[b]);
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        if (t0 + b >= it.t1) break;
#pragma unroll
        for (int e = 0; e < 4; ++e) x[b][e] = gate_value(in, gh, x[b][e] + gh.bias[e]);
        Row4<float>::store(a.g_out, ((t0 + b) * in.HV + it.head) * kHeadDim + 4 * w.lane, x[b]);
      }
    }
  }
  if (in.beta != nullptr) beta_rows<TB>(in, it, w.lane, nullptr, a.beta_out);
}

// The gradients of an item's q or k rows: dy summed over its G value heads (FP32), then (dy - y <y, dy>) r,
// y = x r recomputed from the raw row and the saved inverse norm.
template <class TQ>
__device__ __forceinline__ void normalize_rows_grad(const void* x_raw, const float* r_in, const void* dy_in,
                                                    void* dx_out, const Item& it, const Inputs& in, int lane) {
  const int G = in.HV / in.H;
  for (int64_t t0 = it.t0; t0 < it.t1; t0 += kBatch) {
    float x[kBatch][4], dy[kBatch][4], r[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int64_t t = t0 + b;
#pragma unroll
      for (int e = 0; e < 4; ++e) dy[b][e] = 0.f;
      if (t >= it.t1) continue;
      Row4<TQ>::load(x_raw, (t * in.H + it.head) * kHeadDim + 4 * lane, x[b]);
      r[b] = r_in[t * in.H + it.head];
      for (int j = 0; j < G; ++j) {
        float d[4];
        Bf16Row::load(dy_in, (t * in.HV + it.head * G + j) * kHeadDim + 4 * lane, d);
#pragma unroll
        for (int e = 0; e < 4; ++e) dy[b][e] += d[e];
      }
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (t0 + b >= it.t1) break;
#pragma unroll
      for (int e = 0; e < 4; ++e) x[b][e] *= r[b];
      const float dot =
          warp_sum(x[b][0] * dy[b][0] + x[b][1] * dy[b][1] + x[b][2] * dy[b][2] + x[b][3] * dy[b][3]);
#pragma unroll
      for (int e = 0; e < 4; ++e) dy[b][e] = (dy[b][e] - x[b][e] * dot) * r[b];
      Row4<TQ>::store(dx_out, ((t0 + b) * in.H + it.head) * kHeadDim + 4 * lane, dy[b]);
    }
  }
}

template <class TQ, class TG, class TB>
__global__ void __launch_bounds__(kThreads) act_bwd_kernel(const BwdArgs a) {
  const Inputs& in = a.in;
  const WarpItem w(in.N);
  if (in.q != nullptr && w.within(in.H)) {
    const Item it(w.item, in.H, in.N);
    normalize_rows_grad<TQ>(in.q, a.rq, a.dqn, a.dq, it, in, w.lane);
    normalize_rows_grad<TQ>(in.k, a.rk, a.dkn, a.dk, it, in, w.lane);
  }
  if (!w.within(in.HV)) return;
  const Item it(w.item, in.HV, in.N);
  if (in.g != nullptr) {
    const GateHead gh(in, it.head, w.lane);
    float acc_dt[4] = {0.f, 0.f, 0.f, 0.f}, acc_a = 0.f;  // this lane's partial sums over the item's tokens, in order
    for (int64_t t0 = it.t0; t0 < it.t1; t0 += kGateGradBatch) {
      float x[kGateGradBatch][4], dgo[kGateGradBatch][4];
#pragma unroll
      for (int b = 0; b < kGateGradBatch; ++b) {
        if (t0 + b >= it.t1) continue;
        const int64_t off = ((t0 + b) * in.HV + it.head) * kHeadDim + 4 * w.lane;
        Row4<TG>::load(in.g, off, x[b]);
        Row4<float>::load(a.dg_out, off, dgo[b]);
      }
#pragma unroll
      for (int b = 0; b < kGateGradBatch; ++b) {
        if (t0 + b >= it.t1) break;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float2 s = gate_slopes(in, gh, x[b][e] + gh.bias[e]);
          x[b][e] = dgo[b][e] * s.x;
          acc_dt[e] += x[b][e];
          acc_a += dgo[b][e] * s.y;
        }
        Row4<TG>::store(a.dg, ((t0 + b) * in.HV + it.head) * kHeadDim + 4 * w.lane, x[b]);
      }
    }
    const int64_t slot = (w.item / in.HV) * in.HV + it.head;  // (item index, head) of the partial buffers
    if (a.part_dt != nullptr) Row4<float>::store(a.part_dt, slot * kHeadDim + 4 * w.lane, acc_dt);
    if (a.part_a != nullptr) {
      acc_a = warp_sum(acc_a);
      if (w.lane == 0) a.part_a[slot] = acc_a;
    }
  }
  if (in.beta != nullptr) beta_rows<TB>(in, it, w.lane, a.dbeta_out, a.dbeta);
}

template <class Q, class G, class B>
struct Types {
  using TQ = Q;
  using TG = G;
  using TB = B;
};

// f(Types<TQ, TG, TB>()) for the dtypes of the inputs (kda_act.h Dtype; an absent input's is unused)
template <class F>
cudaError_t with_types(const Inputs& in, F&& f) {
  using bf = __nv_bfloat16;
  auto by_beta = [&](auto q, auto g) -> cudaError_t {
    using TQ = decltype(q);
    using TG = decltype(g);
    return in.beta_dtype == kF32 ? f(Types<TQ, TG, float>()) : f(Types<TQ, TG, bf>());
  };
  auto by_gate = [&](auto q) -> cudaError_t {
    return in.g_dtype == kF32 ? by_beta(q, float()) : by_beta(q, bf());
  };
  return in.qk_dtype == kF32 ? by_gate(float()) : by_gate(bf());
}

}  // namespace

int64_t num_blocks(const Inputs& in) {
  const int64_t heads = in.g != nullptr || in.beta != nullptr ? in.HV : in.q != nullptr ? in.H : 0;
  return (num_items(in.N) * heads + kWarps - 1) / kWarps;
}

cudaError_t launch_act_fwd(const FwdArgs& a, cudaStream_t stream) {
  const int64_t blocks = num_blocks(a.in);
  if (blocks == 0) return cudaSuccess;
  return with_types(a.in, [&](auto types) -> cudaError_t {
    using T = decltype(types);
    auto kern = act_fwd_kernel<typename T::TQ, typename T::TG, typename T::TB>;
    kern<<<dim3(static_cast<unsigned>(blocks)), kThreads, 0, stream>>>(a);
    return cudaGetLastError();
  });
}

cudaError_t launch_act_bwd(const BwdArgs& a, cudaStream_t stream) {
  const int64_t blocks = num_blocks(a.in);
  if (blocks == 0) return cudaSuccess;
  return with_types(a.in, [&](auto types) -> cudaError_t {
    using T = decltype(types);
    auto kern = act_bwd_kernel<typename T::TQ, typename T::TG, typename T::TB>;
    kern<<<dim3(static_cast<unsigned>(blocks)), kThreads, 0, stream>>>(a);
    return cudaGetLastError();
  });
}

}  // namespace act
}  // namespace kda
