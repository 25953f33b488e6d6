#include "server/cache/layer_cache.h"

#include <algorithm>
#include <atomic>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"

namespace oscarkv {
namespace {

// Page table ids are unique in the process (AttendItem::page_table_id).
uint64_t NextPageTableId() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Tier state as counts; the walk below moves it forward token run by token run.
struct Cursor {
  int64_t tokens = 0;
  int pages = 0;
  int sink_blocks = 0;
  int recent_blocks = 0;
};

// The one description of how tokens enter the tiers. `v` receives:
//   NewSinkBlock(), NewRecentBlock(), CopySink(block, row, src, n),
//   CopyRecent(block, row, src, n), Demote(k)  (encode the k oldest recent blocks)
// each returning absl::Status.
template <typename Visitor>
absl::Status Walk(const TierConfig& t, Cursor& c, int64_t n, Visitor& v) {
  const int64_t s0 = t.sink_tokens, w = t.recent_window, p = t.page_tokens;
  const int64_t flush_at = w + p * (kMaxStagedPages + 1);
  auto recent = [&] { return c.tokens - s0 - int64_t(c.pages) * p; };
  auto flush = [&]() -> absl::Status {
    if (c.tokens <= s0) return absl::OkStatus();
    const int64_t r = recent();
    const int k = r >= w + p ? static_cast<int>((r - w) / p) : 0;
    if (k == 0) return absl::OkStatus();
    OSCARKV_RETURN_IF_ERROR(v.Demote(k));
    c.pages += k;
    c.recent_blocks -= k;
    return absl::OkStatus();
  };
  int64_t pos = 0;
  while (pos < n) {
    int64_t m;
    if (c.tokens < s0) {
      const int64_t blk = c.tokens / p, row = c.tokens % p;
      if (blk == c.sink_blocks) {
        OSCARKV_RETURN_IF_ERROR(v.NewSinkBlock());
        ++c.sink_blocks;
      }
      m = std::min({p - row, s0 - c.tokens, n - pos});
      OSCARKV_RETURN_IF_ERROR(v.CopySink(int(blk), int(row), pos, m));
    } else {
      const int64_t r = recent();
      const int64_t blk = r / p, row = r % p;
      if (blk == c.recent_blocks) {
        OSCARKV_RETURN_IF_ERROR(v.NewRecentBlock());
        ++c.recent_blocks;
      }
      m = std::min({p - row, n - pos, flush_at - r});
      OSCARKV_RETURN_IF_ERROR(v.CopyRecent(int(blk), int(row), pos, m));
    }
    c.tokens += m;
    pos += m;
    if (c.tokens > s0 && recent() >= flush_at) OSCARKV_RETURN_IF_ERROR(flush());
  }
  return flush();
}

// Counts what a walk takes from the reservation.
struct PlanVisitor {
  int held = 0, peak = 0, pages = 0;
  absl::Status Take() {
    peak = std::max(peak, ++held);
    return absl::OkStatus();
  }
  absl::Status NewSinkBlock() { return Take(); }
  absl::Status NewRecentBlock() { return Take(); }
  absl::Status CopySink(int, int, int64_t, int64_t) { return absl::OkStatus(); }
  absl::Status CopyRecent(int, int, int64_t, int64_t) { return absl::OkStatus(); }
  absl::Status Demote(int k) {
    pages += k;
    held -= k;
    return absl::OkStatus();
  }
};

Cursor CursorOf(const TierConfig& t, int64_t tokens) {
  const TierCounts tc = CountTiers(t, tokens);
  return Cursor{tokens, tc.pages, tc.sink_blocks, tc.recent_blocks};
}

}  // namespace

TierCounts CountTiers(const TierConfig& t, int64_t tokens) {
  TierCounts c;
  const int64_t s0 = t.sink_tokens, w = t.recent_window, p = t.page_tokens;
  c.sink = std::min(tokens, s0);
  const int64_t rest = tokens - c.sink;
  c.pages = rest >= w + p ? static_cast<int>((rest - w) / p) : 0;
  c.history = int64_t(c.pages) * p;
  c.recent = rest - c.history;
  c.sink_blocks = static_cast<int>(CeilDiv(c.sink, p));
  c.recent_blocks = static_cast<int>(CeilDiv(c.recent, p));
  return c;
}

bool AllFiniteBf16(const bf16_bits* x, size_t n) {
  uint16_t bad = 0;
  for (size_t i = 0; i < n; ++i) bad |= static_cast<uint16_t>((x[i] & 0x7f80u) == 0x7f80u);
  return bad == 0;
}

AppendPlan LayerCache::Plan(int64_t n) const {
  Cursor c = CursorOf(tiers_, tokens_);
  PlanVisitor v;
  (void)Walk(tiers_, c, n, v);
  AppendPlan plan;
  plan.pages = v.pages;
  plan.peak_blocks = v.peak;
  plan.net_blocks = v.held;
  return plan;
}

namespace {

class AppendVisitor {
 public:
  AppendVisitor(LayerCache& cache, std::vector<SlotId>& sink, std::deque<SlotId>& recent,
                std::vector<SlotId>& pages, std::vector<const uint8_t*>& page_ptrs,
                uint64_t& table_id, const bf16_bits* k, const bf16_bits* v,
                const LayerCodec& codec, PagePool& pool, Reservation& res, Backend& backend)
      : geom_(cache.geometry()), sink_(sink), recent_(recent), pages_(pages),
        page_ptrs_(page_ptrs), table_id_(table_id), k_(k), v_(v), codec_(codec), pool_(pool),
        res_(res), backend_(backend) {}

