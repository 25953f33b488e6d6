#include "server/store/sequence_store.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"

namespace oscarkv {
namespace {

constexpr int64_t kMaxChunkTokens = int64_t{1} << 22;

int64_t NowUnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

TierTotals& TierTotals::operator+=(const TierTotals& o) {
  sink_tokens += o.sink_tokens;
  history_tokens += o.history_tokens;
  recent_tokens += o.recent_tokens;
  history_bytes += o.history_bytes;
  exact_bytes += o.exact_bytes;
  sink_bytes += o.sink_bytes;
  slot_bytes += o.slot_bytes;
  elements += o.elements;
  return *this;
}

TierTotals& TierTotals::operator-=(const TierTotals& o) {
  sink_tokens -= o.sink_tokens;
  history_tokens -= o.history_tokens;
  recent_tokens -= o.recent_tokens;
  history_bytes -= o.history_bytes;
  exact_bytes -= o.exact_bytes;
  sink_bytes -= o.sink_bytes;
  slot_bytes -= o.slot_bytes;
  elements -= o.elements;
  return *this;
}

double TierTotals::effective_bits() const {
  return elements > 0 ? 8.0 * double(history_bytes + exact_bytes) / double(elements) : 0.0;
}

absl::Status ValidateSequenceId(const std::string& id) {
  if (id.empty() || id.size() > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence_id must be 1..256 bytes, got ", id.size()));
  }
  for (char c : id) {
    if (c < 0x21 || c > 0x7e) {
      return absl::InvalidArgumentError(
          "sequence_id must be printable ASCII without spaces");
    }
  }
  return absl::OkStatus();
}

Sequence::Sequence(std::string id, std::shared_ptr<const ModelEntry> model, bool pinned)
    : id_(std::move(id)), model_(std::move(model)), pinned_(pinned) {
  layers_.reserve(model_->layout.num_layers);
  for (int l = 0; l < model_->layout.num_layers; ++l) {
    layers_.emplace_back(model_->tiers, model_->geom);
  }
}

SequenceHandle& SequenceHandle::operator=(SequenceHandle&& o) noexcept {
  if (this != &o) {
    if (seq_ && store_) store_->ReleaseUser(*seq_);
    store_ = o.store_;
    seq_ = std::move(o.seq_);
    o.store_ = nullptr;
  }
  return *this;
}

SequenceHandle::~SequenceHandle() {
  if (seq_ && store_) store_->ReleaseUser(*seq_);
}

IngestSession::~IngestSession() {
  if (!committed_) store_->AbortIngest(*seq_);
}

absl::Status IngestSession::Append(int layer, int64_t start_token, int64_t n, const void* k,
                                   size_t k_bytes, const void* v, size_t v_bytes) {
  if (committed_) return absl::FailedPreconditionError("ingest session already committed");
  std::lock_guard<std::mutex> lock(seq_->mu_);
  return store_->AppendLocked(*seq_, layer, start_token, n, k, k_bytes, v, v_bytes);
}

absl::StatusOr<SequenceStats> IngestSession::Commit() {
  if (committed_) return absl::FailedPreconditionError("ingest session already committed");
  auto stats = store_->CommitIngest(seq_, expected_tokens_);
  if (stats.ok()) committed_ = true;
  return stats;
}

SequenceStore::SequenceStore(Backend* backend, PagePool* pool, const ModelRegistry* models,
                             EvictionPolicy policy)
    : backend_(backend), pool_(pool), models_(models), policy_(policy) {}

SequenceStore::~SequenceStore() {
  std::map<std::string, std::shared_ptr<Sequence>> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    all.swap(sequences_);
  }
  for (auto& [id, seq] : all) {
    std::lock_guard<std::mutex> lock(seq->mu_);
    ReleaseLayers(*seq);
  }
}

absl::StatusOr<std::unique_ptr<IngestSession>> SequenceStore::BeginIngest(
    const std::string& id, const std::string& model, bool pin, int64_t expected_tokens) {
  OSCARKV_RETURN_IF_ERROR(ValidateSequenceId(id));
  if (expected_tokens < 0) {
    return absl::InvalidArgumentError("expected_tokens must be >= 0");
  }
  std::shared_ptr<const ModelEntry> entry;
  {
    // The model is looked up under mu_ so that RegisterIfModelUnused cannot
    // replace it between this lookup and the ingest being counted.
    std::lock_guard<std::mutex> lock(mu_);
    OSCARKV_ASSIGN_OR_RETURN(entry, models_->Find(model));
    if (sequences_.count(id)) {
      return absl::AlreadyExistsError(absl::StrCat("sequence '", id, "' already exists"));
    }
    if (!ingesting_.emplace(id, model).second) {
      return absl::AlreadyExistsError(
          absl::StrCat("sequence '", id, "' is being ingested by another stream"));
    }
  }
  auto seq = std::make_shared<Sequence>(id, std::move(entry), pin);
  return std::unique_ptr<IngestSession>(new IngestSession(this, std::move(seq), expected_tokens));
}

absl::StatusOr<SequenceHandle> SequenceStore::Acquire(const std::string& id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sequences_.find(id);
  if (it == sequences_.end() && ingesting_.count(id) > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "sequence '", id, "' is still being ingested (its PutKv stream has not ended)"));
  }
  if (it == sequences_.end()) {
    return absl::NotFoundError(absl::StrCat("unknown sequence '", id, "'"));
  }
  Sequence& s = *it->second;
  ++s.users_;
  s.lru_tick_ = ++clock_;
  s.last_access_ms_ = NowUnixMs();
  return SequenceHandle(this, it->second);
}

