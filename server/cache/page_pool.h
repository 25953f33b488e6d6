// The server's one memory pool (DESIGN section 5): a single backend allocation
// made at start and cut into two classes of fixed-size slots:
//   - history pages (INT2, PageGeometry::page_bytes()),
//   - exact blocks (BF16 sink/recent, PageGeometry::exact_block_bytes()).
// Nothing is allocated on the request path: requests reserve slots up front
// (all or nothing) and draw from the reservation.
//
// Thread-safety: all methods may be called concurrently.
#ifndef OSCARKV_SERVER_CACHE_PAGE_POOL_H_
#define OSCARKV_SERVER_CACHE_PAGE_POOL_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace oscarkv {

using SlotId = uint32_t;

struct PoolOptions {
  size_t total_bytes = 0;       // whole pool
  double exact_fraction = 0.2;  // share of total_bytes for exact (BF16) blocks
  size_t page_bytes = 0;        // slot size of a history page (largest model served)
  size_t block_bytes = 0;       // slot size of an exact block (largest model served)
};

class PagePool;

// Slots taken from the pool for one operation. Move-only; whatever is left
// when it is destroyed goes back to the pool. Not thread-safe.
class Reservation {
 public:
  Reservation() = default;
  Reservation(Reservation&&) noexcept;
  Reservation& operator=(Reservation&&) noexcept;
  Reservation(const Reservation&) = delete;
  Reservation& operator=(const Reservation&) = delete;
  ~Reservation();

  // Precondition: pages_left() > 0 / blocks_left() > 0 (planned by the caller).
  SlotId TakePage();
  SlotId TakeBlock();
  // A block freed during the operation, reusable by the same operation.
  void ReturnBlock(SlotId id) { blocks_.push_back(id); }
  int pages_left() const { return static_cast<int>(pages_.size()); }
  int blocks_left() const { return static_cast<int>(blocks_.size()); }

 private:
  friend class PagePool;
  void Release();
  PagePool* pool_ = nullptr;
  std::vector<SlotId> pages_;
  std::vector<SlotId> blocks_;
};

class PagePool {
 public:
  // Allocates the pool on `backend` (which must outlive the pool).
  static absl::StatusOr<std::unique_ptr<PagePool>> Create(Backend* backend,
                                                          const PoolOptions& options);

  // Takes `pages` history pages and `blocks` exact blocks, or nothing:
  // ResourceExhausted naming what is short.
  absl::StatusOr<Reservation> Reserve(int pages, int blocks);

  void FreePages(const SlotId* ids, size_t n);
  void FreeBlocks(const SlotId* ids, size_t n);

  uint8_t* page(SlotId id) const { return base_page_ + size_t(id) * options_.page_bytes; }
  bf16_bits* block(SlotId id) const {
    return reinterpret_cast<bf16_bits*>(base_block_ + size_t(id) * options_.block_bytes);
  }

  const PoolOptions& options() const { return options_; }
  int total_pages() const { return total_pages_; }
  int total_blocks() const { return total_blocks_; }
  int free_pages() const;
  int free_blocks() const;
  size_t total_bytes() const { return buffer_.size(); }

 private:
  PagePool(DeviceBuffer buffer, const PoolOptions& options, int pages, int blocks);
  void Return(Reservation& r);

  DeviceBuffer buffer_;
  PoolOptions options_;
  uint8_t* base_page_ = nullptr;
  uint8_t* base_block_ = nullptr;
  int total_pages_ = 0;
  int total_blocks_ = 0;
  mutable std::mutex mu_;
  std::vector<SlotId> free_pages_ ABSL_GUARDED_BY(mu_);
  std::vector<SlotId> free_blocks_ ABSL_GUARDED_BY(mu_);

  friend class Reservation;
};

}  // namespace oscarkv

#endif  // OSCARKV_SERVER_CACHE_PAGE_POOL_H_
