#include "server/cache/page_pool.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace oscarkv {

Reservation::Reservation(Reservation&& o) noexcept { *this = std::move(o); }

Reservation& Reservation::operator=(Reservation&& o) noexcept {
  if (this != &o) {
    Release();
    pool_ = o.pool_;
    pages_ = std::move(o.pages_);
    blocks_ = std::move(o.blocks_);
    o.pool_ = nullptr;
    o.pages_.clear();
    o.blocks_.clear();
  }
  return *this;
}

Reservation::~Reservation() { Release(); }

void Reservation::Release() {
  if (pool_ != nullptr) pool_->Return(*this);
  pages_.clear();
  blocks_.clear();
}

SlotId Reservation::TakePage() {
  const SlotId id = pages_.back();
  pages_.pop_back();
  return id;
}

SlotId Reservation::TakeBlock() {
  const SlotId id = blocks_.back();
  blocks_.pop_back();
  return id;
}

absl::StatusOr<std::unique_ptr<PagePool>> PagePool::Create(Backend* backend,
                                                           const PoolOptions& o) {
  if (o.page_bytes == 0 || o.block_bytes == 0) {
    return absl::InvalidArgumentError("pool slot sizes must be positive");
  }
  if (!(o.exact_fraction > 0.0 && o.exact_fraction < 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("exact_fraction must be in (0, 1), got ", o.exact_fraction));
  }
  PoolOptions opts = o;
  // Keep slots 256-byte aligned so kernels can use wide loads.
  opts.page_bytes = (o.page_bytes + 255) / 256 * 256;
  opts.block_bytes = (o.block_bytes + 255) / 256 * 256;
  const size_t exact_bytes = static_cast<size_t>(o.total_bytes * o.exact_fraction);
  const size_t blocks = exact_bytes / opts.block_bytes;
  const size_t pages = (o.total_bytes - exact_bytes) / opts.page_bytes;
  if (blocks < 1 || pages < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pool of ", o.total_bytes, " bytes is too small for one ", opts.page_bytes,
        "-byte page and one ", opts.block_bytes, "-byte block (exact_fraction ",
        o.exact_fraction, ")"));
  }
  // Slot ids and counts are ints here.
  if (pages > size_t(INT32_MAX) || blocks > size_t(INT32_MAX)) {
    return absl::InvalidArgumentError(absl::StrCat("pool has too many slots (", pages,
                                                   " pages, ", blocks, " blocks; at most 2^31 - 1 each)"));
  }
  auto buffer = backend->Allocate(pages * opts.page_bytes + blocks * opts.block_bytes);
  if (!buffer.ok()) return buffer.status();
  return std::unique_ptr<PagePool>(
      new PagePool(std::move(*buffer), opts, static_cast<int>(pages), static_cast<int>(blocks)));
}

PagePool::PagePool(DeviceBuffer buffer, const PoolOptions& options, int pages, int blocks)
    : buffer_(std::move(buffer)), options_(options), total_pages_(pages), total_blocks_(blocks) {
  base_page_ = buffer_.as<uint8_t>();
  base_block_ = base_page_ + size_t(pages) * options_.page_bytes;
  // Highest ids at the front so that TakePage() (back) hands out low ids first.
  free_pages_.resize(pages);
  for (int i = 0; i < pages; ++i) free_pages_[i] = SlotId(pages - 1 - i);
  free_blocks_.resize(blocks);
  for (int i = 0; i < blocks; ++i) free_blocks_[i] = SlotId(blocks - 1 - i);
}

absl::StatusOr<Reservation> PagePool::Reserve(int pages, int blocks) {
  pages = std::max(pages, 0);
  blocks = std::max(blocks, 0);
  Reservation r;
  std::lock_guard<std::mutex> l(mu_);
  if (size_t(pages) > free_pages_.size() || size_t(blocks) > free_blocks_.size()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cache pool is full: need ", pages, " history pages and ", blocks,
        " exact blocks, have ", free_pages_.size(), " of ", total_pages_, " pages and ",
        free_blocks_.size(), " of ", total_blocks_, " blocks free"));
  }
  r.pool_ = this;
  r.pages_.assign(free_pages_.end() - pages, free_pages_.end());
  free_pages_.resize(free_pages_.size() - pages);
  r.blocks_.assign(free_blocks_.end() - blocks, free_blocks_.end());
  free_blocks_.resize(free_blocks_.size() - blocks);
  return r;
}

void PagePool::Return(Reservation& r) {
  std::lock_guard<std::mutex> l(mu_);
  free_pages_.insert(free_pages_.end(), r.pages_.begin(), r.pages_.end());
  free_blocks_.insert(free_blocks_.end(), r.blocks_.begin(), r.blocks_.end());
}

void PagePool::FreePages(const SlotId* ids, size_t n) {
  std::lock_guard<std::mutex> l(mu_);
  free_pages_.insert(free_pages_.end(), ids, ids + n);
}

void PagePool::FreeBlocks(const SlotId* ids, size_t n) {
  std::lock_guard<std::mutex> l(mu_);
  free_blocks_.insert(free_blocks_.end(), ids, ids + n);
}

int PagePool::free_pages() const {
  std::lock_guard<std::mutex> l(mu_);
  return static_cast<int>(free_pages_.size());
}

int PagePool::free_blocks() const {
  std::lock_guard<std::mutex> l(mu_);
  return static_cast<int>(free_blocks_.size());
}

}  // namespace oscarkv
