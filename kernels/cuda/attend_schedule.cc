#include "kernels/cuda/attend_schedule.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <queue>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/status_macros.h"

namespace oscarkv {
namespace cuda_attend {

namespace {
bool Aligned8(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 7u) == 0; }
}  // namespace

absl::Status CheckAttendBatch(const AttendBatch& b) {
  OSCARKV_RETURN_IF_ERROR(ValidateGeometry(b.geom));
  const int H = b.geom.kv_heads, D = b.geom.head_dim;
  if (b.num_q_heads <= 0 || b.num_q_heads % H != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_q_heads ", b.num_q_heads, " must be a positive multiple of kv_heads ", H));
  }
  if (b.num_q_heads / H > 8) {
    return absl::UnimplementedError(absl::StrCat("CUDA attention supports at most 8 query heads ",
                                                 "per kv head, got ", b.num_q_heads / H));
  }
  if (b.geom.group_size < D / 4) {
    return absl::UnimplementedError(absl::StrCat("CUDA attention needs group_size >= head_dim/4 (",
                                                 D / 4, "), got ", b.geom.group_size));
  }
  if (b.geom.page_tokens % 32 != 0) {
    return absl::UnimplementedError(absl::StrCat(
        "CUDA attention needs page_tokens to be a multiple of 32, got ", b.geom.page_tokens));
  }
  if (!(b.scale > 0.0f) || !std::isfinite(b.scale)) {
    return absl::InvalidArgumentError(absl::StrCat("attention scale must be finite and > 0, got ",
                                                   b.scale));
  }
  if (b.num_items < 0 || (b.num_items > 0 && b.items == nullptr)) {
    return absl::InvalidArgumentError("attention batch has no item array");
  }
  for (int i = 0; i < b.num_items; ++i) {
    const AttendItem& it = b.items[i];
    if (it.q == nullptr || it.out == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("attention item ", i, " has no q or out"));
    }
    if (it.num_pages < 0 || it.num_exact < 0) {
      return absl::InvalidArgumentError(absl::StrCat("attention item ", i, " has negative counts"));
    }
    if (it.num_pages > 0) {
      if (it.pages == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat("attention item ", i, " has no page table"));
      }
      if (it.rotation.r_k == nullptr || it.rotation.r_v == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat("attention item ", i, " has no rotation"));
      }
    }
    if (it.num_exact > 0 && it.exact == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("attention item ", i, " has no exact blocks"));
    }
    for (int e = 0; e < it.num_exact; ++e) {
      const ExactBlockRef& x = it.exact[e];
      if (x.tokens < 0 || x.tokens > b.geom.page_tokens) {
        return absl::InvalidArgumentError(absl::StrCat("attention item ", i, " exact block ", e,
                                                       " has ", x.tokens, " tokens"));
      }
      if (x.tokens > 0 && (x.block == nullptr || !Aligned8(x.block))) {
        return absl::InvalidArgumentError(absl::StrCat("attention item ", i, " exact block ", e,
                                                       " is null or not 8-byte aligned"));
      }
    }
  }
  return absl::OkStatus();
}


