#include "server/cache/layer_cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/cache_fixture.h"

namespace oscarkv {
namespace {

using testing::CacheFixture;

constexpr int kHeads = 2, kDim = 64, kGroup = 32;
const TierConfig kTiers{8, 16, 4};  // small S0, W, P so that boundaries are cheap

// Reads the layer back and the raw history bytes.
struct Snapshot {
  std::vector<bf16_bits> k, v;
  std::vector<uint8_t> history;
};

Snapshot Read(CacheFixture& f, const LayerCache& layer) {
  Snapshot s;
  const size_t row = f.geom.exact_row_elems();
  s.k.resize(layer.tokens() * row);
  s.v.resize(layer.tokens() * row);
  std::vector<bf16_bits> scratch(f.geom.exact_block_bytes() / sizeof(bf16_bits));
  EXPECT_TRUE(
      layer.ReadBf16(f.codec, *f.pool, f.backend, scratch.data(), s.k.data(), s.v.data()).ok());
  for (SlotId id : layer.history_pages()) {
    const uint8_t* p = f.pool->page(id);
    s.history.insert(s.history.end(), p, p + f.geom.page_bytes());
  }
  return s;
}

class TierBoundaries : public ::testing::TestWithParam<int64_t> {};

TEST_P(TierBoundaries, OneAtATimeEqualsRandomChunks) {
  const int64_t t = GetParam();
  CacheFixture f(kHeads, kDim, kGroup, kTiers);
  const size_t row = f.geom.exact_row_elems();
  const auto k = testing::RandomBf16(std::max<int64_t>(t, 1) * row, 10 + t, kDim);
  const auto v = testing::RandomBf16(std::max<int64_t>(t, 1) * row, 20 + t, kDim);

  LayerCache single = f.NewLayer();
  for (int64_t i = 0; i < t; ++i) {
    ASSERT_TRUE(f.Append(single, &k[i * row], &v[i * row], 1).ok());
  }
  LayerCache chunked = f.NewLayer();
  std::mt19937 rng(static_cast<unsigned>(t));
  for (int64_t i = 0; i < t;) {
    const int64_t n = std::min<int64_t>(t - i, 1 + rng() % 50);
    ASSERT_TRUE(f.Append(chunked, &k[i * row], &v[i * row], n).ok());
    i += n;
  }
  LayerCache whole = f.NewLayer();
  ASSERT_TRUE(f.Append(whole, k.data(), v.data(), t).ok());

  const TierCounts c = single.counts();
  EXPECT_EQ(c.sink + c.history + c.recent, t);
  EXPECT_EQ(c.sink, std::min<int64_t>(t, kTiers.sink_tokens));
  if (c.history > 0) {
    EXPECT_GE(c.recent, kTiers.recent_window);
    EXPECT_LT(c.recent, kTiers.recent_window + kTiers.page_tokens);
  }
  EXPECT_EQ(single.history_pages().size(), size_t(c.pages));

  const Snapshot a = Read(f, single), b = Read(f, chunked), w = Read(f, whole);
  EXPECT_EQ(a.k, b.k);
  EXPECT_EQ(a.v, b.v);
  EXPECT_EQ(a.history, b.history);
  EXPECT_EQ(a.history, w.history);
  EXPECT_EQ(a.k, w.k);

  // Sink and recent bit-exact; history within the quantizer's bound after the round trip.
  for (int64_t i = 0; i < t; ++i) {
    const bool exact = i < c.sink || i >= c.sink + c.history;
    for (size_t e = 0; e < row; ++e) {
      const size_t idx = i * row + e;
      if (exact) {
        ASSERT_EQ(a.k[idx], k[idx]) << "token " << i;
        ASSERT_EQ(a.v[idx], v[idx]) << "token " << i;
      }
    }
  }
  if (c.history > 0) {
    // Relative reconstruction error of history rows: INT2 with G=32 and clipping.
    double num = 0, den = 0;
    for (int64_t i = c.sink; i < c.sink + c.history; ++i) {
      for (size_t e = 0; e < row; ++e) {
        const double x = Bf16ToFloat(k[i * row + e]), y = Bf16ToFloat(a.k[i * row + e]);
        num += (x - y) * (x - y);
        den += x * x;
      }
    }
    EXPECT_LT(std::sqrt(num / den), 0.6);
  }
  for (auto* l : {&single, &chunked, &whole}) l->Release(*f.pool);
  EXPECT_EQ(f.pool->free_pages(), f.pool->total_pages());
  EXPECT_EQ(f.pool->free_blocks(), f.pool->total_blocks());
}

// 0, 1, S0-1, S0, S0+W-1, S0+W, S0+W+P-1, S0+W+P, S0+W+P+1, large (several flushes of staging).
INSTANTIATE_TEST_SUITE_P(Boundaries, TierBoundaries,
                         ::testing::Values(0, 1, 7, 8, 23, 24, 27, 28, 29, 101,
                                           8 + 16 + 4 * (kMaxStagedPages + 3) + 3));

TEST(LayerCache, HistoryDecodesWithinQuantizerBound) {
  CacheFixture f(kHeads, kDim, kGroup, kTiers);
  const size_t row = f.geom.exact_row_elems();
  const int64_t t = 200;
  const auto k = testing::RandomBf16(t * row, 1, kDim), v = testing::RandomBf16(t * row, 2, kDim);
  LayerCache layer = f.NewLayer();
  ASSERT_TRUE(f.Append(layer, k.data(), v.data(), t).ok());
  // Compare in the rotated domain: rotate the input, clip, and check against the stored codes.
  const PageGeometry& g = f.geom;
  const TierCounts c = layer.counts();
  for (int p = 0; p < c.pages; ++p) {
    const uint8_t* page = f.pool->page(layer.history_pages()[p]);
    for (int h = 0; h < kHeads; ++h) {
      for (int tok = 0; tok < g.page_tokens; ++tok) {
        const int64_t pos = c.sink + int64_t(p) * g.page_tokens + tok;
        float y[kDim], scratch[kDim], out[kDim];
        RotateRow(&k[pos * row + h * kDim], f.r_k.data(), kDim, y);
        ClipRow(y, kDim, f.codec.clip_k, scratch);
        const auto* params =
            reinterpret_cast<const QuantParams*>(page + g.params_offset(h, 0)) + tok * g.groups();
        DequantizeRow(page + g.codes_offset(h, 0) + tok * g.code_row_bytes(), params, kDim,
                      kGroup, out);
        for (int j = 0; j < kDim; ++j) {
          const QuantParams qp = params[j / kGroup];
          const float step = Fp16ToFloat(qp.scale);
          ASSERT_LE(std::fabs(out[j] - y[j]), 0.5f * step + 2e-3f * (std::fabs(y[j]) + step))
              << "page " << p << " head " << h << " token " << tok << " j " << j;
        }
      }
    }
  }
}

TEST(LayerCache, RejectsNonFiniteValuesAndStoresNothing) {
  CacheFixture f(kHeads, kDim, kGroup, kTiers);
  const size_t row = f.geom.exact_row_elems();
  auto k = testing::RandomBf16(40 * row, 3, kDim), v = testing::RandomBf16(40 * row, 4, kDim);
  LayerCache layer = f.NewLayer();
  ASSERT_TRUE(f.Append(layer, k.data(), v.data(), 10).ok());
  k[35 * row + 3] = FloatToBf16(std::nanf(""));
  const absl::Status s = f.Append(layer, &k[10 * row], &v[10 * row], 30);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("NaN or Inf"));
  EXPECT_EQ(layer.tokens(), 10);
  v[12 * row] = 0x7f80;  // +Inf
  k[35 * row + 3] = 0;
  EXPECT_EQ(f.Append(layer, &k[10 * row], &v[10 * row], 30).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(layer.tokens(), 10);
}

TEST(LayerCache, EmptyAppendIsANoOp) {
  CacheFixture f(kHeads, kDim, kGroup, kTiers);
  LayerCache layer = f.NewLayer();
  EXPECT_TRUE(f.Append(layer, nullptr, nullptr, 0).ok());
  EXPECT_EQ(layer.tokens(), 0);
}

TEST(LayerCache, PlanMatchesWhatAppendTakes) {
  CacheFixture f(kHeads, kDim, kGroup, kTiers);
  const size_t row = f.geom.exact_row_elems();
  const auto k = testing::RandomBf16(500 * row, 5, kDim), v = testing::RandomBf16(500 * row, 6, kDim);
  LayerCache layer = f.NewLayer();
  for (int64_t n : {3, 50, 1, 400, 46}) {
    const int64_t at = layer.tokens();
    const AppendPlan plan = layer.Plan(n);
    auto res = f.pool->Reserve(plan.pages, plan.peak_blocks);
    ASSERT_TRUE(res.ok());
    ASSERT_TRUE(layer.Append(&k[at * row], &v[at * row], n, f.codec, *f.pool, *res, f.backend,
                             nullptr).ok());
    EXPECT_EQ(res->pages_left(), 0) << "all planned pages used";
    EXPECT_EQ(res->blocks_left(), plan.peak_blocks - plan.net_blocks);
  }
  const TierCounts c = layer.counts();
  EXPECT_EQ(f.pool->total_pages() - f.pool->free_pages(), c.pages);
  EXPECT_EQ(f.pool->total_blocks() - f.pool->free_blocks(), c.sink_blocks + c.recent_blocks);
}

// The store hands the backends the layer's own page table and its id
// (AttendItem::page_table_id): the table only grows while the id lives.
TEST(LayerCache, PageTableGrowsAtTheEndUnderOneIdAndReleaseDropsTheId) {
  CacheFixture f(kHeads, kDim, kGroup, kTiers);
  const size_t row = f.geom.exact_row_elems();
  const auto k = testing::RandomBf16(300 * row, 7, kDim), v = testing::RandomBf16(300 * row, 8, kDim);
  auto pointers_of = [&](const LayerCache& l) {
    std::vector<const uint8_t*> p;
    for (SlotId id : l.history_pages()) p.push_back(f.pool->page(id));
    return p;
  };
  LayerCache a = f.NewLayer(), b = f.NewLayer();
  ASSERT_TRUE(f.Append(a, k.data(), v.data(), 20).ok());
  EXPECT_EQ(a.page_table_id(), 0u) << "no pages yet";
  EXPECT_TRUE(a.page_pointers().empty());
  int64_t at = 20;
  uint64_t id = 0;
  std::vector<const uint8_t*> before;
  for (int64_t n : {1, 7, 1, 60, 1, 1, 33}) {
    ASSERT_TRUE(f.Append(a, &k[at * row], &v[at * row], n).ok());
    at += n;
    EXPECT_EQ(a.page_pointers(), pointers_of(a));
    if (a.page_pointers().empty()) continue;
    if (id == 0) id = a.page_table_id();
    EXPECT_NE(id, 0u);
    EXPECT_EQ(a.page_table_id(), id) << "same table, same id";
    ASSERT_GE(a.page_pointers().size(), before.size());
    EXPECT_TRUE(std::equal(before.begin(), before.end(), a.page_pointers().begin()))
        << "only grows at the end";
    before = a.page_pointers();
  }
  ASSERT_GT(before.size(), 3u);
  std::vector<ExactBlockRef> exact;
  std::vector<const uint8_t*> pages;
  a.AttendRefs(*f.pool, &exact, &pages);
  EXPECT_EQ(pages, a.page_pointers());
  ASSERT_TRUE(f.Append(b, k.data(), v.data(), 100).ok());
  EXPECT_NE(b.page_table_id(), 0u);
  EXPECT_NE(b.page_table_id(), id) << "another layer, another id";
  a.Release(*f.pool);
  EXPECT_EQ(a.page_table_id(), 0u);
  EXPECT_TRUE(a.page_pointers().empty());
  ASSERT_TRUE(f.Append(a, k.data(), v.data(), 100).ok());
  EXPECT_NE(a.page_table_id(), 0u);
  EXPECT_NE(a.page_table_id(), id) << "a rebuilt table never reuses an id";
  EXPECT_NE(a.page_table_id(), b.page_table_id());
  EXPECT_EQ(a.page_pointers(), pointers_of(a));
}

TEST(PagePool, ReservationIsAllOrNothing) {
  CacheFixture f(kHeads, kDim, kGroup, kTiers, 1 << 20);
  const int pages = f.pool->total_pages(), blocks = f.pool->total_blocks();
  auto too_many = f.pool->Reserve(pages + 1, 1);
  EXPECT_EQ(too_many.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(too_many.status().message()), ::testing::HasSubstr("pool is full"));
  EXPECT_EQ(f.pool->free_pages(), pages);
  EXPECT_EQ(f.pool->free_blocks(), blocks);
  {
    auto r = f.pool->Reserve(pages, blocks);
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(f.pool->free_pages(), 0);
  }
  EXPECT_EQ(f.pool->free_pages(), pages);  // returned on destruction
}

TEST(PagePool, RejectsPoolTooSmallForOneSlot) {
  CpuBackend backend(1);
  PoolOptions o{1000, 0.5, 18432, 131072};
  auto p = PagePool::Create(&backend, o);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(p.status().message()), ::testing::HasSubstr("too small"));
}

TEST(TierCounts, MatchDesignDefinition) {
  const TierConfig d;  // 64, 256, 32
  EXPECT_EQ(CountTiers(d, 0).recent, 0);
  EXPECT_EQ(CountTiers(d, 64 + 256 + 31).pages, 0);
  EXPECT_EQ(CountTiers(d, 64 + 256 + 32).pages, 1);
  EXPECT_EQ(CountTiers(d, 64 + 256 + 32).recent, 256);
  const TierCounts big = CountTiers(d, 131072);
  EXPECT_EQ(big.sink, 64);
  EXPECT_GE(big.recent, 256);
  EXPECT_LT(big.recent, 288);
  EXPECT_EQ(big.sink + big.history + big.recent, 131072);
}

}  // namespace
}  // namespace oscarkv
