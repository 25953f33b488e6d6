// The sequence store: every sequence's per-layer tiers on top of the page pool
// (server/cache), with commit-on-stream-end ingest, LRU eviction and pinning
// (DESIGN sections 1 and 5).
//
// Visibility: a sequence being ingested (IngestSession) is invisible to every
// other call; Commit() makes it visible atomically; destroying an uncommitted
// session frees all its slots.
//
// Capacity: an operation reserves all the slots it needs before touching any
// tier. When the pool cannot serve the reservation, policy kLru evicts the
// least-recently-used committed, unpinned sequence that no call is using and
// retries; kRefuse (or nothing evictable) returns RESOURCE_EXHAUSTED.
//
// Thread-safety: all methods may be called concurrently. Calls on one sequence
// serialize on its mutex. Lock order: Sequence::mu -> SequenceStore::mu_ ->
// PagePool's mutex, and SequenceStore::mu_ -> ModelRegistry's mutex; never
// the reverse.
#ifndef OSCARKV_SERVER_STORE_SEQUENCE_STORE_H_
#define OSCARKV_SERVER_STORE_SEQUENCE_STORE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "server/cache/layer_cache.h"
#include "server/cache/page_pool.h"
#include "server/store/model_registry.h"

namespace oscarkv {

enum class EvictionPolicy { kLru, kRefuse };

// Sums over layers (token counts are token-layers).
struct TierTotals {
  int64_t sink_tokens = 0;
  int64_t history_tokens = 0;
  int64_t recent_tokens = 0;
  int64_t history_bytes = 0;  // pages x page bytes of the model
  int64_t exact_bytes = 0;    // sink + recent rows actually held, BF16
  int64_t sink_bytes = 0;     // the sink part of exact_bytes
  int64_t slot_bytes = 0;     // pool slots held (pages and whole blocks)
  int64_t elements = 0;       // K and V elements: tokens x 2 x Hkv x D

  TierTotals& operator+=(const TierTotals& o);
  TierTotals& operator-=(const TierTotals& o);
  // Stored bits per K/V element: 8 * (history + exact bytes) / elements.
  double effective_bits() const;
};

struct SequenceStats {
  std::string id;
  std::shared_ptr<const ModelEntry> model;
  int64_t tokens = 0;  // min over layers
  TierCounts layer0;   // tiers of layer 0
  TierTotals totals;
  bool pinned = false;
  int64_t last_access_unix_ms = 0;
};

// Store-wide figures for metrics and GetServerInfo.
struct StoreStats {
  TierTotals committed;  // committed sequences only
  int64_t sequences = 0;
  int64_t ingesting = 0;
  int64_t evictions = 0;   // monotonic
  int64_t demotions = 0;   // monotonic, pages
  int64_t pool_total_bytes = 0;
  int64_t pool_free_bytes = 0;
  int64_t pool_history_bytes = 0;  // slots in use
  int64_t pool_exact_bytes = 0;
};

// One layer copied out in the COMPRESSED form (host memory).
struct CompressedLayer {
  int64_t tokens = 0;
  TierCounts counts;
  std::vector<bf16_bits> sink_k, sink_v;      // [sink][Hkv][D]
  std::vector<uint8_t> pages;                 // counts.pages x page_bytes
  std::vector<bf16_bits> recent_k, recent_v;  // [recent][Hkv][D]
};

class SequenceStore;

// The state of one sequence. Fields other than the constants are reached only
// through SequenceStore.
class Sequence {
 public:
  Sequence(std::string id, std::shared_ptr<const ModelEntry> model, bool pinned);
  const std::string& id() const { return id_; }
  const ModelEntry& model() const { return *model_; }

 private:
  friend class SequenceStore;
  friend class IngestSession;
  // FAILED_PRECONDITION when a backend error left a layer unusable.
  absl::Status Usable() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!broken_) return absl::OkStatus();
    return absl::FailedPreconditionError(
        absl::StrCat("sequence '", id_, "' is unusable after a backend error; drop it"));
  }
  const std::string id_;
  const std::shared_ptr<const ModelEntry> model_;
  const bool pinned_;
  std::mutex mu_;
  std::vector<LayerCache> layers_ ABSL_GUARDED_BY(mu_);
  bool counted_ ABSL_GUARDED_BY(mu_) = false;  // part of the store's committed totals
  bool broken_ ABSL_GUARDED_BY(mu_) = false;   // a backend error left a layer unusable
  // Guarded by SequenceStore::mu_.
  int users_ = 0;
  bool doomed_ = false;  // dropped/evicted while in use: released by the last user
  uint64_t lru_tick_ = 0;
  int64_t last_access_ms_ = 0;
};

