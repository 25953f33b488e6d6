// The read side of SequenceStore: attention (with the fused append), copies
// of a layer out in the COMPRESSED or BF16 form, the decode scratch buffers,
// and the registration-time backend probe. See sequence_store.h.
#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/status_macros.h"
#include "server/store/sequence_store.h"

namespace oscarkv {

absl::StatusOr<DeviceBuffer> SequenceStore::TakeScratch(size_t bytes) {
  {
    std::lock_guard<std::mutex> lock(scratch_mu_);
    for (size_t i = 0; i < scratch_.size(); ++i) {
      if (scratch_[i].size() >= bytes) {
        scratch_bytes_ -= scratch_[i].size();
        DeviceBuffer b = std::move(scratch_[i]);
        scratch_.erase(scratch_.begin() + i);
        return b;
      }
    }
  }
  // First use at this size (or more concurrent calls than before): allocate
  // once; the buffer is kept for later calls.
  return backend_->Allocate(bytes);
}

void SequenceStore::ReturnScratch(DeviceBuffer buffer) {
  // Keep at most 64 buffers and 64 MiB for reuse; a larger one is freed.
  constexpr size_t kMaxCachedBytes = size_t{64} << 20;
  std::lock_guard<std::mutex> lock(scratch_mu_);
  if (scratch_.size() < 64 && scratch_bytes_ + buffer.size() <= kMaxCachedBytes) {
    scratch_bytes_ += buffer.size();
    scratch_.push_back(std::move(buffer));
  }
}

absl::Status SequenceStore::Attend(SequenceHandle& seq, int layer, const float* q,
                                   const bf16_bits* k, const bf16_bits* v, int64_t position,
                                   float* out, float* lse, int64_t* tokens) {
  std::vector<AttendTask> tasks(1);
  AttendTask& t = tasks[0];
  t.seq = &seq;
  t.layer = layer;
  t.q = q;
  t.k = k;
  t.v = v;
  t.position = position;
  t.out = out;
  t.lse = lse;
  AttendMany(tasks);
  if (tokens) *tokens = t.tokens;
  return t.status;
}

void SequenceStore::AttendMany(std::vector<AttendTask>& tasks) {
  if (tasks.empty()) return;
  // Lock every distinct sequence once, in address order.
  std::vector<Sequence*> seqs;
  for (const AttendTask& t : tasks) seqs.push_back(&**t.seq);
  std::sort(seqs.begin(), seqs.end());
  seqs.erase(std::unique(seqs.begin(), seqs.end()), seqs.end());
  std::vector<std::unique_lock<std::mutex>> locks;
  for (Sequence* s : seqs) locks.emplace_back(s->mu_);

  // Fused appends in item order (pass 1), then the device references of each item (pass 2).
  struct Refs {
    std::vector<ExactBlockRef> exact;
    const LayerCache* cache = nullptr;  // its page table, as it stands after the appends
  };
  std::vector<Refs> refs(tasks.size());
  // The appends' small row copies go to the device together (one driver
  // call on the GPU), before any attention. (The guard ends the batch on an
  // exception too.)
  struct CopyBatch {
    Backend& backend;
    bool open = true;
    explicit CopyBatch(Backend& b) : backend(b) { backend.BeginCopyBatch(); }
    absl::Status End() {
      open = false;
      return backend.EndCopyBatch();
    }
    ~CopyBatch() {
      if (open) (void)backend.EndCopyBatch();
    }
  } copy_batch(*backend_);
  std::vector<size_t> appended;
  for (size_t i = 0; i < tasks.size(); ++i) {
    AttendTask& t = tasks[i];
    Sequence& seq = **t.seq;
    const ModelEntry& m = seq.model();
    t.status = [&]() -> absl::Status {
      OSCARKV_RETURN_IF_ERROR(m.CheckLayer(t.layer));
      // Before any append: a bad query must leave the sequence unchanged (the
      // backends check it again, too late for that).
      OSCARKV_RETURN_IF_ERROR(
          ValidateQuery(t.q, size_t(m.layout.num_q_heads) * m.layout.head_dim));
      LayerCache& cache = seq.layers_[t.layer];
      if ((t.k == nullptr) != (t.v == nullptr)) {
        return absl::InvalidArgumentError("fused append needs both k and v");
      }
      if (t.k != nullptr) {
        if (t.position >= 0 && t.position != cache.tokens()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "append position ", t.position, " but layer ", t.layer, " holds ", cache.tokens(),
              " tokens (tokens must be contiguous and in order)"));
        }
        const size_t bytes = m.geom.exact_row_elems() * sizeof(bf16_bits);
        OSCARKV_RETURN_IF_ERROR(
            AppendLocked(seq, t.layer, cache.tokens(), 1, t.k, bytes, t.v, bytes));
        appended.push_back(i);
      }
      return absl::OkStatus();
    }();
  }
  if (const absl::Status s = copy_batch.End(); !s.ok()) {
    // Rows the appends counted may be missing on the device.
    for (size_t i : appended) {
      tasks[i].status = absl::InternalError(
          absl::StrCat("backend failed while appending to layer: ", s.message()));
      (*tasks[i].seq)->broken_ = true;
    }
  }
  // Device references only once every append is done: a later append in this
  // batch can demote (and free) a recent block an earlier item would point at.
  // As the API says, all appends happen in item order before any attention.
  for (size_t i = 0; i < tasks.size(); ++i) {
    AttendTask& t = tasks[i];
    if (!t.status.ok()) continue;
    Sequence& seq = **t.seq;
    const ModelEntry& m = seq.model();
    t.status = [&]() -> absl::Status {
      OSCARKV_RETURN_IF_ERROR(seq.Usable());
      const LayerCache& cache = seq.layers_[t.layer];
      cache.ExactRefs(*pool_, &refs[i].exact);
      refs[i].cache = &cache;
      t.tokens = cache.tokens();
      return absl::OkStatus();
    }();
  }
  // One backend batch per model, over the items still OK. The queries and
  // outputs are the tasks' own host buffers: the backend moves them (for the
  // GPU, with the rest of the call's one upload).
  std::vector<const ModelEntry*> models;
  for (const AttendTask& t : tasks) models.push_back(&(*t.seq)->model());
  std::vector<const ModelEntry*> distinct = models;
  std::sort(distinct.begin(), distinct.end());
  distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
  for (const ModelEntry* m : distinct) {
    std::vector<AttendItem> items;
    std::vector<size_t> which;
    for (size_t i = 0; i < tasks.size(); ++i) {
      if (models[i] != m || !tasks[i].status.ok()) continue;
      AttendItem item;
      item.q = tasks[i].q;
      item.out = tasks[i].out;
      item.lse = tasks[i].lse;
      item.rotation = m->codecs[tasks[i].layer].rotation;
      item.exact = refs[i].exact.data();
      item.num_exact = static_cast<int>(refs[i].exact.size());
      const std::vector<const uint8_t*>& pages = refs[i].cache->page_pointers();
      item.pages = pages.data();
      item.num_pages = static_cast<int>(pages.size());
      item.page_table_id = refs[i].cache->page_table_id();
      items.push_back(item);
      which.push_back(i);
    }
    if (items.empty()) continue;
    AttendBatch batch;
    batch.geom = m->geom;
    batch.num_q_heads = m->layout.num_q_heads;
    batch.scale = 1.0f / std::sqrt(static_cast<float>(m->layout.head_dim));
    batch.items = items.data();
    batch.num_items = static_cast<int>(items.size());
    const absl::Status s = backend_->Attend(batch);
    for (size_t i : which) tasks[i].status = s;
  }
}

