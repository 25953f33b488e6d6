// Host-only planning of a batched decode-attention call: how the batch is cut
// into work units (one thread block each) and where each unit's partial
// result goes. Pure functions; used by AttendLauncher, tested on the CPU.
#ifndef OSCARKV_KERNELS_CUDA_ATTEND_SCHEDULE_H_
#define OSCARKV_KERNELS_CUDA_ATTEND_SCHEDULE_H_

#include <algorithm>
#include <vector>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "kernels/cuda/attend_plan.h"

namespace oscarkv {
namespace cuda_attend {

// Checks a batch against the backend contract and this implementation's
// limits: INVALID_ARGUMENT for bad input (null pointers, counts, token counts
// outside [0, P], unaligned blocks), UNIMPLEMENTED for shapes the CUDA kernels
// do not cover (more than 8 query heads per kv head, G < D/4, P not a multiple
// of 32). Page pointers are checked while they are copied (AttendLauncher).
absl::Status CheckAttendBatch(const AttendBatch& batch);

// One history unit of a flat cut of an item (FlatCuts): pages [begin, end)
// of kv head `head`, exact blocks [exact_begin, exact_end) of kv head
// exact_head, and pages [0, next_end) of kv head head + 1, each possibly
// empty.
struct FlatUnit {
  int head = 0;
  int begin = 0, end = 0;
  int exact_head = 0;
  int exact_begin = 0, exact_end = 0;
  int next_end = 0;
  long weight = 0;  // pages + cost x exact blocks
};

struct UnitSizes {
  long exact_per_unit = 1;  // sink / recent blocks per exact unit
  // History pages per history unit: each of an item's units has this many
  // (the last one the rest), unless folded units are cut by weight
  // (exact_page_cost > 0, FoldedPageCuts); the count of units is the same.
  long pages_per_unit = 1;
  long exact_units = 0;     // units with an exact part only (before the others)
  // Units with a history part (and, under a flat cut, units that may hold
  // only the exact blocks of a history item).
  long history_units = 0;
  // The exact blocks of items with history ride on their history units
  // instead of taking exact units of their own (see FoldExact).
  bool fold_exact = false;
  // > 0: a folded exact block counts as this many pages when an item's pages
  // are cut over its units (kFoldedExactPageCost with an exact-first kernel).
  long exact_page_cost = 0;
  long partials = 0;  // partial results the units write
  // A flat cut (SizeAttendUnits' flat_cut, FlatCuts): item i's kv heads
  // laid end to end and cut into flat_units[i] history units of even
  // weight, which may span two kv heads, or, where flat_units[i] is 0 and
  // the item has pages, cut per kv head into units of head_pages[i] pages
  // (weighted as FoldedPageCuts); pages_per_unit is then the heaviest
  // unit's weight (pages + exact_page_cost per folded exact block).
  bool flat = false;
  std::vector<int> flat_units;   // per item
  std::vector<long> head_pages;  // per item
  std::vector<FlatUnit> flat_cuts;  // the flat items' units, item after item
  bool rank_shares = false;  // the flat cut weighed by arrival rank (RankShares)
  long num_work() const { return exact_units + history_units; }
};

// History is "light" when the history units would hold at most this many
// pages each in one full wave. (H200, 2026-11-30, B1 32K: with 16, 40 exact
// units of 2 blocks each ended 1.3 us after the history units (24 pages
// each), on the critical path; with 32, 80 units of one block are done
// 6.5 us before the history units (26 pages each), and the call takes 24.0
// against 25.1 us in the same run; tests/bench/RESULTS.md run 19.)
inline constexpr long kLightPagesPerUnit = 32;

// Whether the exact blocks of items with history ride on their history units.
enum class FoldExact {
  kAuto,    // when the history units would hold >= kFoldPagesPerUnit pages each
            // (kFoldPagesPerUnitExactAfter without an exact-first kernel)
  kAlways,  // always (tests and benchmarks)
  kNever,   // exact units of their own at every length
};

// The mode by its number in OSCARKV_CUDA_ATTEND_FOLD and the benchmark's
// --fold: 0 auto, 1 always, 2 never (anything else: auto).
inline FoldExact FoldExactFromNumber(int n) {
  return n == 1 ? FoldExact::kAlways : n == 2 ? FoldExact::kNever : FoldExact::kAuto;
}

// History units at least this long (in pages) take the exact blocks along
// under FoldExact::kAuto when the split kernel runs them first (its
// exact-first kernel: the default variant at D 128, one group, g <= 4, see
// HasExactFirstKernel): a folded unit runs its exact blocks while the prep
// kernel runs and takes fewer pages for them (kFoldedExactPageCost); the
// exact units it saves are slots for history. (H200, 2026-11-30, one layer,
// 32 q / 8 kv heads, 32-token pages, GPU side, folded vs exact units of their
// own, by pages per unit unfolded, each pair from one call of
// tests/bench/RESULTS.md run 21: B1 32K 19.9 vs 20.6 us (26), B1 64K 26.1
// vs 26.7 (47), B1 8K 15.5 vs 15.1 (7), all with these cuts (call 7); B8
// 64K 118.4 vs 129.6 (408), B8 32K 71.0 vs 73.3 (203), B1 128K 39.0 vs
// 41.2 (93), with even cuts and the exact part first in every unit, 0.3-0.7
// us slower than the kept kernels when unfolded (call 3).)
inline constexpr long kFoldPagesPerUnit = 16;

// The same with the exact blocks after the pages (the other kernels): there
// they are a tail of several us on the critical path, which pays only when
// the units are long. (H200, 2026-11-29, folded vs exact units of their own:
// B8 64K 181.1 vs 192.0 us (408 pages per unit unfolded); B8 32K 109.1 vs
// 106.9 (203); B1 128K 59.9 vs 57.1 (93); B1 32K 31.6 vs 26.3 (24).)
inline constexpr long kFoldPagesPerUnitExactAfter = 256;

// Shares of a wave by arrival rank. The blocks resident on one SM do not
// stream at the same speed: the first to start keeps priority, so with
// equal units the k-th block of an SM ends later than the first (H200,
// 2026-12-02, one wave of 4 blocks per SM, loop times by the blocks' order
// on their SM: B1 128K 16.9 / 17.7 / 18.8 / 20.2 us, B8 64K 68.1 / 70.7 /
// 75.5 / 81.9; tests/bench/RESULTS.md run 32), and each SM ends with its
// last block. With shares, unit w of a launch is cut to weigh
// 1 - skew x r / (pools - 1) of an even unit, r = w % pools: the r-th block
// to arrive on an SM runs a unit of rank r (ClaimUnit in attend_claim.cuh).
// Ranks alternate unit by unit, so each item of a batch has units of
// every rank.
struct RankShares {
  int pools = 0;      // blocks per SM of the wave; < 2: even cuts
  double skew = 0.0;  // the last rank's shortfall against the first; <= 0: even cuts
  // Shares only where the even flat cut's units weigh at least this many
  // pages (kRankSharePagesPerUnit).
  long min_unit_pages = 0;
  bool active() const { return pools > 1 && skew > 0.0; }
  // Unit w's weight against an even unit's (1 when not active).
  double share(long w) const {
    return active() ? 1.0 - skew * double(w % pools) / double(pools - 1) : 1.0;
  }
  bool operator==(const RankShares& o) const {
    return pools == o.pools && skew == o.skew && min_unit_pages == o.min_unit_pages;
  }
};

// Rank shares pay where units are long: the even flat cut's heaviest unit
// at least this many pages. (H200, 2026-12-02, 4 ranks, skew 0.165 against
// even cuts, GPU side: B8 64K (264 pages per unit) 96.1-96.7 -> 93.7-93.9
// us, B8 32K (139) 59.7-59.8 -> 57.9-58.2; B1 128K (67) 33.7 -> 34.6-34.8
// with the claims of call 3, which cost the blocks 0.7 us more before their
// first loads; tests/bench/RESULTS.md run 32.)
inline constexpr long kRankSharePagesPerUnit = 128;

// Sizes the units so that they fit in one wave of `capacity` resident
// blocks. Exact units (item, kv head, up to exact_per_unit blocks) take at
// most capacity / 4 of the wave when the history is light (they are short
// chains of dependent loads and the critical path), else capacity / 8;
// history units (item, kv head, up to pages_per_unit pages) the rest. When
// the exact blocks fold (see FoldExact), each (item, kv head)'s exact blocks
// are spread over its first history units, which run them before their
// pages (the default variant; the others after them), and only items
// without history keep exact units; the history units take the rest of the
// wave, which is all of it when every item has history (exact units of
// their own would sit idle once done, for most of a long call: 16 % of the
// wave at B8 64K).
// exact_first: the split kernel of this batch's shape runs folded exact
// blocks before the pages (kFoldPagesPerUnit, weighted cuts) or after them
// (kFoldPagesPerUnitExactAfter, even cuts). flat_cut (the split kernel
// runs units of two kv heads: variant 19's): from the same folding
// decision, exact units and share of the wave, the history is cut flat
// (FlatCuts, UnitSizes::flat) when folded blocks have a weight
// (exact_first): items get units in proportion to their weight (pages +
// kFoldedExactPageCost per folded exact block, over all their kv heads);
// items too light for one unit per kv head, and any whose flat cut does not
// fit FlatUnit, are cut per head. Per (item, kv head) cuts give B8 64K on
// an H200 512 units for 528 slots; a flat cut gives 528 of ~3 % less weight
// each.
// With active `shares` and a flat cut whose even units weigh at least
// shares.min_unit_pages, the flat items are cut by rank shares instead
// (UnitSizes::rank_shares).
UnitSizes SizeAttendUnits(const AttendItem* items, int num_items, int kv_heads, long capacity,
                          FoldExact fold = FoldExact::kAuto, bool exact_first = true,
                          bool flat_cut = false, RankShares shares = {});


// Cuts one item's history flat: its kv heads' exact blocks (weight `cost`
// each; pass exact = 0 when they do not ride on the history units) and
// pages laid end to end, kv head after kv head, each head's blocks before
// its pages, cut at block and page boundaries nearest to `units` even
// shares of the weight (at least one block or page each). Writes the units
// in order. Returns false when a unit does not have the form FlatUnit
// describes (it would cover more than two kv heads, or the exact blocks of
// two, or a whole head's pages after its blocks: too few units for the
// item's heads), which the caller answers with per-head cuts. With active
// `shares`, unit k (launch unit first_unit + k) gets shares.share(first_unit
// + k) of an even share instead, in proportion.
bool FlatCuts(long pages, int exact, long cost, int kv_heads, int units,
              std::vector<FlatUnit>* out, const RankShares& shares = {}, long first_unit = 0);

// An item whose exact blocks ride on its `hist_splits` history units: each
// of its first units takes ceil(E / hist_splits) blocks (FoldedExactPerUnit),
// the last one the rest, so ceil(E / per) units carry some (FoldedExactSplits).
inline int FoldedExactPerUnit(int num_exact, int hist_splits) {
  return (num_exact + hist_splits - 1) / hist_splits;
}
inline int FoldedExactSplits(int num_exact, int hist_splits) {
  if (num_exact <= 0 || hist_splits <= 0) return 0;
  const int per = FoldedExactPerUnit(num_exact, hist_splits);
  return (num_exact + per - 1) / per;
}

// A folded exact block's weight against one history page in the split
// kernel's plan: a unit carrying one starts its pages ~3.5 us after the
// others at B = 1 (its exact part, then its page table and first chunks),
// ~10 pages of its loop. (H200, 2026-11-30, folded plans, GPU side, cost
// 5 / 10 / 16 pages against even cuts: B1 32K 20.5 / 19.9 / 19.9 against
// 21.3 us, B1 64K 26.7 / 26.1 / 27.0 against 27.3, B8 32K 71.0 / 70.7 /
// 72.1 against 71.7; tests/bench/RESULTS.md run 21.)
inline constexpr long kFoldedExactPageCost = 10;

// The exact blocks [begin, end) that unit s of an item's history units
// carries when they are folded, `per` on each of its first units
// (FoldedExactPerUnit); empty past them, and for per = 0.
struct BlockRange {
  int begin, end;
};
inline BlockRange FoldedExactBlocks(int num_exact, int per, int s) {
  const long begin = std::min<long>(num_exact, long(s) * per);
  return {static_cast<int>(begin), static_cast<int>(std::min<long>(num_exact, begin + per))};
}

// The page cuts (*cuts)[s], [s + 1] of an item's `splits` history units of a
// kv head (the same for every head), splits = ceil(pages / ppu): `ppu` pages
// each, the last one the rest; with `cost` > 0 and its exact blocks folded
// (`per` on each of its first units, FoldedExactBlocks), weighted so that
// pages + cost x exact blocks come out even over the units, at least one
// page each.
void FoldedPageCuts(long pages, int splits, long ppu, int num_exact, int per, long cost,
                    std::vector<long>* cuts);

// Writes sizes.num_work() units into `work`: the exact units (item, then kv
// head major), then the history units (item major; per kv head, or flat
// when sizes.flat); sizes.partials partial indices, each written by exactly
// one part of one unit, and each (item, kv head)'s partial ranges into
// heads[item * kv_heads + head] (with per-head cuts, kv head h's history
// partials are the item's first one + h x its units per head).
void FillAttendUnits(const UnitSizes& sizes, const AttendItem* items, int num_items,
                     int kv_heads, WorkUnit* work, HeadPartials* heads);

// Paired heads (LaunchArgs::head_shift = 1): a batch with 2g query heads
// per kv head (g <= 4) runs on the split kernel of g, over 2H plan heads,
// plan head 2h + s taking query heads 2g·h + g·s .. + g - 1 of kv head h.
// Expands the plan of the H kv heads (`num_work` units, `partials` partial
// indices, heads[item·H + h]) into that of the plan heads: unit u becomes
// units 2u (s = 0) and 2u + 1 (s = 1), the same ranges of the same kv head
// (2·kv_head + s, exact_head likewise; a second history part is then plan
// head kv_head + 2), so that the two blocks read each page at about the
// same time and the second read finds it in L2; half s writes the partials
// of the kv heads' plan shifted by s·partials, and
// out_heads[item·2H + 2h + s] lists them. Writes 2·num_work units.
void PairHeadUnits(const WorkUnit* work, long num_work, const HeadPartials* heads,
                   int num_items, int kv_heads, long partials, WorkUnit* out_work,
                   HeadPartials* out_heads);

// An exact block's weight against one history page when the cluster
// kernel's ranks share an (item, kv head): a 32-token BF16 block of one kv
// head is 16 KB of K and V against a page's ~2.3 KB, read by fewer warps in
// a chain of dependent steps. A first estimate, not a measured optimum.
inline constexpr long kClusterExactPageCost = 4;

// The cluster kernel's units (attend_cluster.cuh): `clusters_per_head`
// clusters of `cluster` units per (item, kv head), unit
// ((i·H + h)·clusters_per_head + k)·cluster + r for rank r of cluster k. The
// item's exact blocks are spread evenly over the units (unit u takes blocks
// [E·u / units, E·(u + 1) / units)); its pages are cut into contiguous
// ranges, in order, so that pages + kClusterExactPageCost x exact blocks
// come out even over the units (a unit whose exact blocks alone reach the
// even share takes no pages). Every
// page and exact block of every (item, kv head) is in exactly one unit;
// partial indices are unused (-1).
void FillClusterUnits(const AttendItem* items, int num_items, int kv_heads, int cluster,
                      int clusters_per_head, WorkUnit* work);

}  // namespace cuda_attend
}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_CUDA_ATTEND_SCHEDULE_H_
