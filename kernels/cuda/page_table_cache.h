// Bookkeeping of the CUDA launcher's device copies of named page tables
// (AttendItem::page_table_id): where each table lives in one device array of
// page pointers, and which of its entries a call must upload. Host code only,
// no CUDA calls: the launcher owns the array and does the copies.
//
// A decode step attends the same (sequence, layer) tables call after call,
// each at most one page longer than the last time, so the entries are
// uploaded once instead of on every call.
//
// Placement: each table gets a run of `capacity` entries (a power of two, at
// least kMinEntries) from a bump allocator. A table that outgrows its run
// moves to a new one (uploaded whole; the old run is abandoned). When the
// array is full the caller takes a new array of CapacityWhenFull entries (or
// clears this one) and places the batch again: every table is then uploaded
// whole once. This is a cache: forgetting is always correct. The array must
// hold the tables of every layer of every sequence being decoded (the store
// calls once per layer), so it grows to fit them rather than being cleared
// on every round of layers.
//
// Not thread-safe (the launcher's caller serializes calls).
#ifndef OSCARKV_KERNELS_CUDA_PAGE_TABLE_CACHE_H_
#define OSCARKV_KERNELS_CUDA_PAGE_TABLE_CACHE_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <unordered_map>

namespace oscarkv {
namespace cuda_attend {

class PageTableCache {
 public:
  static constexpr size_t kMinEntries = 64;

  // Where table `id` lives now and what to upload: entries [upload_from,
  // num_pages) of the caller's table go to array entries offset +
  // upload_from onward.
  struct Placement {
    size_t offset = 0;
    int upload_from = 0;
  };

  explicit PageTableCache(size_t capacity_entries = 0) : capacity_(capacity_entries) {}

  // Places table `id` with `num_pages` entries (`pages`, host array). A known
  // table whose remembered entries still match (its length did not shrink and
  // its last remembered entry is the same) uploads only its new entries;
  // anything else is uploaded whole. nullopt when the array has no room (the
  // caller then calls Clear and places the batch again). id must not be 0.
  std::optional<Placement> Place(uint64_t id, const void* const* pages, int num_pages);

  // Forgets every table; the whole array is free again.
  void Clear();
  // A new array of `capacity_entries` entries (forgets every table).
  void Reset(size_t capacity_entries);

  // Entries a table of `num_pages` pages takes in the array.
  static size_t CapacityFor(int num_pages);

  // The array size to continue with once placing a batch that needs `need`
  // entries failed: twice the size (repeatedly, up to `max_entries`) while
  // the known tables and the batch would fill more than half of it, so that
  // a working set larger than the array stops emptying it over and over;
  // else the same size, cleared (that drops runs abandoned by moved tables
  // and tables no longer used).
  size_t CapacityWhenFull(size_t need, size_t max_entries) const;

  size_t capacity() const { return capacity_; }
  size_t used() const { return used_; }
  size_t live() const { return live_; }  // entries in the runs of known tables
  size_t tables() const { return tables_.size(); }

 private:
  struct Table {
    size_t offset = 0;
    size_t capacity = 0;
    int count = 0;
    const void* last = nullptr;  // entry count - 1 when placed
  };
  size_t capacity_;
  size_t used_ = 0;
  size_t live_ = 0;
  std::unordered_map<uint64_t, Table> tables_;
};

}  // namespace cuda_attend
}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_CUDA_PAGE_TABLE_CACHE_H_
