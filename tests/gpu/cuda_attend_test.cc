// GPU decode attention over the tiered compressed cache vs the CPU backend and
// vs the fp64 reference over the dequantized cache (kernels/reference.h).
//
// Stated tolerances (measured figures are printed):
//   ‖o_gpu − o_ref‖ / ‖o_ref‖ < 1e-4 per item, elementwise |o_gpu − o_cpu|
//   < 1e-4·(1 + |o_cpu|) where a test compares elements, |lse_gpu − lse_ref|
//   < 1e-4, the same against the CPU backend (kOutTol, kLseTol); 1e-3 for
//   the outputs of batches that run the 16-bit P' path (kOutTol16, OutTol).
//   The GPU computes q·k with fp16 hi/lo query columns or int8 query digits
//   and exact codes (fp32-level), and p·v with bf16 hi/lo probabilities
//   (~2^-17 of each term) times the V codes less a center (2 and 1 in turn:
//   the tensor cores' truncating adder made uncentered sums drift over long
//   units, ~1e-4 at 300 pages per unit; LongUnitsOfTheFloatValuePath-
//   MatchReference) or with P' as 24-bit fixed point of each chunk's
//   bound (variants 6, 7: ~2^-23 of it per term): errors of 1e-6..1e-5. The
//   default for D = 128, G = D, g <= 4 (variant 14, as 8) keeps P' in 16-bit fixed
//   point of each chunk's max P' (2^-17 of it per term), and the min term
//   of the asymmetric codes cancels part of the code term, so an output
//   element near 0 keeps less: measured up to 6.3e-5 (relative L2) and
//   5.0e-4·(1 + |o|) (one element), H200, 2026-11-29. That is still below
//   BF16's rounding of the output (2^-9 relative) and ~500 times below the
//   2-bit cache's own error against BF16 attention (~0.25); the code it
//   shares with variant 6 is tested at 1e-4 through variant 6
//   (tests/gpu/run_all.sh), and an error in its own P' path (a digit, a
//   scale) moves the output by far more than 1e-3.
// Outputs are poisoned with NaN before each run; every element must be finite.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/attend_kernels.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/quantize.h"
#include "kernels/reference.h"
#include "tests/gpu/gpu_test_util.h"

namespace oscarkv {
namespace {

// The stated tolerances (see the top of this file).
constexpr double kOutTol = 1e-4;
constexpr double kOutTol16 = 1e-3;
constexpr double kLseTol = 1e-4;

// The tolerance on the outputs of a batch of this shape under the variant a
// launcher of this process starts with (OSCARKV_CUDA_ATTEND_VARIANT, else the
// default). Called only when a device is present.
double OutTol(int head_dim, int group_size, int gqa) {
  static const int variant = [] {
    auto launcher = AttendLauncher::Create(0);
    return launcher.ok() ? (*launcher)->variant() : AttendLauncher::kDefaultVariant;
  }();
  return AttendLauncher::UsesFixedPoint16(variant, head_dim, group_size, gqa) ? kOutTol16 : kOutTol;
}

using gputest::EncodePagesOnCpu;
using gputest::RandomKvRows;
using gputest::RandomRotations;
using gputest::SplitTiers;
using gputest::Tiers;
using gputest::Upload;

Backend* gpu = nullptr;

class CudaAttendEnv : public ::testing::Environment {
 public:
  void SetUp() override {
    if (CudaDeviceCount() == 0) return;
    auto b = CreateCudaBackend(0);
    if (b.ok()) gpu = b->release();
  }
  void TearDown() override {
    delete gpu;
    gpu = nullptr;
  }
};
const auto* const kEnv = ::testing::AddGlobalTestEnvironment(new CudaAttendEnv);

struct Config {
  int dim, gqa, group, kv_heads, sink, window, page_tokens;
  bool per_head;
  std::vector<int> lengths;
  float q_sigma = 1.5f;  // spread of the random queries (larger: peakier attention)
  // > 0: the V rows of tokens t with (t / zero_v_run) % zero_v_every == 0 are
  // zero (V scale 0).
  int zero_v_every = 0, zero_v_run = 1;
  // > 0: the GPU's R_K and R_V start this many floats into their buffer
  // (1: not 16-byte aligned).
  int rotation_offset = 0;
};

struct Errors {
  double gpu_ref = 0, cpu_ref = 0, gpu_cpu = 0, lse_gpu_ref = 0, lse_gpu_cpu = 0;
  // Max over elements of |o_a − o_b| / (1 + |o_b|).
  double elem_gpu_ref = 0, elem_cpu_ref = 0, elem_gpu_cpu = 0;
};

// Builds every item's cache, runs GPU, CPU and the fp64 reference, returns the
// worst errors over the items. `inspect`, when given, sees the GPU's batch
// first (to check what a launcher plans for it).
Errors RunConfig(const Config& cf, uint64_t seed, int repeats = 1,
                 const std::function<void(const AttendBatch&)>& inspect = {}) {
  Errors worst;
  std::mt19937_64 rng(seed);
  const int H = cf.kv_heads, D = cf.dim, P = cf.page_tokens, Hq = H * cf.gqa;
  const PageGeometry geom{H, D, cf.group, P};
  const size_t row = size_t(H) * D;
  const size_t block_elems = geom.exact_block_bytes() / 2;
  const float scale = 1.0f / std::sqrt(float(D));
  auto rotations = RandomRotations(*gpu, D, cf.per_head ? H : 1, rng, cf.rotation_offset);
  EXPECT_TRUE(rotations.ok()) << rotations.status();
  if (!rotations.ok()) return worst;
  const RotationRef rot_host = rotations->host_ref(), rot_gpu = rotations->device_ref();

  const int n = static_cast<int>(cf.lengths.size());
  std::vector<std::vector<bf16_bits>> ks(n), vs(n);
  std::vector<std::vector<float>> qs(n);
  std::vector<Tiers> tiers(n);
  // Host exact blocks and pages, in one array each.
  std::vector<bf16_bits> exact_host;
  std::vector<uint8_t> pages_host;
  std::vector<std::vector<std::pair<size_t, int>>> item_exact(n);  // (block index, tokens)
  std::vector<std::vector<size_t>> item_pages(n);
  std::vector<bf16_bits> staging;  // exact blocks the pages are encoded from
  auto fill_block = [&](const std::vector<bf16_bits>& k, const std::vector<bf16_bits>& v,
                        int t0, int count, bf16_bits* dst) {
    std::fill(dst, dst + block_elems, FloatToBf16(1000.0f));  // unused rows: loud if read
    for (int t = 0; t < count; ++t) {
      std::memcpy(dst + t * row, &k[(t0 + t) * row], row * 2);
      std::memcpy(dst + size_t(P) * row + t * row, &v[(t0 + t) * row], row * 2);
    }
  };
  for (int i = 0; i < n; ++i) {
    const int T = cf.lengths[i];
    tiers[i] = SplitTiers(T, cf.sink, cf.window, P);
    ks[i] = RandomKvRows(size_t(T) * H, D, rng);
    vs[i] = RandomKvRows(size_t(T) * H, D, rng);
    for (int t = 0; cf.zero_v_every > 0 && t < T; ++t) {
      if ((t / cf.zero_v_run) % cf.zero_v_every != 0) continue;
      std::fill(vs[i].begin() + size_t(t) * row, vs[i].begin() + size_t(t + 1) * row, bf16_bits{0});
    }
    std::normal_distribution<float> nd(0.0f, cf.q_sigma);
    qs[i].resize(size_t(Hq) * D);
    for (auto& x : qs[i]) x = nd(rng);
    auto add_exact = [&](int t0, int count) {
      for (int s = 0; s < count; s += P) {
        const int c = std::min(P, count - s);
        const size_t idx = exact_host.size() / block_elems;
        exact_host.resize(exact_host.size() + block_elems);
        fill_block(ks[i], vs[i], t0 + s, c, &exact_host[idx * block_elems]);
        item_exact[i].push_back({idx, c});
      }
    };
    add_exact(0, tiers[i].sink);
    for (int p = 0; p < tiers[i].pages; ++p) {
      const size_t idx = staging.size() / block_elems;
      staging.resize(staging.size() + block_elems);
      fill_block(ks[i], vs[i], tiers[i].sink + p * P, P, &staging[idx * block_elems]);
      item_pages[i].push_back(idx);
    }
    add_exact(tiers[i].sink + tiers[i].pages * P, tiers[i].recent);
  }
  const size_t num_pages = staging.size() / block_elems;
  pages_host.assign(num_pages * geom.page_bytes(), 0);
  CpuBackend cpu(2);
  {
    std::vector<EncodeJob> jobs(num_pages);
    for (size_t p = 0; p < num_pages; ++p) {
      jobs[p] = EncodeJob{&staging[p * block_elems], &pages_host[p * geom.page_bytes()], rot_host,
                          0.96f, 0.92f};
    }
    EXPECT_TRUE(cpu.EncodePages(geom, jobs.data(), static_cast<int>(num_pages)).ok());
  }
  auto exact_dev = Upload(*gpu, exact_host.empty() ? std::vector<bf16_bits>(1) : exact_host);
  auto pages_dev = Upload(*gpu, pages_host.empty() ? std::vector<uint8_t>(1) : pages_host);
  EXPECT_TRUE(exact_dev.ok() && pages_dev.ok());

  // Items: host (CPU backend) and device (GPU) views of the cache; queries
  // and outputs are host memory for both.
  std::vector<std::vector<ExactBlockRef>> ex_cpu(n), ex_gpu(n);
  std::vector<std::vector<const uint8_t*>> pg_cpu(n), pg_gpu(n);
  std::vector<float> out_cpu(size_t(n) * Hq * D), lse_cpu(size_t(n) * Hq);
  std::vector<float> out_gpu(out_cpu.size()), lse_gpu(lse_cpu.size());
  std::vector<AttendItem> it_cpu(n), it_gpu(n);
  for (int i = 0; i < n; ++i) {
    for (auto [idx, c] : item_exact[i]) {
      ex_cpu[i].push_back({&exact_host[idx * block_elems], c});
      ex_gpu[i].push_back({exact_dev->as<bf16_bits>() + idx * block_elems, c});
    }
    for (size_t p : item_pages[i]) {
      pg_cpu[i].push_back(&pages_host[p * geom.page_bytes()]);
      pg_gpu[i].push_back(pages_dev->as<uint8_t>() + p * geom.page_bytes());
    }
    it_cpu[i] = AttendItem{qs[i].data(), &out_cpu[size_t(i) * Hq * D], &lse_cpu[size_t(i) * Hq],
                           rot_host, ex_cpu[i].data(), int(ex_cpu[i].size()), pg_cpu[i].data(),
                           int(pg_cpu[i].size())};
    it_gpu[i] = AttendItem{qs[i].data(), &out_gpu[size_t(i) * Hq * D], &lse_gpu[size_t(i) * Hq],
                           rot_gpu, ex_gpu[i].data(), int(ex_gpu[i].size()), pg_gpu[i].data(),
                           int(pg_gpu[i].size())};
  }
  EXPECT_TRUE(cpu.Attend(AttendBatch{geom, Hq, scale, it_cpu.data(), n}).ok());

  if (inspect) inspect(AttendBatch{geom, Hq, scale, it_gpu.data(), n});
  std::vector<float> first_out;
  for (int rep = 0; rep < repeats; ++rep) {
    // Poisoned before each run, so an output the call did not write shows.
    std::fill(out_gpu.begin(), out_gpu.end(), std::numeric_limits<float>::quiet_NaN());
    std::fill(lse_gpu.begin(), lse_gpu.end(), std::numeric_limits<float>::quiet_NaN());
    auto st = gpu->Attend(AttendBatch{geom, Hq, scale, it_gpu.data(), n});
    EXPECT_TRUE(st.ok()) << st;
    if (rep == 0) {
      first_out = out_gpu;
    } else {
      EXPECT_EQ(0, std::memcmp(first_out.data(), out_gpu.data(), out_gpu.size() * 4))
          << "repeated Attend gave different bits";
    }
  }

  // fp64 reference over the dequantized, un-rotated cache.
  for (int i = 0; i < n; ++i) {
    const int T = cf.lengths[i];
    std::vector<double> k(size_t(T) * row), v(size_t(T) * row), q(qs[i].begin(), qs[i].end());
    for (size_t e = 0; e < k.size(); ++e) {
      k[e] = Bf16ToFloat(ks[i][e]);
      v[e] = Bf16ToFloat(vs[i][e]);
    }
    for (int p = 0; p < tiers[i].pages; ++p) {
      const uint8_t* page = &pages_host[item_pages[i][p] * geom.page_bytes()];
      for (int h = 0; h < H; ++h) {
        for (int kind = 0; kind < 2; ++kind) {
          const float* r = (kind == 0 ? rot_host.r_k : rot_host.r_v) + rot_host.stride * h;
          for (int t = 0; t < P; ++t) {
            float y[256];
            DequantizeRow(page + geom.codes_offset(h, kind) + t * geom.code_row_bytes(),
                          reinterpret_cast<const QuantParams*>(page + geom.params_offset(h, kind)) +
                              t * geom.groups(),
                          D, cf.group, y);
            double* dst = &(kind == 0 ? k : v)[(size_t(tiers[i].sink + p * P + t) * H + h) * D];
            for (int a = 0; a < D; ++a) {
              double s = 0;
              for (int b = 0; b < D; ++b) s += double(y[b]) * r[size_t(a) * D + b];
              dst[a] = s;
            }
          }
        }
      }
    }
    std::vector<double> lse_ref;
    const auto ref = ReferenceAttention(q, k, v, T, Hq, H, D, scale, &lse_ref);
    double nr = 0, eg = 0, ec = 0, egc = 0;
    for (int e = 0; e < Hq * D; ++e) {
      const double og = out_gpu[size_t(i) * Hq * D + e], oc = out_cpu[size_t(i) * Hq * D + e];
      EXPECT_TRUE(std::isfinite(og)) << "item " << i << " element " << e << " not written";
      nr += ref[e] * ref[e];
      eg += (og - ref[e]) * (og - ref[e]);
      ec += (oc - ref[e]) * (oc - ref[e]);
      egc += (og - oc) * (og - oc);
      auto elem = [](double a, double b) { return std::fabs(a - b) / (1.0 + std::fabs(b)); };
      worst.elem_gpu_ref = std::max(worst.elem_gpu_ref, elem(og, ref[e]));
      worst.elem_cpu_ref = std::max(worst.elem_cpu_ref, elem(oc, ref[e]));
      worst.elem_gpu_cpu = std::max(worst.elem_gpu_cpu, elem(og, oc));
    }
    if (T == 0) {
      EXPECT_EQ(eg, 0.0) << "empty item must give zeros";
      for (int h = 0; h < Hq; ++h) EXPECT_EQ(lse_gpu[size_t(i) * Hq + h], -INFINITY);
      continue;
    }
    worst.gpu_ref = std::max(worst.gpu_ref, std::sqrt(eg / nr));
    worst.cpu_ref = std::max(worst.cpu_ref, std::sqrt(ec / nr));
    worst.gpu_cpu = std::max(worst.gpu_cpu, std::sqrt(egc / nr));
    for (int h = 0; h < Hq; ++h) {
      const double lg = lse_gpu[size_t(i) * Hq + h];
      worst.lse_gpu_ref = std::max(worst.lse_gpu_ref, std::fabs(lg - lse_ref[h]));
      worst.lse_gpu_cpu = std::max(worst.lse_gpu_cpu, std::fabs(lg - lse_cpu[size_t(i) * Hq + h]));
    }
  }
  return worst;
}

// The errors of a RunConfig within the tolerances of its shape: against the
// fp64 reference and the CPU backend, and the log-sum-exp.
void ExpectWithinTolerance(const Config& cf, const Errors& e) {
  EXPECT_LT(e.gpu_ref, OutTol(cf.dim, cf.group, cf.gqa));
  EXPECT_LT(e.gpu_cpu, OutTol(cf.dim, cf.group, cf.gqa));
  EXPECT_LT(e.lse_gpu_ref, kLseTol);
}

// A CUDA backend of its own, created with these environment variables set
// (the launcher reads OSCARKV_CUDA_ATTEND_* when it is made), on which
// RunConfig runs (`gpu`) while this is in scope.
class ScopedBackend {
 public:
  explicit ScopedBackend(std::initializer_list<std::pair<const char*, std::string>> env)
      : shared_(gpu) {
    std::vector<std::pair<const char*, std::string>> before;  // what was set
    for (const auto& [name, value] : env) {
      if (const char* old = std::getenv(name)) before.push_back({name, old});
      setenv(name, value.c_str(), 1);
    }
    auto b = CreateCudaBackend(0);
    for (const auto& [name, value] : env) unsetenv(name);
    for (const auto& [name, value] : before) setenv(name, value.c_str(), 1);
    status_ = b.status();
    if (b.ok()) {
      own_ = std::move(b).value();
      gpu = own_.get();
    }
  }
  ~ScopedBackend() { gpu = shared_; }
  ScopedBackend(const ScopedBackend&) = delete;
  ScopedBackend& operator=(const ScopedBackend&) = delete;
  const absl::Status& status() const { return status_; }

