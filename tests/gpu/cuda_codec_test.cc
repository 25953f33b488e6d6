// GPU codec vs the CPU backend: EncodePages codes and params, DecodePages.
// Inputs are random BF16 rows with outlier channels, random dense orthogonal
// rotations, several head dims, group sizes, page sizes and clip ratios.
//
// Stated tolerance: the GPU rotates on the tensor cores with R split into two
// fp16 terms (strip and roles kernels, D 64 / 128, rows scaled by a power of
// two into fp16) or three bf16 terms (the wgmma kernel, D 128's default on
// Hopper; the tiled kernel, D 256): fp32-level accuracy, another summation
// order than the CPU's fp32 loop, so a value sitting on a rounding boundary
// may land on the other side: we require fewer than 1e-4 of all codes to
// differ (measured 9.8e-7 on the H200, 2026-11-29, session 4; 2.5e-6 with
// three bf16 terms everywhere; 1.9e-6 with the wgmma kernel, 2026-12-02) and
// fewer than 1e-2 of the fp16 (scale, min) params per case (measured 1.4e-3:
// group extremes carry the CPU's own fp32 summation error), each by at most 4
// fp16 ulps (measured at most 3, in a G = 4 group whose range max - min
// cancels), and print the measured fractions.
// Decode: the GPU sums in the CPU's order, but the compilers may contract
// multiply-adds differently; we require every BF16 output to be within one
// BF16 ulp of the row's largest magnitude from the CPU's (an absolute bound:
// relative ulps mean nothing for outputs near zero), and fewer than 1e-3 of
// outputs to differ at all.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/codec_kernels.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/hadamard.h"
#include "kernels/quantize.h"
#include "tests/gpu/gpu_test_util.h"

namespace oscarkv {
namespace {

using gputest::Download;
using gputest::RandomKvRows;
using gputest::RandomOrthogonal;
using gputest::Upload;

class CudaCodecTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (CudaDeviceCount() == 0) return;
    auto b = CreateCudaBackend(0);
    ASSERT_TRUE(b.ok()) << b.status();
    gpu_ = b->release();
  }
  static void TearDownTestSuite() {
    delete gpu_;
    gpu_ = nullptr;
  }
  void SetUp() override {
    if (gpu_ == nullptr) GTEST_SKIP() << "no CUDA device";
  }
  static Backend* gpu_;
};
Backend* CudaCodecTest::gpu_ = nullptr;

struct CodecCase {
  int heads, dim, group, page_tokens, jobs;
  float clip_k, clip_v;
  bool per_head;
  int src_shift = 0;  // GPU blocks start this many bf16 past a 16-byte boundary (0 or 4)
  // R = H (the data-free default) for every matrix: sums of +-x/sqrt(D) of
  // bf16 inputs, so equal magnitudes among a row's largest are common and
  // the clip search's repeat handling runs on real shapes.
  bool hadamard = false;
  // Every job uses rotation set 0 (else jobs alternate between two sets, so
  // that a 64-row tile of 32-token pages mixes rotations).
  bool one_rotation = false;
};

struct Counts {
  size_t codes = 0, code_flips = 0, params = 0, param_diffs = 0;
  int max_param_ulp = 0;
};

// Distance in fp16 ulps between two finite fp16 values of the same sign.
int Fp16UlpDistance(uint16_t a, uint16_t b) {
  auto key = [](uint16_t h) { return (h & 0x8000) ? -int(h & 0x7fff) : int(h); };
  return std::abs(key(a) - key(b));
}

// One case's random blocks and rotations on both sides, and its jobs: the
// CPU's into cpu_pages, the GPU's into pages_dev.
struct EncodeInputs {
  PageGeometry geom;
  std::vector<bf16_bits> blocks;
  std::vector<float> rot;
  DeviceBuffer blocks_dev, rot_dev, pages_dev;
  std::vector<uint8_t> cpu_pages;
  std::vector<EncodeJob> cpu_jobs, gpu_jobs;
};

