// The oscarkv.v1.KvCache service on gRPC's callback API: unary handlers use
// the default reactor, PutKv / GetKv / Attend have their own reactors
// (kv_streams.cc, attend_reactor.cc). Handlers translate between protobuf and
// the SequenceStore; every error leaves the store unchanged and comes back as
// a precise status.
//
// Thread-safety: gRPC calls the handlers from its threads concurrently; all
// state lives in the store, the registry and the metrics, which are safe.
#ifndef OSCARKV_SERVER_SERVICE_KV_SERVICE_H_
#define OSCARKV_SERVER_SERVICE_KV_SERVICE_H_

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "oscarkv/v1/kvcache.grpc.pb.h"
#include "server/service/compute_executor.h"
#include "server/service/server_metrics.h"
#include "server/service/stream_watchdog.h"
#include "server/store/model_registry.h"
#include "server/store/sequence_store.h"

namespace oscarkv {

// Reads an oscarkv calibration file (path or contents) into a rotation; when
// `expected` is non-null the rotation must have that layout. Null reader: the
// server accepts only the data-free Hadamard source.
using CalibrationReader = std::function<absl::StatusOr<ModelRotation>(
    const std::string& path_or_bytes, bool is_path, const ModelLayout* expected)>;

struct ServiceContext {
  SequenceStore* store = nullptr;
  ModelRegistry* models = nullptr;
  Backend* backend = nullptr;
  ServerMetrics* metrics = nullptr;  // may be null
  // Where encoding and attention run (see compute_executor.h); null: inline on
  // gRPC's callback threads.
  ComputeExecutor* executor = nullptr;
  // Attend messages of at most this many items run inline on the callback
  // thread that read them (one thread hop less per decode step), at most
  // kMaxInlineAttends at a time; larger ones, and the rest, go to the
  // executor. The server resolves its option's -1 (auto) before this.
  int attend_inline_items = 0;
  CalibrationReader calibration_reader;
  // Real path of --calibration_dir: LoadCalibration(path) reads only files
  // inside it (calibration_path.h). Empty: path loading is refused.
  std::string calibration_dir;
  TierConfig tiers;             // for models registered through LoadCalibration
  int group_size = 0;           // 0: G = D
  float clip_k = 0.96f;         // Hadamard defaults
  float clip_v = 0.92f;
  int64_t max_message_bytes = 64 << 20;
  // PutKv / GetKv streams idle on their client this long are ended
  // (stream_watchdog.h); 0: never.
  std::chrono::milliseconds stream_idle_timeout{0};
  std::string version;
};

class KvCacheService final : public v1::KvCache::CallbackService {
 public:
  explicit KvCacheService(ServiceContext ctx)
      : ctx_(std::move(ctx)), watchdog_(ctx_.stream_idle_timeout) {}

  grpc::ServerReadReactor<v1::PutKvRequest>* PutKv(grpc::CallbackServerContext* context,
                                                    v1::PutKvResponse* response) override;
  grpc::ServerUnaryReactor* AppendKv(grpc::CallbackServerContext* context,
                                     const v1::AppendKvRequest* request,
                                     v1::AppendKvResponse* response) override;
  grpc::ServerWriteReactor<v1::GetKvResponse>* GetKv(grpc::CallbackServerContext* context,
                                                     const v1::GetKvRequest* request) override;
  grpc::ServerBidiReactor<v1::AttendRequest, v1::AttendResponse>* Attend(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* DropSequence(grpc::CallbackServerContext* context,
                                         const v1::DropSequenceRequest* request,
                                         v1::DropSequenceResponse* response) override;
  grpc::ServerUnaryReactor* GetSequence(grpc::CallbackServerContext* context,
                                        const v1::GetSequenceRequest* request,
                                        v1::SequenceInfo* response) override;
  grpc::ServerUnaryReactor* ListSequences(grpc::CallbackServerContext* context,
                                          const v1::ListSequencesRequest* request,
                                          v1::ListSequencesResponse* response) override;
  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* context,
                                          const v1::GetServerInfoRequest* request,
                                          v1::ServerInfo* response) override;
  grpc::ServerUnaryReactor* LoadCalibration(grpc::CallbackServerContext* context,
                                            const v1::LoadCalibrationRequest* request,
                                            v1::LoadCalibrationResponse* response) override;

  const ServiceContext& context() const { return ctx_; }
  // Where PutKv and GetKv reactors register while they may stall on their
  // client.
  StreamWatchdog& stream_watchdog() const { return watchdog_; }
  // Records one finished RPC in the metrics (no-op without metrics).
  void Record(const char* method, std::chrono::steady_clock::time_point start,
              absl::StatusCode code) const;

  // Attend batches running inline on gRPC callback threads: they wait on the
  // backend (its lock, a GPU synchronization), so only this many may hold a
  // callback thread at once; TryEnterInline() is false beyond it.
  static constexpr int kMaxInlineAttends = 2;
  bool TryEnterInline() const {
    int n = inline_attends_.load(std::memory_order_relaxed);
    while (n < kMaxInlineAttends) {
      if (inline_attends_.compare_exchange_weak(n, n + 1, std::memory_order_acq_rel)) return true;
    }
    return false;
  }
  void LeaveInline() const { inline_attends_.fetch_sub(1, std::memory_order_acq_rel); }

 private:
  absl::Status DoLoadCalibration(const v1::LoadCalibrationRequest& request,
                                 v1::LoadCalibrationResponse* response);
  ServiceContext ctx_;
  mutable StreamWatchdog watchdog_;
  mutable std::atomic<int> inline_attends_{0};
};

// Reactor factories (kv_streams.cc, attend_reactor.cc).
grpc::ServerReadReactor<v1::PutKvRequest>* NewPutKvReactor(const KvCacheService* service,
                                                           grpc::CallbackServerContext* context,
                                                           v1::PutKvResponse* response);
grpc::ServerWriteReactor<v1::GetKvResponse>* NewGetKvReactor(const KvCacheService* service,
                                                             grpc::CallbackServerContext* context,
                                                             const v1::GetKvRequest* request);
grpc::ServerBidiReactor<v1::AttendRequest, v1::AttendResponse>* NewAttendReactor(
    const KvCacheService* service, grpc::CallbackServerContext* context);

}  // namespace oscarkv

#endif  // OSCARKV_SERVER_SERVICE_KV_SERVICE_H_
