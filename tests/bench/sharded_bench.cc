// Sharded scaling benchmark (issue 6): N oscarkv servers in this process, each
// with its own backend (CPU threads, or its own GPU with --backend=cuda and
// device i % --gpus), driven through ShardedClient. Measures, for each N in
// --servers, aggregate PutKv ingest and Attend throughput and per-call latency,
// and prints the ratio of each N to the first (the one-server baseline).
//
//   sharded_bench [--servers=1,2] [--backend=cpu|cuda] [--gpus=1] [--threads=1]
//                 [--sequences=8] [--tokens=8192] [--layers=4] [--rounds=10]
//                 [--connect=HOST:PORT,HOST:PORT...]
// With --connect, the servers are separate processes (e.g. one
// `oscarkv-server --backend=cuda` per GPU under CUDA_VISIBLE_DEVICES, started
// with --model=bench:LAYERS:32:8:128): each N uses the first N addresses, and
// the sequences are dropped after each N.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "client/sharded_client.h"
#include "kernels/numeric.h"
#include "server/oscarkv_server.h"

namespace oscarkv {
namespace {

struct Args {
  std::vector<int> servers = {1, 2};
  std::vector<std::string> connect;  // external servers (empty: in-process)
  std::string backend = "cpu";
  int gpus = 1, threads = 1, sequences = 8, tokens = 8192, layers = 4, rounds = 10;
};

double Seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void FillBf16(std::vector<bf16_bits>& x, uint64_t seed) {
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 7;
  for (auto& e : x) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    e = FloatToBf16((float((s >> 40) & 0xffff) / 32768.0f - 1.0f) * 2.0f);
  }
}

struct Figures {
  double ingest_gbs = 0, attend_items_s = 0, attend_p50_ms = 0, attend_p99_ms = 0;
};

absl::StatusOr<Figures> RunWith(const Args& a, int n) {
  const ModelLayout layout{a.layers, 32, 8, 128};
  std::vector<std::unique_ptr<OscarkvServer>> servers;
  std::vector<std::string> targets;
  const size_t bytes_per_seq = size_t(a.layers) * a.tokens * 8 * 128 * 2 * 2;
  for (int i = 0; i < n && !a.connect.empty(); ++i) targets.push_back(a.connect[i]);
  for (int i = 0; i < n && a.connect.empty(); ++i) {
    ServerOptions o;
    o.backend = a.backend;
    o.cpu_threads = a.threads;
    o.cuda_device = i % std::max(a.gpus, 1);
    o.models = {"bench:" + std::to_string(a.layers) + ":32:8:128"};
    // Room for every sequence on one server (the one-server case holds them all).
    o.pool_size.bytes = size_t(a.sequences) * bytes_per_seq / 4 + (size_t{256} << 20);
    auto s = OscarkvServer::Start(o, nullptr);
    if (!s.ok()) return s.status();
    targets.push_back((*s)->address());
    servers.push_back(std::move(*s));
  }
  ShardedClient client(targets);
  std::vector<bf16_bits> k(bytes_per_seq / 4), v(bytes_per_seq / 4);
  FillBf16(k, 1);
  FillBf16(v, 2);

  Figures f;
  // Ingest: every sequence streamed concurrently, each to its owner.
  double t0 = Seconds();
  std::vector<std::future<absl::StatusOr<PutResult>>> puts;
  for (int i = 0; i < a.sequences; ++i) {
    const std::string id = "seq-" + std::to_string(i);
    puts.push_back(client.For(id).PutSequenceAsync(id, "bench", layout, a.tokens, k.data(),
                                                    v.data()));
  }
  for (auto& p : puts) {
    auto r = p.get();
    if (!r.ok()) return r.status();
  }
  f.ingest_gbs = double(a.sequences) * bytes_per_seq / (Seconds() - t0) / 1e9;

  // Attend: each round, one batch = every sequence on one layer, fanned out by owner.
  std::vector<float> q(32 * 128);
  for (size_t i = 0; i < q.size(); ++i) q[i] = float((i * 37) % 17) / 17.0f - 0.5f;
  std::vector<double> lat;
  t0 = Seconds();
  for (int r = 0; r < a.rounds; ++r) {
    std::vector<AttendQuery> batch;
    for (int i = 0; i < a.sequences; ++i) {
      AttendQuery aq;
      aq.sequence_id = "seq-" + std::to_string(i);
      aq.layer = r % a.layers;
      aq.q = q.data();
      batch.push_back(aq);
    }
    const double c0 = Seconds();
    auto out = client.Attend(batch, layout, false);
    lat.push_back(Seconds() - c0);
    if (!out.ok()) return out.status();
    for (const auto& o : *out) {
      if (!o.status.ok()) return o.status;
    }
  }
  const double elapsed = Seconds() - t0;
  f.attend_items_s = double(a.rounds) * a.sequences / elapsed;
  std::sort(lat.begin(), lat.end());
  f.attend_p50_ms = lat[lat.size() / 2] * 1e3;
  f.attend_p99_ms = lat[std::min(lat.size() - 1, lat.size() * 99 / 100)] * 1e3;
  if (!a.connect.empty()) {
    for (int i = 0; i < a.sequences; ++i) {
      auto d = client.Drop("seq-" + std::to_string(i));
      if (!d.ok()) return d.status();
    }
  }
  for (auto& s : servers) s->Shutdown(std::chrono::system_clock::now());
  return f;
}

std::vector<int> ParseList(const char* p) {
  std::vector<int> out;
  while (*p) {
    out.push_back(std::atoi(p));
    while (*p && *p != ',') ++p;
    if (*p == ',') ++p;
  }
  return out;
}

}  // namespace
}  // namespace oscarkv