void MakeEncodeInputs(Backend& gpu, const CodecCase& c, uint64_t seed, EncodeInputs* in) {
  std::mt19937_64 rng(seed);
  in->geom = PageGeometry{c.heads, c.dim, c.group, c.page_tokens};
  const size_t block_elems = in->geom.exact_block_bytes() / 2;
  const size_t page_bytes = in->geom.page_bytes();
  in->blocks = RandomKvRows(block_elems * c.jobs / c.dim, c.dim, rng);
  // Two rotation sets (jobs alternate between them unless c.one_rotation);
  // per-head: one matrix per head.
  const int mats = c.per_head ? c.heads : 1;
  const size_t set_floats = size_t(mats) * c.dim * c.dim;
  std::vector<float>& rot = in->rot;
  rot.assign(4 * set_floats, 0.0f);
  for (int s = 0; s < 4 * mats; ++s) {
    if (c.hadamard) {
      const std::vector<double> h = HadamardMatrix(c.dim);
      for (size_t i = 0; i < h.size(); ++i) rot[size_t(s) * c.dim * c.dim + i] = float(h[i]);
      continue;
    }
    auto r = RandomOrthogonal(c.dim, rng);
    std::memcpy(&rot[size_t(s) * c.dim * c.dim], r.data(), r.size() * 4);
  }
  // Layout: set 0 K, set 0 V, set 1 K, set 1 V.
  std::vector<bf16_bits> shifted(c.src_shift, 0);
  shifted.insert(shifted.end(), in->blocks.begin(), in->blocks.end());
  auto blocks_dev = Upload(gpu, shifted);
  ASSERT_TRUE(blocks_dev.ok()) << blocks_dev.status();
  auto rot_dev = Upload(gpu, rot);
  ASSERT_TRUE(rot_dev.ok()) << rot_dev.status();
  auto pages_dev = gpu.Allocate(page_bytes * c.jobs);
  ASSERT_TRUE(pages_dev.ok());
  in->blocks_dev = std::move(blocks_dev).value();
  in->rot_dev = std::move(rot_dev).value();
  in->pages_dev = std::move(pages_dev).value();
  in->cpu_pages.assign(page_bytes * c.jobs, 0);

  in->cpu_jobs.resize(c.jobs);
  in->gpu_jobs.resize(c.jobs);
  for (int j = 0; j < c.jobs; ++j) {
    const int set = c.one_rotation ? 0 : j % 2;
    const size_t rk = 2 * set * set_floats, rv = (2 * set + 1) * set_floats;
    const size_t stride = c.per_head ? size_t(c.dim) * c.dim : 0;
    in->cpu_jobs[j] = EncodeJob{in->blocks.data() + j * block_elems,
                                in->cpu_pages.data() + j * page_bytes,
                                RotationRef{rot.data() + rk, rot.data() + rv, stride}, c.clip_k,
                                c.clip_v};
    const float* rd = in->rot_dev.as<float>();
    in->gpu_jobs[j] = EncodeJob{in->blocks_dev.as<bf16_bits>() + c.src_shift + j * block_elems,
                                in->pages_dev.as<uint8_t>() + j * page_bytes,
                                RotationRef{rd + rk, rd + rv, stride}, c.clip_k, c.clip_v};
  }
}

// Encodes `c.jobs` random blocks on both backends; returns the mismatch counts
// and leaves the pages (CPU and GPU) for the decode checks.
void RunEncode(Backend& gpu, const CodecCase& c, uint64_t seed, Counts* counts,
               std::vector<uint8_t>* cpu_pages_out, DeviceBuffer* gpu_pages_out,
               std::vector<float>* rot_out, DeviceBuffer* rot_dev_out) {
  EncodeInputs in;
  MakeEncodeInputs(gpu, c, seed, &in);
  if (::testing::Test::HasFatalFailure()) return;
  const PageGeometry& geom = in.geom;
  const size_t page_bytes = geom.page_bytes();
  // Poison the GPU pages: every byte must be written.
  std::vector<uint8_t> poison(page_bytes * c.jobs, 0xA5);
  ASSERT_TRUE(gpu.CopyToDevice(in.pages_dev.data(), poison.data(), poison.size()).ok());

  CpuBackend cpu(2);
  ASSERT_TRUE(cpu.EncodePages(geom, in.cpu_jobs.data(), c.jobs).ok());
  ASSERT_TRUE(gpu.EncodePages(geom, in.gpu_jobs.data(), c.jobs).ok());
  auto got = Download<uint8_t>(gpu, in.pages_dev.data(), page_bytes * c.jobs);
  ASSERT_TRUE(got.ok());

  for (int j = 0; j < c.jobs; ++j) {
    for (int h = 0; h < c.heads; ++h) {
      for (int kind = 0; kind < 2; ++kind) {
        const size_t co = j * page_bytes + geom.codes_offset(h, kind);
        const size_t po = j * page_bytes + geom.params_offset(h, kind);
        for (int t = 0; t < c.page_tokens; ++t) {
          uint8_t qa[256], qb[256];
          UnpackRow(&in.cpu_pages[co + t * geom.code_row_bytes()], c.dim, qa);
          UnpackRow(&(*got)[co + t * geom.code_row_bytes()], c.dim, qb);
          for (int e = 0; e < c.dim; ++e) counts->code_flips += qa[e] != qb[e];
          counts->codes += c.dim;
          for (int gi = 0; gi < geom.groups(); ++gi) {
            const size_t o = po + (size_t(t) * geom.groups() + gi) * 4;
            const bool differ = std::memcmp(&in.cpu_pages[o], &(*got)[o], 4) != 0;
            counts->param_diffs += differ;
            counts->params += 1;
            if (differ) {
              uint16_t a[2], b[2];
              std::memcpy(a, &in.cpu_pages[o], 4);
              std::memcpy(b, &(*got)[o], 4);
              counts->max_param_ulp = std::max(
                  {counts->max_param_ulp, Fp16UlpDistance(a[0], b[0]), Fp16UlpDistance(a[1], b[1])});
            }
          }
        }
      }
    }
  }
  *cpu_pages_out = std::move(in.cpu_pages);
  *gpu_pages_out = std::move(in.pages_dev);
  *rot_out = std::move(in.rot);
  *rot_dev_out = std::move(in.rot_dev);
}

