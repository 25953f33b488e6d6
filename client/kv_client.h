// The oscarkv C++ client: what a prefill or decode process links to talk to an
// oscarkv-server (proto/oscarkv/v1/kvcache.proto).
//
// Every call has a deadline (ClientOptions::deadline unless stated) that
// bounds all its attempts and backoffs: a retry gets what remains of it, and
// is not made when too little would remain. Retries happen only where they
// are safe: a mutating call (PutKv, AppendKv, Attend with appends, Drop,
// LoadCalibration) is sent at most once; what is retried with backoff is only
// getting a READY connection before it, when no byte has been sent.
// Read-only calls are retried on UNAVAILABLE.
//
// Thread-safety: a KvClient may be used from many threads at once. PutStream
// and AttendSession objects belong to one thread at a time.
#ifndef OSCARKV_CLIENT_KV_CLIENT_H_
#define OSCARKV_CLIENT_KV_CLIENT_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "kernels/layout.h"
#include "kernels/numeric.h"
#include "oscarkv/v1/kvcache.grpc.pb.h"

namespace oscarkv {

struct ClientOptions {
  // Per call (a whole stream for streams), all attempts and backoffs included.
  std::chrono::milliseconds deadline{60000};
  int max_attempts = 4;                        // attempts for a retryable failure
  std::chrono::milliseconds backoff{50};       // doubled per attempt
  int64_t max_message_bytes = 64 << 20;
  int64_t chunk_bytes = 4 << 20;  // PutKv payload per message (K + V)
};

// Progress of a long transfer: bytes done and total (0 when unknown).
using ProgressFn = std::function<void(int64_t done, int64_t total)>;

struct PutResult {
  int64_t tokens = 0;
  int64_t bf16_bytes_sent = 0;
  int64_t stored_bytes = 0;
  double effective_bits = 0;
};

// An open PutKv stream (one sequence). Write chunks in token order per layer,
// then Finish() to commit. Destroying it without Finish() cancels the stream:
// the server stores nothing.
class PutStream {
 public:
  ~PutStream();
  // One layer (layer >= 0) or all layers (-1; k, v are [L][n][Hkv][D]).
  absl::Status Write(int layer, int64_t start_token, int64_t n, const bf16_bits* k,
                     const bf16_bits* v);
  absl::StatusOr<PutResult> Finish();
  // Abandons the stream; the server discards the partial sequence.
  void Cancel();

 private:
  friend class KvClient;
  PutStream() = default;
  std::unique_ptr<grpc::ClientContext> context_;
  std::unique_ptr<v1::PutKvResponse> response_;
  std::unique_ptr<grpc::ClientWriter<v1::PutKvRequest>> writer_;
  ModelLayout layout_;
  int64_t bytes_sent_ = 0;
  bool done_ = false;
};

// One layer of a GetKv transfer.
struct FetchedLayer {
  int64_t tokens = 0;
  // COMPRESSED: tiers as stored. BF16 [rows][Hkv][D].
  int64_t sink_tokens = 0, history_tokens = 0, recent_tokens = 0;
  std::vector<bf16_bits> sink_k, sink_v, recent_k, recent_v;
  std::vector<uint8_t> pages;  // history pages, page_format.h layout
  int num_matrices = 0;        // 0 when the rotation was not requested
  std::vector<float> r_k, r_v;
  float clip_k = 0, clip_v = 0;
  // BF16: the whole layer [tokens][Hkv][D].
  std::vector<bf16_bits> k, v;
};

struct FetchedSequence {
  v1::SequenceInfo info;
  v1::KvFormat format = v1::KV_FORMAT_COMPRESSED;
  std::vector<FetchedLayer> layers;  // indexed by layer; unrequested layers stay empty
  std::vector<bool> present;
  int64_t bytes_received = 0;
};

// Whether `f` is consistent in itself: every layer in `layers` (all of the
// layout's when empty) is present, and each present layer's bytes match its
// token counts, tiers (COMPRESSED: page geometry of info's layout and tiers)
// and rotation (1 or num_kv_heads matrices of D x D). DATA_LOSS naming the
// first mismatch otherwise. GetKv checks every reply with it.
absl::Status CheckFetchedSequence(const FetchedSequence& f, const std::vector<int>& layers = {});

struct AttendQuery {
  std::string sequence_id;
  int layer = 0;
  const float* q = nullptr;  // [Hq][D]
  // Optional fused append of the current token: [Hkv][D] each, both or neither.
  const bf16_bits* k = nullptr;
  const bf16_bits* v = nullptr;
  int64_t position = -1;  // the appended token's index (checked when > 0)
};

struct AttendOutput {
  absl::Status status;
  std::vector<float> out;  // [Hq][D]
  std::vector<float> lse;  // [Hq] when requested
  int64_t tokens = 0;
};

// A decode-side Attend stream: each Call() sends one batch (e.g. one layer of
// one decode step for many sequences) and waits for its reply.
class AttendSession {
 public:
  ~AttendSession();
  // `layouts` gives each query's shape: q bytes = Hq*D*4, k/v = Hkv*D*2.
  absl::StatusOr<std::vector<AttendOutput>> Call(const std::vector<AttendQuery>& queries,
                                                 const std::vector<ModelLayout>& layouts,
                                                 bool return_lse);
  // Half-closes and returns the stream's final status.
  absl::Status Close();

 private:
  friend class KvClient;
  AttendSession() = default;
  std::unique_ptr<grpc::ClientContext> context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::AttendRequest, v1::AttendResponse>> stream_;
  uint64_t next_id_ = 1;
  bool closed_ = false;
};

class KvClient {
 public:
  // Connects lazily to `target` (host:port) over an insecure channel.
  static std::unique_ptr<KvClient> Create(const std::string& target, ClientOptions options = {});
  KvClient(std::shared_ptr<grpc::Channel> channel, ClientOptions options);

