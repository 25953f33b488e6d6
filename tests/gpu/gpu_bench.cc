// GPU benchmark: one layer of decode attention over the compressed paged
// cache (32 q / 8 kv heads, D = 128, G = 128, P = 32, S0 = 64, W = 256) at
// B=1 8K/32K/64K/128K and B=8 32K/64K, plus the encode kernel's throughput
// and the device-to-device copy bandwidth (and a read-only ceiling, the
// launch floor of empty kernels and the first access after a PDL wait,
// read_probe.cu), in one run. With --baseline, reads
// the PyTorch cuDNN SDPA timings (sdpa_baseline.py, same shapes, same run)
// and prints ratios.
//
// Timing: CUDA events around each launch after warm-up, medians; the cache is
// rotated over several page sets so that L2 never holds it; inputs are random.
// Each row is timed twice: calls issued one by one (ours_us, as in earlier
// runs: includes launch latency when the GPU waits for the CPU) and with a
// batch of calls queued behind a held stream (GPU side; TimeEventsQueued),
// next to the same two figures of SDPA. The default variant's rows also get
// the GPU side cut after each kernel, without the prep kernel
// (AttendLauncher::set_skip_prep: the most that making the query fragments
// inside the split kernel could save) and with the outputs in device memory.
//
//   oscarkv_gpu_bench [--baseline sdpa.json] [--json out.json] [--iters N] [--only B1_S131072]
//                     [--q-heads 32|40|48|56|64]  (query heads over the 8 kv heads, default 32:
//                                                 64 is g = 8, whose default runs paired
//                                                 heads or the 8-head warp on the integer
//                                                 path; give sdpa_baseline.py the same)
//                     [--pair-heads 0|1]  (1, the default: 6 or 8 query heads per kv head run
//                                          as paired heads where AttendLauncher::PairsHeads
//                                          says; 0: never (the 8-head warp under variants 14,
//                                          19 and auto, the float P'·V kernel of g = 8 under
//                                          the others); see AttendLauncher::set_pair_heads)
//                     [--variant N[,N...]]  (split-kernel variants, see AttendLauncher::set_variant;
//                                            default: all, one table row each; with a list,
//                                            every listed variant gets the stage breakdown)
//                     [--ablate BITS]  (time parts of the history loop in place, results wrong:
//                                       see AttendLauncher::set_ablate)
//                     [--fold 0|1|2]  (where the exact blocks run: auto, on the history units,
//                                      in units of their own: see AttendLauncher::set_fold_exact)
//                     [--trace N [--trace-twice]]  (after each row, N more calls (after a
//                                   warm-up round), each queued behind a hold, with per-block
//                                   timestamps (AttendLauncher::set_trace), summarized: when
//                                   the first / median / last block of each kernel passes each
//                                   mark; with --trace-twice each traced call is the second of
//                                   two in a row on the same inputs)
//                     [--trace-dump FILE]  (with --trace: every traced block's row as CSV,
//                                           call,kernel,block,unit,sm then the 7 marks in ns from
//                                           the call's first prep block start, empty if unset)
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "kernels/cuda/attend_kernels.h"
#include "kernels/cuda/codec_kernels.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/hadamard.h"
#include "nlohmann/json.hpp"
#include "tests/gpu/attend_trace_summary.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/gpu/read_probe.h"

namespace oscarkv {
namespace {

#define CK(x)                                                                          \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(3);                                                                    \
    }                                                                                  \
  } while (0)
#define CKS(x)                                                                    \
  do {                                                                            \
    absl::Status s_ = (x);                                                        \
    if (!s_.ok()) {                                                               \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, s_.ToString().c_str()); \
      std::exit(3);                                                               \
    }                                                                             \
  } while (0)

using gputest::Median;

// Median of the intervals between event pairs (ev[2i], ev[2i+1]), in
// microseconds; destroys the events.
double MedianElapsedUs(std::vector<cudaEvent_t>& ev) {
  std::vector<double> t(ev.size() / 2);
  for (size_t i = 0; i < t.size(); ++i) {
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
    t[i] = ms * 1000.0;
  }
  for (auto& e : ev) CK(cudaEventDestroy(e));
  return Median(t);
}

// Median of per-call event timings of fn(i), in microseconds.
template <typename Fn>
double TimeEvents(cudaStream_t s, int warmup, int iters, Fn&& fn) {
  for (int i = 0; i < warmup; ++i) fn(i);
  std::vector<cudaEvent_t> ev(2 * iters);
  for (auto& e : ev) CK(cudaEventCreate(&e));
  for (int i = 0; i < iters; ++i) {
    CK(cudaEventRecord(ev[2 * i], s));
    fn(i);
    CK(cudaEventRecord(ev[2 * i + 1], s));
  }
  CK(cudaStreamSynchronize(s));
  return MedianElapsedUs(ev);
}

// Median GPU-side time of fn(i), in microseconds: the stream is held by a
// host function until a batch of calls (with their events) is enqueued, so
// the events time the GPU's work and gaps alone, not the CPU's launch calls
// (TimeEvents times calls issued one by one, which at small shapes includes
// the launch latency when the GPU waits for the CPU).
// Holds a stream with a host function that spins until Release(), so that
// the work enqueued meanwhile reaches the GPU at once. Must be released
// before the stream is waited for.
class StreamHold {
 public:
  explicit StreamHold(cudaStream_t s) {
    CK(cudaLaunchHostFunc(
        s,
        [](void* p) {
          auto* flag = static_cast<std::atomic<int>*>(p);
          while (flag->load(std::memory_order_acquire) == 0) {
          }
        },
        &go_));
  }
  void Release() { go_.store(1, std::memory_order_release); }

 private:
  std::atomic<int> go_{0};
};

