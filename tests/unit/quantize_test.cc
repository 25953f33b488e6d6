#include "kernels/quantize.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/hadamard.h"
#include "kernels/layout.h"
#include "tests/unit/test_util.h"

namespace oscarkv {
namespace {

struct Shape {
  int dim;
  int group;
};

class QuantizeShapes : public ::testing::TestWithParam<Shape> {};

// The fp16 rounding of (s, lo) can move the grid by |lo|·2^-11 + 3·|s|·2^-11.
float Slack(const QuantParams& p) {
  return (std::fabs(Fp16ToFloat(p.min)) + 3 * std::fabs(Fp16ToFloat(p.scale))) * 1e-3f + 1e-6f;
}

TEST_P(QuantizeShapes, EveryElementWithinHalfAStepOfClippedInput) {
  const auto [d, g] = GetParam();
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<float> y = testing::RandomFloats(d, 100 * d + g + trial, 1.0f + trial);
    std::vector<float> scratch(d);
    ClipRow(y.data(), d, 0.9f, scratch.data());
    std::vector<uint8_t> codes(d / 4);
    std::vector<QuantParams> params(d / g);
    QuantizeRow(y.data(), d, g, codes.data(), params.data());
    std::vector<float> out(d);
    DequantizeRow(codes.data(), params.data(), d, g, out.data());
    for (int j = 0; j < d; ++j) {
      const QuantParams p = params[j / g];
      const float step = Fp16ToFloat(p.scale);
      ASSERT_LE(std::fabs(out[j] - y[j]), 0.5f * step + Slack(p))
          << "d=" << d << " g=" << g << " j=" << j;
    }
  }
}

TEST_P(QuantizeShapes, ParamsAreMinAndRangeOverThreeInFp16) {
  const auto [d, g] = GetParam();
  std::vector<float> y = testing::RandomFloats(d, 5 + d + g);
  std::vector<uint8_t> codes(d / 4);
  std::vector<QuantParams> params(d / g);
  QuantizeRow(y.data(), d, g, codes.data(), params.data());
  for (int gi = 0; gi < d / g; ++gi) {
    const float lo = *std::min_element(y.begin() + gi * g, y.begin() + (gi + 1) * g);
    const float hi = *std::max_element(y.begin() + gi * g, y.begin() + (gi + 1) * g);
    EXPECT_EQ(params[gi].min, FloatToFp16(lo));
    EXPECT_EQ(params[gi].scale, FloatToFp16((hi - lo) / 3.0f));
  }
}

TEST_P(QuantizeShapes, PackUnpackRoundTrip) {
  const auto [d, g] = GetParam();
  // Codes 0..3 in every position: quantize a ramp whose group min/max are known.
  std::vector<float> y(d);
  for (int j = 0; j < d; ++j) y[j] = float(j % 4);
  std::vector<uint8_t> codes(d / 4);
  std::vector<QuantParams> params(d / g);
  QuantizeRow(y.data(), d, g, codes.data(), params.data());
  std::vector<uint8_t> q(d);
  UnpackRow(codes.data(), d, q.data());
  for (int j = 0; j < d; ++j) ASSERT_EQ(q[j], j % 4) << j;
  // The layout of DESIGN section 2: byte j = q[j] | q[j+D/4]<<2 | q[j+D/2]<<4 | q[j+3D/4]<<6.
  const int quarter = d / 4;
  for (int j = 0; j < quarter; ++j) {
    const uint8_t want = uint8_t(q[j] | q[j + quarter] << 2 | q[j + 2 * quarter] << 4 |
                                 q[j + 3 * quarter] << 6);
    ASSERT_EQ(codes[j], want);
  }
}

// DESIGN section 2 step 3 written out plainly: QuantizeRow (vectorized where
// the host allows) must give the same codes and parameters, bit for bit.
TEST_P(QuantizeShapes, SameBitsAsThePlainDefinition) {
  const auto [d, g] = GetParam();
  for (int seed = 0; seed < 20; ++seed) {
    const std::vector<float> y = testing::RandomFloats(d, 100 + seed, seed % 2 ? 0.01f : 8.0f);
    std::vector<uint8_t> codes(d / 4), want_codes(d / 4);
    std::vector<QuantParams> params(d / g), want_params(d / g);
    QuantizeRow(y.data(), d, g, codes.data(), params.data());
    std::vector<uint8_t> q(d);
    for (int g0 = 0; g0 < d; g0 += g) {
      float lo = y[g0], hi = y[g0];
      for (int j = g0; j < g0 + g; ++j) {
        lo = std::min(lo, y[j]);
        hi = std::max(hi, y[j]);
      }
      const QuantParams p{FloatToFp16(std::max(hi - lo, kMinRange) / 3.0f), FloatToFp16(lo)};
      want_params[g0 / g] = p;
      const float sq = Fp16ToFloat(p.scale), loq = Fp16ToFloat(p.min);
      for (int j = g0; j < g0 + g; ++j) {
        q[j] = uint8_t(std::min(std::max(std::rint((y[j] - loq) * (1.0f / sq)), 0.0f), 3.0f));
      }
    }
    for (int j = 0; j < d / 4; ++j) {
      want_codes[j] = PackCodes4(q[j], q[j + d / 4], q[j + d / 2], q[j + 3 * d / 4]);
    }
    ASSERT_EQ(codes, want_codes) << "seed " << seed;
    for (int i = 0; i < d / g; ++i) {
      ASSERT_EQ(params[i].scale, want_params[i].scale) << "seed " << seed << " group " << i;
      ASSERT_EQ(params[i].min, want_params[i].min) << "seed " << seed << " group " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllShapes, QuantizeShapes,
                         ::testing::Values(Shape{64, 32}, Shape{64, 64}, Shape{128, 32},
                                           Shape{128, 64}, Shape{128, 128}, Shape{256, 32},
                                           Shape{256, 64}, Shape{256, 128}, Shape{256, 256}));

TEST(Clip, RatioOneLeavesRowUnchanged) {
  std::vector<float> y = testing::RandomFloats(128, 3, 4.0f);
  std::vector<float> before = y, scratch(128);
  ClipRow(y.data(), 128, 1.0f, scratch.data());
  EXPECT_EQ(y, before);
  EXPECT_EQ(ClipThreshold(before.data(), 128, 1.0f, scratch.data()),
            std::fabs(*std::max_element(before.begin(), before.end(),
                                        [](float a, float b) { return std::fabs(a) < std::fabs(b); })));
}

TEST(Clip, ThresholdIsCeilRankOfAbsoluteValues) {
  std::vector<float> y(128);
  for (int j = 0; j < 128; ++j) y[j] = (j % 2 ? -1.0f : 1.0f) * float(j + 1);
  std::vector<float> scratch(128);
  // ceil(0.96 * 128) = 123 -> the 123rd smallest |y| is 123.
  EXPECT_EQ(ClipRank(0.96f, 128), 123);
  EXPECT_EQ(ClipThreshold(y.data(), 128, 0.96f, scratch.data()), 123.0f);
  ClipRow(y.data(), 128, 0.96f, scratch.data());
  EXPECT_EQ(*std::max_element(y.begin(), y.end()), 123.0f);
  EXPECT_EQ(*std::min_element(y.begin(), y.end()), -123.0f);
}

TEST(Quantize, ConstantRowDequantizesExactly) {
  std::vector<float> y(128, 0.5f);
  std::vector<uint8_t> codes(32);
  std::vector<QuantParams> params(1);
  QuantizeRow(y.data(), 128, 128, codes.data(), params.data());
  std::vector<float> out(128);
  DequantizeRow(codes.data(), params.data(), 128, 128, out.data());
  for (float x : out) EXPECT_FLOAT_EQ(x, 0.5f);
}

TEST(Numeric, Bf16RoundTripAndRounding) {
  for (float x : {0.0f, 1.0f, -2.5f, 3.14159f, 1e-30f, 6.5e4f}) {
    const float r = Bf16ToFloat(FloatToBf16(x));
    EXPECT_NEAR(r, x, std::fabs(x) * 0.0079f) << x;
  }
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(FloatToBf16(1.0f + 1.0f / 256), FloatToBf16(1.0f));  // ties to even
}

TEST(Numeric, Fp16MatchesIeeeHalf) {
  EXPECT_EQ(FloatToFp16(1.0f), 0x3c00);
  EXPECT_EQ(FloatToFp16(-2.0f), 0xc000);
  EXPECT_EQ(FloatToFp16(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToFp16(1e6f), 0x7c00);
  EXPECT_EQ(FloatToFp16(5.9604645e-8f), 0x0001);  // smallest subnormal
  for (float x : {0.1f, -0.3333f, 1234.5f, 1e-5f, 7e-3f}) {
    EXPECT_NEAR(Fp16ToFloat(FloatToFp16(x)), x, std::fabs(x) * 1e-3f + 6e-8f) << x;
  }
  for (uint32_t h = 0; h < 0x7c00; h += 7) {  // every finite positive half round-trips
    ASSERT_EQ(FloatToFp16(Fp16ToFloat(static_cast<fp16_bits>(h))), h) << h;
  }
}

TEST(Layout, RejectsBadShapesWithClearMessages) {
  ModelLayout l{36, 32, 8, 96};
  auto s = ValidateLayout(l);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("head_dim"));
  l.head_dim = 128;
  l.num_q_heads = 30;
  s = ValidateLayout(l);
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("multiple of num_kv_heads"));
  l.num_q_heads = 32;
  EXPECT_TRUE(ValidateLayout(l).ok());
  int g = 48;
  s = ResolveGroupSize(128, &g);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("must divide head_dim"));
  g = 0;
  EXPECT_TRUE(ResolveGroupSize(128, &g).ok());
  EXPECT_EQ(g, 128);
  EXPECT_FALSE(ValidateClipRatio(0.0f, "key").ok());
  EXPECT_FALSE(ValidateClipRatio(std::nanf(""), "key").ok());
  EXPECT_FALSE(ValidateTiers(TierConfig{64, 256, 0}).ok());
}

TEST(Clip, ThresholdReturnsForRowsWithNaN) {
  // Validated ingest never has one, but a rotation can overflow; the
  // selection must still end (its answer is then not meaningful).
  std::vector<float> scratch(256);
  for (int pos : {0, 5, 77, 127}) {
    std::vector<float> y = testing::RandomFloats(128, 11, 2.0f);
    y[pos] = std::numeric_limits<float>::quiet_NaN();
    (void)ClipThreshold(y.data(), 128, 0.92f, scratch.data());
    for (int i = 0; i < 128; i += 3) y[i] = std::numeric_limits<float>::quiet_NaN();
    (void)ClipThreshold(y.data(), 128, 0.96f, scratch.data());
  }
  SUCCEED();
}

// The fast selection path must agree with a full sort for every ratio and shape.
TEST(Clip, ThresholdMatchesFullSortForAllRatios) {
  for (int d : {64, 128, 256}) {
    for (int trial = 0; trial < 30; ++trial) {
      std::vector<float> y = testing::RandomFloats(d, 1000 + 37 * d + trial, 1.0f + trial % 5);
      if (trial % 3 == 0) y[trial % d] = y[(trial + 1) % d];  // ties
      std::vector<float> sorted(d), scratch(d);
      for (int j = 0; j < d; ++j) sorted[j] = std::fabs(y[j]);
      std::sort(sorted.begin(), sorted.end());
      for (float ratio : {0.5f, 0.8f, 0.9f, 0.92f, 0.96f, 0.99f, 1.0f}) {
        const int k = ClipRank(ratio, d);
        ASSERT_EQ(ClipThreshold(y.data(), d, ratio, scratch.data()), sorted[k - 1])
            << "d=" << d << " ratio=" << ratio << " trial=" << trial;
      }
    }
  }
}

// Rows of few distinct magnitudes (runs of ties across the lane maxima, the
// bound and the candidates), signed zeros and one-value rows: the selection
// must still give the full sort's element.
TEST(Clip, ThresholdMatchesFullSortOnRowsOfTies) {
  for (int d : {64, 128, 256}) {
    for (int levels : {1, 2, 3, 7}) {
      std::vector<float> y = testing::RandomFloats(d, 500 + d + levels, 1.0f);
      for (int j = 0; j < d; ++j) {
        const float q = std::round(std::fabs(y[j]) * levels) / levels;
        y[j] = (j % 3 == 0 ? -1.0f : 1.0f) * q;  // -0.0f where q is 0
      }
      std::vector<float> sorted(d), scratch(d);
      for (int j = 0; j < d; ++j) sorted[j] = std::fabs(y[j]);
      std::sort(sorted.begin(), sorted.end());
      for (float ratio : {0.5f, 0.9f, 0.92f, 0.96f, 0.99f}) {
        const int k = ClipRank(ratio, d);
        ASSERT_EQ(ClipThreshold(y.data(), d, ratio, scratch.data()), sorted[k - 1])
            << "d=" << d << " levels=" << levels << " ratio=" << ratio;
      }
    }
  }
}

}  // namespace
}  // namespace oscarkv