  const std::string& target() const { return target_; }
  const ClientOptions& options() const { return options_; }
  // K + V payload bytes per PutKv message: options().chunk_bytes, held within
  // both this client's and the server's message limit (the server's is asked
  // once, by GetServerInfo; this client's alone while that fails).
  int64_t PutChunkBytes();

  // ---- ingest
  absl::StatusOr<std::unique_ptr<PutStream>> OpenPut(const std::string& sequence_id,
                                                      const std::string& model,
                                                      const ModelLayout& layout, bool pin,
                                                      int64_t expected_tokens);
  // Streams a whole prefill cache, k and v BF16 [L][T][Hkv][D], layer by
  // layer in token ranges of about PutChunkBytes(), and commits it.
  absl::StatusOr<PutResult> PutSequence(const std::string& sequence_id, const std::string& model,
                                        const ModelLayout& layout, int64_t tokens,
                                        const bf16_bits* k, const bf16_bits* v, bool pin = false,
                                        const ProgressFn& progress = nullptr);
  // Appends n decode tokens to one layer or all (-1): k, v [layers][n][Hkv][D].
  absl::StatusOr<int64_t> Append(const std::string& sequence_id, const ModelLayout& layout,
                                 int layer, int64_t start_token, int64_t n, const bf16_bits* k,
                                 const bf16_bits* v);

  // ---- read
  absl::StatusOr<FetchedSequence> GetKv(const std::string& sequence_id, v1::KvFormat format,
                                        const std::vector<int>& layers = {},
                                        bool include_rotation = true,
                                        const ProgressFn& progress = nullptr);
  // The session's deadline bounds the whole stream (default: ClientOptions::
  // deadline); open one per request being decoded, with its expected length.
  absl::StatusOr<std::unique_ptr<AttendSession>> OpenAttend(
      std::chrono::milliseconds session_deadline = std::chrono::milliseconds(0));
  // One Attend round trip on a fresh stream (convenience).
  absl::StatusOr<std::vector<AttendOutput>> Attend(const std::vector<AttendQuery>& queries,
                                                   const ModelLayout& layout, bool return_lse);

  // ---- admin
  absl::StatusOr<int64_t> Drop(const std::string& sequence_id);
  absl::StatusOr<v1::SequenceInfo> Stat(const std::string& sequence_id);
  absl::StatusOr<std::vector<v1::SequenceInfo>> List(const std::string& model = "");
  absl::StatusOr<v1::ServerInfo> Info();
  absl::StatusOr<v1::ModelInfo> LoadCalibration(const v1::LoadCalibrationRequest& request);
  // The layout of a registered model (from Info()).
  absl::StatusOr<ModelLayout> ModelLayoutOf(const std::string& model);

  // ---- async: each runs the blocking call of the same name on its own
  // thread; the future is ready when the call ends. The client, and any k / v
  // / q buffers passed, must stay valid until then.
  std::future<absl::StatusOr<v1::SequenceInfo>> StatAsync(const std::string& sequence_id);
  std::future<absl::StatusOr<int64_t>> DropAsync(const std::string& sequence_id);
  std::future<absl::StatusOr<v1::ServerInfo>> InfoAsync();
  std::future<absl::StatusOr<int64_t>> AppendAsync(const std::string& sequence_id,
                                                   const ModelLayout& layout, int layer,
                                                   int64_t start_token, int64_t n,
                                                   const bf16_bits* k, const bf16_bits* v);
  // One Attend round trip on its own thread; the queries' q/k/v must stay
  // valid until the future is ready.
  std::future<absl::StatusOr<std::vector<AttendOutput>>> AttendAsync(
      std::vector<AttendQuery> queries, const ModelLayout& layout, bool return_lse);
  // Runs PutSequence on its own thread; k and v must stay valid until ready.
  std::future<absl::StatusOr<PutResult>> PutSequenceAsync(const std::string& sequence_id,
                                                          const std::string& model,
                                                          const ModelLayout& layout,
                                                          int64_t tokens, const bf16_bits* k,
                                                          const bf16_bits* v, bool pin = false);

  v1::KvCache::Stub& stub() { return *stub_; }

 private:
  using Clock = std::chrono::system_clock;
  // When a call starting now must end: now + options_.deadline.
  Clock::time_point CallDeadline() const;
  static std::unique_ptr<grpc::ClientContext> NewContext(Clock::time_point deadline);
  // Between attempt `attempt` and the next of one call: if another is allowed
  // (fewer than options_.max_attempts so far, and after sleeping *backoff a
  // useful part of the call's `deadline` left: kMinRetryTime in
  // kv_client.cc), sleeps *backoff, doubles it and returns true; else false.
  bool BackOff(int attempt, Clock::time_point deadline, std::chrono::milliseconds* backoff) const;
  // Runs `call` (one attempt, on a fresh context with the call's deadline)
  // with the retry rule of the header comment, all attempts within one
  // CallDeadline().
  absl::Status WithRetry(bool read_only,
                         const std::function<grpc::Status(grpc::ClientContext&)>& call);

  std::string target_;
  ClientOptions options_;
  std::atomic<int64_t> server_max_message_bytes_{0};  // 0: not asked yet
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::KvCache::Stub> stub_;
};

// grpc::Status -> absl::Status (same codes).
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace oscarkv

#endif  // OSCARKV_CLIENT_KV_CLIENT_H_
