// The attention work planner (kernels/cuda/attend_schedule.h), on the CPU: it
// runs in CI, where the GPU tests skip. Every history page and exact block of
// every (item, kv head) must be covered by exactly one unit, units must fit in
// one wave whenever that is possible, and each item's partial ranges must name
// exactly its units.
#include <algorithm>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/attend_schedule.h"

namespace oscarkv {
namespace cuda_attend {
namespace {

struct Case {
  std::vector<AttendItem> items;
  int kv_heads;
  long capacity;
  FoldExact fold = FoldExact::kAuto;
  bool exact_first = true;  // the shape's split kernel runs folded blocks first
  bool flat_cut = false;    // the shape's split kernel runs units of two kv heads
  RankShares shares;        // unit weights by arrival rank (flat cuts)
};

// The partials each (item, kv head)'s parts write: its history and exact sets.
struct HeadSets {
  std::set<int> hist, exact;
};

// Checks one history unit of a flat cut: at most two kv heads, the second
// one's pages only after the whole of the first's, and the exact blocks of
// one head, before that head's pages.
// `blocks`: the item's exact blocks that ride on its history units.
void CheckFlatUnit(const WorkUnit& w, const AttendItem& it, int H, int blocks) {
  EXPECT_TRUE(w.exact_head == w.kv_head || w.exact_head == w.kv_head + 1);
  EXPECT_LT(w.exact_head, H);
  const bool has_history = w.partial >= 0, has_exact = w.exact_partial >= 0;
  if (w.next_partial >= 0) {
    EXPECT_TRUE(has_history);
    EXPECT_LT(w.kv_head + 1, H);
    EXPECT_GT(w.next_end, 0);
    EXPECT_LE(w.next_end, it.num_pages);
  } else {
    EXPECT_EQ(w.next_end, 0);
  }
  if (has_exact && w.exact_head == w.kv_head + 1) {
    // The blocks of the next head: this head's pages up to its end, then
    // the next head's blocks from its first.
    EXPECT_TRUE(has_history);
    EXPECT_EQ(w.end, it.num_pages);
    EXPECT_EQ(w.exact_begin, 0);
  }
  if (has_exact && w.exact_head == w.kv_head && has_history) {
    // The blocks of this head, then its pages from its first.
    EXPECT_EQ(w.begin, 0);
    EXPECT_EQ(w.exact_end, blocks);
  }
  if (w.next_partial >= 0) {
    // All of the next head's blocks come before its pages.
    EXPECT_EQ(w.end, it.num_pages);
    if (blocks > 0) {
      EXPECT_TRUE(has_exact);
      EXPECT_EQ(w.exact_head, w.kv_head + 1);
      EXPECT_EQ(w.exact_end, blocks);
    }
  }
  if (has_exact) EXPECT_LE(w.exact_end, blocks);
}

// What the merge reads for each (item, head) (heads[ih]'s partial ranges) is
// exactly what its parts wrote (written[ih]); `H` heads per item.
void ExpectRangesNameWhatWasWritten(const std::vector<HeadPartials>& heads,
                                    const std::vector<HeadSets>& written, int H) {
  auto range = [](int first, int count) {
    std::set<int> r;
    for (int k = 0; k < count; ++k) r.insert(first + k);
    return r;
  };
  for (size_t ih = 0; ih < heads.size(); ++ih) {
    SCOPED_TRACE(testing::Message() << "item " << ih / H << " head " << ih % H);
    EXPECT_EQ(range(heads[ih].hist_first, heads[ih].hist_count), written[ih].hist);
    EXPECT_EQ(range(heads[ih].exact_first, heads[ih].exact_count), written[ih].exact);
  }
}

void CheckPlan(const Case& c) {
  const int n = static_cast<int>(c.items.size()), H = c.kv_heads;
  const UnitSizes sizes = SizeAttendUnits(c.items.data(), n, H, c.capacity, c.fold, c.exact_first,
                                          c.flat_cut, c.shares);
  EXPECT_EQ(sizes.exact_page_cost,
            sizes.fold_exact && c.exact_first ? kFoldedExactPageCost : 0);
  if (!c.flat_cut) EXPECT_FALSE(sizes.flat);
  if (sizes.rank_shares) EXPECT_TRUE(sizes.flat && c.shares.active());
  std::vector<WorkUnit> work(sizes.num_work());
  std::vector<HeadPartials> heads(size_t(n) * H);
  FillAttendUnits(sizes, c.items.data(), n, H, work.data(), heads.data());

  long pages = 0, exact = 0, item_heads_with_pages = 0;
  for (const AttendItem& it : c.items) {
    pages += it.num_pages;
    exact += it.num_exact;
    item_heads_with_pages += it.num_pages > 0 ? H : 0;
  }
  // One wave: history units never exceed the target share of the capacity
  // unless every (item, head) already has a single unit.
  const long target = std::max({1L, std::max<long>(1, c.capacity) / 2,
                                std::max<long>(1, c.capacity) - sizes.exact_units});
  if (item_heads_with_pages <= target) EXPECT_LE(sizes.history_units, target);
  EXPECT_GE(sizes.pages_per_unit, 1);
  EXPECT_GE(sizes.exact_per_unit, 1);

  // Coverage: each (item, head, page) and (item, head, exact block) once;
  // each partial index in [0, sizes.partials) written by exactly one part.
  std::set<std::tuple<int, int, int>> seen_pages, seen_exact;
  std::set<int> seen_partials;
  std::vector<HeadSets> written(size_t(n) * H);
  std::vector<int> unit_of_head(size_t(n) * H, 0);  // per-head cuts: units seen so far
  bool exact_phase = true;
  long exact_only = 0, with_history = 0;
  auto add_pages = [&](int item, int head, int begin, int end) {
    EXPECT_LT(begin, end);
    EXPECT_LE(end, c.items[item].num_pages);
    for (int pg = begin; pg < end; ++pg) {
      EXPECT_TRUE(seen_pages.insert({item, head, pg}).second);
    }
  };
  for (size_t u = 0; u < work.size(); ++u) {
    const WorkUnit& w = work[u];
    ASSERT_GE(w.item, 0);
    ASSERT_LT(w.item, n);
    ASSERT_GE(w.kv_head, 0);
    ASSERT_LT(w.kv_head, H);
    const bool has_history = w.partial >= 0, has_exact = w.exact_partial >= 0;
    EXPECT_TRUE(has_history || has_exact) << "unit " << u << " has nothing to do";
    const AttendItem& it = c.items[w.item];
    // A flat cut's units (after the exact units) may hold exact blocks only
    // (a heavy block weight).
    const bool flat_unit =
        sizes.flat && long(u) >= sizes.exact_units && sizes.flat_units[w.item] > 0;
    if (flat_unit) EXPECT_GT(it.num_pages, 0);
    if (has_history || flat_unit) exact_phase = false;
    EXPECT_TRUE(has_history || flat_unit || exact_phase) << "exact-only units must come first";
    exact_only += has_history || flat_unit ? 0 : 1;
    with_history += has_history || flat_unit ? 1 : 0;
    const size_t ih = size_t(w.item) * H + w.kv_head;
    if (flat_unit) {
      CheckFlatUnit(w, it, H, sizes.fold_exact ? it.num_exact : 0);
    } else {
      EXPECT_EQ(w.exact_head, w.kv_head);
      EXPECT_EQ(w.next_partial, -1);
    }
    if (has_exact) {
      EXPECT_LT(w.exact_begin, w.exact_end);
      EXPECT_LE(w.exact_end, it.num_exact);
      EXPECT_EQ(has_history || flat_unit, sizes.fold_exact && it.num_pages > 0);
      if (!flat_unit) {
        const int splits = heads[ih].hist_count;
        const int per = has_history ? (it.num_exact + splits - 1) / splits
                                    : static_cast<int>(sizes.exact_per_unit);
        EXPECT_LE(w.exact_end - w.exact_begin, per);
        EXPECT_EQ(w.exact_begin % per, 0);
        // Per-head cuts: exact set entry e of the head is its unit e.
        EXPECT_EQ(w.exact_partial, heads[ih].exact_first + w.exact_begin / per);
      }
      EXPECT_TRUE(seen_partials.insert(w.exact_partial).second);
      written[size_t(w.item) * H + w.exact_head].exact.insert(w.exact_partial);
      for (int e = w.exact_begin; e < w.exact_end; ++e) {
        EXPECT_TRUE(seen_exact.insert({w.item, w.exact_head, e}).second);
      }
    }
    if (has_history) {
      if (!flat_unit) {
        // Unit s of its (item, kv head): ppu pages each, or FoldedPageCuts'
        // weighted cuts when the item's exact blocks ride along; history
        // set entry s of the head.
        const int s = unit_of_head[ih]++;
        const int splits = heads[ih].hist_count;
        ASSERT_LT(s, splits);
        EXPECT_EQ(w.partial, heads[ih].hist_first + s);
        const bool weighted = sizes.fold_exact && it.num_exact > 0 && sizes.exact_page_cost > 0;
        // An item cut per head in a flat plan has its own pages per unit.
        const long ppu = sizes.flat ? sizes.head_pages[w.item] : sizes.pages_per_unit;
        if (!weighted) {
          EXPECT_LE(w.end - w.begin, ppu);
          EXPECT_EQ(w.begin, s * ppu);
        } else {
          std::vector<long> cuts;
          FoldedPageCuts(it.num_pages, splits, ppu, it.num_exact,
                         FoldedExactPerUnit(it.num_exact, splits), sizes.exact_page_cost, &cuts);
          EXPECT_EQ(w.begin, cuts[s]);
          EXPECT_EQ(w.end, cuts[s + 1]);
        }
      }
      EXPECT_TRUE(seen_partials.insert(w.partial).second);
      written[ih].hist.insert(w.partial);
      add_pages(w.item, w.kv_head, w.begin, w.end);
    }
    if (w.next_partial >= 0) {
      EXPECT_TRUE(seen_partials.insert(w.next_partial).second);
      written[ih + 1].hist.insert(w.next_partial);
      add_pages(w.item, w.kv_head + 1, 0, w.next_end);
    }
  }
  EXPECT_EQ(exact_only, sizes.exact_units);
  EXPECT_EQ(with_history, sizes.history_units);
  EXPECT_EQ(static_cast<long>(seen_partials.size()), sizes.partials);
  if (!seen_partials.empty()) {
    EXPECT_EQ(*seen_partials.begin(), 0);
    EXPECT_EQ(*seen_partials.rbegin(), sizes.partials - 1);
  }
  EXPECT_EQ(static_cast<long>(seen_pages.size()), pages * H);
  EXPECT_EQ(static_cast<long>(seen_exact.size()), exact * H);
  ExpectRangesNameWhatWasWritten(heads, written, H);
}

AttendItem Item(int pages, int exact) {
  AttendItem it;
  it.num_pages = pages;
  it.num_exact = exact;
  return it;
}

TEST(AttendSchedule, CoversEveryPageAndBlockOnceForTheBenchmarkShapes) {
  // 396 = 3 resident blocks x 132 SMs (H200, default variant).
  CheckPlan({{Item(4086, 10)}, 8, 396});                    // B=1, 128K
  CheckPlan({{Item(246, 10)}, 8, 396});                     // B=1, 8K
  CheckPlan({std::vector<AttendItem>(8, Item(2038, 10)), 8, 396});  // B=8, 64K
}

TEST(AttendSchedule, ExactUnitsGetMoreOfTheWaveWhenTheHistoryIsLight) {
  // B=1 with 10 exact blocks per kv head, exact units of their own. Light
  // history (at most kLightPagesPerUnit pages per unit): one block per exact
  // unit, since two would put the exact units on the critical path; longer
  // history: the history units need the slots. By default (kAuto) only the
  // shortest of these keeps exact units: from kFoldPagesPerUnit pages per
  // unit the blocks ride on the history units.
  struct Case {
    int pages;  // per kv head
    long exact_per_unit, exact_units;
    bool folds_by_default;
  };
  for (const Case& c : {Case{246, 1, 80, false},     // 8K, ~7 pages per unit
                        Case{1014, 1, 80, true},     // 32K, ~26
                        Case{2038, 2, 40, true}}) {  // 64K, ~47
    SCOPED_TRACE("pages " + std::to_string(c.pages));
    const AttendItem item = Item(c.pages, 10);
    const UnitSizes u = SizeAttendUnits(&item, 1, 8, 396, FoldExact::kNever);
    EXPECT_FALSE(u.fold_exact);
    EXPECT_EQ(u.pages_per_unit >= kFoldPagesPerUnit, c.folds_by_default);
    EXPECT_EQ(u.exact_per_unit, c.exact_per_unit);
    EXPECT_EQ(u.exact_units, c.exact_units);
    CheckPlan({{item}, 8, 396, FoldExact::kNever});
    const UnitSizes by_default = SizeAttendUnits(&item, 1, 8, 396);
    EXPECT_EQ(by_default.fold_exact, c.folds_by_default);
    EXPECT_EQ(by_default.exact_units, c.folds_by_default ? 0 : c.exact_units);
    CheckPlan({{item}, 8, 396});
  }
}

TEST(AttendSchedule, LongHistoryUnitsTakeTheWholeWaveAndCarryTheExactBlocks) {
  // B=1, 128K: 93 pages per unit unfolded, long enough to carry the exact
  // blocks by default (forced gives the same): no exact units of their own;
  // 10 of the history units of each kv head take one exact block each.
  const AttendItem heavy = Item(4086, 10);
  const UnitSizes unfolded = SizeAttendUnits(&heavy, 1, 8, 396, FoldExact::kNever);
  EXPECT_FALSE(unfolded.fold_exact);
  EXPECT_EQ(unfolded.exact_per_unit, 2);
  EXPECT_LE(unfolded.exact_units, 396 / 8);
  EXPECT_GE(unfolded.pages_per_unit, kFoldPagesPerUnit);
  const UnitSizes a = SizeAttendUnits(&heavy, 1, 8, 396);
  EXPECT_TRUE(a.fold_exact);
  const UnitSizes u = SizeAttendUnits(&heavy, 1, 8, 396, FoldExact::kAlways);
  EXPECT_EQ(u.history_units, a.history_units);
  EXPECT_TRUE(u.fold_exact);
  EXPECT_EQ(u.exact_units, 0);
  EXPECT_LE(u.history_units, 396);
  EXPECT_GT(u.history_units, 396 - 396 / 8);
  const int splits = static_cast<int>(u.history_units / 8);
  EXPECT_EQ(FoldedExactSplits(10, splits), 10);
  EXPECT_EQ(u.partials, u.history_units + 8 * 10);
  // B=8, 64K (408 pages per unit unfolded), with one sink-only item: folded
  // by default; that item still gets exact units.
  std::vector<AttendItem> batch(8, Item(2038, 10));
  batch.push_back(Item(0, 3));
  const UnitSizes b = SizeAttendUnits(batch.data(), 9, 8, 396);
  EXPECT_TRUE(b.fold_exact);
  EXPECT_EQ(b.exact_units, 8 * 3);
  CheckPlan({batch, 8, 396});
  EXPECT_FALSE(SizeAttendUnits(batch.data(), 9, 8, 396, FoldExact::kNever).fold_exact);
  // History this short (7 pages per unit) folds only when forced.
  const AttendItem light = Item(246, 10);
  EXPECT_FALSE(SizeAttendUnits(&light, 1, 8, 396).fold_exact);
  const UnitSizes f = SizeAttendUnits(&light, 1, 8, 396, FoldExact::kAlways);
  EXPECT_TRUE(f.fold_exact);
  EXPECT_EQ(f.exact_units, 0);
  CheckPlan({{light}, 8, 396, FoldExact::kAlways});
  EXPECT_EQ(FoldedExactSplits(10, 4), 4);  // 3 + 3 + 3 + 1
  EXPECT_EQ(FoldedExactSplits(9, 6), 5);   // 2 x 4 + 1
  EXPECT_EQ(FoldedExactSplits(0, 6), 0);
}

TEST(AttendSchedule, FoldedUnitsTakeFewerPagesForTheirExactBlocks) {
  // B=1 32K folded: 1014 pages per kv head in 49 units of up to 21, 10 exact
  // blocks on the first 10 units. Each unit's pages plus the blocks' cost
  // come within a page of the even share; the cuts cover the pages in order.
  const long pages = 1014, ppu = 21, cost = kFoldedExactPageCost;
  const int splits = 49, exact = 10, per = FoldedExactPerUnit(exact, splits);
  std::vector<long> cuts;
  FoldedPageCuts(pages, splits, ppu, exact, per, cost, &cuts);
  ASSERT_EQ(cuts.size(), size_t(splits) + 1);
  EXPECT_EQ(cuts.front(), 0);
  EXPECT_EQ(cuts.back(), pages);
  const double share = double(pages + cost * exact) / splits;
  for (int s = 0; s < splits; ++s) {
    const long unit_pages = cuts[s + 1] - cuts[s], blocks = s < exact ? 1 : 0;
    EXPECT_GE(unit_pages, 1);
    EXPECT_NEAR(double(unit_pages + cost * blocks), share, 1.0) << "unit " << s;
  }
  EXPECT_LT(cuts[1] - cuts[0], cuts[splits] - cuts[splits - 1]);
  // No cost (or no blocks, or a single unit): ppu each, the last one the rest.
  FoldedPageCuts(pages, splits, ppu, exact, per, 0, &cuts);
  for (int s = 0; s < splits; ++s) EXPECT_EQ(cuts[s], s * ppu);
  EXPECT_EQ(cuts.back(), pages);
  FoldedPageCuts(5, 1, 5, 3, 3, cost, &cuts);
  EXPECT_EQ(cuts, (std::vector<long>{0, 5}));
  // Blocks costing more than a unit's share: still one page per unit at least.
  FoldedPageCuts(6, 3, 2, 2, 1, cost, &cuts);
  EXPECT_EQ(cuts, (std::vector<long>{0, 1, 2, 6}));
  // The blocks of each unit, 3 per unit over 10: 3, 3, 3, 1, then none.
  EXPECT_EQ(FoldedExactBlocks(10, 3, 3).begin, 9);
  EXPECT_EQ(FoldedExactBlocks(10, 3, 3).end, 10);
  EXPECT_EQ(FoldedExactBlocks(10, 3, 4).begin, FoldedExactBlocks(10, 3, 4).end);
  EXPECT_EQ(FoldedExactBlocks(10, 0, 0).begin, FoldedExactBlocks(10, 0, 0).end);
  CheckPlan({{Item(1014, 10)}, 8, 396, FoldExact::kAlways});
  CheckPlan({{Item(7, 10), Item(1014, 3), Item(0, 2)}, 8, 396, FoldExact::kAlways});
}

TEST(AttendSchedule, ShapesWithoutAnExactFirstKernelFoldOnlyLongUnitsAndCutThemEvenly) {
  // Their folded blocks run after the pages: from kFoldPagesPerUnitExactAfter
  // pages per unit, with even cuts. B=1 32K and 128K keep exact units; B=8
  // 64K folds.
  const AttendItem b1_32k = Item(1014, 10), b1_128k = Item(4086, 10);
  EXPECT_TRUE(SizeAttendUnits(&b1_32k, 1, 8, 396).fold_exact);
  EXPECT_FALSE(SizeAttendUnits(&b1_32k, 1, 8, 396, FoldExact::kAuto, false).fold_exact);
  EXPECT_FALSE(SizeAttendUnits(&b1_128k, 1, 8, 396, FoldExact::kAuto, false).fold_exact);
  const std::vector<AttendItem> b8_64k(8, Item(2038, 10));
  const UnitSizes b8 = SizeAttendUnits(b8_64k.data(), 8, 8, 396, FoldExact::kAuto, false);
  EXPECT_TRUE(b8.fold_exact);
  EXPECT_EQ(b8.exact_page_cost, 0);
  CheckPlan({b8_64k, 8, 396, FoldExact::kAuto, false});
  CheckPlan({{Item(1014, 10)}, 8, 396, FoldExact::kAlways, false});
}

TEST(AttendSchedule, HandlesEmptyItemsSinkOnlyItemsAndTinyCapacities) {
  CheckPlan({{Item(0, 0), Item(0, 1), Item(3, 2), Item(0, 0)}, 2, 1});
  CheckPlan({{Item(0, 0)}, 4, 396});
  CheckPlan({{}, 8, 396});
  CheckPlan({{Item(1, 1)}, 1, 0});
}

// A random batch: 1-8 kv heads, a capacity of 1..max_capacity, up to
// max_items - 1 items of up to max_pages - 1 pages and 13 exact blocks.
Case RandomCase(std::mt19937& rng, long max_capacity, int max_items, int max_pages) {
  Case c;
  c.kv_heads = 1 + static_cast<int>(rng() % 8);
  c.capacity = 1 + static_cast<long>(rng() % max_capacity);
  const int n = static_cast<int>(rng() % max_items);
  for (int i = 0; i < n; ++i) {
    c.items.push_back(Item(static_cast<int>(rng() % max_pages), static_cast<int>(rng() % 14)));
  }
  return c;
}

TEST(AttendSchedule, CoversRandomBatches) {
  std::mt19937 rng(5);
  int flat_plans = 0;
  for (int trial = 0; trial < 200; ++trial) {
    Case c = RandomCase(rng, 600, 12, 3000);
    const int n = static_cast<int>(c.items.size());
    SCOPED_TRACE(trial);
    CheckPlan(c);
    c.fold = FoldExact::kAlways;
    CheckPlan(c);
    c.fold = FoldExact::kNever;
    CheckPlan(c);
    for (const FoldExact fold : {FoldExact::kAuto, FoldExact::kAlways, FoldExact::kNever}) {
      c.fold = fold;
      c.flat_cut = true;
      CheckPlan(c);
      c.shares = RankShares{2 + trial % 4, 0.05 * (1 + trial % 6)};
      CheckPlan(c);
      c.shares = RankShares{};
      flat_plans += SizeAttendUnits(c.items.data(), n, c.kv_heads, c.capacity, fold, true, true).flat;
      c.exact_first = false;  // folded blocks without a weight: never flat
      CheckPlan(c);
      if (SizeAttendUnits(c.items.data(), n, c.kv_heads, c.capacity, fold, false, true)
              .fold_exact) {
        EXPECT_FALSE(
            SizeAttendUnits(c.items.data(), n, c.kv_heads, c.capacity, fold, false, true).flat);
      }
      c.exact_first = true;
      c.flat_cut = false;
    }
  }
  EXPECT_GT(flat_plans, 100) << "of 600";
}

// A unit's weight: its pages plus kFoldedExactPageCost per exact block.
long UnitWeight(const WorkUnit& w, long cost) {
  const long pages = (w.partial >= 0 ? w.end - w.begin : 0) + w.next_end;
  return pages + (w.exact_partial >= 0 ? cost * (w.exact_end - w.exact_begin) : 0);
}

long HeaviestUnit(const std::vector<AttendItem>& items, int H, long capacity, bool flat) {
  const int n = static_cast<int>(items.size());
  const UnitSizes u = SizeAttendUnits(items.data(), n, H, capacity, FoldExact::kAuto, true, flat);
  EXPECT_EQ(u.flat, flat);
  std::vector<WorkUnit> work(u.num_work());
  std::vector<HeadPartials> heads(size_t(n) * H);
  FillAttendUnits(u, items.data(), n, H, work.data(), heads.data());
  long heaviest = 0;
  for (const WorkUnit& w : work) heaviest = std::max(heaviest, UnitWeight(w, u.exact_page_cost));
  if (flat) EXPECT_EQ(u.pages_per_unit, heaviest);
  return heaviest;
}

// Rank shares (B1 128K and B8 64K on 4 blocks x 132 SMs): unit w weighs
// 1 - skew x (w % 4) / 3 of an even unit, within one folded exact block's
// weight, every page and block still covered once (CheckPlan); without
// shares, or with a skew of 0, the even cut.
TEST(AttendSchedule, FlatCutsWeighUnitsByArrivalRank) {
  const RankShares shares{4, 0.165};
  const std::vector<AttendItem> b8(8, Item(2038, 10));
  for (const int n : {1, 8}) {
    SCOPED_TRACE(n);
    const std::vector<AttendItem> items(n, Item(n == 1 ? 4086 : 2038, 10));
    const UnitSizes u =
        SizeAttendUnits(items.data(), n, 8, 528, FoldExact::kAuto, true, true, shares);
    ASSERT_TRUE(u.flat);
    EXPECT_TRUE(u.rank_shares);
    EXPECT_EQ(u.history_units, 528);
    CheckPlan({items, 8, 528, FoldExact::kAuto, true, true, shares});
    std::vector<WorkUnit> work(u.num_work());
    std::vector<HeadPartials> heads(size_t(n) * 8);
    FillAttendUnits(u, items.data(), n, 8, work.data(), heads.data());
    // Each item's units: its weight over the shares of its units.
    double rank_weight[4] = {0, 0, 0, 0};
    long total = 0;
    for (const WorkUnit& w : work) total += UnitWeight(w, u.exact_page_cost);
    const long per_item = total / n;
    EXPECT_EQ(per_item * n, total);
    for (int i = 0, w0 = 0; i < n; ++i) {
      double share_sum = 0;
      for (int k = 0; k < u.flat_units[i]; ++k) share_sum += shares.share(w0 + k);
      for (int k = 0; k < u.flat_units[i]; ++k) {
        const long w = w0 + k;
        const double want = double(per_item) * shares.share(w) / share_sum;
        EXPECT_NEAR(double(UnitWeight(work[w], u.exact_page_cost)), want,
                    double(kFoldedExactPageCost) + 1.0) << "unit " << w;
        rank_weight[w % 4] += double(UnitWeight(work[w], u.exact_page_cost));
      }
      w0 += u.flat_units[i];
    }
    for (int r = 1; r < 4; ++r) {
      EXPECT_NEAR(rank_weight[r] / rank_weight[0], 1.0 - 0.165 * r / 3, 0.01) << "rank " << r;
    }
  }
  // The threshold: B1 128K's even units (67 pages) stay even, B8 64K's
  // (264) take the shares.
  RankShares long_units = shares;
  long_units.min_unit_pages = kRankSharePagesPerUnit;
  const std::vector<AttendItem> b1{Item(4086, 10)};
  const UnitSizes b1_even = SizeAttendUnits(b1.data(), 1, 8, 528, FoldExact::kAuto, true, true,
                                            long_units);
  EXPECT_TRUE(b1_even.flat);
  EXPECT_FALSE(b1_even.rank_shares);
  EXPECT_TRUE(SizeAttendUnits(b8.data(), 8, 8, 528, FoldExact::kAuto, true, true, long_units)
                  .rank_shares);
  // No skew, or one pool: the even cut, unit for unit.
  const UnitSizes even = SizeAttendUnits(b8.data(), 8, 8, 528, FoldExact::kAuto, true, true);
  for (const RankShares off : {RankShares{4, 0.0}, RankShares{1, 0.3}, RankShares{}}) {
    const UnitSizes u = SizeAttendUnits(b8.data(), 8, 8, 528, FoldExact::kAuto, true, true, off);
    ASSERT_EQ(u.flat_cuts.size(), even.flat_cuts.size());
    for (size_t k = 0; k < u.flat_cuts.size(); ++k) {
      EXPECT_EQ(u.flat_cuts[k].weight, even.flat_cuts[k].weight);
      EXPECT_EQ(u.flat_cuts[k].begin, even.flat_cuts[k].begin);
    }
  }
}

TEST(AttendSchedule, FlatCutsSpreadTheWeightEvenlyOverEveryUnitOfTheWave) {
  // B=8, 64K on 528 slots (4 blocks x 132 SMs, variant 15's kernel): per
  // (item, kv head) cuts give 8 units to each of the 64, 512 in all; a flat
  // cut 66 per item, 528, within one exact block's weight of the even
  // share of 64 x (2038 + 10 x 10) / 528 = 259.2.
  const std::vector<AttendItem> b8(8, Item(2038, 10));
  const UnitSizes per_head = SizeAttendUnits(b8.data(), 8, 8, 528);
  EXPECT_EQ(per_head.history_units, 512);
  const UnitSizes flat = SizeAttendUnits(b8.data(), 8, 8, 528, FoldExact::kAuto, true, true);
  EXPECT_TRUE(flat.flat);
  EXPECT_TRUE(flat.fold_exact);
  EXPECT_EQ(flat.exact_units, 0);
  EXPECT_EQ(flat.history_units, 528);
  EXPECT_EQ(flat.flat_units, std::vector<int>(8, 66));
  const long heaviest_flat = HeaviestUnit(b8, 8, 528, true);
  EXPECT_LE(heaviest_flat, 260 + kFoldedExactPageCost);
  EXPECT_LT(heaviest_flat, HeaviestUnit(b8, 8, 528, false));
  CheckPlan({b8, 8, 528, FoldExact::kAuto, true, true});
  // Units that end a kv head take the next one's exact blocks, and most
  // also its first pages: 6 per item (66 units over 8 heads: the cut after
  // unit 33 falls on head 4's first block).
  std::vector<WorkUnit> work(flat.num_work());
  std::vector<HeadPartials> heads(64);
  FillAttendUnits(flat, b8.data(), 8, 8, work.data(), heads.data());
  int crossing = 0, second_parts = 0;
  for (const WorkUnit& w : work) {
    crossing += w.exact_partial >= 0 && w.exact_head == w.kv_head + 1;
    second_parts += w.next_partial >= 0;
  }
  EXPECT_EQ(crossing, 8 * 6);
  EXPECT_GT(second_parts, 24);
  // Items of different lengths get units in proportion to their weight.
  const std::vector<AttendItem> mixed{Item(4086, 10), Item(1014, 10), Item(2038, 10)};
  const UnitSizes m = SizeAttendUnits(mixed.data(), 3, 8, 528, FoldExact::kAuto, true, true);
  ASSERT_TRUE(m.flat);
  EXPECT_EQ(m.history_units, 528);
  EXPECT_GT(m.flat_units[0], m.flat_units[2]);
  EXPECT_GT(m.flat_units[2], m.flat_units[1]);
  EXPECT_LE(HeaviestUnit(mixed, 8, 528, true),
            (8 * (4086 + 1014 + 2038 + 3 * 100) + 527) / 528 + 2 * kFoldedExactPageCost);
  CheckPlan({mixed, 8, 528, FoldExact::kAuto, true, true});
  // B=1, 128K: one item, the whole wave.
  const UnitSizes b1 = SizeAttendUnits(b8.data(), 1, 8, 528, FoldExact::kAuto, true, true);
  EXPECT_EQ(b1.history_units, 528);
  CheckPlan({{Item(4086, 10)}, 8, 528, FoldExact::kAuto, true, true});
  // Too few slots for a unit per kv head: per-head cuts.
  const std::vector<AttendItem> many(64, Item(2038, 10));
  EXPECT_FALSE(SizeAttendUnits(many.data(), 64, 8, 396, FoldExact::kAuto, true, true).flat);
  CheckPlan({many, 8, 396, FoldExact::kAuto, true, true});
  // A short item next to long ones (a new request in a decode batch): one
  // unit per kv head for it, cut per head; the long items still flat, the
  // wave still whole.
  std::vector<AttendItem> with_short = b8;
  with_short.push_back(Item(3, 10));
  const UnitSizes ws = SizeAttendUnits(with_short.data(), 9, 8, 528, FoldExact::kAuto, true, true);
  ASSERT_TRUE(ws.flat);
  EXPECT_EQ(ws.flat_units[8], 0);
  EXPECT_EQ(ws.head_pages[8], 3);
  EXPECT_EQ(ws.history_units, 528);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(ws.flat_units[i], 65);
  CheckPlan({with_short, 8, 528, FoldExact::kAuto, true, true});
  // Many one-page items next to a long one, on few kv heads: never more
  // units than the wave holds (each light item takes its one unit per head
  // out of the share first).
  for (const int H : {1, 2}) {
    std::vector<AttendItem> light{Item(2000, 0)};
    light.insert(light.end(), 20, Item(1, 0));
    const UnitSizes l = SizeAttendUnits(light.data(), 21, H, 100, FoldExact::kAuto, true, true);
    EXPECT_TRUE(l.flat);
    EXPECT_LE(l.history_units, 100);
    CheckPlan({light, H, 100, FoldExact::kAuto, true, true});
  }
  CheckPlan({{Item(81, 0), Item(3, 0), Item(241, 0), Item(1, 0)}, 1, 10, FoldExact::kAuto, true,
             true});
}

// The batch of the GPU test CudaAttendVariant.FlatCutUnitsAcrossKvHeads-
// MatchReference (30K, 9K, 300 and 2K tokens: S0 64, W 256, 32-token
// pages), planned for a wave of 53 units: the plans it asserts on the GPU
// (flat, units with a second part, and with the next kv head's blocks when
// they are folded) are these. Folded: 30K in 27 flat units, 9K in 10,
// 2K per head (one unit per kv head), 300 in exact units; exact units of
// their own: 30K in 10 flat units, 9K and 2K per head.
TEST(AttendSchedule, TheGpuTestsFlatBatchHasUnitsOfEveryKind) {
  const std::vector<AttendItem> batch{Item(927, 10), Item(271, 10), Item(0, 10), Item(52, 10)};
  for (const FoldExact fold : {FoldExact::kAuto, FoldExact::kAlways, FoldExact::kNever}) {
    const UnitSizes u = SizeAttendUnits(batch.data(), 4, 8, 53, fold, true, true);
    ASSERT_TRUE(u.flat);
    EXPECT_EQ(u.fold_exact, fold != FoldExact::kNever);
    const std::vector<int> folded{27, 10, 0, 0}, unfolded{10, 0, 0, 0};
    EXPECT_EQ(u.flat_units, u.fold_exact ? folded : unfolded);
    EXPECT_EQ(u.head_pages[3], 52);
    std::vector<WorkUnit> work(u.num_work());
    std::vector<HeadPartials> heads(4 * 8);
    FillAttendUnits(u, batch.data(), 4, 8, work.data(), heads.data());
    int second = 0, next_exact = 0;
    for (const WorkUnit& w : work) {
      second += w.next_partial >= 0;
      next_exact += w.exact_partial >= 0 && w.exact_head != w.kv_head;
    }
    EXPECT_GT(second, 0);
    EXPECT_EQ(next_exact > 0, u.fold_exact);
    CheckPlan({batch, 8, 53, fold, true, true});
  }
}

// Paired heads (PairHeadUnits): the kv heads' plan doubled into 2H plan
// heads. Units 2u and 2u + 1 are unit u for plan heads 2h and 2h + 1 (the
// same pages and blocks, read side by side); every (item, plan head) page
// and exact block is covered once, a second history part goes to plan head
// kv_head + 2 (the next kv head's half), every partial of [0, 2 x partials)
// is written once, and each plan head's partial ranges name exactly what its
// parts wrote. Counts, when asked, the paired plan's units with a second
// history part and those with the next head's exact blocks.
void CheckPairedPlan(const Case& c, int* second_parts_out = nullptr,
                     int* next_head_exact_out = nullptr) {
  const int n = static_cast<int>(c.items.size()), H = c.kv_heads, Hp = 2 * H;
  const UnitSizes sizes =
      SizeAttendUnits(c.items.data(), n, H, c.capacity, c.fold, c.exact_first, c.flat_cut);
  std::vector<WorkUnit> work(sizes.num_work());
  std::vector<HeadPartials> heads(size_t(n) * H);
  FillAttendUnits(sizes, c.items.data(), n, H, work.data(), heads.data());
  std::vector<WorkUnit> paired(2 * work.size());
  std::vector<HeadPartials> paired_heads(size_t(n) * Hp);
  PairHeadUnits(work.data(), static_cast<long>(work.size()), heads.data(), n, H, sizes.partials,
                paired.data(), paired_heads.data());

  std::set<std::tuple<int, int, int>> seen_pages, seen_exact;
  std::set<int> seen_partials;
  std::vector<HeadSets> written(size_t(n) * Hp);
  int second_parts = 0, next_head_exact = 0;
  auto add_partial = [&](int partial) {
    EXPECT_GE(partial, 0);
    EXPECT_LT(partial, 2 * sizes.partials);
    EXPECT_TRUE(seen_partials.insert(partial).second) << "partial " << partial;
  };
  for (size_t u = 0; u < paired.size(); ++u) {
    const WorkUnit& w = paired[u];
    const WorkUnit& k = work[u / 2];  // the kv heads' unit
    const int s = static_cast<int>(u % 2);
    SCOPED_TRACE(testing::Message() << "unit " << u);
    EXPECT_EQ(w.item, k.item);
    EXPECT_EQ(w.kv_head, 2 * k.kv_head + s);
    EXPECT_EQ(w.exact_head, 2 * k.exact_head + s);
    EXPECT_EQ(std::make_tuple(w.begin, w.end, w.exact_begin, w.exact_end, w.next_end),
              std::make_tuple(k.begin, k.end, k.exact_begin, k.exact_end, k.next_end));
    EXPECT_EQ(w.partial >= 0, k.partial >= 0);
    EXPECT_EQ(w.exact_partial >= 0, k.exact_partial >= 0);
    EXPECT_EQ(w.next_partial >= 0, k.next_partial >= 0);
    const size_t base = size_t(w.item) * Hp;
    second_parts += w.next_partial >= 0;
    next_head_exact += w.exact_partial >= 0 && w.exact_head != w.kv_head;
    if (w.partial >= 0) {
      add_partial(w.partial);
      written[base + w.kv_head].hist.insert(w.partial);
      for (int pg = w.begin; pg < w.end; ++pg) {
        EXPECT_TRUE(seen_pages.insert({w.item, w.kv_head, pg}).second);
      }
    }
    if (w.next_partial >= 0) {
      const int next = w.kv_head + 2;  // the kernel's kv_head + (1 << head_shift)
      ASSERT_LT(next, Hp);
      add_partial(w.next_partial);
      written[base + next].hist.insert(w.next_partial);
      for (int pg = 0; pg < w.next_end; ++pg) {
        EXPECT_TRUE(seen_pages.insert({w.item, next, pg}).second);
      }
    }
    if (w.exact_partial >= 0) {
      ASSERT_LT(w.exact_head, Hp);
      add_partial(w.exact_partial);
      written[base + w.exact_head].exact.insert(w.exact_partial);
      for (int e = w.exact_begin; e < w.exact_end; ++e) {
        EXPECT_TRUE(seen_exact.insert({w.item, w.exact_head, e}).second);
      }
    }
  }
  long pages = 0, exact = 0;
  for (const AttendItem& it : c.items) {
    pages += it.num_pages;
    exact += it.num_exact;
  }
  EXPECT_EQ(static_cast<long>(seen_pages.size()), pages * Hp);
  EXPECT_EQ(static_cast<long>(seen_exact.size()), exact * Hp);
  EXPECT_EQ(static_cast<long>(seen_partials.size()), 2 * sizes.partials);
  ExpectRangesNameWhatWasWritten(paired_heads, written, Hp);
  if (second_parts_out != nullptr) *second_parts_out = second_parts;
  if (next_head_exact_out != nullptr) *next_head_exact_out = next_head_exact;
}

TEST(AttendSchedule, PairedHeadsCoverEveryPlanHeadOnceWithUnitsSideBySide) {
  // The GPU test's flat batch as it plans it when paired (53 units of the
  // kv heads for a wave of 106 blocks: second parts and the next head's
  // blocks), B8 64K on half of 528 slots, and random batches, per head and
  // flat.
  int second = 0, next_exact = 0;
  CheckPairedPlan({{Item(927, 10), Item(271, 10), Item(0, 10), Item(52, 10)}, 8, 53,
                   FoldExact::kAuto, true, true},
                  &second, &next_exact);
  EXPECT_GT(second, 0);
  EXPECT_GT(next_exact, 0);
  CheckPairedPlan(
      {std::vector<AttendItem>(8, Item(2040, 10)), 8, 264, FoldExact::kAuto, true, true});
  std::mt19937 rng(17);
  for (int trial = 0; trial < 40; ++trial) {
    Case c = RandomCase(rng, 300, 10, 1500);
    SCOPED_TRACE(trial);
    for (const FoldExact fold : {FoldExact::kAuto, FoldExact::kAlways, FoldExact::kNever}) {
      c.fold = fold;
      for (const bool flat : {false, true}) {
        c.flat_cut = flat;
        CheckPairedPlan(c);
      }
    }
  }
}

TEST(AttendSchedule, FlatCutsCrossKvHeadsAtBlockAndPageBoundaries) {
  // Two kv heads of one exact block (weight 1) and 5 pages: 12 in all, 3
  // units of 4. Unit 1 ends head 0's pages, takes head 1's block and its
  // first page.
  std::vector<FlatUnit> cut;
  ASSERT_TRUE(FlatCuts(5, 1, 1, 2, 3, &cut));
  ASSERT_EQ(cut.size(), 3u);
  auto same = [](const FlatUnit& a, const FlatUnit& b) {
    return std::tie(a.head, a.begin, a.end, a.exact_head, a.exact_begin, a.exact_end, a.next_end,
                    a.weight) == std::tie(b.head, b.begin, b.end, b.exact_head, b.exact_begin,
                                          b.exact_end, b.next_end, b.weight);
  };
  // FlatUnit{head, begin, end, exact_head, exact_begin, exact_end, next_end, weight}
  EXPECT_TRUE(same(cut[0], FlatUnit{0, 0, 3, 0, 0, 1, 0, 4}));
  EXPECT_TRUE(same(cut[1], FlatUnit{0, 3, 5, 1, 0, 1, 1, 4}));
  EXPECT_TRUE(same(cut[2], FlatUnit{1, 1, 5, 1, 0, 0, 0, 4}));
  // Blocks of weight 2 and 4 pages: the second cut lands on head 1's block
  // boundary, so unit 1 ends with that block and has no second part.
  ASSERT_TRUE(FlatCuts(4, 1, 2, 2, 3, &cut));
  EXPECT_TRUE(same(cut[0], FlatUnit{0, 0, 2, 0, 0, 1, 0, 4}));
  EXPECT_TRUE(same(cut[1], FlatUnit{0, 2, 4, 1, 0, 1, 0, 4}));
  EXPECT_TRUE(same(cut[2], FlatUnit{1, 0, 4, 1, 0, 0, 0, 4}));
  // Cuts at the boundary nearest to the exact even share: 8 heads of 10
  // blocks (weight 10) and 100 pages in 23 units; cut 12 aims at 834.78,
  // 34.78 into head 4, so it falls after its block 3 (weight 830), not 4.
  ASSERT_TRUE(FlatCuts(100, 10, 10, 8, 23, &cut));
  long before_cut12 = 0;
  for (int u = 0; u < 12; ++u) before_cut12 += cut[u].weight;
  EXPECT_EQ(before_cut12, 830);
  // One unit for two heads, or units that would take two heads' blocks: refused.
  EXPECT_FALSE(FlatCuts(5, 1, 1, 2, 1, &cut));
  EXPECT_FALSE(FlatCuts(2, 3, 10, 4, 5, &cut));
  // No exact blocks: pages only, at most one head boundary per unit.
  ASSERT_TRUE(FlatCuts(100, 0, 0, 8, 11, &cut));
  ASSERT_EQ(cut.size(), 11u);
  long pages = 0;
  for (const FlatUnit& f : cut) {
    pages += (f.end - f.begin) + f.next_end;
    EXPECT_NEAR(double(f.weight), 800.0 / 11, 1.0);
  }
  EXPECT_EQ(pages, 800);
}

// The cluster kernel's units: K clusters of NB per (item, kv head) in order,
// each page and exact block of each (item, kv head) in exactly one unit, page
// ranges contiguous and in order, and no rank with pages past an even share
// of pages + kClusterExactPageCost x exact blocks by more than one page.
void CheckClusterPlan(const std::vector<AttendItem>& items, int H, int NB, int K) {
  const int n = static_cast<int>(items.size()), C = NB * K;  // units per head
  std::vector<WorkUnit> work(size_t(n) * H * C);
  FillClusterUnits(items.data(), n, H, NB, K, work.data());
  for (int i = 0; i < n; ++i) {
    const long pages = items[i].num_pages, exact = items[i].num_exact;
    const double target = double(pages + kClusterExactPageCost * exact) / C;
    for (int h = 0; h < H; ++h) {
      SCOPED_TRACE(testing::Message() << "item " << i << " head " << h);
      long next_page = 0, next_exact = 0;
      for (int r = 0; r < C; ++r) {
        const WorkUnit& u = work[(size_t(i) * H + h) * C + r];
        EXPECT_EQ(u.item, i);
        EXPECT_EQ(u.kv_head, h);
        EXPECT_EQ(u.partial, -1);
        EXPECT_EQ(u.exact_partial, -1);
        EXPECT_EQ(u.begin, next_page);
        EXPECT_LE(u.begin, u.end);
        EXPECT_EQ(u.exact_begin, next_exact);
        EXPECT_LE(u.exact_begin, u.exact_end);
        next_page = u.end;
        next_exact = u.exact_end;
        const long cost = (u.end - u.begin) + kClusterExactPageCost * (u.exact_end - u.exact_begin);
        // No unit with pages goes past the even share by more than the
        // rounding (a unit whose exact blocks alone reach it takes none),
        // and exact blocks are spread evenly.
        if (u.end > u.begin) EXPECT_LE(cost, target + 1.0);
        EXPECT_LE(u.exact_end - u.exact_begin, (exact + C - 1) / C);
        EXPECT_GE(u.exact_end - u.exact_begin, exact / C);
      }
      EXPECT_EQ(next_page, pages);
      EXPECT_EQ(next_exact, exact);
    }
  }
}

TEST(AttendSchedule, ClusterUnitsCoverEveryPageAndBlockOnceAndBalanceTheRanks) {
  for (const int NB : {4, 16}) {
    for (const int K : {1, 3, 11}) {
      SCOPED_TRACE(testing::Message() << K << " clusters of " << NB << " per head");
      CheckClusterPlan({Item(4086, 10)}, 8, NB, K);  // B=1, 128K
      CheckClusterPlan({Item(246, 10)}, 8, NB, K);   // B=1, 8K
      CheckClusterPlan({Item(0, 0), Item(0, 3), Item(5, 0), Item(1, 40), Item(17, 1)}, 2, NB, K);
    }
  }
  // B=1, 128K over 16 units: 10 of them take an exact block and 4 pages fewer.
  const AttendItem heavy = Item(4086, 10);
  std::vector<WorkUnit> work(16);
  FillClusterUnits(&heavy, 1, 1, 16, 1, work.data());
  int with_exact = 0;
  for (const WorkUnit& u : work) {
    const int e = u.exact_end - u.exact_begin;
    with_exact += e;
    EXPECT_NEAR((u.end - u.begin) + kClusterExactPageCost * e, (4086 + 40) / 16.0, 1.0);
  }
  EXPECT_EQ(with_exact, 10);
  std::mt19937 rng(11);
  for (int trial = 0; trial < 100; ++trial) {
    std::vector<AttendItem> items;
    const int n = static_cast<int>(rng() % 6);
    for (int i = 0; i < n; ++i) {
      items.push_back(Item(static_cast<int>(rng() % 5000), static_cast<int>(rng() % 40)));
    }
    SCOPED_TRACE(trial);
    CheckClusterPlan(items, 1 + static_cast<int>(rng() % 8), 4 << (rng() % 3),
                     1 + static_cast<int>(rng() % 12));
  }
}

TEST(AttendSchedule, CheckRefusesBadItemsAndUnsupportedShapesWithClearCodes) {
  float q[4 * 128], out[4 * 128];
  alignas(8) bf16_bits block[8];
  ExactBlockRef exact{block, 32};
  AttendItem item;
  item.q = q;
  item.out = out;
  item.exact = &exact;
  item.num_exact = 1;
  AttendBatch b{PageGeometry{1, 128, 128, 32}, 4, 0.088f, &item, 1};
  EXPECT_TRUE(CheckAttendBatch(b).ok()) << CheckAttendBatch(b);

  AttendBatch bad = b;
  bad.num_q_heads = 6;  // 6 query heads on 1 kv head: supported (<= 8)
  EXPECT_TRUE(CheckAttendBatch(bad).ok());
  bad.num_q_heads = 16;
  EXPECT_EQ(CheckAttendBatch(bad).code(), absl::StatusCode::kUnimplemented);
  bad = b;
  bad.geom.group_size = 16;
  EXPECT_EQ(CheckAttendBatch(bad).code(), absl::StatusCode::kUnimplemented);
  bad = b;
  bad.geom.page_tokens = 48;
  exact.tokens = 32;
  EXPECT_EQ(CheckAttendBatch(bad).code(), absl::StatusCode::kUnimplemented);
  bad = b;
  bad.geom.head_dim = 96;
  EXPECT_EQ(CheckAttendBatch(bad).code(), absl::StatusCode::kInvalidArgument);
  bad = b;
  bad.scale = 0.0f;
  EXPECT_EQ(CheckAttendBatch(bad).code(), absl::StatusCode::kInvalidArgument);

  exact.tokens = 33;  // more than P
  EXPECT_EQ(CheckAttendBatch(b).code(), absl::StatusCode::kInvalidArgument);
  exact.tokens = 32;
  exact.block = reinterpret_cast<const bf16_bits*>(reinterpret_cast<const char*>(block) + 2);
  EXPECT_EQ(CheckAttendBatch(b).code(), absl::StatusCode::kInvalidArgument);
  exact.block = block;
  item.num_pages = 3;  // no page table
  EXPECT_EQ(CheckAttendBatch(b).code(), absl::StatusCode::kInvalidArgument);
  item.num_pages = 0;
  item.q = nullptr;
  const absl::Status st = CheckAttendBatch(b);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(st.message()).find("item 0"), std::string::npos) << st;
}

}  // namespace
}  // namespace cuda_attend
}  // namespace oscarkv
