// The encode kernels' row helpers (kernels/cuda/encode_rows.cuh: the clip
// threshold by max extraction or bitwise search, then clamp, quantize and
// pack, R rows per warp) run on the CPU through the warp emulation
// (warp_emulation.h), against the CPU codec (ClipThreshold, ClipRow,
// QuantizeRow) on the same rotated rows: the thresholds, codes and
// (scale, min) must be the same bits. Rows with ties among the largest
// magnitudes (the recount), one lane holding all of a row's largest values,
// ranks past the extraction limit (the bitwise search), constant rows, and
// rows a pass does not use. Runs in CI (no GPU).
//
// Not covered: the inline PTX of the 4-values-per-lane drop (D = 128), which
// the emulation replaces by the same steps in C++ (encode_rows.cuh).
#include "tests/gpu/warp_emulation.h"  // first: it replaces the PTX operations

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/encode_rows.cuh"
#include "kernels/page_format.h"
#include "kernels/quantize.h"

namespace oscarkv {
namespace {

enum class RowKind { kGaussian, kTies, kOneLaneTop, kConstant };

// A rotated row of D values of the given kind.
std::vector<float> MakeRow(int D, RowKind kind, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> y(D);
  switch (kind) {
    case RowKind::kGaussian:
      for (auto& v : y) v = normal(rng);
      y[rng() % D] *= 8.0f;  // an outlier channel
      break;
    case RowKind::kTies: {
      // Few distinct magnitudes, both signs: the largest repeat on several lanes.
      const float levels[] = {0.25f, 0.5f, 1.0f, 1.5f, 3.0f};
      for (auto& v : y) v = levels[rng() % 5] * (rng() % 2 ? 1.0f : -1.0f);
      break;
    }
    case RowKind::kOneLaneTop:
      // Lane 5 holds the row's E largest magnitudes (elements 5 + 32 i).
      for (auto& v : y) v = 0.5f * normal(rng);
      for (int i = 0; i < D / 32; ++i) y[5 + 32 * i] = (i % 2 ? -1.0f : 1.0f) * (10.0f + i);
      break;
    case RowKind::kConstant:
      for (auto& v : y) v = 0.75f;
      break;
  }
  return y;
}

struct Mismatches {
  int tau = 0, codes = 0, params = 0;
};

// One pass of the row helpers: R rows of one kind, a clip ratio per row,
// which rows it stores, and what the warp wrote.
template <int D, int G, int R>
struct Pass {
  RowKind kind;
  float ratio[R];
  bool use[R];
  std::vector<std::vector<float>> rows;
  std::vector<std::vector<uint8_t>> codes;      // 0xAB until written
  std::vector<std::vector<QuantParams>> params;  // {0xDEAD, 0xBEEF} until written
  float tau[R];

  Pass(RowKind k, const float (&rs)[4], int unused, uint64_t seed)
      : kind(k),
        codes(R, std::vector<uint8_t>(D / 4, 0xAB)),
        params(R, std::vector<QuantParams>(D / G, {0xDEAD, 0xBEEF})) {
    std::mt19937_64 rng(seed);
    for (int r = 0; r < R; ++r) {
      ratio[r] = rs[r % 4];
      use[r] = r != unused;
      rows.push_back(MakeRow(D, kind, rng));
    }
  }

  // The warp's part (every lane calls it).
  void Run(int lane) {
    const float* yr[R];
    int top[R];
    uint8_t* co[R];
    QuantParams* po[R];
    for (int r = 0; r < R; ++r) {
      yr[r] = rows[r].data();
      top[r] = cuda_encode::ClipTopRank(ratio[r], D);
      co[r] = codes[r].data();
      po[r] = params[r].data();
    }
    float t[R];
    cuda_encode::ClipThresholdsWarp<D, R>(yr, top, t, lane);
    cuda_encode::QuantizeRowsWarp<D, G, R>(yr, t, co, po, use, lane);
    if (lane == 0) std::copy(t, t + R, tau);
  }