template <typename Fn>
double TimeEventsQueued(cudaStream_t s, int warmup, int iters, Fn&& fn) {
  for (int i = 0; i < warmup; ++i) fn(i);
  constexpr int kBatch = 25;  // calls queued behind one hold (well inside the launch queue)
  std::vector<cudaEvent_t> ev(2 * iters);
  for (auto& e : ev) CK(cudaEventCreate(&e));
  for (int b0 = 0; b0 < iters; b0 += kBatch) {
    StreamHold hold(s);
    for (int i = b0; i < std::min(iters, b0 + kBatch); ++i) {
      CK(cudaEventRecord(ev[2 * i], s));
      fn(i);
      CK(cudaEventRecord(ev[2 * i + 1], s));
    }
    hold.Release();
    CK(cudaStreamSynchronize(s));
  }
  return MedianElapsedUs(ev);
}

// Fast deterministic random BF16 (uniform +-2, every 37th channel x8).
std::vector<bf16_bits> RandomBf16(size_t n, int d, uint64_t seed) {
  std::vector<bf16_bits> x(n);
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < n; ++i) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    const float u = float(s >> 40) / float(1ull << 24) * 4.0f - 2.0f;
    x[i] = FloatToBf16((i % d) % 37 == 3 ? 8.0f * u : u);
  }
  return x;
}

struct Shape {
  int batch, tokens;
};

// --trace-dump: each traced call's blocks, one CSV line each (times in ns
// from the call's first prep block start; marks a block did not pass are
// left empty), for analyses the summary does not make (per-SM loop times).
void DumpTraces(const std::vector<AttendTrace>& traces, const std::string& key, std::FILE* f) {
  using namespace cuda_attend;
  for (size_t c = 0; c < traces.size(); ++c) {
    const AttendTrace& t = traces[c];
    const unsigned long long t0 = gputest::TraceStartNs(t);
    for (int k = 0; k < kTraceKernels; ++k) {
      for (size_t b = 0; b < t.blocks(k); ++b) {
        const unsigned long long* row = t.rows[k].data() + b * kTraceMarks;
        if (row[kTraceStart] == 0) continue;  // a block without a timeline
        std::fprintf(f, "%s,%zu,%d,%zu,%llu,%llu", key.c_str(), c, k, b,
                     gputest::TraceUnitOf(row, b), gputest::TraceSmOf(row));
        for (int m = 0; m < kTraceMarks; ++m) {
          if (m == kTraceSm) continue;
          if (row[m] == 0) {
            std::fprintf(f, ",");
          } else {
            std::fprintf(f, ",%lld", static_cast<long long>(row[m] - t0));
          }
        }
        std::fprintf(f, "\n");
      }
    }
  }
}

// --trace: after one warm-up round, `calls` more calls of the launchers' sets
// in turn (L2 stays cold for the pages) with per-block timestamps, each
// queued behind a hold as the GPU-side timings are (the GPU sees the launches
// at once, not as the host issues them); with `twice`, each traced call is
// the second of two in a row on the same inputs. Prints the summary of the
// timelines (gputest::PrintTraceSummary). The launchers stay traced.
void PrintCallTraces(std::vector<std::unique_ptr<AttendLauncher>>& launchers,
                     const std::vector<AttendBatch>& batches, cudaStream_t stream, int calls,
                     bool twice, const std::string& key, std::FILE* dump) {
  const int sets = static_cast<int>(launchers.size());
  if (launchers[0]->schedule().clusters_per_head > 0) {
    std::printf("%-13s   trace: none (variant 11's cluster kernel records no timeline)\n", "");
    return;
  }
  for (int s = 0; s < sets; ++s) {
    launchers[s]->set_trace(true);
    CKS(launchers[s]->Prepare(batches[s], stream));
  }
  std::vector<AttendTrace> traces;
  for (int i = 0; i < sets + calls; ++i) {
    AttendLauncher& L = *launchers[i % sets];
    StreamHold hold(stream);
    CKS(L.Launch(stream));
    if (twice) CKS(L.Launch(stream));
    hold.Release();
    auto t = L.TakeTrace(stream);
    CKS(t.status());
    if (i >= sets) traces.push_back(std::move(t).value());
  }
  if (dump != nullptr) DumpTraces(traces, key, dump);
  std::printf("%-13s   trace, median of %d calls%s, us from the first prep block's start "
              "(first / median / last block):\n", "", calls,
              twice ? " (each the second of two calls in a row: code and data warm)" : "");
  gputest::PrintTraceSummary(traces, "                  ");
}

// The first access after a PDL wait (the merge kernel's first (m, l) load
// and shuffles took ~1 us: RESULTS runs 31 and 33): one load per lane of 128
// one-warp blocks, of words a 4-per-SM writer grid just wrote or of others,
// behind a PDL wait or a plain launch; medians over 20 launches' blocks.
void PrintFirstAccessAfterWait(int sms, cudaStream_t stream, nlohmann::json& out) {
  const int writers = 4 * sms, readers = 128;
  float* words = nullptr;
  unsigned long long* times = nullptr;
  CK(cudaMalloc(&words, 2 * sizeof(float) * writers * 128));
  CK(cudaMemset(words, 0, 2 * sizeof(float) * writers * 128));
  CK(cudaMalloc(&times, 2 * sizeof(unsigned long long) * readers));
  std::vector<unsigned long long> host(2 * readers);
  double median_ns[2][2];
  for (int pdl = 0; pdl < 2; ++pdl) {
    for (int written = 0; written < 2; ++written) {
      std::vector<double> ns;
      for (int rep = 0; rep < 21; ++rep) {
        CK(gputest::LaunchHandoffProbe(words, words + writers * 128, writers, readers,
                                       written == 1, pdl == 1, times, stream));
        CK(cudaStreamSynchronize(stream));
        if (rep == 0) continue;  // warm-up
        CK(cudaMemcpy(host.data(), times, host.size() * sizeof(host[0]),
                      cudaMemcpyDeviceToHost));
        for (int b = 0; b < readers; ++b) ns.push_back(double(host[2 * b]));
      }
      median_ns[pdl][written] = gputest::Median(std::move(ns));
    }
  }
  CK(cudaFree(words));
  CK(cudaFree(times));
  std::printf("first access after the wait (one load per lane + 5 shuffles, %d one-warp blocks "
              "after %d writer blocks), median: PDL %.0f ns of words just written, %.0f ns of "
              "others; plain launch %.0f / %.0f ns\n",
              readers, writers, median_ns[1][1], median_ns[1][0], median_ns[0][1],
              median_ns[0][0]);
  out["first_access_pdl_written_ns"] = median_ns[1][1];
  out["first_access_pdl_other_ns"] = median_ns[1][0];
  out["first_access_plain_written_ns"] = median_ns[0][1];
  out["first_access_plain_other_ns"] = median_ns[0][0];
}

