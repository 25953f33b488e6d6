#include "kernels/calib/fidelity.h"

#include <cmath>
#include <map>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/calib/calibrate.h"
#include "kernels/calib/fidelity_bench.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/calib/synthetic.h"
#include "kernels/hadamard.h"
#include "kernels/numeric.h"
#include "kernels/reference.h"

namespace oscarkv {
namespace {

SyntheticSpec SmallSpec(uint64_t seed) {
  SyntheticSpec s;
  s.num_q_heads = 8;
  s.num_kv_heads = 2;
  s.head_dim = 128;
  s.tokens = 512;
  s.num_queries = 4;
  s.seed = seed;
  return s;
}

LayerRotation Hadamard128() {
  LayerRotation r = IdentityLayerRotation(128, 0.96f, 0.92f);
  const std::vector<double> h = HadamardMatrix(128);
  r.r_k.assign(h.begin(), h.end());
  r.r_v = r.r_k;
  return r;
}

TEST(Fidelity, OutputErrorMatchesFp64ReferenceAttention) {
  auto data = GenerateSyntheticLayer(SmallSpec(3), 0);
  ASSERT_TRUE(data.ok());
  const LayerRotation rot = Hadamard128();
  std::vector<float> k_hat, v_hat;
  ASSERT_TRUE(DequantizedCache(*data, rot, 0, &k_hat, &v_hat).ok());
  FidelityOptions opt;
  opt.protect = false;
  auto m = MeasureCacheFidelity(*data, k_hat, v_hat, opt);
  ASSERT_TRUE(m.ok()) << m.status();
  // Independent computation with kernels/reference.h.
  std::vector<double> k_ref(data->k.size()), v_ref(data->v.size());
  for (size_t i = 0; i < k_ref.size(); ++i) k_ref[i] = Bf16ToFloat(data->k[i]);
  for (size_t i = 0; i < v_ref.size(); ++i) v_ref[i] = Bf16ToFloat(data->v[i]);
  std::vector<double> kh(k_hat.begin(), k_hat.end()), vh(v_hat.begin(), v_hat.end());
  double err2 = 0, ref2 = 0;
  const int d = 128, hq = 8;
  for (int r = 0; r < data->num_queries; ++r) {
    std::vector<double> q(data->q.begin() + size_t(r) * hq * d, data->q.begin() + size_t(r + 1) * hq * d);
    auto o_ref = ReferenceAttention(q, k_ref, v_ref, data->tokens, hq, 2, d, 1 / std::sqrt(128.0), nullptr);
    auto o = ReferenceAttention(q, kh, vh, data->tokens, hq, 2, d, 1 / std::sqrt(128.0), nullptr);
    for (size_t i = 0; i < o.size(); ++i) {
      err2 += (o[i] - o_ref[i]) * (o[i] - o_ref[i]);
      ref2 += o_ref[i] * o_ref[i];
    }
  }
  EXPECT_NEAR(m->output_rel_error, std::sqrt(err2 / ref2), 1e-9);
  EXPECT_GT(m->output_rel_error, 0.01);  // 2-bit keys and values do change the output
  EXPECT_DOUBLE_EQ(m->effective_bits, 2.25);
}

// The fidelity path must be the codec the server runs: encode pages with the
// CPU backend and a calibrated per-head rotation, decode, and compare with
// DequantizedCache (the backend rounds its decoded block to BF16).
TEST(Fidelity, DequantizedCacheMatchesCpuBackendPages) {
  SyntheticSpec spec = SmallSpec(6);
  spec.tokens = 64;
  auto data = GenerateSyntheticLayer(spec, 0);
  spec.tokens = spec.num_queries = 256;
  auto cal = GenerateSyntheticLayer(spec, 0);
  ASSERT_TRUE(data.ok() && cal.ok());
  CalibrationOptions copt;
  copt.per_head = true;
  auto rot = CalibrateLayer(*ActivationsFromSynthetic(*cal), copt, nullptr);
  ASSERT_TRUE(rot.ok()) << rot.status();
  std::vector<float> k_hat, v_hat;
  ASSERT_TRUE(DequantizedCache(*data, *rot, 0, &k_hat, &v_hat).ok());

  const int d = 128, hkv = 2, p = 32;
  const PageGeometry geom{hkv, d, d, p};
  CpuBackend backend(1);
  auto block = backend.Allocate(geom.exact_block_bytes());
  auto page = backend.Allocate(geom.page_bytes());
  auto out = backend.Allocate(geom.exact_block_bytes());
  ASSERT_TRUE(block.ok() && page.ok() && out.ok());
  for (int first = 0; first < data->tokens; first += p) {
    // Exact block: K [P][H][D] then V [P][H][D].
    bf16_bits* b = block->as<bf16_bits>();
    const size_t half = size_t(p) * hkv * d;
    std::copy_n(&data->k[size_t(first) * hkv * d], half, b);
    std::copy_n(&data->v[size_t(first) * hkv * d], half, b + half);
    EncodeJob enc{b, page->as<uint8_t>(), {rot->r_k.data(), rot->r_v.data(), size_t(d) * d},
                  rot->clip_k, rot->clip_v};
    ASSERT_TRUE(backend.EncodePages(geom, &enc, 1).ok());
    DecodeJob dec{page->as<uint8_t>(), out->as<bf16_bits>(),
                  {rot->r_k.data(), rot->r_v.data(), size_t(d) * d}};
    ASSERT_TRUE(backend.DecodePages(geom, &dec, 1).ok());
    const bf16_bits* o = out->as<bf16_bits>();
    for (size_t e = 0; e < half; ++e) {
      const float kf = k_hat[size_t(first) * hkv * d + e], vf = v_hat[size_t(first) * hkv * d + e];
      ASSERT_NEAR(Bf16ToFloat(o[e]), kf, 1e-5 + 8e-3 * std::fabs(kf)) << "K elem " << first << "+" << e;
      ASSERT_NEAR(Bf16ToFloat(o[half + e]), vf, 1e-5 + 8e-3 * std::fabs(vf)) << "V elem " << first << "+" << e;
    }
  }
}

TEST(Fidelity, FullyProtectedCacheIsExact) {
  auto data = GenerateSyntheticLayer(SmallSpec(4), 0);
  ASSERT_TRUE(data.ok());
  FidelityOptions opt;
  opt.sink_tokens = 512;
  auto m = MeasureFidelity(*data, Hadamard128(), opt);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->output_rel_error, 0.0);
  EXPECT_EQ(m->logit_rmse, 0.0);
  EXPECT_NEAR(m->kl, 0.0, 1e-15);
  EXPECT_EQ(m->needle_hits, m->needle_trials);
  EXPECT_DOUBLE_EQ(m->effective_bits, 16.0);
}

TEST(Fidelity, RejectsMismatchedRotation) {
  auto data = GenerateSyntheticLayer(SmallSpec(4), 0);
  ASSERT_TRUE(data.ok());
  EXPECT_FALSE(MeasureFidelity(*data, IdentityLayerRotation(64, 0.96f, 0.92f), FidelityOptions()).ok());
  LayerRotation three = Hadamard128();
  three.num_matrices = 3;
  EXPECT_FALSE(MeasureFidelity(*data, three, FidelityOptions()).ok());
}

// The DESIGN section 9 contract: on held-out tokens, OSCAR (calibrated on
// other tokens) < Hadamard only < no rotation, by clear margins.
TEST(Fidelity, OscarBeatsHadamardBeatsNoRotationOnHeldOutTokens) {
  double protected_ratio_sum = 0;
  const uint64_t seeds[] = {1, 2, 3};
  for (uint64_t seed : seeds) {
    FidelityBenchOptions o;
    o.spec = SmallSpec(seed);
    o.layers = 2;
    o.calib_tokens = 1024;
    o.test_tokens = 1024;
    o.test_queries = 8;
    o.trials = 2;
    o.include_ablation = false;
    o.fidelity.sink_tokens = 32;
    o.fidelity.recent_window = 128;
    auto rows = RunFidelityBench(o);
    ASSERT_TRUE(rows.ok()) << rows.status();
    std::map<std::string, FidelityRow> by;
    for (const auto& r : *rows) by[r.method + (r.protect ? "/protect" : "")] = r;
    SCOPED_TRACE("seed " + std::to_string(seed) + "\n" + FormatFidelityTable(*rows));
    for (const char* suffix : {"", "/protect"}) {
      const double none = by[std::string("none") + suffix].output_rel_error;
      const double had = by[std::string("hadamard") + suffix].output_rel_error;
      const double oscar = by[std::string("oscar") + suffix].output_rel_error;
      EXPECT_LT(had, none / 1.4) << suffix;
      EXPECT_LT(oscar, had * (suffix[0] ? 0.97 : 0.88)) << suffix;
      EXPECT_LT(by[std::string("oscar") + suffix].kl, by[std::string("hadamard") + suffix].kl) << suffix;
      EXPECT_LT(by[std::string("hadamard") + suffix].kl, by[std::string("none") + suffix].kl) << suffix;
    }
    EXPECT_LT(by["oscar"].kl, 0.5 * by["hadamard"].kl);
    EXPECT_GE(by["oscar/protect"].needle_hits, 0.85 * by["oscar/protect"].needle_trials);
    EXPECT_DOUBLE_EQ(by["oscar"].effective_bits, 2.25);
    protected_ratio_sum += by["oscar/protect"].output_rel_error / by["hadamard/protect"].output_rel_error;
  }
  EXPECT_LT(protected_ratio_sum / 3, 0.92);
}

}  // namespace
}  // namespace oscarkv
