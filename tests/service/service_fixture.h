// Shared helpers for the service tests: an in-process server on 127.0.0.1:0
// with a small model, seeded K/V data, and an fp64 model of what the server
// stores (to check GetKv and Attend against).
#ifndef OSCARKV_TESTS_SERVICE_SERVICE_FIXTURE_H_
#define OSCARKV_TESTS_SERVICE_SERVICE_FIXTURE_H_

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "client/kv_client.h"
#include "client/local_attention.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/layout.h"
#include "kernels/numeric.h"
#include "kernels/page_format.h"
#include "kernels/quantize.h"
#include "kernels/reference.h"
#include "kernels/status_macros.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"
#include "server/calibration_reader.h"
#include "server/oscarkv_server.h"

namespace oscarkv::testing {

// "tiny": 2 layers, 8 q heads, 2 kv heads, D 64; tiers S0 8, W 16, P 8.
inline constexpr char kTinyModel[] = "tiny";
inline ModelLayout TinyLayout() { return ModelLayout{2, 8, 2, 64}; }

// The backend under test: $OSCARKV_TEST_BACKEND (cpu | cuda | auto), default cpu.
inline std::string TestBackend() {
  const char* b = std::getenv("OSCARKV_TEST_BACKEND");
  return b && *b ? b : "cpu";
}
// Server vs local-CPU-kernel agreement: exact on the CPU backend; the CUDA
// kernels sum in another order.
inline double BackendTolerance() { return TestBackend() == "cpu" ? 1e-6 : 2e-5; }

// Tiers of the tiny model: 8-token pages, except where the backend needs
// pages of 32 tokens (the CUDA attention kernels) or $OSCARKV_TEST_PAGE_TOKENS
// asks for them (to run the CUDA tiers on the CPU backend).
inline TierConfig TinyTiers() {
  const char* p = std::getenv("OSCARKV_TEST_PAGE_TOKENS");
  const int page = p && *p ? std::atoi(p) : (TestBackend() == "cpu" ? 8 : 32);
  return page == 8 ? TierConfig{8, 16, 8} : TierConfig{8, page, page};
}

// For tests whose token counts and tier sizes are written for 8-token pages.
#define OSCARKV_SKIP_UNLESS_8_TOKEN_PAGES()                                    \
  if (::oscarkv::testing::TinyTiers().page_tokens != 8)                        \
  GTEST_SKIP() << "token counts and tier sizes written for 8-token pages"

// A failed call: its status code, and a message that contains `text`.
inline void ExpectStatus(const absl::Status& s, absl::StatusCode code, const std::string& text) {
  EXPECT_EQ(s.code(), code) << s;
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr(text));
}
inline void ExpectStatus(const grpc::Status& s, grpc::StatusCode code, const std::string& text) {
  EXPECT_EQ(s.error_code(), code) << s.error_message();
  EXPECT_THAT(s.error_message(), ::testing::HasSubstr(text));
}

// A LoadCalibration of the data-free Hadamard rotation of the tiny layout.
inline v1::LoadCalibrationRequest TinyHadamardRequest(const std::string& model, bool replace) {
  v1::LoadCalibrationRequest req;
  req.set_model(model);
  req.set_replace(replace);
  const ModelLayout tiny = TinyLayout();
  v1::ModelLayout* l = req.mutable_hadamard_layout();
  l->set_num_layers(tiny.num_layers);
  l->set_num_q_heads(tiny.num_q_heads);
  l->set_num_kv_heads(tiny.num_kv_heads);
  l->set_head_dim(tiny.head_dim);
  return req;
}

inline ServerOptions TinyServerOptions(size_t pool_bytes = size_t{8} << 20) {
  ServerOptions o;
  o.listen_address = "127.0.0.1:0";
  o.backend = TestBackend();
  o.cpu_threads = 2;
  o.pool_size.bytes = pool_bytes;
  o.exact_fraction = 0.5;
  o.tiers = TinyTiers();
  o.models = {"tiny:2:8:2:64"};
  o.max_message_bytes = 4 << 20;
  return o;
}