void SequenceStore::ReleaseUser(Sequence& seq) {
  bool release = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    --seq.users_;
    release = seq.doomed_ && seq.users_ == 0;
  }
  if (release) {
    std::lock_guard<std::mutex> lock(seq.mu_);
    // Drop marks a sequence doomed and subtracts its totals under this lock,
    // so counted_ is false here; checked anyway so that the committed totals
    // never keep a freed sequence.
    if (seq.counted_) AddCommitted(TotalsLocked(seq), -1);
    seq.counted_ = false;
    ReleaseLayers(seq);
  }
}

void SequenceStore::ReleaseLayers(Sequence& seq) {
  for (LayerCache& l : seq.layers_) l.Release(*pool_);
}

void SequenceStore::AbortIngest(Sequence& seq) {
  // The id first: once the pool shows the slots free, the id is unknown too.
  {
    std::lock_guard<std::mutex> lock(mu_);
    ingesting_.erase(seq.id());
  }
  std::lock_guard<std::mutex> lock(seq.mu_);
  ReleaseLayers(seq);
}

TierTotals SequenceStore::TotalsLocked(Sequence& seq) {
  TierTotals t;
  const ModelEntry& m = seq.model();
  const int64_t row_bytes = int64_t(m.geom.exact_row_elems()) * 2;
  const int64_t page_slot = pool_->options().page_bytes, block_slot = pool_->options().block_bytes;
  for (const LayerCache& l : seq.layers_) {
    const TierCounts c = l.counts();
    t.sink_tokens += c.sink;
    t.history_tokens += c.history;
    t.recent_tokens += c.recent;
    t.history_bytes += int64_t(l.history_pages().size()) * int64_t(m.geom.page_bytes());
    t.exact_bytes += (c.sink + c.recent) * row_bytes * 2;
    t.sink_bytes += c.sink * row_bytes * 2;
    t.slot_bytes += int64_t(l.history_pages().size()) * page_slot +
                    int64_t(l.sink_blocks().size() + l.recent_blocks().size()) * block_slot;
    t.elements += l.tokens() * int64_t(m.geom.exact_row_elems()) * 2;
  }
  return t;
}

void SequenceStore::AddCommitted(const TierTotals& delta, int sign) {
  std::lock_guard<std::mutex> lock(mu_);
  if (sign > 0) {
    committed_ += delta;
  } else {
    committed_ -= delta;
  }
}

