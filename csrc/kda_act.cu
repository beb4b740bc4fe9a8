// The in-call activations of kda_kcp.chunk_kda (FLA's use_qk_l2norm_in_kernel, use_gate_in_kernel,
// use_beta_sigmoid_in_kernel) as one pass each way (docs/kernels.md, "The activations"): memory-bound elementwise
// work with one warp reduction per q/k row, in FP32.
//   act_fwd_kernel: q, k -> x / sqrt(sum x^2 + 1e-6) in bf16 (each head's row written for its G value heads) and
//     the inverse norms; g -> the gate (kda_act.h GateForm) in fp32; beta -> sigmoid(beta) (times 2) in bf16.
//   act_bwd_kernel: dq = (dy - y <y, dy>) r with y = q r, dy the sum of the G value heads' gradients (same for k);
//     the gate's and the sigmoid's chain rule elementwise; per item, the partial sums of dA_log and ddt_bias.
// One warp per item (64 tokens of one head), lane l on channels 4l .. 4l + 3 of each 128-wide row (8 or 16 bytes:
// a warp reads a row in one coalesced request); the betas of an item, two tokens per lane. The options are runtime
// values, uniform over the grid; the gate's form is dispatched once per item to a loop compiled for it, and the
// instantiations stay those of the input dtypes (bf16 / fp32 for q and k, g and beta: eight per direction).
// A warp takes its rows in batches (all loads first, then the arithmetic, then the stores) and sums a batch's rows
// with one shuffle sequence; neither changes any value: each is the FP32 expression of its row taken alone, each
// sum adds its terms in the order of one warp_sum per row, an item's partial sums run in token order.
// NaN and Inf propagate as in the torch ops (no fmin/fmax, no clamps), so the KDA preps' value check still sees them.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cmath>
#include <cstdint>

#include "kda_act.h"
#include "kda_common.cuh"
#include "kda_warp_rows.cuh"

