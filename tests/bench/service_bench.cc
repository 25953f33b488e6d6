// Service benchmarks (issue 4), every figure beside its baseline from the same
// run:
//   ingest  PutKv throughput (BF16 GB/s over loopback) vs a plain gRPC client
//           stream of the same message sizes (ByteSink);
//   attend  Attend p50/p99 per message (1 and 16 sequences of 32K tokens) vs
//           the same attention called in-process on the server's store;
//   memory  pool bytes per token actually held vs the codec's figure.
// Usage: service_bench [--quick] [--backend=cpu|cuda|auto] [--only=memory|attend|ingest]
//                      [--attend_inline_items=N] [--listen=ADDR]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "byte_sink.grpc.pb.h"
#include "client/kv_client.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/server_builder.h"
#include "server/oscarkv_server.h"

namespace oscarkv {
namespace {

using Clock = std::chrono::steady_clock;
std::string g_backend = "cpu";  // --backend=cpu|cuda|auto
int g_attend_inline_items = -1;  // --attend_inline_items=N (ServerOptions::attend_inline_items)
std::string g_listen = "127.0.0.1:0";  // --listen=ADDR (attend; unix:PATH for a Unix socket)
double Secs(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

double Pct(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[std::min(v.size() - 1, size_t(p * double(v.size() - 1) + 0.5))];
}

class ByteSinkService final : public bench::ByteSink::CallbackService {
  grpc::ServerReadReactor<bench::Blob>* Sink(grpc::CallbackServerContext*,
                                             bench::SinkReply* reply) override {
    class Reactor : public grpc::ServerReadReactor<bench::Blob> {
     public:
      explicit Reactor(bench::SinkReply* r) : reply_(r) { StartRead(&blob_); }
      void OnReadDone(bool ok) override {
        if (!ok) {
          reply_->set_bytes(bytes_);
          Finish(grpc::Status::OK);
          return;
        }
        bytes_ += int64_t(blob_.k().size() + blob_.v().size());
        StartRead(&blob_);
      }
      void OnDone() override { delete this; }

     private:
      bench::SinkReply* reply_;
      bench::Blob blob_;
      int64_t bytes_ = 0;
    };
    return new Reactor(reply);
  }
};

std::vector<bf16_bits> RandomBf16(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<bf16_bits> out(n);
  for (auto& x : out) x = FloatToBf16(nd(rng));
  return out;
}

void BenchIngest(bool quick) {
  const ModelLayout layout{4, 32, 8, 128};  // Qwen3-8B heads, 4 layers
  const int64_t tokens = quick ? 4096 : 16384;
  const size_t row = 8 * 128;
  const size_t n = size_t(layout.num_layers) * tokens * row;
  const std::vector<bf16_bits> k = RandomBf16(n, 1), v = RandomBf16(n, 2);
  ServerOptions o;
  o.backend = g_backend;
  o.pool_size.bytes = size_t(1) << 30;
  o.models = {"q8b4:4:32:8:128"};
  auto server = OscarkvServer::Start(o, nullptr);
  // The same service with a recent window longer than the sequence: every
  // token stays BF16, so no page is encoded. Isolates the RPC/store path.
  ServerOptions raw = o;
  raw.tiers.recent_window = 65536;
  raw.exact_fraction = 0.9;
  auto raw_server = OscarkvServer::Start(raw, nullptr);
  if (!server.ok() || !raw_server.ok()) {
    std::printf("ingest: cannot start servers\n");
    return;
  }
  ByteSinkService sink_service;
  grpc::ServerBuilder builder;
  int sink_port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &sink_port);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);  // a port of its own, as the server
  builder.RegisterService(&sink_service);
  builder.SetMaxReceiveMessageSize(64 << 20);
  auto sink_server = builder.BuildAndStart();