 private:
  Backend* shared_;
  std::unique_ptr<Backend> own_;
  absl::Status status_;
};

class CudaAttendTest : public ::testing::TestWithParam<std::tuple<int, int, int>> {
 protected:
  void SetUp() override {
    if (gpu == nullptr) GTEST_SKIP() << "no CUDA device";
  }
};

// Lengths around the tier boundaries of S0 = 8, W = 40, P = 32: sink only,
// sink + recent, the first page (S0 + W + P = 80), and longer sequences.
const std::vector<int> kBoundaryLengths = {0,  1,  7,   8,   9,   47,  48,   79,
                                           80, 81, 111, 112, 113, 200, 1000, 2500};

TEST_P(CudaAttendTest, MatchesCpuBackendAndFp64ReferenceAroundTierBoundaries) {
  const auto [dim, gqa, groups] = GetParam();
  const Config cf{dim, gqa, dim / groups, 2, 8, 40, 32, gqa == 4, kBoundaryLengths};
  const Errors e = RunConfig(cf, 1000 + dim + 10 * gqa + groups, /*repeats=*/2);
  std::printf("D=%d g=%d G=%d: rel err gpu/ref %.2e cpu/ref %.2e gpu/cpu %.2e, lse gpu/ref %.2e\n",
              dim, gqa, dim / groups, e.gpu_ref, e.cpu_ref, e.gpu_cpu, e.lse_gpu_ref);
  EXPECT_LT(e.gpu_ref, OutTol(dim, dim / groups, gqa));
  EXPECT_LT(e.gpu_cpu, OutTol(dim, dim / groups, gqa));
  EXPECT_LT(e.lse_gpu_ref, kLseTol);
  EXPECT_LT(e.lse_gpu_cpu, kLseTol);
}

INSTANTIATE_TEST_SUITE_P(HeadDimGqaGroups, CudaAttendTest,
                         ::testing::Combine(::testing::Values(64, 128, 256),
                                            ::testing::Values(1, 2, 4, 8), ::testing::Values(1, 2, 4)),
                         [](const auto& info) {
                           return "D" + std::to_string(std::get<0>(info.param)) + "_g" +
                                  std::to_string(std::get<1>(info.param)) + "_groups" +
                                  std::to_string(std::get<2>(info.param));
                         });

TEST(CudaAttendDefaults, Qwen3ShapeWithDefaultTiersMatchesReference) {
  if (gpu == nullptr) GTEST_SKIP() << "no CUDA device";
  const Config cf{128, 4, 128, 8, 64, 256, 32, false, {320, 351, 352, 353, 5000, 20000}};
  const Errors e = RunConfig(cf, 77);
  std::printf("Qwen3 shape: rel err gpu/ref %.2e cpu/ref %.2e, lse gpu/ref %.2e\n", e.gpu_ref,
              e.cpu_ref, e.lse_gpu_ref);
  EXPECT_LT(e.gpu_ref, OutTol(cf.dim, cf.group, cf.gqa));
  EXPECT_LT(e.lse_gpu_ref, kLseTol);
}

// Edge cases of the default history path for this shape (integer P·V):
// pages of 64 tokens (two 32-token chunks each), peakier attention (queries
// with 3x the usual spread, so p spreads widely inside a chunk), and zero V
// rows (V scale 0): every 5th token, or runs of 64 tokens every other run
// (whole chunks whose max s_V is 0).
TEST(CudaAttendDefaults, LongPagesPeakyAttentionAndZeroValueRowsMatchReference) {
  if (gpu == nullptr) GTEST_SKIP() << "no CUDA device";
  for (const auto [every, run] : {std::pair{5, 1}, std::pair{2, 64}}) {
    Config cf{128, 4, 128, 2, 8, 40, 64, false, {0, 100, 300, 1000, 2500}};
    cf.q_sigma = 4.5f;
    cf.zero_v_every = every;
    cf.zero_v_run = run;
    const Errors e = RunConfig(cf, 91 + run);
    std::printf("P=64, q x3, zero V rows (every %d of runs of %d): rel err gpu/ref %.2e "
                "cpu/ref %.2e gpu/cpu %.2e, lse gpu/ref %.2e\n",
                every, run, e.gpu_ref, e.cpu_ref, e.gpu_cpu, e.lse_gpu_ref);
    EXPECT_LT(e.gpu_ref, OutTol(cf.dim, cf.group, cf.gqa));
    EXPECT_LT(e.gpu_cpu, OutTol(cf.dim, cf.group, cf.gqa));
    EXPECT_LT(e.lse_gpu_ref, kLseTol);
    EXPECT_LT(e.lse_gpu_cpu, kLseTol);
  }
}

// Rotations that are not 16-byte aligned on the device (the prep kernel's
// and the 64-dim merge's scalar paths), per head and shared, in a batch of
// 6 items x 32 query heads: its merge grid of 32-dim slices (768 blocks) is
// more than an H200 holds at once, so it runs 64-dim slices.
TEST(CudaAttendDefaults, MisalignedRotationsMatchReference) {
  if (gpu == nullptr) GTEST_SKIP() << "no CUDA device";
  for (const bool per_head : {false, true}) {
    Config cf{128, 4, 128, 8, 64, 256, 32, per_head, {300, 700, 1200, 2000, 900, 1500}};
    cf.rotation_offset = 1;
    int merge_slice = 0;
    auto plan = [&](const AttendBatch& batch) {
      auto launcher = AttendLauncher::Create(0);
      ASSERT_TRUE(launcher.ok()) << launcher.status();
      ASSERT_TRUE((*launcher)->Prepare(batch, nullptr).ok());
      ASSERT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
      merge_slice = (*launcher)->schedule().merge_slice;
    };
    const Errors e = RunConfig(cf, 61 + per_head, 1, plan);
    // 768 blocks of 32 dims, 4 per SM (the 32-dim kernel's 123 registers):
    // more than an H200's 132 SMs hold; a GPU with 192 SMs would hold them.
    int sms = 0;
    ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
    if (4 * sms < 768) EXPECT_EQ(merge_slice, 64) << "on " << sms << " SMs";
    std::printf("misaligned rotations (per head %d): rel err gpu/ref %.2e gpu/cpu %.2e, "
                "lse gpu/ref %.2e\n",
                per_head, e.gpu_ref, e.gpu_cpu, e.lse_gpu_ref);
    EXPECT_LT(e.gpu_ref, OutTol(cf.dim, cf.group, cf.gqa));
    EXPECT_LT(e.gpu_cpu, OutTol(cf.dim, cf.group, cf.gqa));
    EXPECT_LT(e.lse_gpu_ref, kLseTol);
  }
}

// Exact blocks riding on the history units (forced with
// OSCARKV_CUDA_ATTEND_FOLD=1: by default they do only from kFoldPagesPerUnit
// pages per unit, ~20K tokens at B = 1 on an H200): batches with so much
// history that the default schedule would not count it as light either
// (> 16 x 396 (item, kv head, page) triples on an H200), next to items short
// enough to have no history at all (those keep exact units of their own).
TEST(CudaAttendDefaults, HeavyHistoryWithExactBlocksOnHistoryUnitsMatchesReference) {
  if (gpu == nullptr) GTEST_SKIP() << "no CUDA device";
  const ScopedBackend folded({{"OSCARKV_CUDA_ATTEND_FOLD", "1"}});
  ASSERT_TRUE(folded.status().ok()) << folded.status();
  const Config configs[] = {
      {128, 4, 128, 8, 64, 256, 32, false, {100, 300, 28000}},
      {64, 8, 32, 8, 8, 40, 32, true, {50, 27000, 7}},
      {256, 1, 128, 8, 64, 256, 32, false, {27000, 320}},
  };
  for (const Config& cf : configs) {
    const Errors e = RunConfig(cf, 91 + cf.dim);
    std::printf("heavy D=%d g=%d: rel err gpu/ref %.2e cpu/ref %.2e gpu/cpu %.2e, "
                "lse gpu/ref %.2e\n",
                cf.dim, cf.gqa, e.gpu_ref, e.cpu_ref, e.gpu_cpu, e.lse_gpu_ref);
    ExpectWithinTolerance(cf, e);
  }
}

// Variant 19: the history cut flat, so that units span two kv heads (the
// exact blocks of the next one, then its first pages as a second part).
// Planned for a wave of 53 units (OSCARKV_CUDA_ATTEND_WAVE_UNITS), so that
// the 30K-token item gets 27 units of ~300 pages for its 8 kv heads, as
// B8 64K gets 66 of ~260 on a whole H200 (the 110-page weight of a head's
// exact blocks then ends inside a unit), while the fp64 reference stays
// small; next to an item cut per head (one unit per kv head: too light for
// the flat share) and one without history (the CPU test
// AttendSchedule.TheGpuTestsFlatBatchHasUnitsOfEveryKind pins these
// plans). Exact blocks folded onto the history units (auto, forced) and in
// exact units of their own (never folded); every plan must be flat with
// units of both kinds, and the results those of the fp64 reference.
TEST(CudaAttendVariant, FlatCutUnitsAcrossKvHeadsMatchReference) {
  if (gpu == nullptr) GTEST_SKIP() << "no CUDA device";
  constexpr long kWave = 53;
  for (const char* fold : {"0", "1", "2"}) {
    const ScopedBackend flat({{"OSCARKV_CUDA_ATTEND_VARIANT", "19"},
                              {"OSCARKV_CUDA_ATTEND_FOLD", fold},
                              {"OSCARKV_CUDA_ATTEND_WAVE_UNITS", std::to_string(kWave)}});
    ASSERT_TRUE(flat.status().ok()) << flat.status();
    const Config cf{128, 4, 128, 8, 64, 256, 32, false, {30000, 9000, 300, 2000}};
    const bool folded = fold[0] != '2';
    int plans = 0;
    auto plan = [&](const AttendBatch& batch) {
      auto launcher = AttendLauncher::Create(0);
      ASSERT_TRUE(launcher.ok()) << launcher.status();
      AttendLauncher& L = **launcher;
      L.set_variant(AttendLauncher::kFlatCutVariant);
      L.set_fold_exact(cuda_attend::FoldExactFromNumber(std::atoi(fold)));
      L.set_wave_units(kWave);
      ASSERT_TRUE(L.Prepare(batch, nullptr).ok());
      ASSERT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
      const AttendSchedule& sc = L.schedule();
      EXPECT_TRUE(sc.flat_cut) << "fold " << fold;
      EXPECT_EQ(sc.variant, AttendLauncher::kFlatCutVariant);
      EXPECT_GT(sc.second_parts, 0) << "fold " << fold;
      if (folded) EXPECT_GT(sc.next_head_exact, 0) << "fold " << fold;
      ++plans;
    };
    const Errors e = RunConfig(cf, 123 + fold[0], 2, plan);
    EXPECT_GT(plans, 0);
    std::printf("flat cut (fold %s): rel err gpu/ref %.2e cpu/ref %.2e gpu/cpu %.2e, "
                "lse gpu/ref %.2e\n",
                fold, e.gpu_ref, e.cpu_ref, e.gpu_cpu, e.lse_gpu_ref);
    ExpectWithinTolerance(cf, e);
  }
}

// 6 and 8 query heads per kv head at D 128 on the integer path, both ways:
// paired heads (AttendLauncher::PairsHeads: two plan heads of 3 or 4, each
// unit of the kv heads' plan twice, PairHeadUnits; the plan heads read their
// kv head's pages, exact rows and rotations) and, with pairing off, the
// 8-head warp (HistoryWarpIntPv8). Per-head cuts (variant 14, the device's
// wave) and flat cuts with units across kv heads (variant 19 on a wave of 53
// units of the kv heads, 106 blocks when paired: the plan of
// FlatCutUnitsAcrossKvHeadsMatchReference, with second parts and the next
// head's exact blocks), exact blocks folded and in units of their own, next
// to items without history; against fp64 and the CPU backend with the
// 16-bit P' tolerance. (The float kernel of g = 8 at D 128, variant 3, is
// LongUnitsOfTheFloatValuePathMatchReference's.)
TEST(CudaAttendVariant, EightAndSixHeadsPerKvHeadOnTheIntegerPathMatchReference) {
  if (gpu == nullptr) GTEST_SKIP() << "no CUDA device";
  struct Plan {
    const char* variant;
    long wave;  // units of the kv heads' plan (0: the device's)
    const char* fold;
    int gqa;
  };
  for (const bool pair : {true, false}) {
    for (const Plan pl : {Plan{"14", 0, "2", 8}, Plan{"19", 53, "0", 8}, Plan{"19", 53, "1", 6},
                          Plan{"19", 53, "0", 7}}) {
      // g = 7 never pairs (the 8-head warp either way).
      const bool paired = pair && pl.gqa % 2 == 0;
      const long wave = paired ? 2 * pl.wave : pl.wave;
      SCOPED_TRACE(testing::Message() << (paired ? "paired" : "8-head warp") << ", variant "
                                      << pl.variant << " wave " << wave << " fold " << pl.fold
                                      << " g " << pl.gqa);
      // Per-head rotations (each plan head must take its kv head's R_K, R_V).
      const Config cf{128, pl.gqa, 128, 8, 64, 256, 32, true, {30000, 9000, 300, 2000}};
      const ScopedBackend backend({{"OSCARKV_CUDA_ATTEND_VARIANT", pl.variant},
                                   {"OSCARKV_CUDA_ATTEND_WAVE_UNITS", std::to_string(wave)},
                                   {"OSCARKV_CUDA_ATTEND_FOLD", pl.fold},
                                   {"OSCARKV_CUDA_ATTEND_PAIR_HEADS", pair ? "1" : "0"}});
      ASSERT_TRUE(backend.status().ok()) << backend.status();
      int plans = 0;
      auto plan = [&](const AttendBatch& batch) {
        auto launcher = AttendLauncher::Create(0);
        ASSERT_TRUE(launcher.ok()) << launcher.status();
        AttendLauncher& L = **launcher;
        L.set_variant(std::atoi(pl.variant));
        L.set_wave_units(wave);
        L.set_fold_exact(cuda_attend::FoldExactFromNumber(std::atoi(pl.fold)));
        L.set_pair_heads(pair);
        ASSERT_TRUE(L.Prepare(batch, nullptr).ok());
        ASSERT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
        const AttendSchedule& sc = L.schedule();
        EXPECT_EQ(sc.paired_heads, paired);
        EXPECT_TRUE(sc.integer_pv);
        if (pl.variant[1] == '9') {
          EXPECT_TRUE(sc.flat_cut);
          EXPECT_GT(sc.second_parts, 0);
          if (pl.fold[0] != '2') EXPECT_GT(sc.next_head_exact, 0);
        }
        ++plans;
      };
      const Errors e = RunConfig(cf, 777 + pl.gqa, 1, plan);
      EXPECT_GT(plans, 0);
      std::printf("%s (v%s, wave %ld, fold %s, g %d): rel err gpu/ref %.2e cpu/ref %.2e "
                  "gpu/cpu %.2e, element gpu/ref %.2e, lse gpu/ref %.2e\n",
                  paired ? "paired heads" : "8-head warp", pl.variant, wave, pl.fold, pl.gqa,
                  e.gpu_ref, e.cpu_ref, e.gpu_cpu, e.elem_gpu_ref, e.lse_gpu_ref);
      EXPECT_LT(e.gpu_ref, kOutTol16);
      EXPECT_LT(e.gpu_cpu, kOutTol16);
      EXPECT_LT(e.lse_gpu_ref, kLseTol);
    }
  }
}

// Which shapes run P·V on the integer tensor cores (the schedule's
// integer_pv, the benchmark's label): D 128, G = D, at most 4 query heads
// per kv head, or 6 or 8 as paired heads, variants 6-17 and 19 (and auto);
// no device needed.
TEST(CudaAttendLauncher, IntegerValueProductShapes) {
  using L = AttendLauncher;
  EXPECT_TRUE(L::UsesIntegerValueProduct(L::kAutoVariant, 128, 128, 4));
  EXPECT_TRUE(L::UsesIntegerValueProduct(L::kFlatCutVariant, 128, 128, 1));
  EXPECT_TRUE(L::UsesIntegerValueProduct(6, 128, 128, 2));
  EXPECT_TRUE(L::UsesIntegerValueProduct(L::kAutoVariant, 128, 128, 8));  // paired heads
  EXPECT_TRUE(L::UsesIntegerValueProduct(L::kFlatCutVariant, 128, 128, 6));
  EXPECT_TRUE(L::PairsHeads(L::kAutoVariant, 128, 128, 8));
  EXPECT_TRUE(L::PairsHeads(14, 128, 128, 6));
  EXPECT_FALSE(L::PairsHeads(L::kAutoVariant, 128, 128, 4));
  EXPECT_FALSE(L::PairsHeads(L::kAutoVariant, 128, 128, 7));  // odd: the 8-head warp
  EXPECT_TRUE(L::UsesIntegerValueProduct(L::kAutoVariant, 128, 128, 7));
  EXPECT_TRUE(L::UsesIntegerValueProduct(L::kFlatCutVariant, 128, 128, 5));
  EXPECT_FALSE(L::UsesIntegerValueProduct(15, 128, 128, 7));  // the 8-head warp: 14 and 19
  EXPECT_TRUE(L::UsesIntegerValueProduct(L::kClusterVariant, 128, 128, 7));  // runs auto there
  EXPECT_FALSE(L::PairsHeads(3, 128, 128, 8));  // variant 3: no integer P·V
  EXPECT_FALSE(L::UsesIntegerValueProduct(3, 128, 128, 8));
  EXPECT_FALSE(L::PairsHeads(L::kAutoVariant, 64, 64, 8));
  EXPECT_FALSE(L::UsesIntegerValueProduct(L::kAutoVariant, 64, 64, 8));
  EXPECT_FALSE(L::UsesIntegerValueProduct(L::kAutoVariant, 64, 64, 4));
  EXPECT_FALSE(L::UsesIntegerValueProduct(L::kAutoVariant, 256, 256, 4));
  EXPECT_FALSE(L::UsesIntegerValueProduct(L::kAutoVariant, 128, 64, 4));  // two groups
  EXPECT_FALSE(L::UsesIntegerValueProduct(3, 128, 128, 4));
  EXPECT_FALSE(L::UsesIntegerValueProduct(0, 128, 128, 4));
}

// Long units on the float P'·V path (bf16 hi / lo P' on the float tensor
// cores: the default's kernel at head dims 64 and 256, and at g = 8 with
// D 128 under variant 3, which this test runs): planned
// for a wave of 2 units, each kv head's 300 pages (9600 tokens) are one unit,
// 2400 tokens per warp, the split of a 600K-token sequence on an H200. The
// warp's P'·V accumulators are carried through all of them; the tensor
// cores' adder cuts every product at the accumulator's last bit, so the
// accumulator must stay small: the codes are centered (HistoryWarp::
// ValueProduct). Without the centers (c·s + min, the sum of c·s ~1.5 s per
// unit of weight) these units erred by 1.02-1.28e-4·(1 + |o|) elementwise
// against fp64, relative L2 2.5-3.9e-5; with them 1.0-1.25e-5 and 2.7-4.1e-6
// (H200, 2026-12-02, RESULTS run 27). Held to kLongUnitTol elementwise:
// 3x above the centered figures, 2.5x below the uncentered ones.
constexpr double kLongUnitTol = 4e-5;
TEST(CudaAttendVariant, LongUnitsOfTheFloatValuePathMatchReference) {
  if (gpu == nullptr) GTEST_SKIP() << "no CUDA device";
  // Each shape in 2 units (one per kv head), with the exact blocks after the
  // pages and in units of their own, then in the device's wave (short units).
  for (const auto [wave, fold] : {std::pair{2L, "1"}, std::pair{2L, "2"}, std::pair{0L, "0"}}) {
    // Variant 3 with paired heads off: D 128 at g = 8 runs the float kernel
    // of g = 8 (the other shapes run it under every variant).
    const ScopedBackend backend({{"OSCARKV_CUDA_ATTEND_WAVE_UNITS", std::to_string(wave)},
                                 {"OSCARKV_CUDA_ATTEND_FOLD", fold},
                                 {"OSCARKV_CUDA_ATTEND_VARIANT", "3"},
                                 {"OSCARKV_CUDA_ATTEND_PAIR_HEADS", "0"}});
    ASSERT_TRUE(backend.status().ok()) << backend.status();
    for (const auto [dim, gqa] : {std::pair{128, 8}, std::pair{256, 4}, std::pair{64, 8}}) {
      SCOPED_TRACE(testing::Message() << "D " << dim << " g " << gqa << " wave " << wave
                                      << " fold " << fold);
      const Config cf{dim, gqa, dim, 2, 64, 256, 32, false, {64 + 300 * 32 + 256}};
      int pages_per_unit = 0;
      auto plan = [&](const AttendBatch& batch) {
        auto launcher = AttendLauncher::Create(0);
        ASSERT_TRUE(launcher.ok()) << launcher.status();
        AttendLauncher& L = **launcher;
        L.set_wave_units(wave);
        L.set_fold_exact(cuda_attend::FoldExactFromNumber(std::atoi(fold)));
        L.set_variant(3);
        L.set_pair_heads(false);
        ASSERT_TRUE(L.Prepare(batch, nullptr).ok());
        ASSERT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
        pages_per_unit = L.schedule().pages_per_unit;
        EXPECT_FALSE(L.schedule().integer_pv) << "the float path's kernel";
        EXPECT_FALSE(L.schedule().paired_heads);
      };
      const Errors e = RunConfig(cf, 321 + dim + gqa, 1, plan);
      std::printf("float-path units (D %d g %d, wave %ld, fold %s, %d pages per unit): rel err "
                  "gpu/ref %.2e cpu/ref %.2e gpu/cpu %.2e; element gpu/ref %.2e cpu/ref %.2e "
                  "gpu/cpu %.2e; lse gpu/ref %.2e\n",
                  dim, gqa, wave, fold, pages_per_unit, e.gpu_ref, e.cpu_ref, e.gpu_cpu,
                  e.elem_gpu_ref, e.elem_cpu_ref, e.elem_gpu_cpu, e.lse_gpu_ref);
      // One unit per kv head (with its exact blocks, if folded).
      if (wave == 2) EXPECT_GE(pages_per_unit, 300);
      ExpectWithinTolerance(cf, e);
      EXPECT_LT(e.elem_gpu_ref, kLongUnitTol);
      EXPECT_LT(e.elem_gpu_cpu, kLongUnitTol);
    }
  }
}

// Batches of the same shapes (page and exact block counts) one after the
// other, as in a decode loop: the launcher reuses its plan (the units and
// head partials it left in its staging buffer), but each call's own pages,
// exact blocks and queries must be the ones attended to: new caches (their
// buffers may come back at the same addresses; ReplayedLaunchesReadThe-
// PagesOfTheirTime moves the blocks), with the exact blocks on the history
// units (their first block is copied into each unit per call) and in exact
// units of their own.
TEST(CudaAttendLauncher, RepeatedShapesReuseThePlanWithEachCallsOwnBlocks) {
  if (gpu == nullptr) GTEST_SKIP() << "no CUDA device";
  for (const char* fold : {"1", "2"}) {
    const ScopedBackend backend({{"OSCARKV_CUDA_ATTEND_FOLD", fold}});
    ASSERT_TRUE(backend.status().ok()) << backend.status();
    const Config cf{128, 4, 128, 8, 64, 256, 32, false, {3000, 700, 100, 5000}};
    // The plan of a launcher as the backend's: one Prepare, then a second of
    // the same batch reuses it.
    int reused[2] = {-1, -1};
    auto plan = [&](const AttendBatch& batch) {
      auto launcher = AttendLauncher::Create(0);
      ASSERT_TRUE(launcher.ok()) << launcher.status();
      AttendLauncher& L = **launcher;
      L.set_fold_exact(cuda_attend::FoldExactFromNumber(std::atoi(fold)));
      for (int k = 0; k < 2; ++k) {
        ASSERT_TRUE(L.Prepare(batch, nullptr).ok());
        reused[k] = L.schedule().plan_reused;
      }
      ASSERT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
    };
    for (const uint64_t seed : {301, 302, 303}) {
      std::function<void(const AttendBatch&)> inspect;
      if (seed == 301) inspect = plan;
      const Errors e = RunConfig(cf, seed + fold[0], 2, inspect);
      std::printf("same shapes, seed %d (fold %s): rel err gpu/ref %.2e gpu/cpu %.2e, "
                  "lse gpu/ref %.2e\n",
                  int(seed), fold, e.gpu_ref, e.gpu_cpu, e.lse_gpu_ref);
      ExpectWithinTolerance(cf, e);
    }
    EXPECT_EQ(reused[0], 0);
    EXPECT_EQ(reused[1], 1);
  }
}

// Variant 18 (auto, the default) runs 19 from kHeavyTokenHeadsPerSm history
// (token, kv head) pairs per SM, else 14; every other variant runs itself.
// Needs no device: the choice is the host's.
TEST(CudaAttendVariant, AutoRunsNineteenFromTheHeavyThresholdElseFourteen) {
  constexpr int kAuto = AttendLauncher::kAutoVariant;
  constexpr long kPerSm = AttendLauncher::kHeavyTokenHeadsPerSm;
  EXPECT_EQ(AttendLauncher::kDefaultVariant, kAuto);
  EXPECT_EQ(AttendLauncher::ResolveVariant(kAuto, 0, 132), 14);
  EXPECT_EQ(AttendLauncher::ResolveVariant(kAuto, kPerSm * 132 - 1, 132), 14);
  EXPECT_EQ(AttendLauncher::ResolveVariant(kAuto, kPerSm * 132, 132), 19);
  // The benchmark's shapes on an H200 (132 SMs, 8 kv heads, 32-token pages).
  EXPECT_EQ(AttendLauncher::ResolveVariant(kAuto, (65536L - 320) * 8, 132), 14);   // B1 64K
  EXPECT_EQ(AttendLauncher::ResolveVariant(kAuto, (131072L - 320) * 8, 132), 19);  // B1 128K
  EXPECT_EQ(AttendLauncher::ResolveVariant(kAuto, 8 * (32768L - 320) * 8, 132), 19);  // B8 32K
  EXPECT_EQ(AttendLauncher::ResolveVariant(kAuto, kPerSm, 0), 19);  // no SM count: one
  for (int v = 0; v < AttendLauncher::kNumVariants; ++v) {
    if (v != kAuto) EXPECT_EQ(AttendLauncher::ResolveVariant(v, 1L << 40, 132), v);
  }
  // 14 and 19 share their shapes and their 16-bit P', so auto's tolerance is theirs.
  for (int gqa : {1, 4, 8}) {
    for (int group : {32, 128}) {
      EXPECT_EQ(AttendLauncher::UsesFixedPoint16(kAuto, 128, group, gqa),
                AttendLauncher::UsesFixedPoint16(14, 128, group, gqa));
      EXPECT_EQ(AttendLauncher::UsesFixedPoint16(19, 128, group, gqa),
                AttendLauncher::UsesFixedPoint16(14, 128, group, gqa));
    }
  }
  EXPECT_TRUE(AttendLauncher::UsesFixedPoint16(kAuto, 128, 128, 4));
}

// Auto at 8 query heads per kv head (D 128): paired heads on a batch it
// counts as light (in kv heads' (token, head) pairs), the 8-head warp with
// variant 19's flat cut on a heavy one (RESULTS run 28); with pairing off,
// the 8-head warp on both. Prepare only (it reads no page; every entry of
// the tables points at one device page).
TEST(CudaAttendVariant, AutoPairsLightBatchesAtEightHeadsAndRunsTheEightHeadWarpOnHeavyOnes) {
  if (gpu == nullptr) GTEST_SKIP() << "no CUDA device";
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  const PageGeometry geom{8, 128, 128, 32};
  void* page = nullptr;
  ASSERT_EQ(cudaMalloc(&page, geom.page_bytes()), cudaSuccess);
  const auto* rot = static_cast<const float*>(page);
  // Light: 8K tokens; heavy: the first page count past the threshold.
  const long heavy_pages =
      AttendLauncher::kHeavyTokenHeadsPerSm * sms / (geom.page_tokens * geom.kv_heads) + 1;
  for (const long pages : {256L, heavy_pages}) {
    for (const bool pair : {true, false}) {
      SCOPED_TRACE(testing::Message() << pages << " pages, pairing " << pair);
      std::vector<const uint8_t*> table(pages, static_cast<const uint8_t*>(page));
      std::vector<float> q(64 * 128, 0.5f), out(64 * 128);
      AttendItem item{q.data(), out.data(), nullptr, RotationRef{rot, rot, 0}, nullptr, 0,
                      table.data(), static_cast<int>(pages)};
      const AttendBatch b{geom, 64, 0.088f, &item, 1};
      auto launcher = AttendLauncher::Create(0);
      ASSERT_TRUE(launcher.ok()) << launcher.status();
      (*launcher)->set_pair_heads(pair);
      ASSERT_TRUE((*launcher)->Prepare(b, nullptr).ok());
      ASSERT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
      const AttendSchedule& sc = (*launcher)->schedule();
      const bool heavy = pages == heavy_pages;
      EXPECT_EQ(sc.paired_heads, pair && !heavy);
      EXPECT_TRUE(sc.integer_pv);
      EXPECT_EQ(sc.variant, heavy ? AttendLauncher::kFlatCutVariant : 14);
    }
  }
  ASSERT_EQ(cudaFree(page), cudaSuccess);
}

TEST(CudaAttendLimits, UnsupportedShapesAndBadItemsGiveAClearStatus) {
  if (gpu == nullptr) GTEST_SKIP() << "no CUDA device";
  AttendItem item;
  AttendBatch b{PageGeometry{2, 128, 128, 32}, 4, 0.1f, &item, 1};
  EXPECT_EQ(gpu->Attend(b).code(), absl::StatusCode::kInvalidArgument);  // null q / out
  b.num_q_heads = 32;  // 16 per kv head
  EXPECT_EQ(gpu->Attend(b).code(), absl::StatusCode::kUnimplemented);
  b.num_q_heads = 4;
  b.geom.group_size = 16;
  EXPECT_EQ(gpu->Attend(b).code(), absl::StatusCode::kUnimplemented);
  b.geom = PageGeometry{2, 128, 128, 16};
  EXPECT_EQ(gpu->Attend(b).code(), absl::StatusCode::kUnimplemented);
  b.geom = PageGeometry{2, 100, 100, 32};
  EXPECT_EQ(gpu->Attend(b).code(), absl::StatusCode::kInvalidArgument);
  b.num_items = 0;
  b.geom = PageGeometry{2, 128, 128, 32};
  EXPECT_TRUE(gpu->Attend(b).ok());
}

// Exact (BF16) blocks only: a one-item call, then a larger batch (the
// launcher's buffers grow in between) whose middle item asks for no lse,
// against the CPU backend on the same blocks.
TEST(CudaAttendBatches, GrowingBatchWithAnItemWithoutLseMatchesTheCpu) {
  if (gpu == nullptr) GTEST_SKIP() << "no CUDA device";
  const PageGeometry geom{2, 128, 128, 32};
  const int Hq = 8, D = 128;
  const float scale = 1.0f / std::sqrt(float(D));
  const size_t block_elems = geom.exact_block_bytes() / 2;
  std::mt19937_64 rng(77);
  std::normal_distribution<float> nd;
  std::vector<bf16_bits> blocks_host(5 * block_elems);
  for (auto& x : blocks_host) x = FloatToBf16(nd(rng));
  auto blocks_dev = Upload(*gpu, blocks_host);
  ASSERT_TRUE(blocks_dev.ok());
  CpuBackend cpu(2);
  // Item i: blocks [i, i + 2), the last one holding 5 + 9 i tokens.
  const int n = 3;
  std::vector<std::vector<ExactBlockRef>> ex_cpu(n), ex_gpu(n);
  std::vector<std::vector<float>> q(n, std::vector<float>(Hq * D));
  for (int i = 0; i < n; ++i) {
    for (int b = 0; b < 2; ++b) {
      const int tokens = b == 0 ? 32 : 5 + 9 * i;
      ex_cpu[i].push_back({&blocks_host[(i + b) * block_elems], tokens});
      ex_gpu[i].push_back({blocks_dev->as<bf16_bits>() + (i + b) * block_elems, tokens});
    }
    for (float& x : q[i]) x = nd(rng);
  }
  const float kNaN = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> out_cpu(n * Hq * D), lse_cpu(n * Hq), out_gpu(n * Hq * D, kNaN),
      lse_gpu(n * Hq, kNaN);
  std::vector<AttendItem> it_cpu(n), it_gpu(n);
  for (int i = 0; i < n; ++i) {
    it_cpu[i] = AttendItem{q[i].data(), &out_cpu[i * Hq * D], &lse_cpu[i * Hq], RotationRef{},
                           ex_cpu[i].data(), 2, nullptr, 0};
    it_gpu[i] = AttendItem{q[i].data(), &out_gpu[i * Hq * D], i == 1 ? nullptr : &lse_gpu[i * Hq],
                           RotationRef{}, ex_gpu[i].data(), 2, nullptr, 0};
  }
  ASSERT_TRUE(cpu.Attend(AttendBatch{geom, Hq, scale, it_cpu.data(), n}).ok());
  for (int batch : {1, n}) {
    std::fill(out_gpu.begin(), out_gpu.end(), kNaN);
    std::fill(lse_gpu.begin(), lse_gpu.end(), kNaN);
    const absl::Status st = gpu->Attend(AttendBatch{geom, Hq, scale, it_gpu.data(), batch});
    ASSERT_TRUE(st.ok()) << st;
    for (int i = 0; i < n; ++i) {
      for (int e = 0; e < Hq * D; ++e) {
        const float got = out_gpu[i * Hq * D + e], want = out_cpu[i * Hq * D + e];
        if (i >= batch) {
          ASSERT_TRUE(std::isnan(got)) << "item " << i << " is not in the batch";
        } else {
          ASSERT_NEAR(got, want, kOutTol * (1.0f + std::fabs(want))) << "item " << i << " elem " << e;
        }
      }
      for (int h = 0; h < Hq; ++h) {
        const float got = lse_gpu[i * Hq + h];
        if (i >= batch || i == 1) {
          ASSERT_TRUE(std::isnan(got)) << "lse of item " << i << " written";
        } else {
          ASSERT_NEAR(got, lse_cpu[i * Hq + h], kLseTol * (1.0f + std::fabs(lse_cpu[i * Hq + h])));
        }
      }
    }
  }
  // A bad query in item 2 names it, and no item's output is written.
  std::fill(out_gpu.begin(), out_gpu.end(), 7.0f);
  q[2][5] = kNaN;
  const absl::Status st = gpu->Attend(AttendBatch{geom, Hq, scale, it_gpu.data(), n});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("attention item 2: query contains a non-finite value at index 5"),
            std::string::npos)
      << st;
  for (float x : out_gpu) ASSERT_EQ(x, 7.0f);
}

// Named page tables (AttendItem::page_table_id) live on the device between
// calls: each call uploads only what is new, and every call's answers equal
// the CPU backend's on the same pages. Outputs poisoned before each call.
TEST(CudaAttendPageTables, NamedTablesUploadOnlyTheirNewPagesAndMatchTheCpu) {
  if (gpu == nullptr) GTEST_SKIP() << "no CUDA device";
  const PageGeometry geom{2, 128, 128, 32};
  const int Hq = 8, D = 128, kPool = 400;
  const double tol = OutTol(D, geom.group_size, Hq / geom.kv_heads);
  const float scale = 1.0f / std::sqrt(float(D));
  const size_t block_elems = geom.exact_block_bytes() / 2;
  std::mt19937_64 rng(91);
  auto rotations = RandomRotations(*gpu, D, 1, rng);
  ASSERT_TRUE(rotations.ok()) << rotations.status();
  const RotationRef rot_host = rotations->host_ref(), rot_gpu = rotations->device_ref();
  // A pool of encoded pages, on the host and on the device.
  const std::vector<bf16_bits> staging = RandomKvRows(size_t(kPool) * block_elems / D, D, rng);
  auto pages_or = EncodePagesOnCpu(geom, staging.data(), kPool, rot_host);
  ASSERT_TRUE(pages_or.ok()) << pages_or.status();
  const std::vector<uint8_t>& pages_host = *pages_or;
  CpuBackend cpu(2);
  auto pages_dev = Upload(*gpu, pages_host);
  ASSERT_TRUE(pages_dev.ok());
  auto launcher = AttendLauncher::Create(0);
  ASSERT_TRUE(launcher.ok()) << launcher.status();
  AttendLauncher& L = **launcher;
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);