// The CPU backend inside a Backend of the test's own: a subclass overrides
// the one behaviour a test changes. AvailableBytes and the copy batch keep
// Backend's defaults unless overridden.
class CpuBackendWrapper : public Backend {
 public:
  std::string name() const override { return "cpu-wrapped"; }
  std::string description() const override { return name() + " (cpu inside)"; }
  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override { return cpu_.Allocate(bytes); }
  absl::Status CopyToDevice(void* d, const void* s, size_t n) override {
    return cpu_.CopyToDevice(d, s, n);
  }
  absl::Status CopyToHost(void* d, const void* s, size_t n) override {
    return cpu_.CopyToHost(d, s, n);
  }
  absl::Status CopyOnDevice(void* d, const void* s, size_t n) override {
    return cpu_.CopyOnDevice(d, s, n);
  }
  absl::Status EncodePages(const PageGeometry& g, const EncodeJob* j, int n) override {
    return cpu_.EncodePages(g, j, n);
  }
  absl::Status DecodePages(const PageGeometry& g, const DecodeJob* j, int n) override {
    return cpu_.DecodePages(g, j, n);
  }
  absl::Status Attend(const AttendBatch& b) override { return cpu_.Attend(b); }

 protected:
  CpuBackend cpu_{1};
};

struct TestServer {
  std::shared_ptr<prometheus::Registry> registry = std::make_shared<prometheus::Registry>();
  std::unique_ptr<OscarkvServer> server;
  std::unique_ptr<KvClient> client;

  explicit TestServer(const ServerOptions& options = TinyServerOptions(),
                      ClientOptions client_options = {}) {
    auto s = OscarkvServer::Start(options, registry, DefaultCalibrationReader());
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) return;
    server = std::move(*s);
    client_options.max_message_bytes = options.max_message_bytes;
    client_options.chunk_bytes = 64 << 10;
    client = KvClient::Create(server->address(), client_options);
  }
};

// Polls `done` every 5 ms until it holds or `limit` has passed; whether it
// held.
template <typename Pred>
bool WaitUntil(Pred done, std::chrono::milliseconds limit) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (!done()) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

// The server's metrics as Prometheus scrapes them (text format).
inline std::string Scrape(OscarkvServer& server) {
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, server.collectable()->Collect());
  return out.str();
}

// Polls the pool's free bytes (up to `limit`) until done(free bytes); the
// last value seen (-1: none).
template <class Done>
int64_t PollFree(KvClient& client, Done done, std::chrono::milliseconds limit) {
  int64_t got = -1;
  WaitUntil(
      [&] {
        auto info = client.Info();
        if (!info.ok()) return false;
        got = info->pool().free_bytes();
        return done(got);
      },
      limit);
  return got;
}

// Waits (up to 5 s) until the pool's free bytes equal `want` (a stream's
// cleanup runs when the server notices its end) and returns the last seen.
inline int64_t WaitForFree(KvClient& client, int64_t want) {
  return PollFree(client, [&](int64_t free) { return free == want; }, std::chrono::seconds(5));
}

// Waits (up to `limit`) until the pool's free bytes differ from `from` (the
// server holds a stream's pages).
inline void WaitForFreeToChange(KvClient& client, int64_t from, std::chrono::milliseconds limit) {
  PollFree(client, [&](int64_t free) { return free != from; }, limit);
}

// Seeded K/V [L][T][Hkv][D] in BF16 with a few large channels.
struct KvData {
  ModelLayout layout;
  int64_t tokens = 0;
  std::vector<bf16_bits> k, v;
  size_t row() const { return layout.kv_row_elems(); }
  const bf16_bits* k_at(int layer, int64_t t) const { return k.data() + (size_t(layer) * tokens + t) * row(); }
  const bf16_bits* v_at(int layer, int64_t t) const { return v.data() + (size_t(layer) * tokens + t) * row(); }
  // The first n tokens of every layer.
  KvData Prefix(int64_t n) const {
    KvData p;
    p.layout = layout;
    p.tokens = n;
    for (int l = 0; l < layout.num_layers; ++l) {
      p.k.insert(p.k.end(), k_at(l, 0), k_at(l, n));
      p.v.insert(p.v.end(), v_at(l, 0), v_at(l, n));
    }
    return p;
  }
};

inline KvData MakeKv(const ModelLayout& layout, int64_t tokens, uint64_t seed) {
  KvData d;
  d.layout = layout;
  d.tokens = tokens;
  const size_t n = size_t(layout.num_layers) * tokens * d.row();
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  d.k.resize(n);
  d.v.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const int ch = int(i % layout.head_dim);
    d.k[i] = FloatToBf16(nd(rng) * (ch % 29 == 3 ? 6.0f : 1.0f));
    d.v[i] = FloatToBf16(nd(rng));
  }
  return d;
}