// Keeps a committed sequence alive and un-evictable while held. Move-only.
class SequenceHandle {
 public:
  SequenceHandle() = default;
  SequenceHandle(SequenceStore* store, std::shared_ptr<Sequence> seq)
      : store_(store), seq_(std::move(seq)) {}
  SequenceHandle(SequenceHandle&& o) noexcept = default;
  SequenceHandle& operator=(SequenceHandle&& o) noexcept;
  ~SequenceHandle();
  Sequence* operator->() const { return seq_.get(); }
  Sequence& operator*() const { return *seq_; }

 private:
  SequenceStore* store_ = nullptr;
  std::shared_ptr<Sequence> seq_;
};

// An uncommitted sequence being filled by one PutKv stream. Not thread-safe
// (one stream); destroying it without Commit() discards everything.
class IngestSession {
 public:
  ~IngestSession();
  // Appends n tokens of one layer (layer >= 0) or of all layers (-1):
  // k, v BF16 [layers][n][Hkv][D]. Returns INVALID_ARGUMENT for a bad chunk,
  // RESOURCE_EXHAUSTED when the pool cannot take it.
  absl::Status Append(int layer, int64_t start_token, int64_t n, const void* k, size_t k_bytes,
                      const void* v, size_t v_bytes);
  // Makes the sequence visible. INVALID_ARGUMENT if it is empty, its layers
  // hold different token counts or expected_tokens is not met.
  absl::StatusOr<SequenceStats> Commit();
  const ModelEntry& model() const { return seq_->model(); }

 private:
  friend class SequenceStore;
  IngestSession(SequenceStore* store, std::shared_ptr<Sequence> seq, int64_t expected_tokens)
      : store_(store), seq_(std::move(seq)), expected_tokens_(expected_tokens) {}
  SequenceStore* store_;
  std::shared_ptr<Sequence> seq_;
  int64_t expected_tokens_;
  bool committed_ = false;
};

class SequenceStore {
 public:
  // `backend`, `pool` and `models` must outlive the store.
  SequenceStore(Backend* backend, PagePool* pool, const ModelRegistry* models,
                EvictionPolicy policy);
  ~SequenceStore();

  // ALREADY_EXISTS if the id is stored or being ingested; NOT_FOUND for an
  // unknown model; INVALID_ARGUMENT for a malformed id.
  absl::StatusOr<std::unique_ptr<IngestSession>> BeginIngest(const std::string& id,
                                                             const std::string& model, bool pin,
                                                             int64_t expected_tokens);
  // NOT_FOUND if no committed sequence has this id. Marks it most recently used.
  absl::StatusOr<SequenceHandle> Acquire(const std::string& id);

  // Appends decode tokens (same chunk rules as IngestSession::Append).
  absl::Status Append(SequenceHandle& seq, int layer, int64_t start_token, int64_t n,
                      const void* k, size_t k_bytes, const void* v, size_t v_bytes);

  // Attention of one query token on one layer; with k and v (BF16 [Hkv][D])
  // non-null, appends that token first (position: expected token index, or -1).
  // q fp32 [Hq][D]; out fp32 [Hq][D]; lse [Hq] or null.
  absl::Status Attend(SequenceHandle& seq, int layer, const float* q, const bf16_bits* k,
                      const bf16_bits* v, int64_t position, float* out, float* lse,
                      int64_t* tokens);

  // Many attention items at once: every distinct sequence is locked once
  // (in address order), fused appends run in item order, and the items of
  // each model go to the backend in one batch. Each task gets its own status.
  struct AttendTask {
    SequenceHandle* seq = nullptr;
    int layer = 0;
    const float* q = nullptr;  // host [Hq][D]
    const bf16_bits* k = nullptr;  // optional fused append, host [Hkv][D]
    const bf16_bits* v = nullptr;
    int64_t position = -1;
    float* out = nullptr;  // host [Hq][D]
    float* lse = nullptr;  // host [Hq] or null
    int64_t tokens = 0;    // out: tokens attended
    absl::Status status;   // out
  };
  void AttendMany(std::vector<AttendTask>& tasks);

