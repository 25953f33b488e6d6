// The history warps of the CUDA attention kernels (attend_history*.cuh), run
// on the CPU through the warp emulation (warp_emulation.h), against an fp64
// softmax over the same pages: the chunk loads, the online softmax, P·V on
// the (emulated) tensor cores and Finish, for
//   - HistoryWarpIntPv<.., 2 digits> (variant 8; verified on the H200 by
//     cuda_attend_test, so this also checks the emulation),
//   - HistoryWarpIntPv<.., 2 digits, kShortChain> (variant 12), also through
//     the loops of variants 13 and 14 (the default; 15 runs 14's), which
//     must give 12's results bit for bit,
//   - HistoryWarp with integer q·K (variant 3: bf16 hi/lo P'),
//   - HistoryWarpIntPv8 (variants 14 and 19 at 5-8 query heads per kv head),
//     which must give, head for head, the 4-head warp of variant 12's bits
//     on the same query digits.
// Logits come from each warp's own q·K (random query digits, so they are not
// a real query's); the reference takes those logits and computes, in fp64,
// o = Σ_t 2^(lg_t − M) (s_t c_t + min_t) / Σ_t 2^(lg_t − M) from the page
// bytes. Runs in CI (no GPU; the CUDA headers only).
//
// Stated tolerances: relative L2 error of o per head < 2e-4 (16-bit P':
// 2^-17 of each chunk's max per term; the H200 measured up to 6.3e-5 on
// whole calls), |l − Σw| / Σw < 1e-5; variant 12 within 3e-5 (relative
// L2) of variant 8 on the same input (measured: up to 1.2e-5, at logits
// near 1000) and its error against fp64 at most 1.25 times 8's (+2e-6).
#include "tests/gpu/warp_emulation.h"  // first: it replaces the PTX operations

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <mutex>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/attend_history_int.cuh"
#include "kernels/cuda/attend_history_int8.cuh"
#include "kernels/numeric.h"
#include "kernels/page_format.h"
#include "tests/gpu/softmax_check.h"