  // Against the CPU codec on the same rows.
  Mismatches Compare() const {
    Mismatches bad;
    std::vector<float> scratch(D);
    for (int r = 0; r < R; ++r) {
      std::vector<float> y = rows[r];
      const float tau_cpu = ratio[r] < 1.0f ? ClipThreshold(y.data(), D, ratio[r], scratch.data())
                                            : INFINITY;
      bad.tau += std::memcmp(&tau_cpu, &tau[r], 4) != 0;
      if (!use[r]) {  // a row the pass does not store: its bytes stay as they were
        for (uint8_t c : codes[r]) bad.codes += c != 0xAB;
        for (const QuantParams& p : params[r]) bad.params += p.scale != 0xDEAD || p.min != 0xBEEF;
        continue;
      }
      ClipRow(y.data(), D, ratio[r], scratch.data());
      std::vector<uint8_t> want_codes(D / 4);
      std::vector<QuantParams> want_params(D / G);
      QuantizeRow(y.data(), D, G, want_codes.data(), want_params.data());
      for (int j = 0; j < D / 4; ++j) bad.codes += codes[r][j] != want_codes[j];
      for (int g = 0; g < D / G; ++g) {
        bad.params += params[r][g].scale != want_params[g].scale || params[r][g].min != want_params[g].min;
      }
    }
    return bad;
  }
};

// Every pass of one shape through one emulated warp (one RunWarp: the lanes'
// threads start once per shape), then each against the CPU.
template <int D, int G, int R>
void CheckShape(const char* name) {
  const RowKind kinds[] = {RowKind::kGaussian, RowKind::kTies, RowKind::kOneLaneTop,
                           RowKind::kConstant};
  // Keys' and values' default ratios, no clipping, and 0.5 (a rank past the
  // max-extraction limit: the bitwise search); mixed within a pass too.
  const float ratio_sets[][4] = {{0.96f, 0.96f, 0.96f, 0.96f},
                                 {0.92f, 0.92f, 0.92f, 0.92f},
                                 {1.0f, 1.0f, 1.0f, 1.0f},
                                 {0.5f, 0.5f, 0.5f, 0.5f},
                                 {0.96f, 0.92f, 1.0f, 0.5f}};
  std::vector<Pass<D, G, R>> passes;
  for (const RowKind kind : kinds) {
    for (const auto& rs : ratio_sets) {
      for (int unused = -1; unused < R; unused += R) {  // all rows used, then row R-1 unused
        passes.emplace_back(kind, rs, unused, 1000 + 7 * passes.size());
      }
    }
  }
  warp_emulation::RunWarp([&](int lane) {
    for (auto& pass : passes) pass.Run(lane);
  });
  Mismatches total;
  for (const auto& pass : passes) {
    const Mismatches m = pass.Compare();
    total.tau += m.tau;
    total.codes += m.codes;
    total.params += m.params;
    EXPECT_EQ(m.tau, 0) << name << " kind " << int(pass.kind) << " ratio " << pass.ratio[0];
    EXPECT_EQ(m.codes, 0) << name << " kind " << int(pass.kind) << " ratio " << pass.ratio[0];
    EXPECT_EQ(m.params, 0) << name << " kind " << int(pass.kind) << " ratio " << pass.ratio[0];
  }
  std::printf("%-22s %3zu passes of %d rows: %d thresholds, %d code bytes, %d params differ\n", name,
              passes.size(), R, total.tau, total.codes, total.params);
}

TEST(EncodeRowsEmulation, ThresholdsCodesAndParamsAreTheCpuCodecsBits) {
  CheckShape<128, 128, 4>("D128 G128 R4 (roles)");
  CheckShape<128, 128, 2>("D128 G128 R2 (strip)");
  CheckShape<128, 32, 2>("D128 G32 R2");
  CheckShape<128, 16, 1>("D128 G16 R1");
  CheckShape<64, 64, 4>("D64 G64 R4");
  CheckShape<64, 16, 2>("D64 G16 R2");
  CheckShape<256, 256, 2>("D256 G256 R2");
  CheckShape<256, 64, 4>("D256 G64 R4");
}

}  // namespace
}  // namespace oscarkv