  // Tables: (id, page indices into the pool); id 0 = unnamed.
  struct Table {
    uint64_t id;
    std::vector<int> pages;
  };
  std::vector<Table> tables;
  auto random_pages = [&](int n) {
    std::vector<int> v(n);
    for (int& x : v) x = static_cast<int>(rng() % kPool);
    return v;
  };
  auto grow = [&](Table& t, int n) {
    for (int x : random_pages(n)) t.pages.push_back(x);
  };
  // Runs the tables as one batch on both backends; returns pages uploaded.
  auto run = [&](const char* what) -> long {
    const int n = static_cast<int>(tables.size());
    std::vector<std::vector<float>> q(n, std::vector<float>(Hq * D));
    std::normal_distribution<float> nd(0.0f, 1.5f);
    for (auto& v : q) for (float& x : v) x = nd(rng);
    std::vector<std::vector<const uint8_t*>> pc(n), pg(n);
    const float kNaN = std::numeric_limits<float>::quiet_NaN();
    std::vector<float> out_cpu(n * Hq * D), lse_cpu(n * Hq), out_gpu(n * Hq * D, kNaN),
        lse_gpu(n * Hq, kNaN);
    std::vector<AttendItem> ic(n), ig(n);
    for (int i = 0; i < n; ++i) {
      for (int p : tables[i].pages) {
        pc[i].push_back(&pages_host[p * geom.page_bytes()]);
        pg[i].push_back(pages_dev->as<uint8_t>() + size_t(p) * geom.page_bytes());
      }
      const int np = static_cast<int>(tables[i].pages.size());
      ic[i] = AttendItem{q[i].data(), &out_cpu[i * Hq * D], &lse_cpu[i * Hq], rot_host,
                         nullptr, 0, pc[i].data(), np};
      ig[i] = AttendItem{q[i].data(), &out_gpu[i * Hq * D], &lse_gpu[i * Hq], rot_gpu,
                         nullptr, 0, pg[i].data(), np};
      ig[i].page_table_id = tables[i].id;
    }
    EXPECT_TRUE(cpu.Attend(AttendBatch{geom, Hq, scale, ic.data(), n}).ok());
    const AttendBatch batch{geom, Hq, scale, ig.data(), n};
    absl::Status st = L.Prepare(batch, stream);
    if (st.ok()) st = L.Launch(stream);
    EXPECT_TRUE(st.ok()) << what << ": " << st;
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_TRUE(L.CopyResults(batch).ok());
    int bad = 0;
    for (int e = 0; e < n * Hq * D && bad < 5; ++e) {
      if (!(std::fabs(out_gpu[e] - out_cpu[e]) <= tol * (1.0f + std::fabs(out_cpu[e])))) {
        ADD_FAILURE() << what << ": item " << e / (Hq * D) << " element " << e % (Hq * D)
                      << " gpu " << out_gpu[e] << " cpu " << out_cpu[e];
        ++bad;
      }
    }
    for (int e = 0; e < n * Hq; ++e) {
      EXPECT_NEAR(lse_gpu[e], lse_cpu[e], kLseTol * (1.0f + std::fabs(lse_cpu[e]))) << what;
    }
    return L.schedule().pages_uploaded;
  };

