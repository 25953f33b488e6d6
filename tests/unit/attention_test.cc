#include <cmath>
#include <limits>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/attention_cpu.h"
#include "kernels/reference.h"
#include "tests/unit/cache_fixture.h"

namespace oscarkv {
namespace {

using testing::CacheFixture;

struct Case {
  int q_heads, kv_heads, dim, group;
  int64_t tokens;
  TierConfig tiers;
};

// The dense fp64 cache the compressed one stands for: exact tiers as stored,
// history dequantized and un-rotated (y^ · Rᵀ) in fp64.
void DequantizedCache(const CacheFixture& f, const LayerCache& layer,
                      const std::vector<bf16_bits>& k, const std::vector<bf16_bits>& v,
                      std::vector<double>* kd, std::vector<double>* vd) {
  const PageGeometry& g = f.geom;
  const size_t row = g.exact_row_elems();
  const int d = g.head_dim;
  const TierCounts c = layer.counts();
  kd->resize(k.size());
  vd->resize(v.size());
  for (size_t i = 0; i < k.size(); ++i) {
    (*kd)[i] = Bf16ToFloat(k[i]);
    (*vd)[i] = Bf16ToFloat(v[i]);
  }
  std::vector<float> y(d);
  for (int p = 0; p < c.pages; ++p) {
    const uint8_t* page = f.pool->page(layer.history_pages()[p]);
    for (int h = 0; h < g.kv_heads; ++h) {
      for (int kind = 0; kind < 2; ++kind) {
        const float* r = kind == 0 ? f.r_k.data() : f.r_v.data();
        std::vector<double>* dst = kind == 0 ? kd : vd;
        for (int t = 0; t < g.page_tokens; ++t) {
          const auto* params =
              reinterpret_cast<const QuantParams*>(page + g.params_offset(h, kind)) +
              t * g.groups();
          DequantizeRow(page + g.codes_offset(h, kind) + t * g.code_row_bytes(), params, d,
                        g.group_size, y.data());
          const int64_t pos = c.sink + int64_t(p) * g.page_tokens + t;
          for (int i = 0; i < d; ++i) {
            double s = 0;
            for (int j = 0; j < d; ++j) s += double(y[j]) * r[size_t(i) * d + j];
            (*dst)[pos * row + h * d + i] = s;
          }
        }
      }
    }
  }
}

double RelErr(const std::vector<float>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num / den);
}

class CompressedAttention : public ::testing::TestWithParam<Case> {};

TEST_P(CompressedAttention, MatchesFp64ReferenceOverDequantizedCache) {
  const Case c = GetParam();
  CacheFixture f(c.kv_heads, c.dim, c.group, c.tiers, 256 << 20, c.tokens);
  const size_t row = f.geom.exact_row_elems();
  const auto k = testing::RandomBf16(c.tokens * row, 31, c.dim, 6.0f);
  const auto v = testing::RandomBf16(c.tokens * row, 32, c.dim, 2.0f);
  LayerCache layer = f.NewLayer();
  ASSERT_TRUE(f.Append(layer, k.data(), v.data(), c.tokens).ok());
  std::vector<double> kd, vd;
  DequantizedCache(f, layer, k, v, &kd, &vd);

  for (int trial = 0; trial < 3; ++trial) {
    const std::vector<float> q = testing::RandomFloats(size_t(c.q_heads) * c.dim, 40 + trial, 0.5f);
    std::vector<float> out(q.size(), std::numeric_limits<float>::quiet_NaN());
    std::vector<float> lse(c.q_heads, std::numeric_limits<float>::quiet_NaN());
    std::vector<ExactBlockRef> exact;
    std::vector<const uint8_t*> pages;
    layer.AttendRefs(*f.pool, &exact, &pages);
    AttendItem item{q.data(), out.data(), lse.data(), f.codec.rotation, exact.data(),
                    int(exact.size()), pages.data(), int(pages.size())};
    const float scale = 1.0f / std::sqrt(float(c.dim));
    AttendBatch batch{f.geom, c.q_heads, scale, &item, 1};
    ASSERT_TRUE(f.backend.Attend(batch).ok());

    std::vector<double> qd(q.begin(), q.end()), want_lse;
    const std::vector<double> want = ReferenceAttention(qd, kd, vd, int(c.tokens), c.q_heads,
                                                        c.kv_heads, c.dim, scale, &want_lse);
    EXPECT_LT(RelErr(out, want), 1e-4) << "tokens=" << c.tokens;
    for (int h = 0; h < c.q_heads; ++h) EXPECT_NEAR(lse[h], want_lse[h], 1e-4) << h;
  }
}

const TierConfig kSmall{8, 16, 4};
INSTANTIATE_TEST_SUITE_P(
    Shapes, CompressedAttention,
    ::testing::Values(Case{8, 8, 64, 32, 30, kSmall},       // GQA 1, history starts
                      Case{8, 1, 128, 32, 5, kSmall},       // only sink
                      Case{32, 8, 128, 128, 1000, kSmall},  // GQA 4, Qwen3-8B head shape
                      Case{16, 2, 256, 64, 400, kSmall},    // GQA 8, D 256
                      Case{32, 8, 128, 128, 2000, TierConfig{}},  // default tiers
                      Case{8, 4, 64, 64, 64 + 256 + 32, TierConfig{}}));

TEST(MergeAttention, TwoPartsEqualOnePass) {
  const int hq = 8, hkv = 2, d = 64, t = 300, split = 123;
  const auto k = testing::RandomBf16(size_t(t) * hkv * d, 1, d);
  const auto v = testing::RandomBf16(size_t(t) * hkv * d, 2, d);
  const auto q = testing::RandomFloats(size_t(hq) * d, 3, 0.3f);
  const float scale = 0.125f;
  std::vector<float> full(hq * d), a(hq * d), b(hq * d), merged(hq * d);
  std::vector<float> lf(hq), la(hq), lb(hq);
  for (int h = 0; h < hkv; ++h) {
    AttendBf16KvHead(k.data(), v.data(), t, hkv, d, hq, scale, q.data(), full.data(), lf.data(), h);
    AttendBf16KvHead(k.data(), v.data(), split, hkv, d, hq, scale, q.data(), a.data(), la.data(), h);
    AttendBf16KvHead(k.data() + size_t(split) * hkv * d, v.data() + size_t(split) * hkv * d,
                     t - split, hkv, d, hq, scale, q.data(), b.data(), lb.data(), h);
  }
  for (int h = 0; h < hq; ++h) {
    float lse;
    MergeAttention(&a[h * d], la[h], &b[h * d], lb[h], d, &merged[h * d], &lse);
    EXPECT_NEAR(lse, lf[h], 1e-4);
    for (int j = 0; j < d; ++j) EXPECT_NEAR(merged[h * d + j], full[h * d + j], 1e-5);
  }
  // An empty side (lse = -inf) leaves the other unchanged.
  float lse;
  std::vector<float> o(d);
  MergeAttention(&a[0], la[0], &b[0], -std::numeric_limits<float>::infinity(), d, o.data(), &lse);
  EXPECT_EQ(lse, la[0]);
  for (int j = 0; j < d; ++j) EXPECT_FLOAT_EQ(o[j], a[j]);
}

TEST(Bf16Attention, MatchesFp64Reference) {
  const int hq = 32, hkv = 8, d = 128, t = 777;
  const auto k = testing::RandomBf16(size_t(t) * hkv * d, 4, d);
  const auto v = testing::RandomBf16(size_t(t) * hkv * d, 5, d);
  const auto q = testing::RandomFloats(size_t(hq) * d, 6, 0.3f);
  const float scale = 1.0f / std::sqrt(128.0f);
  std::vector<float> out(hq * d), lse(hq);
  for (int h = 0; h < hkv; ++h)
    AttendBf16KvHead(k.data(), v.data(), t, hkv, d, hq, scale, q.data(), out.data(), lse.data(), h);
  std::vector<double> kd(k.size()), vd(v.size()), qd(q.begin(), q.end()), want_lse;
  for (size_t i = 0; i < k.size(); ++i) {
    kd[i] = Bf16ToFloat(k[i]);
    vd[i] = Bf16ToFloat(v[i]);
  }
  const auto want = ReferenceAttention(qd, kd, vd, t, hq, hkv, d, scale, &want_lse);
  EXPECT_LT(RelErr(out, want), 1e-5);
  for (int h = 0; h < hq; ++h) EXPECT_NEAR(lse[h], want_lse[h], 1e-4);
}

TEST(CpuBackend, AttendRejectsBadShapes) {
  CpuBackend backend(1);
  AttendBatch batch{PageGeometry{8, 96, 32, 32}, 32, 0.1f, nullptr, 0};
  absl::Status s = backend.Attend(batch);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("head_dim"));
  batch.geom = PageGeometry{8, 128, 48, 32};
  EXPECT_THAT(std::string(backend.Attend(batch).message()), ::testing::HasSubstr("group_size"));
  batch.geom = PageGeometry{8, 128, 128, 32};
  batch.num_q_heads = 12;
  EXPECT_THAT(std::string(backend.Attend(batch).message()), ::testing::HasSubstr("multiple"));
}