  std::printf("\n== ingest: %d layers x %lld tokens (Qwen3-8B heads), %.0f MiB BF16 per run\n",
              layout.num_layers, (long long)tokens, double(2 * n * 2) / (1 << 20));
  std::printf("%-10s %-16s %-22s %-16s %-14s %-14s\n", "chunk", "PutKv GB/s",
              "PutKv no-encode GB/s", "ByteSink GB/s", "PutKv/base", "no-enc/base");
  for (int64_t chunk : {int64_t(1) << 20, int64_t(4) << 20}) {
    ClientOptions co;
    co.chunk_bytes = chunk;
    // PutKv (best of 3), with and without encoding.
    auto put = [&](OscarkvServer& srv) {
      auto client = KvClient::Create(srv.address(), co);
      double best = 1e30;
      for (int rep = 0; rep < 3; ++rep) {
        const std::string id = "ingest-" + std::to_string(chunk) + "-" + std::to_string(rep);
        const auto t0 = Clock::now();
        auto r = client->PutSequence(id, "q8b4", layout, tokens, k.data(), v.data());
        const double s = Secs(Clock::now() - t0);
        if (!r.ok()) {
          std::printf("PutKv failed: %s\n", r.status().ToString().c_str());
          return 1e30;
        }
        best = std::min(best, s);
        (void)client->Drop(id);
      }
      return best;
    };
    const double put_best = put(**server);
    const double raw_best = put(**raw_server);
    // Baseline: the same message sizes on a plain byte stream (best of 3).
    auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(sink_port),
                                       grpc::InsecureChannelCredentials());
    auto stub = bench::ByteSink::NewStub(channel);
    const int64_t per = std::max<int64_t>(1, chunk / int64_t(row * 4));
    double sink_best = 1e30;
    for (int rep = 0; rep < 3; ++rep) {
      grpc::ClientContext ctx;
      bench::SinkReply reply;
      const auto t0 = Clock::now();
      auto w = stub->Sink(&ctx, &reply);
      for (int l = 0; l < layout.num_layers; ++l) {
        for (int64_t t = 0; t < tokens; t += per) {
          const int64_t m = std::min(per, tokens - t);
          const size_t off = (size_t(l) * tokens + t) * row;
          bench::Blob b;
          b.set_k(reinterpret_cast<const char*>(k.data() + off), m * row * 2);
          b.set_v(reinterpret_cast<const char*>(v.data() + off), m * row * 2);
          w->Write(b);
        }
      }
      w->WritesDone();
      w->Finish();
      sink_best = std::min(sink_best, Secs(Clock::now() - t0));
    }
    const double gb = double(2 * n * 2) / 1e9;
    std::printf("%-10s %-16.3f %-22.3f %-16.3f %-14.2f %-14.2f\n",
                (std::to_string(chunk >> 20) + " MiB").c_str(), gb / put_best, gb / raw_best,
                gb / sink_best, sink_best / put_best, sink_best / raw_best);
  }
  std::printf("(PutKv includes the server's rotate+clip+INT2 encode of every history page on "
              "the %s backend; the baseline does nothing with the bytes)\n",
              g_backend.c_str());
  sink_server->Shutdown();
}