const CodecCase kCases[] = {
    {4, 128, 128, 32, 24, 0.96f, 0.92f, false}, {2, 128, 32, 32, 12, 0.96f, 0.92f, true},
    {3, 128, 16, 5, 9, 1.0f, 1.0f, false},      {2, 64, 64, 32, 10, 0.96f, 0.92f, false},
    {2, 64, 4, 7, 6, 0.9f, 0.5f, false},        {2, 256, 256, 32, 8, 0.96f, 0.92f, true},
    {1, 256, 64, 16, 5, 1.0f, 0.92f, false},    {8, 128, 128, 32, 70, 0.96f, 0.92f, false},
    // Blocks only 8-byte aligned (the job contract's minimum), clip ratios
    // that keep 40 of 128 (past the max-extraction path) and 24 of 64.
    {2, 128, 128, 32, 6, 0.7f, 0.9f, false, 4}, {2, 64, 32, 16, 6, 0.95f, 0.63f, true, 4},
    // Group sizes 8 and 64 at D = 128, odd page sizes (4-byte aligned code rows).
    {2, 128, 8, 9, 6, 0.96f, 0.92f, false}, {3, 128, 64, 11, 6, 0.96f, 0.92f, true},
    // The benchmark's data: Hadamard rotation, 8 heads, D 128, G 128, and D 64.
    {8, 128, 128, 32, 64, 0.96f, 0.92f, false, 0, true},
    {4, 64, 64, 32, 16, 0.96f, 0.92f, false, 0, true},
};

TEST_F(CudaCodecTest, EncodeMatchesCpuBackendUpToRareBoundaryFlips) {
  Counts total;
  uint64_t seed = 1;
  for (const CodecCase& c : kCases) {
    SCOPED_TRACE(testing::Message() << "H=" << c.heads << " D=" << c.dim << " G=" << c.group
                                    << " P=" << c.page_tokens << " clip=" << c.clip_k);
    Counts k;
    std::vector<uint8_t> cpu_pages;
    DeviceBuffer gpu_pages, rot_dev;
    std::vector<float> rot;
    ASSERT_NO_FATAL_FAILURE(RunEncode(*gpu_, c, seed++, &k, &cpu_pages, &gpu_pages, &rot, &rot_dev));
    if (c.hadamard) {
      std::printf("encode, Hadamard D=%d: %zu of %zu codes flipped, %zu of %zu params differ, "
                  "max %d fp16 ulp\n",
                  c.dim, k.code_flips, k.codes, k.param_diffs, k.params, k.max_param_ulp);
    }
    EXPECT_LT(double(k.code_flips), 1e-4 * k.codes + 0.5);
    EXPECT_LT(double(k.param_diffs), 1e-2 * k.params + 0.5);
    EXPECT_LE(k.max_param_ulp, 4);
    total.codes += k.codes;
    total.code_flips += k.code_flips;
    total.params += k.params;
    total.param_diffs += k.param_diffs;
    total.max_param_ulp = std::max(total.max_param_ulp, k.max_param_ulp);
  }
  std::printf("encode: %zu of %zu codes flipped (%.2e), %zu of %zu params differ (%.2e), "
              "max %d fp16 ulp\n",
              total.code_flips, total.codes, double(total.code_flips) / total.codes,
              total.param_diffs, total.params, double(total.param_diffs) / total.params,
              total.max_param_ulp);
  RecordProperty("code_flip_fraction", std::to_string(double(total.code_flips) / total.codes));
}

bool WarpgroupKernelRuns() {
  auto available = EncodeWarpgroupAvailable();
  return available.ok() && *available;
}

// Encodes `c` once with each kernel of `choices`, each over its own poison (so
// that a byte one leaves unwritten shows too), into (*pages)[k].
void EncodeWithEach(Backend& gpu, const CodecCase& c, uint64_t seed,
                    const std::vector<EncodeKernelChoice>& choices,
                    std::vector<std::vector<uint8_t>>* pages) {
  EncodeInputs in;
  MakeEncodeInputs(gpu, c, seed, &in);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  const size_t bytes = in.geom.page_bytes() * c.jobs;
  auto jobs_dev = Upload(gpu, in.gpu_jobs);
  ASSERT_TRUE(jobs_dev.ok()) << jobs_dev.status();
  const uint8_t poisons[] = {0xA5, 0x5A, 0xC3};
  ASSERT_LE(choices.size(), std::size(poisons));
  for (size_t k = 0; k < choices.size(); ++k) {
    const std::vector<uint8_t> fill(bytes, poisons[k]);
    ASSERT_TRUE(gpu.CopyToDevice(in.pages_dev.data(), fill.data(), bytes).ok());
    // The backend copies on its own (non-blocking) stream; the launch below
    // goes to the legacy stream: let every copy land first.
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const absl::Status launched =
        LaunchEncodePages(in.geom, jobs_dev->as<EncodeJob>(), c.jobs, nullptr, choices[k]);
    ASSERT_TRUE(launched.ok()) << launched;
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    auto got = Download<uint8_t>(gpu, in.pages_dev.data(), bytes);
    ASSERT_TRUE(got.ok()) << got.status();
    pages->push_back(std::move(got).value());
  }
}

size_t CountDiffering(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  size_t n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += a[i] != b[i];
  return n;
}

