// The tiers of one sequence in one layer (DESIGN section 1):
//   sink    tokens [0, S0)             BF16 exact blocks, bit-exact
//   history tokens [S0, T - r)         INT2 history pages of P tokens
//   recent  the last r tokens          BF16 exact blocks, W <= r < W + P once
//                                      the sequence has history
// Every new token enters the sink or the recent tier; when r reaches W + P the
// oldest P recent tokens are encoded into one history page (demotion). The
// state is a function of the token count alone, so appending one token at a
// time or in chunks of any size gives identical tiers.
//
// Not thread-safe: the owner (the sequence store) serializes calls per sequence.
#ifndef OSCARKV_SERVER_CACHE_LAYER_CACHE_H_
#define OSCARKV_SERVER_CACHE_LAYER_CACHE_H_

#include <cstdint>
#include <deque>
#include <vector>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "kernels/layout.h"
#include "server/cache/page_pool.h"

namespace oscarkv {

// Slots one append needs from the pool, computed before anything is touched.
struct AppendPlan {
  int pages = 0;        // new history pages
  int peak_blocks = 0;  // most exact blocks held from the reservation at once
  int net_blocks = 0;   // blocks held at the end (may be negative: demotion frees)
};

// Tier sizes at T tokens.
struct TierCounts {
  int64_t sink = 0;
  int64_t history = 0;
  int64_t recent = 0;
  int pages = 0;
  int sink_blocks = 0;
  int recent_blocks = 0;
};
TierCounts CountTiers(const TierConfig& tiers, int64_t tokens);

// Demotions are batched: the recent tier may grow by up to this many pages
// beyond W + P during one append before they are encoded in one backend call.
inline constexpr int kMaxStagedPages = 64;

// The per-layer encoding parameters: rotation (device pointers) and clip ratios.
struct LayerCodec {
  RotationRef rotation;
  float clip_k = 0.96f;
  float clip_v = 0.92f;
};

class LayerCache {
 public:
  LayerCache(const TierConfig& tiers, const PageGeometry& geom) : tiers_(tiers), geom_(geom) {}
  LayerCache(LayerCache&&) = default;
  LayerCache& operator=(LayerCache&&) = default;

  int64_t tokens() const { return tokens_; }
  TierCounts counts() const { return CountTiers(tiers_, tokens_); }

  // What appending n tokens needs from the reservation (see PlanLayers for
  // several layers sharing one reservation).
  AppendPlan Plan(int64_t n) const;

  // Appends n tokens: k, v host BF16 [n][H][D]. Every block and page comes
  // from `reservation` (planned with Plan); blocks freed by demotion go back
  // into it. Returns InvalidArgument for non-finite values (nothing is
  // changed then), or the backend's error (the layer is then unusable and
  // the caller must drop the sequence).
  absl::Status Append(const bf16_bits* k, const bf16_bits* v, int64_t n, const LayerCodec& codec,
                      PagePool& pool, Reservation& reservation, Backend& backend,
                      int* demotions);

  // Frees every slot back to the pool and resets to zero tokens.
  void Release(PagePool& pool);

  // Device pointers for attention, in token order.
  void AttendRefs(const PagePool& pool, std::vector<ExactBlockRef>* exact,
                  std::vector<const uint8_t*>* pages) const;
  // The sink and recent blocks of AttendRefs alone.
  void ExactRefs(const PagePool& pool, std::vector<ExactBlockRef>* exact) const;
  // The history pages' device pointers in token order, kept as pages are
  // added (no per-call work); valid until the next Append or Release.
  const std::vector<const uint8_t*>& page_pointers() const { return page_ptrs_; }
  // The id of that table for AttendItem::page_table_id: taken with the
  // table's first page, unique in the process, dropped by Release (0 then).
  // Meaningful only while there are pages.
  uint64_t page_table_id() const { return page_table_id_; }

  // Reads all tokens back as host BF16 [T][H][D]: sink and recent bit-exact,
  // history decoded (dequantized, un-rotated). `scratch` is backend memory of
  // at least one exact block (geometry().exact_block_bytes()) owned by the
  // caller; it is not a pool slot, so a read never competes with ingest.
  absl::Status ReadBf16(const LayerCodec& codec, const PagePool& pool, Backend& backend,
                        bf16_bits* scratch, bf16_bits* k, bf16_bits* v) const;

  // Copies the rows of one BF16 tier (counts().sink or counts().recent
  // tokens) to host k and v, [n][H][D] each.
  enum class ExactTier { kSink, kRecent };
  absl::Status CopyExactTier(ExactTier tier, const PagePool& pool, Backend& backend, bf16_bits* k,
                             bf16_bits* v) const;

  const std::vector<SlotId>& history_pages() const { return pages_; }
  const std::vector<SlotId>& sink_blocks() const { return sink_blocks_; }
  const std::deque<SlotId>& recent_blocks() const { return recent_blocks_; }
  const PageGeometry& geometry() const { return geom_; }
  const TierConfig& tiers() const { return tiers_; }

 private:
  TierConfig tiers_;
  PageGeometry geom_;
  int64_t tokens_ = 0;
  std::vector<SlotId> sink_blocks_;
  std::vector<SlotId> pages_;
  std::vector<const uint8_t*> page_ptrs_;  // pool.page(pages_[i])
  uint64_t page_table_id_ = 0;
  std::deque<SlotId> recent_blocks_;
};

// What appending n tokens to each of `layers` in turn, with one reservation,
// needs: pages summed, blocks = the largest running total of blocks held.
AppendPlan PlanLayers(const std::vector<const LayerCache*>& layers, int64_t n);

// Returns true if every BF16 value is finite (no NaN, no Inf).
bool AllFiniteBf16(const bf16_bits* x, size_t n);

}  // namespace oscarkv

#endif  // OSCARKV_SERVER_CACHE_LAYER_CACHE_H_