void BenchAttend(bool quick) {
  const int tokens = quick ? 8192 : 32768;
  const ModelLayout layout{1, 32, 8, 128};
  ServerOptions o;
  o.backend = g_backend;
  o.attend_inline_items = g_attend_inline_items;
  o.listen_address = g_listen;
  o.pool_size.bytes = size_t(768) << 20;
  o.models = {"q8b1:1:32:8:128"};
  auto server = OscarkvServer::Start(o, nullptr);
  if (!server.ok()) {
    std::printf("attend: cannot start server: %s\n", server.status().ToString().c_str());
    return;
  }
  auto client = KvClient::Create((*server)->address());
  const size_t row = 8 * 128;
  const std::vector<bf16_bits> k = RandomBf16(size_t(tokens) * row, 3),
                               v = RandomBf16(size_t(tokens) * row, 4);
  for (int s = 0; s < 16; ++s) {
    auto r = client->PutSequence("att" + std::to_string(s), "q8b1", layout, tokens, k.data(),
                                 v.data());
    if (!r.ok()) {
      std::printf("attend: put failed: %s\n", r.status().ToString().c_str());
      return;
    }
  }
  for (int s = 0; s < 16; ++s) {
    auto r = client->PutSequence("small" + std::to_string(s), "q8b1", layout, 64, k.data(),
                                 v.data());
    if (!r.ok()) return;
  }
  std::vector<float> q(32 * 128);
  std::mt19937_64 rng(5);
  std::normal_distribution<float> nd;
  for (float& x : q) x = nd(rng);
  std::printf("\n== attend: one layer, %d tokens per sequence (Qwen3-8B heads), %s backend, "
              "--attend_inline_items=%d (-1: the server's default), server on %s\n",
              tokens, g_backend.c_str(), g_attend_inline_items, (*server)->address().c_str());
  std::printf("%-6s %-7s %-7s %-12s %-12s %-16s %-16s %-15s %-10s\n", "seqs", "tokens", "append",
              "rpc p50 ms", "rpc p99 ms", "in-proc p50 ms", "in-proc p99 ms", "overhead p50 us",
              "max|diff|");
  auto session = client->OpenAttend();
  const int reps = quick ? 20 : 60;
  // "small": 64-token sequences, where the compute is negligible and the
  // difference is the RPC path alone. "append": every call also appends one
  // token (the decode step's fused Append+Attend; every 32nd demotes a block
  // into a page); "apx" sequences, so the others keep their lengths.
  for (int s = 0; s < 16; ++s) {
    auto r = client->PutSequence("apx" + std::to_string(s), "q8b1", layout, tokens, k.data(),
                                 v.data());
    if (!r.ok()) return;
  }
  struct Row {
    int batch;
    std::string prefix;
    bool append;
  };
  for (const Row& row : std::vector<Row>{{1, "att", false},
                                         {16, "att", false},
                                         {1, "apx", true},
                                         {16, "apx", true},
                                         {1, "small", false},
                                         {16, "small", false}}) {
    const int batch = row.batch;
    const std::string& prefix = row.prefix;
    std::vector<AttendQuery> queries;
    for (int s = 0; s < batch; ++s) {
      AttendQuery aq{prefix + std::to_string(s), 0, q.data()};
      if (row.append) {
        aq.k = k.data();
        aq.v = v.data();
      }
      queries.push_back(aq);
    }
    std::vector<double> rpc, local;
    double max_diff = 0;  // batched RPC outputs vs one-by-one in-process calls
    if (!row.append) {
      auto r = (*session)->Call(queries, {layout}, true);
      std::vector<float> out(q.size()), lse(32);
      for (int j = 0; r.ok() && j < batch; ++j) {
        auto h = (*server)->store().Acquire(queries[j].sequence_id);
        int64_t n = 0;
        (void)(*server)->store().Attend(*h, 0, q.data(), nullptr, nullptr, -1, out.data(),
                                        lse.data(), &n);
        for (size_t e = 0; e < out.size() && e < (*r)[j].out.size(); ++e) {
          max_diff = std::max(max_diff, double(std::abs(out[e] - (*r)[j].out[e])));
        }
        if ((*r)[j].out.size() != out.size()) max_diff = INFINITY;
      }
    }
    // Interleaved so that drift (frequency, other load) hits both alike.
    for (int i = 0; i < reps + 3; ++i) {
      auto t0 = Clock::now();
      auto r = (*session)->Call(queries, {layout}, true);
      const double s = Secs(Clock::now() - t0);
      if (!r.ok()) return;
      t0 = Clock::now();
      {
        // The same work in-process: one AttendMany over the same items.
        std::vector<SequenceHandle> handles;
        for (int j = 0; j < batch; ++j) handles.push_back(*(*server)->store().Acquire(queries[j].sequence_id));
        std::vector<SequenceStore::AttendTask> tasks(batch);
        std::vector<std::vector<float>> outs(batch, std::vector<float>(q.size()));
        std::vector<std::vector<float>> lses(batch, std::vector<float>(32));
        for (int j = 0; j < batch; ++j) {
          tasks[j].seq = &handles[j];
          tasks[j].q = q.data();
          if (row.append) {
            tasks[j].k = k.data();
            tasks[j].v = v.data();
          }
          tasks[j].out = outs[j].data();
          tasks[j].lse = lses[j].data();
        }
        (*server)->store().AttendMany(tasks);
      }
      const double l = Secs(Clock::now() - t0);
      if (i >= 3) {
        rpc.push_back(s * 1e3);
        local.push_back(l * 1e3);
      }
    }
    char diff[32] = "-";  // appending rows are not compared (each call grows the cache)
    if (!row.append) std::snprintf(diff, sizeof(diff), "%.2g", max_diff);
    std::printf("%-6d %-7d %-7s %-12.3f %-12.3f %-16.3f %-16.3f %-15.0f %-10s\n", batch,
                prefix == "small" ? 64 : tokens, row.append ? "yes" : "no", Pct(rpc, 0.5),
                Pct(rpc, 0.99), Pct(local, 0.5), Pct(local, 0.99),
                (Pct(rpc, 0.5) - Pct(local, 0.5)) * 1e3, diff);
  }
  (void)(*session)->Close();
}