// Encodes `c` with the strip, roles and (D 128, where it runs) wgmma kernels.
// The roles kernel is the strip kernel's math split between multiplying and
// quantizing warps: the same pages byte for byte. The wgmma kernel rotates
// with R's three bf16 terms in one accumulator, the roles kernel with two
// fp16 terms: pages may differ only where a code or a param sits on a
// rounding boundary (both quantize with the same code). Bound: 5e-4 of the
// page bytes (measured at most 1.2e-4 on the H200, 2026-12-02, in the G = 8
// case, whose rows are 2/3 params; 3.0e-5 on the benchmark's data).
void ExpectEncodeKernelsAgree(Backend& gpu, const CodecCase& c, uint64_t seed) {
  std::vector<EncodeKernelChoice> choices = {EncodeKernelChoice::kStrips,
                                             EncodeKernelChoice::kRoles};
  if (c.dim == 128 && WarpgroupKernelRuns()) choices.push_back(EncodeKernelChoice::kWarpgroup);
  std::vector<std::vector<uint8_t>> pages;
  ASSERT_NO_FATAL_FAILURE(EncodeWithEach(gpu, c, seed, choices, &pages));
  const size_t bytes = pages[0].size();
  EXPECT_EQ(CountDiffering(pages[0], pages[1]), 0u) << "roles vs strip, of " << bytes
                                                    << " page bytes";
  if (pages.size() > 2) {
    const size_t differing = CountDiffering(pages[1], pages[2]);
    EXPECT_LT(double(differing), 5e-4 * bytes + 0.5) << "wgmma vs roles, of " << bytes
                                                     << " page bytes";
    std::printf("wgmma vs roles kernel: %zu of %zu page bytes differ\n", differing, bytes);
  }
}

// On a Hopper GPU the build's sm_90a code must be what runs (else every
// encode test below would silently test the roles kernel in its place).
TEST_F(CudaCodecTest, HopperRunsTheWgmmaEncodeKernel) {
  cudaDeviceProp prop;
  ASSERT_EQ(cudaGetDeviceProperties(&prop, 0), cudaSuccess);
  auto available = EncodeWarpgroupAvailable();
  ASSERT_TRUE(available.ok()) << available.status();
  if (prop.major != 9 || prop.minor != 0) GTEST_SKIP() << "not a Hopper GPU: " << prop.name;
  EXPECT_TRUE(*available) << "built without sm_90a? (kernels/cuda/CMakeLists.txt)";
  // Forcing it on a head dim it does not take is refused.
  const PageGeometry geom{2, 64, 64, 32};
  const absl::Status s =
      LaunchEncodePages(geom, nullptr, 1, nullptr, EncodeKernelChoice::kWarpgroup);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
}

// Every case with D <= 128 as it is (tiles that mix rotations and jobs, odd
// page sizes, 8-byte-aligned blocks, Hadamard ties). Small: most blocks get
// one tile; run_all.sh's sanitizer runs use this test only.
TEST_F(CudaCodecTest, RolesKernelWritesTheStripKernelsBytes) {
  uint64_t seed = 100;
  for (const CodecCase& c : kCases) {
    if (c.dim > 128) continue;
    SCOPED_TRACE(testing::Message() << "H=" << c.heads << " D=" << c.dim << " G=" << c.group
                                    << " P=" << c.page_tokens << " clip=" << c.clip_k);
    ASSERT_NO_FATAL_FAILURE(ExpectEncodeKernelsAgree(*gpu_, c, seed++));
  }
}

// The same cases with enough jobs that every block of the roles kernel's
// one-wave grid (one block per SM) walks at least 12 tiles, so that its y
// buffers, barrier phases and row slots are each reused several times; each
// case twice: with jobs alternating between two rotations (tiles that mix
// them: one m16 tile per pass) and with one rotation (two m16 tiles per
// fragment load).
TEST_F(CudaCodecTest, RolesKernelWritesTheStripKernelsBytesOverManyTilesPerBlock) {
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  uint64_t seed = 200;
  for (CodecCase c : kCases) {
    if (c.dim > 128) continue;
    const long items_per_tile_row = 2L * c.heads;  // (kind, head) items per 64-row tile
    const long rows = 12L * sms * 64 / items_per_tile_row + 64;
    c.jobs = std::max<int>(c.jobs, static_cast<int>((rows + c.page_tokens - 1) / c.page_tokens));
    for (const bool one_rotation : {false, true}) {
      c.one_rotation = one_rotation;
      SCOPED_TRACE(testing::Message() << "H=" << c.heads << " D=" << c.dim << " G=" << c.group
                                      << " P=" << c.page_tokens << " jobs=" << c.jobs
                                      << " one rotation=" << one_rotation);
      // The wgmma kernel's tiles of two rotations take one multiply per
      // rotation, each storing its own rows.
      ASSERT_NO_FATAL_FAILURE(ExpectEncodeKernelsAgree(*gpu_, c, seed++));
    }
  }
}

// The dim x dim identity, row-major (a rotation under which y = x exactly).
std::vector<float> IdentityMatrix(int dim) {
  std::vector<float> eye(size_t(dim) * dim, 0.0f);
  for (int i = 0; i < dim; ++i) eye[size_t(i) * dim + i] = 1.0f;
  return eye;
}

