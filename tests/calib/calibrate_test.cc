#include "kernels/calib/calibrate.h"

#include <cmath>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/calib/synthetic.h"
#include "kernels/hadamard.h"

namespace oscarkv {
namespace {

using ::testing::HasSubstr;

// A random orthogonal D×D matrix (Gram–Schmidt on Gaussian columns), row-major.
std::vector<double> RandomOrthogonal(int d, uint64_t seed) {
  SyntheticRng rng(seed);
  std::vector<std::vector<double>> cols;
  while (int(cols.size()) < d) {
    std::vector<double> x(d);
    for (double& e : x) e = rng.Normal();
    for (int pass = 0; pass < 2; ++pass) {
      for (const auto& c : cols) {
        double dot = 0;
        for (int i = 0; i < d; ++i) dot += x[i] * c[i];
        for (int i = 0; i < d; ++i) x[i] -= dot * c[i];
      }
    }
    double n = 0;
    for (double e : x) n += e * e;
    for (double& e : x) e /= std::sqrt(n);
    cols.push_back(x);
  }
  std::vector<double> u(size_t(d) * d);
  for (int i = 0; i < d; ++i)
    for (int j = 0; j < d; ++j) u[size_t(i) * d + j] = cols[j][i];
  return u;
}

LayerActivations SmallActivations(int tokens, int hq, int hkv, int d, uint64_t seed) {
  LayerActivations a;
  a.tokens = tokens;
  a.num_q_heads = hq;
  a.num_kv_heads = hkv;
  a.head_dim = d;
  SyntheticRng rng(seed);
  a.q.resize(size_t(tokens) * hq * d);
  a.k.resize(size_t(tokens) * hkv * d);
  a.v.resize(size_t(tokens) * hkv * d);
  for (float& x : a.q) x = rng.Normal() * (1.0f + 2.0f * float(rng.Uniform()));
  for (float& x : a.k) x = rng.Normal();
  for (float& x : a.v) x = rng.Normal();
  return a;
}

TEST(Calibrate, EigenRecoversKnownSpectrumUpToSign) {
  const int d = 16;
  const std::vector<double> u = RandomOrthogonal(d, 5);
  std::vector<double> lambda(d);
  for (int j = 0; j < d; ++j) lambda[j] = 10.0 / (1 + j);  // distinct, descending
  std::vector<double> c(size_t(d) * d, 0.0);
  for (int i = 0; i < d; ++i)
    for (int k = 0; k < d; ++k)
      for (int j = 0; j < d; ++j) c[size_t(i) * d + k] += u[size_t(i) * d + j] * lambda[j] * u[size_t(k) * d + j];
  auto es = SymmetricEigen(c, d);
  ASSERT_TRUE(es.ok()) << es.status();
  for (int j = 0; j < d; ++j) {
    EXPECT_NEAR(es->eigenvalues[j], lambda[j], 1e-10) << "eigenvalue " << j;
    double dot = 0;
    for (int i = 0; i < d; ++i) dot += es->u[size_t(i) * d + j] * u[size_t(i) * d + j];
    EXPECT_NEAR(std::fabs(dot), 1.0, 1e-9) << "eigenvector " << j;
  }
}

TEST(Calibrate, SampledQueryCovarianceRecoversTopEigenvectors) {
  // Queries drawn with covariance U diag(lambda) Uᵀ; the key target's top
  // eigenvectors must align with U's columns.
  const int d = 64, n = 6000, hq = 2, hkv = 1;
  const std::vector<double> u = RandomOrthogonal(d, 9);
  const double lambda[3] = {25.0, 9.0, 4.0};  // the rest 1
  LayerActivations a = SmallActivations(n, hq, hkv, d, 3);
  SyntheticRng rng(77);
  for (int t = 0; t < n; ++t) {
    for (int h = 0; h < hq; ++h) {
      float* q = &a.q[(size_t(t) * hq + h) * d];
      for (int i = 0; i < d; ++i) q[i] = 0;
      for (int j = 0; j < d; ++j) {
        const double z = rng.Normal() * std::sqrt(j < 3 ? lambda[j] : 1.0);
        for (int i = 0; i < d; ++i) q[i] += float(z * u[size_t(i) * d + j]);
      }
    }
  }
  auto targets = ComputeTargets(a, CalibrationOptions());
  ASSERT_TRUE(targets.ok()) << targets.status();
  auto es = SymmetricEigen(targets->key[0], d);
  ASSERT_TRUE(es.ok());
  for (int j = 0; j < 3; ++j) {
    EXPECT_NEAR(es->eigenvalues[j], lambda[j], 0.08 * lambda[j]) << j;
    double dot = 0;
    for (int i = 0; i < d; ++i) dot += es->u[size_t(i) * d + j] * u[size_t(i) * d + j];
    EXPECT_GT(std::fabs(dot), 0.98) << "eigenvector " << j;
  }
}

TEST(Calibrate, KeyTargetIsGroupQueryCovariancePerLayerAndPerHead) {
  LayerActivations a = SmallActivations(12, 4, 2, 64, 11);
  CalibrationOptions opt;
  opt.per_head = true;
  auto per_head = ComputeTargets(a, opt);
  opt.per_head = false;
  auto per_layer = ComputeTargets(a, opt);
  ASSERT_TRUE(per_head.ok() && per_layer.ok());
  ASSERT_EQ(per_head->key.size(), 2u);
  ASSERT_EQ(per_layer->key.size(), 1u);
  const int d = 64;
  for (int h = 0; h < 2; ++h) {
    for (int i = 0; i < d; ++i) {
      for (int j = 0; j < d; ++j) {
        double want = 0;
        for (int t = 0; t < 12; ++t)
          for (int g = 0; g < 2; ++g) {
            const float* q = &a.q[(size_t(t) * 4 + h * 2 + g) * d];
            want += double(q[i]) * q[j];
          }
        want /= 24;
        EXPECT_NEAR(per_head->key[h][i * d + j], want, 1e-5);
      }
    }
  }
  for (int e = 0; e < d * d; ++e) {
    EXPECT_NEAR(per_layer->key[0][e], 0.5 * (per_head->key[0][e] + per_head->key[1][e]), 1e-9);
  }
}

TEST(Calibrate, ExactValueTargetMatchesCausalSoftmaxFormula) {
  const int n = 10, hq = 2, hkv = 1, d = 64;
  LayerActivations a = SmallActivations(n, hq, hkv, d, 21);
  CalibrationOptions opt;
  opt.value_target = ValueTarget::kExactSoftmax;
  auto targets = ComputeTargets(a, opt);
  ASSERT_TRUE(targets.ok()) << targets.status();
  std::vector<double> want(d * d, 0.0);
  for (int h = 0; h < hq; ++h) {
    for (int t = 0; t < n; ++t) {
      std::vector<double> z(t + 1);
      double mx = -1e300;
      for (int s = 0; s <= t; ++s) {
        double dot = 0;
        for (int j = 0; j < d; ++j) dot += double(a.q[(t * hq + h) * d + j]) * a.k[s * d + j];
        z[s] = dot / std::sqrt(double(d));
        mx = std::max(mx, z[s]);
      }
      double sum = 0;
      for (double& x : z) sum += (x = std::exp(x - mx));
      std::vector<double> o(d, 0.0);
      for (int s = 0; s <= t; ++s)
        for (int j = 0; j < d; ++j) o[j] += z[s] / sum * a.v[s * d + j];
      for (int i = 0; i < d; ++i)
        for (int j = 0; j < d; ++j) want[i * d + j] += o[i] * o[j] / (n * hq);
    }
  }
  for (int e = 0; e < d * d; ++e) EXPECT_NEAR(targets->value[0][e], want[e], 1e-5) << e;
}

TEST(Calibrate, ProxyValueTargetWeightsTokensByLogitSecondMoment) {
  const int n = 9, hq = 2, hkv = 1, d = 64;
  LayerActivations a = SmallActivations(n, hq, hkv, d, 31);
  auto targets = ComputeTargets(a, CalibrationOptions());
  ASSERT_TRUE(targets.ok());
  const std::vector<double>& ck = targets->key[0];
  std::vector<double> w(n);
  double mean = 0;
  for (int t = 0; t < n; ++t) {
    double s = 0;
    for (int i = 0; i < d; ++i)
      for (int j = 0; j < d; ++j) s += double(a.k[t * d + i]) * ck[i * d + j] * a.k[t * d + j];
    w[t] = s;
    mean += s / n;
  }
  for (int i = 0; i < d; ++i) {
    for (int j = 0; j < d; ++j) {
      double want = 0;
      for (int t = 0; t < n; ++t) want += w[t] / mean * a.v[t * d + i] * a.v[t * d + j] / n;
      EXPECT_NEAR(targets->value[0][i * d + j], want, 1e-5);
    }
  }
}

TEST(Calibrate, RotationSatisfiesCompositionDefinitionExactly) {
  SyntheticSpec spec;
  spec.num_q_heads = 4;
  spec.num_kv_heads = 2;
  spec.head_dim = 64;
  spec.tokens = spec.num_queries = 256;
  auto layer = GenerateSyntheticLayer(spec, 0);
  ASSERT_TRUE(layer.ok());
  auto acts = ActivationsFromSynthetic(*layer);
  ASSERT_TRUE(acts.ok());
  for (bool per_head : {false, true}) {
    CalibrationOptions opt;
    opt.per_head = per_head;
    auto rot = CalibrateLayer(*acts, opt, nullptr);
    ASSERT_TRUE(rot.ok()) << rot.status();
    auto targets = ComputeTargets(*acts, opt);
    ASSERT_TRUE(targets.ok());
    ASSERT_EQ(rot->num_matrices, per_head ? 2 : 1);
    for (int m = 0; m < rot->num_matrices; ++m) {
      for (int kind = 0; kind < 2; ++kind) {
        auto es = SymmetricEigen(kind == 0 ? targets->key[m] : targets->value[m], 64);
        ASSERT_TRUE(es.ok());
        auto r = ComposeRotation(es->u, es->eigenvalues, 64);
        ASSERT_TRUE(r.ok());
        const std::vector<float>& got = kind == 0 ? rot->r_k : rot->r_v;
        for (int e = 0; e < 64 * 64; ++e) {
          ASSERT_EQ(got[size_t(m) * 4096 + e], float((*r)[e])) << "matrix " << m << " kind " << kind;
        }
        EXPECT_LT(OrthogonalityError(got.data() + size_t(m) * 4096, 64), 1e-5);
        // Eigenvalues are stored descending, in U's column order, and U comes back
        // from R = U·H·P_br.
        const std::vector<float>& eig = kind == 0 ? rot->eig_k : rot->eig_v;
        for (int j = 1; j < 64; ++j) EXPECT_GE(eig[size_t(m) * 64 + j - 1], eig[size_t(m) * 64 + j]);
        std::vector<float> r_m(got.begin() + size_t(m) * 4096, got.begin() + size_t(m + 1) * 4096);
        std::vector<float> e_m(eig.begin() + size_t(m) * 64, eig.begin() + size_t(m + 1) * 64);
        auto u = QueryBasisFromRotation(r_m, e_m, 64);
        ASSERT_TRUE(u.ok());
        double worst = 0;
        for (int e = 0; e < 4096; ++e) worst = std::max(worst, std::fabs((*u)[e] - es->u[e]));
        EXPECT_LT(worst, 1e-5);
      }
    }
  }
}

TEST(Calibrate, ClipFitPicksARatioFromTheGrid) {
  SyntheticSpec spec;
  spec.num_q_heads = 4;
  spec.num_kv_heads = 2;
  spec.head_dim = 64;
  spec.tokens = spec.num_queries = 256;
  auto acts = ActivationsFromSynthetic(*GenerateSyntheticLayer(spec, 0));
  ASSERT_TRUE(acts.ok());
  CalibrationOptions opt;
  opt.fit_clip = true;
  opt.clip_grid = {0.85f, 0.95f, 1.0f};
  LayerCalibrationReport rep;
  auto rot = CalibrateLayer(*acts, opt, &rep);
  ASSERT_TRUE(rot.ok()) << rot.status();
  EXPECT_THAT(opt.clip_grid, ::testing::Contains(rot->clip_k));
  EXPECT_THAT(opt.clip_grid, ::testing::Contains(rot->clip_v));
  EXPECT_EQ(rep.clip_k, rot->clip_k);
  EXPECT_GT(rep.top_eig_share_k, 0.0);
  EXPECT_LE(rep.top_eig_share_k, 1.0);
  // The chosen ratio's objective is the minimum over the grid.
  for (float c : opt.clip_grid) {
    double err = 0;
    for (int h = 0; h < 2; ++h) {
      auto targets = ComputeTargets(*acts, CalibrationOptions());
      err += WeightedCodecError(&acts->k[size_t(h) * 64], 256, 2 * 64, 64, rot->r_k.data(), c, 64,
                                targets->key[0], targets->token_weight[h]);
    }
    EXPECT_GE(err / 2, rep.clip_error_k * (1 - 1e-9)) << "ratio " << c;
  }
}

TEST(Calibrate, RejectsInconsistentShapesNaNAndOversizedExactTarget) {
  LayerActivations a = SmallActivations(8, 4, 2, 64, 1);
  a.k.pop_back();
  EXPECT_THAT(CalibrateLayer(a, CalibrationOptions(), nullptr).status().message(),
              HasSubstr("K has"));
  a = SmallActivations(8, 4, 2, 64, 1);
  a.v[17] = NAN;
  EXPECT_THAT(CalibrateLayer(a, CalibrationOptions(), nullptr).status().message(),
              HasSubstr("non-finite"));
  a = SmallActivations(8, 3, 2, 64, 1);
  EXPECT_FALSE(CalibrateLayer(a, CalibrationOptions(), nullptr).ok());
  a = SmallActivations(8, 4, 2, 64, 1);
  CalibrationOptions opt;
  opt.value_target = ValueTarget::kExactSoftmax;
  opt.max_exact_tokens = 4;
  EXPECT_THAT(CalibrateLayer(a, opt, nullptr).status().message(), HasSubstr("O(n^2)"));
  opt = CalibrationOptions();
  opt.clip_k = 1.5f;
  EXPECT_FALSE(CalibrateLayer(SmallActivations(8, 4, 2, 64, 1), opt, nullptr).ok());
}

}  // namespace
}  // namespace oscarkv
