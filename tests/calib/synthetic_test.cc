#include "kernels/calib/synthetic.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/calib/calibrate.h"
#include "kernels/calib/rotationzoo.h"
#include "kernels/calib/safetensors.h"
#include "kernels/numeric.h"

namespace oscarkv {
namespace {

SyntheticSpec SpecOf(int q_heads, int kv_heads, int head_dim, int tokens, uint64_t seed) {
  SyntheticSpec s;
  s.num_q_heads = q_heads;
  s.num_kv_heads = kv_heads;
  s.head_dim = head_dim;
  s.tokens = tokens;
  s.num_queries = 4;
  s.seed = seed;
  return s;
}

SyntheticSpec SmallSpec() { return SpecOf(8, 2, 64, 512, 7); }

// Scaled logits of query row r, q head i over all tokens.
std::vector<double> Logits(const SyntheticLayer& l, int r, int i) {
  const int d = l.head_dim, h = i / (l.num_q_heads / l.num_kv_heads);
  std::vector<double> out(l.tokens);
  const float* q = &l.q[(size_t(r) * l.num_q_heads + i) * d];
  for (int t = 0; t < l.tokens; ++t) {
    const uint16_t* k = &l.k[(size_t(t) * l.num_kv_heads + h) * d];
    double dot = 0;
    for (int j = 0; j < d; ++j) dot += double(q[j]) * Bf16ToFloat(k[j]);
    out[t] = dot / std::sqrt(double(d));
  }
  return out;
}

TEST(Synthetic, IsDeterministicGivenSeedAndLayer) {
  auto a = GenerateSyntheticLayer(SmallSpec(), 3);
  auto b = GenerateSyntheticLayer(SmallSpec(), 3);
  auto c = GenerateSyntheticLayer(SmallSpec(), 4);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(a->k, b->k);
  EXPECT_EQ(a->v, b->v);
  EXPECT_EQ(a->q, b->q);
  EXPECT_EQ(a->needle, b->needle);
  EXPECT_NE(a->k, c->k);
}

// The heads are generated on threads of their own; the output must be the
// same bits as when they ran one after another (the value below was computed
// with the sequential generator before the heads went parallel).
TEST(Synthetic, ParallelHeadsGiveTheSequentialBits) {
  SyntheticSpec s = SpecOf(32, 8, 128, 2048, 11);
  s.plant_needle = true;
  auto l = GenerateSyntheticLayer(s, 5);
  ASSERT_TRUE(l.ok()) << l.status();
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the bytes of k, v, q
  auto fnv = [&h](const auto& vec) {
    const auto* p = reinterpret_cast<const unsigned char*>(vec.data());
    for (size_t i = 0; i < vec.size() * sizeof(vec[0]); ++i) {
      h ^= p[i];
      h *= 1099511628211ull;
    }
  };
  fnv(l->k);
  fnv(l->v);
  fnv(l->q);
  EXPECT_EQ(h, 0x0894b9219867fdf0ull);
  EXPECT_EQ(l->needle, 1046);
}

TEST(Synthetic, HasDeclaredShapes) {
  auto l = GenerateSyntheticLayer(SmallSpec(), 0);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->k.size(), 512u * 2 * 64);
  EXPECT_EQ(l->v.size(), 512u * 2 * 64);
  EXPECT_EQ(l->q.size(), 4u * 8 * 64);
  EXPECT_GE(l->needle, 128);
  EXPECT_LT(l->needle, 384);
}

TEST(Synthetic, SampleSeedChangesTokensButNotOutlierChannels) {
  SyntheticSpec s = SmallSpec();
  auto a = GenerateSyntheticLayer(s, 0);
  s.sample_seed = 1;
  auto b = GenerateSyntheticLayer(s, 0);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(a->k, b->k);
  // Per-channel mean |k| of head 0: the top channels are the same in both draws.
  auto top = [](const SyntheticLayer& l) {
    std::vector<double> m(l.head_dim, 0);
    for (int t = 1; t < l.tokens; ++t)
      for (int j = 0; j < l.head_dim; ++j)
        m[j] += std::fabs(Bf16ToFloat(l.k[(size_t(t) * l.num_kv_heads) * l.head_dim + j]));
    std::vector<int> idx(l.head_dim);
    for (int j = 0; j < l.head_dim; ++j) idx[j] = j;
    std::sort(idx.begin(), idx.end(), [&](int x, int y) { return m[x] > m[y]; });
    idx.resize(4);
    std::sort(idx.begin(), idx.end());
    return idx;
  };
  EXPECT_EQ(top(*a), top(*b));
}

TEST(Synthetic, OutlierChannelsDominateKeyMagnitude) {
  auto l = GenerateSyntheticLayer(SmallSpec(), 1);
  ASSERT_TRUE(l.ok());
  std::vector<double> m(64, 0);
  for (int t = 1; t < l->tokens; ++t)
    for (int j = 0; j < 64; ++j) m[j] += std::fabs(Bf16ToFloat(l->k[(size_t(t) * 2) * 64 + j]));
  std::vector<double> sorted = m;
  std::sort(sorted.begin(), sorted.end(), std::greater<double>());
  const double median = sorted[32];
  EXPECT_GT(sorted[3], 4 * median);  // 4 outlier channels well above the bulk
}

TEST(Synthetic, SinkTakesLargeAttentionAndNeedleIsTopForItsQuery) {
  auto l = GenerateSyntheticLayer(SmallSpec(), 2);
  ASSERT_TRUE(l.ok());
  double sink_mass = 0;
  for (int r = 1; r < l->num_queries; ++r) {
    for (int i = 0; i < l->num_q_heads; ++i) {
      std::vector<double> z = Logits(*l, r, i);
      const double mx = *std::max_element(z.begin(), z.end());
      double sum = 0;
      for (double x : z) sum += std::exp(x - mx);
      sink_mass += std::exp(z[0] - mx) / sum;
    }
  }
  sink_mass /= (l->num_queries - 1) * l->num_q_heads;
  EXPECT_GT(sink_mass, 0.1) << "mean attention on the sink token";
  int top_is_needle = 0;
  for (int i = 0; i < l->num_q_heads; ++i) {
    std::vector<double> z = Logits(*l, l->needle_query, i);
    const int arg = int(std::max_element(z.begin(), z.end()) - z.begin());
    top_is_needle += arg == l->needle;
  }
  EXPECT_GE(top_is_needle, l->num_q_heads - 1);
}

TEST(Synthetic, GeneratesThirtyTwoKTokensQuickly) {
  SyntheticSpec s;
  s.tokens = 32768;
  s.num_q_heads = 32;
  s.num_kv_heads = 8;
  s.head_dim = 128;
  const auto t0 = std::chrono::steady_clock::now();
  auto l = GenerateSyntheticLayer(s, 0);
  const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(l.ok());
#ifdef NDEBUG
  const double limit = 2.0;  // ~0.45 s in a Release build on the 2-vCPU dev VM
#else
  const double limit = 20.0;  // Debug / sanitizer builds
#endif
  EXPECT_LT(sec, limit) << "generation took " << sec << " s";
}

TEST(Synthetic, RealQueryCovarianceFromRotationZooShapesTheQueries) {
  auto bytes = ReadFileBytes(std::string(OSCARKV_ROTATIONZOO_DIR) + "/k_rotation_qqt_r_h_pbr.pt");
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  auto zoo = ParseRotationZoo(*bytes);
  ASSERT_TRUE(zoo.ok()) << zoo.status();
  const int layer = 10, d = 128;
  auto u = QueryBasisFromRotation(zoo->rotation[layer], zoo->eigenvalues[layer], d);
  ASSERT_TRUE(u.ok());
  SyntheticSpec s;
  s.num_q_heads = 4;
  s.num_kv_heads = 1;
  s.tokens = 64;
  s.num_queries = 1500;
  s.query_outlier_mean = 0;  // centered queries: their covariance is the real one
  s.query_basis = *u;
  s.query_eigenvalues.assign(zoo->eigenvalues[layer].begin(), zoo->eigenvalues[layer].end());
  auto l = GenerateSyntheticLayer(s, 0);
  ASSERT_TRUE(l.ok()) << l.status();
  // Top eigenvector of the queries' second moment vs the real top eigenvector.
  const int top = int(std::max_element(s.query_eigenvalues.begin(), s.query_eigenvalues.end()) -
                      s.query_eigenvalues.begin());
  std::vector<double> c(d * d, 0.0);
  for (int r = 0; r < s.num_queries * 4; ++r)
    for (int i = 0; i < d; ++i)
      for (int j = 0; j < d; ++j) c[i * d + j] += double(l->q[r * d + i]) * l->q[r * d + j];
  auto es = SymmetricEigen(c, d);
  ASSERT_TRUE(es.ok());
  double dot = 0;
  for (int i = 0; i < d; ++i) dot += es->u[i * d + 0] * (*u)[i * d + top];
  EXPECT_GT(std::fabs(dot), 0.95);
}

TEST(Synthetic, KnobsOverrideByName) {
  SyntheticSpec s;
  ASSERT_TRUE(SetSyntheticKnobs(&s, "key_private_std=2.5,latent_rank=3").ok());
  EXPECT_EQ(s.key_private_std, 2.5f);
  EXPECT_EQ(s.latent_rank, 3);
  EXPECT_THAT(SetSyntheticKnobs(&s, "nope=1").message(), testing::HasSubstr("unknown"));
  EXPECT_FALSE(SetSyntheticKnobs(&s, "latent_rank=1.5").ok());
  EXPECT_FALSE(SetSyntheticKnobs(&s, "key_noise_std=abc").ok());
}

TEST(Synthetic, RejectsBadSpec) {
  SyntheticSpec s = SmallSpec();
  s.num_q_heads = 7;
  EXPECT_THAT(GenerateSyntheticLayer(s, 0).status().message(),
              testing::HasSubstr("not a multiple"));
  s = SmallSpec();
  s.head_dim = 96;
  EXPECT_THAT(GenerateSyntheticLayer(s, 0).status().message(),
              testing::HasSubstr("power of two"));
  s = SmallSpec();
  s.key_noise_std = NAN;
  EXPECT_FALSE(GenerateSyntheticLayer(s, 0).ok());
  s = SmallSpec();
  s.query_basis.assign(10, 0.0);
  EXPECT_THAT(GenerateSyntheticLayer(s, 0).status().message(), testing::HasSubstr("query_basis"));
}

}  // namespace
}  // namespace oscarkv