  tables = {{101, random_pages(40)}, {102, random_pages(100)}, {103, random_pages(7)}};
  EXPECT_EQ(run("first call"), 147) << "new tables: whole";
  EXPECT_EQ(run("same tables"), 0) << "known tables: nothing";
  grow(tables[0], 1);
  grow(tables[2], 60);  // 67 pages: past its 64-entry run
  EXPECT_EQ(run("grown"), 1 + 67) << "one new page; a moved table whole";
  tables[1].pages.back() = (tables[1].pages.back() + 1) % kPool;
  EXPECT_EQ(run("changed last page"), 100) << "a changed table is noticed and uploaded whole";
  tables.push_back({0, random_pages(30)});
  EXPECT_EQ(run("with an unnamed table"), 30) << "unnamed: whole, every call";
  EXPECT_EQ(L.schedule().page_tables_cleared, 0);
  tables.pop_back();
  // A small array that may not grow (reallocated: everything uploaded
  // again) and fills up.
  L.set_page_table_entries(640, 640);
  EXPECT_EQ(run("new array"), 41 + 100 + 67);
  tables.push_back({104, random_pages(150)});  // runs 64 + 128 + 128 + 256 = 576 of 640
  EXPECT_EQ(run("fourth table"), 150);
  EXPECT_EQ(L.schedule().page_tables_cleared, 0);
  tables.back() = {105, random_pages(150)};  // 256 more: full
  EXPECT_EQ(run("array full"), 41 + 100 + 67 + 150) << "cleared, then all whole";
  EXPECT_EQ(L.schedule().page_tables_cleared, 1);
  EXPECT_EQ(run("after the clear"), 0);
  // Larger than the largest array allowed: uploaded with the call, still right.
  L.set_page_table_entries(128, 128);
  EXPECT_EQ(run("array too small"), 41 + 100 + 67 + 150);
  EXPECT_EQ(run("array too small, again"), 41 + 100 + 67 + 150);
  // A bad page pointer in a named table's new entries is refused by index,
  // and forgets what the failed call would have uploaded.
  L.set_page_table_entries(size_t(1) << 18, size_t(1) << 25);  // the defaults
  EXPECT_EQ(run("default sizes"), 41 + 100 + 67 + 150);
  {
    std::vector<const uint8_t*> pg;
    for (int p : tables[0].pages) pg.push_back(pages_dev->as<uint8_t>() + size_t(p) * geom.page_bytes());
    pg.push_back(nullptr);
    std::vector<float> q(Hq * D, 0.5f), out(Hq * D);
    AttendItem item{q.data(), out.data(), nullptr, rot_gpu, nullptr, 0, pg.data(),
                    static_cast<int>(pg.size())};
    item.page_table_id = tables[0].id;
    const absl::Status st = L.Prepare(AttendBatch{geom, Hq, scale, &item, 1}, stream);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find("page 41 is null or not 8-byte aligned"), std::string::npos) << st;
  }
  EXPECT_EQ(run("after a refused call"), 41 + 100 + 67 + 150) << "forgotten: whole again";
  // A refused query in another item, after table 101 got a new page in the
  // same batch: nothing of the failed call is taken as uploaded.
  grow(tables[0], 1);
  {
    std::vector<const uint8_t*> pg;
    for (int p : tables[0].pages) pg.push_back(pages_dev->as<uint8_t>() + size_t(p) * geom.page_bytes());
    std::vector<float> q0(Hq * D, 0.5f), q1(Hq * D, 0.5f), out(2 * Hq * D);
    q1[3] = std::numeric_limits<float>::quiet_NaN();
    AttendItem items[2] = {
        AttendItem{q0.data(), out.data(), nullptr, rot_gpu, nullptr, 0, pg.data(),
                   static_cast<int>(pg.size())},
        AttendItem{q1.data(), out.data() + Hq * D, nullptr, rot_gpu}};
    items[0].page_table_id = tables[0].id;
    const absl::Status st = L.Prepare(AttendBatch{geom, Hq, scale, items, 2}, stream);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find("attention item 1"), std::string::npos) << st;
  }
  EXPECT_EQ(run("after a refused query"), 42 + 100 + 67 + 150) << "forgotten: whole again";
  // One table twice in a batch: copied once.
  tables = {{106, random_pages(90)}, {106, {}}};
  tables[1].pages = tables[0].pages;
  EXPECT_EQ(run("one table twice"), 90);
  EXPECT_EQ(run("one table twice, again"), 0);
  // Many layers: every layer of every sequence has its own table, and the
  // store attends one layer per call. A small array grows to hold them all
  // (forgetting what it held each time), so that from the third round of
  // layers on nothing is copied.
  L.set_page_table_entries(256, size_t(1) << 20);
  std::vector<std::vector<Table>> layers;
  for (int layer = 0; layer < 6; ++layer) {
    layers.push_back({{uint64_t(1000 + 2 * layer), random_pages(100)},
                      {uint64_t(1001 + 2 * layer), random_pages(90)}});
  }
  int grown = 0;
  for (int round = 0; round < 3; ++round) {
    for (size_t layer = 0; layer < layers.size(); ++layer) {
      tables = layers[layer];
      const long uploaded = run("layers");
      grown += L.schedule().page_tables_grown;
      if (round == 2) EXPECT_EQ(uploaded, 0) << "round " << round << " layer " << layer;
    }
  }
  EXPECT_GT(grown, 0);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// Runs `launch` (enqueues on `stream`), waits for it and copies L's results
