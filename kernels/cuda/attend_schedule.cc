#include "kernels/cuda/attend_schedule.h"

#include <algorithm>

namespace oscarkv {
namespace cuda_attend {

UnitSizes SizeAttendUnits(const AttendItem* items, int n, int H, long capacity) {
  UnitSizes u;
  capacity = std::max<long>(1, capacity);
  long total_pages = 0, total_exact = 0, max_exact = 1;
  for (int i = 0; i < n; ++i) {
    total_pages += items[i].num_pages;
    total_exact += items[i].num_exact;
    max_exact = std::max<long>(max_exact, items[i].num_exact);
  }
  auto count_exact = [&](long e) {
    long c = 0;
    for (int i = 0; i < n; ++i) c += (items[i].num_exact + e - 1) / e;
    return c * H;
  };
  while (u.exact_per_unit < max_exact && count_exact(u.exact_per_unit) > capacity / 8) {
    ++u.exact_per_unit;
  }
  u.exact_units = total_exact > 0 ? count_exact(u.exact_per_unit) : 0;
  const long target = std::max({1L, capacity / 2, capacity - u.exact_units});
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
  return u;
}

void FillAttendUnits(const UnitSizes& sizes, const AttendItem* items, int n, int H,
                     WorkUnit* work, ItemPlan* plans) {
  const long epu = sizes.exact_per_unit, ppu = sizes.pages_per_unit;
  int partial = 0, w = 0;
  for (int i = 0; i < n; ++i) {
    const AttendItem& it = items[i];
    const int splits = it.num_exact > 0 ? static_cast<int>((it.num_exact + epu - 1) / epu) : 0;
    plans[i].exact_begin = partial;
    plans[i].exact_splits = splits;
    for (int h = 0; h < H; ++h) {
      for (int s = 0; s < splits; ++s) {
        const int begin = static_cast<int>(s * epu);
        const int end = static_cast<int>(std::min<long>(it.num_exact, (s + 1) * epu));
        work[w++] = WorkUnit{i, h, begin, end, partial++, 1};
      }
    }
  }
  for (int i = 0; i < n; ++i) {
    const AttendItem& it = items[i];
    const int splits = it.num_pages > 0 ? static_cast<int>((it.num_pages + ppu - 1) / ppu) : 0;
    plans[i].hist_begin = partial;
    plans[i].hist_splits = splits;
    for (int h = 0; h < H; ++h) {
      for (int s = 0; s < splits; ++s) {
        const int begin = static_cast<int>(s * ppu);
        const int end = static_cast<int>(std::min<long>(it.num_pages, (s + 1) * ppu));
        work[w++] = WorkUnit{i, h, begin, end, partial++, 0};
      }
    }
  }
}

}  // namespace cuda_attend
}  // namespace oscarkv