// Stores the first `tokens` tokens of `data` as sequence `id` of the tiny
// model (the rest are left for the test to append).
inline absl::Status PutFirstTokens(KvClient& client, const std::string& id, const KvData& data,
                                   int64_t tokens) {
  const KvData first = data.Prefix(tokens);
  return client.PutSequence(id, kTinyModel, data.layout, tokens, first.k.data(), first.v.data())
      .status();
}

inline std::vector<float> RandomQuery(const ModelLayout& l, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> q(size_t(l.num_q_heads) * l.head_dim);
  for (float& x : q) x = nd(rng);
  return q;
}

// The fp64 cache a COMPRESSED layer represents: sink/recent as stored, history
// dequantized in the rotated basis and un-rotated in fp64. Returns K and V
// [T][Hkv][D].
inline void DequantizedLayer(const FetchedLayer& f, const ModelLayout& l, int group_size,
                             int page_tokens, std::vector<double>* k, std::vector<double>* v) {
  const int d = l.head_dim, h = l.num_kv_heads;
  const size_t row = size_t(h) * d;
  PageGeometry g{h, d, group_size, page_tokens};
  k->assign(size_t(f.tokens) * row, 0.0);
  v->assign(size_t(f.tokens) * row, 0.0);
  for (int64_t t = 0; t < f.sink_tokens; ++t) {
    for (size_t i = 0; i < row; ++i) {
      (*k)[t * row + i] = Bf16ToFloat(f.sink_k[t * row + i]);
      (*v)[t * row + i] = Bf16ToFloat(f.sink_v[t * row + i]);
    }
  }
  const int64_t base = f.sink_tokens + f.history_tokens;
  for (int64_t t = 0; t < f.recent_tokens; ++t) {
    for (size_t i = 0; i < row; ++i) {
      (*k)[(base + t) * row + i] = Bf16ToFloat(f.recent_k[t * row + i]);
      (*v)[(base + t) * row + i] = Bf16ToFloat(f.recent_v[t * row + i]);
    }
  }
  std::vector<float> y(d);
  const int pages = int(f.history_tokens / page_tokens);
  for (int p = 0; p < pages; ++p) {
    const uint8_t* page = f.pages.data() + size_t(p) * g.page_bytes();
    for (int hh = 0; hh < h; ++hh) {
      for (int kind = 0; kind < 2; ++kind) {
        const float* r = (kind == 0 ? f.r_k.data() : f.r_v.data()) +
                         (f.num_matrices > 1 ? size_t(hh) * d * d : 0);
        const uint8_t* codes = page + g.codes_offset(hh, kind);
        const auto* params = reinterpret_cast<const QuantParams*>(page + g.params_offset(hh, kind));
        for (int t = 0; t < page_tokens; ++t) {
          DequantizeRow(codes + size_t(t) * g.code_row_bytes(), params + size_t(t) * g.groups(),
                        d, group_size, y.data());
          const int64_t tok = f.sink_tokens + int64_t(p) * page_tokens + t;
          double* dst = (kind == 0 ? k->data() : v->data()) + tok * row + size_t(hh) * d;
          for (int i = 0; i < d; ++i) {
            double s = 0;
            for (int j = 0; j < d; ++j) s += double(y[j]) * r[size_t(i) * d + j];
            dst[i] = s;
          }
        }
      }
    }
  }
}

// Infinity when the sizes differ or are zero, so an empty result never passes.
inline double MaxAbsDiff(const std::vector<float>& a, const std::vector<double>& b) {
  if (a.size() != b.size() || a.empty()) return INFINITY;
  double m = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

// The largest |difference| between the server's Attend output for layer 1 of
// sequence `id` and `local`'s, for one random query of `seed`.
inline absl::StatusOr<double> LocalVsServerLayer1(KvClient& client, LocalAttention& local,
                                                  const std::string& id,
                                                  const ModelLayout& layout, uint64_t seed) {
  const std::vector<float> q = RandomQuery(layout, seed);
  auto remote = client.Attend({AttendQuery{id, 1, q.data()}}, layout, false);
  if (!remote.ok()) return remote.status();
  if (!(*remote)[0].status.ok()) return (*remote)[0].status;
  std::vector<float> out(q.size());
  OSCARKV_RETURN_IF_ERROR(local.Attend(1, q.data(), out.data(), nullptr));
  return MaxAbsDiff((*remote)[0].out, std::vector<double>(out.begin(), out.end()));
}

}  // namespace oscarkv::testing

#endif  // OSCARKV_TESTS_SERVICE_SERVICE_FIXTURE_H_
