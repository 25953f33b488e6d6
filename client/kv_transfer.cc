// The streaming calls of KvClient: PutKv, GetKv and Attend.
#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "client/kv_chunk.h"
#include "client/kv_client.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/status_macros.h"

namespace oscarkv {
namespace {

template <typename T>
void AppendBytes(const std::string& bytes, std::vector<T>* out) {
  const size_t n = bytes.size() / sizeof(T);
  if (n == 0) return;
  const size_t old = out->size();
  out->resize(old + n);
  std::memcpy(out->data() + old, bytes.data(), n * sizeof(T));
}

absl::Status Inconsistent(int layer, const std::string& what) {
  return absl::DataLossError(absl::StrCat("fetched sequence: layer ", layer, ": ", what));
}

}  // namespace

absl::Status CheckFetchedSequence(const FetchedSequence& f, const std::vector<int>& layers) {
  const ModelLayout layout{f.info.layout().num_layers(), f.info.layout().num_q_heads(),
                           f.info.layout().num_kv_heads(), f.info.layout().head_dim()};
  if (!ValidateLayout(layout).ok() || f.layers.size() != size_t(layout.num_layers) ||
      f.present.size() != f.layers.size()) {
    return absl::DataLossError("fetched sequence: no valid header (model layout)");
  }
  for (int l : layers) {
    if (l < 0 || l >= layout.num_layers || !f.present[l]) return Inconsistent(l, "missing");
  }
  if (layers.empty()) {
    for (int l = 0; l < layout.num_layers; ++l) {
      if (!f.present[l]) return Inconsistent(l, "missing");
    }
  }
  const int64_t row = layout.kv_row_elems(), d = layout.head_dim;
  const TierConfig tiers{f.info.tiers().sink_tokens(), f.info.tiers().recent_window(),
                         f.info.tiers().page_tokens()};
  const PageGeometry geom = MakeGeometry(layout, tiers, f.info.tiers().group_size());
  if (f.format == v1::KV_FORMAT_COMPRESSED && !ValidateGeometry(geom).ok()) {
    return absl::DataLossError("fetched sequence: no valid header (tiers)");
  }
  for (int l = 0; l < layout.num_layers; ++l) {
    if (!f.present[l]) continue;
    const FetchedLayer& fl = f.layers[l];
    if (f.format == v1::KV_FORMAT_BF16) {
      if (fl.tokens < 0 || int64_t(fl.k.size()) != fl.tokens * row || fl.v.size() != fl.k.size()) {
        return Inconsistent(l, absl::StrCat(fl.k.size(), " K and ", fl.v.size(),
                                            " V elements for ", fl.tokens, " tokens"));
      }
      continue;
    }
    const int p = geom.page_tokens;
    if (fl.sink_tokens < 0 || fl.recent_tokens < 0 || fl.history_tokens < 0 ||
        fl.history_tokens % p != 0 || int64_t(fl.sink_k.size()) != fl.sink_tokens * row ||
        fl.sink_v.size() != fl.sink_k.size() ||
        int64_t(fl.recent_k.size()) != fl.recent_tokens * row ||
        fl.recent_v.size() != fl.recent_k.size() ||
        int64_t(fl.pages.size()) != fl.history_tokens / p * int64_t(geom.page_bytes())) {
      return Inconsistent(l, absl::StrCat("tiers of ", fl.sink_tokens, " + ", fl.history_tokens,
                                          " + ", fl.recent_tokens,
                                          " tokens do not match their bytes"));
    }
    if (fl.num_matrices != 0) {
      if (fl.num_matrices != 1 && fl.num_matrices != layout.num_kv_heads) {
        return Inconsistent(l, absl::StrCat(fl.num_matrices, " rotation matrices for ",
                                            layout.num_kv_heads,
                                            " kv heads (expected 1 or one per kv head)"));
      }
      const size_t floats = size_t(fl.num_matrices) * d * d;
      if (fl.r_k.size() != floats || fl.r_v.size() != floats) {
        return Inconsistent(l, absl::StrCat("rotation has ", fl.r_k.size(), " and ", fl.r_v.size(),
                                            " floats; expected ", floats));
      }
    }
  }
  return absl::OkStatus();
}

PutStream::~PutStream() {
  if (!done_) Cancel();
}

void PutStream::Cancel() {
  if (done_) return;
  done_ = true;
  context_->TryCancel();
  writer_->Finish();  // returns CANCELLED; the server discards the stream
}

absl::Status PutStream::Write(int layer, int64_t start_token, int64_t n, const bf16_bits* k,
                              const bf16_bits* v) {
  if (done_) return absl::FailedPreconditionError("PutStream already finished");
  v1::PutKvRequest req;
  OSCARKV_ASSIGN_OR_RETURN(const size_t bytes,
                           FillKvChunk(layout_, layer, start_token, n, k, v, req.mutable_chunk()));
  if (!writer_->Write(req)) {
    // The server ended the stream (an error status is waiting in Finish()).
    done_ = true;
    return FromGrpcStatus(writer_->Finish());
  }
  bytes_sent_ += int64_t(2 * bytes);
  return absl::OkStatus();
}

absl::StatusOr<PutResult> PutStream::Finish() {
  if (done_) return absl::FailedPreconditionError("PutStream already finished");
  done_ = true;
  writer_->WritesDone();
  OSCARKV_RETURN_IF_ERROR(FromGrpcStatus(writer_->Finish()));
  PutResult r;
  r.tokens = response_->tokens();
  r.bf16_bytes_sent = bytes_sent_;
  r.stored_bytes = response_->stored_bytes();
  r.effective_bits = response_->effective_bits();
  return r;
}

absl::StatusOr<std::unique_ptr<PutStream>> KvClient::OpenPut(const std::string& sequence_id,
                                                              const std::string& model,
                                                              const ModelLayout& layout, bool pin,
                                                              int64_t expected_tokens) {
  v1::PutKvRequest header;
  header.mutable_header()->set_sequence_id(sequence_id);
  header.mutable_header()->set_model(model);
  header.mutable_header()->set_pin(pin);
  header.mutable_header()->set_expected_tokens(expected_tokens);
  // The stream's deadline covers the attempts to open it too.
  const Clock::time_point deadline = CallDeadline();
  auto backoff = options_.backoff;
  for (int attempt = 1;; ++attempt) {
    std::unique_ptr<PutStream> s(new PutStream());
    s->context_ = NewContext(deadline);
    s->response_ = std::make_unique<v1::PutKvResponse>();
    s->layout_ = layout;
    s->writer_ = stub_->PutKv(s->context_.get(), s->response_.get());
    if (s->writer_->Write(header)) return s;
    // The header could not be sent: nothing reached the server.
    s->done_ = true;
    const grpc::Status status = s->writer_->Finish();
    if (status.error_code() != grpc::StatusCode::UNAVAILABLE ||
        !BackOff(attempt, deadline, &backoff)) {
      return FromGrpcStatus(status);
    }
  }
}

absl::StatusOr<PutResult> KvClient::PutSequence(const std::string& sequence_id,
                                                const std::string& model,
                                                const ModelLayout& layout, int64_t tokens,
                                                const bf16_bits* k, const bf16_bits* v, bool pin,
                                                const ProgressFn& progress) {
  if (tokens <= 0) return absl::InvalidArgumentError("PutSequence needs at least one token");
  OSCARKV_ASSIGN_OR_RETURN(std::unique_ptr<PutStream> stream,
                           OpenPut(sequence_id, model, layout, pin, tokens));
  const size_t row = layout.kv_row_elems();
  const int64_t token_bytes = int64_t(row) * 2 * 2;
  const int64_t per_chunk = std::max<int64_t>(1, PutChunkBytes() / token_bytes);
  const int64_t total = int64_t(layout.num_layers) * tokens * token_bytes;
  int64_t done = 0;
  for (int l = 0; l < layout.num_layers; ++l) {
    const size_t base = size_t(l) * tokens * row;
    for (int64_t t = 0; t < tokens; t += per_chunk) {
      const int64_t n = std::min(per_chunk, tokens - t);
      OSCARKV_RETURN_IF_ERROR(stream->Write(l, t, n, k + base + t * row, v + base + t * row));
      done += n * token_bytes;
      if (progress) progress(done, total);
    }
  }
  return stream->Finish();
}

absl::StatusOr<FetchedSequence> KvClient::GetKv(const std::string& sequence_id,
                                                v1::KvFormat format,
                                                const std::vector<int>& layers,
                                                bool include_rotation,
                                                const ProgressFn& progress) {
  v1::GetKvRequest req;
  req.set_sequence_id(sequence_id);
  req.set_format(format);
  for (int l : layers) req.add_layers(l);
  req.set_include_rotation(include_rotation);
  req.set_max_chunk_bytes(std::min<int64_t>(options_.chunk_bytes, options_.max_message_bytes / 2));
  FetchedSequence out;
  out.format = format == v1::KV_FORMAT_BF16 ? v1::KV_FORMAT_BF16 : v1::KV_FORMAT_COMPRESSED;
  // Read-only: a stream that breaks with UNAVAILABLE is fetched again whole.
  absl::Status status = WithRetry(true, [&](grpc::ClientContext& ctx) -> grpc::Status {
    out = FetchedSequence();
    out.format = format == v1::KV_FORMAT_BF16 ? v1::KV_FORMAT_BF16 : v1::KV_FORMAT_COMPRESSED;
    auto reader = stub_->GetKv(&ctx, req);
    v1::GetKvResponse msg;
    int64_t total = 0;
    std::string bad;  // the reply's first malformed message, if any
    while (reader->Read(&msg)) {
      out.bytes_received += int64_t(msg.ByteSizeLong());
      if (msg.payload_case() != v1::GetKvResponse::kHeader && out.layers.empty()) {
        bad = "data before the header";
        break;
      }
      if (msg.has_bf16() && (msg.bf16().k().size() % sizeof(bf16_bits) != 0 ||
                             msg.bf16().v().size() % sizeof(bf16_bits) != 0)) {
        bad = "an odd byte count of BF16 rows";
        break;
      }
      switch (msg.payload_case()) {
        case v1::GetKvResponse::kHeader: {
          if (!out.layers.empty()) {
            bad = "a second header";
            break;
          }
          out.info = msg.header();
          const int num_layers = out.info.layout().num_layers();
          if (num_layers <= 0 || num_layers > kMaxLayers) {
            bad = absl::StrCat("a header of ", num_layers, " layers");
            break;
          }
          out.layers.assign(num_layers, FetchedLayer());
          out.present.assign(num_layers, false);
          const int64_t row = int64_t(out.info.layout().num_kv_heads()) * out.info.layout().head_dim();
          const int64_t nl = layers.empty() ? num_layers : int64_t(layers.size());
          total = format == v1::KV_FORMAT_BF16 ? nl * out.info.tokens() * row * 4
                                               : out.info.stored_bytes() * nl / std::max(1, num_layers);
          break;
        }
        case v1::GetKvResponse::kBf16: {
          const v1::KvChunk& c = msg.bf16();
          if (c.layer() < 0 || c.layer() >= int(out.layers.size())) {
            bad = absl::StrCat("a chunk of layer ", c.layer());
            break;
          }
          FetchedLayer& fl = out.layers[c.layer()];
          out.present[c.layer()] = true;
          AppendBytes(c.k(), &fl.k);
          AppendBytes(c.v(), &fl.v);
          fl.tokens = c.start_token() + c.num_tokens();
          break;
        }
        case v1::GetKvResponse::kCompressed: {
          const v1::CompressedChunk& c = msg.compressed();
          if (c.layer() < 0 || c.layer() >= int(out.layers.size())) {
            bad = absl::StrCat("a chunk of layer ", c.layer());
            break;
          }
          FetchedLayer& fl = out.layers[c.layer()];
          out.present[c.layer()] = true;
          if (c.has_rotation()) {
            fl.num_matrices = c.rotation().num_matrices();
            fl.r_k.clear();
            fl.r_v.clear();
            AppendBytes(c.rotation().r_k(), &fl.r_k);
            AppendBytes(c.rotation().r_v(), &fl.r_v);
            fl.clip_k = c.rotation().clip_k();
            fl.clip_v = c.rotation().clip_v();
          }
          if (c.tier() == v1::TIER_SINK) {
            AppendBytes(c.k(), &fl.sink_k);
            AppendBytes(c.v(), &fl.sink_v);
            fl.sink_tokens += c.num_tokens();
          } else if (c.tier() == v1::TIER_HISTORY) {
            AppendBytes(c.pages(), &fl.pages);
            fl.history_tokens += c.num_tokens();
          } else if (c.tier() == v1::TIER_RECENT) {
            AppendBytes(c.k(), &fl.recent_k);
            AppendBytes(c.v(), &fl.recent_v);
            fl.recent_tokens += c.num_tokens();
          }
          fl.tokens = fl.sink_tokens + fl.history_tokens + fl.recent_tokens;
          break;
        }
        default:
          break;
      }
      if (!bad.empty()) break;  // found inside the switch
      if (progress) progress(out.bytes_received, total);
    }
    if (!bad.empty()) {
      ctx.TryCancel();
      reader->Finish();
      return grpc::Status(grpc::StatusCode::DATA_LOSS, "GetKv reply: " + bad);
    }
    return reader->Finish();
  });
  if (!status.ok()) return status;
  OSCARKV_RETURN_IF_ERROR(CheckFetchedSequence(out, layers));
  return out;
}

AttendSession::~AttendSession() {
  if (!closed_) {
    context_->TryCancel();
    stream_->Finish();
  }
}

absl::StatusOr<std::vector<AttendOutput>> AttendSession::Call(
    const std::vector<AttendQuery>& queries, const std::vector<ModelLayout>& layouts,
    bool return_lse) {
  if (closed_) return absl::FailedPreconditionError("AttendSession is closed");
  if (layouts.size() != queries.size() && layouts.size() != 1) {
    return absl::InvalidArgumentError("give one layout, or one per query");
  }
  v1::AttendRequest req;
  req.set_return_lse(return_lse);
  req.set_request_id(next_id_++);
  for (size_t i = 0; i < queries.size(); ++i) {
    const AttendQuery& q = queries[i];
    const ModelLayout& l = layouts.size() == 1 ? layouts[0] : layouts[i];
    if (q.q == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("query ", i, " has no q"));
    }
    if ((q.k == nullptr) != (q.v == nullptr)) {
      return absl::InvalidArgumentError(
          absl::StrCat("query ", i, ": a fused append needs both k and v"));
    }
    v1::AttendItem* item = req.add_items();
    item->set_sequence_id(q.sequence_id);
    item->set_layer(q.layer);
    item->set_q(reinterpret_cast<const char*>(q.q), size_t(l.num_q_heads) * l.head_dim * 4);
    if (q.k != nullptr && q.v != nullptr) {
      const size_t kv = l.kv_row_elems() * 2;
      item->set_k(reinterpret_cast<const char*>(q.k), kv);
      item->set_v(reinterpret_cast<const char*>(q.v), kv);
      item->set_position(q.position);
    }
  }
  v1::AttendResponse resp;
  if (!stream_->Write(req) || !stream_->Read(&resp)) {
    closed_ = true;
    const absl::Status s = FromGrpcStatus(stream_->Finish());
    return s.ok() ? absl::UnavailableError("Attend stream ended early") : s;
  }
  if (resp.results_size() != int(queries.size()) || resp.request_id() != req.request_id()) {
    return absl::DataLossError(absl::StrCat(
        "Attend reply ", resp.request_id(), " has ", resp.results_size(), " results; request ",
        req.request_id(), " had ", queries.size(), " items"));
  }
  std::vector<AttendOutput> out(queries.size());
  for (size_t i = 0; i < queries.size(); ++i) {
    const v1::AttendResult& r = resp.results(int(i));
    if (r.code() != 0) {
      const bool known = r.code() > 0 && r.code() <= int(absl::StatusCode::kUnauthenticated);
      out[i].status = absl::Status(known ? static_cast<absl::StatusCode>(r.code())
                                         : absl::StatusCode::kUnknown,
                                   r.error());
      continue;
    }
    const ModelLayout& l = layouts.size() == 1 ? layouts[0] : layouts[i];
    const size_t out_bytes = size_t(l.num_q_heads) * l.head_dim * sizeof(float);
    const size_t lse_bytes = return_lse ? size_t(l.num_q_heads) * sizeof(float) : 0;
    if (r.out().size() != out_bytes || r.lse().size() != lse_bytes) {
      out[i].status = absl::DataLossError(absl::StrCat(
          "Attend reply: item ", i, " has ", r.out().size(), " bytes of output and ",
          r.lse().size(), " of lse; expected ", out_bytes, " and ", lse_bytes));
      continue;
    }
    AppendBytes(r.out(), &out[i].out);
    AppendBytes(r.lse(), &out[i].lse);
    out[i].tokens = r.tokens();
  }
  return out;
}