  absl::Status NewSinkBlock() {
    sink_.push_back(res_.TakeBlock());
    return absl::OkStatus();
  }
  absl::Status NewRecentBlock() {
    recent_.push_back(res_.TakeBlock());
    return absl::OkStatus();
  }
  absl::Status CopySink(int blk, int row, int64_t src, int64_t n) {
    return Copy(sink_[blk], row, src, n);
  }
  absl::Status CopyRecent(int blk, int row, int64_t src, int64_t n) {
    return Copy(recent_[blk], row, src, n);
  }
  absl::Status Demote(int k) {
    jobs_.clear();
    for (int i = 0; i < k; ++i) {
      EncodeJob job;
      job.src_block = pool_.block(recent_[i]);
      const SlotId page = res_.TakePage();
      if (pages_.empty()) table_id_ = NextPageTableId();
      pages_.push_back(page);
      job.dst_page = pool_.page(page);
      page_ptrs_.push_back(job.dst_page);
      job.rotation = codec_.rotation;
      job.clip_k = codec_.clip_k;
      job.clip_v = codec_.clip_v;
      jobs_.push_back(job);
    }
    OSCARKV_RETURN_IF_ERROR(backend_.EncodePages(geom_, jobs_.data(), k));
    for (int i = 0; i < k; ++i) {
      res_.ReturnBlock(recent_.front());
      recent_.pop_front();
    }
    demotions += k;
    return absl::OkStatus();
  }

  int demotions = 0;

 private:
  absl::Status Copy(SlotId block, int row, int64_t src, int64_t n) {
    const size_t row_elems = geom_.exact_row_elems();
    bf16_bits* base = pool_.block(block);
    const size_t bytes = size_t(n) * row_elems * sizeof(bf16_bits);
    OSCARKV_RETURN_IF_ERROR(
        backend_.CopyToDevice(base + size_t(row) * row_elems, k_ + src * row_elems, bytes));
    return backend_.CopyToDevice(base + (size_t(geom_.page_tokens) + row) * row_elems,
                                 v_ + src * row_elems, bytes);
  }

