// Prometheus metrics of one server (DESIGN section 8). The registry is passed
// in (no global registry), so tests can run several servers in one process.
// Gauges that mirror store state are refreshed on every scrape through
// MakeRefreshingCollectable(); counters and histograms are updated on the
// request path.
//
// Thread-safety: all methods may be called concurrently.
#ifndef OSCARKV_SERVER_SERVICE_SERVER_METRICS_H_
#define OSCARKV_SERVER_SERVICE_SERVER_METRICS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "server/store/sequence_store.h"

namespace oscarkv {

class ServerMetrics {
 public:
  explicit ServerMetrics(prometheus::Registry& registry);

  // One finished RPC: method name (e.g. "PutKv") and final status code.
  void ObserveRpc(const std::string& method, absl::StatusCode code, double seconds);
  // BF16 K/V payload bytes received by PutKv/AppendKv/Attend appends.
  void AddIngestBytesIn(int64_t bytes);
  // Pool bytes a committed PutKv stored.
  void AddIngestBytesStored(int64_t bytes);
  // Backend attention time of one item (seconds).
  void ObserveAttention(double seconds);
  // Mirrors the store and the models into the gauges.
  void Refresh(const StoreStats& stats,
               const std::vector<std::shared_ptr<const ModelEntry>>& models);

 private:
  prometheus::Family<prometheus::Histogram>& rpc_seconds_;
  prometheus::Family<prometheus::Gauge>& memory_bytes_;
  prometheus::Family<prometheus::Gauge>& pool_bytes_;
  prometheus::Family<prometheus::Gauge>& tokens_;
  prometheus::Gauge& bytes_per_element_;
  prometheus::Gauge& compression_ratio_;
  prometheus::Family<prometheus::Gauge>& sequences_;
  prometheus::Counter& evictions_;
  prometheus::Counter& demotions_;
  prometheus::Family<prometheus::Counter>& ingest_bytes_;
  prometheus::Counter& ingest_in_;
  prometheus::Counter& ingest_stored_;
  prometheus::Histogram& attention_seconds_;
  prometheus::Family<prometheus::Gauge>& model_calibrated_;

  std::mutex mu_;  // serializes Refresh (counter deltas)
  int64_t seen_evictions_ = 0;
  int64_t seen_demotions_ = 0;
};

// A Collectable for an Exposer: calls `refresh` then collects `registry`.
// Keep the returned pointer alive as long as the Exposer may scrape it.
std::shared_ptr<prometheus::Collectable> MakeRefreshingCollectable(
    std::shared_ptr<prometheus::Registry> registry, std::function<void()> refresh);

}  // namespace oscarkv

#endif  // OSCARKV_SERVER_SERVICE_SERVER_METRICS_H_
