#include "kernels/cuda/page_table_cache.h"

#include <algorithm>

namespace oscarkv {
namespace cuda_attend {

size_t PageTableCache::CapacityFor(int num_pages) {
  size_t c = kMinEntries;
  while (c < static_cast<size_t>(std::max(num_pages, 0))) c *= 2;
  return c;
}

std::optional<PageTableCache::Placement> PageTableCache::Place(uint64_t id,
                                                               const void* const* pages,
                                                               int num_pages) {
  const void* last = num_pages > 0 ? pages[num_pages - 1] : nullptr;
  auto it = tables_.find(id);
  if (it != tables_.end()) {
    Table& t = it->second;
    const bool same_prefix =
        t.count <= num_pages && (t.count == 0 || pages[t.count - 1] == t.last);
    if (same_prefix && static_cast<size_t>(num_pages) <= t.capacity) {
      const Placement p{t.offset, t.count};
      t.count = num_pages;
      t.last = last;
      return p;
    }
  }
  // New, outgrown or changed: a new run, uploaded whole.
  const size_t need = CapacityFor(num_pages);
  if (need > capacity_ - used_) return std::nullopt;
  Table t;
  t.offset = used_;
  t.capacity = need;
  t.count = num_pages;
  t.last = last;
  used_ += need;
  live_ += need;
  if (it != tables_.end()) {
    live_ -= it->second.capacity;  // its old run is abandoned
    it->second = t;
  } else {
    tables_.emplace(id, t);
  }
  return Placement{t.offset, 0};
}

size_t PageTableCache::CapacityWhenFull(size_t need, size_t max_entries) const {
  size_t c = std::max(capacity_, kMinEntries);
  while (2 * (live_ + need) > c && c < max_entries) c = std::min(2 * c, max_entries);
  return std::max(c, capacity_);
}

void PageTableCache::Clear() {
  tables_.clear();
  used_ = 0;
  live_ = 0;
}

void PageTableCache::Reset(size_t capacity_entries) {
  Clear();
  capacity_ = capacity_entries;
}

}  // namespace cuda_attend
}  // namespace oscarkv