// Encodes `blocks` (`jobs` exact blocks of `geom`) with the identity rotation,
// so y = x exactly on both backends, and the clip ratios ratios(j) = {K, V}
// of job j, on the CPU and on the GPU with each kernel in `choices` (kAuto
// through Backend::EncodePages, as the server calls it; the others through
// LaunchEncodePages), each over a poison, and expects the CPU's pages byte
// for byte.
template <typename Ratios>
void ExpectIdentityPagesEqualCpu(Backend& gpu, const PageGeometry& geom,
                                 const std::vector<bf16_bits>& blocks, int jobs, Ratios ratios,
                                 const std::vector<EncodeKernelChoice>& choices) {
  const int dim = geom.head_dim;
  const size_t block_elems = geom.exact_block_bytes() / 2;
  const std::vector<float> eye = IdentityMatrix(dim);
  auto blocks_dev = Upload(gpu, blocks);
  auto eye_dev = Upload(gpu, eye);
  ASSERT_TRUE(blocks_dev.ok() && eye_dev.ok());
  auto pages_dev = gpu.Allocate(geom.page_bytes() * jobs);
  ASSERT_TRUE(pages_dev.ok());
  std::vector<uint8_t> cpu_pages(geom.page_bytes() * jobs, 0);
  std::vector<EncodeJob> cpu_jobs(jobs), gpu_jobs(jobs);
  for (int j = 0; j < jobs; ++j) {
    const auto [ck, cv] = ratios(j);
    cpu_jobs[j] = EncodeJob{blocks.data() + j * block_elems,
                            cpu_pages.data() + j * geom.page_bytes(),
                            RotationRef{eye.data(), eye.data(), 0}, ck, cv};
    gpu_jobs[j] = EncodeJob{blocks_dev->as<bf16_bits>() + j * block_elems,
                            pages_dev->as<uint8_t>() + j * geom.page_bytes(),
                            RotationRef{eye_dev->as<float>(), eye_dev->as<float>(), 0}, ck, cv};
  }
  CpuBackend cpu(2);
  ASSERT_TRUE(cpu.EncodePages(geom, cpu_jobs.data(), jobs).ok());
  auto jobs_dev = Upload(gpu, gpu_jobs);
  ASSERT_TRUE(jobs_dev.ok()) << jobs_dev.status();
  for (const EncodeKernelChoice choice : choices) {
    SCOPED_TRACE(testing::Message() << "kernel choice " << static_cast<int>(choice));
    const std::vector<uint8_t> poison(cpu_pages.size(), 0xC3);
    ASSERT_TRUE(gpu.CopyToDevice(pages_dev->data(), poison.data(), poison.size()).ok());
    if (choice == EncodeKernelChoice::kAuto) {
      ASSERT_TRUE(gpu.EncodePages(geom, gpu_jobs.data(), jobs).ok());
    } else {
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the backend copies on its own stream
      ASSERT_TRUE(
          LaunchEncodePages(geom, jobs_dev->as<EncodeJob>(), jobs, nullptr, choice).ok());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    }
    auto got = Download<uint8_t>(gpu, pages_dev->data(), cpu_pages.size());
    ASSERT_TRUE(got.ok());
    size_t differ = 0;
    for (size_t i = 0; i < cpu_pages.size(); ++i) differ += cpu_pages[i] != (*got)[i];
    EXPECT_EQ(differ, 0u) << "of " << cpu_pages.size() << " page bytes";
  }
}

// Rows whose largest magnitudes repeat (small integers, identity rotation, so
// y = x exactly on both backends): the GPU's fast clip search, which drops
// every holder of the current maximum per round, must notice the repeats and
// recount. Every byte must equal the CPU's (no rounding differences here).
TEST_F(CudaCodecTest, RepeatedLargestValuesClipExactlyLikeTheCpu) {
  std::mt19937_64 rng(7);
  for (const int dim : {64, 128}) {
    SCOPED_TRACE(testing::Message() << "D=" << dim);
    const PageGeometry geom{2, dim, 32, 32};
    const int jobs = 6;
    const size_t block_elems = geom.exact_block_bytes() / 2;
    std::uniform_int_distribution<int> small(-3, 3);
    std::vector<bf16_bits> blocks(block_elems * jobs);
    for (auto& v : blocks) v = FloatToBf16(static_cast<float>(small(rng)));
    // Clip ranks 13 and 20 from the top (D = 128), 7 and 10 (D = 64).
    ASSERT_NO_FATAL_FAILURE(ExpectIdentityPagesEqualCpu(
        *gpu_, geom, blocks, jobs, [](int) { return std::pair{0.9f, 0.85f}; },
        {EncodeKernelChoice::kAuto}));
  }
}