namespace kda {
namespace act {
namespace {

constexpr int kThreads = kWarps * 32;
constexpr float kSoftplusThreshold = 20.f;  // torch's softplus: x itself above it (gradient 1)

// CTAs per SM that the register budget must allow (__launch_bounds__): 7 x 128 threads, <= 72 registers. sm_90a
// compiles the forward's bf16 instantiations to 64 (8 CTAs, 32 warps per SM) and the backward's to 70-72 (7, 28
// warps); at 8 CTAs (64 registers) the backward and, on sm_100a, the forward's bounded gates spill. Each warp keeps
// about 2 KB of loads in flight, which covers HBM's latency several times over at these warp counts; 4-warp CTAs
// leave a smaller last wave than 8-warp ones.
constexpr int kCtasPerSm = 7;

// Rows per batch: every load of a batch is issued before any of its arithmetic and stores, so a warp keeps a batch
// of loads in flight (about 2 KB; ~64 bytes a lane) where one row at a time would keep 256-512 bytes. The q and k
// passes take P tokens of q and the same P tokens of k in one batch (2P rows, one warp_sum_rows); the sums need a
// power of two. One lane's share of a row is 4 values: 8 bytes in bf16, 16 in fp32.
template <class T>
constexpr int kLaneBytes = 4 * static_cast<int>(sizeof(T));
// forward norm: x only -> P = 4 (bf16) or 2 (fp32)
template <class TQ>
constexpr int kNormFwdTokens = 64 / (2 * kLaneBytes<TQ>);
// forward gate: the raw gate row -> 8 (bf16) or 4 (fp32) rows
template <class TG>
constexpr int kGateFwdRows = 64 / kLaneBytes<TG>;
// backward norm: x and the bf16 gradient row(s) -> P = 2 (2 KB in bf16, 3 KB in fp32; x, dy and r of 4 rows fit)
constexpr int kNormBwdTokens = 2;
// backward gate: the raw gate row and its fp32 gradient -> 3 rows in bf16 (2.25 KB; 4 spill at 72 registers), 2 in
// fp32 (2 KB)
template <class TG>
constexpr int kGateBwdRows = kLaneBytes<TG> == 8 ? 3 : 2;

// Four consecutive values of a row, in the row's storage type: loaded as one raw access (`Raw`, what a batch keeps
// in registers until its arithmetic: a bf16 row's four values take two registers, not four) and unpacked to floats.
// Loads go through the read-only path (the pass writes no input); fp32 rows are stored streaming (evict-first: this
// pass does not read them again, and they would push out of L2 the rows it still reads).
template <class T>
struct Row4;
template <>
struct Row4<float> {
  using Raw = float4;
  static __device__ __forceinline__ Raw load(const void* base, int64_t off) {
    return __ldg(reinterpret_cast<const float4*>(static_cast<const float*>(base) + off));
  }
  static __device__ __forceinline__ void unpack(const Raw& v, float (&x)[4]) {
    x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
  }
  static __device__ __forceinline__ void store(void* base, int64_t off, const float (&x)[4]) {
    __stcs(reinterpret_cast<float4*>(static_cast<float*>(base) + off), make_float4(x[0], x[1], x[2], x[3]));
  }
  static __device__ __forceinline__ float load1(const void* base, int64_t off) {
    return __ldg(static_cast<const float*>(base) + off);
  }
  static __device__ __forceinline__ void store1(void* base, int64_t off, float x) { static_cast<float*>(base)[off] = x; }
};
template <>
struct Row4<__nv_bfloat16> {
  using Raw = uint2;  // two bf16 pairs, the lower channel in the low half of each
  static __device__ __forceinline__ Raw load(const void* base, int64_t off) {
    return __ldg(reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(base) + off));
  }
  static __device__ __forceinline__ void unpack(const Raw& v, float (&x)[4]) {
    const float2 a = bf2_to_f2(v.x), b = bf2_to_f2(v.y);
    x[0] = a.x, x[1] = a.y, x[2] = b.x, x[3] = b.y;
  }
  // one 8-byte store: a 64-bit word (a uint2 compiles to two 4-byte stores, __stwb to a strong one)
  static __device__ __forceinline__ void store(void* base, int64_t off, const float (&x)[4]) {
    *reinterpret_cast<uint64_t*>(static_cast<__nv_bfloat16*>(base) + off) =
        static_cast<uint64_t>(pack_bf16(x[0], x[1])) | static_cast<uint64_t>(pack_bf16(x[2], x[3])) << 32;
  }
  static __device__ __forceinline__ float load1(const void* base, int64_t off) {
    return __bfloat162float(__ldg(static_cast<const __nv_bfloat16*>(base) + off));
  }
  static __device__ __forceinline__ void store1(void* base, int64_t off, float x) {
    static_cast<__nv_bfloat16*>(base)[off] = __float2bfloat16_rn(x);
  }
};
using Bf16Row = Row4<__nv_bfloat16>;

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

// The gate's form as a type: each form's loop is compiled alone, with no branch on the form per value.
template <int F>
struct Form {
  static constexpr int value = F;
};
template <class Fn>
__device__ __forceinline__ void with_gate_form(int form, Fn&& fn) {
  if (form == kSoftplus)
    fn(Form<kSoftplus>());
  else if (form == kBoundedRate)
    fn(Form<kBoundedRate>());
  else
    fn(Form<kBounded>());
}

// the gate of the pre-activation x (= g + dt_bias)
template <int FORM>
__device__ __forceinline__ float gate_value(const Inputs& in, const GateHead& h, float x) {
  if constexpr (FORM == kSoftplus) return -h.rate * softplus(x);
  if constexpr (FORM == kBoundedRate) return in.lower_bound * sigmoid(h.rate * x);
  return in.lower_bound * sigmoid(x);
}

// (d gate / dx, d gate / dA_log) at x
template <int FORM>
__device__ __forceinline__ float2 gate_slopes(const Inputs& in, const GateHead& h, float x) {
  if constexpr (FORM == kSoftplus) {
    const float s = x > kSoftplusThreshold ? 1.f : sigmoid(x);
    return make_float2(-h.rate * s, -h.rate * softplus(x));
  } else {
    const float z = FORM == kBoundedRate ? h.rate * x : x;
    const float s = sigmoid(z);
    const float ds = in.lower_bound * (1.f - s) * s;  // d (lower_bound sigmoid(z)) / dz
    return FORM == kBoundedRate ? make_float2(ds * h.rate, ds * h.rate * x) : make_float2(ds, 0.f);
  }
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
  int64_t t0;  // first token row
  int n;       // token rows: kRowsPerItem, fewer in a head's last item
  int head;
  __device__ __forceinline__ Item(int64_t item, int heads, int64_t N) {
    const int64_t c = item / heads;
    head = static_cast<int>(item - c * heads);
    t0 = c * kRowsPerItem;
    n = static_cast<int>(t0 + kRowsPerItem < N ? kRowsPerItem : N - t0);
  }
};

// Row i (< kRowsPerItem) of an item in a tensor of one layout: element offset base + i stride. i stride fits in 32
// bits (heads <= 65535), so a batch's rows cost the compiler one 32-bit offset each, shared by every tensor of the
// layout, instead of a 64-bit offset per row and tensor (which spilled at these register budgets).
struct Rows {
  int64_t base;
  int stride;
  __device__ __forceinline__ int64_t at(int i) const { return base + i * stride; }
};
// this lane's four values of the item's rows of head `head` in a [N, heads, 128] tensor
__device__ __forceinline__ Rows row_values(const Item& it, int heads, int head, int lane) {
  return Rows{(it.t0 * heads + head) * kHeadDim + 4 * lane, heads * kHeadDim};
}
// the item's values of head `head` in a [N, heads] tensor
__device__ __forceinline__ Rows row_scalars(const Item& it, int heads, int head) {
  return Rows{it.t0 * heads + head, heads};
}

// A row of a batch past the item's end (the last item of a head) loads nothing: zeros, whose results are computed
// with the other rows' (no branch between the rows' arithmetic) and never stored.
template <class T>
__device__ __forceinline__ typename Row4<T>::Raw load_or_zero(bool valid, const void* base, int64_t off) {
  return valid ? Row4<T>::load(base, off) : typename Row4<T>::Raw{};
}
template <class T>
__device__ __forceinline__ void unpack(const typename Row4<T>::Raw& v, float (&x)[4]) {
  Row4<T>::unpack(v, x);
}

// The q and k rows of an item: normalised, written for the G value heads of their head; the inverse norms to rq, rk.
// A batch is P tokens of q (rows b < P) and the same P tokens of k (rows P + b).
template <class TQ>
__device__ __forceinline__ void normalize_rows(const FwdArgs& a, const Item& it, int lane) {
  const Inputs& in = a.in;
  constexpr int P = kNormFwdTokens<TQ>, R = 2 * P;
  const int G = in.HV / in.H;
  const Rows rows = row_values(it, in.H, it.head, lane), out = row_values(it, in.HV, it.head * G, lane),
             norms = row_scalars(it, in.H, it.head);
  for (int i = 0; i < it.n; i += P) {
    typename Row4<TQ>::Raw raw[R];
#pragma unroll
    for (int b = 0; b < R; ++b) raw[b] = load_or_zero<TQ>(i + b % P < it.n, b < P ? in.q : in.k, rows.at(i + b % P));
    float s[R];
#pragma unroll
    for (int b = 0; b < R; ++b) {
      float x[4];
      unpack<TQ>(raw[b], x);
      s[b] = x[0] * x[0] + x[1] * x[1] + x[2] * x[2] + x[3] * x[3];
    }
    const float mine = warp_sum_rows(s, [](float ss) { return 1.f / sqrtf(ss + kNormEps); });
    {  // lane b (32 / R) holds row b's inverse norm
      const int b = lane / (32 / R);
      if (lane % (32 / R) == 0 && i + b % P < it.n) (b < P ? a.rq : a.rk)[norms.at(i + b % P)] = mine;
    }
#pragma unroll
    for (int b = 0; b < R; ++b) {
      float x[4];
      unpack<TQ>(raw[b], x);
#pragma unroll
      for (int e = 0; e < 4; ++e) x[e] *= s[b];
      if (i + b % P >= it.n) continue;
      // the G copies in a loop: unrolled, their addresses take registers (sm_90a: 66, 7 CTAs per SM instead of 8)
#pragma unroll 1
      for (int j = 0; j < G; ++j) Bf16Row::store(b < P ? a.qn : a.kn, out.at(i + b % P) + j * kHeadDim, x);
    }
  }
}

// The activated gate rows of an item (fp32).
template <int FORM, class TG>
__device__ __forceinline__ void gate_rows(const FwdArgs& a, const Item& it, int lane) {
  const Inputs& in = a.in;
  const GateHead gh(in, it.head, lane);
  constexpr int R = kGateFwdRows<TG>;
  const Rows rows = row_values(it, in.HV, it.head, lane);
  for (int i = 0; i < it.n; i += R) {
    typename Row4<TG>::Raw raw[R];
#pragma unroll
    for (int b = 0; b < R; ++b) raw[b] = load_or_zero<TG>(i + b < it.n, in.g, rows.at(i + b));
#pragma unroll
    for (int b = 0; b < R; ++b) {
      float x[4];
      unpack<TG>(raw[b], x);
#pragma unroll
      for (int e = 0; e < 4; ++e) x[e] = gate_value<FORM>(in, gh, x[e] + gh.bias[e]);
      if (i + b < it.n) Row4<float>::store(a.g_out, rows.at(i + b), x);
    }
  }
}

// The betas of an item, two tokens per lane (t0 + lane and t0 + 32 + lane), both loaded first: sigmoid(beta)
// beta_scale (forward, dbeta_out null) or its chain rule (backward).
template <class TB>
__device__ __forceinline__ void beta_rows(const Inputs& in, const Item& it, int lane, const void* dbeta_out,
                                          void* out) {
  constexpr int kPerLane = kRowsPerItem / 32;
  const Rows betas = row_scalars(it, in.HV, it.head);
  float x[kPerLane], d[kPerLane];
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int i = 32 * k + lane;
    x[k] = i < it.n ? Row4<TB>::load1(in.beta, betas.at(i)) : 0.f;
    d[k] = i < it.n && dbeta_out != nullptr ? Bf16Row::load1(dbeta_out, betas.at(i)) : 0.f;
  }
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int i = 32 * k + lane;
    if (i >= it.n) continue;
    const float s = sigmoid(x[k]);
    if (dbeta_out == nullptr)
      Bf16Row::store1(out, betas.at(i), in.beta_scale * s);
    else
      Row4<TB>::store1(out, betas.at(i), d[k] * in.beta_scale * (1.f - s) * s);
  }
}