int main(int argc, char** argv) {
  oscarkv::Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    auto val = [&](const char* name) -> const char* {
      const size_t n = std::strlen(name);
      return s.compare(0, n, name) == 0 ? s.c_str() + n : nullptr;
    };
    if (const char* p = val("--servers=")) a.servers = oscarkv::ParseList(p);
    else if (const char* p = val("--backend=")) a.backend = p;
    else if (const char* p = val("--gpus=")) a.gpus = std::atoi(p);
    else if (const char* p = val("--threads=")) a.threads = std::atoi(p);
    else if (const char* p = val("--sequences=")) a.sequences = std::atoi(p);
    else if (const char* p = val("--tokens=")) a.tokens = std::atoi(p);
    else if (const char* p = val("--layers=")) a.layers = std::atoi(p);
    else if (const char* p = val("--rounds=")) a.rounds = std::atoi(p);
    else if (const char* p = val("--connect=")) a.connect = absl::StrSplit(p, ',');
    else {
      std::fprintf(stderr,
                   "usage: %s [--servers=1,2] [--backend=cpu|cuda] [--gpus=1] [--threads=1] "
                   "[--sequences=8] [--tokens=8192] [--layers=4] [--rounds=10] "
                   "[--connect=HOST:PORT,...]\n"
                   "N servers (in this process, or the first N of --connect) behind "
                   "ShardedClient; ingest and Attend throughput for each N, with ratios to "
                   "the first N.\n",
                   argv[0]);
      return s == "--help" ? 0 : 2;
    }
  }
  if (a.servers.empty() || a.sequences <= 0 || a.tokens <= 0 || a.layers <= 0 || a.rounds <= 0) {
    std::fprintf(stderr, "sharded_bench: every count must be positive\n");
    return 2;
  }
  for (int n : a.servers) {
    if (n <= 0 || (!a.connect.empty() && n > static_cast<int>(a.connect.size()))) {
      std::fprintf(stderr, "sharded_bench: %d servers asked for, %zu given with --connect\n", n,
                   a.connect.size());
      return 2;
    }
  }
  std::printf("sharded_bench: backend %s, %d thread(s) per CPU server, %d sequences x %d tokens x "
              "%d layers (32 q / 8 kv heads, D 128), %d Attend rounds of %d items\n",
              a.backend.c_str(), a.threads, a.sequences, a.tokens, a.layers, a.rounds,
              a.sequences);
  std::printf("%8s | %12s %7s | %14s %7s | %10s %10s\n", "servers", "ingest GB/s", "ratio",
              "Attend items/s", "ratio", "p50 ms", "p99 ms");
  oscarkv::Figures base;
  for (size_t i = 0; i < a.servers.size(); ++i) {
    auto f = oscarkv::RunWith(a, a.servers[i]);
    if (!f.ok()) {
      std::fprintf(stderr, "sharded_bench: %d servers: %s\n", a.servers[i],
                   f.status().ToString().c_str());
      return 1;
    }
    if (i == 0) base = *f;
    std::printf("%8d | %12.3f %6.2fx | %14.1f %6.2fx | %10.2f %10.2f\n", a.servers[i],
                f->ingest_gbs, f->ingest_gbs / base.ingest_gbs, f->attend_items_s,
                f->attend_items_s / base.attend_items_s, f->attend_p50_ms, f->attend_p99_ms);
  }
  return 0;
}
