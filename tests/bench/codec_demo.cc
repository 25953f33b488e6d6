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

#include "kernels/calib/synthetic.h"
#include "kernels/cpu/attention_cpu.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/rotation.h"
#include "server/cache/layer_cache.h"

namespace oscarkv {
namespace {

double NowMs() {
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
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

  auto rotation = HadamardRotation(layout);
  const LayerRotation& lr = rotation->layers[0];
  CpuBackend backend(threads);
  const PageGeometry geom{layout.num_kv_heads, d, d, tiers.page_tokens};
  const TierCounts counts = CountTiers(tiers, tokens);
  PoolOptions o;
  o.page_bytes = geom.page_bytes();
  o.block_bytes = geom.exact_block_bytes();
  const size_t blocks = counts.sink_blocks + counts.recent_blocks + kMaxStagedPages + 2;
  o.total_bytes = size_t(counts.pages + 1) * o.page_bytes + blocks * o.block_bytes;
  o.exact_fraction = double(blocks * o.block_bytes) / o.total_bytes;
  auto pool = PagePool::Create(&backend, o);
  if (!pool.ok()) {
    std::fprintf(stderr, "error: %s\n", pool.status().ToString().c_str());
    return 1;
  }
  LayerCodec codec{RotationRef{lr.r_k.data(), lr.r_v.data(), 0}, lr.clip_k, lr.clip_v};
  LayerCache layer(tiers, geom);
  const AppendPlan plan = layer.Plan(tokens);
  auto res = (*pool)->Reserve(plan.pages, plan.peak_blocks);
  int demotions = 0;
  t0 = NowMs();
  absl::Status s = res.ok() ? layer.Append(data->k.data(), data->v.data(), tokens, codec, **pool,
                                           *res, backend, &demotions)
                            : res.status();
  const double ingest_ms = NowMs() - t0;
  if (!s.ok()) {
    std::fprintf(stderr, "error: %s\n", s.ToString().c_str());
    return 1;
  }
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

  std::vector<ExactBlockRef> exact;
  std::vector<const uint8_t*> pages;
  layer.AttendRefs(**pool, &exact, &pages);
  const int hq = layout.num_q_heads;
  const float scale = 1.0f / std::sqrt(float(d));
  std::vector<float> out(hq * d), lse(hq), ref(hq * d), ref_lse(hq);
  ParallelFor par(threads);
  double err_sum = 0, worst = 0, t_oscar = 0, t_bf16 = 0;
  for (int qi = 0; qi < spec.num_queries; ++qi) {
    const float* q = data->q.data() + size_t(qi) * hq * d;
    AttendItem item{q, out.data(), lse.data(), codec.rotation, exact.data(), int(exact.size()),
                    pages.data(), int(pages.size())};
    AttendBatch batch{geom, hq, scale, &item, 1};
    t0 = NowMs();
    (void)backend.Attend(batch);
    t_oscar += NowMs() - t0;
    t0 = NowMs();
    par.Run(layout.num_kv_heads, [&](int h) {
      AttendBf16KvHead(data->k.data(), data->v.data(), tokens, layout.num_kv_heads, d, hq, scale,
                       q, ref.data(), ref_lse.data(), h);
    });
    t_bf16 += NowMs() - t0;
    double num = 0, den = 0;
    for (size_t i = 0; i < out.size(); ++i) {
      num += (out[i] - ref[i]) * (out[i] - ref[i]);
      den += double(ref[i]) * ref[i];
    }
    const double e = std::sqrt(num / den);
    err_sum += e;
    worst = std::max(worst, e);
  }
  const int n = spec.num_queries;
  std::printf("  attention (%d decode queries): relative error vs BF16 mean %.4f, worst %.4f\n", n,
              err_sum / n, worst);
  std::printf("  attention time per query: compressed %.2f ms, BF16 %.2f ms (%.2fx)\n",
              t_oscar / n, t_bf16 / n, t_bf16 / t_oscar);
  layer.Release(**pool);
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