absl::Status AttendSession::Close() {
  if (closed_) return absl::OkStatus();
  closed_ = true;
  stream_->WritesDone();
  return FromGrpcStatus(stream_->Finish());
}

absl::StatusOr<std::unique_ptr<AttendSession>> KvClient::OpenAttend(
    std::chrono::milliseconds session_deadline) {
  std::unique_ptr<AttendSession> s(new AttendSession());
  s->context_ = NewContext(session_deadline.count() > 0 ? Clock::now() + session_deadline
                                                         : CallDeadline());
  s->stream_ = stub_->Attend(s->context_.get());
  if (s->stream_ == nullptr) return absl::UnavailableError("cannot open an Attend stream");
  return s;
}

absl::StatusOr<std::vector<AttendOutput>> KvClient::Attend(const std::vector<AttendQuery>& queries,
                                                           const ModelLayout& layout,
                                                           bool return_lse) {
  OSCARKV_ASSIGN_OR_RETURN(std::unique_ptr<AttendSession> session, OpenAttend());
  OSCARKV_ASSIGN_OR_RETURN(std::vector<AttendOutput> out,
                           session->Call(queries, {layout}, return_lse));
  // The answers stand even if the stream then ends badly (a deadline or a
  // shutdown between the reply and the close): the server applied their
  // fused appends, and an error here would invite a retry that appends again.
  session->Close().IgnoreError();
  return out;
}

}  // namespace oscarkv