void BenchMemory() {
  std::printf("\n== memory: pool bytes per token per layer vs the codec's figure (Qwen3-8B "
              "heads, S0 64, W 256, P 32, G 128)\n");
  std::printf("%-8s %-16s %-16s %-10s\n", "tokens", "pool B/token", "codec B/token", "overhead");
  const ModelLayout layout{1, 32, 8, 128};
  ServerOptions o;
  o.backend = g_backend;
  o.pool_size.bytes = size_t(256) << 20;
  o.models = {"q8b1:1:32:8:128"};
  auto server = OscarkvServer::Start(o, nullptr);
  if (!server.ok()) return;
  auto client = KvClient::Create((*server)->address());
  const size_t row = 8 * 128;
  for (int tokens : {4096, 4113, 32768, 32785, 32799, 131072}) {
    const std::vector<bf16_bits> k = RandomBf16(size_t(tokens) * row, 6);
    auto r = client->PutSequence("mem", "q8b1", layout, tokens, k.data(), k.data());
    if (!r.ok()) {
      std::printf("%-8d (put failed: %s)\n", tokens, r.status().ToString().c_str());
      continue;
    }
    const double elems = double(row) * 2;  // K and V per token
    const double codec_bits = (16.0 * (64 + 256) + 2.25 * (tokens - 64 - 256)) / tokens;
    const double codec = codec_bits * elems / 8;
    const double pool = double(r->stored_bytes) / tokens;
    std::printf("%-8d %-16.1f %-16.1f %+.2f%%\n", tokens, pool, codec, 100 * (pool / codec - 1));
    (void)client->Drop("mem");
  }
  std::printf("(pool bytes count whole slots: partly filled BF16 blocks, and the recent tier "
              "holding W..W+P-1 tokens where the codec figure assumes exactly W)\n");
}

}  // namespace
}  // namespace oscarkv

int main(int argc, char** argv) {
  bool quick = false;
  std::string only;  // --only=memory|attend|ingest
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) quick = true;
    if (std::strncmp(argv[i], "--only=", 7) == 0) only = argv[i] + 7;
    if (std::strncmp(argv[i], "--backend=", 10) == 0) oscarkv::g_backend = argv[i] + 10;
    if (std::strncmp(argv[i], "--listen=", 9) == 0) oscarkv::g_listen = argv[i] + 9;
    if (std::strncmp(argv[i], "--attend_inline_items=", 22) == 0) {
      oscarkv::g_attend_inline_items = std::atoi(argv[i] + 22);
    }
  }
  std::printf("oscarkv service bench (%s), backend %s, %u hardware threads\n",
              quick ? "quick" : "full", oscarkv::g_backend.c_str(),
              std::thread::hardware_concurrency());
  if (only.empty() || only == "memory") oscarkv::BenchMemory();
  if (only.empty() || only == "attend") oscarkv::BenchAttend(quick);
  if (only.empty() || only == "ingest") oscarkv::BenchIngest(quick);
  return 0;
}
