#include "client/kv_client.h"

#include "client/kv_chunk.h"

#include <algorithm>
#include <limits>
#include <thread>

#include "absl/strings/str_cat.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "kernels/status_macros.h"

namespace oscarkv {

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

std::unique_ptr<KvClient> KvClient::Create(const std::string& target, ClientOptions options) {
  grpc::ChannelArguments args;
  // gRPC takes an int: larger limits mean "as large as gRPC allows".
  const int limit = static_cast<int>(
      std::min<int64_t>(options.max_message_bytes, std::numeric_limits<int>::max()));
  args.SetMaxReceiveMessageSize(limit);
  args.SetMaxSendMessageSize(limit);
  auto channel = grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
  auto client = std::make_unique<KvClient>(std::move(channel), options);
  client->target_ = target;
  return client;
}

KvClient::KvClient(std::shared_ptr<grpc::Channel> channel, ClientOptions options)
    : options_(options), channel_(std::move(channel)), stub_(v1::KvCache::NewStub(channel_)) {}

int64_t KvClient::PutChunkBytes() {
  constexpr int64_t kMessageHeadroom = 64 << 10;  // the chunk's other fields and framing
  int64_t server = server_max_message_bytes_.load(std::memory_order_relaxed);
  if (server == 0) {
    auto info = Info();
    if (info.ok() && info->max_message_bytes() > 0) {
      server = info->max_message_bytes();
      server_max_message_bytes_.store(server, std::memory_order_relaxed);
    }
  }
  const int64_t limit =
      server > 0 ? std::min(options_.max_message_bytes, server) : options_.max_message_bytes;
  return std::max<int64_t>(1, std::min(options_.chunk_bytes, limit - kMessageHeadroom));
}

// A retry is made only if at least this much of the call's deadline is left
// after its backoff: a shorter attempt would mostly turn UNAVAILABLE into
// DEADLINE_EXCEEDED, hiding that the server was unavailable.
constexpr std::chrono::milliseconds kMinRetryTime{20};

KvClient::Clock::time_point KvClient::CallDeadline() const {
  return Clock::now() + options_.deadline;
}

std::unique_ptr<grpc::ClientContext> KvClient::NewContext(Clock::time_point deadline) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(deadline);
  return ctx;
}

bool KvClient::BackOff(int attempt, Clock::time_point deadline,
                       std::chrono::milliseconds* backoff) const {
  if (attempt >= options_.max_attempts || Clock::now() + *backoff + kMinRetryTime > deadline) {
    return false;
  }
  std::this_thread::sleep_for(*backoff);
  *backoff *= 2;
  return true;
}

absl::Status KvClient::WithRetry(bool read_only,
                                 const std::function<grpc::Status(grpc::ClientContext&)>& call) {
  const Clock::time_point deadline = CallDeadline();
  auto backoff = options_.backoff;
  if (!read_only) {
    // A mutating call is sent at most once. What is retried is only getting a
    // connection before it: until the channel is READY no byte of the request
    // has left this process. (A failure after sending is returned as is: the
    // server may have applied the call.)
    for (int attempt = 1;; ++attempt) {
      const Clock::time_point wait_until = std::min(deadline, Clock::now() + backoff * 4);
      if (channel_->WaitForConnected(wait_until)) break;
      if (!BackOff(attempt, deadline, &backoff)) {
        return absl::UnavailableError(absl::StrCat("cannot connect to ", target_, " after ",
                                                   attempt, " attempts within the ",
                                                   options_.deadline.count(), " ms deadline"));
      }
    }
    return FromGrpcStatus(call(*NewContext(deadline)));
  }
  grpc::Status status;
  for (int attempt = 1;; ++attempt) {
    status = call(*NewContext(deadline));
    const bool retryable = status.error_code() == grpc::StatusCode::UNAVAILABLE;
    if (!retryable || attempt >= options_.max_attempts) break;
    if (!BackOff(attempt, deadline, &backoff)) {
      return absl::UnavailableError(absl::StrCat(
          status.error_message(), " (attempt ", attempt, "; too little of the ",
          options_.deadline.count(), " ms deadline left to retry)"));
    }
  }
  return FromGrpcStatus(status);
}

absl::StatusOr<int64_t> KvClient::Append(const std::string& sequence_id,
                                         const ModelLayout& layout, int layer,
                                         int64_t start_token, int64_t n, const bf16_bits* k,
                                         const bf16_bits* v) {
  v1::AppendKvRequest req;
  req.set_sequence_id(sequence_id);
  OSCARKV_RETURN_IF_ERROR(
      FillKvChunk(layout, layer, start_token, n, k, v, req.mutable_chunk()).status());
  v1::AppendKvResponse resp;
  // Sent at most once (see WithRetry).
  OSCARKV_RETURN_IF_ERROR(WithRetry(false, [&](grpc::ClientContext& ctx) {
    return stub_->AppendKv(&ctx, req, &resp);
  }));
  return resp.tokens();
}