// Rows in which one lane of the quantizing warp holds all of its values among
// the row's largest magnitudes: the clip search drops that lane's head once
// per value and then meets a value it has already taken (it does not zero the
// last one, for speed), which must send the row to the exact recount. With
// the identity rotation y = x, so the pages must equal the CPU's byte for
// byte, for every kernel that encodes the head dim, with one group per row
// and with groups of 32 (one lane per group computes its scale). Lane L holds
// elements L + 32 i; here they get the magnitudes 64 + 8 i (signs
// alternating), every other element a distinct magnitude below 16. Clip
// ratios put the threshold past those values (more rounds than the lane has
// values), exactly at its last one, and before it (at D 64 that is no
// clipping); the jobs cycle through them, so that a 64-row tile (two jobs)
// mixes thresholds in a pass.
TEST_F(CudaCodecTest, ALaneHoldingAllOfTheLargestValuesClipsLikeTheCpu) {
  for (const auto& [dim, group] : {std::pair{64, 64}, std::pair{64, 32}, std::pair{128, 128},
                                   std::pair{128, 32}, std::pair{256, 256}, std::pair{256, 32}}) {
    SCOPED_TRACE(testing::Message() << "D=" << dim << " G=" << group);
    const int E = dim / 32;
    const PageGeometry geom{2, dim, group, 32};
    const int jobs = 6;
    const size_t block_elems = geom.exact_block_bytes() / 2;
    const size_t row_elems = geom.exact_row_elems();
    std::vector<bf16_bits> blocks(block_elems * jobs);
    for (int j = 0; j < jobs; ++j) {
      for (int kind = 0; kind < 2; ++kind) {
        for (int t = 0; t < geom.page_tokens; ++t) {
          for (int h = 0; h < geom.kv_heads; ++h) {
            bf16_bits* x = blocks.data() + j * block_elems + kind * size_t(geom.page_tokens) * row_elems +
                           size_t(t) * row_elems + size_t(h) * dim;
            const int lane = (t * 7 + h * 3 + kind + j) % 32;
            for (int e = 0; e < dim; ++e) {
              float v;
              if (e % 32 == lane) {
                const int i = e / 32;
                v = (i % 2 == 0 ? 1.0f : -1.0f) * static_cast<float>(64 + 8 * i);
              } else {
                v = static_cast<float>((e * 37 + t) % dim) / 16.0f;  // distinct, < 16
                if (e % 3 == 0) v = -v;
              }
              x[e] = FloatToBf16(v);
            }
          }
        }
      }
    }
    // Thresholds from the top: E + 2 and E + 7 values (past the lane's E),
    // exactly E, and E - 1 and E + 1 (K, V ratios of jobs 3m, 3m + 1, 3m + 2).
    const auto ratio = [&](int top) { return static_cast<float>(dim - top + 1) / dim; };
    const std::pair<float, float> clips[3] = {
        {ratio(E + 2), ratio(E + 7)}, {ratio(E), ratio(E)}, {ratio(E - 1), ratio(E + 1)}};
    std::vector<EncodeKernelChoice> choices = {EncodeKernelChoice::kAuto};
    if (dim <= 128) {
      choices.insert(choices.end(), {EncodeKernelChoice::kStrips, EncodeKernelChoice::kRoles,
                                     EncodeKernelChoice::kTiled});
      if (dim == 128 && WarpgroupKernelRuns()) choices.push_back(EncodeKernelChoice::kWarpgroup);
    }
    ASSERT_NO_FATAL_FAILURE(ExpectIdentityPagesEqualCpu(
        *gpu_, geom, blocks, jobs, [&](int j) { return clips[j % 3]; }, choices));
  }
}

// A copy batch (Backend::BeginCopyBatch) as a decode step's fused appends
// use it: many small row copies deferred into one driver call, with an
// encode of some of the blocks in the middle (it must see their rows), and
// large filler copies that lap the 1 MiB pinned ring several times. Every
// byte must land, and the pages must equal the CPU's.
TEST_F(CudaCodecTest, ACopyBatchAcrossRingLapsAndEncodesKeepsEveryCopyInOrder) {
  const PageGeometry geom{2, 128, 32, 32};
  const int dim = 128, jobs = 6;
  const size_t block_elems = geom.exact_block_bytes() / 2, row = geom.exact_row_elems();
  std::mt19937_64 rng(11);
  std::uniform_int_distribution<int> small(-3, 3);
  std::vector<bf16_bits> blocks(block_elems * jobs);
  for (auto& v : blocks) v = FloatToBf16(static_cast<float>(small(rng)));
  std::vector<uint8_t> filler(size_t(3) << 20);
  for (auto& b : filler) b = static_cast<uint8_t>(rng());
  const std::vector<float> eye = IdentityMatrix(dim);
  auto eye_dev = Upload(*gpu_, eye);
  auto blocks_dev = gpu_->Allocate(blocks.size() * 2);
  auto pages_dev = gpu_->Allocate(geom.page_bytes() * jobs);
  auto filler_dev = gpu_->Allocate(filler.size());
  ASSERT_TRUE(eye_dev.ok() && blocks_dev.ok() && pages_dev.ok() && filler_dev.ok());
  std::vector<uint8_t> cpu_pages(geom.page_bytes() * jobs, 0);
  std::vector<EncodeJob> cpu_jobs(jobs), gpu_jobs(jobs);
  for (int j = 0; j < jobs; ++j) {
    cpu_jobs[j] = EncodeJob{blocks.data() + j * block_elems, cpu_pages.data() + j * geom.page_bytes(),
                            RotationRef{eye.data(), eye.data(), 0}, 0.9f, 0.85f};
    gpu_jobs[j] = EncodeJob{blocks_dev->as<bf16_bits>() + j * block_elems,
                            pages_dev->as<uint8_t>() + j * geom.page_bytes(),
                            RotationRef{eye_dev->as<float>(), eye_dev->as<float>(), 0}, 0.9f, 0.85f};
  }
  CpuBackend cpu(2);
  ASSERT_TRUE(cpu.EncodePages(geom, cpu_jobs.data(), jobs).ok());

  const size_t chunk = size_t(48) << 10;  // filler copies: 64 of 48 KB, 3 MiB in all
  size_t filler_pos = 0;
  auto copy_filler = [&] {
    if (filler_pos >= filler.size()) return;
    ASSERT_TRUE(gpu_->CopyToDevice(filler_dev->as<uint8_t>() + filler_pos, &filler[filler_pos],
                                   chunk).ok());
    filler_pos += chunk;
  };
  gpu_->BeginCopyBatch();
  for (int j = 0; j < jobs; ++j) {
    // Token by token, K row then V row, as fused appends write them.
    bf16_bits* dst = blocks_dev->as<bf16_bits>() + j * block_elems;
    const bf16_bits* src = blocks.data() + j * block_elems;
    for (int t = 0; t < geom.page_tokens; ++t) {
      ASSERT_TRUE(gpu_->CopyToDevice(dst + t * row, src + t * row, row * 2).ok());
      const size_t v = size_t(geom.page_tokens) * row + t * row;
      ASSERT_TRUE(gpu_->CopyToDevice(dst + v, src + v, row * 2).ok());
      if (t % 3 == 0) copy_filler();
    }
    if (j == 2) ASSERT_TRUE(gpu_->EncodePages(geom, gpu_jobs.data(), 3).ok());  // mid-batch
  }
  while (filler_pos < filler.size()) copy_filler();
  ASSERT_TRUE(gpu_->EndCopyBatch().ok());
  ASSERT_TRUE(gpu_->EncodePages(geom, gpu_jobs.data() + 3, 3).ok());
  auto pages = Download<uint8_t>(*gpu_, pages_dev->data(), cpu_pages.size());
  auto back = Download<uint8_t>(*gpu_, filler_dev->data(), filler.size());
  ASSERT_TRUE(pages.ok() && back.ok());
  size_t differ = 0;
  for (size_t i = 0; i < cpu_pages.size(); ++i) differ += cpu_pages[i] != (*pages)[i];
  EXPECT_EQ(differ, 0u) << "page bytes unlike the CPU's, of " << cpu_pages.size();
  EXPECT_TRUE(*back == filler) << "filler bytes lost or out of order";
}

