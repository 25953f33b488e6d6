// PutKv (client streaming ingest) and GetKv (server streaming read) reactors.
#include <algorithm>
#include <chrono>
#include <memory>
#include <mutex>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"
#include "server/service/convert.h"
#include "server/service/kv_service.h"

namespace oscarkv {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int64_t kDefaultChunkBytes = 1 << 20;
constexpr int64_t kMessageHeadroom = 64 << 10;  // protobuf framing and small fields

// One token of one layer, K and V in BF16.
int64_t TokenBytes(const ModelEntry& m) { return int64_t(m.geom.exact_row_elems()) * 2 * 2; }
// A layer's rotation as GetKv sends it (R_K and R_V, fp32).
int64_t RotationBytes(const ModelEntry& m, int layer) {
  const LayerRotation& r = m.rotation.layers[layer];
  return int64_t(r.r_k.size() + r.r_v.size()) * int64_t(sizeof(float));
}

// Reads a header, then chunks; commits the sequence when the client
// half-closes. Any error, a cancellation, a disconnect or a client idle past
// the server's limit destroys the IngestSession, which frees everything the
// stream had stored.
//
// Phases: a read is pending (waiting on the client: the watchdog may end the
// stream), or a message is being handled on the executor (it alone touches
// session_ then). mu_ orders the watchdog against the reactor's own Done.
class PutKvReactor final : public grpc::ServerReadReactor<v1::PutKvRequest>,
                           public StallableStream {
 public:
  PutKvReactor(const KvCacheService* svc, grpc::CallbackServerContext* ctx,
               v1::PutKvResponse* response)
      : svc_(svc), ctx_(ctx), response_(response), start_(Clock::now()) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ReadNextLocked();
    }
    svc_->stream_watchdog().Add(this);
  }

  void OnReadDone(bool ok) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      reading_ = false;
      if (finished_) return;  // ended as idle meanwhile: nothing more to do
    }
    if (!ok) {
      RunOn(svc_->context().executor, [this] { EndOfStream(); });
      return;
    }
    // No read is pending while the chunk is encoded, so the reactor cannot
    // finish under the task; a cancellation shows at the next read.
    RunOn(svc_->context().executor, [this] {
      const absl::Status status = HandleMessage();
      if (!status.ok()) {
        Done(status);
        return;
      }
      std::lock_guard<std::mutex> lock(mu_);
      ReadNextLocked();
    });
  }

  void OnDone() override {
    svc_->stream_watchdog().Remove(this);
    delete this;
  }

  void CancelIfIdle(Clock::time_point now, std::chrono::milliseconds limit) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (finished_ || !reading_ || now - read_since_ < limit) return;
    const auto idle = std::chrono::duration_cast<std::chrono::milliseconds>(now - read_since_);
    // The pending read then completes with !ok and OnReadDone does nothing;
    // until then (it takes mu_) the reactor cannot be destroyed.
    Finish(EndLocked(absl::AbortedError(absl::StrCat(
        "PutKv stream idle for ", idle.count(), " ms (no message; this server's "
        "--stream_idle_timeout_ms is ", limit.count(), "); nothing was stored"))));
  }

 private:
  absl::Status HandleMessage() {
    const ServiceContext& c = svc_->context();
    if (session_ == nullptr) {
      if (!request_.has_header()) {
        return absl::InvalidArgumentError("the first PutKv message must be a header");
      }
      const v1::PutKvHeader& h = request_.header();
      OSCARKV_ASSIGN_OR_RETURN(session_, c.store->BeginIngest(h.sequence_id(), h.model(),
                                                              h.pin(), h.expected_tokens()));
      return absl::OkStatus();
    }
    if (!request_.has_chunk()) {
      return absl::InvalidArgumentError(
          request_.has_header() ? "PutKv got a second header; only the first message is one"
                                : "PutKv message has neither header nor chunk");
    }
    const v1::KvChunk& k = request_.chunk();
    const int64_t bytes = int64_t(k.k().size() + k.v().size());
    bytes_in_ += bytes;
    if (c.metrics) c.metrics->AddIngestBytesIn(bytes);
    return session_->Append(k.layer(), k.start_token(), k.num_tokens(), k.k().data(),
                            k.k().size(), k.v().data(), k.v().size());
  }

  void EndOfStream() {
    if (ctx_->IsCancelled()) {
      Done(absl::CancelledError("PutKv was cancelled; nothing was stored"));
      return;
    }
    if (session_ == nullptr) {
      Done(absl::InvalidArgumentError("PutKv stream ended without a header (empty stream)"));
      return;
    }
    absl::StatusOr<SequenceStats> stats = session_->Commit();
    if (!stats.ok()) {
      Done(stats.status());
      return;
    }
    response_->set_tokens(stats->tokens);
    response_->set_bf16_bytes_received(bytes_in_);
    response_->set_stored_bytes(stats->totals.slot_bytes);
    response_->set_effective_bits(stats->totals.effective_bits());
    if (svc_->context().metrics) svc_->context().metrics->AddIngestBytesStored(stats->totals.slot_bytes);
    Done(absl::OkStatus());
  }

  void ReadNextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    reading_ = true;
    read_since_ = Clock::now();
    StartRead(&request_);
  }

  // Runs once, from the stream's own end (on a thread that has no read
  // pending), never with CancelIfIdle's ending.
  void Done(const absl::Status& status) {
    grpc::Status end;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finished_) return;
      end = EndLocked(status);
    }
    // Outside mu_: once finished, OnDone may destroy the reactor (and mu_).
    Finish(std::move(end));
  }

  // Marks the stream finished, frees its ingest and records `status`; the
  // caller then finishes the call with the returned status.
  grpc::Status EndLocked(const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    finished_ = true;
    session_.reset();  // uncommitted: frees every slot of the stream now
    svc_->Record("PutKv", start_, status.code());
    return ToGrpcStatus(status);
  }

  const KvCacheService* svc_;
  grpc::CallbackServerContext* ctx_;
  v1::PutKvResponse* response_;
  const Clock::time_point start_;
  v1::PutKvRequest request_;
  // Touched by the handling phase without mu_, and by EndLocked only when
  // no message is being handled (a read pending, or from the handling task).
  std::unique_ptr<IngestSession> session_;
  int64_t bytes_in_ = 0;
  std::mutex mu_;
  bool reading_ ABSL_GUARDED_BY(mu_) = false;  // a read is pending
  Clock::time_point read_since_ ABSL_GUARDED_BY(mu_);
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