// into out and lse (poisoned first, so every element must be copied);
// returns out, then lse.
template <typename Launch>
std::vector<float> RunAndCopyResults(AttendLauncher& L, const AttendBatch& batch,
                                     cudaStream_t stream, std::vector<float>& out,
                                     std::vector<float>& lse, Launch&& launch) {
  std::fill(out.begin(), out.end(), std::numeric_limits<float>::quiet_NaN());
  std::fill(lse.begin(), lse.end(), std::numeric_limits<float>::quiet_NaN());
  launch();
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  const absl::Status copied = L.CopyResults(batch);
  EXPECT_TRUE(copied.ok()) << copied;
  std::vector<float> r = out;
  r.insert(r.end(), lse.begin(), lse.end());
  return r;
}

void PrepareAndLaunch(AttendLauncher& L, const AttendBatch& batch, cudaStream_t stream) {
  absl::Status st = L.Prepare(batch, stream);
  if (st.ok()) st = L.Launch(stream);
  EXPECT_TRUE(st.ok()) << st;
}

// A prepared launch replayed without a new Prepare (directly, and as a CUDA
// graph, as attend_kernels.h allows) reads the pages as they are on the
// device at that time: after the pages' contents change, each replay equals
// a new Prepare + Launch, bit for bit. The batch mixes an item with history
// and exact blocks, one with one page (a single unit per kv head), one with
// exact blocks only and an empty one; the first results match the CPU, and
// so do those of a batch of the same counts with other exact blocks, which
// reuses the plan. A traced launch of the same batch gives the same results
// and a well-formed timeline.
TEST(CudaAttendLauncher, ReplayedLaunchesReadThePagesOfTheirTime) {
  if (gpu == nullptr) GTEST_SKIP() << "no CUDA device";
  for (const int g : {1, 2, 4, 8}) {
    SCOPED_TRACE("g = " + std::to_string(g));
    const int H = 2, D = 128, Hq = H * g;
    const PageGeometry geom{H, D, D, 32};
    const float scale = 1.0f / std::sqrt(float(D));
    const size_t block_elems = geom.exact_block_bytes() / 2;
    std::mt19937_64 rng(500 + g);
    auto rotations = RandomRotations(*gpu, D, 1, rng);
    ASSERT_TRUE(rotations.ok()) << rotations.status();
    const RotationRef rot_host = rotations->host_ref(), rot_gpu = rotations->device_ref();
    const int kPages = 300, kBlocks = 3;
    std::vector<bf16_bits> staging =
        RandomKvRows(size_t(kPages + kBlocks) * block_elems / D, D, rng);
    auto pages_or = EncodePagesOnCpu(geom, staging.data(), kPages, rot_host);
    ASSERT_TRUE(pages_or.ok()) << pages_or.status();
    const std::vector<uint8_t>& pages_host = *pages_or;
    CpuBackend cpu(2);
    // What is left of staging: the exact blocks.
    staging.erase(staging.begin(), staging.begin() + size_t(kPages) * block_elems);
    auto pages_dev = Upload(*gpu, pages_host);
    auto blocks_dev = Upload(*gpu, staging);
    ASSERT_TRUE(pages_dev.ok() && blocks_dev.ok());
    std::vector<const uint8_t*> pg;
    for (int p = 0; p < kPages; ++p) {
      pg.push_back(pages_dev->as<uint8_t>() + size_t(p) * geom.page_bytes());
    }
    std::vector<ExactBlockRef> ex;
    for (int b = 0; b < kBlocks; ++b) {
      ex.push_back({blocks_dev->as<bf16_bits>() + b * block_elems, 32 - 7 * b});
    }
    const int n = 4;
    std::vector<float> q(size_t(n) * Hq * D);
    std::normal_distribution<float> nd(0.0f, 1.5f);
    for (float& x : q) x = nd(rng);
    std::vector<float> out(size_t(n) * Hq * D), lse(size_t(n) * Hq);
    std::vector<AttendItem> items(n);
    for (int i = 0; i < n; ++i) {
      items[i] = AttendItem{&q[size_t(i) * Hq * D], &out[size_t(i) * Hq * D], &lse[size_t(i) * Hq],
                            rot_gpu};
    }
    items[0].exact = ex.data();
    items[0].num_exact = kBlocks;
    items[0].pages = pg.data();
    items[0].num_pages = kPages;
    items[1].pages = pg.data() + 17;
    items[1].num_pages = 1;
    items[2].exact = ex.data() + 1;
    items[2].num_exact = 2;
    const AttendBatch batch{geom, Hq, scale, items.data(), n};
    auto launcher = AttendLauncher::Create(0);
    ASSERT_TRUE(launcher.ok()) << launcher.status();
    AttendLauncher& L = **launcher;
    cudaStream_t stream = nullptr;
    ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
    auto run = [&](auto&& launch) { return RunAndCopyResults(L, batch, stream, out, lse, launch); };
    auto prepare_and_launch = [&] { PrepareAndLaunch(L, batch, stream); };
    // Against the CPU backend on the same pages (host copies): `got` from
    // the items `dev_items`, whose exact blocks are dev_ex's; their host
    // copies are host_ex.
    std::vector<const uint8_t*> pg_host;
    for (int p = 0; p < kPages; ++p) pg_host.push_back(&pages_host[size_t(p) * geom.page_bytes()]);
    auto expect_cpu_results = [&](const std::vector<float>& got,
                                  const std::vector<AttendItem>& dev_items,
                                  const std::vector<ExactBlockRef>& dev_ex,
                                  const std::vector<ExactBlockRef>& host_ex) {
      std::vector<float> out_cpu(out.size()), lse_cpu(lse.size());
      std::vector<AttendItem> ic = dev_items;
      for (int i = 0; i < n; ++i) {
        ic[i].out = &out_cpu[size_t(i) * Hq * D];
        ic[i].lse = &lse_cpu[size_t(i) * Hq];
        ic[i].rotation = rot_host;
        if (ic[i].pages != nullptr) ic[i].pages = pg_host.data() + (ic[i].pages - pg.data());
        if (ic[i].exact != nullptr) ic[i].exact = host_ex.data() + (ic[i].exact - dev_ex.data());
      }
      ASSERT_TRUE(cpu.Attend(AttendBatch{geom, Hq, scale, ic.data(), n}).ok());
      for (size_t e = 0; e < out.size(); ++e) {
        ASSERT_NEAR(got[e], out_cpu[e], OutTol(D, D, g) * (1.0f + std::fabs(out_cpu[e])))
            << "element " << e;
      }
      for (size_t e = 0; e < lse.size(); ++e) {
        const float x = got[out.size() + e];
        if (std::isinf(lse_cpu[e])) {
          ASSERT_EQ(x, lse_cpu[e]) << "lse " << e;
        } else {
          ASSERT_NEAR(x, lse_cpu[e], kLseTol * (1.0f + std::fabs(lse_cpu[e]))) << "lse " << e;
        }
      }
    };
    const std::vector<float> first = run(prepare_and_launch);
    std::vector<ExactBlockRef> ex_host;
    for (int b = 0; b < kBlocks; ++b) ex_host.push_back({&staging[b * block_elems], 32 - 7 * b});
    expect_cpu_results(first, items, ex, ex_host);
    {
      // The same page and block counts with other exact blocks (a new
      // buffer, the last block 5 tokens shorter): the next Prepare reuses
      // the plan (AttendSchedule::plan_reused) and must attend to the new
      // blocks. Also with variant 19 planned for a wave of 7 units, whose
      // flat cut puts kv head 1's blocks and first pages on the unit that
      // ends head 0 (D 128 with g <= 4; at g = 8 the default, paired heads
      // on this light batch, 3 units of the kv heads at that wave; before
      // session 24 the float-path kernel, one 300-page unit per kv head,
      // which before the V codes were centered erred by 1.2e-4, past the
      // 1e-4 bound, on the H200, 2026-12-01;
      // LongUnitsOfTheFloatValuePathMatchReference).
      std::vector<bf16_bits> blocks2_host =
          RandomKvRows(size_t(kBlocks) * block_elems / D, D, rng);
      auto blocks2 = Upload(*gpu, blocks2_host);
      ASSERT_TRUE(blocks2.ok());
      std::vector<ExactBlockRef> ex2, ex2_host;
      for (int b = 0; b < kBlocks; ++b) {
        const int tokens = 32 - 7 * b - (b == kBlocks - 1 ? 5 : 0);
        ex2.push_back({blocks2->as<bf16_bits>() + b * block_elems, tokens});
        ex2_host.push_back({&blocks2_host[b * block_elems], tokens});
      }
      std::vector<AttendItem> items2 = items;
      for (int i = 0; i < n; ++i) {
        if (items2[i].exact != nullptr) items2[i].exact = ex2.data() + (items[i].exact - ex.data());
      }
      const AttendBatch batch2{geom, Hq, scale, items2.data(), n};
      const int default_variant = L.variant();
      // (variant, wave units): the default as planned, then 19 (g <= 4) or
      // the default (g = 8) in a wave of 7.
      std::vector<std::pair<int, int>> runs{{default_variant, 0}};
      runs.push_back({g <= 4 ? AttendLauncher::kFlatCutVariant : default_variant, 7});
      for (const auto [variant, wave] : runs) {
        SCOPED_TRACE("variant " + std::to_string(variant) + ", wave " + std::to_string(wave));
        L.set_variant(variant);
        L.set_wave_units(wave);
        // The plan of `batch`: the last one's in the device's wave (same
        // counts), a new one in a wave of 7 (another capacity).
        run(prepare_and_launch);
        EXPECT_EQ(L.schedule().plan_reused, wave == 0 ? 1 : 0);
        const std::vector<float> got = run([&] {
          absl::Status st = L.Prepare(batch2, stream);
          if (st.ok()) st = L.Launch(stream);
          EXPECT_TRUE(st.ok()) << st;
        });
        const AttendSchedule& sc = L.schedule();
        EXPECT_EQ(sc.plan_reused, 1);
        if (variant == AttendLauncher::kFlatCutVariant && g <= 4) {
          EXPECT_TRUE(sc.flat_cut);
          EXPECT_GT(sc.next_head_exact, 0);
          EXPECT_GT(sc.second_parts, 0);
        }
        expect_cpu_results(got, items2, ex2, ex2_host);
      }
      L.set_variant(default_variant);
      L.set_wave_units(0);
      run(prepare_and_launch);
    }
    for (int h = 0; h < Hq; ++h) EXPECT_EQ(lse[size_t(3) * Hq + h], -INFINITY) << "empty item";
    {
      // A traced launch (AttendLauncher::set_trace, for benchmarks): the same
      // results bit for bit, one row per block of each kernel, every mark a
      // block passed between its start and end, and the rows cleared once read.
      L.set_trace(true);
      const std::vector<float> traced = run(prepare_and_launch);
      EXPECT_EQ(0, std::memcmp(traced.data(), first.data(), first.size() * 4));
      auto trace = L.TakeTrace(stream);
      ASSERT_TRUE(trace.ok()) << trace.status();
      using namespace cuda_attend;
      const AttendSchedule& sc = L.schedule();
      const bool cluster = sc.clusters_per_head > 0;  // variant 11 records nothing
      const size_t blocks[kTraceKernels] = {
          cluster ? 0 : size_t(n) * Hq, cluster ? 0 : size_t(sc.exact_units + sc.history_units),
          cluster ? 0 : size_t(n) * Hq * (D / sc.merge_slice)};
      for (int k = 0; k < kTraceKernels; ++k) {
        ASSERT_EQ(trace->blocks(k), blocks[k]) << "kernel " << k;
        for (size_t b = 0; b < trace->blocks(k); ++b) {
          const unsigned long long* row = trace->rows[k].data() + b * kTraceMarks;
          ASSERT_NE(row[kTraceStart], 0u) << "kernel " << k << " block " << b;
          for (int m = kTraceWaited; m <= kTraceEnd; ++m) {
            if (m != kTraceEnd && row[m] == 0) continue;  // a mark this block does not pass
            EXPECT_GE(row[m], row[kTraceStart]) << "kernel " << k << " block " << b << " mark " << m;
            EXPECT_LE(row[m], row[kTraceEnd]) << "kernel " << k << " block " << b << " mark " << m;
          }
          if (k == kTraceSplit && row[kTraceWaited] != 0) {  // a history part, in order
            EXPECT_LE(row[kTraceWaited], row[kTraceLoopDone]) << "block " << b;
            EXPECT_LE(row[kTraceLoopDone], row[kTraceWritten]) << "block " << b;
          }
        }
      }
      auto again = L.TakeTrace(stream);
      ASSERT_TRUE(again.ok()) << again.status();
      for (int k = 0; k < kTraceKernels; ++k) {
        for (unsigned long long x : again->rows[k]) ASSERT_EQ(x, 0u) << "kernel " << k;
      }
      L.set_trace(false);
      run(prepare_and_launch);
    }
    {
      // The outputs written to device memory and copied down by CopyResults
      // (set_results_in_device_memory, for benchmarks): the same bits.
      L.set_results_in_device_memory(true);
      const std::vector<float> on_device = run(prepare_and_launch);
      EXPECT_EQ(0, std::memcmp(on_device.data(), first.data(), first.size() * 4));
      L.set_results_in_device_memory(false);
      run(prepare_and_launch);
    }
    // Replays (directly, then as a CUDA graph) after the pages' contents
    // change on the device: each must equal a new Prepare + Launch on the
    // new contents, and differ from the first results.
    std::vector<uint8_t> shifted(pages_host.size());
    for (int rep = 1; rep <= 2; ++rep) {
      for (int p = 0; p < kPages; ++p) {
        std::memcpy(&shifted[size_t(p) * geom.page_bytes()],
                    &pages_host[size_t((p + rep) % kPages) * geom.page_bytes()], geom.page_bytes());
      }
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t exec = nullptr;
      if (rep == 2) {
        ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
        ASSERT_TRUE(L.Launch(stream).ok());
        ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
        ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
      }
      ASSERT_EQ(cudaMemcpy(pages_dev->as<uint8_t>(), shifted.data(), shifted.size(),
                           cudaMemcpyHostToDevice),
                cudaSuccess);
      const std::vector<float> replay = run([&] {
        if (exec != nullptr) {
          EXPECT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
        } else {
          EXPECT_TRUE(L.Launch(stream).ok());
        }
      });
      if (exec != nullptr) {
        EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
        EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
      }
      const std::vector<float> fresh = run(prepare_and_launch);
      EXPECT_EQ(0, std::memcmp(replay.data(), fresh.data(), fresh.size() * 4)) << "replay " << rep;
      EXPECT_NE(0, std::memcmp(replay.data(), first.data(), first.size() * 4))
          << "replay " << rep << ": new pages, same results";
    }
    EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  }
}