absl::StatusOr<SequenceStats> SequenceStore::CommitIngest(std::shared_ptr<Sequence> seq,
                                                          int64_t expected) {
  std::lock_guard<std::mutex> seq_lock(seq->mu_);
  if (seq->broken_) return absl::FailedPreconditionError("ingest failed; nothing was stored");
  const int64_t t0 = seq->layers_[0].tokens();
  if (t0 == 0) {
    return absl::InvalidArgumentError("PutKv stream ended without any tokens for layer 0");
  }
  for (size_t l = 1; l < seq->layers_.size(); ++l) {
    if (seq->layers_[l].tokens() != t0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "PutKv stream ended with layer ", l, " holding ", seq->layers_[l].tokens(),
          " tokens but layer 0 holding ", t0, "; every layer must hold the same tokens"));
    }
  }
  if (expected > 0 && t0 != expected) {
    return absl::InvalidArgumentError(absl::StrCat("PutKv stream ended with ", t0,
                                                   " tokens per layer; header expected ",
                                                   expected));
  }
  const TierTotals totals = TotalsLocked(*seq);
  {
    std::lock_guard<std::mutex> lock(mu_);
    ingesting_.erase(seq->id());
    seq->lru_tick_ = ++clock_;
    seq->last_access_ms_ = NowUnixMs();
    sequences_[seq->id()] = seq;
    committed_ += totals;
  }
  seq->counted_ = true;
  return StatLocked(*seq);
}

bool SequenceStore::EvictionCanHelp(int pages, int blocks) {
  std::vector<std::shared_ptr<Sequence>> idle;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [id, seq] : sequences_) {
      if (!seq->pinned_ && seq->users_ == 0) idle.push_back(seq);
    }
  }
  int64_t free_pages = pool_->free_pages(), free_blocks = pool_->free_blocks();
  for (const auto& seq : idle) {
    // try_lock: the caller may hold another sequence's lock; a sequence busy
    // right now is simply not counted.
    std::unique_lock<std::mutex> lock(seq->mu_, std::try_to_lock);
    if (!lock.owns_lock()) continue;
    for (const LayerCache& l : seq->layers_) {
      free_pages += int64_t(l.history_pages().size());
      free_blocks += int64_t(l.sink_blocks().size() + l.recent_blocks().size());
    }
  }
  return free_pages >= pages && free_blocks >= blocks;
}

absl::StatusOr<Reservation> SequenceStore::ReserveWithEviction(int pages, int blocks) {
  if (pages > pool_->total_pages() || blocks > pool_->total_blocks()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "request needs ", pages, " history pages and ", blocks,
        " exact blocks; the whole pool has ", pool_->total_pages(), " and ",
        pool_->total_blocks()));
  }
  bool checked_eviction_helps = false;
  for (;;) {
    absl::StatusOr<Reservation> r = pool_->Reserve(pages, blocks);
    if (r.ok() || r.status().code() != absl::StatusCode::kResourceExhausted) return r;
    if (policy_ == EvictionPolicy::kRefuse) {
      return absl::ResourceExhaustedError(
          absl::StrCat("pool full (eviction policy refuse): ", r.status().message()));
    }
    if (!checked_eviction_helps) {
      checked_eviction_helps = true;
      if (!EvictionCanHelp(pages, blocks)) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "pool full, and evicting every idle unpinned sequence would not free enough; "
            "the rest are pinned or in use (nothing was evicted): ", r.status().message()));
      }
    }
    std::shared_ptr<Sequence> victim;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto best = sequences_.end();
      for (auto it = sequences_.begin(); it != sequences_.end(); ++it) {
        const Sequence& s = *it->second;
        if (s.pinned_ || s.users_ > 0) continue;
        if (best == sequences_.end() || s.lru_tick_ < best->second->lru_tick_) best = it;
      }
      if (best != sequences_.end()) {
        victim = best->second;
        sequences_.erase(best);
        ++evictions_;
      }
    }
    if (!victim) {
      return absl::ResourceExhaustedError(
          absl::StrCat("pool full and no sequence can be evicted (all pinned or in use): ",
                       r.status().message()));
    }
    std::lock_guard<std::mutex> lock(victim->mu_);
    if (victim->counted_) AddCommitted(TotalsLocked(*victim), -1);
    victim->counted_ = false;
    ReleaseLayers(*victim);
  }
}