TEST_F(CudaCodecTest, DecodeMatchesCpuBackendOnTheSamePages) {
  size_t outputs = 0, diffs = 0;
  float max_rel = 0.0f;  // largest difference in units of the row's BF16 ulp
  uint64_t seed = 100;
  for (const CodecCase& c : kCases) {
    SCOPED_TRACE(testing::Message() << "D=" << c.dim << " G=" << c.group);
    Counts k;
    std::vector<uint8_t> cpu_pages;
    DeviceBuffer gpu_pages, rot_dev;
    std::vector<float> rot;
    ASSERT_NO_FATAL_FAILURE(RunEncode(*gpu_, c, seed++, &k, &cpu_pages, &gpu_pages, &rot, &rot_dev));
    const PageGeometry geom{c.heads, c.dim, c.group, c.page_tokens};
    // Decode the CPU's pages on both backends.
    auto src_dev = Upload(*gpu_, cpu_pages);
    ASSERT_TRUE(src_dev.ok());
    const size_t block_elems = geom.exact_block_bytes() / 2;
    auto dst_dev = gpu_->Allocate(block_elems * 2 * c.jobs);
    ASSERT_TRUE(dst_dev.ok());
    std::vector<bf16_bits> poison(block_elems * c.jobs, 0x7fc1);
    ASSERT_TRUE(gpu_->CopyToDevice(dst_dev->data(), poison.data(), poison.size() * 2).ok());
    std::vector<bf16_bits> cpu_out(block_elems * c.jobs, 0);
    const int mats = c.per_head ? c.heads : 1;
    const size_t set_floats = size_t(mats) * c.dim * c.dim;
    const size_t stride = c.per_head ? size_t(c.dim) * c.dim : 0;
    std::vector<DecodeJob> cj(c.jobs), gj(c.jobs);
    for (int j = 0; j < c.jobs; ++j) {
      const int set = j % 2;
      const size_t rk = 2 * set * set_floats, rv = (2 * set + 1) * set_floats;
      cj[j] = DecodeJob{cpu_pages.data() + j * geom.page_bytes(), cpu_out.data() + j * block_elems,
                        RotationRef{rot.data() + rk, rot.data() + rv, stride}};
      const float* rd = rot_dev.as<float>();
      gj[j] = DecodeJob{src_dev->as<uint8_t>() + j * geom.page_bytes(),
                        dst_dev->as<bf16_bits>() + j * block_elems,
                        RotationRef{rd + rk, rd + rv, stride}};
    }
    CpuBackend cpu(2);
    ASSERT_TRUE(cpu.DecodePages(geom, cj.data(), c.jobs).ok());
    ASSERT_TRUE(gpu_->DecodePages(geom, gj.data(), c.jobs).ok());
    auto got = Download<bf16_bits>(*gpu_, dst_dev->data(), block_elems * c.jobs);
    ASSERT_TRUE(got.ok());
    const size_t rows = cpu_out.size() / c.dim;
    for (size_t rw = 0; rw < rows; ++rw) {
      float mx = 0.0f;
      for (int e = 0; e < c.dim; ++e) mx = std::max(mx, std::fabs(Bf16ToFloat(cpu_out[rw * c.dim + e])));
      const float ulp_row = mx * (1.0f / 128.0f);  // bf16 has 8 significant bits
      for (int e = 0; e < c.dim; ++e) {
        const size_t i = rw * c.dim + e;
        const float d = std::fabs(Bf16ToFloat(cpu_out[i]) - Bf16ToFloat((*got)[i]));
        // Hadamard rows dequantize to sums of +-(q·s + lo)/sqrt(D), which
        // often land on a bf16 rounding boundary, so fp32 summation order
        // flips their last bit far more often (2.4 % of outputs on the H200,
        // 2026-11-30, within 0.31 row ulps): they are held to the row-ulp
        // bound only.
        if (!c.hadamard) diffs += d != 0.0f;
        max_rel = std::max(max_rel, mx > 0 ? d / ulp_row : (d > 0 ? 1e9f : 0.0f));
      }
    }
    if (!c.hadamard) outputs += cpu_out.size();
  }
  std::printf("decode: %zu of %zu bf16 outputs differ (%.2e), max difference %.3f row ulps\n",
              diffs, outputs, double(diffs) / outputs, max_rel);
  EXPECT_LE(max_rel, 1.0f);
  EXPECT_LT(double(diffs), 1e-3 * outputs + 0.5);
}

