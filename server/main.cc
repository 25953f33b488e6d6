// oscarkv-server: the KV-cache service. `oscarkv-server --help` lists the flags.
#include <sched.h>
#include <signal.h>

#include <cerrno>
#include <cstring>

#include <chrono>
#include <cstdio>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "prometheus/exposer.h"
#include "server/calibration_reader.h"
#include "server/oscarkv_server.h"

ABSL_FLAG(std::string, listen, "0.0.0.0:50051",
          "gRPC listen address: host:port (port 0 picks one), or unix:PATH for a Unix domain "
          "socket (clients on the same host only, no TCP port opened; refused if another "
          "server answers on it)");
ABSL_FLAG(std::string, metrics_listen, "0.0.0.0:9464",
          "Prometheus /metrics listen address (host:port); empty disables metrics");
ABSL_FLAG(std::string, backend, "auto",
          "compute backend: auto (CUDA if a GPU is usable, else CPU), cpu, or cuda");
ABSL_FLAG(int, cpu_threads, 0, "CPU backend worker threads (0: one per hardware thread)");
ABSL_FLAG(int, compute_threads, 0,
          "threads that run ingest encoding and attention off gRPC's callback threads "
          "(0: one per hardware thread; see also --attend_inline_items)");
ABSL_FLAG(int, attend_inline_items, -1,
          "Attend messages with at most this many items run on the gRPC thread that read "
          "them, without a hop to the compute threads (0: every message hops; -1: 16 on a "
          "GPU backend, 0 on the CPU backend, whose attention takes milliseconds of CPU)");
ABSL_FLAG(int, cuda_device, 0, "CUDA device index for --backend=cuda|auto");
ABSL_FLAG(std::string, pool_size, "1GiB",
          "memory pool allocated once at start: bytes with a unit (512MiB, 8GiB) or a "
          "fraction in (0,1) of the backend's available memory (free GPU memory for cuda, "
          "available host memory for cpu)");
ABSL_FLAG(double, exact_fraction, 0.25,
          "share of the pool reserved for BF16 sink/recent blocks (the rest holds INT2 pages)");
ABSL_FLAG(int, sink_tokens, 64, "S0: leading tokens kept exactly in BF16");
ABSL_FLAG(int, recent_window, 256, "W: most recent tokens kept in BF16 (W <= r < W + P)");
ABSL_FLAG(int, page_tokens, 32, "P: tokens per INT2 history page");
ABSL_FLAG(int, group_size, 0, "G: channels per quantization group (0: G = head_dim)");
ABSL_FLAG(double, clip_k, 0.96, "key clip ratio for the Hadamard default rotation");
ABSL_FLAG(double, clip_v, 0.92, "value clip ratio for the Hadamard default rotation");
ABSL_FLAG(std::vector<std::string>, model, {"qwen3-8b:36:32:8:128"},
          "models to serve, comma-separated name:layers:q_heads:kv_heads:head_dim; each uses "
          "the data-free Hadamard rotation unless --calibration names it");
ABSL_FLAG(std::vector<std::string>, calibration, {},
          "calibration files, comma-separated model=path (oscarkv safetensors files); read "
          "at start from any path");
ABSL_FLAG(std::string, calibration_dir, "",
          "directory LoadCalibration may read calibration files from by path (relative paths "
          "are taken relative to it; files that resolve outside it through .. or symlinks are "
          "refused); empty: LoadCalibration by path is refused, clients send the file's bytes "
          "as content");
ABSL_FLAG(int, max_models, oscarkv::kDefaultMaxModels,
          "most models this server holds (--model's and those LoadCalibration registers); "
          "each holds its rotation in device and host memory and none can be unregistered, "
          "so registering a new name beyond it is RESOURCE_EXHAUSTED (replacing a model is "
          "not)");
ABSL_FLAG(int64_t, stream_idle_timeout_ms, 60000,
          "a PutKv stream that receives no message, or a GetKv stream whose client takes no "
          "message, for this long is ended (PutKv: ABORTED, the ingest discarded; GetKv: "
          "cancelled), releasing its pool slots or sequence; 0: no limit; at most a week");
ABSL_FLAG(std::string, eviction, "lru",
          "when the pool is full: lru (evict least-recently-used unpinned sequences) or "
          "refuse (RESOURCE_EXHAUSTED)");