absl::Status SequenceStore::AppendLocked(Sequence& seq, int layer, int64_t start, int64_t n,
                                         const void* k, size_t k_bytes, const void* v,
                                         size_t v_bytes) {
  OSCARKV_RETURN_IF_ERROR(seq.Usable());
  const ModelEntry& m = seq.model();
  const int num_layers = m.layout.num_layers;
  if (layer < -1 || layer >= num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " out of range [0, ",
                                                   num_layers, ") (or -1 for all layers)"));
  }
  if (n < 1 || n > kMaxChunkTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_tokens must be in [1, ", kMaxChunkTokens, "], got ", n));
  }
  const int nl = layer < 0 ? num_layers : 1;
  const int first = layer < 0 ? 0 : layer;
  const size_t row = m.geom.exact_row_elems();
  const size_t expect = size_t(nl) * size_t(n) * row * sizeof(bf16_bits);
  const char* names[2] = {"k", "v"};
  const size_t got[2] = {k_bytes, v_bytes};
  for (int i = 0; i < 2; ++i) {
    if (got[i] != expect) {
      return absl::InvalidArgumentError(absl::StrCat(
          names[i], " has ", got[i], " bytes; expected ", expect, " = ", nl, " layers x ", n,
          " tokens x ", m.layout.num_kv_heads, " kv heads x ", m.layout.head_dim,
          " head_dim x 2 bytes (BF16)"));
    }
  }
  std::vector<const LayerCache*> targets;
  for (int l = first; l < first + nl; ++l) {
    if (seq.layers_[l].tokens() != start) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer ", l, " holds ", seq.layers_[l].tokens(), " tokens; chunk starts at token ",
          start, " (tokens must be contiguous and in order, without overlap)"));
    }
    targets.push_back(&seq.layers_[l]);
  }
  const auto* kb = static_cast<const bf16_bits*>(k);
  const auto* vb = static_cast<const bf16_bits*>(v);
  const size_t layer_elems = size_t(n) * row;
  for (int i = 0; i < nl; ++i) {
    if (!AllFiniteBf16(kb + i * layer_elems, layer_elems)) {
      return absl::InvalidArgumentError(
          absl::StrCat("k of layer ", first + i, " contains NaN or Inf values"));
    }
    if (!AllFiniteBf16(vb + i * layer_elems, layer_elems)) {
      return absl::InvalidArgumentError(
          absl::StrCat("v of layer ", first + i, " contains NaN or Inf values"));
    }
  }
  const AppendPlan plan = PlanLayers(targets, n);
  OSCARKV_ASSIGN_OR_RETURN(Reservation res, ReserveWithEviction(plan.pages, plan.peak_blocks));
  const TierTotals before = TotalsLocked(seq);
  int demotions = 0;
  absl::Status status;
  for (int i = 0; i < nl && status.ok(); ++i) {
    status = seq.layers_[first + i].Append(kb + i * layer_elems, vb + i * layer_elems, n,
                                           m.codecs[first + i], *pool_, res, *backend_,
                                           &demotions);
  }
  if (!status.ok()) seq.broken_ = true;
  TierTotals delta = TotalsLocked(seq);
  delta -= before;
  {
    std::lock_guard<std::mutex> lock(mu_);
    demotions_ += demotions;
    if (seq.counted_) committed_ += delta;
  }
  if (!status.ok()) {
    return absl::InternalError(absl::StrCat("backend failed while appending to layer: ",
                                            status.message()));
  }
  return absl::OkStatus();
}

absl::Status SequenceStore::Append(SequenceHandle& seq, int layer, int64_t start_token,
                                   int64_t n, const void* k, size_t k_bytes, const void* v,
                                   size_t v_bytes) {
  std::lock_guard<std::mutex> lock(seq->mu_);
  return AppendLocked(*seq, layer, start_token, n, k, k_bytes, v, v_bytes);
}

absl::StatusOr<int64_t> SequenceStore::Drop(const std::string& id) {
  // The sequence's lock is held (taken before mu_, the lock order) while the
  // sequence leaves the map and its bytes are counted: a last reader cannot
  // free its layers in between and leave the reply saying 0 bytes freed.
  for (;;) {
    std::shared_ptr<Sequence> seq;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = sequences_.find(id);
      if (it == sequences_.end() && ingesting_.count(id) > 0) {
        return absl::FailedPreconditionError(absl::StrCat(
            "sequence '", id, "' is still being ingested (its PutKv stream has not ended; "
            "cancelling the stream discards it)"));
      }
      if (it == sequences_.end()) {
        return absl::NotFoundError(absl::StrCat("unknown sequence '", id, "'"));
      }
      seq = it->second;
    }
    std::lock_guard<std::mutex> seq_lock(seq->mu_);
    bool release_now = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = sequences_.find(id);
      // Dropped, evicted or replaced while we waited for its lock: look again.
      if (it == sequences_.end() || it->second != seq) continue;
      sequences_.erase(it);
      release_now = seq->users_ == 0;
      if (!release_now) seq->doomed_ = true;
    }
    const TierTotals totals = TotalsLocked(*seq);
    if (seq->counted_) AddCommitted(totals, -1);
    seq->counted_ = false;
    if (release_now) ReleaseLayers(*seq);
    return totals.slot_bytes;
  }
}