absl::Status SequenceStore::ReadCompressed(SequenceHandle& seq, int layer, CompressedLayer* out) {
  const ModelEntry& m = seq->model();
  OSCARKV_RETURN_IF_ERROR(m.CheckLayer(layer));
  std::lock_guard<std::mutex> lock(seq->mu_);
  OSCARKV_RETURN_IF_ERROR(seq->Usable());
  const LayerCache& cache = seq->layers_[layer];
  const size_t row = m.geom.exact_row_elems();
  out->tokens = cache.tokens();
  out->counts = cache.counts();
  out->sink_k.resize(size_t(out->counts.sink) * row);
  out->sink_v.resize(size_t(out->counts.sink) * row);
  out->recent_k.resize(size_t(out->counts.recent) * row);
  out->recent_v.resize(size_t(out->counts.recent) * row);
  OSCARKV_RETURN_IF_ERROR(cache.CopyExactTier(LayerCache::ExactTier::kSink, *pool_, *backend_,
                                              out->sink_k.data(), out->sink_v.data()));
  OSCARKV_RETURN_IF_ERROR(cache.CopyExactTier(LayerCache::ExactTier::kRecent, *pool_, *backend_,
                                              out->recent_k.data(), out->recent_v.data()));
  const size_t page_bytes = m.geom.page_bytes();
  out->pages.resize(cache.history_pages().size() * page_bytes);
  for (size_t i = 0; i < cache.history_pages().size(); ++i) {
    OSCARKV_RETURN_IF_ERROR(backend_->CopyToHost(
        out->pages.data() + i * page_bytes, pool_->page(cache.history_pages()[i]), page_bytes));
  }
  return absl::OkStatus();
}