namespace {

// The history units' share of a wave of `capacity` blocks once the exact
// units have theirs (at least half of it).
long HistoryShare(long capacity, long exact_units) {
  capacity = std::max<long>(1, capacity);
  return std::max({1L, capacity / 2, capacity - exact_units});
}

// The unit sizes, with the exact blocks of items with history folded onto
// their history units or not.
UnitSizes SizeUnits(const AttendItem* items, int n, int H, long capacity, bool fold_exact) {
  UnitSizes u;
  capacity = std::max<long>(1, capacity);
  long total_pages = 0;
  for (int i = 0; i < n; ++i) total_pages += items[i].num_pages;
  const bool light_history = total_pages * H <= kLightPagesPerUnit * capacity;
  u.fold_exact = fold_exact;
  // Items whose exact blocks take exact units of their own.
  auto exact_only = [&](int i) {
    return items[i].num_exact > 0 && (!u.fold_exact || items[i].num_pages == 0);
  };
  long max_exact = 1;
  bool any_exact = false;
  for (int i = 0; i < n; ++i) {
    if (!exact_only(i)) continue;
    any_exact = true;
    max_exact = std::max<long>(max_exact, items[i].num_exact);
  }
  auto count_exact = [&](long e) {
    long c = 0;
    for (int i = 0; i < n; ++i) {
      if (exact_only(i)) c += (items[i].num_exact + e - 1) / e;
    }
    return c * H;
  };
  // Exact units are short chains of dependent loads: with little history they
  // are the critical path, so they get more of the wave (one block each where
  // possible); with much history the history units need the slots.
  const long exact_cap = light_history ? capacity / 4 : capacity / 8;
  while (u.exact_per_unit < max_exact && count_exact(u.exact_per_unit) > exact_cap) {
    ++u.exact_per_unit;
  }
  u.exact_units = any_exact ? count_exact(u.exact_per_unit) : 0;
  const long target = HistoryShare(capacity, u.exact_units);
  auto count_history = [&](long p) {
    long c = 0;
    for (int i = 0; i < n; ++i) c += (items[i].num_pages + p - 1) / p;
    return c * H;
  };
  // The smallest pages-per-unit whose unit count fits the target (the count
  // only falls as units grow), by bisection; when even one unit per
  // (item, kv head) is too many, one unit per (item, kv head).
  long max_pages = 1;
  for (int i = 0; i < n; ++i) max_pages = std::max<long>(max_pages, items[i].num_pages);
  long lo = std::min(max_pages, std::max<long>(1, (total_pages * H + target - 1) / target));
  long hi = max_pages;
  while (lo < hi) {
    const long mid = lo + (hi - lo) / 2;
    if (count_history(mid) > target) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  u.pages_per_unit = lo;
  u.history_units = total_pages > 0 ? count_history(u.pages_per_unit) : 0;
  u.partials = u.num_work();
  if (u.fold_exact) {
    for (int i = 0; i < n; ++i) {
      if (items[i].num_pages <= 0) continue;
      const long splits = (items[i].num_pages + u.pages_per_unit - 1) / u.pages_per_unit;
      u.partials += long(H) * FoldedExactSplits(items[i].num_exact, static_cast<int>(splits));
    }
  }
  return u;
}

}  // namespace

bool FlatCuts(long pages, int exact, long cost, int H, int units, std::vector<FlatUnit>* out,
              const RankShares& shares, long first_unit) {
  out->clear();
  if (pages <= 0 || H <= 0 || units <= 0) return pages <= 0 || H <= 0;
  if (cost <= 0) exact = 0;  // weightless blocks would be cut anywhere
  const long per_head = exact + pages;  // elements: blocks, then pages
  const long elements = per_head * H;
  const long exact_weight = cost * exact, head_weight = exact_weight + pages;
  const long total = head_weight * H;
  units = static_cast<int>(std::min<long>(units, elements));
  out->resize(units);
  FlatUnit* const cut = out->data();
  // The weight before element j of head h.
  auto weight_before = [&](long h, long j) {
    return h * head_weight + (j <= exact ? j * cost : exact_weight + (j - exact));
  };
  // Cut k at the element boundary nearest to the weight k x total / units =
  // t + acc / units, kept in step without a division per cut (this runs in
  // a Prepare for hundreds of units): t = floor, acc the remainder.
  const long q = total / units, r = total % units;
  // With rank shares: cut k at total x S_k / S_units (S_k: the shares of
  // units [0, k)), as t + acc / units with acc rounded.
  std::vector<double> share_before;
  if (shares.active()) {
    share_before.assign(units + 1, 0.0);
    for (int k = 0; k < units; ++k) {
      share_before[k + 1] = share_before[k] + shares.share(first_unit + k);
    }
  }
  long t = 0, acc = 0;
  long th = 0, ts = 0;  // the head of weight t, and its first weight
  long prev = 0, h0 = 0, e0 = 0;  // the unit's first element, as (head, element)
  long w0 = 0;                    // and the weight before it
  for (int k = 1; k <= units; ++k) {
    if (share_before.empty()) {
      t += q;
      acc += r;
      if (acc >= units) {
        acc -= units;
        ++t;
      }
    } else {
      const long double x = static_cast<long double>(total) * share_before[k] / share_before[units];
      t = static_cast<long>(std::floor(x));
      acc = std::lround(static_cast<double>((x - t) * units));
      if (acc >= units) {
        acc -= units;
        ++t;
      }
      if (k == units) {
        t = total;
        acc = 0;
      }
    }
    while (th + 1 < H && t >= ts + head_weight) {
      ++th;
      ts += head_weight;
    }
    // The target's offset in its head, o + acc / units: among the blocks
    // (weight `cost` each) or among the pages, rounded to the nearest
    // boundary.
    long h = th, j;
    const long o = t - ts;
    if (o < exact_weight || (o == exact_weight && acc == 0)) {
      j = exact > 0 ? (2 * (o * units + acc) + cost * units) / (2 * cost * units) : 0;
    } else {
      j = std::min(per_head, exact + (o - exact_weight) + (2 * acc >= units ? 1 : 0));
    }
    long b = k == units ? elements : h * per_head + j;
    const long lo = prev + 1, hi = elements - (units - k);
    if (b < lo || b > hi || k == units) {
      b = std::clamp(b, lo, hi);
      h = b / per_head;  // rare: only where a cut moved
      j = b % per_head;
    }
    // The unit [prev, b): its last head and its elements there.
    const long h1 = j == 0 ? h - 1 : h, e1 = j == 0 ? per_head : j;
    FlatUnit& u = cut[k - 1] = FlatUnit{};
    u.head = static_cast<int>(h0);
    u.exact_head = u.head;
    if (h1 == h0) {
      if (e0 < exact) {
        u.exact_begin = static_cast<int>(e0);
        u.exact_end = static_cast<int>(std::min<long>(e1, exact));
      }
      u.begin = static_cast<int>(std::max<long>(e0, exact) - exact);
      u.end = static_cast<int>(std::max<long>(e1, exact) - exact);
    } else {
      // Two heads at most, and head h0's part pages only.
      if (h1 != h0 + 1 || e0 < exact) {
        out->clear();
        return false;
      }
      u.begin = static_cast<int>(e0 - exact);
      u.end = static_cast<int>(pages);
      u.exact_head = static_cast<int>(h1);
      u.exact_end = static_cast<int>(std::min<long>(e1, exact));
      u.next_end = static_cast<int>(std::max<long>(e1, exact) - exact);
    }
    const long w1 = weight_before(h, j);
    u.weight = w1 - w0;
    prev = b;
    w0 = w1;
    h0 = j == per_head ? h + 1 : h;
    e0 = j == per_head ? 0 : j;
  }
  return true;
}

namespace {

// One item's per-head cut (the same for each kv head): units of `ppu`
// pages, its `exact` folded blocks (0: none ride along) on its first units,
// weighted by `cost` (FoldedPageCuts, which writes *cuts).
struct HeadCut {
  int splits = 0;        // units per kv head
  int per = 0;           // folded blocks per unit (FoldedExactPerUnit)
  int exact_splits = 0;  // units per kv head that carry some (FoldedExactSplits)
};
HeadCut CutPerHead(long pages, int exact, long ppu, long cost, std::vector<long>* cuts) {
  HeadCut c;
  c.splits = pages > 0 ? static_cast<int>((pages + ppu - 1) / ppu) : 0;
  if (exact > 0 && c.splits > 0) {
    c.per = FoldedExactPerUnit(exact, c.splits);
    c.exact_splits = FoldedExactSplits(exact, c.splits);
  }
  FoldedPageCuts(pages, c.splits, ppu, exact, c.per, cost, cuts);
  return c;
}

// The flat cut of a batch (SizeAttendUnits' flat_cut) on the wave share
// `target`, from per-head sizes `u`. Items whose share of the wave (in
// proportion to their weight) is below one unit per kv head take one unit
// per kv head, cut per head (they are light: the flat units weigh more); the
// others share the rest in proportion to their weight, at least one unit per
// kv head each, the remainder to the items with the heaviest units; each is
// cut flat, or per head when its flat cut would not fit FlatUnit (few pages
// for many exact blocks). False (u unchanged) when no item is cut flat.
bool CutFlat(const AttendItem* items, int n, int H, long target, const RankShares& shares,
             UnitSizes* u) {
  // Folded blocks need a weight to be cut with the pages (the kernels that
  // run them after the pages have none, and no flat cut).
  if (u->fold_exact && u->exact_page_cost <= 0) return false;
  const long cost = u->fold_exact ? u->exact_page_cost : 0;
  auto blocks_of = [&](int i) { return u->fold_exact ? items[i].num_exact : 0; };
  std::vector<double> weight(n, 0.0);
  for (int i = 0; i < n; ++i) {
    if (items[i].num_pages > 0) weight[i] = double(H) * double(items[i].num_pages + cost * blocks_of(i));
  }
  // Items cut per head (one split per kv head unless set below), by units
  // per kv head; 0: cut flat.
  std::vector<long> head_splits(n, 0);
  std::vector<int> units(n, 0);
  // Light items first: taking one out only makes the others' shares
  // smaller, so this ends.
  long share = target;
  for (bool changed = true; changed;) {
    changed = false;
    double rest = 0;
    for (int i = 0; i < n; ++i) rest += head_splits[i] == 0 ? weight[i] : 0.0;
    const long share_before = share;
    for (int i = 0; i < n; ++i) {
      if (weight[i] <= 0 || head_splits[i] > 0) continue;
      if (double(share_before) * weight[i] < double(H) * rest) {
        head_splits[i] = 1;
        share -= H;
        changed = true;
      }
    }
  }
  // The others: floor(share x weight / rest) >= H units each (so at most
  // `share` in all), the remainder one by one to the heaviest units.
  double rest = 0;
  long assigned = 0;
  for (int i = 0; i < n; ++i) rest += head_splits[i] == 0 ? weight[i] : 0.0;
  using Entry = std::pair<double, int>;  // (weight per unit, item)
  std::priority_queue<Entry> heaviest_units;
  for (int i = 0; i < n; ++i) {
    if (weight[i] <= 0 || head_splits[i] > 0) continue;
    // (At least H: the test above, up to rounding.)
    units[i] = std::max(H, static_cast<int>(std::floor(double(share) * weight[i] / rest)));
    assigned += units[i];
    heaviest_units.push({weight[i] / units[i], i});
  }
  while (assigned < share && !heaviest_units.empty()) {
    const int i = heaviest_units.top().second;
    heaviest_units.pop();
    ++units[i];
    ++assigned;
    heaviest_units.push({weight[i] / units[i], i});
  }
  long history_units = 0, partials = 0, heaviest = 0;
  bool any_flat = false;
  std::vector<FlatUnit> cut, cuts;
  std::vector<long> page_cuts;
  std::vector<long> head_pages(n, 0);
  for (int i = 0; i < n; ++i) {
    const long pages = items[i].num_pages;
    if (pages <= 0) continue;
    const int e = blocks_of(i);
    if (head_splits[i] == 0) {
      // (The item's units follow the exact units and the items before it.)
      if (FlatCuts(pages, e, cost, H, units[i], &cut, shares, u->exact_units + history_units)) {
        any_flat = true;
        units[i] = static_cast<int>(cut.size());
        history_units += units[i];
        for (const FlatUnit& f : cut) {
          partials += (f.begin < f.end) + (f.exact_begin < f.exact_end) + (f.next_end > 0);
          heaviest = std::max(heaviest, f.weight);
        }
        cuts.insert(cuts.end(), cut.begin(), cut.end());
        continue;
      }
      head_splits[i] = std::max(1, units[i] / H);  // H x that many units at most
      units[i] = 0;
    }
    // Per head, as FillAttendUnits cuts it, with the item's pages per unit.
    head_pages[i] = (pages + head_splits[i] - 1) / head_splits[i];
    const HeadCut c = CutPerHead(pages, e, head_pages[i], cost, &page_cuts);
    history_units += long(H) * c.splits;
    partials += long(H) * (c.splits + c.exact_splits);
    for (int k = 0; k < c.splits; ++k) {
      const BlockRange r = FoldedExactBlocks(e, c.per, k);
      heaviest = std::max(heaviest, page_cuts[k + 1] - page_cuts[k] + cost * (r.end - r.begin));
    }
  }
  if (!any_flat) return false;
  // Items whose exact blocks take exact units of their own keep them.
  u->partials = u->exact_units + partials;
  u->history_units = history_units;
  u->pages_per_unit = heaviest;
  u->flat = true;
  u->flat_units = std::move(units);
  u->head_pages = std::move(head_pages);
  u->flat_cuts = std::move(cuts);
  return true;
}

}  // namespace

UnitSizes SizeAttendUnits(const AttendItem* items, int n, int H, long capacity, FoldExact fold,
                          bool exact_first, bool flat_cut, RankShares shares) {
  UnitSizes sizes;
  switch (fold) {
    case FoldExact::kAlways:
      sizes = SizeUnits(items, n, H, capacity, true);
      break;
    case FoldExact::kNever:
      sizes = SizeUnits(items, n, H, capacity, false);
      break;
    case FoldExact::kAuto: {
      sizes = SizeUnits(items, n, H, capacity, false);
      const long from = exact_first ? kFoldPagesPerUnit : kFoldPagesPerUnitExactAfter;
      if (sizes.pages_per_unit >= from) sizes = SizeUnits(items, n, H, capacity, true);
      break;
    }
  }
  sizes.exact_page_cost = sizes.fold_exact && exact_first ? kFoldedExactPageCost : 0;
  if (flat_cut) {
    const UnitSizes unflat = sizes;
    const long share = HistoryShare(capacity, sizes.exact_units);
    CutFlat(items, n, H, share, RankShares{}, &sizes);
    if (sizes.flat && shares.active() && sizes.pages_per_unit >= shares.min_unit_pages) {
      sizes = unflat;
      CutFlat(items, n, H, share, shares, &sizes);
      sizes.rank_shares = sizes.flat;
    }
  }
  return sizes;
}

namespace {
// A unit of (item, kv head) with no ranges and no partials yet.
WorkUnit UnitOf(int item, int kv_head) {
  WorkUnit u{};
  u.item = item;
  u.kv_head = kv_head;
  u.exact_head = kv_head;
  return u;
}
}  // namespace

void FoldedPageCuts(long pages, int splits, long ppu, int num_exact, int per, long cost,
                    std::vector<long>* cuts) {
  std::vector<long>& pb = *cuts;
  pb.resize(splits + 1);
  for (int s = 0; s <= splits; ++s) pb[s] = std::min(pages, s * ppu);
  if (cost <= 0 || num_exact <= 0 || splits <= 1 || pages < splits) return;
  // Unit s's pages plus `cost` per exact block come out even: cut s sits at
  // the even share of the weight before it, less its units' blocks' cost,
  // with at least one page per unit (pages >= splits: the clamp's bounds
  // stay ordered).
  const double share = double(pages + cost * long(num_exact)) / splits;
  long blocks = 0;  // exact blocks of units [0, s)
  for (int s = 1; s < splits; ++s) {
    const BlockRange r = FoldedExactBlocks(num_exact, per, s - 1);
    blocks += r.end - r.begin;
    const long cut = std::lround(share * s - double(cost * blocks));
    pb[s] = std::clamp(cut, pb[s - 1] + 1, pages - (splits - s));
  }
}

namespace {

// The history units of item i under a flat cut, cut[0, sizes.flat_units[i])
// (SizeAttendUnits' FlatCuts), from `partial` on: each kv head's history
// partials, then its exact ones.
void FillFlatUnits(const UnitSizes& sizes, const FlatUnit* cut, int i, int H, int* partial,
                   int* w, WorkUnit* work, HeadPartials* heads) {
  const FlatUnit* const cut_end = cut + sizes.flat_units[i];
  std::vector<int> hist(H, 0), ex(H, 0);
  for (const FlatUnit* p = cut; p < cut_end; ++p) {
    const FlatUnit& f = *p;
    if (f.begin < f.end) ++hist[f.head];
    if (f.exact_begin < f.exact_end) ++ex[f.exact_head];
    if (f.next_end > 0) ++hist[f.head + 1];
  }
  for (int h = 0; h < H; ++h) {
    HeadPartials& hp = heads[size_t(i) * H + h];
    hp.hist_first = *partial;
    hp.hist_count = hist[h];
    *partial += hist[h];
    if (ex[h] > 0) {  // else the item's exact units' (set before)
      hp.exact_first = *partial;
      hp.exact_count = ex[h];
      *partial += ex[h];
    }
    hist[h] = hp.hist_first;  // from here: the next index of each set
    ex[h] = hp.exact_first;
  }
  for (const FlatUnit* p = cut; p < cut_end; ++p) {
    const FlatUnit& f = *p;
    WorkUnit& u = work[(*w)++] = UnitOf(i, f.head);
    if (f.begin < f.end) {
      u.begin = f.begin;
      u.end = f.end;
      u.partial = hist[f.head]++;
    }
    if (f.exact_begin < f.exact_end) {
      u.exact_head = f.exact_head;
      u.exact_begin = f.exact_begin;
      u.exact_end = f.exact_end;
      u.exact_partial = ex[f.exact_head]++;
    }
    if (f.next_end > 0) {
      u.next_end = f.next_end;
      u.next_partial = hist[f.head + 1]++;
    }
  }
}

}  // namespace

void FillAttendUnits(const UnitSizes& sizes, const AttendItem* items, int n, int H,
                     WorkUnit* work, HeadPartials* heads) {
  const long epu = sizes.exact_per_unit, batch_ppu = sizes.pages_per_unit;
  int partial = 0, w = 0;
  std::vector<long> cuts;  // one item's page cuts at a time
  const FlatUnit* flat_cut = sizes.flat_cuts.data();  // the next flat item's units
  for (int i = 0; i < n; ++i) {
    const AttendItem& it = items[i];
    for (int h = 0; h < H; ++h) heads[size_t(i) * H + h] = HeadPartials{partial, 0, partial, 0};
    if (it.num_exact <= 0 || (sizes.fold_exact && it.num_pages > 0)) continue;
    const int splits = static_cast<int>((it.num_exact + epu - 1) / epu);
    for (int h = 0; h < H; ++h) {
      HeadPartials& hp = heads[size_t(i) * H + h];
      hp.exact_first = partial;
      hp.exact_count = splits;
      for (int s = 0; s < splits; ++s) {
        WorkUnit& u = work[w++] = UnitOf(i, h);
        u.exact_begin = static_cast<int>(s * epu);
        u.exact_end = static_cast<int>(std::min<long>(it.num_exact, (s + 1) * epu));
        u.exact_partial = partial++;
      }
    }
  }
  for (int i = 0; i < n; ++i) {
    const AttendItem& it = items[i];
    if (sizes.flat && sizes.flat_units[i] > 0) {
      FillFlatUnits(sizes, flat_cut, i, H, &partial, &w, work, heads);
      flat_cut += sizes.flat_units[i];
      continue;
    }
    // Per head, with the batch's pages per unit, or the item's own when the
    // batch is cut flat.
    const long ppu = sizes.flat ? std::max(1L, sizes.head_pages[i]) : batch_ppu;
    // Exact blocks riding on this item's first history units.
    const bool fold = sizes.fold_exact && it.num_pages > 0 && it.num_exact > 0;
    const HeadCut c = CutPerHead(it.num_pages, fold ? it.num_exact : 0, ppu,
                                 fold ? sizes.exact_page_cost : 0, &cuts);
    const int splits = c.splits, esplits = c.exact_splits;
    const int hist_begin = partial;
    partial += H * splits;
    const int exact_begin = partial;
    if (fold) partial += H * esplits;
    for (int h = 0; h < H; ++h) {
      HeadPartials& hp = heads[size_t(i) * H + h];
      hp.hist_first = hist_begin + h * splits;
      hp.hist_count = splits;
      if (fold) {
        hp.exact_first = exact_begin + h * esplits;
        hp.exact_count = esplits;
      }
    }
    for (int h = 0; h < H; ++h) {
      for (int s = 0; s < splits; ++s) {
        WorkUnit& u = work[w++] = UnitOf(i, h);
        u.begin = static_cast<int>(cuts[s]);
        u.end = static_cast<int>(cuts[s + 1]);
        u.partial = hist_begin + h * splits + s;
        const BlockRange r = FoldedExactBlocks(it.num_exact, c.per, s);
        if (r.begin < r.end) {
          u.exact_begin = r.begin;
          u.exact_end = r.end;
          u.exact_partial = exact_begin + h * esplits + s;
        }
      }
    }
  }
}

void PairHeadUnits(const WorkUnit* work, long num_work, const HeadPartials* heads, int n, int H,
                   long partials, WorkUnit* out_work, HeadPartials* out_heads) {
  const int half = static_cast<int>(partials);  // the partials of one half
  auto shifted = [](int partial, int by) { return partial >= 0 ? partial + by : -1; };
  for (long u = 0; u < num_work; ++u) {
    for (int s = 0; s < 2; ++s) {
      WorkUnit& p = out_work[2 * u + s] = work[u];
      const int by = s * half;
      p.kv_head = 2 * work[u].kv_head + s;
      p.exact_head = 2 * work[u].exact_head + s;
      p.partial = shifted(work[u].partial, by);
      p.exact_partial = shifted(work[u].exact_partial, by);
      p.next_partial = shifted(work[u].next_partial, by);
    }
  }
  for (long ih = 0; ih < long(n) * H; ++ih) {
    for (int s = 0; s < 2; ++s) {
      HeadPartials& hp = out_heads[2 * ih + s] = heads[ih];
      hp.hist_first += s * half;
      hp.exact_first += s * half;
    }
  }
}

void FillClusterUnits(const AttendItem* items, int n, int H, int cluster, int clusters_per_head,
                      WorkUnit* work) {
  const int units = cluster * clusters_per_head;  // per (item, kv head)
  std::vector<long> eb(units + 1), pb(units + 1);
  std::vector<double> want(units);
  int w = 0;
  for (int i = 0; i < n; ++i) {
    const long pages = items[i].num_pages, exact = items[i].num_exact;
    // Unit u's exact blocks [eb[u], eb[u + 1]) (spread evenly) and page weight.
    double total_want = 0;
    const double target = double(pages + kClusterExactPageCost * exact) / units;
    for (int u = 0; u <= units; ++u) eb[u] = exact * u / units;
    for (int u = 0; u < units; ++u) {
      want[u] = std::max(0.0, target - double(kClusterExactPageCost * (eb[u + 1] - eb[u])));
      total_want += want[u];
    }
    // Its pages [pb[u], pb[u + 1]), the same for every kv head.
    double cum = 0;
    pb[0] = 0;
    for (int u = 0; u < units; ++u) {
      cum += want[u];
      long end = pages;  // the last unit takes the rest
      if (u + 1 < units) {
        end = total_want > 0 ? std::min(pages, std::lround(double(pages) * cum / total_want)) : 0;
      }
      pb[u + 1] = std::max(pb[u], end);
    }
    for (int h = 0; h < H; ++h) {
      for (int u = 0; u < units; ++u) {
        WorkUnit& wu = work[w++] = UnitOf(i, h);
        wu.begin = static_cast<int>(pb[u]);
        wu.end = static_cast<int>(pb[u + 1]);
        wu.exact_begin = static_cast<int>(eb[u]);
        wu.exact_end = static_cast<int>(eb[u + 1]);
      }
    }
  }
}

}  // namespace cuda_attend
}  // namespace oscarkv
