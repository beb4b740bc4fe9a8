// CPU emulation of the cuda_fp16.h pieces the kernels use: the type, and conversions that round to nearest
// even as the hardware's cvt.rn (g++'s _Float16, a correctly rounded software conversion on x86-64).
#pragma once
#include <cstdint>
#include <cstring>
#include <vector>
struct __half { uint16_t x; };
inline uint16_t f32_to_f16_bits(float f) { _Float16 h = static_cast<_Float16>(f); uint16_t u; std::memcpy(&u, &h, 2); return u; }
// fp16 to float by a table of all 65,536 values (the emulated mma decodes every operand of the warp per product)
inline const std::vector<float> g_f16_values = [] {
  std::vector<float> t(65536);
  for (uint32_t u = 0; u < 65536; ++u) {
    const uint16_t b = static_cast<uint16_t>(u);
    _Float16 h;
    std::memcpy(&h, &b, 2);
    t[u] = static_cast<float>(h);
  }
  return t;
}();
inline float f16_bits_to_f32(uint16_t u) { return g_f16_values[u]; }
