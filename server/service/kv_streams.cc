// PutKv (client streaming ingest) and GetKv (server streaming read) reactors.
#include <algorithm>
#include <chrono>
#include <memory>

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
// half-closes. Any error, a cancellation or a disconnect destroys the
// IngestSession, which frees everything the stream had stored.
class PutKvReactor final : public grpc::ServerReadReactor<v1::PutKvRequest> {
 public:
  PutKvReactor(const KvCacheService* svc, grpc::CallbackServerContext* ctx,
               v1::PutKvResponse* response)
      : svc_(svc), ctx_(ctx), response_(response), start_(Clock::now()) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
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
      StartRead(&request_);
    });
  }

  void OnDone() override { delete this; }

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

  void Done(const absl::Status& status) {
    session_.reset();  // uncommitted: frees every slot of the stream now
    svc_->Record("PutKv", start_, status.code());
    Finish(ToGrpcStatus(status));
  }

  const KvCacheService* svc_;
  grpc::CallbackServerContext* ctx_;
  v1::PutKvResponse* response_;
  const Clock::time_point start_;
  v1::PutKvRequest request_;
  std::unique_ptr<IngestSession> session_;
  int64_t bytes_in_ = 0;
};

// Writes the header, then each requested layer: COMPRESSED as sink, history
// pages, recent; BF16 as token ranges. Each layer is copied out under the
// sequence's lock once, then streamed, so a concurrent append never tears a
// layer; the handle keeps the sequence from being evicted meanwhile.
class GetKvReactor final : public grpc::ServerWriteReactor<v1::GetKvResponse> {
 public:
  GetKvReactor(const KvCacheService* svc, grpc::CallbackServerContext* ctx,
               const v1::GetKvRequest* request)
      : svc_(svc), start_(Clock::now()), request_(*request) {
    const absl::Status status = Init();
    if (!status.ok()) {
      Done(status);
      return;
    }
    WriteNext();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Done(absl::CancelledError("GetKv client went away"));
      return;
    }
    WriteNext();
  }

  void OnDone() override { delete this; }

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
      StartWrite(&message_);
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
      StartWrite(&message_);
    }
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
  const Clock::time_point start_;
  const v1::GetKvRequest request_;
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