// Writes the header, then each requested layer: COMPRESSED as sink, history
// pages, recent; BF16 as token ranges. Each layer is copied out under the
// sequence's lock once, then streamed, so a concurrent append never tears a
// layer; the handle keeps the sequence from being evicted meanwhile.
//
// A write the client does not take (it stopped reading, and flow control
// holds the rest) for the server's idle limit cancels the call: the pending
// write then fails and the reactor lets go of the sequence. (A status cannot
// reach a client that does not read; the call ends CANCELLED for it, and
// ABORTED saying why in the server's metrics.)
class GetKvReactor final : public grpc::ServerWriteReactor<v1::GetKvResponse>,
                           public StallableStream {
 public:
  GetKvReactor(const KvCacheService* svc, grpc::CallbackServerContext* ctx,
               const v1::GetKvRequest* request)
      : svc_(svc), ctx_(ctx), start_(Clock::now()), request_(*request) {
    const absl::Status status = Init();
    if (!status.ok()) {
      Done(status);
      return;
    }
    svc_->stream_watchdog().Add(this);
    WriteNext();
  }

  void OnWriteDone(bool ok) override {
    std::chrono::milliseconds idle{0};
    {
      std::lock_guard<std::mutex> lock(mu_);
      writing_ = false;
      idle = idle_cancelled_after_;
    }
    if (!ok) {
      Done(idle.count() > 0
               ? absl::AbortedError(absl::StrCat(
                     "GetKv client took no message for ", idle.count(),
                     " ms (this server's --stream_idle_timeout_ms is ",
                     svc_->stream_watchdog().limit().count(), "); the call was cancelled"))
               : absl::CancelledError("GetKv client went away"));
      return;
    }
    WriteNext();
  }

  void OnDone() override {
    svc_->stream_watchdog().Remove(this);  // also when Init failed before Add
    delete this;
  }

  void CancelIfIdle(Clock::time_point now, std::chrono::milliseconds limit) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!writing_ || idle_cancelled_after_.count() > 0 || now - write_since_ < limit) return;
    idle_cancelled_after_ =
        std::chrono::duration_cast<std::chrono::milliseconds>(now - write_since_);
    // Finish could not get past the untaken write; cancelling fails it.
    ctx_->TryCancel();
  }

 private:
  absl::Status Init() {
    const ServiceContext& c = svc_->context();
    OSCARKV_ASSIGN_OR_RETURN(seq_, c.store->Acquire(request_.sequence_id()));
    const ModelEntry& m = seq_->model();
    bf16_ = request_.format() == v1::KV_FORMAT_BF16;
    if (!v1::KvFormat_IsValid(request_.format())) {
      return absl::InvalidArgumentError(absl::StrCat("unknown format ", request_.format()));
    }
    std::vector<bool> seen(m.layout.num_layers, false);
    for (int l : request_.layers()) {
      OSCARKV_RETURN_IF_ERROR(m.CheckLayer(l));
      if (seen[l]) {
        return absl::InvalidArgumentError(absl::StrCat("layer ", l, " is listed twice"));
      }
      seen[l] = true;
      layers_.push_back(l);
    }
    if (layers_.empty()) {
      for (int l = 0; l < m.layout.num_layers; ++l) layers_.push_back(l);
    }
    if (request_.max_chunk_bytes() < 0) {
      return absl::InvalidArgumentError("max_chunk_bytes must be >= 0");
    }
    chunk_bytes_ = request_.max_chunk_bytes() > 0 ? request_.max_chunk_bytes() : kDefaultChunkBytes;
    chunk_bytes_ = std::min(chunk_bytes_, std::max<int64_t>(c.max_message_bytes - kMessageHeadroom,
                                                            int64_t{1} << 16));
    // Every message carries at least one token row or one page, and a
    // layer's first COMPRESSED message its rotation: refuse up front what can
    // never fit, rather than end the stream midway.
    const int64_t unit = bf16_ ? TokenBytes(m) : std::max(TokenBytes(m), int64_t(m.geom.page_bytes()));
    int64_t rotation = 0;
    if (!bf16_ && request_.include_rotation()) {
      for (int l : layers_) rotation = std::max(rotation, RotationBytes(m, l));
    }
    if (unit + rotation + kMessageHeadroom > c.max_message_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "a GetKv message of this model needs ", unit + rotation + kMessageHeadroom,
          " bytes (", rotation, " of rotation, ", unit,
          " of one token row or page, and headroom); this server's message limit is ",
          c.max_message_bytes,
          rotation > 0 ? " (fetch without include_rotation and take the model's rotation "
                         "from its calibration file)"
                       : ""));
    }
    ToProto(c.store->Stat(seq_), message_.mutable_header());
    header_pending_ = true;
    return absl::OkStatus();
  }

  void WriteNext() {
    if (header_pending_) {
      header_pending_ = false;
      WriteMessage();
      return;
    }
    message_.Clear();
    bool done = false;
    const absl::Status status = Produce(&done);
    if (!status.ok()) {
      Done(status);
    } else if (done) {
      Done(absl::OkStatus());
    } else {
      WriteMessage();
    }
  }

  void WriteMessage() {
    std::lock_guard<std::mutex> lock(mu_);
    writing_ = true;
    write_since_ = Clock::now();
    StartWrite(&message_);
  }

  // Fills message_ with the next piece, or sets *done.
  absl::Status Produce(bool* done) {
    const ServiceContext& c = svc_->context();
    const ModelEntry& m = seq_->model();
    const size_t row = m.geom.exact_row_elems();
    for (;;) {
      if (layer_index_ >= layers_.size()) {
        *done = true;
        return absl::OkStatus();
      }
      const int layer = layers_[layer_index_];
      if (!loaded_) {
        if (bf16_) {
          OSCARKV_RETURN_IF_ERROR(c.store->ReadBf16(seq_, layer, &bf16_k_, &bf16_v_, &tokens_));
        } else {
          OSCARKV_RETURN_IF_ERROR(c.store->ReadCompressed(seq_, layer, &compressed_));
        }
        loaded_ = true;
        phase_ = 0;
        offset_ = 0;
        first_of_layer_ = true;
      }
      if (bf16_) {
        if (offset_ < tokens_) {
          const int64_t tokens_per_chunk = std::max<int64_t>(1, chunk_bytes_ / TokenBytes(m));
          const int64_t n = std::min(tokens_per_chunk, tokens_ - offset_);
          v1::KvChunk* out = message_.mutable_bf16();
          out->set_layer(layer);
          out->set_start_token(offset_);
          out->set_num_tokens(static_cast<int32_t>(n));
          out->set_k(reinterpret_cast<const char*>(bf16_k_.data() + offset_ * row), n * row * 2);
          out->set_v(reinterpret_cast<const char*>(bf16_v_.data() + offset_ * row), n * row * 2);
          offset_ += n;
          return absl::OkStatus();
        }
      } else if (ProduceCompressed(layer)) {
        return absl::OkStatus();
      }
      ++layer_index_;
      loaded_ = false;
    }
  }

  // Emits the next compressed piece of `layer`; false when the layer is done.
  // The layer's first piece carries its rotation (include_rotation), whose
  // bytes come out of that message's budget.
  bool ProduceCompressed(int layer) {
    const ModelEntry& m = seq_->model();
    const CompressedLayer& cl = compressed_;
    const size_t row = m.geom.exact_row_elems();
    const int64_t budget =
        chunk_bytes_ - (first_of_layer_ && request_.include_rotation() ? RotationBytes(m, layer) : 0);
    const int64_t tokens_per_chunk = std::max<int64_t>(1, budget / TokenBytes(m));
    const int p = m.geom.page_tokens;
    auto exact = [&](v1::Tier tier, int64_t base, int64_t total, const std::vector<bf16_bits>& k,
                     const std::vector<bf16_bits>& v) {
      const int64_t n = std::min(tokens_per_chunk, total - offset_);
      v1::CompressedChunk* out = Begin(layer, tier, base + offset_, n);
      out->set_k(reinterpret_cast<const char*>(k.data() + offset_ * row), n * row * 2);
      out->set_v(reinterpret_cast<const char*>(v.data() + offset_ * row), n * row * 2);
      offset_ += n;
    };
    for (;;) {
      if (phase_ == 0) {
        if (offset_ < cl.counts.sink) {
          exact(v1::TIER_SINK, 0, cl.counts.sink, cl.sink_k, cl.sink_v);
          return true;
        }
      } else if (phase_ == 1) {
        if (offset_ < cl.counts.pages) {
          const int64_t page_bytes = int64_t(m.geom.page_bytes());
          const int64_t pages_per_chunk = std::max<int64_t>(1, budget / page_bytes);
          const int64_t n = std::min(pages_per_chunk, cl.counts.pages - offset_);
          v1::CompressedChunk* out =
              Begin(layer, v1::TIER_HISTORY, cl.counts.sink + offset_ * p, n * p);
          out->set_pages(reinterpret_cast<const char*>(cl.pages.data() + offset_ * page_bytes),
                         n * page_bytes);
          offset_ += n;
          return true;
        }
      } else if (phase_ == 2) {
        if (offset_ < cl.counts.recent) {
          exact(v1::TIER_RECENT, cl.counts.sink + cl.counts.history, cl.counts.recent,
                cl.recent_k, cl.recent_v);
          return true;
        }
      } else {
        return false;
      }
      ++phase_;
      offset_ = 0;
    }
  }

  v1::CompressedChunk* Begin(int layer, v1::Tier tier, int64_t start, int64_t n) {
    v1::CompressedChunk* out = message_.mutable_compressed();
    out->set_layer(layer);
    out->set_tier(tier);
    out->set_start_token(start);
    out->set_num_tokens(static_cast<int32_t>(n));
    if (first_of_layer_ && request_.include_rotation()) {
      const LayerRotation& r = seq_->model().rotation.layers[layer];
      v1::LayerRotation* pr = out->mutable_rotation();
      pr->set_num_matrices(r.num_matrices);
      pr->set_r_k(reinterpret_cast<const char*>(r.r_k.data()), r.r_k.size() * sizeof(float));
      pr->set_r_v(reinterpret_cast<const char*>(r.r_v.data()), r.r_v.size() * sizeof(float));
      pr->set_clip_k(r.clip_k);
      pr->set_clip_v(r.clip_v);
    }
    first_of_layer_ = false;
    return out;
  }

  void Done(const absl::Status& status) {
    svc_->Record("GetKv", start_, status.code());
    Finish(ToGrpcStatus(status));
  }

  const KvCacheService* svc_;
  grpc::CallbackServerContext* ctx_;
  const Clock::time_point start_;
  const v1::GetKvRequest request_;
  std::mutex mu_;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;  // a write is pending
  Clock::time_point write_since_ ABSL_GUARDED_BY(mu_);
  // Set when the watchdog cancelled the call: how long the write had waited.
  std::chrono::milliseconds idle_cancelled_after_ ABSL_GUARDED_BY(mu_){0};
  SequenceHandle seq_;
  bool bf16_ = false;
  std::vector<int> layers_;
  int64_t chunk_bytes_ = kDefaultChunkBytes;
  v1::GetKvResponse message_;
  bool header_pending_ = false;
  size_t layer_index_ = 0;
  bool loaded_ = false;
  bool first_of_layer_ = false;
  int phase_ = 0;
  int64_t offset_ = 0;
  int64_t tokens_ = 0;
  std::vector<bf16_bits> bf16_k_, bf16_v_;
  CompressedLayer compressed_;
};

}  // namespace

grpc::ServerReadReactor<v1::PutKvRequest>* NewPutKvReactor(const KvCacheService* service,
                                                           grpc::CallbackServerContext* context,
                                                           v1::PutKvResponse* response) {
  return new PutKvReactor(service, context, response);
}

grpc::ServerWriteReactor<v1::GetKvResponse>* NewGetKvReactor(const KvCacheService* service,
                                                             grpc::CallbackServerContext* context,
                                                             const v1::GetKvRequest* request) {
  return new GetKvReactor(service, context, request);
}

}  // namespace oscarkv