TEST_F(CudaCodecTest, GpuRoundTripStaysWithinTheQuantizationError) {
  // Encode on the GPU, decode on the GPU: the reconstruction error of each row
  // must match the CPU round trip's (same codec) within 2%, on average.
  const CodecCase c{4, 128, 128, 32, 16, 0.96f, 0.92f, false};
  Counts k;
  std::vector<uint8_t> cpu_pages;
  DeviceBuffer gpu_pages, rot_dev;
  std::vector<float> rot;
  std::mt19937_64 rng(7);
  ASSERT_NO_FATAL_FAILURE(RunEncode(*gpu_, c, 7, &k, &cpu_pages, &gpu_pages, &rot, &rot_dev));
  const PageGeometry geom{c.heads, c.dim, c.group, c.page_tokens};
  const size_t block_elems = geom.exact_block_bytes() / 2;
  // Regenerate the same blocks RunEncode drew (same seed, same order).
  std::mt19937_64 rng2(7);
  std::vector<bf16_bits> blocks = RandomKvRows(block_elems * c.jobs / c.dim, c.dim, rng2);
  auto dst_dev = gpu_->Allocate(block_elems * 2 * c.jobs);
  ASSERT_TRUE(dst_dev.ok());
  const size_t set_floats = size_t(c.dim) * c.dim;
  std::vector<DecodeJob> gj(c.jobs), cj(c.jobs);
  std::vector<bf16_bits> cpu_out(block_elems * c.jobs);
  for (int j = 0; j < c.jobs; ++j) {
    const int set = j % 2;
    const size_t rk = 2 * set * set_floats, rv = (2 * set + 1) * set_floats;
    const float* rd = rot_dev.as<float>();
    gj[j] = DecodeJob{gpu_pages.as<uint8_t>() + j * geom.page_bytes(),
                      dst_dev->as<bf16_bits>() + j * block_elems, RotationRef{rd + rk, rd + rv, 0}};
    cj[j] = DecodeJob{cpu_pages.data() + j * geom.page_bytes(), cpu_out.data() + j * block_elems,
                      RotationRef{rot.data() + rk, rot.data() + rv, 0}};
  }
  ASSERT_TRUE(gpu_->DecodePages(geom, gj.data(), c.jobs).ok());
  CpuBackend cpu(2);
  ASSERT_TRUE(cpu.DecodePages(geom, cj.data(), c.jobs).ok());
  auto got = Download<bf16_bits>(*gpu_, dst_dev->data(), block_elems * c.jobs);
  ASSERT_TRUE(got.ok());
  double err_gpu = 0, err_cpu = 0, norm = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const double x = Bf16ToFloat(blocks[i]);
    err_gpu += std::pow(Bf16ToFloat((*got)[i]) - x, 2);
    err_cpu += std::pow(Bf16ToFloat(cpu_out[i]) - x, 2);
    norm += x * x;
  }
  const double rg = std::sqrt(err_gpu / norm), rc = std::sqrt(err_cpu / norm);
  std::printf("round trip relative error: gpu %.4f cpu %.4f\n", rg, rc);
  EXPECT_GT(rc, 0.01);  // a 2-bit codec cannot be exact: guards against comparing x with x
  EXPECT_NEAR(rg, rc, 0.02 * rc);
}

TEST_F(CudaCodecTest, BadJobsAreRefusedWithAClearStatus) {
  const PageGeometry geom{2, 128, 128, 32};
  EncodeJob job;
  auto st = gpu_->EncodePages(geom, &job, 1);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  st = gpu_->EncodePages(PageGeometry{2, 96, 32, 32}, &job, 1);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  DecodeJob dj;
  st = gpu_->DecodePages(geom, &dj, 1);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_TRUE(gpu_->EncodePages(geom, nullptr, 0).ok());
}

TEST(CudaBackendFactory, ReportsUnavailableWithoutADeviceAndRangeErrorsOtherwise) {
  auto b = CreateCudaBackend(0);
  if (CudaDeviceCount() == 0) {
    EXPECT_EQ(b.status().code(), absl::StatusCode::kUnavailable) << b.status();
  } else {
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ((*b)->name(), "cuda");
    auto bad = CreateCudaBackend(CudaDeviceCount());
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  }
}

}  // namespace
}  // namespace oscarkv