TEST(CpuBackend, AttendRejectsNonFiniteQuery) {
  CacheFixture f(2, 64, 64, TierConfig{8, 16, 4});
  const size_t row = f.geom.exact_row_elems();
  const auto k = testing::RandomBf16(50 * row, 1, 64), v = testing::RandomBf16(50 * row, 2, 64);
  LayerCache layer = f.NewLayer();
  ASSERT_TRUE(f.Append(layer, k.data(), v.data(), 50).ok());
  std::vector<ExactBlockRef> exact;
  std::vector<const uint8_t*> pages;
  layer.AttendRefs(*f.pool, &exact, &pages);
  std::vector<float> q(4 * 64, 0.1f), out(4 * 64, -7.0f);
  q[77] = std::numeric_limits<float>::infinity();
  AttendItem item{q.data(), out.data(), nullptr, f.codec.rotation, exact.data(),
                  int(exact.size()), pages.data(), int(pages.size())};
  const absl::Status s = f.backend.Attend(AttendBatch{f.geom, 4, 0.125f, &item, 1});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("index 77"));
  EXPECT_EQ(out[0], -7.0f);  // nothing written
}

TEST(ValidateQuery, NamesTheFirstNonFiniteIndexAndAcceptsEveryFiniteValue) {
  const float kInf = std::numeric_limits<float>::infinity();
  std::vector<float> q(1000, 0.5f);
  q[1] = std::numeric_limits<float>::max();
  q[2] = -std::numeric_limits<float>::max();
  q[3] = std::numeric_limits<float>::denorm_min();
  q[4] = -0.0f;
  EXPECT_TRUE(ValidateQuery(q.data(), q.size()).ok());
  for (size_t at : {size_t{0}, size_t{513}, size_t{999}}) {
    for (float bad : {std::numeric_limits<float>::quiet_NaN(), kInf, -kInf}) {
      std::vector<float> b = q;
      b[at] = bad;
      if (at + 7 < b.size()) b[at + 7] = kInf;  // only the first one is named
      const absl::Status s = ValidateQuery(b.data(), b.size());
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
      EXPECT_EQ(s.message(), "query contains a non-finite value at index " + std::to_string(at));
    }
  }
  EXPECT_EQ(ValidateQuery(nullptr, 4).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(ValidateQuery(q.data(), 0).ok());
}

TEST(CpuBackend, DecodeInvertsEncodeWithinQuantizationError) {
  CacheFixture f(4, 128, 128, TierConfig{0, 0, 16});
  const size_t row = f.geom.exact_row_elems();
  const auto block = testing::RandomBf16(2 * 16 * row, 9, 128, 1.0f);  // K then V
  auto res = f.pool->Reserve(1, 2);
  ASSERT_TRUE(res.ok());
  bf16_bits* src = f.pool->block(res->TakeBlock());
  bf16_bits* dst = f.pool->block(res->TakeBlock());
  std::copy(block.begin(), block.end(), src);
  uint8_t* page = f.pool->page(res->TakePage());
  EncodeJob ej{src, page, f.codec.rotation, 1.0f, 1.0f};
  ASSERT_TRUE(f.backend.EncodePages(f.geom, &ej, 1).ok());
  DecodeJob dj{page, dst, f.codec.rotation};
  ASSERT_TRUE(f.backend.DecodePages(f.geom, &dj, 1).ok());
  double num = 0, den = 0;
  for (size_t i = 0; i < block.size(); ++i) {
    const double x = Bf16ToFloat(block[i]), y = Bf16ToFloat(dst[i]);
    num += (x - y) * (x - y);
    den += x * x;
  }
  // INT2 of Gaussian rows, one group of 128, no clipping: the range is about 5 sigma, the
  // step 5/3 sigma, the uniform rounding error step/sqrt(12) ~ 0.48 sigma.
  EXPECT_LT(std::sqrt(num / den), 0.55);
  EXPECT_GT(std::sqrt(num / den), 0.05);  // it really was quantized
}

}  // namespace
}  // namespace oscarkv
