// oscarkv-codec-demo: the codec and the tiers on one Qwen3-8B-shaped layer
// (32 q / 8 kv heads, D 128) with a realistic synthetic cache: compresses T
// tokens, attends with several decode queries, and prints the memory saved,
// the attention error against BF16 and the timings. No server involved.
//
//   oscarkv-codec-demo [--tokens=32768] [--threads=N]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "kernels/calib/calibrate.h"
#include "kernels/calib/synthetic.h"
#include "kernels/cpu/attention_cpu.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/rotation.h"
#include "kernels/status_macros.h"
#include "server/cache/layer_cache.h"

namespace oscarkv {
namespace {

double NowMs() {
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct DemoResult {
  double mean_err = 0, worst_err = 0, oscar_ms = 0, bf16_ms = 0;
  int needle_kept = 0, needle_trials = 0;
};

// Compresses `data` with `lr` through the real tiers and CPU backend, attends
// with every query and compares with BF16 attention over the uncompressed cache.
absl::StatusOr<DemoResult> CompressAndAttend(const SyntheticLayer& data, const LayerRotation& lr,
                                             const TierConfig& tiers, CpuBackend& backend,
                                             ParallelFor& par, bool print_memory) {
  const int d = data.head_dim, hkv = data.num_kv_heads, hq = data.num_q_heads;
  const int tokens = data.tokens;
  const PageGeometry geom{hkv, d, d, tiers.page_tokens};
  const TierCounts counts = CountTiers(tiers, tokens);
  PoolOptions o;
  o.page_bytes = geom.page_bytes();
  o.block_bytes = geom.exact_block_bytes();
  const size_t blocks = counts.sink_blocks + counts.recent_blocks + kMaxStagedPages + 2;
  o.total_bytes = size_t(counts.pages + 1) * o.page_bytes + blocks * o.block_bytes;
  o.exact_fraction = double(blocks * o.block_bytes) / o.total_bytes;
  OSCARKV_ASSIGN_OR_RETURN(std::unique_ptr<PagePool> pool, PagePool::Create(&backend, o));
  LayerCodec codec{RotationRef{lr.r_k.data(), lr.r_v.data(), 0}, lr.clip_k, lr.clip_v};
  LayerCache layer(tiers, geom);
  const AppendPlan plan = layer.Plan(tokens);
  OSCARKV_ASSIGN_OR_RETURN(Reservation res, pool->Reserve(plan.pages, plan.peak_blocks));
  int demotions = 0;
  double t0 = NowMs();
  OSCARKV_RETURN_IF_ERROR(layer.Append(data.k.data(), data.v.data(), tokens, codec, *pool, res,
                                       backend, &demotions));
  const double ingest_ms = NowMs() - t0;
  if (print_memory) {
    const size_t row = geom.exact_row_elems();
    const double bf16_bytes = double(tokens) * row * 2 * 2;
    const double stored = double(counts.pages) * geom.page_bytes() +
                          double(counts.sink + counts.recent) * row * 2 * 2;
    std::printf("  memory: BF16 %.1f MB -> stored %.1f MB (%.2fx smaller); effective %.2f bits "
                "per element (history %.2f)\n",
                bf16_bytes / 1e6, stored / 1e6, bf16_bytes / stored,
                stored * 8 / (double(tokens) * row * 2), 2.0 + 32.0 / geom.group_size);
    std::printf("  tiers: sink %lld, history %lld (%d pages), recent %lld tokens; %d demotions; "
                "ingest+quantize %.0f ms (%.0f tokens/s)\n",
                (long long)counts.sink, (long long)counts.history, counts.pages,
                (long long)counts.recent, demotions, ingest_ms, tokens / ingest_ms * 1e3);
  }
  std::vector<ExactBlockRef> exact;
  std::vector<const uint8_t*> pages;
  layer.AttendRefs(*pool, &exact, &pages);
  const float scale = 1.0f / std::sqrt(float(d));
  std::vector<float> out(hq * d), lse(hq), ref(hq * d), ref_lse(hq);
  DemoResult r;
  double err_sum = 0;
  for (int qi = 0; qi < data.num_queries; ++qi) {
    const float* q = data.q.data() + size_t(qi) * hq * d;
    AttendItem item{q, out.data(), lse.data(), codec.rotation, exact.data(), int(exact.size()),
                    pages.data(), int(pages.size())};
    AttendBatch batch{geom, hq, scale, &item, 1};
    t0 = NowMs();
    OSCARKV_RETURN_IF_ERROR(backend.Attend(batch));
    r.oscar_ms += NowMs() - t0;
    t0 = NowMs();
    par.Run(hkv, [&](int h) {
      AttendBf16KvHead(data.k.data(), data.v.data(), tokens, hkv, d, hq, scale, q, ref.data(),
                       ref_lse.data(), h);
    });
    r.bf16_ms += NowMs() - t0;
    double num = 0, den = 0;
    for (size_t i = 0; i < out.size(); ++i) {
      num += (out[i] - ref[i]) * (out[i] - ref[i]);
      den += double(ref[i]) * ref[i];
    }
    const double e = std::sqrt(num / den);
    err_sum += e;
    r.worst_err = std::max(r.worst_err, e);
  }
  const int n = data.num_queries;
  r.mean_err = err_sum / n;
  r.oscar_ms /= n;
  r.bf16_ms /= n;
  layer.Release(*pool);
  return r;
}

int Run(int tokens, int threads) {
  const ModelLayout layout{1, 32, 8, 128};
  const TierConfig tiers;
  const int d = layout.head_dim;
  std::printf("oscarkv codec demo: one Qwen3-8B-shaped layer (%d q / %d kv heads, D %d), %d "
              "tokens, tiers S0=%d W=%d P=%d, INT2 with G=%d, CPU backend (%d threads)\n",
              layout.num_q_heads, layout.num_kv_heads, d, tokens, tiers.sink_tokens,
              tiers.recent_window, tiers.page_tokens, d, threads);

  SyntheticSpec spec;
  spec.num_q_heads = layout.num_q_heads;
  spec.num_kv_heads = layout.num_kv_heads;
  spec.head_dim = d;
  spec.tokens = tokens;
  spec.num_queries = 8;
  double t0 = NowMs();
  auto data = GenerateSyntheticLayer(spec, 0);
  if (!data.ok()) {
    std::fprintf(stderr, "error: %s\n", data.status().ToString().c_str());
    return 1;
  }
  std::printf("  generated a synthetic cache (outlier key channels, attention sink, needle at "
              "token %d) in %.0f ms\n",
              data->needle, NowMs() - t0);

  // OSCAR: calibrate on other tokens of the same distribution (held out).
  SyntheticSpec calib_spec = spec;
  calib_spec.tokens = 2048;
  calib_spec.num_queries = calib_spec.tokens;
  calib_spec.sample_seed = spec.sample_seed + 1;
  t0 = NowMs();
  auto calib_data = GenerateSyntheticLayer(calib_spec, 0);
  auto acts = calib_data.ok() ? ActivationsFromSynthetic(*calib_data)
                              : absl::StatusOr<LayerActivations>(calib_data.status());
  CalibrationOptions copts;
  auto oscar = acts.ok() ? CalibrateLayer(*acts, copts, nullptr)
                         : absl::StatusOr<LayerRotation>(acts.status());
  if (!oscar.ok()) {
    std::fprintf(stderr, "error: calibration: %s\n", oscar.status().ToString().c_str());
    return 1;
  }
  std::printf("  calibrated OSCAR rotations on %d other tokens in %.0f ms\n", calib_spec.tokens,
              NowMs() - t0);

  auto hadamard = HadamardRotation(layout);
  CpuBackend backend(threads);
  ParallelFor par(threads);
  struct Row {
    const char* name;
    const LayerRotation* rotation;
  };
  const Row rows[] = {{"Hadamard (data-free default)", &hadamard->layers[0]},
                      {"OSCAR (calibrated, held-out)", &*oscar}};
  bool first = true;
  for (const Row& row : rows) {
    auto r = CompressAndAttend(*data, *row.rotation, tiers, backend, par, first);
    first = false;
    if (!r.ok()) {
      std::fprintf(stderr, "error: %s\n", r.status().ToString().c_str());
      return 1;
    }
    std::printf("  %-30s attention error vs BF16 (%d queries): mean %.4f, worst %.4f; time per "
                "query %.2f ms vs BF16 %.2f ms (%.2fx)\n",
                row.name, data->num_queries, r->mean_err, r->worst_err, r->oscar_ms, r->bf16_ms,
                r->bf16_ms / r->oscar_ms);
  }
  return 0;
}

}  // namespace
}  // namespace oscarkv

int main(int argc, char** argv) {
  int tokens = 32768, threads = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--tokens=", 0) == 0) {
      tokens = std::atoi(a.c_str() + 9);
    } else if (a.rfind("--threads=", 0) == 0) {
      threads = std::atoi(a.c_str() + 10);
    } else {
      std::fprintf(stderr,
                   "usage: %s [--tokens=32768] [--threads=N]\n"
                   "Compresses a synthetic Qwen3-8B-shaped layer with the OSCAR codec and "
                   "compares attention with BF16.\n",
                   argv[0]);
      return a == "--help" ? 0 : 2;
    }
  }
  if (tokens <= 0) {
    std::fprintf(stderr, "error: --tokens must be positive\n");
    return 2;
  }
  if (threads <= 0) threads = int(std::max(1u, std::thread::hardware_concurrency()));
  return oscarkv::Run(tokens, threads);
}