namespace oscarkv {
namespace {

using cuda_attend::HistoryWarp;
using cuda_attend::HistoryWarpIntPv;
using cuda_attend::HistoryWarpIntPv8;
using cuda_attend::kQueryMetaFloats;
using cuda_attend::LaunchArgs;

constexpr int kD = 128;       // the integer paths' head dim
constexpr int kTokensPerChunk = 32;
constexpr int kMaxHeads = FinishedState::kMaxHeads;  // a block's query heads (HG): 4, or 8
constexpr int kHead = 1;      // the kv head under test (of 2: offsets inside a page)

using Warp8 = HistoryWarpIntPv<kD, 1, false, 2, false>;
using Warp12 = HistoryWarpIntPv<kD, 1, false, 2, true>;
using Warp3 = HistoryWarp<kD, 1, false, true>;

// kLarge: logits near 1000 (base 2), where lg + log2 s_V rounds at ulp(1000).
// kFlat: logits within about one unit, so that every token weighs (a long
// unit's P'·V then sums thousands of terms of one size).
enum class Logits { kSpread, kPeaky, kRising, kLarge, kFlat };

struct Input {
  PageGeometry geom{2, kD, kD, kTokensPerChunk};
  int g = 4;
  // The chunks a warp takes (the split kernel's walk: warp w of a block of
  // walk_warps takes chunks w, w + walk_warps, ...).
  int walk_warps = 1, walk_warp = 0;
  std::vector<std::vector<uint8_t>> pages;
  std::vector<uint32_t> qfrag;  // [kv head][2][4][2][32]
  std::vector<float> qmeta;     // [kv head * g + head][kQueryMetaFloats]
};

uint32_t Params(float scale, float min) {
  return uint32_t(FloatToFp16(scale)) | (uint32_t(FloatToFp16(min)) << 16);
}

// The query fragments a warp reads (InitQuery): integer digits (variants 3
// and 6-12) or fp16 hi / lo pairs (HistoryWarp without kIntQK), `words` per kv head.
struct QueryFormat {
  int words = 2 * 4 * 2 * 32;
  bool fp16 = false;
};

// Where a lane's logits lg[τ][e] are: (head, token within the chunk), or
// head -1 for a lane whose copy another lane records.
// Also the warp's head dim, quantization groups and query format.
template <class W>
struct LogitMap;
template <int D, int NG, bool G8, int kDigits, bool kShort>
struct LogitMap<HistoryWarpIntPv<D, NG, G8, kDigits, kShort>> {
  static constexpr int kHeadDim = D, kGroups = NG;
  static constexpr int E = 2;
  static QueryFormat Query() { return {}; }
  static void At(int lane, int tau, int e, int* head, int* token) {
    *head = lane & 3;
    *token = 16 * tau + (lane >> 2) + 8 * e;
  }
};
template <int D, int NG, bool G8>
struct LogitMap<HistoryWarpIntPv8<D, NG, G8>> {
  static constexpr int kHeadDim = D, kGroups = NG;
  static constexpr int E = 4;
  static QueryFormat Query() { return {4 * 4 * 2 * 32, false}; }
  static void At(int lane, int tau, int e, int* head, int* token) {
    *head = (lane & 3) + 4 * (e >> 1);
    *token = 16 * tau + (lane >> 2) + 8 * (e & 1);
  }
};
template <int D, int NG, bool G8, bool kInt>
struct LogitMap<HistoryWarp<D, NG, G8, kInt>> {
  using W = HistoryWarp<D, NG, G8, kInt>;
  static constexpr int kHeadDim = D, kGroups = NG;
  static constexpr int E = 4;
  static QueryFormat Query() { return {W::QN * W::QK * 2 * 32, !W::kIntQK}; }
  static void At(int lane, int tau, int e, int* head, int* token) {
    const int c = lane & 3;
    if (G8) {
      *head = 2 * c + (e & 1);
    } else {
      *head = c < 2 ? 2 * (c & 1) + (e & 1) : -1;  // lanes c and c ^ 2 hold the same logits
    }
    *token = 16 * tau + (lane >> 2) + 8 * (e >> 1);
  }
};

// Pages of random codes and plausible (scale, min) for warp W's head dim,
// groups and query format; `zero_rows`: every 7th token's V scale is 0 (a
// constant row: the encoder's output for one), and every one of the second
// chunk's. `encoded_values`: each V row's min is -1.5 (±0.1) times its
// scale, as the encoder makes them for rows of mean ~0 (min ≈ -max, scale =
// (max - min) / 3), so that Σ p·(c·s + min) is a small difference of two
// large sums, as in the service.
template <class W>
Input MakeInput(int g, int num_pages, Logits kind, bool zero_rows, uint64_t seed,
                int page_tokens = kTokensPerChunk, bool encoded_values = false) {
  constexpr int head_dim = LogitMap<W>::kHeadDim, groups = LogitMap<W>::kGroups;
  const QueryFormat query = LogitMap<W>::Query();
  Input in;
  in.g = g;
  in.geom.head_dim = head_dim;
  in.geom.group_size = head_dim / groups;
  in.geom.page_tokens = page_tokens;
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> byte(0, 255), digit(-64, 63);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::uniform_real_distribution<float> ks(0.02f, 0.08f), kmin(-0.2f, 0.0f);
  std::uniform_real_distribution<float> vs(0.005f, 0.05f), vmin(-0.2f, 0.1f);
  const PageGeometry& geom = in.geom;
  for (int p = 0; p < num_pages; ++p) {
    std::vector<uint8_t> page(geom.page_bytes());
    for (auto& b : page) b = static_cast<uint8_t>(byte(rng));
    for (int h = 0; h < geom.kv_heads; ++h) {
      for (int t = 0; t < geom.page_tokens; ++t) {
        const int token = p * geom.page_tokens + t;
        for (int gi = 0; gi < groups; ++gi) {
          float k_min = kmin(rng);
          if (kind == Logits::kPeaky && token == 37) k_min = 9.0f;  // 2^9 above the rest
          if (kind == Logits::kRising) k_min = 0.02f * token;      // the max moves every chunk
          if (kind == Logits::kLarge) k_min = 1000.0f + 8.0f * k_min;
          const uint32_t kp = Params(ks(rng), k_min);
          // zero_rows: also every V scale of the second chunk (S = 0: its P'
          // terms are dropped, only the min terms count).
          const bool zero = zero_rows && (token % 7 == 3 || token / kTokensPerChunk == 1);
          const float v_scale = zero ? 0.0f : vs(rng);
          const float v_min = encoded_values ? -v_scale * (1.5f + 0.1f * unit(rng)) : vmin(rng);
          const uint32_t vp = Params(v_scale, v_min);
          const size_t at = (size_t(t) * groups + gi) * 4;
          std::memcpy(&page[geom.params_offset(h, 0) + at], &kp, 4);
          std::memcpy(&page[geom.params_offset(h, 1) + at], &vp, 4);
        }
      }
    }
    in.pages.push_back(std::move(page));
  }
  in.qfrag.resize(size_t(geom.kv_heads) * query.words);
  for (auto& w : in.qfrag) {
    w = 0;
    if (query.fp16) {
      const float lo = unit(rng), hi = unit(rng);
      w = warp_emulation::PackHalves(lo, hi);
    } else {
      for (int j = 0; j < 4; ++j) w |= uint32_t(uint8_t(int8_t(digit(rng)))) << (8 * j);
    }
  }
  // Logits spread over a few units either way: integer digits' dot products
  // are ~1e4, fp16 columns' ~10.
  const float mult = (query.fp16 ? 4.0f : 0.004f) * (kind == Logits::kFlat ? 0.02f : 1.0f);
  in.qmeta.assign(size_t(geom.kv_heads) * g * kQueryMetaFloats, 0.0f);
  for (int hh = 0; hh < geom.kv_heads * g; ++hh) {
    in.qmeta[size_t(hh) * kQueryMetaFloats + 0] = mult * (1.0f + 0.25f * (hh % 4));
    for (int gi = 0; gi < groups; ++gi) in.qmeta[size_t(hh) * kQueryMetaFloats + 1 + gi] = 1.0f;  // Σq'
  }
  return in;
}

struct Output : FinishedState {
  std::vector<std::vector<double>> logits;  // [head][token]
};

// A history warp that records the logits of each chunk it processes (the
// warp's iteration it is chunk pages.ChunkOf(it)), for the fp64 reference.
template <class W, int kWalkWarps>
struct Recorder {
  using Regs = typename W::Regs;
  static constexpr int kLogitsPerTile = W::kLogitsPerTile;
  W& hw;
  cuda_attend::WarpPages<kWalkWarps>& pages;
  int g, lane;
  std::vector<std::vector<double>>& logits;  // [head][token]
  // Chunks accumulated: every loop takes a chunk's logits, then accumulates
  // it, before the next chunk's logits.
  int it = 0;

