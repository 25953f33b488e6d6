#include "server/service/server_metrics.h"

#include <utility>

namespace oscarkv {
namespace {

using prometheus::BuildCounter;
using prometheus::BuildGauge;
using prometheus::BuildHistogram;

const prometheus::Histogram::BucketBoundaries& RpcBuckets() {
  static const auto* b = new prometheus::Histogram::BucketBoundaries{
      50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3,
      100e-3, 250e-3, 500e-3, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0};
  return *b;
}

class RefreshingCollectable final : public prometheus::Collectable {
 public:
  RefreshingCollectable(std::shared_ptr<prometheus::Registry> registry,
                        std::function<void()> refresh)
      : registry_(std::move(registry)), refresh_(std::move(refresh)) {}
  std::vector<prometheus::MetricFamily> Collect() const override {
    if (refresh_) refresh_();
    return registry_->Collect();
  }

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  std::function<void()> refresh_;
};

}  // namespace

ServerMetrics::ServerMetrics(prometheus::Registry& r)
    : rpc_seconds_(BuildHistogram()
                       .Name("oscarkv_rpc_duration_seconds")
                       .Help("Server-side RPC latency by method and final status code")
                       .Register(r)),
      memory_bytes_(BuildGauge()
                        .Name("oscarkv_memory_bytes")
                        .Help("Cache payload bytes of committed sequences by tier "
                              "(history pages, BF16 sink and recent rows), and free pool bytes")
                        .Register(r)),
      pool_bytes_(BuildGauge()
                      .Name("oscarkv_pool_bytes")
                      .Help("Pool slot bytes by slot class and state")
                      .Register(r)),
      tokens_(BuildGauge()
                  .Name("oscarkv_tokens")
                  .Help("Tokens of committed sequences by tier, summed over layers")
                  .Register(r)),
      bytes_per_element_(BuildGauge()
                             .Name("oscarkv_stored_bytes_per_element")
                             .Help("Stored bytes per K/V element over committed sequences "
                                   "(x8 = effective bits per element; BF16 is 2)")
                             .Register(r)
                             .Add({})),
      compression_ratio_(BuildGauge()
                             .Name("oscarkv_compression_ratio")
                             .Help("BF16 bytes over stored bytes, committed sequences")
                             .Register(r)
                             .Add({})),
      sequences_(BuildGauge()
                     .Name("oscarkv_sequences")
                     .Help("Sequences by state (committed, ingesting)")
                     .Register(r)),
      evictions_(BuildCounter()
                     .Name("oscarkv_evictions_total")
                     .Help("Sequences evicted to make room (LRU policy)")
                     .Register(r)
                     .Add({})),
      demotions_(BuildCounter()
                     .Name("oscarkv_demotions_total")
                     .Help("History pages encoded from the recent tier")
                     .Register(r)
                     .Add({})),
      ingest_bytes_(BuildCounter()
                        .Name("oscarkv_ingest_bytes_total")
                        .Help("Ingest bytes: BF16 K/V received (bf16_in) and pool bytes of "
                              "committed PutKv streams (stored)")
                        .Register(r)),
      ingest_in_(ingest_bytes_.Add({{"kind", "bf16_in"}})),
      ingest_stored_(ingest_bytes_.Add({{"kind", "stored"}})),
      attention_seconds_(BuildHistogram()
                             .Name("oscarkv_attention_compute_seconds")
                             .Help("Backend attention time per item (one sequence, one layer)")
                             .Register(r)
                             .Add({}, RpcBuckets())),
      model_calibrated_(BuildGauge()
                            .Name("oscarkv_model_calibrated")
                            .Help("1 if the model uses a calibrated rotation, 0 for the "
                                  "data-free Hadamard default")
                            .Register(r)) {}

void ServerMetrics::ObserveRpc(const std::string& method, absl::StatusCode code,
                               double seconds) {
  rpc_seconds_.Add({{"method", method}, {"code", absl::StatusCodeToString(code)}}, RpcBuckets())
      .Observe(seconds);
}

void ServerMetrics::AddIngestBytesIn(int64_t bytes) { ingest_in_.Increment(double(bytes)); }
void ServerMetrics::AddIngestBytesStored(int64_t bytes) {
  ingest_stored_.Increment(double(bytes));
}
void ServerMetrics::ObserveAttention(double seconds) { attention_seconds_.Observe(seconds); }

void ServerMetrics::Refresh(const StoreStats& s,
                            const std::vector<std::shared_ptr<const ModelEntry>>& models) {
  std::lock_guard<std::mutex> lock(mu_);
  const TierTotals& c = s.committed;
  const int64_t sink_bytes = c.sink_bytes;
  memory_bytes_.Add({{"tier", "history"}}).Set(double(c.history_bytes));
  memory_bytes_.Add({{"tier", "sink"}}).Set(double(sink_bytes));
  memory_bytes_.Add({{"tier", "recent"}}).Set(double(c.exact_bytes - sink_bytes));
  memory_bytes_.Add({{"tier", "free"}}).Set(double(s.pool_free_bytes));
  pool_bytes_.Add({{"slot", "page"}, {"state", "used"}}).Set(double(s.pool_history_bytes));
  pool_bytes_.Add({{"slot", "block"}, {"state", "used"}}).Set(double(s.pool_exact_bytes));
  pool_bytes_.Add({{"slot", "all"}, {"state", "free"}}).Set(double(s.pool_free_bytes));
  pool_bytes_.Add({{"slot", "all"}, {"state", "total"}}).Set(double(s.pool_total_bytes));
  tokens_.Add({{"tier", "sink"}}).Set(double(c.sink_tokens));
  tokens_.Add({{"tier", "history"}}).Set(double(c.history_tokens));
  tokens_.Add({{"tier", "recent"}}).Set(double(c.recent_tokens));
  const double bits = c.effective_bits();
  bytes_per_element_.Set(bits / 8.0);
  compression_ratio_.Set(bits > 0 ? 16.0 / bits : 0.0);
  sequences_.Add({{"state", "committed"}}).Set(double(s.sequences));
  sequences_.Add({{"state", "ingesting"}}).Set(double(s.ingesting));
  if (s.evictions > seen_evictions_) evictions_.Increment(double(s.evictions - seen_evictions_));
  if (s.demotions > seen_demotions_) demotions_.Increment(double(s.demotions - seen_demotions_));
  seen_evictions_ = std::max(seen_evictions_, s.evictions);
  seen_demotions_ = std::max(seen_demotions_, s.demotions);
  for (const auto& m : models) {
    model_calibrated_.Add({{"model", m->name}, {"objective", m->rotation.objective}})
        .Set(m->rotation.calibrated() ? 1.0 : 0.0);
  }
}

std::shared_ptr<prometheus::Collectable> MakeRefreshingCollectable(
    std::shared_ptr<prometheus::Registry> registry, std::function<void()> refresh) {
  return std::make_shared<RefreshingCollectable>(std::move(registry), std::move(refresh));
}

}  // namespace oscarkv
