// CPU emulation of the cuda_bf16.h pieces the kernels use (round to nearest even, as the hardware).
#pragma once
#include <cuda_runtime.h>  // the vector types
#include <cmath>
#include <cstdint>
#include <cstring>
struct __nv_bfloat16 { uint16_t x; };
struct __nv_bfloat162 { __nv_bfloat16 x, y; };
inline float __bfloat162float(__nv_bfloat16 b) { uint32_t u = uint32_t(b.x) << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u; std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffff) > 0x7f800000) return {uint16_t((u >> 16) | 0x40)};
  uint32_t r = u + 0x7fff + ((u >> 16) & 1);
  return {uint16_t(r >> 16)};
}
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)}; }
inline float2 __bfloat1622float2(__nv_bfloat162 v) { return {__bfloat162float(v.x), __bfloat162float(v.y)}; }
// fma.rn.bf16x2 as an FP32 fma rounded to bf16 (the hardware rounds once: the two differ only in a tie of the double
// rounding, which kda_status.cuh's products by zero never meet)
inline __nv_bfloat162 __hfma2(__nv_bfloat162 a, __nv_bfloat162 b, __nv_bfloat162 c) {
  return {__float2bfloat16_rn(std::fma(__bfloat162float(a.x), __bfloat162float(b.x), __bfloat162float(c.x))),
          __float2bfloat16_rn(std::fma(__bfloat162float(a.y), __bfloat162float(b.y), __bfloat162float(c.y)))};
}
