// The bit-level float helpers of kernels/numeric.h that the CUDA attention
// prep kernel uses for its digit scales (FrexpExponent, Exp2Int), against
// the C library's frexpf and ldexpf: every exponent, subnormals, the range
// ends, and random values.
#include "kernels/numeric.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

namespace oscarkv {
namespace {

TEST(Exp2Int, IsLdexpOfOneForEveryExponentInAndOutOfRange) {
  for (int k = -400; k <= 400; ++k) {
    const float want = std::ldexp(1.0f, k);
    EXPECT_EQ(FloatBits(Exp2Int(k)), FloatBits(want)) << "k " << k;
  }
}

TEST(FrexpExponent, IsFrexpsExponentForNormalsSubnormalsAndRandomValues) {
  auto check = [](float x) {
    int want = 0;
    std::frexp(x, &want);
    ASSERT_EQ(FrexpExponent(x), want) << "x " << x << " bits " << FloatBits(x);
  };
  // Every power of two and its neighbours, from the smallest subnormal up.
  for (int k = -149; k <= 127; ++k) {
    const float p = std::ldexp(1.0f, k);
    check(p);
    check(std::nextafter(p, 0.0f) > 0.0f ? std::nextafter(p, 0.0f) : p);
    check(std::nextafter(p, std::numeric_limits<float>::infinity()));
  }
  check(std::numeric_limits<float>::max());
  check(std::numeric_limits<float>::min());
  check(std::numeric_limits<float>::denorm_min());
  // Every subnormal bit pattern's leading bit position, and random bits.
  for (uint32_t b = 1; b < (1u << 23); b = b * 3 + 1) check(BitsToFloat(b));
  std::mt19937 rng(27);
  for (int i = 0; i < 200000; ++i) {
    const uint32_t bits = rng() & 0x7fffffffu;
    const float x = BitsToFloat(bits);
    if (x > 0.0f && std::isfinite(x)) check(x);
  }
}

}  // namespace
}  // namespace oscarkv