absl::Status SequenceStore::ReadBf16(SequenceHandle& seq, int layer, std::vector<bf16_bits>* k,
                                     std::vector<bf16_bits>* v, int64_t* tokens) {
  const ModelEntry& m = seq->model();
  OSCARKV_RETURN_IF_ERROR(m.CheckLayer(layer));
  std::lock_guard<std::mutex> lock(seq->mu_);
  OSCARKV_RETURN_IF_ERROR(seq->Usable());
  const LayerCache& cache = seq->layers_[layer];
  // Decode scratch from the scratch cache, not the pool: a read must neither
  // evict another sequence nor fail because the pool is full.
  OSCARKV_ASSIGN_OR_RETURN(DeviceBuffer scratch, TakeScratch(m.geom.exact_block_bytes()));
  const size_t elems = size_t(cache.tokens()) * m.geom.exact_row_elems();
  k->resize(elems);
  v->resize(elems);
  *tokens = cache.tokens();
  absl::Status s = cache.ReadBf16(m.codecs[layer], *pool_, *backend_, scratch.as<bf16_bits>(),
                                  k->data(), v->data());
  ReturnScratch(std::move(scratch));
  return s;
}

absl::Status SequenceStore::ProbeModel(const ModelEntry& m) {
  if (m.geom.page_bytes() > pool_->options().page_bytes ||
      m.geom.exact_block_bytes() > pool_->options().block_bytes) {
    return absl::FailedPreconditionError(absl::StrCat(
        "model '", m.name, "' needs ", m.geom.page_bytes(), "-byte pages and ",
        m.geom.exact_block_bytes(), "-byte blocks; this server's pool slots are ",
        pool_->options().page_bytes, " and ", pool_->options().block_bytes,
        " (register the model at start with --model to size the pool for it)"));
  }
  OSCARKV_ASSIGN_OR_RETURN(Reservation res, ReserveWithEviction(1, 1));
  const SlotId block = res.TakeBlock();
  const SlotId page = res.TakePage();
  absl::Status status = [&]() -> absl::Status {
    // A block of small finite values, encoded into the page.
    std::vector<bf16_bits> host(m.geom.exact_block_bytes() / sizeof(bf16_bits));
    for (size_t i = 0; i < host.size(); ++i) host[i] = FloatToBf16(float(int(i % 7) - 3) / 8.0f);
    OSCARKV_RETURN_IF_ERROR(
        backend_->CopyToDevice(pool_->block(block), host.data(), host.size() * sizeof(bf16_bits)));
    EncodeJob job;
    job.src_block = pool_->block(block);
    job.dst_page = pool_->page(page);
    job.rotation = m.codecs[0].rotation;
    job.clip_k = m.codecs[0].clip_k;
    job.clip_v = m.codecs[0].clip_v;
    OSCARKV_RETURN_IF_ERROR(backend_->EncodePages(m.geom, &job, 1));
    const size_t q_floats = size_t(m.layout.num_q_heads) * m.layout.head_dim;
    std::vector<float> q(q_floats, 0.01f), out(q_floats), lse(m.layout.num_q_heads);
    ExactBlockRef exact{pool_->block(block), 1};
    const uint8_t* pages[1] = {pool_->page(page)};
    AttendItem item;
    item.q = q.data();
    item.out = out.data();
    item.lse = lse.data();
    item.rotation = m.codecs[0].rotation;
    item.exact = &exact;
    item.num_exact = 1;
    item.pages = pages;
    item.num_pages = 1;
    AttendBatch batch;
    batch.geom = m.geom;
    batch.num_q_heads = m.layout.num_q_heads;
    batch.scale = 1.0f / std::sqrt(float(m.layout.head_dim));
    batch.items = &item;
    batch.num_items = 1;
    return backend_->Attend(batch);
  }();
  res.ReturnBlock(block);
  pool_->FreePages(&page, 1);
  if (!status.ok()) {
    return absl::Status(status.code(), absl::StrCat("backend ", backend_->name(),
                                                    " cannot serve model '", m.name,
                                                    "': ", status.message()));
  }
  return absl::OkStatus();
}

}  // namespace oscarkv
