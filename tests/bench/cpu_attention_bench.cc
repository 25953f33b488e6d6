// CPU benchmark: decode attention over the compressed tiered cache against
// plain BF16 attention of the same code base, on one Qwen3-8B layer
// (32 q / 8 kv heads, D 128, G 128, S0 64, W 256, P 32), side by side in one
// run; plus quantization (EncodePages) throughput.
//
//   cpu_attention_bench [--tokens=8192,32768,131072] [--reps=N] [--threads=N]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kernels/cpu/attention_cpu.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/parallel.h"
#include "kernels/hadamard.h"
#include "server/cache/layer_cache.h"

namespace oscarkv {
namespace {

constexpr int kQHeads = 32, kKvHeads = 8, kDim = 128;

// Fast approximately Gaussian values (sum of 4 uniforms), a few outlier channels.
void FillBf16(bf16_bits* x, size_t n, uint64_t seed) {
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < n; ++i) {
    float acc = 0;
    for (int k = 0; k < 4; ++k) {
      s ^= s << 13;
      s ^= s >> 7;
      s ^= s << 17;
      acc += float(s >> 40) * (1.0f / 16777216.0f);
    }
    float val = (acc - 2.0f) * 1.7f;
    if ((i % kDim) == 5 || (i % kDim) == 77) val *= 10.0f;
    x[i] = FloatToBf16(val);
  }
}

double NowMs() {
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

template <typename F>
double MedianMs(int reps, F&& f) {
  f();  // warm-up
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const double a = NowMs();
    f();
    t.push_back(NowMs() - a);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int Run(const std::vector<int64_t>& lengths, int reps, int threads) {
  CpuBackend backend(threads);
  ParallelFor pool_threads(threads);
  const TierConfig tiers;
  const PageGeometry geom{kKvHeads, kDim, kDim, tiers.page_tokens};
  const size_t row = geom.exact_row_elems();
  const std::vector<double> h = HadamardMatrix(kDim);
  const std::vector<float> rot(h.begin(), h.end());
  LayerCodec codec{RotationRef{rot.data(), rot.data(), 0}, 0.96f, 0.92f};
  const float scale = 1.0f / std::sqrt(float(kDim));

  std::printf("oscarkv CPU attention benchmark: one layer, %d q / %d kv heads, D %d, G %d, "
              "S0 %d, W %d, P %d, %d threads, median of %d\n",
              kQHeads, kKvHeads, kDim, kDim, tiers.sink_tokens, tiers.recent_window,
              tiers.page_tokens, threads, reps);
  std::printf("%8s | %10s %10s | %10s %10s | %7s | %6s\n", "tokens", "bf16 ms", "bf16 MB",
              "oscar ms", "oscar MB", "speedup", "bits");
  for (int64_t t : lengths) {
    std::vector<bf16_bits> k(size_t(t) * row), v(size_t(t) * row);
    FillBf16(k.data(), k.size(), 1 + t);
    FillBf16(v.data(), v.size(), 2 + t);
    std::vector<float> q(kQHeads * kDim);
    for (size_t i = 0; i < q.size(); ++i) q[i] = Bf16ToFloat(k[(i * 7919) % k.size()]) * 0.1f;

    const TierCounts c = CountTiers(tiers, t);
    PoolOptions o;
    o.page_bytes = geom.page_bytes();
    o.block_bytes = geom.exact_block_bytes();
    const size_t blocks = c.sink_blocks + c.recent_blocks + kMaxStagedPages + 2;
    o.total_bytes = (c.pages + 1) * o.page_bytes + blocks * o.block_bytes;
    o.exact_fraction = double(blocks * o.block_bytes) / o.total_bytes;
    auto pool = PagePool::Create(&backend, o);
    if (!pool.ok()) {
      std::fprintf(stderr, "pool: %s\n", pool.status().ToString().c_str());
      return 1;
    }
    LayerCache layer(tiers, geom);
    const AppendPlan plan = layer.Plan(t);
    auto res = (*pool)->Reserve(plan.pages, plan.peak_blocks);
    if (!res.ok()) {
      std::fprintf(stderr, "reserve: %s\n", res.status().ToString().c_str());
      return 1;
    }
    const double enc0 = NowMs();
    absl::Status s = layer.Append(k.data(), v.data(), t, codec, **pool, *res, backend, nullptr);
    const double ingest_ms = NowMs() - enc0;
    if (!s.ok()) {
      std::fprintf(stderr, "append: %s\n", s.ToString().c_str());
      return 1;
    }
    std::vector<ExactBlockRef> exact;
    std::vector<const uint8_t*> pages;
    layer.AttendRefs(**pool, &exact, &pages);
    std::vector<float> out(kQHeads * kDim), lse(kQHeads), out_bf(kQHeads * kDim), lse_bf(kQHeads);
    AttendItem item{q.data(), out.data(), lse.data(), codec.rotation, exact.data(),
                    int(exact.size()), pages.data(), int(pages.size())};
    AttendBatch batch{geom, kQHeads, scale, &item, 1};
    const double oscar_ms = MedianMs(reps, [&] { (void)backend.Attend(batch); });
    const double bf16_ms = MedianMs(reps, [&] {
      pool_threads.Run(kKvHeads, [&](int hh) {
        AttendBf16KvHead(k.data(), v.data(), int(t), kKvHeads, kDim, kQHeads, scale, q.data(),
                         out_bf.data(), lse_bf.data(), hh);
      });
    });
    const double bf16_mb = double(t) * row * 2 * 2 / 1e6;
    const double oscar_bytes = double(c.pages) * geom.page_bytes() +
                               double(c.sink + c.recent) * row * 2 * 2;
    const double bits = oscar_bytes * 8 / (double(t) * row * 2);
    double num = 0, den = 0;
    for (size_t i = 0; i < out.size(); ++i) {
      num += (out[i] - out_bf[i]) * (out[i] - out_bf[i]);
      den += out_bf[i] * out_bf[i];
    }
    std::printf("%8lld | %10.2f %10.1f | %10.2f %10.1f | %6.2fx | %6.2f   (rel. err vs bf16 %.3f; "
                "ingest+encode %.0f ms = %.0f ktok/s)\n",
                (long long)t, bf16_ms, bf16_mb, oscar_ms, oscar_bytes / 1e6, bf16_ms / oscar_ms,
                bits, std::sqrt(num / den), ingest_ms, t / ingest_ms);
    layer.Release(**pool);
  }

  // Quantization throughput: EncodePages over 512 full blocks (16K tokens, all heads, K and V).
  {
    const int nblocks = 512;
    PoolOptions o{0, 0.5, geom.page_bytes(), geom.exact_block_bytes()};
    o.total_bytes = 2 * nblocks * o.block_bytes + 64;
    o.exact_fraction = 0.5;
    auto pool = PagePool::Create(&backend, o);
    auto res = (*pool)->Reserve(nblocks, nblocks);
    if (!res.ok()) return 1;
    std::vector<EncodeJob> jobs;
    for (int b = 0; b < nblocks; ++b) {
      bf16_bits* blk = (*pool)->block(res->TakeBlock());
      FillBf16(blk, 2 * geom.page_tokens * row, 100 + b);
      jobs.push_back(EncodeJob{blk, (*pool)->page(res->TakePage()), codec.rotation, 0.96f, 0.92f});
    }
    const double ms = MedianMs(reps, [&] { (void)backend.EncodePages(geom, jobs.data(), nblocks); });
    const double tokens = double(nblocks) * geom.page_tokens;
    std::printf("quantize (rotate+clip+INT2+pack, K and V, 8 heads): %.0f tokens/s, %.2f GB/s "
                "of BF16 in (%d threads)\n",
                tokens / (ms / 1e3), tokens * row * 4 / (ms / 1e3) / 1e9, threads);
  }
  return 0;
}

}  // namespace
}  // namespace oscarkv

int main(int argc, char** argv) {
  std::vector<int64_t> lengths = {8192, 32768, 131072};
  int reps = 5, threads = 0;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--tokens=", 0) == 0) {
      lengths.clear();
      for (const char* p = a.c_str() + 9; *p;) {
        lengths.push_back(std::strtoll(p, const_cast<char**>(&p), 10));
        if (*p == ',') ++p;
      }
    } else if (a.rfind("--reps=", 0) == 0) {
      reps = std::atoi(a.c_str() + 7);
    } else if (a.rfind("--threads=", 0) == 0) {
      threads = std::atoi(a.c_str() + 10);
    } else {
      std::fprintf(stderr, "usage: %s [--tokens=8192,32768,131072] [--reps=5] [--threads=N]\n",
                   argv[0]);
      return 2;
    }
  }
  if (threads <= 0) threads = std::max(1u, std::thread::hardware_concurrency());
  return oscarkv::Run(lengths, std::max(reps, 1), threads);
}
