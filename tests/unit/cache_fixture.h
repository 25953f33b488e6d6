// A LayerCache on the CPU backend with its pool and rotation, for tests.
#ifndef OSCARKV_TESTS_UNIT_CACHE_FIXTURE_H_
#define OSCARKV_TESTS_UNIT_CACHE_FIXTURE_H_

#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/quantize.h"
#include "server/cache/layer_cache.h"
#include "tests/unit/test_util.h"

namespace oscarkv::testing {

struct CacheFixture {
  CacheFixture(int kv_heads, int dim, int group, TierConfig tiers, size_t pool_bytes = 64 << 20,
               uint64_t seed = 1)
      : backend(2), tiers(tiers), geom{kv_heads, dim, group, tiers.page_tokens} {
    PoolOptions o;
    o.total_bytes = pool_bytes;
    o.exact_fraction = 0.5;
    o.page_bytes = geom.page_bytes();
    o.block_bytes = geom.exact_block_bytes();
    auto p = PagePool::Create(&backend, o);
    EXPECT_TRUE(p.ok()) << p.status();
    pool = std::move(*p);
    r_k = RandomOrthogonal(dim, seed);
    r_v = RandomOrthogonal(dim, seed + 1);
    codec.rotation = RotationRef{r_k.data(), r_v.data(), 0};
  }

  LayerCache NewLayer() const { return LayerCache(tiers, geom); }

  // Appends n tokens of k/v (host [n][H][D]) with a reservation planned for it.
  absl::Status Append(LayerCache& layer, const bf16_bits* k, const bf16_bits* v, int64_t n) {
    const AppendPlan plan = layer.Plan(n);
    auto res = pool->Reserve(plan.pages, plan.peak_blocks);
    if (!res.ok()) return res.status();
    return layer.Append(k, v, n, codec, *pool, *res, backend, &demotions);
  }

  CpuBackend backend;
  TierConfig tiers;
  PageGeometry geom;
  std::unique_ptr<PagePool> pool;
  std::vector<float> r_k, r_v;
  LayerCodec codec;
  int demotions = 0;
};

}  // namespace oscarkv::testing

#endif  // OSCARKV_TESTS_UNIT_CACHE_FIXTURE_H_