int Main(int argc, char** argv) {
  std::string baseline_path, json_path, only;
  int iters = 200;
  std::vector<int> only_variants;  // empty: all
  int ablate = 0;
  int fold_exact = 0;
  int trace_calls = 0;
  bool trace_twice = false;
  std::string trace_dump_path;
  int q_heads = 32;
  int pair_heads = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--baseline" && i + 1 < argc) baseline_path = argv[++i];
    else if (a == "--json" && i + 1 < argc) json_path = argv[++i];
    else if (a == "--iters" && i + 1 < argc) iters = std::atoi(argv[++i]);
    else if (a == "--only" && i + 1 < argc) only = argv[++i];
    else if (a == "--ablate" && i + 1 < argc) ablate = std::atoi(argv[++i]);
    else if (a == "--fold" && i + 1 < argc) fold_exact = std::atoi(argv[++i]);
    else if (a == "--trace" && i + 1 < argc) trace_calls = std::atoi(argv[++i]);
    else if (a == "--trace-twice") trace_twice = true;  // with --trace
    else if (a == "--trace-dump" && i + 1 < argc) trace_dump_path = argv[++i];  // with --trace
    else if (a == "--q-heads" && i + 1 < argc) q_heads = std::atoi(argv[++i]);
    else if (a == "--pair-heads" && i + 1 < argc) pair_heads = std::atoi(argv[++i]);
    else if (a == "--variant" && i + 1 < argc) {
      // One variant or a comma-separated list.
      for (const char* p = argv[++i]; *p != '\0';) {
        char* end = nullptr;
        only_variants.push_back(static_cast<int>(std::strtol(p, &end, 10)));
        if (end == p) break;
        p = *end == ',' ? end + 1 : end;
      }
    }
    else {
      std::fprintf(stderr,
                   "usage: %s [--baseline sdpa.json] [--json out.json] [--iters N] "
                   "[--only B1_S131072] [--variant N[,N...]] [--ablate BITS] [--fold 0|1|2] "
                   "[--trace N [--trace-twice] [--trace-dump FILE]] [--q-heads 32..64, a multiple of 8] "
                   "[--pair-heads 0|1]\n",
                   argv[0]);
      return 2;
    }
  }
  if (q_heads < 8 || q_heads > 64 || q_heads % 8 != 0) {
    std::fprintf(stderr,
                 "--q-heads must be a multiple of the 8 kv heads, at most 64 (8 per kv head)\n");
    return 2;
  }
  if ((trace_twice || !trace_dump_path.empty()) && trace_calls <= 0) {
    std::fprintf(stderr, "--trace-twice and --trace-dump need --trace N (N > 0)\n");
    return 2;
  }
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> trace_dump(nullptr, &std::fclose);
  if (!trace_dump_path.empty()) {
    trace_dump.reset(std::fopen(trace_dump_path.c_str(), "w"));
    if (trace_dump == nullptr) {
      std::fprintf(stderr, "cannot write --trace-dump %s: %s\n", trace_dump_path.c_str(),
                   std::strerror(errno));
      return 2;
    }
    std::fprintf(trace_dump.get(), "shape,call,kernel,block,unit,sm,start,mark2,mark3,mark4,mark5,"
                                   "mark6,end\n");
  }
  auto backend_or = CreateCudaBackend(0);
  if (!backend_or.ok()) {
    std::fprintf(stderr, "no CUDA backend: %s\n", backend_or.status().ToString().c_str());
    return 2;
  }
  Backend& backend = **backend_or;
  std::printf("device: %s\n", backend.description().c_str());
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  int sms = 0;  // one wave of the probes below: 4 blocks per SM, as the split kernel's
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  nlohmann::json out;
  out["device"] = backend.description();

  // 1. Copy bandwidth (bytes read + written).
  const size_t copy_bytes = size_t(1) << 30;
  void *ca, *cb;
  CK(cudaMalloc(&ca, copy_bytes));
  CK(cudaMalloc(&cb, copy_bytes));
  CK(cudaMemset(ca, 1, copy_bytes));
  const double copy_us = TimeEvents(stream, 3, 20, [&](int) {
    CK(cudaMemcpyAsync(cb, ca, copy_bytes, cudaMemcpyDeviceToDevice, stream));
  });
  CK(cudaFree(cb));
  const double copy_gbs = 2.0 * copy_bytes / copy_us / 1e3;
  std::printf("copy bandwidth (read+write): %.0f GB/s\n", copy_gbs);
  out["copy_gbs"] = copy_gbs;
  // The read-only ceiling (a kernel that only streams bytes in, as the
  // history loop does): the whole GiB, and 77 MiB (about the compressed cache of
  // B1 128K) GPU side as the attention rows are timed, launch floor included,
  // from windows far enough apart that L2 never holds the next one.
  {
    const int blocks = 4 * sms;
    uint32_t* sink;
    CK(cudaMalloc(&sink, sizeof(uint32_t) * blocks));
    const double full_us = TimeEvents(stream, 3, 20, [&](int) {
      CK(gputest::LaunchReadProbe(ca, copy_bytes, sink, blocks, stream));
    });
    const size_t window = size_t(77) << 20;
    const double window_us = TimeEventsQueued(stream, 8, 200, [&](int i) {
      const size_t at = size_t(i % 12) * (copy_bytes / 12) & ~size_t(255);
      CK(gputest::LaunchReadProbe(static_cast<const uint8_t*>(ca) + at, window, sink, blocks,
                                  stream));
    });
    CK(cudaFree(sink));
    const double full_gbs = copy_bytes / full_us / 1e3, window_gbs = window / window_us / 1e3;
    std::printf("read bandwidth (read only, %d blocks of 512): 1 GiB %.0f GB/s (%.0f%% of copy); "
                "77 MiB GPU side in %.1f us: %.0f GB/s (%.0f%% of copy)\n",
                blocks, full_gbs, 100.0 * full_gbs / copy_gbs, window_us, window_gbs,
                100.0 * window_gbs / copy_gbs);
    out["read_gbs"] = full_gbs;
    out["read_77mib_us"] = window_us;
  }
  CK(cudaFree(ca));

  // The floor under every figure below: events around the smallest GPU work
  // (a 4-byte memset, one or three in a row), GPU side as the attention rows'
  // queued figure. What a call of three kernels cannot go below.
  {
    void* tiny;
    CK(cudaMalloc(&tiny, 256));
    double floor_us[2];
    for (int k = 0; k < 2; ++k) {
      const int ops = k == 0 ? 1 : 3;
      floor_us[k] = TimeEventsQueued(stream, 10, 200, [&](int) {
        for (int o = 0; o < ops; ++o) CK(cudaMemsetAsync(tiny, o, 4, stream));
      });
    }
    CK(cudaFree(tiny));
    std::printf("launch floor (GPU side, events around tiny memsets): 1 op %.1f us, 3 ops %.1f us\n",
                floor_us[0], floor_us[1]);
    out["floor_1op_us"] = floor_us[0];
    out["floor_3op_us"] = floor_us[1];
    // Empty kernels instead: one (with no instruction, and with the PDL
    // wait and trigger that the prep kernel runs), and three chained as the
    // attention call's are (plain, then PDL), with 32 blocks (a B = 1 call's
    // prep) and with one wave of 4 blocks per SM (its split).
    double bare_us[2], chain_us[2][2];
    for (int w = 0; w < 2; ++w) {
      const int blocks = w == 0 ? 32 : 4 * sms;
      bare_us[w] = TimeEventsQueued(stream, 10, 200, [&](int) {
        CK(gputest::LaunchEmptyChain(1, blocks, false, stream));
      });
      for (int k = 0; k < 2; ++k) {
        chain_us[k][w] = TimeEventsQueued(stream, 10, 200, [&](int) {
          CK(gputest::LaunchEmptyChain(k == 0 ? 1 : 3, blocks, true, stream));
        });
      }
    }
    std::printf("launch floor (GPU side, empty kernels, 32 / %d blocks): 1 kernel %.1f / %.1f us, "
                "with the PDL wait and trigger %.1f / %.1f us, 3 chained (PDL) %.1f / %.1f us\n",
                4 * sms, bare_us[0], bare_us[1], chain_us[0][0], chain_us[0][1], chain_us[1][0],
                chain_us[1][1]);
    out["floor_1kernel_bare_us"] = bare_us[0];
    out["floor_1kernel_us"] = chain_us[0][0];
    out["floor_3kernel_pdl_us"] = chain_us[1][0];
    out["floor_3kernel_pdl_wave_us"] = chain_us[1][1];
  }
  PrintFirstAccessAfterWait(sms, stream, out);
  if (trace_calls > 0) {
    auto step = AttendTraceTimerStepNs();
    CKS(step.status());
    std::printf("trace timer (%%globaltimer): smallest step %.0f ns\n", *step);
  }
  // How many clusters of the cluster kernel (variant 11) fit at once, by
  // block and cluster size: the multiprocessors of a cluster must share a GPC.
  // The kernel is built for 128 threads: the other block sizes are what its
  // registers and shared memory would allow at that size, and the 2-block
  // size is asked of the 4-block kernel.
  std::printf("cluster kernel, clusters resident at once (threads per block x cluster size):");
  for (const int threads : {384, 192, 128}) {
    for (const int size : {16, 8, 4, 2}) {
      const auto c = AttendClusterCapacity(threads, size);
      std::printf(" %dx%d: %d", threads, size, c.ok() ? *c : -1);
      if (!c.ok()) std::printf(" (%s)", c.status().ToString().c_str());
    }
  }
  std::printf("\n");

  // 2. Encode throughput: 2048 random 32-token blocks (8 heads, D 128).
  const PageGeometry geom{8, 128, 128, 32};
  const int kBlocks = 2048;
  const size_t block_elems = geom.exact_block_bytes() / 2;
  auto blocks_host = RandomBf16(block_elems * kBlocks, 128, 1);
  auto blocks = gputest::Upload(backend, blocks_host);
  CKS(blocks.status());
  const auto h64 = HadamardMatrix(128);
  std::vector<float> rot(2 * 128 * 128);
  for (size_t i = 0; i < h64.size(); ++i) rot[i] = rot[i + h64.size()] = float(h64[i]);
  auto rot_dev = gputest::Upload(backend, rot);
  CKS(rot_dev.status());
  const RotationRef rref{rot_dev->as<float>(), rot_dev->as<float>() + 128 * 128, 0};
  const int kPool = 40960;
  auto pool = backend.Allocate(size_t(kPool) * geom.page_bytes());
  CKS(pool.status());
  std::vector<EncodeJob> jobs(kBlocks);
  for (int j = 0; j < kBlocks; ++j) {
    jobs[j] = EncodeJob{blocks->as<bf16_bits>() + j * block_elems,
                        pool->as<uint8_t>() + size_t(j) * geom.page_bytes(), rref, 0.96f, 0.92f};
  }
  EncodeJob* jobs_dev;
  CK(cudaMalloc(&jobs_dev, sizeof(EncodeJob) * kBlocks));
  CK(cudaMemcpy(jobs_dev, jobs.data(), sizeof(EncodeJob) * kBlocks, cudaMemcpyHostToDevice));
  // The tiled kernel (R staged in shared memory per tile) first, as the
  // baseline; then the strip kernel and its warp-specialized twin, which must
  // write the same bytes; the default last, whose pages the attention
  // benchmark below uses. Tiled and strip must agree on (almost) every byte.
  const double enc_bytes = double(kBlocks) * (geom.exact_block_bytes() + geom.page_bytes());
  // Each kernel writes over its own poison, so that bytes one leaves
  // unwritten count as differing.
  // `pages` (null: not wanted) gets the pages back.
  const auto time_encode = [&](EncodeKernelChoice choice, std::vector<uint8_t>* pages) {
    CK(cudaMemsetAsync(pool->data(), 0x11 * (1 + static_cast<int>(choice)),
                       size_t(kBlocks) * geom.page_bytes(), stream));
    const double us = TimeEvents(stream, 2, 20, [&](int) {
      CKS(LaunchEncodePages(geom, jobs_dev, kBlocks, stream, choice));
    });
    if (pages != nullptr) {
      pages->resize(size_t(kBlocks) * geom.page_bytes());
      CK(cudaMemcpy(pages->data(), pool->data(), pages->size(), cudaMemcpyDeviceToHost));
    }
    return us;
  };
  const auto count_differing = [](const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
    size_t n = 0;
    for (size_t i = 0; i < a.size(); ++i) n += a[i] != b[i];
    return n;
  };
  std::vector<uint8_t> tiled_pages, strip_pages, roles_pages, wgmma_pages;
  const double tiled_us = time_encode(EncodeKernelChoice::kTiled, &tiled_pages);
  const double strip_us = time_encode(EncodeKernelChoice::kStrips, &strip_pages);
  const double roles_us = time_encode(EncodeKernelChoice::kRoles, &roles_pages);
  auto wgmma = EncodeWarpgroupAvailable();
  CKS(wgmma.status());
  const double wgmma_us =
      *wgmma ? time_encode(EncodeKernelChoice::kWarpgroup, &wgmma_pages) : 0.0;
  const double enc_us = time_encode(EncodeKernelChoice::kAuto, nullptr);
  const size_t differing = count_differing(strip_pages, tiled_pages);
  const size_t roles_differing = count_differing(roles_pages, strip_pages);
  const double enc_gbs = enc_bytes / enc_us / 1e3;
  const double tiled_gbs = enc_bytes / tiled_us / 1e3;
  const auto print_kernel = [&](const char* name, double us) {
    const double gbs = enc_bytes / us / 1e3;
    std::printf("encode, %-22s %7.1f us: %4.0f GB/s = %4.1f%% of copy, %.2fx the tiled kernel\n",
                name, us, gbs, 100.0 * gbs / copy_gbs, tiled_us / us);
  };
  print_kernel("tiled kernel (baseline)", tiled_us);
  print_kernel("strip kernel", strip_us);
  print_kernel("roles kernel", roles_us);
  std::printf("encode, roles vs strip kernel: %.2fx\n", strip_us / roles_us);
  if (*wgmma) {
    print_kernel("wgmma kernel", wgmma_us);
    const size_t wgmma_differing = count_differing(wgmma_pages, roles_pages);
    std::printf("encode, wgmma vs roles kernel: %.2fx; page bytes that differ: %zu of %zu "
                "(%.1e)\n",
                roles_us / wgmma_us, wgmma_differing, wgmma_pages.size(),
                double(wgmma_differing) / wgmma_pages.size());
    out["encode_wgmma_us"] = wgmma_us;
    out["encode_wgmma_differing_bytes"] = wgmma_differing;
  } else {
    std::printf("encode, wgmma kernel: not in the loaded code (not built for sm_90a)\n");
  }
  std::printf("page bytes that differ: strip vs tiled %zu of %zu (%.1e); roles vs strip %zu\n",
              differing, strip_pages.size(), double(differing) / strip_pages.size(),
              roles_differing);
  if (roles_differing != 0) {  // the same math: any difference is a bug
    std::fprintf(stderr, "error: the roles kernel's pages differ from the strip kernel's\n");
    // Where (the first few): page, head, K/V, token, and whether code or params.
    int shown = 0;
    for (size_t i = 0; i < roles_pages.size() && shown < 12; ++i) {
      if (roles_pages[i] == strip_pages[i]) continue;
      const size_t page = i / geom.page_bytes(), off = i % geom.page_bytes();
      for (int h = 0; h < geom.kv_heads; ++h) {
        for (int kind = 0; kind < 2; ++kind) {
          const size_t co = geom.codes_offset(h, kind), po = geom.params_offset(h, kind);
          const bool code = off >= co && off < po;
          const bool param = off >= po && off < po + geom.params_bytes();
          if (!code && !param) continue;
          const size_t rel = code ? off - co : off - po;
          const size_t per_token = code ? geom.code_row_bytes() : geom.param_row_bytes();
          std::fprintf(stderr, "  page %zu head %d %s token %zu %s byte %zu: roles %02x strip %02x\n",
                       page, h, kind == 0 ? "K" : "V", rel / per_token, code ? "code" : "param",
                       rel % per_token, roles_pages[i], strip_pages[i]);
        }
      }
      ++shown;
    }
    return 1;
  }
  // One demotion-sized call through the backend (job upload, launch, wait),
  // warm: the first call also allocates the job buffer. Median of 9.
  CKS(backend.EncodePages(geom, jobs.data(), 64));
  std::vector<double> call_us;
  for (int rep = 0; rep < 9; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    CKS(backend.EncodePages(geom, jobs.data(), 64));
    call_us.push_back(
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(call_us.begin(), call_us.end());
  const double enc_call_us = call_us[call_us.size() / 2];
  std::printf("encode: %d pages (%.0f MB in + out) in %.1f us: %.0f GB/s = %.0f%% of copy, "
              "%.2f Gtokens/s (all heads); Backend::EncodePages(64 pages) call %.0f us\n",
              kBlocks, enc_bytes / 1e6, enc_us, enc_gbs, 100.0 * enc_gbs / copy_gbs,
              kBlocks * 32 / enc_us / 1e3, enc_call_us);
  out["encode"] = {{"pages", kBlocks}, {"us", enc_us}, {"gbs", enc_gbs},
                   {"pct_copy", 100.0 * enc_gbs / copy_gbs}, {"call_64_pages_us", enc_call_us},
                   {"tiled_us", tiled_us}, {"tiled_gbs", tiled_gbs}, {"strip_us", strip_us},
                   {"roles_us", roles_us}, {"differing_page_bytes", differing},
                   {"roles_differing_page_bytes", roles_differing}};
  CK(cudaFree(jobs_dev));
  // Fill the pool by replicating the encoded pages.
  for (int p = kBlocks; p < kPool; p += kBlocks) {
    CK(cudaMemcpy(pool->as<uint8_t>() + size_t(p) * geom.page_bytes(), pool->data(),
                  size_t(std::min(kBlocks, kPool - p)) * geom.page_bytes(),
                  cudaMemcpyDeviceToDevice));
  }

  nlohmann::json baseline;
  if (!baseline_path.empty()) {
    std::ifstream f(baseline_path);
    if (f) baseline = nlohmann::json::parse(f, nullptr, false);
  }

  // 3. Attention.
  const int Hq = q_heads, D = 128, kExactBlocks = 320;
  if (baseline.is_object() && baseline.value("q_heads", 32) != Hq) {
    std::fprintf(stderr, "the baseline %s was timed with %d q heads, this run has %d (pass the "
                 "same --q-heads to sdpa_baseline.py)\n",
                 baseline_path.c_str(), baseline.value("q_heads", 32), Hq);
    return 2;
  }
  std::printf("\nattention: %d q / 8 kv heads (%d per kv head), D %d\n", Hq, Hq / 8, D);
  out["q_heads"] = Hq;
  const float scale = 1.0f / std::sqrt(float(D));
  const std::vector<Shape> shapes = {{1, 8192}, {1, 32768}, {1, 65536}, {1, 131072},
                                     {8, 32768}, {8, 65536}};
  std::printf("\n(vN: split-kernel variant, * = the default; see AttendLauncher::set_variant)\n");
  std::printf("%-13s %9s %9s %9s %9s %8s %8s %9s %7s %6s\n", "shape", "ours_us", "graph_us",
              "call_us", "sdpa_us", "speedup", "MB", "GB/s", "%copy", "sets");
  nlohmann::json rows = nlohmann::json::array();
  int default_variant = -1;
  {
    auto probe = AttendLauncher::Create(0);
    CKS(probe.status());
    default_variant = (*probe)->variant();
  }
  for (int variant = 0; variant < AttendLauncher::kNumVariants; ++variant)
  for (const Shape& sh : shapes) {
    if (!only_variants.empty() &&
        std::find(only_variants.begin(), only_variants.end(), variant) == only_variants.end()) {
      continue;
    }
    if (!only.empty() && only != "B" + std::to_string(sh.batch) + "_S" + std::to_string(sh.tokens)) {
      continue;
    }
    const auto tiers = gputest::SplitTiers(sh.tokens, 64, 256, 32);
    const int npages = tiers.pages;
    const int nexact = (tiers.sink + 31) / 32 + (tiers.recent + 31) / 32;
    const int sets = std::max(2, std::min(16, kPool / (sh.batch * npages)));
    std::vector<std::unique_ptr<AttendLauncher>> launchers;
    std::vector<std::vector<std::vector<const uint8_t*>>> tables(sets);
    std::vector<std::vector<std::vector<ExactBlockRef>>> exacts(sets);
    // Queries and outputs are host memory (Prepare uploads the queries; the
    // whole Backend::Attend calls below write the outputs).
    std::vector<float> qh(size_t(sh.batch) * Hq * D);
    {
      uint64_t s = 12345;
      for (auto& x : qh) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        x = (float(s >> 40) / float(1ull << 24) - 0.5f) * 4.0f;
      }
    }
    std::vector<float> outh(size_t(sets) * sh.batch * Hq * (D + 1),
                            std::numeric_limits<float>::quiet_NaN());
    std::vector<std::vector<AttendItem>> items(sets);
    std::vector<AttendBatch> batches;  // set s: its items, once complete
    for (int s = 0; s < sets; ++s) {
      tables[s].resize(sh.batch);
      exacts[s].resize(sh.batch);
      for (int b = 0; b < sh.batch; ++b) {
        const long start = (long(s) * sh.batch + b) * npages % std::max(1, kPool - npages);
        for (int p = 0; p < npages; ++p) {
          tables[s][b].push_back(pool->as<uint8_t>() + size_t(start + p) * geom.page_bytes());
        }
        int left_sink = tiers.sink, left_recent = tiers.recent;
        for (int e = 0; e < nexact; ++e) {
          const int blk = ((s * sh.batch + b) * nexact + e) % kExactBlocks;
          int tok;
          if (left_sink > 0) {
            tok = std::min(32, left_sink);
            left_sink -= tok;
          } else {
            tok = std::min(32, left_recent);
            left_recent -= tok;
          }
          exacts[s][b].push_back({blocks->as<bf16_bits>() + size_t(blk) * block_elems, tok});
        }
        float* o = outh.data() + (size_t(s) * sh.batch + b) * Hq * (D + 1);
        items[s].push_back(AttendItem{qh.data() + size_t(b) * Hq * D, o, o + Hq * D, rref,
                                      exacts[s][b].data(), nexact, tables[s][b].data(), npages});
      }
      auto l = AttendLauncher::Create(0);
      CKS(l.status());
      (*l)->set_variant(variant);
      (*l)->set_ablate(ablate);
      (*l)->set_fold_exact(cuda_attend::FoldExactFromNumber(fold_exact));
      (*l)->set_pair_heads(pair_heads != 0);
      batches.push_back(AttendBatch{geom, Hq, scale, items[s].data(), sh.batch});
      CKS((*l)->Prepare(batches[s], stream));
      launchers.push_back(std::move(l).value());
    }
    CK(cudaStreamSynchronize(stream));
    const double us = TimeEvents(stream, 3 * sets, iters,
                                 [&](int i) { CKS(launchers[i % sets]->Launch(stream)); });
    const double gpu_us = TimeEventsQueued(
        stream, 3 * sets, iters, [&](int i) { CKS(launchers[i % sets]->Launch(stream)); });
    // Where the time goes (default variant, GPU side): the same calls cut
    // after the prep kernel, after the split kernel, and whole (the merge then
    // adds the rest); each stage runs in its place in the call, with PDL
    // overlaps.
    double stage_us[2] = {0, 0};
    const bool stages = variant == default_variant || !only_variants.empty();
    if (stages) {
      for (int st = 1; st <= 3; ++st) {
        for (int s = 0; s < sets; ++s) {
          launchers[s]->set_launch_stages(st);
          CKS(launchers[s]->Prepare(batches[s], stream));
        }
        CK(cudaStreamSynchronize(stream));
        if (st == 3) break;
        stage_us[st - 1] = TimeEventsQueued(
            stream, 3 * sets, iters, [&](int i) { CKS(launchers[i % sets]->Launch(stream)); });
      }
    }
    // The same calls with one launcher setting on (set(launcher, true)),
    // then off again.
    auto time_with = [&](auto&& set) {
      auto prepare_all = [&](bool on) {
        for (int s = 0; s < sets; ++s) {
          set(*launchers[s], on);
          CKS(launchers[s]->Prepare(batches[s], stream));
        }
        CK(cudaStreamSynchronize(stream));
      };
      prepare_all(true);
      const double t = TimeEventsQueued(
          stream, 3 * sets, iters, [&](int i) { CKS(launchers[i % sets]->Launch(stream)); });
      prepare_all(false);
      return t;
    };
    // Without the prep kernel (AttendLauncher::set_skip_prep; the split
    // reads the last call's fragments): the most that computing the query
    // fragments inside the split kernel could save.
    const double no_prep_us =
        stages ? time_with([](AttendLauncher& l, bool on) { l.set_skip_prep(on); }) : 0.0;
    // With the outputs written to device memory, as SDPA's stay there
    // (AttendLauncher::set_results_in_device_memory): what the service's
    // writes over the bus to mapped host memory cost.
    const double device_out_us = time_with(
        [](AttendLauncher& l, bool on) { l.set_results_in_device_memory(on); });
    // CUDA graphs of each set's three launches.
    std::vector<cudaGraphExec_t> execs(sets);
    for (int s = 0; s < sets; ++s) {
      cudaGraph_t g;
      CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      CKS(launchers[s]->Launch(stream));
      CK(cudaStreamEndCapture(stream, &g));
      CK(cudaGraphInstantiate(&execs[s], g, 0));
      CK(cudaGraphDestroy(g));
    }
    const double graph_us = TimeEvents(stream, 3 * sets, iters,
                                       [&](int i) { CK(cudaGraphLaunch(execs[i % sets], stream)); });
    for (auto& e : execs) CK(cudaGraphExecDestroy(e));
    // Whole Backend::Attend calls (plan + upload + launches + sync), wall
    // clock, and where a call's wall time goes (medians of 30, one launcher
    // used the way the backend uses it): Prepare's host work alone; Prepare
    // and its upload, waited for; + the kernels; + copying the outputs out.
    // `named`: the items carry page-table ids as the store gives them, so the
    // tables stay on the device and a repeated call uploads no page pointers.
    struct CallTimes {
      double call_us = 0;
      double host_us[4] = {0, 0, 0, 0};
      long pages_uploaded = 0;  // by the last call
    };
    auto measure_calls = [&](bool named) {
      // Ids are never reused (the AttendItem contract), across shapes too.
      static uint64_t next_table_id = 1;
      for (int s = 0; s < sets; ++s) {
        for (int b = 0; b < sh.batch; ++b) items[s][b].page_table_id = named ? next_table_id++ : 0;
      }
      auto since = [](std::chrono::steady_clock::time_point a) {
        return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - a)
            .count();
      };
      CallTimes ct;
      std::vector<double> call;
      for (int i = 0; i < 30 + sets; ++i) {
        const auto a = std::chrono::steady_clock::now();
        CKS(backend.Attend(batches[i % sets]));
        // After each set's first call (which uploads its named tables).
        if (i >= sets) call.push_back(since(a));
      }
      ct.call_us = Median(call);
      // Each set's launcher places its (new) named tables once, untimed, so
      // that the timed calls below see them on the device, as the
      // Backend::Attend calls above did after their first round.
      for (int s = 0; s < sets; ++s) {
        CKS(launchers[s]->Prepare(batches[s], stream));
        CK(cudaStreamSynchronize(stream));
      }
      std::vector<double> t[4];
      for (int i = 0; i < 30; ++i) {
        AttendLauncher& L = *launchers[i % sets];
        const AttendBatch& batch = batches[i % sets];
        auto a = std::chrono::steady_clock::now();
        CKS(L.Prepare(batch, stream));
        t[0].push_back(since(a));
        CK(cudaStreamSynchronize(stream));
        t[1].push_back(since(a));
        a = std::chrono::steady_clock::now();
        CKS(L.Prepare(batch, stream));
        CKS(L.Launch(stream));
        CK(cudaStreamSynchronize(stream));
        t[2].push_back(since(a));
        a = std::chrono::steady_clock::now();
        CKS(L.Prepare(batch, stream));
        CKS(L.Launch(stream));
        CK(cudaStreamSynchronize(stream));
        CKS(L.CopyResults(batch));
        t[3].push_back(since(a));
        ct.pages_uploaded = L.schedule().pages_uploaded;
      }
      for (int k = 0; k < 4; ++k) ct.host_us[k] = Median(t[k]);
      return ct;
    };
    // Alternated, so that drift hits both alike; the second of each is kept.
    CallTimes unnamed = measure_calls(false), named = measure_calls(true);
    unnamed = measure_calls(false);
    named = measure_calls(true);
    const double call_us = unnamed.call_us;
    // Every output written (they start as NaN) and finite.
    size_t bad = 0, nonzero = 0;
    for (float x : outh) {
      bad += !std::isfinite(x);
      nonzero += x != 0.0f;
    }
    const double bytes = double(sh.batch) *
                         (double(npages) * geom.page_bytes() +
                          double(tiers.sink + tiers.recent) * 8 * D * 2 * 2);
    const double gbs = bytes / us / 1e3;
    const std::string key = "B" + std::to_string(sh.batch) + "_S" + std::to_string(sh.tokens);
    double sdpa = 0, sdpa_gpu = 0;
    if (baseline.is_object() && baseline.contains("sdpa_us") && baseline["sdpa_us"].contains(key)) {
      sdpa = baseline["sdpa_us"][key].get<double>();
    }
    if (baseline.is_object() && baseline.contains("sdpa_gpu_us") &&
        baseline["sdpa_gpu_us"].contains(key)) {
      sdpa_gpu = baseline["sdpa_gpu_us"][key].get<double>();
    }
    const std::string label =
        key + "/v" + std::to_string(variant) + (variant == default_variant ? "*" : "");
    std::printf("%-13s %9.1f %9.1f %9.1f %9.1f %8.2f %8.1f %9.0f %6.0f%% %6d%s\n", label.c_str(), us,
                graph_us, call_us, sdpa, sdpa > 0 ? sdpa / std::min(us, graph_us) : 0.0,
                bytes / 1e6, gbs, 100.0 * gbs / copy_gbs, sets,
                bad ? "  NON-FINITE OUTPUT" : (nonzero == 0 ? "  ALL ZERO" : ""));
    const auto& sched = launchers[0]->schedule();
    std::printf("%-13s   GPU side (calls queued): ours %.1f us, SDPA %.1f us, speedup %.2f; "
                "outputs in device memory (as SDPA's) %.1f us, speedup %.2f; ", "",
                gpu_us, sdpa_gpu, sdpa_gpu > 0 && gpu_us > 0 ? sdpa_gpu / gpu_us : 0.0,
                device_out_us, sdpa_gpu > 0 && device_out_us > 0 ? sdpa_gpu / device_out_us : 0.0);
    if (sched.clusters_per_head > 0) {
      std::printf("one cluster kernel: %d blocks, %d clusters of %d per kv head\n",
                  sched.history_units, sched.clusters_per_head, sched.cluster_blocks);
    } else {
      const char* flat = " at most, exact blocks counted as pages, cut flat over the kv heads";
      char ranks[96] = "";
      if (sched.rank_pools > 0) {
        std::snprintf(ranks, sizeof(ranks), ", claimed by arrival rank (%d ranks, skew %.3f)",
                      sched.rank_pools, sched.rank_skew);
      }
      std::printf("units: %d exact + %d history (%d pages each%s%s), %d partials; ran v%d%s%s, "
                  "merge slices of %d dims\n",
                  sched.exact_units, sched.history_units, sched.pages_per_unit,
                  sched.flat_cut ? flat : "", ranks, sched.partials, sched.variant,
                  sched.integer_pv ? "" : " (its float P'V kernel at this shape)",
                  sched.paired_heads ? " on paired heads (two blocks per unit of the kv heads)"
                                     : "",
                  sched.merge_slice);
    }
    for (const CallTimes* ct : {&unnamed, &named}) {
      const double* h = ct->host_us;
      std::printf("%-13s   call wall time, %s: Prepare (host) %.1f us, + upload %.1f, "
                  "+ kernels %.1f, + outputs out %.1f = %.1f us (%ld page pointers uploaded); "
                  "Backend::Attend %.1f us\n",
                  "", ct == &named ? "page tables kept on the device" : "page tables uploaded",
                  h[0], h[1] - h[0], h[2] - h[1], h[3] - h[2], h[3], ct->pages_uploaded,
                  ct->call_us);
    }
    if (stages) {
      std::printf("%-13s   GPU-side stages: prep %.1f us, prep+split %.1f us, all %.1f us "
                  "(split adds %.1f, merge adds %.1f)\n",
                  "", stage_us[0], stage_us[1], gpu_us, stage_us[1] - stage_us[0],
                  gpu_us - stage_us[1]);
      std::printf("%-13s   GPU-side without the prep kernel (split and merge only, the last "
                  "call's query fragments): %.1f us, %.1f us less\n",
                  "", no_prep_us, gpu_us - no_prep_us);
    }
    if (trace_calls > 0) PrintCallTraces(launchers, batches, stream, trace_calls, trace_twice, key,
                                         trace_dump.get());
    const auto& sc = launchers[0]->schedule();
    rows.push_back({{"shape", key}, {"variant", variant}, {"us", us}, {"graph_us", graph_us}, {"call_us", call_us},
                    {"call_named_tables_us", named.call_us},
                    {"sdpa_us", sdpa}, {"speedup", sdpa > 0 ? sdpa / std::min(us, graph_us) : 0.0},
                    {"bytes", bytes}, {"gbs", gbs}, {"pct_copy", 100.0 * gbs / copy_gbs},
                    {"history_units", sc.history_units}, {"exact_units", sc.exact_units},
                    {"pages_per_unit", sc.pages_per_unit}, {"ran_variant", sc.variant},
                    {"flat_cut", sc.flat_cut}, {"paired_heads", sc.paired_heads},
                    {"nonfinite", bad},
                    {"gpu_us", gpu_us}, {"sdpa_gpu_us", sdpa_gpu},
                    {"gpu_device_out_us", device_out_us},
                    {"prep_us", stage_us[0]}, {"prep_split_us", stage_us[1]},
                    {"no_prep_us", no_prep_us}});
  }
  out["attention"] = rows;
  if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
  CK(cudaStreamDestroy(stream));
  return 0;
}

}  // namespace
}  // namespace oscarkv

int main(int argc, char** argv) { return oscarkv::Main(argc, argv); }