SequenceStats SequenceStore::StatLocked(Sequence& seq) {
  SequenceStats st;
  st.id = seq.id();
  st.model = seq.model_;
  st.tokens = seq.layers_.empty() ? 0 : seq.layers_[0].tokens();
  for (const LayerCache& l : seq.layers_) st.tokens = std::min(st.tokens, l.tokens());
  if (!seq.layers_.empty()) st.layer0 = seq.layers_[0].counts();
  st.totals = TotalsLocked(seq);
  st.pinned = seq.pinned_;
  {
    std::lock_guard<std::mutex> lock(mu_);
    st.last_access_unix_ms = seq.last_access_ms_;
  }
  return st;
}

SequenceStats SequenceStore::Stat(SequenceHandle& seq) {
  std::lock_guard<std::mutex> lock(seq->mu_);
  return StatLocked(*seq);
}

std::vector<SequenceStats> SequenceStore::List(const std::string& model, const std::string& after,
                                               int limit) {
  std::vector<std::shared_ptr<Sequence>> picked;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = sequences_.upper_bound(after);
         it != sequences_.end() && static_cast<int>(picked.size()) < limit; ++it) {
      if (!model.empty() && it->second->model().name != model) continue;
      picked.push_back(it->second);
    }
  }
  std::vector<SequenceStats> out;
  for (auto& s : picked) {
    std::lock_guard<std::mutex> lock(s->mu_);
    out.push_back(StatLocked(*s));
  }
  return out;
}

StoreStats SequenceStore::Stats() const {
  StoreStats st;
  {
    std::lock_guard<std::mutex> lock(mu_);
    st.committed = committed_;
    st.sequences = static_cast<int64_t>(sequences_.size());
    st.ingesting = static_cast<int64_t>(ingesting_.size());
    st.evictions = evictions_;
    st.demotions = demotions_;
  }
  const int64_t page_slot = pool_->options().page_bytes, block_slot = pool_->options().block_bytes;
  const int free_pages = pool_->free_pages(), free_blocks = pool_->free_blocks();
  st.pool_total_bytes = int64_t(pool_->total_pages()) * page_slot +
                        int64_t(pool_->total_blocks()) * block_slot;
  st.pool_free_bytes = int64_t(free_pages) * page_slot + int64_t(free_blocks) * block_slot;
  st.pool_history_bytes = int64_t(pool_->total_pages() - free_pages) * page_slot;
  st.pool_exact_bytes = int64_t(pool_->total_blocks() - free_blocks) * block_slot;
  return st;
}

int64_t SequenceStore::CountSequencesLocked(const std::string& model) const {
  int64_t n = 0;
  for (const auto& [id, s] : sequences_) n += s->model().name == model;
  return n;
}

int64_t SequenceStore::CountSequences(const std::string& model) const {
  std::lock_guard<std::mutex> lock(mu_);
  return CountSequencesLocked(model);
}

absl::Status SequenceStore::CheckModelUnusedLocked(const std::string& model) const {
  const int64_t stored = CountSequencesLocked(model);
  int64_t ingesting = 0;
  for (const auto& [id, m] : ingesting_) ingesting += m == model;
  if (stored == 0 && ingesting == 0) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "model '", model, "' is in use: ", stored, " stored sequence(s) (drop them first) and ",
      ingesting, " sequence(s) being ingested (PutKv streams not yet ended); its rotation can be "
      "replaced once none remain"));
}

absl::Status SequenceStore::CheckModelUnused(const std::string& model) const {
  std::lock_guard<std::mutex> lock(mu_);
  return CheckModelUnusedLocked(model);
}

absl::Status SequenceStore::RegisterIfModelUnused(
    const std::string& model, const std::function<absl::Status()>& registration) {
  std::lock_guard<std::mutex> lock(mu_);
  OSCARKV_RETURN_IF_ERROR(CheckModelUnusedLocked(model));
  return registration();
}

}  // namespace oscarkv