template <class TQ, class TG, class TB>
__global__ void __launch_bounds__(kThreads, kCtasPerSm) act_fwd_kernel(const FwdArgs a) {
  const Inputs& in = a.in;
  const WarpItem w(in.N);
  if (in.q != nullptr && w.within(in.H)) normalize_rows<TQ>(a, Item(w.item, in.H, in.N), w.lane);
  if (!w.within(in.HV)) return;
  const Item it(w.item, in.HV, in.N);
  if (in.g != nullptr)
    with_gate_form(in.gate_form, [&](auto form) { gate_rows<decltype(form)::value, TG>(a, it, w.lane); });
  if (in.beta != nullptr) beta_rows<TB>(in, it, w.lane, nullptr, a.beta_out);
}

// The gradients of an item's q and k rows: dy summed over its G value heads (FP32, in head order), then
// (dy - y <y, dy>) r, y = x r recomputed from the raw row and the saved inverse norm. A batch is P tokens of q and
// the same P tokens of k; the gradient rows of one value head are loaded for all rows of the batch at once.
template <class TQ>
__device__ __forceinline__ void normalize_rows_grad(const BwdArgs& a, const Item& it, int lane) {
  const Inputs& in = a.in;
  constexpr int P = kNormBwdTokens, R = 2 * P;
  const int G = in.HV / in.H;
  const Rows rows = row_values(it, in.H, it.head, lane), grad = row_values(it, in.HV, it.head * G, lane),
             norms = row_scalars(it, in.H, it.head);
  for (int i = 0; i < it.n; i += P) {
    typename Row4<TQ>::Raw raw[R];
    float r[R], dy[R][4];
#pragma unroll
    for (int b = 0; b < R; ++b) {
      raw[b] = load_or_zero<TQ>(i + b % P < it.n, b < P ? in.q : in.k, rows.at(i + b % P));
      r[b] = i + b % P < it.n ? __ldg((b < P ? a.rq : a.rk) + norms.at(i + b % P)) : 0.f;
#pragma unroll
      for (int e = 0; e < 4; ++e) dy[b][e] = 0.f;
    }
    for (int j = 0; j < G; ++j) {
      Bf16Row::Raw d[R];
#pragma unroll
      for (int b = 0; b < R; ++b)
        d[b] = load_or_zero<__nv_bfloat16>(i + b % P < it.n, b < P ? a.dqn : a.dkn, grad.at(i + b % P) + j * kHeadDim);
#pragma unroll
      for (int b = 0; b < R; ++b) {
        float dj[4];
        unpack<__nv_bfloat16>(d[b], dj);
#pragma unroll
        for (int e = 0; e < 4; ++e) dy[b][e] += dj[e];
      }
    }
    float x[R][4], dot[R];
#pragma unroll
    for (int b = 0; b < R; ++b) {
      unpack<TQ>(raw[b], x[b]);
#pragma unroll
      for (int e = 0; e < 4; ++e) x[b][e] *= r[b];
      dot[b] = x[b][0] * dy[b][0] + x[b][1] * dy[b][1] + x[b][2] * dy[b][2] + x[b][3] * dy[b][3];
    }
    warp_sum_rows(dot, [](float v) { return v; });
#pragma unroll
    for (int b = 0; b < R; ++b) {
#pragma unroll
      for (int e = 0; e < 4; ++e) dy[b][e] = (dy[b][e] - x[b][e] * dot[b]) * r[b];
      if (i + b % P < it.n) Row4<TQ>::store(b < P ? a.dq : a.dk, rows.at(i + b % P), dy[b]);
    }
  }
}

