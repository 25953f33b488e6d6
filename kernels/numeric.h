// BF16 and FP16 conversions shared by host and device code.
//
// Storage types are plain uint16_t so that the same structs compile under g++
// and nvcc without cuda_bf16.h. Conversions round to nearest even, like the
// hardware; NaN stays NaN.
#ifndef OSCARKV_KERNELS_NUMERIC_H_
#define OSCARKV_KERNELS_NUMERIC_H_

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define OSCARKV_HD __host__ __device__ __forceinline__
#define OSCARKV_HDC __host__ __device__ constexpr
#else
#define OSCARKV_HD inline
#define OSCARKV_HDC constexpr
#endif

namespace oscarkv {

using bf16_bits = uint16_t;  // raw bfloat16
using fp16_bits = uint16_t;  // raw IEEE half

OSCARKV_HD uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

OSCARKV_HD float BitsToFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

OSCARKV_HD float Bf16ToFloat(bf16_bits b) { return BitsToFloat(static_cast<uint32_t>(b) << 16); }

OSCARKV_HD bf16_bits FloatToBf16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16_bits>((u >> 16) | 0x40u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<bf16_bits>(u >> 16);
}

// IEEE half from float, round to nearest even, overflow to inf.
OSCARKV_HD fp16_bits FloatToFp16(float f) {
  uint32_t x = FloatBits(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t absx = x & 0x7fffffffu;
  if (absx >= 0x7f800000u) return static_cast<fp16_bits>(sign | (absx > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (absx >= 0x477ff000u) return static_cast<fp16_bits>(sign | 0x7c00u);  // rounds to >= 65520
  if (absx < 0x38800000u) {  // subnormal half (or zero)
    // value = absx as float; half subnormal unit = 2^-24.
    float a = BitsToFloat(absx);
    // Round a / 2^-24 to nearest even integer using float arithmetic (exact for this range).
    float scaled = a * 16777216.0f;
    uint32_t m = static_cast<uint32_t>(scaled);
    float frac = scaled - static_cast<float>(m);
    if (frac > 0.5f || (frac == 0.5f && (m & 1u))) ++m;
    return static_cast<fp16_bits>(sign | m);
  }
  uint32_t exp = ((absx >> 23) - 127 + 15) << 10;
  uint32_t mant = absx & 0x7fffffu;
  uint32_t h = exp | (mant >> 13);
  uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<fp16_bits>(sign | h);
}

OSCARKV_HD float Fp16ToFloat(fp16_bits h) {
  uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    float v = static_cast<float>(mant) * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  if (exp == 31) return BitsToFloat(sign | 0x7f800000u | (mant << 13));
  return BitsToFloat(sign | ((exp - 15 + 127) << 23) | (mant << 13));
}

// 2^k, exactly as ldexpf(1.0f, k): subnormal below 2^-126, 0 below 2^-149,
// +inf above 2^127, from bit patterns (the CUDA attention prep kernel's
// digit scales: no library range code on its critical path).
OSCARKV_HD float Exp2Int(int k) {
  if (k > 127) return BitsToFloat(0x7f800000u);
  if (k >= -126) return BitsToFloat(static_cast<uint32_t>(k + 127) << 23);
  if (k >= -149) return BitsToFloat(1u << (k + 149));
  return 0.0f;
}

// The exponent e of frexpf(x, &e) for a finite x > 0 (x = f·2^e, f in
// [0.5, 1)), subnormal x included.
OSCARKV_HD int FrexpExponent(float x) {
  const uint32_t bits = FloatBits(x);
  const int biased = static_cast<int>(bits >> 23);
  if (biased != 0) return biased - 126;
#if defined(__CUDA_ARCH__)
  const int lz = __clz(static_cast<int>(bits));
#else
  const int lz = __builtin_clz(bits);  // bits != 0: x > 0
#endif
  return (32 - lz) - 149;
}

}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_NUMERIC_H_
