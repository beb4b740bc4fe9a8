// CPU emulation of the cuda_fp16.h pieces the kernels use: the type, and conversions that round to nearest
// even as the hardware's cvt.rn (g++'s _Float16, a correctly rounded software conversion on x86-64).
#pragma once
#include <cstdint>
#include <cstring>
struct __half { uint16_t x; };
inline uint16_t f32_to_f16_bits(float f) { _Float16 h = static_cast<_Float16>(f); uint16_t u; std::memcpy(&u, &h, 2); return u; }
inline float f16_bits_to_f32(uint16_t u) { _Float16 h; std::memcpy(&h, &u, 2); return static_cast<float>(h); }