absl::StatusOr<int64_t> KvClient::Drop(const std::string& sequence_id) {
  v1::DropSequenceRequest req;
  req.set_sequence_id(sequence_id);
  v1::DropSequenceResponse resp;
  OSCARKV_RETURN_IF_ERROR(WithRetry(false, [&](grpc::ClientContext& ctx) {
    return stub_->DropSequence(&ctx, req, &resp);
  }));
  return resp.freed_bytes();
}

absl::StatusOr<v1::SequenceInfo> KvClient::Stat(const std::string& sequence_id) {
  v1::GetSequenceRequest req;
  req.set_sequence_id(sequence_id);
  v1::SequenceInfo resp;
  OSCARKV_RETURN_IF_ERROR(WithRetry(true, [&](grpc::ClientContext& ctx) {
    return stub_->GetSequence(&ctx, req, &resp);
  }));
  return resp;
}

absl::StatusOr<std::vector<v1::SequenceInfo>> KvClient::List(const std::string& model) {
  std::vector<v1::SequenceInfo> all;
  std::string token;
  do {
    v1::ListSequencesRequest req;
    req.set_model(model);
    req.set_page_token(token);
    v1::ListSequencesResponse resp;
    OSCARKV_RETURN_IF_ERROR(WithRetry(true, [&](grpc::ClientContext& ctx) {
      return stub_->ListSequences(&ctx, req, &resp);
    }));
    for (auto& s : *resp.mutable_sequences()) all.push_back(std::move(s));
    token = resp.next_page_token();
  } while (!token.empty());
  return all;
}

absl::StatusOr<v1::ServerInfo> KvClient::Info() {
  v1::ServerInfo resp;
  OSCARKV_RETURN_IF_ERROR(WithRetry(true, [&](grpc::ClientContext& ctx) {
    return stub_->GetServerInfo(&ctx, v1::GetServerInfoRequest(), &resp);
  }));
  return resp;
}

absl::StatusOr<v1::ModelInfo> KvClient::LoadCalibration(const v1::LoadCalibrationRequest& req) {
  v1::LoadCalibrationResponse resp;
  OSCARKV_RETURN_IF_ERROR(WithRetry(false, [&](grpc::ClientContext& ctx) {
    return stub_->LoadCalibration(&ctx, req, &resp);
  }));
  return resp.model();
}

absl::StatusOr<ModelLayout> KvClient::ModelLayoutOf(const std::string& model) {
  OSCARKV_ASSIGN_OR_RETURN(v1::ServerInfo info, Info());
  for (const v1::ModelInfo& m : info.models()) {
    if (m.name() == model) {
      return ModelLayout{m.layout().num_layers(), m.layout().num_q_heads(),
                         m.layout().num_kv_heads(), m.layout().head_dim()};
    }
  }
  return absl::NotFoundError(absl::StrCat("server ", target_, " has no model '", model, "'"));
}

// The async calls run the blocking ones on their own thread, like AttendAsync
// and PutSequenceAsync. (They used gRPC's callback API; with gRPC 1.51 a
// callback that releases the last reference to its call, and through it to
// the channel, runs the channel's shutdown on the callback thread pool itself,
// which that pool does not survive (grpc/grpc#32584): a crash seen in the
// service tests when a client was destroyed right after its last async call.)
std::future<absl::StatusOr<v1::SequenceInfo>> KvClient::StatAsync(const std::string& id) {
  return std::async(std::launch::async, [this, id] { return Stat(id); });
}

std::future<absl::StatusOr<int64_t>> KvClient::DropAsync(const std::string& id) {
  return std::async(std::launch::async, [this, id] { return Drop(id); });
}

std::future<absl::StatusOr<v1::ServerInfo>> KvClient::InfoAsync() {
  return std::async(std::launch::async, [this] { return Info(); });
}

std::future<absl::StatusOr<int64_t>> KvClient::AppendAsync(const std::string& id,
                                                           const ModelLayout& layout, int layer,
                                                           int64_t start_token, int64_t n,
                                                           const bf16_bits* k,
                                                           const bf16_bits* v) {
  return std::async(std::launch::async,
                    [=] { return Append(id, layout, layer, start_token, n, k, v); });
}

std::future<absl::StatusOr<std::vector<AttendOutput>>> KvClient::AttendAsync(
    std::vector<AttendQuery> queries, const ModelLayout& layout, bool return_lse) {
  return std::async(std::launch::async, [this, queries = std::move(queries), layout, return_lse] {
    return Attend(queries, layout, return_lse);
  });
}

std::future<absl::StatusOr<PutResult>> KvClient::PutSequenceAsync(
    const std::string& sequence_id, const std::string& model, const ModelLayout& layout,
    int64_t tokens, const bf16_bits* k, const bf16_bits* v, bool pin) {
  return std::async(std::launch::async, [=] {
    return PutSequence(sequence_id, model, layout, tokens, k, v, pin);
  });
}

}  // namespace oscarkv
