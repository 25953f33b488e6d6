// The CUDA launcher's bookkeeping of device page tables is host code: tested
// on the CPU (runs in CI).
#include "kernels/cuda/page_table_cache.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace oscarkv::cuda_attend {
namespace {

// A table of n fake page addresses, distinct per `seed`.
std::vector<const void*> Table(int n, uintptr_t seed) {
  std::vector<const void*> t;
  for (int i = 0; i < n; ++i) t.push_back(reinterpret_cast<const void*>((seed << 32) + 4096 * (i + 1)));
  return t;
}

TEST(PageTableCache, CapacityIsAPowerOfTwoOfAtLeastTheMinimum) {
  EXPECT_EQ(PageTableCache::CapacityFor(0), PageTableCache::kMinEntries);
  EXPECT_EQ(PageTableCache::CapacityFor(1), PageTableCache::kMinEntries);
  EXPECT_EQ(PageTableCache::CapacityFor(64), 64u);
  EXPECT_EQ(PageTableCache::CapacityFor(65), 128u);
  EXPECT_EQ(PageTableCache::CapacityFor(4096), 4096u);
  EXPECT_EQ(PageTableCache::CapacityFor(4097), 8192u);
}

TEST(PageTableCache, AGrowingTableUploadsOnlyItsNewEntries) {
  PageTableCache c(1024);
  const auto t = Table(200, 1);
  auto p = c.Place(7, t.data(), 10);
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->upload_from, 0) << "new: whole";
  const size_t at = p->offset;
  p = c.Place(7, t.data(), 10);
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->offset, at);
  EXPECT_EQ(p->upload_from, 10) << "unchanged: nothing";
  p = c.Place(7, t.data(), 11);
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->offset, at);
  EXPECT_EQ(p->upload_from, 10) << "one more page: that one";
  EXPECT_EQ(c.used(), 64u);
  // Past its 64 entries: a new run of 128, uploaded whole.
  p = c.Place(7, t.data(), 65);
  ASSERT_TRUE(p.has_value());
  EXPECT_NE(p->offset, at);
  EXPECT_EQ(p->upload_from, 0);
  EXPECT_EQ(c.used(), 64u + 128u);
  EXPECT_EQ(c.tables(), 1u);
}

TEST(PageTableCache, AChangedOrShorterTableIsUploadedWhole) {
  PageTableCache c(1024);
  auto t = Table(50, 2);
  ASSERT_TRUE(c.Place(3, t.data(), 40).has_value());
  // Shorter than remembered: not the promised append-only table.
  auto p = c.Place(3, t.data(), 30);
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->upload_from, 0);
  // Its last remembered entry differs: uploaded whole too.
  t[29] = reinterpret_cast<const void*>(uintptr_t(99) << 32);
  p = c.Place(3, t.data(), 35);
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->upload_from, 0);
  // And now remembered as it is.
  p = c.Place(3, t.data(), 36);
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->upload_from, 35);
}

TEST(PageTableCache, TablesGetDisjointRunsAndAFullArrayRefusesUntilCleared) {
  PageTableCache c(256);
  const auto a = Table(100, 3), b = Table(60, 4), d = Table(10, 5);
  const auto pa = c.Place(1, a.data(), 100);  // 128 entries
  const auto pb = c.Place(2, b.data(), 60);   // 64
  const auto pd = c.Place(3, d.data(), 10);   // 64
  ASSERT_TRUE(pa && pb && pd);
  EXPECT_EQ(pa->offset, 0u);
  EXPECT_EQ(pb->offset, 128u);
  EXPECT_EQ(pd->offset, 192u);
  EXPECT_EQ(c.used(), 256u);
  // Known tables that fit their runs still work when the array is full.
  EXPECT_TRUE(c.Place(2, b.data(), 64).has_value());
  EXPECT_FALSE(c.Place(4, d.data(), 1).has_value()) << "no room for a new one";
  EXPECT_FALSE(c.Place(2, b.data(), 65).has_value()) << "nor for a grown one";
  c.Clear();
  EXPECT_EQ(c.used(), 0u);
  EXPECT_EQ(c.tables(), 0u);
  const auto p = c.Place(2, b.data(), 60);
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->upload_from, 0) << "forgotten: uploaded whole again";
  c.Reset(64);
  EXPECT_EQ(c.capacity(), 64u);
  EXPECT_EQ(c.used(), 0u);
  EXPECT_FALSE(c.Place(1, a.data(), 100).has_value()) << "larger than the whole array";
}

// The store attends one layer per call, so the tables in use are those of
// every layer: an array that cannot hold them grows (doubling while they fill
// more than half of it) instead of being emptied on every round of layers.
TEST(PageTableCache, AFullArrayGrowsWhileTheTablesInUseFillMoreThanHalfOfIt) {
  PageTableCache c(512);
  const auto t = Table(100, 6);
  ASSERT_TRUE(c.Place(1, t.data(), 100).has_value());  // 128
  ASSERT_TRUE(c.Place(2, t.data(), 100).has_value());  // 256
  EXPECT_EQ(c.live(), 256u);
  // Known tables 256 + a batch of 256: 512 > 512 / 2: grow until they fill
  // at most half.
  EXPECT_EQ(c.CapacityWhenFull(256, 1 << 20), 1024u);
  EXPECT_EQ(c.CapacityWhenFull(256, 600), 600u) << "capped";
  EXPECT_EQ(c.CapacityWhenFull(256, 512), 512u) << "at the cap: emptied instead";
  // A table that moves abandons its run: live counts only the new one.
  ASSERT_TRUE(c.Place(2, t.data(), 10).has_value());  // shrank: new run of 64
  EXPECT_EQ(c.live(), 128u + 64u);
  EXPECT_EQ(c.used(), 128u + 128u + 64u);
  // Mostly abandoned space and a small batch: emptied, not grown.
  EXPECT_EQ(c.CapacityWhenFull(64, 1 << 20), 512u);
  c.Clear();
  EXPECT_EQ(c.live(), 0u);
}

}  // namespace
}  // namespace oscarkv::cuda_attend