  const PageGeometry& geom_;
  std::vector<SlotId>& sink_;
  std::deque<SlotId>& recent_;
  std::vector<SlotId>& pages_;
  std::vector<const uint8_t*>& page_ptrs_;
  uint64_t& table_id_;
  const bf16_bits* k_;
  const bf16_bits* v_;
  const LayerCodec& codec_;
  PagePool& pool_;
  Reservation& res_;
  Backend& backend_;
  std::vector<EncodeJob> jobs_;
};

}  // namespace

absl::Status LayerCache::Append(const bf16_bits* k, const bf16_bits* v, int64_t n,
                                const LayerCodec& codec, PagePool& pool,
                                Reservation& reservation, Backend& backend, int* demotions) {
  if (n < 0) return absl::InvalidArgumentError("negative token count");
  if (n == 0) return absl::OkStatus();
  const size_t elems = size_t(n) * geom_.exact_row_elems();
  if (!AllFiniteBf16(k, elems)) {
    return absl::InvalidArgumentError("keys contain NaN or Inf values");
  }
  if (!AllFiniteBf16(v, elems)) {
    return absl::InvalidArgumentError("values contain NaN or Inf values");
  }
  const AppendPlan plan = Plan(n);
  if (reservation.pages_left() < plan.pages || reservation.blocks_left() < plan.peak_blocks) {
    return absl::InternalError(absl::StrCat(
        "append of ", n, " tokens needs ", plan.pages, " pages and ", plan.peak_blocks,
        " blocks; the reservation holds ", reservation.pages_left(), " and ",
        reservation.blocks_left()));
  }
  Cursor c = CursorOf(tiers_, tokens_);
  AppendVisitor visitor(*this, sink_blocks_, recent_blocks_, pages_, page_ptrs_, page_table_id_,
                        k, v, codec, pool, reservation, backend);
  const absl::Status s = Walk(tiers_, c, n, visitor);
  tokens_ = c.tokens;
  if (demotions) *demotions += visitor.demotions;
  return s;
}

void LayerCache::Release(PagePool& pool) {
  pool.FreePages(pages_.data(), pages_.size());
  pool.FreeBlocks(sink_blocks_.data(), sink_blocks_.size());
  std::vector<SlotId> recent(recent_blocks_.begin(), recent_blocks_.end());
  pool.FreeBlocks(recent.data(), recent.size());
  pages_.clear();
  page_ptrs_.clear();
  page_table_id_ = 0;
  sink_blocks_.clear();
  recent_blocks_.clear();
  tokens_ = 0;
}

void LayerCache::AttendRefs(const PagePool& pool, std::vector<ExactBlockRef>* exact,
                            std::vector<const uint8_t*>* pages) const {
  ExactRefs(pool, exact);
  *pages = page_ptrs_;
}

void LayerCache::ExactRefs(const PagePool& pool, std::vector<ExactBlockRef>* exact) const {
  const TierCounts tc = counts();
  const int p = geom_.page_tokens;
  exact->clear();
  int64_t left = tc.sink;
  for (SlotId b : sink_blocks_) {
    const int n = static_cast<int>(std::min<int64_t>(left, p));
    exact->push_back(ExactBlockRef{pool.block(b), n});
    left -= n;
  }
  left = tc.recent;
  for (SlotId b : recent_blocks_) {
    const int n = static_cast<int>(std::min<int64_t>(left, p));
    exact->push_back(ExactBlockRef{pool.block(b), n});
    left -= n;
  }
}

namespace {

// Copies n token rows of an exact block (K half, then V half) to host k and v.
absl::Status CopyBlockRows(Backend& backend, const PageGeometry& geom, const bf16_bits* block,
                           int64_t n, bf16_bits* k, bf16_bits* v) {
  const size_t row = geom.exact_row_elems();
  const size_t bytes = size_t(n) * row * sizeof(bf16_bits);
  OSCARKV_RETURN_IF_ERROR(backend.CopyToHost(k, block, bytes));
  return backend.CopyToHost(v, block + size_t(geom.page_tokens) * row, bytes);
}

}  // namespace

absl::Status LayerCache::CopyExactTier(ExactTier tier, const PagePool& pool, Backend& backend,
                                       bf16_bits* k, bf16_bits* v) const {
  const TierCounts tc = counts();
  const int64_t total = tier == ExactTier::kSink ? tc.sink : tc.recent;
  const size_t row = geom_.exact_row_elems();
  int64_t pos = 0;
  auto copy = [&](SlotId b) -> absl::Status {
    const int64_t n = std::min<int64_t>(total - pos, geom_.page_tokens);
    if (n <= 0) return absl::OkStatus();
    OSCARKV_RETURN_IF_ERROR(
        CopyBlockRows(backend, geom_, pool.block(b), n, k + pos * row, v + pos * row));
    pos += n;
    return absl::OkStatus();
  };
  if (tier == ExactTier::kSink) {
    for (SlotId b : sink_blocks_) OSCARKV_RETURN_IF_ERROR(copy(b));
  } else {
    for (SlotId b : recent_blocks_) OSCARKV_RETURN_IF_ERROR(copy(b));
  }
  return absl::OkStatus();
}

absl::Status LayerCache::ReadBf16(const LayerCodec& codec, const PagePool& pool,
                                  Backend& backend, bf16_bits* scratch, bf16_bits* k,
                                  bf16_bits* v) const {
  const TierCounts tc = counts();
  const int p = geom_.page_tokens;
  const size_t row = geom_.exact_row_elems();
  OSCARKV_RETURN_IF_ERROR(CopyExactTier(ExactTier::kSink, pool, backend, k, v));
  int64_t pos = tc.sink;
  for (SlotId id : pages_) {
    DecodeJob job{pool.page(id), scratch, codec.rotation};
    OSCARKV_RETURN_IF_ERROR(backend.DecodePages(geom_, &job, 1));
    OSCARKV_RETURN_IF_ERROR(
        CopyBlockRows(backend, geom_, scratch, p, k + pos * row, v + pos * row));
    pos += p;
  }
  return CopyExactTier(ExactTier::kRecent, pool, backend, k + pos * row, v + pos * row);
}

AppendPlan PlanLayers(const std::vector<const LayerCache*>& layers, int64_t n) {
  AppendPlan total;
  int held = 0;
  for (const LayerCache* l : layers) {
    const AppendPlan p = l->Plan(n);
    total.pages += p.pages;
    total.peak_blocks = std::max(total.peak_blocks, held + p.peak_blocks);
    held += p.net_blocks;
  }
  total.net_blocks = held;
  return total;
}

}  // namespace oscarkv
