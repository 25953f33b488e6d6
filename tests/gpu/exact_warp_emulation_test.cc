// The exact (BF16 sink / recent) warp of the CUDA split kernel
// (attend_exact.cuh), run on the CPU through the warp emulation
// (warp_emulation.h), against an fp64 softmax over the same BF16 rows: the
// row loads, the reduce-scatter of the dot products through the warp's
// scratch, the online softmax and Finish, for head dims 64, 128 and 256 and
// GQA groups up to 8. The warp takes its share of each block as the split
// kernel's run_exact does (warp w of 4, WarpTokens). Runs in CI (no GPU).
//
// Stated tolerance: relative L2 error of o per head < 1e-5 and of l < 1e-5
// (fp32 dot products of at most 256 terms and fp32 accumulation).
#include "tests/gpu/warp_emulation.h"  // first: it replaces the PTX operations

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/attend_exact.cuh"
#include "kernels/numeric.h"
#include "kernels/page_format.h"
#include "tests/gpu/softmax_check.h"

namespace oscarkv {
namespace {

using cuda_attend::ExactWarp;
using cuda_attend::LaunchArgs;

constexpr int kKvHeads = 2, kHead = 1, kPageTokens = 32, kBlockWarps = 4;
constexpr double kTol = 1e-5;

// Exact blocks (K [P][H][D] then V [P][H][D], bf16) with `tokens` valid
// tokens each, and the queries of kv head kHead's g heads.
struct Input {
  PageGeometry geom;
  int g = 0;
  int warp = 0;  // of kBlockWarps
  float scale_log2 = 0.0f;
  std::vector<std::vector<bf16_bits>> blocks;
  std::vector<int> tokens;
  std::vector<float> q;  // [g][D]
};

Input MakeInput(int D, int g, std::vector<int> tokens, int warp, bool peaky, uint64_t seed) {
  Input in;
  in.geom = PageGeometry{kKvHeads, D, D, kPageTokens};
  in.g = g;
  in.warp = warp;
  in.scale_log2 = float(1.4426950408889634 / std::sqrt(double(D)));
  in.tokens = std::move(tokens);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (size_t b = 0; b < in.tokens.size(); ++b) {
    std::vector<bf16_bits> block(in.geom.exact_block_bytes() / 2);
    for (auto& x : block) x = FloatToBf16(normal(rng));
    in.blocks.push_back(std::move(block));
  }
  in.q.resize(size_t(g) * D);
  for (auto& x : in.q) x = 2.0f * normal(rng);
  if (peaky) {
    // Token 5 of the first block: its key along head 0's query, ~2^13 above the rest.
    const size_t row = size_t(5) * in.geom.exact_row_elems() + size_t(kHead) * D;
    for (int d = 0; d < D; ++d) in.blocks[0][row + d] = FloatToBf16(0.2f * in.q[d]);
  }
  return in;
}

using Output = FinishedState;

template <int D, int HG>
Output RunExactWarp(const Input& in) {
  using Ex = ExactWarp<D, HG>;
  Output out;
  LaunchArgs a = {};
  a.geom = in.geom;
  a.g = in.g;
  alignas(16) float scratch[Ex::kLogits];  // the warp's scratch, shared by its lanes
  float sm_o[HG][D];
  warp_emulation::RunWarp([&](int lane) {
    Ex ex;
    ex.Init(in.q.data(), in.scale_log2, in.g, lane);
    for (size_t b = 0; b < in.blocks.size(); ++b) {
      int t, t1;
      if (!Ex::WarpTokens(in.tokens[b], kBlockWarps, in.warp, t, t1)) continue;
      const ExactBlockRef blk{in.blocks[b].data(), in.tokens[b]};
      for (; t < t1; t += Ex::kTokensPerStep) {
        typename Ex::Rows rows;
        Ex::LoadRows(a, kHead, blk, t, t1, lane, rows);
        ex.Step(in.g, rows, t, t1, lane, scratch);
      }
    }
    ex.Finish(in.g, lane, sm_o, out.m, out.l);
  });
  for (int hh = 0; hh < in.g; ++hh) std::copy(sm_o[hh], sm_o[hh] + D, out.o[hh]);
  return out;
}

using Errors = SoftmaxErrors;  // the worst head's

// Against fp64 over the warp's tokens of each block.
Errors CompareWithFp64(const Input& in, const Output& out) {
  const int D = in.geom.head_dim;
  const size_t row_elems = in.geom.exact_row_elems();
  Errors err;
  for (int hh = 0; hh < in.g; ++hh) {
    std::vector<double> lg;
    std::vector<const bf16_bits*> vrows;
    for (size_t b = 0; b < in.blocks.size(); ++b) {
      const int per = (in.tokens[b] + kBlockWarps - 1) / kBlockWarps;
      const int t0 = in.warp * per, t1 = std::min(in.tokens[b], t0 + per);
      for (int t = t0; t < t1; ++t) {
        const bf16_bits* k = in.blocks[b].data() + size_t(t) * row_elems + size_t(kHead) * D;
        double dot = 0.0;
        for (int d = 0; d < D; ++d) dot += double(in.q[size_t(hh) * D + d]) * Bf16ToFloat(k[d]);
        lg.push_back(dot * in.scale_log2);
        vrows.push_back(k + size_t(kPageTokens) * row_elems);
      }
    }
    SCOPED_TRACE(testing::Message() << "head " << hh);
    const SoftmaxErrors e = CompareWithSoftmax(
        lg, [&](size_t i, int d) { return double(Bf16ToFloat(vrows[i][d])); }, D, out.o[hh],
        out.m[hh], out.l[hh]);
    err.o = std::max(err.o, e.o);
    err.l = std::max(err.l, e.l);
  }
  for (int hh = in.g; hh < FinishedState::kMaxHeads; ++hh) {
    EXPECT_TRUE(std::isnan(out.l[hh])) << "head " << hh;
  }
  return err;
}

template <int D, int HG>
void Check(const char* name, int g, std::vector<int> tokens, int warp, bool peaky) {
  const Input in = MakeInput(D, g, std::move(tokens), warp, peaky, 31 * D + g + warp);
  const Errors e = CompareWithFp64(in, RunExactWarp<D, HG>(in));
  std::printf("%-34s o err %.2e  l err %.2e\n", name, e.o, e.l);
  EXPECT_LT(e.o, kTol) << name;
  EXPECT_LT(e.l, kTol) << name;
}

TEST(ExactWarpEmulation, MatchesFp64SoftmaxOverTheSameRows) {
  // Full and partial blocks (the recent tier's last block is partial), and
  // a warp whose share of a short block is empty or shorter than a step.
  Check<128, 4>("D128 g4 warp 1, 32+32+17 tokens", 4, {32, 32, 17}, 1, false);
  Check<128, 4>("D128 g3 warp 3, 32+9 tokens", 3, {32, 9}, 3, false);
  Check<128, 4>("D128 g4 warp 0, peaky", 4, {32, 32}, 0, true);
  Check<64, 8>("D64 g8 warp 2, 32+32+5 tokens", 8, {32, 32, 5}, 2, false);
  Check<256, 4>("D256 g2 warp 1, 32+20 tokens", 2, {32, 20}, 1, false);
  Check<256, 8>("D256 g6 warp 0, 32 tokens", 6, {32}, 0, false);
}

}  // namespace
}  // namespace oscarkv
