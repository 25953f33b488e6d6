// One oscarkv server: backend, pool, models, sequence store, the gRPC service
// with health checking and reflection, and the metrics registry. Used by
// main.cc and by the in-process tests (several may run in one process: no
// globals beyond gRPC's own).
//
// Thread-safety: Start/Shutdown from one thread; everything else is safe.
#ifndef OSCARKV_SERVER_OSCARKV_SERVER_H_
#define OSCARKV_SERVER_OSCARKV_SERVER_H_

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "grpcpp/server.h"
#include "kernels/backend.h"
#include "prometheus/registry.h"
#include "server/cache/page_pool.h"
#include "server/service/kv_service.h"
#include "server/service/server_metrics.h"
#include "server/store/model_registry.h"
#include "server/store/sequence_store.h"

namespace oscarkv {

// A --pool_size value: bytes, or a share of the backend's available memory.
struct PoolSize {
  size_t bytes = 0;     // when fraction == 0
  double fraction = 0;  // in (0, 1); resolved by ResolvePoolBytes once the backend exists
};

// The default of ServerOptions::attend_inline_items on an accelerator. H200,
// 2026-11-29, CUDA backend, Attend RPC p50 with the executor hop vs inline,
// server on 2 cores: 1 item of 32K tokens 183 vs 166 us, with a fused append
// 203 vs 170, 16 items 982 vs 903 (tests/bench/RESULTS.md, run 9).
inline constexpr int kAttendInlineItems = 16;

// The longest stream idle limit accepted (a week). Larger values would
// overflow when compared with clock durations in nanoseconds; 0 means none.
inline constexpr std::chrono::milliseconds kMaxStreamIdleTimeout{int64_t{7} * 24 * 3600 * 1000};

struct ServerOptions {
  std::string listen_address = "127.0.0.1:0";
  std::string backend = "auto";  // auto | cpu | cuda
  int cpu_threads = 0;           // 0: one per hardware thread
  // Threads that run ingest encoding and attention off gRPC's callback
  // threads (0: one per hardware thread).
  int compute_threads = 0;
  // Attend messages with at most this many items run on the gRPC callback
  // thread that read them instead of on the compute threads (one thread hop
  // less). -1: kAttendInlineItems when the backend computes on an
  // accelerator, 0 when it computes on the host's cores.
  int attend_inline_items = -1;
  int cuda_device = 0;
  // The one pool allocated at start: pool_size.fraction of the backend's
  // available memory (Backend::AvailableBytes: host memory for CPU, free
  // device memory for CUDA) when it is > 0, else pool_size.bytes.
  PoolSize pool_size{size_t{256} << 20, 0};
  double exact_fraction = 0.25;  // pool share of BF16 sink/recent blocks
  TierConfig tiers;
  int group_size = 0;  // 0: G = D
  float clip_k = 0.96f;
  float clip_v = 0.92f;
  // name:layers:q_heads:kv_heads:head_dim, registered with the Hadamard rotation
  // unless a calibration below names the model.
  std::vector<std::string> models = {"qwen3-8b:36:32:8:128"};
  // model=path: oscarkv calibration files (needs a calibration reader). Given
  // by the operator, so read from any path.
  std::vector<std::string> calibrations;
  // LoadCalibration by path reads only regular files that resolve (symlinks
  // and `..` followed) inside this existing directory; relative paths are
  // taken relative to it. Empty: path loading is refused (PERMISSION_DENIED),
  // clients send the file's bytes as `content` instead.
  std::string calibration_dir;
  // At most this many models (those of `models` and LoadCalibration's); a
  // LoadCalibration of a new name beyond it is RESOURCE_EXHAUSTED. Must be
  // >= 1 and >= models.size().
  int max_models = kDefaultMaxModels;
  // A PutKv stream whose next message has not arrived, or a GetKv stream
  // whose write the client has not taken, for this long is ended by the
  // server (server/service/stream_watchdog.h), releasing its pool slots or
  // sequence. 0: never; at most kMaxStreamIdleTimeout.
  std::chrono::milliseconds stream_idle_timeout{60000};
  EvictionPolicy eviction = EvictionPolicy::kLru;
  int64_t max_message_bytes = 64 << 20;
  std::string version = "0.1.0";
};

class OscarkvServer {
 public:
  // Builds everything and starts serving. `registry` may be null (no metrics).
  // `calibration_reader` may be null (Hadamard only).
  static absl::StatusOr<std::unique_ptr<OscarkvServer>> Start(
      const ServerOptions& options, std::shared_ptr<prometheus::Registry> registry,
      CalibrationReader calibration_reader = nullptr);
  ~OscarkvServer();

  // The bound port (useful with port 0); 0 for a Unix domain socket.
  int port() const { return port_; }
  // Where a client on this host reaches the server: the socket for a
  // "unix:" listen address, else 127.0.0.1 and the bound port.
  std::string address() const {
    return unix_socket_.empty() ? "127.0.0.1:" + std::to_string(port_) : unix_socket_;
  }
  // Stops accepting, lets in-flight calls finish until `deadline`, then
  // cancels the rest. Idempotent.
  void Shutdown(std::chrono::system_clock::time_point deadline);
  void Wait();

  // The scrape target for an Exposer (refreshes store gauges first).
  std::shared_ptr<prometheus::Collectable> collectable() const { return collectable_; }
  SequenceStore& store() { return *store_; }
  ModelRegistry& models() { return models_; }
  Backend& backend() { return *backend_; }
  PagePool& pool() { return *pool_; }
  // How a fractional pool size was resolved, e.g. "0.5 of 62668 MiB available
  // host memory"; empty when the pool size was given in bytes.
  const std::string& pool_size_note() const { return pool_size_note_; }
  ServerMetrics* metrics() { return metrics_.get(); }

 private:
  explicit OscarkvServer(int max_models) : models_(max_models) {}

  std::unique_ptr<Backend> backend_;
  ModelRegistry models_;
  std::unique_ptr<PagePool> pool_;
  std::unique_ptr<SequenceStore> store_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<ServerMetrics> metrics_;
  std::shared_ptr<prometheus::Collectable> collectable_;
  // Declared before the gRPC server: destroyed after it, once no reactor can
  // post work any more.
  std::unique_ptr<ComputeExecutor> executor_;
  std::unique_ptr<KvCacheService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::string pool_size_note_;
  int port_ = 0;
  std::string unix_socket_;  // the listen address when it is "unix:PATH"
  bool shut_down_ = false;
};

// Creates the backend named by `kind` (auto | cpu | cuda).
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const std::string& kind, int cpu_threads,
                                                       int cuda_device);

// Parses "1073741824", "512MiB", "2GiB", "1.5G" (bytes), or a fraction in (0, 1)
// such as "0.5" (of the backend's available memory). INVALID_ARGUMENT naming
// the text otherwise.
absl::StatusOr<PoolSize> ParsePoolSize(const std::string& text);

// The pool size Start allocates: options.pool_size.fraction of
// backend.AvailableBytes() when set, else options.pool_size.bytes. `note` (may be
// null) gets which memory the fraction was taken of ("" for bytes).
// INVALID_ARGUMENT for a fraction outside (0, 1); the backend's error when it
// cannot report its memory.
absl::StatusOr<size_t> ResolvePoolBytes(const ServerOptions& options, const Backend& backend,
                                        std::string* note);

}  // namespace oscarkv

#endif  // OSCARKV_SERVER_OSCARKV_SERVER_H_