// Rank pools (attend_claim.cuh): under a flat cut the split blocks claim
// their units by arrival rank, so the block that runs a unit changes from
// launch to launch. Each unit is claimed once (the trace names it), also
// when most blocks find no slot of their own SM (a short wave), the
// counters are left at zero for the next launch (launches without a new
// Prepare, graph replays and a traced launch all give the first launch's
// bits), and the results match the CPU backend's; with the skew at 0 (even units, block b
// running unit b) they match too.
TEST(CudaAttendLauncher, UnitsClaimedByArrivalRankGiveTheSameBitsEveryLaunch) {
  if (gpu == nullptr) GTEST_SKIP() << "no CUDA device";
  const int H = 8, g = 4, D = 128, Hq = H * g;
  const PageGeometry geom{H, D, D, 32};
  const float scale = 1.0f / std::sqrt(float(D));
  const size_t block_elems = geom.exact_block_bytes() / 2;
  std::mt19937_64 rng(777);
  auto rotations = RandomRotations(*gpu, D, 1, rng);
  ASSERT_TRUE(rotations.ok()) << rotations.status();
  const int kPages = 1000, kBlocks = 3;
  std::vector<bf16_bits> staging =
      RandomKvRows(size_t(kPages + kBlocks) * block_elems / D, D, rng);
  auto pages_or = EncodePagesOnCpu(geom, staging.data(), kPages, rotations->host_ref());
  ASSERT_TRUE(pages_or.ok()) << pages_or.status();
  staging.erase(staging.begin(), staging.begin() + size_t(kPages) * block_elems);
  auto pages_dev = Upload(*gpu, *pages_or);
  auto blocks_dev = Upload(*gpu, staging);
  ASSERT_TRUE(pages_dev.ok() && blocks_dev.ok());
  std::vector<const uint8_t*> pg, pg_host;
  for (int p = 0; p < kPages; ++p) {
    pg.push_back(pages_dev->as<uint8_t>() + size_t(p) * geom.page_bytes());
    pg_host.push_back(pages_or->data() + size_t(p) * geom.page_bytes());
  }
  std::vector<ExactBlockRef> ex, ex_host;
  for (int b = 0; b < kBlocks; ++b) {
    ex.push_back({blocks_dev->as<bf16_bits>() + b * block_elems, 32 - 5 * b});
    ex_host.push_back({&staging[b * block_elems], 32 - 5 * b});
  }
  std::vector<float> q(size_t(Hq) * D), out(q.size()), lse(Hq);
  std::normal_distribution<float> nd(0.0f, 1.5f);
  for (float& x : q) x = nd(rng);
  AttendItem item{q.data(), out.data(), lse.data(), rotations->device_ref()};
  item.pages = pg.data();
  item.num_pages = kPages;
  item.exact = ex.data();
  item.num_exact = kBlocks;
  const AttendBatch batch{geom, Hq, scale, &item, 1};
  // The CPU backend's results on the host copies.
  std::vector<float> out_cpu(out.size()), lse_cpu(lse.size());
  AttendItem item_cpu = item;
  item_cpu.out = out_cpu.data();
  item_cpu.lse = lse_cpu.data();
  item_cpu.rotation = rotations->host_ref();
  item_cpu.pages = pg_host.data();
  item_cpu.exact = ex_host.data();
  CpuBackend cpu(2);
  ASSERT_TRUE(cpu.Attend(AttendBatch{geom, Hq, scale, &item_cpu, 1}).ok());

  auto launcher = AttendLauncher::Create(0);
  ASSERT_TRUE(launcher.ok()) << launcher.status();
  AttendLauncher& L = **launcher;
  L.set_variant(AttendLauncher::kFlatCutVariant);
  L.set_rank_min_unit_pages(0);  // its ~15-page units too
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  auto run = [&](auto&& launch) { return RunAndCopyResults(L, batch, stream, out, lse, launch); };
  auto prepare_and_launch = [&] { PrepareAndLaunch(L, batch, stream); };
  auto launch = [&] { EXPECT_TRUE(L.Launch(stream).ok()); };
  auto expect_cpu = [&](const std::vector<float>& got) {
    for (size_t e = 0; e < out.size(); ++e) {
      ASSERT_NEAR(got[e], out_cpu[e], OutTol(D, D, g) * (1.0f + std::fabs(out_cpu[e])))
          << "element " << e;
    }
    for (int h = 0; h < Hq; ++h) {
      ASSERT_NEAR(got[out.size() + h], lse_cpu[h], kLseTol * (1.0f + std::fabs(lse_cpu[h])))
          << "lse " << h;
    }
  };
  auto same_bits = [](const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
  };
  const std::vector<float> first = run(prepare_and_launch);
  const AttendSchedule sc = L.schedule();
  ASSERT_TRUE(sc.flat_cut);
  ASSERT_GE(sc.rank_pools, 2) << "the device's wave has one block per SM";
  EXPECT_EQ(sc.rank_skew, AttendLauncher::kDefaultRankSkew);
  expect_cpu(first);
  for (int k = 0; k < 3; ++k) EXPECT_TRUE(same_bits(run(launch), first)) << "launch " << k;
  {
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    ASSERT_TRUE(L.Launch(stream).ok());
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    for (int k = 0; k < 2; ++k) {
      EXPECT_TRUE(same_bits(run([&] { EXPECT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess); }),
                            first))
          << "replay " << k;
    }
    EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
    EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  }
  {
    // Each split block's row names the unit it claimed: every unit once.
    L.set_trace(true);
    EXPECT_TRUE(same_bits(run(prepare_and_launch), first)) << "traced";
    auto trace = L.TakeTrace(stream);
    ASSERT_TRUE(trace.ok()) << trace.status();
    using namespace cuda_attend;
    const size_t units = size_t(sc.exact_units + sc.history_units);
    ASSERT_EQ(trace->blocks(kTraceSplit), units);
    std::vector<int> claimed(units, 0);
    for (size_t b = 0; b < units; ++b) {
      const unsigned long long unit = trace->rows[kTraceSplit][b * kTraceMarks + kTraceSm] >> 32;
      ASSERT_GE(unit, 1u) << "block " << b << " claimed no unit";
      ASSERT_LE(unit, units) << "block " << b;
      ++claimed[unit - 1];
    }
    for (size_t u = 0; u < units; ++u) EXPECT_EQ(claimed[u], 1) << "unit " << u;
    L.set_trace(false);
  }
  EXPECT_TRUE(same_bits(run(launch), first)) << "after the traced launch";
  // A wave of 53 units: the blocks on SMs past the 14th have no slot of
  // their own (s·R + r >= 53) and take the free ones of other SMs.
  L.set_wave_units(53);
  const std::vector<float> short_wave = run(prepare_and_launch);
  EXPECT_GE(L.schedule().rank_pools, 2);
  EXPECT_LE(L.schedule().exact_units + L.schedule().history_units, 53);
  expect_cpu(short_wave);
  for (int k = 0; k < 2; ++k) EXPECT_TRUE(same_bits(run(launch), short_wave)) << "53, launch " << k;
  L.set_wave_units(0);
  EXPECT_TRUE(same_bits(run(prepare_and_launch), first)) << "the device's wave again";
  L.set_rank_skew(0.0);
  const std::vector<float> even = run(prepare_and_launch);
  EXPECT_EQ(L.schedule().rank_pools, 0);
  expect_cpu(even);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