  absl::Status ReadCompressed(SequenceHandle& seq, int layer, CompressedLayer* out);
  // Whole layer in BF16 [T][Hkv][D]: sink and recent bit-exact, history decoded.
  absl::Status ReadBf16(SequenceHandle& seq, int layer, std::vector<bf16_bits>* k,
                        std::vector<bf16_bits>* v, int64_t* tokens);

  // NOT_FOUND if absent. Returns the pool bytes freed (now, or when the last
  // reader finishes).
  absl::StatusOr<int64_t> Drop(const std::string& id);
  SequenceStats Stat(SequenceHandle& seq);
  // Committed sequences ordered by id, starting after `after`, at most `limit`.
  std::vector<SequenceStats> List(const std::string& model, const std::string& after, int limit);
  StoreStats Stats() const;
  // Committed sequences of `model`.
  int64_t CountSequences(const std::string& model) const;

  // OK when `model` has neither committed sequences nor PutKv streams
  // ingesting into it; FAILED_PRECONDITION naming both counts otherwise (a
  // replaced rotation must not leave sequences encoded with the old one).
  absl::Status CheckModelUnused(const std::string& model) const;
  // Runs `registration` (which registers or replaces `model`) only if
  // CheckModelUnused passes, under the store's lock: no ingest of `model` can
  // begin or commit between the check and the registration. `registration`
  // must not call the store.
  absl::Status RegisterIfModelUnused(const std::string& model,
                                     const std::function<absl::Status()>& registration);

  // Runs one tiny encode + attention for `model` on the backend (one exact
  // block and one page from the pool, returned afterwards), so a model the
  // backend cannot serve (e.g. a page size its kernels do not implement) is
  // refused when it is registered rather than on every request.
  absl::Status ProbeModel(const ModelEntry& model);

  EvictionPolicy policy() const { return policy_; }
  Backend& backend() { return *backend_; }
  PagePool& pool() { return *pool_; }

 private:
  friend class IngestSession;
  friend class SequenceHandle;

  absl::Status AppendLocked(Sequence& seq, int layer, int64_t start, int64_t n, const void* k,
                            size_t k_bytes, const void* v, size_t v_bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu_);
  // Reserves slots, evicting per policy.
  // Whether the free slots plus those of every idle unpinned sequence cover
  // the request (so that a hopeless request evicts nothing).
  bool EvictionCanHelp(int pages, int blocks);
  absl::StatusOr<Reservation> ReserveWithEviction(int pages, int blocks);
  void ReleaseUser(Sequence& seq);
  // Frees all slots of a sequence no one else can reach.
  void ReleaseLayers(Sequence& seq);
  void AbortIngest(Sequence& seq);
  absl::StatusOr<SequenceStats> CommitIngest(std::shared_ptr<Sequence> seq, int64_t expected);
  SequenceStats StatLocked(Sequence& seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu_);
  TierTotals TotalsLocked(Sequence& seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu_);
  void AddCommitted(const TierTotals& delta, int sign);
  int64_t CountSequencesLocked(const std::string& model) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckModelUnusedLocked(const std::string& model) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Backend buffers for decode scratch (ReadBf16), reused across calls.
  absl::StatusOr<DeviceBuffer> TakeScratch(size_t bytes);
  void ReturnScratch(DeviceBuffer buffer);

  Backend* const backend_;
  PagePool* const pool_;
  const ModelRegistry* const models_;
  const EvictionPolicy policy_;

  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<Sequence>> sequences_ ABSL_GUARDED_BY(mu_);
  // Sequences being ingested (PutKv streams not ended): id -> model name.
  std::map<std::string, std::string> ingesting_ ABSL_GUARDED_BY(mu_);
  uint64_t clock_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t evictions_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t demotions_ ABSL_GUARDED_BY(mu_) = 0;
  TierTotals committed_ ABSL_GUARDED_BY(mu_);

  std::mutex scratch_mu_;
  std::vector<DeviceBuffer> scratch_ ABSL_GUARDED_BY(scratch_mu_);
  size_t scratch_bytes_ ABSL_GUARDED_BY(scratch_mu_) = 0;  // cached in scratch_
};

// Checks a sequence id: 1..256 bytes of printable ASCII.
absl::Status ValidateSequenceId(const std::string& id);

}  // namespace oscarkv

#endif  // OSCARKV_SERVER_STORE_SEQUENCE_STORE_H_