  void Load(Regs& x, const uint8_t* page, int chunk) const { hw.Load(x, page, chunk); }
  void Logits(const Regs& x, float (&lg)[2][kLogitsPerTile]) const {
    hw.Logits(x, lg);
    for (int tau = 0; tau < 2; ++tau) Record(tau, lg[tau]);
  }
  // Variant 14's loop takes a chunk's logits one 16-token tile at a time.
  void LogitsTile(const Regs& x, int tau, float (&lgt)[kLogitsPerTile]) const {
    hw.LogitsTile(x, tau, lgt);
    Record(tau, lgt);
  }
  void Record(int tau, const float (&lgt)[kLogitsPerTile]) const {
    const int chunk = pages.ChunkOf(it);
    for (int e = 0; e < kLogitsPerTile; ++e) {
      int head, token;
      LogitMap<W>::At(lane, tau, e, &head, &token);
      if (head >= 0 && head < g) logits[head][chunk * kTokensPerChunk + token] = lgt[e];
    }
  }
  void Accumulate(const Regs& x, const float (&lg)[2][kLogitsPerTile]) {
    hw.Accumulate(x, lg);
    ++it;
  }
  float& AblationSink() { return hw.AblationSink(); }
  void Process(const Regs& x) {
    float lg[2][kLogitsPerTile];
    Logits(x, lg);
    Accumulate(x, lg);
  }
};

int NumChunks(const Input& in) {
  return int(in.pages.size()) * in.geom.page_tokens / kTokensPerChunk;
}

// Whether the input's warp takes chunk `chunk` (Input::walk_warps).
bool Walked(const Input& in, int chunk) { return chunk % in.walk_warps == in.walk_warp; }

// One warp over its chunks of the input as the split kernel runs them
// (WarpPages for the pages, the first two chunks loaded, then
// RunDoubleBufferedChunks, or with kLoadOrder 1 / 2 variant 13's / 14's
// RunChunksLoadingAfterFirstUse), then Finish.
template <class W, int kWalkWarps, int kLoadOrder = 0>
Output RunWalk(const Input& in) {
  Output out;
  const int tokens = int(in.pages.size()) * in.geom.page_tokens;
  out.logits.assign(kMaxHeads,
                    std::vector<double>(tokens, std::numeric_limits<double>::quiet_NaN()));
  LaunchArgs a = {};
  a.geom = in.geom;
  a.g = in.g;
  a.hq = in.geom.kv_heads * in.g;
  a.qfrag = const_cast<uint32_t*>(in.qfrag.data());
  a.qmeta = const_cast<float*>(in.qmeta.data());
  std::vector<const uint8_t*> table;
  for (const auto& page : in.pages) table.push_back(page.data());
  cuda_attend::ItemPlan item;
  item.pages = table.data();
  item.num_pages = int(table.size());
  EXPECT_EQ(in.walk_warps, kWalkWarps);
  const int cpp = in.geom.page_tokens / kTokensPerChunk;
  constexpr int D = LogitMap<W>::kHeadDim;
  EXPECT_EQ(in.geom.head_dim, D);
  float sm_o[kMaxHeads][D];
  for (auto& row : sm_o) std::fill(std::begin(row), std::end(row), std::nanf(""));
  warp_emulation::RunWarp([&](int lane) {
    W hw;
    hw.InitOffsets(in.geom, kHead, lane);
    cuda_attend::WarpPages<kWalkWarps> pages(item, /*first=*/0, NumChunks(in), cpp, in.walk_warp,
                                              lane);
    hw.InitQuery(a, /*item=*/0, kHead, lane);
    // The kernels' own loop (RunDoubleBufferedChunks over the register
    // double buffer, as the split and cluster kernels run it), through a
    // warp that records each chunk's logits between Logits and Accumulate.
    Recorder<W, kWalkWarps> rec{hw, pages, in.g, lane, out.logits};
    auto page_of = [&](int it) { return pages.Page(it); };
    auto in_page = [&](int it) { return pages.InPage(it); };
    const int iters = pages.Iterations();
    typename W::Regs ra, rb;
    if (iters > 0) hw.Load(ra, page_of(0), in_page(0));
    if (iters > 1) hw.Load(rb, page_of(1), in_page(1));
    if (iters > 0 && kLoadOrder > 0) {
      cuda_attend::RunChunksLoadingAfterFirstUse<kLoadOrder == 2>(rec, ra, rb, iters, page_of,
                                                                  in_page);
    } else if (iters > 0) {
      cuda_attend::RunDoubleBufferedChunks(rec, ra, rb, iters, 0, page_of, in_page);
    }
    hw.Finish(in.g, sm_o, out.m, out.l);
  });
  for (int hh = 0; hh < kMaxHeads; ++hh) std::copy(sm_o[hh], sm_o[hh] + D, out.o[hh]);
  return out;
}

template <class W>
Output RunHistoryWarp(const Input& in) {
  return RunWalk<W, 1>(in);
}

// V of token t, dim d, dequantized from the page bytes (page_format.h).
double ValueAt(const Input& in, int token, int d) {
  const PageGeometry& geom = in.geom;
  const int D = geom.head_dim;
  const std::vector<uint8_t>& page = in.pages[token / geom.page_tokens];
  const int t = token % geom.page_tokens;
  const uint8_t byte = page[geom.codes_offset(kHead, 1) + size_t(t) * geom.code_row_bytes() +
                            d % (D / 4)];
  uint32_t params;
  const size_t at = (size_t(t) * geom.groups() + d / geom.group_size) * 4;
  std::memcpy(&params, &page[geom.params_offset(kHead, 1) + at], 4);
  const double scale = Fp16ToFloat(static_cast<fp16_bits>(params & 0xffffu));
  const double min = Fp16ToFloat(static_cast<fp16_bits>(params >> 16));
  return UnpackCode(byte, d / (D / 4)) * scale + min;
}

using Errors = SoftmaxErrors;  // the worst head's

// The warp's result against the fp64 softmax over its own logits.
Errors CompareWithFp64(const Input& in, const Output& out) {
  Errors err;
  const int D = in.geom.head_dim;
  const int tokens = int(in.pages.size()) * in.geom.page_tokens;
  for (int hh = 0; hh < kMaxHeads; ++hh) {
    if (hh >= in.g) {
      // Heads past the group are not written.
      EXPECT_TRUE(std::isnan(out.o[hh][0]) && std::isnan(out.l[hh])) << "head " << hh;
      continue;
    }
    // The warp's tokens have logits, and only those.
    SCOPED_TRACE(testing::Message() << "head " << hh);
    std::vector<double> logits;
    std::vector<int> token_of;
    for (int t = 0; t < tokens; ++t) {
      if (Walked(in, t / kTokensPerChunk)) {
        EXPECT_TRUE(std::isfinite(out.logits[hh][t])) << "token " << t;
        logits.push_back(out.logits[hh][t]);
        token_of.push_back(t);
      } else {
        EXPECT_TRUE(std::isnan(out.logits[hh][t])) << "token " << t;
      }
    }
    const SoftmaxErrors e = CompareWithSoftmax(
        logits, [&](size_t i, int d) { return ValueAt(in, token_of[i], d); }, D, out.o[hh],
        out.m[hh], out.l[hh]);
    err.o = std::max(err.o, e.o);
    err.l = std::max(err.l, e.l);
  }
  return err;
}

double RelativeL2(const Output& a, const Output& b, int g) {
  constexpr int D = kD;
  double worst = 0.0;
  for (int hh = 0; hh < g; ++hh) {
    double num = 0.0, den = 0.0;
    for (int d = 0; d < D; ++d) {
      const double x = double(a.o[hh][d]) / a.l[hh], y = double(b.o[hh][d]) / b.l[hh];
      num += (x - y) * (x - y);
      den += y * y;
    }
    worst = std::max(worst, std::sqrt(num / den));
  }
  return worst;
}

// Whether two warps' results are the same bits (o, m, l of every head, and
// the logits): variants 13's and 14's loops run 12's products in 12's order.
bool SameBits(const Output& a, const Output& b) {
  if (std::memcmp(a.o, b.o, sizeof(a.o)) != 0 || std::memcmp(a.m, b.m, sizeof(a.m)) != 0 ||
      std::memcmp(a.l, b.l, sizeof(a.l)) != 0 || a.logits.size() != b.logits.size()) {
    return false;
  }
  for (size_t h = 0; h < a.logits.size(); ++h) {  // NaN where a head or token has none
    if (a.logits[h].size() != b.logits[h].size() ||
        std::memcmp(a.logits[h].data(), b.logits[h].data(), a.logits[h].size() * sizeof(double))) {
      return false;
    }
  }
  return true;
}

constexpr double kOutTol = 2e-4;
constexpr double kSumTol = 1e-5;
constexpr double kVariantTol = 3e-5;
// Variant 12 keeps P' on a grid 4 units finer than 8's (S / 65531, not
// S / 65535), so the two round differently; it must be as accurate.
constexpr double kAsAccurate = 1.25, kAsAccurateFloor = 2e-6;

struct Case {
  const char* name;
  int g;
  int pages;
  Logits logits;
  bool zero_rows;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class HistoryWarpEmulationTest : public ::testing::TestWithParam<Case> {};

TEST_P(HistoryWarpEmulationTest, MatchesFp64SoftmaxOverTheSamePages) {
  const Case& c = GetParam();
  const Input in =
      MakeInput<Warp8>(c.g, c.pages, c.logits, c.zero_rows, 1000 + c.pages * 10 + c.g);
  const Output o8 = RunHistoryWarp<Warp8>(in);
  const Output o12 = RunHistoryWarp<Warp12>(in);
  const Output o13 = RunWalk<Warp12, 1, /*kLoadOrder=*/1>(in);
  const Output o14 = RunWalk<Warp12, 1, /*kLoadOrder=*/2>(in);
  const Output o3 = RunHistoryWarp<Warp3>(in);
  const Errors e8 = CompareWithFp64(in, o8), e12 = CompareWithFp64(in, o12);
  const Errors e3 = CompareWithFp64(in, o3);
  const double d12 = RelativeL2(o12, o8, c.g);
  std::printf("%-22s o err: v8 %.2e  v12 %.2e  v3 %.2e; l err: v8 %.1e v12 %.1e v3 %.1e; "
              "v12 vs v8 %.2e\n",
              c.name, e8.o, e12.o, e3.o, e8.l, e12.l, e3.l, d12);
  EXPECT_LT(e8.o, kOutTol);
  EXPECT_LT(e12.o, kOutTol);
  EXPECT_LT(e3.o, kOutTol);
  EXPECT_LT(e8.l, kSumTol);
  EXPECT_LT(e12.l, kSumTol);
  EXPECT_LT(e3.l, kSumTol);
  EXPECT_LT(d12, kVariantTol);
  EXPECT_LT(e12.o, kAsAccurate * e8.o + kAsAccurateFloor);
  // The same logits: q·K is the same code in 8 and 12.
  for (int hh = 0; hh < c.g; ++hh) EXPECT_EQ(o8.logits[hh], o12.logits[hh]) << "head " << hh;
  EXPECT_TRUE(SameBits(o13, o12)) << "variant 13's loop against 12's";
  EXPECT_TRUE(SameBits(o14, o12)) << "variant 14's loop against 12's";
}

INSTANTIATE_TEST_SUITE_P(
    Chunks, HistoryWarpEmulationTest,
    ::testing::Values(Case{"spread g4 8 chunks", 4, 8, Logits::kSpread, false},
                      Case{"spread g3 zero rows", 3, 6, Logits::kSpread, true},
                      Case{"peaky g4", 4, 4, Logits::kPeaky, false},
                      Case{"rising max g2", 2, 12, Logits::kRising, true},
                      Case{"one chunk g1", 1, 1, Logits::kSpread, false},
                      Case{"logits near 1000 g4", 4, 6, Logits::kLarge, true}),
    [](const ::testing::TestParamInfo<Case>& info) {
      std::string name = info.param.name;
      for (char& ch : name) {
        if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
      }
      return name;
    });

// The split kernel's page walk: warp 3 of 4 over 8-chunk pages (P = 256),
// 34 iterations, so WarpPages refetches its lanes' page pointers (every 32
// iterations) and the chunk within a page alternates (3, 7, 3, ...).
TEST(HistoryWarpEmulation, WarpOfFourWalksItsChunksOfEightChunkPages) {
  Input in = MakeInput<Warp12>(4, 17, Logits::kSpread, true, 77, /*page_tokens=*/256);
  in.walk_warps = 4;
  in.walk_warp = 3;
  const Output o8 = RunWalk<Warp8, 4>(in);
  const Output o12 = RunWalk<Warp12, 4>(in);
  const Output o13 = RunWalk<Warp12, 4, /*kLoadOrder=*/1>(in);
  const Output o14 = RunWalk<Warp12, 4, /*kLoadOrder=*/2>(in);
  const Errors e8 = CompareWithFp64(in, o8), e12 = CompareWithFp64(in, o12);
  EXPECT_TRUE(SameBits(o13, o12)) << "variant 13's loop against 12's";
  EXPECT_TRUE(SameBits(o14, o12)) << "variant 14's loop against 12's";
  std::printf("walk 34 of 136 chunks   o err: v8 %.2e  v12 %.2e; l err: v8 %.1e v12 %.1e\n", e8.o,
              e12.o, e8.l, e12.l);
  EXPECT_LT(e8.o, kOutTol);
  EXPECT_LT(e12.o, kOutTol);
  EXPECT_LT(e8.l, kSumTol);
  EXPECT_LT(e12.l, kSumTol);
}

// Variants 13's and 14's loops against 12's at every chunk count from 1 to
// 9 (odd and even; the loops' first chunk, last chunk and buffer swap).
TEST(HistoryWarpEmulation, LoadOrdersGiveVariant12sBitsAtEveryChunkCount) {
  for (int chunks = 1; chunks <= 9; ++chunks) {
    SCOPED_TRACE(testing::Message() << chunks << " chunks");
    const Input in = MakeInput<Warp12>(3, chunks, Logits::kSpread, chunks % 2 == 1, 2000 + chunks);
    const Output o12 = RunHistoryWarp<Warp12>(in);
    EXPECT_LT(CompareWithFp64(in, o12).o, kOutTol);
    EXPECT_TRUE(SameBits(RunWalk<Warp12, 1, /*kLoadOrder=*/1>(in), o12)) << "variant 13";
    EXPECT_TRUE(SameBits(RunWalk<Warp12, 1, /*kLoadOrder=*/2>(in), o12)) << "variant 14";
  }
}

// The 8-head integer warp (HistoryWarpIntPv8, variants 14 and 19 at 5-8
// query heads per kv head) over its chunks as variant 14's loop runs them:
// against fp64, and head for head against the 4-head warp of variant 12
// (whose loop 14's gives bit for bit) on the two halves of its query digits
// (tiles 2s, 2s + 1 and the meta of heads 4s..4s + 3): the same products in
// the same order, so the same bits (o, m, l, logits).
TEST(HistoryWarpEmulation, EightHeadWarpMatchesFp64AndTheFourHeadWarpHeadForHead) {
  using Warp8x = HistoryWarpIntPv8<kD, 1, true>;
  struct Eight {
    int g, pages;
    Logits logits;
    bool zero_rows;
  };
  for (const Eight c : {Eight{8, 8, Logits::kSpread, false}, Eight{8, 5, Logits::kPeaky, true},
                        Eight{7, 6, Logits::kRising, true}, Eight{5, 4, Logits::kLarge, false},
                        Eight{6, 1, Logits::kSpread, true}}) {
    SCOPED_TRACE(testing::Message() << "g " << c.g << ", " << c.pages << " chunks");
    const Input in = MakeInput<Warp8x>(c.g, c.pages, c.logits, c.zero_rows, 9000 + c.g + c.pages);
    const Output o8x = RunWalk<Warp8x, 1, /*kLoadOrder=*/2>(in);
    const Errors e = CompareWithFp64(in, o8x);
    std::printf("8-head warp, g %d, %d chunks: o err %.2e, l err %.1e\n", c.g, c.pages, e.o,
                e.l);
    EXPECT_LT(e.o, kOutTol);
    EXPECT_LT(e.l, kSumTol);
    EXPECT_TRUE(SameBits(RunHistoryWarp<Warp8x>(in), o8x)) << "variant 12's loop against 14's";
    for (int s = 0; s * 4 < c.g; ++s) {
      // Half s as a 4-head input: words [s·512, +512) of each kv head's
      // fragments, heads 4s.. of its meta.
      Input half = in;
      half.g = std::min(4, c.g - 4 * s);
      constexpr int kWords = 2 * 4 * 2 * 32;
      half.qfrag.assign(size_t(in.geom.kv_heads) * kWords, 0u);
      half.qmeta.assign(size_t(in.geom.kv_heads) * half.g * kQueryMetaFloats, 0.0f);
      for (int h = 0; h < in.geom.kv_heads; ++h) {
        std::copy_n(in.qfrag.begin() + (size_t(h) * 2 + s) * kWords, kWords,
                    half.qfrag.begin() + size_t(h) * kWords);
        std::copy_n(in.qmeta.begin() + (size_t(h) * c.g + 4 * s) * kQueryMetaFloats,
                    half.g * kQueryMetaFloats,
                    half.qmeta.begin() + size_t(h) * half.g * kQueryMetaFloats);
      }
      const Output o4 = RunHistoryWarp<Warp12>(half);
      for (int hh = 0; hh < half.g; ++hh) {
        SCOPED_TRACE(testing::Message() << "head " << 4 * s + hh);
        EXPECT_EQ(std::memcmp(o4.o[hh], o8x.o[4 * s + hh], sizeof(o4.o[hh])), 0);
        EXPECT_EQ(std::memcmp(&o4.m[hh], &o8x.m[4 * s + hh], sizeof(float)), 0);
        EXPECT_EQ(std::memcmp(&o4.l[hh], &o8x.l[4 * s + hh], sizeof(float)), 0);
        EXPECT_EQ(std::memcmp(o4.logits[hh].data(), o8x.logits[4 * s + hh].data(),
                              o4.logits[hh].size() * sizeof(double)),
                  0);
      }
    }
  }
}

// HistoryWarp at the other shapes (head dims 64 / 256, 2 or 4 quantization
// groups, 8 query heads per kv head; fp16 hi / lo query columns, bf16 hi /
// lo P'): the warps variants 0 and 3 run there.
template <int D, int NG, bool G8, bool kInt>
void CheckHistoryWarp(const char* name, int g, int pages, Logits kind) {
  using W = HistoryWarp<D, NG, G8, kInt>;
  const Input in = MakeInput<W>(g, pages, kind, true, 5000 + D + 10 * NG + g);
  const Errors e = CompareWithFp64(in, RunHistoryWarp<W>(in));
  std::printf("%-34s o err %.2e  l err %.2e\n", name, e.o, e.l);
  EXPECT_LT(e.o, kOutTol) << name;
  EXPECT_LT(e.l, kSumTol) << name;
}

TEST(HistoryWarpEmulation, OtherShapesMatchFp64) {
  CheckHistoryWarp<128, 1, false, false>("D128 G128 g4 fp16 q (variant 0)", 4, 6, Logits::kSpread);
  CheckHistoryWarp<128, 2, true, false>("D128 G64 g8 fp16 q", 8, 4, Logits::kRising);
  CheckHistoryWarp<128, 4, false, true>("D128 G32 g3 int q", 3, 4, Logits::kPeaky);
  CheckHistoryWarp<64, 2, true, false>("D64 G32 g6", 6, 5, Logits::kSpread);
  CheckHistoryWarp<64, 1, false, false>("D64 G64 g2", 2, 3, Logits::kRising);
  CheckHistoryWarp<256, 4, false, false>("D256 G64 g4", 4, 3, Logits::kSpread);
  CheckHistoryWarp<256, 1, true, false>("D256 G256 g8", 8, 3, Logits::kPeaky);
}

// Variant 0's warp at g = 8 (D 128, fp16 q·K, bf16 hi / lo P'·V on the float
// tensor cores: the default's kernel at g = 8 and at head dims 64 and 256)
// over long units, every token weighing (flat logits) and V rows as the
// encoder makes them, under both of the emulation's float mma sums. The
// warp's P'·V accumulators are carried through every mma of its unit; the
// truncating adder cuts each product at the accumulator's last bit, so the
// accumulators must stay near the output's size: HistoryWarp::ValueProduct
// centers the codes (2 and 1 in turn). Measured here with the codes as
// stored (c = 0..3, no center): 8.3e-5 at 75 chunks and 1.2e-3 at 300 with
// truncating sums, 7e-6 and 3.5e-5 with fused ones; a fixed center of 2:
// 4.4e-6 and 5.3e-5 truncating; the centers in turn: 3.4e-6 and 2.7e-6
// (dev VM, 2026-12-02; relative L2 of o). 75 chunks per warp is one 300-page
// unit, where the H200 erred by 3.2e-5 relative L2 (1.0e-4·(1 + |o|) in one
// element) before the centers (RESULTS run 27).
constexpr double kLongUnitTol = 2e-5;

// Puts the emulation's float mma sums back to their default at the end of a
// test that switches them.
struct RestoreFloatMmaSums {
  ~RestoreFloatMmaSums() {
    warp_emulation::SetFloatMmaSums(warp_emulation::FloatMmaSums::kRoundToNearest);
  }
};

TEST(HistoryWarpEmulation, FloatValueProductStaysAccurateOverLongUnitsOfTruncatingSums) {
  using W = HistoryWarp<kD, 1, true, false>;
  RestoreFloatMmaSums restore;
  for (const int chunks : {8, 75, 300}) {
    SCOPED_TRACE(testing::Message() << chunks << " chunks");
    const Input in = MakeInput<W>(8, chunks, Logits::kFlat, false, 7000 + chunks,
                                  kTokensPerChunk, /*encoded_values=*/true);
    warp_emulation::SetFloatMmaSums(warp_emulation::FloatMmaSums::kRoundToNearest);
    const Errors fused = CompareWithFp64(in, RunHistoryWarp<W>(in));
    warp_emulation::SetFloatMmaSums(warp_emulation::FloatMmaSums::kAlignedTruncation);
    const Errors cut = CompareWithFp64(in, RunHistoryWarp<W>(in));
    std::printf("g8 fp16 q, flat logits, encoded V rows, %3d chunks: o err %.2e (fused sums), "
                "%.2e (truncating sums); l err %.1e / %.1e\n",
                chunks, fused.o, cut.o, fused.l, cut.l);
    EXPECT_LT(fused.o, kLongUnitTol);
    EXPECT_LT(cut.o, kLongUnitTol);
    EXPECT_LT(fused.l, kSumTol);
    EXPECT_LT(cut.l, kSumTol);
  }
}

// The emulation's own operations on known values, so that a wrong lane
// layout shows up here and not only as an attention error.
TEST(WarpEmulation, ShufflesTransposeAndIntegerMma) {
  using namespace cuda_attend;  // NOLINT
  int xor_ok = 0, transpose_ok = 0, mma_ok = 0, any_ok = 0;
  std::mutex mu;
  warp_emulation::RunWarp([&](int lane) {
    const float v = __shfl_xor_sync(0xffffffffu, float(lane), 5);
    const int up = __shfl_sync(0xffffffffu, lane * 3, (lane + 1) & 31);
    // movmatrix: lane l holds row l/4, cols 2(l%4), +1 of M[i][j] = 8i + j.
    const int i = lane >> 2, j = 2 * (lane & 3);
    const uint32_t t = TransposeM8N8(uint32_t(8 * i + j) | (uint32_t(8 * i + j + 1) << 16));
    const bool t_ok = (t & 0xffffu) == uint32_t(8 * j + i) && (t >> 16) == uint32_t(8 * (j + 1) + i);
    // A = 1 everywhere, B[k][n] = n - 4 (s8): every D element of column n is 32(n - 4).
    int c[4] = {0, 0, 0, 0};
    const uint32_t b = 0x01010101u * uint32_t(uint8_t(int8_t(i - 4)));  // col n = groupID
    ImmaU8S8(c, 0x01010101u, 0x01010101u, 0x01010101u, 0x01010101u, b, b);
    const int n0 = 2 * (lane & 3), n1 = n0 + 1;
    const bool m_ok = c[0] == 32 * (n0 - 4) && c[1] == 32 * (n1 - 4) && c[2] == 32 * (n0 - 4) &&
                      c[3] == 32 * (n1 - 4);
    const bool a_ok = __any_sync(0xffffffffu, lane == 17) == 1 && __any_sync(0xffffffffu, 0) == 0;
    std::lock_guard<std::mutex> lock(mu);
    xor_ok += v == float(lane ^ 5) && up == ((lane + 1) & 31) * 3;
    transpose_ok += t_ok;
    mma_ok += m_ok;
    any_ok += a_ok;
  });
  EXPECT_EQ(xor_ok, 32);
  EXPECT_EQ(transpose_ok, 32);
  EXPECT_EQ(mma_ok, 32);
  EXPECT_EQ(any_ok, 32);
  EXPECT_EQ(cuda_attend::Prmt(0x33221100u, 0x77665544u, 0x5140u), 0x55114400u);
  EXPECT_EQ(cuda_attend::Prmt(0x00008000u, 0u, 0x0009u), 0x000000ffu);  // sign replicate
}

// The emulated float mma's two sums on one case: c = 1 + 2^-23 (1 + ulp)
// and 16 products of 2^-24 (half an ulp each). Fused sums round each fma to
// nearest even: the first goes up to 1 + 2 ulp, the others tie back to it.
// The truncating model cuts every product to 0 at c's last bit: c stays.
TEST(WarpEmulation, TruncatingFloatMmaSumsCutAddendsAtTheAccumulatorsLastBit) {
  RestoreFloatMmaSums restore;
  const float ulp = std::ldexp(1.0f, -23);
  float got[2] = {0, 0};
  for (const int mode : {0, 1}) {
    warp_emulation::SetFloatMmaSums(mode == 0 ? warp_emulation::FloatMmaSums::kRoundToNearest
                                              : warp_emulation::FloatMmaSums::kAlignedTruncation);
    std::mutex mu;
    warp_emulation::RunWarp([&](int lane) {
      // A = 1 everywhere (bf16 0x3f80), B = 2^-24 everywhere (bf16 0x3380).
      float c[4] = {1.0f + ulp, 0.0f, 0.0f, 0.0f};
      cuda_attend::MmaBf16(c, 0x3f803f80u, 0x3f803f80u, 0x3f803f80u, 0x3f803f80u, 0x33803380u,
                           0x33803380u);
      if (lane == 0) {
        std::lock_guard<std::mutex> lock(mu);
        got[mode] = c[0];
      }
    });
  }
  EXPECT_EQ(got[0], 1.0f + 2 * ulp) << "fused sums";
  EXPECT_EQ(got[1], 1.0f + ulp) << "truncating sums: every 2^-24 addend is cut at c's last bit";
}

// The mma fragments with distinct values against plain matrix products,
// the fragments laid out from the PTX ISA's tables as written out here
// (a guard against the emulation drifting, not a second source).
TEST(WarpEmulation, MmaFragmentsOfDistinctValuesGiveTheMatrixProduct) {
  // m16n8k32 u8 x s8: A[i][k] = (7i + 3k) % 251, B[k][n] = (5k + 11n) % 200 - 100.
  const auto a8 = [](int i, int k) { return uint32_t((7 * i + 3 * k) % 251); };
  const auto b8 = [](int k, int n) { return (5 * k + 11 * n) % 200 - 100; };
  // m16n8k16 f16: small integers, exact in fp16 and in the fp32 sums.
  const auto af = [](int i, int k) { return float((3 * i + k) % 17 - 8); };
  const auto bf = [](int k, int n) { return float((k + 5 * n) % 13 - 6); };
  int ok8 = 0, okf = 0;
  std::mutex mu;
  warp_emulation::RunWarp([&](int lane) {
    const int g = lane >> 2, t = lane & 3;
    uint32_t a[4] = {0, 0, 0, 0}, b[2] = {0, 0};
    for (int j = 0; j < 4; ++j) {
      a[0] |= a8(g, 4 * t + j) << (8 * j);
      a[1] |= a8(g + 8, 4 * t + j) << (8 * j);
      a[2] |= a8(g, 16 + 4 * t + j) << (8 * j);
      a[3] |= a8(g + 8, 16 + 4 * t + j) << (8 * j);
      b[0] |= uint32_t(uint8_t(int8_t(b8(4 * t + j, g)))) << (8 * j);
      b[1] |= uint32_t(uint8_t(int8_t(b8(16 + 4 * t + j, g)))) << (8 * j);
    }
    int c[4] = {1, 2, 3, 4};  // accumulated onto
    cuda_attend::ImmaU8S8(c, a[0], a[1], a[2], a[3], b[0], b[1]);
    bool good8 = true;
    for (int e = 0; e < 4; ++e) {
      const int row = g + (e >= 2 ? 8 : 0), col = 2 * t + (e & 1);
      int want = e + 1;
      for (int k = 0; k < 32; ++k) want += int(a8(row, k)) * b8(k, col);
      good8 = good8 && c[e] == want;
    }
    const auto pack = warp_emulation::PackHalves;
    const uint32_t fa0 = pack(af(g, 2 * t), af(g, 2 * t + 1));
    const uint32_t fa1 = pack(af(g + 8, 2 * t), af(g + 8, 2 * t + 1));
    const uint32_t fa2 = pack(af(g, 2 * t + 8), af(g, 2 * t + 9));
    const uint32_t fa3 = pack(af(g + 8, 2 * t + 8), af(g + 8, 2 * t + 9));
    const uint32_t fb0 = pack(bf(2 * t, g), bf(2 * t + 1, g));
    const uint32_t fb1 = pack(bf(2 * t + 8, g), bf(2 * t + 9, g));
    float cf[4] = {0.5f, 0.0f, 0.0f, 0.0f};
    cuda_attend::MmaF16(cf, fa0, fa1, fa2, fa3, fb0, fb1);
    bool goodf = true;
    for (int e = 0; e < 4; ++e) {
      const int row = g + (e >= 2 ? 8 : 0), col = 2 * t + (e & 1);
      float want = e == 0 ? 0.5f : 0.0f;
      for (int k = 0; k < 16; ++k) want += af(row, k) * bf(k, col);
      goodf = goodf && cf[e] == want;
    }
    std::lock_guard<std::mutex> lock(mu);
    ok8 += good8;
    okf += goodf;
  });
  EXPECT_EQ(ok8, 32);
  EXPECT_EQ(okf, 32);
}

}  // namespace
}  // namespace oscarkv