TEST(CudaAttendLimits, NullOrMisalignedPageIsRefusedByIndex) {
  if (gpu == nullptr) GTEST_SKIP() << "no CUDA device";
  auto pool = gpu->Allocate(4096);
  ASSERT_TRUE(pool.ok());
  std::vector<float> q(4 * 128, 0.5f), out(4 * 128), rot(128 * 128, 0.0f);
  const uint8_t* base = pool->as<uint8_t>();
  for (const uint8_t* bad : {static_cast<const uint8_t*>(nullptr), base + 4}) {
    const uint8_t* pages[3] = {base, base + 8, bad};
    AttendItem item{q.data(), out.data(), nullptr, RotationRef{rot.data(), rot.data(), 0},
                    nullptr, 0, pages, 3};
    const absl::Status st =
        gpu->Attend(AttendBatch{PageGeometry{1, 128, 128, 32}, 4, 0.1f, &item, 1});
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find("page 2 is null or not 8-byte aligned"), std::string::npos) << st;
  }
}

TEST(CudaAttendLimits, NonFiniteQueryIsRefusedAndOutputIsUntouched) {
  if (gpu == nullptr) GTEST_SKIP() << "no CUDA device";
  std::vector<float> q(4 * 128, 0.5f), out(4 * 128, 7.0f), lse(4, 7.0f);
  q[130] = std::numeric_limits<float>::infinity();
  AttendItem item{q.data(), out.data(), lse.data()};
  const absl::Status st = gpu->Attend(AttendBatch{PageGeometry{1, 128, 128, 32}, 4, 0.1f, &item, 1});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("non-finite value at index 130"), std::string::npos) << st;
  for (float x : out) ASSERT_EQ(x, 7.0f);
  for (float x : lse) ASSERT_EQ(x, 7.0f);
  // The same query, finite: no history, no exact blocks, so out = 0 and lse = -inf.
  q[130] = 0.25f;
  ASSERT_TRUE(gpu->Attend(AttendBatch{PageGeometry{1, 128, 128, 32}, 4, 0.1f, &item, 1}).ok());
  for (float x : out) ASSERT_EQ(x, 0.0f);
  for (float x : lse) ASSERT_EQ(x, -std::numeric_limits<float>::infinity());
}

}  // namespace
}  // namespace oscarkv