// The gate's gradient rows of an item and this lane's partial sums of dA_log and ddt_bias over them, in token order
// (then the four channels in order for dA_log), stored per item for torch to sum.
template <int FORM, class TG>
__device__ __forceinline__ void gate_rows_grad(const BwdArgs& a, const Item& it, int64_t item, int lane) {
  const Inputs& in = a.in;
  const GateHead gh(in, it.head, lane);
  constexpr int R = kGateBwdRows<TG>;
  const Rows rows = row_values(it, in.HV, it.head, lane);
  float acc_dt[4] = {0.f, 0.f, 0.f, 0.f}, acc_a = 0.f;
  for (int i = 0; i < it.n; i += R) {
    typename Row4<TG>::Raw raw[R];
    float4 dgo_raw[R];
#pragma unroll
    for (int b = 0; b < R; ++b) {
      raw[b] = load_or_zero<TG>(i + b < it.n, in.g, rows.at(i + b));
      dgo_raw[b] = load_or_zero<float>(i + b < it.n, a.dg_out, rows.at(i + b));
    }
#pragma unroll
    for (int b = 0; b < R; ++b) {
      float x[4], dgo[4], sa[4];  // sa: d gate / dA_log
      unpack<TG>(raw[b], x);
      unpack<float>(dgo_raw[b], dgo);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 s = gate_slopes<FORM>(in, gh, x[e] + gh.bias[e]);
        x[e] = dgo[e] * s.x;
        sa[e] = s.y;
      }
      if (i + b < it.n) {  // a row past the item's end adds nothing to the sums, not even a zero's sign
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          acc_dt[e] += x[e];
          acc_a += dgo[e] * sa[e];
        }
        Row4<TG>::store(a.dg, rows.at(i + b), x);
      }
    }
  }
  const int64_t slot = (item / in.HV) * in.HV + it.head;  // (item index, head) of the partial buffers
  if (a.part_dt != nullptr) Row4<float>::store(a.part_dt, slot * kHeadDim + 4 * lane, acc_dt);
  if (a.part_a != nullptr) {
    acc_a = warp_sum(acc_a);
    if (lane == 0) a.part_a[slot] = acc_a;
  }
}

template <class TQ, class TG, class TB>
__global__ void __launch_bounds__(kThreads, kCtasPerSm) act_bwd_kernel(const BwdArgs a) {
  const Inputs& in = a.in;
  const WarpItem w(in.N);
  if (in.q != nullptr && w.within(in.H)) normalize_rows_grad<TQ>(a, Item(w.item, in.H, in.N), w.lane);
  if (!w.within(in.HV)) return;
  const Item it(w.item, in.HV, in.N);
  if (in.g != nullptr)
    with_gate_form(in.gate_form, [&](auto form) { gate_rows_grad<decltype(form)::value, TG>(a, it, w.item, w.lane); });
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