ABSL_FLAG(int64_t, max_message_bytes, 64 << 20, "largest gRPC message accepted or sent");
ABSL_FLAG(std::string, cpu_affinity, "",
          "pin the server's threads to these CPUs, e.g. 0-1 or 2,3 (empty: no pinning); "
          "gRPC's cross-core hand-offs dominate Attend's RPC overhead on large hosts");
ABSL_FLAG(int, shutdown_grace_seconds, 10,
          "on SIGTERM/SIGINT: seconds in-flight calls may take to finish before cancellation");

namespace {

// Parses "0-3,8" into a CPU set; false on a malformed list.
bool ParseCpuList(const std::string& text, cpu_set_t* set) {
  CPU_ZERO(set);
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    std::vector<std::string> range = absl::StrSplit(part, absl::MaxSplits('-', 1));
    int lo = 0, hi = 0;
    if (!absl::SimpleAtoi(range[0], &lo)) return false;
    hi = lo;
    if (range.size() == 2 && !absl::SimpleAtoi(range[1], &hi)) return false;
    if (lo < 0 || hi < lo || hi >= CPU_SETSIZE) return false;
    for (int c = lo; c <= hi; ++c) CPU_SET(c, set);
  }
  return true;
}

int Fail(const std::string& message) {
  std::fprintf(stderr, "oscarkv-server: %s\n", message.c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "GPU-resident KV-cache service (OSCAR rotation + 2-bit quantization).\n"
      "Prefill workers stream BF16 K/V in with PutKv; decode workers fetch it (GetKv) or\n"
      "attend over it remotely (Attend). Health: grpc.health.v1; reflection: on.\n"
      "Example: oscarkv-server --listen=0.0.0.0:50051 --pool_size=8GiB --backend=auto");
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "server/main.cc");
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  absl::ParseCommandLine(argc, argv);

  const std::string affinity = absl::GetFlag(FLAGS_cpu_affinity);
  if (!affinity.empty()) {
    cpu_set_t set;
    if (!ParseCpuList(affinity, &set)) {
      return Fail(absl::StrCat("--cpu_affinity '", affinity, "' must be like 0-3 or 0,2"));
    }
    // Before any thread exists, so every thread inherits it.
    if (sched_setaffinity(0, sizeof(set), &set) != 0) {
      return Fail(absl::StrCat("cannot pin to CPUs ", affinity, ": ", std::strerror(errno)));
    }
  }

  // Block the shutdown signals in every thread; main waits for them below.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  oscarkv::ServerOptions o;
  o.listen_address = absl::GetFlag(FLAGS_listen);
  o.backend = absl::GetFlag(FLAGS_backend);
  o.cpu_threads = absl::GetFlag(FLAGS_cpu_threads);
  o.compute_threads = absl::GetFlag(FLAGS_compute_threads);
  o.attend_inline_items = absl::GetFlag(FLAGS_attend_inline_items);
  o.cuda_device = absl::GetFlag(FLAGS_cuda_device);
  absl::StatusOr<oscarkv::PoolSize> pool = oscarkv::ParsePoolSize(absl::GetFlag(FLAGS_pool_size));
  if (!pool.ok()) return Fail(std::string(pool.status().message()));
  o.pool_size = *pool;
  o.exact_fraction = absl::GetFlag(FLAGS_exact_fraction);
  o.tiers.sink_tokens = absl::GetFlag(FLAGS_sink_tokens);
  o.tiers.recent_window = absl::GetFlag(FLAGS_recent_window);
  o.tiers.page_tokens = absl::GetFlag(FLAGS_page_tokens);
  o.group_size = absl::GetFlag(FLAGS_group_size);
  o.clip_k = static_cast<float>(absl::GetFlag(FLAGS_clip_k));
  o.clip_v = static_cast<float>(absl::GetFlag(FLAGS_clip_v));
  o.models = absl::GetFlag(FLAGS_model);
  o.calibrations = absl::GetFlag(FLAGS_calibration);
  o.calibration_dir = absl::GetFlag(FLAGS_calibration_dir);
  const std::string eviction = absl::GetFlag(FLAGS_eviction);
  if (eviction == "lru") {
    o.eviction = oscarkv::EvictionPolicy::kLru;
  } else if (eviction == "refuse") {
    o.eviction = oscarkv::EvictionPolicy::kRefuse;
  } else {
    return Fail(absl::StrCat("--eviction must be lru or refuse, got '", eviction, "'"));
  }
  o.max_models = absl::GetFlag(FLAGS_max_models);
  if (o.max_models < 1) {
    return Fail(absl::StrCat("--max_models must be >= 1, got ", o.max_models));
  }
  const int64_t idle_ms = absl::GetFlag(FLAGS_stream_idle_timeout_ms);
  if (idle_ms < 0 || idle_ms > oscarkv::kMaxStreamIdleTimeout.count()) {
    return Fail(absl::StrCat("--stream_idle_timeout_ms must be >= 0 (0: no limit) and at most ",
                             oscarkv::kMaxStreamIdleTimeout.count(), " (a week), got ", idle_ms));
  }
  o.stream_idle_timeout = std::chrono::milliseconds(idle_ms);
  o.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  if (o.max_message_bytes < (1 << 20) || o.max_message_bytes > (int64_t{1} << 30)) {
    return Fail("--max_message_bytes must be in [1MiB, 1GiB]");
  }

  // The metrics endpoint first: a port clash fails before any memory is taken.
  std::unique_ptr<prometheus::Exposer> exposer;
  const std::string metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  if (!metrics_listen.empty()) {
    try {
      exposer = std::make_unique<prometheus::Exposer>(metrics_listen, /*num_threads=*/2);
    } catch (const std::exception& e) {
      return Fail(absl::StrCat("cannot serve metrics on ", metrics_listen, ": ", e.what()));
    }
  }
  auto registry = std::make_shared<prometheus::Registry>();
  auto server = oscarkv::OscarkvServer::Start(o, registry, oscarkv::DefaultCalibrationReader());
  if (!server.ok()) return Fail(server.status().ToString());
  if (exposer) exposer->RegisterCollectable((*server)->collectable());

  std::vector<std::string> models;
  for (const auto& m : (*server)->models().List()) {
    models.push_back(absl::StrCat(m->name, " (", m->layout.DebugString(), ", rotation ",
                                  m->rotation.objective, m->rotation.calibrated() ? "" :
                                  " data-free default", ")"));
  }
  std::fprintf(stderr,
               "oscarkv-server: listening on %s, backend %s, pool %.1f MiB%s, "
               "eviction %s\n  models: %s\n  LoadCalibration by path: %s\n  limits: %d models, "
               "streams idle %s\n  metrics: %s\n",
               (*server)->port() > 0
                   ? absl::StrCat("port ", (*server)->port(), " (", o.listen_address, ")").c_str()
                   : o.listen_address.c_str(),
               (*server)->backend().description().c_str(),
               double((*server)->pool().total_bytes()) / (1 << 20),
               (*server)->pool_size_note().empty()
                   ? ""
                   : absl::StrCat(" (", (*server)->pool_size_note(), ")").c_str(),
               eviction.c_str(), absl::StrJoin(models, "; ").c_str(),
               o.calibration_dir.empty() ? "off (--calibration_dir)"
                                         : absl::StrCat("files in ", o.calibration_dir).c_str(),
               o.max_models,
               idle_ms == 0 ? "without limit"
                            : absl::StrCat("at most ", idle_ms, " ms").c_str(),
               metrics_listen.empty()
                   ? "off"
                   : absl::StrCat("http://", metrics_listen, "/metrics (port ",
                                  exposer->GetListeningPorts().front(), ")")
                         .c_str());
  std::fflush(stderr);

  int sig = 0;
  sigwait(&signals, &sig);
  std::fprintf(stderr, "oscarkv-server: signal %d, draining in-flight calls (up to %d s)\n", sig,
               absl::GetFlag(FLAGS_shutdown_grace_seconds));
  (*server)->Shutdown(std::chrono::system_clock::now() +
                      std::chrono::seconds(absl::GetFlag(FLAGS_shutdown_grace_seconds)));
  (*server)->Wait();
  // The metrics endpoint goes before the server: a scrape must not reach a
  // store being destroyed.
  if (exposer) {
    exposer->RemoveCollectable((*server)->collectable());
    exposer.reset();
  }
  std::fprintf(stderr, "oscarkv-server: stopped\n");
  return 0;
}
