// The client against a server that breaks the API contract (a bug, a
// mismatched version, a proxy): a scripted fake KvCache service sends replies
// the real server never would, and the client must answer with a clear
// status, never crash or return a half-filled result as OK.
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "client/kv_client.h"
#include "gmock/gmock.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "service_fixture.h"

namespace oscarkv::testing {
namespace {

// Replies to every GetKv with `script`, in order, then OK (except the first
// `unavailable_get_kv` GetKv calls, which end UNAVAILABLE after
// `unavailable_after`, as a server still starting); to each Attend message
// with `attend_reply` (its request_id copied unless `attend_reply_id` >= 0).
// A handler works on a copy taken when its call starts: the handler of a
// call the client has cancelled may still be writing when the test sets the
// next script.
class ScriptedKvCache final : public v1::KvCache::Service {
 public:
  struct Script {
    std::vector<v1::GetKvResponse> get_kv;
    v1::AttendResponse attend_reply;
    int64_t attend_reply_id = -1;
    grpc::Status attend_end = grpc::Status::OK;  // how each Attend stream ends
    int unavailable_get_kv = 0;
    std::chrono::milliseconds unavailable_after{0};
  };
  // Changes the script of later calls.
  void Edit(const std::function<void(Script&)>& edit) {
    std::lock_guard<std::mutex> lock(mu_);
    edit(script_);
  }

  grpc::Status Attend(grpc::ServerContext*,
                      grpc::ServerReaderWriter<v1::AttendResponse, v1::AttendRequest>* stream)
      override {
    const Script s = Copy();
    v1::AttendRequest req;
    while (stream->Read(&req)) {
      v1::AttendResponse r = s.attend_reply;
      r.set_request_id(s.attend_reply_id >= 0 ? s.attend_reply_id : req.request_id());
      if (!stream->Write(r)) break;
    }
    return s.attend_end;
  }

  grpc::Status GetKv(grpc::ServerContext*, const v1::GetKvRequest*,
                     grpc::ServerWriter<v1::GetKvResponse>* writer) override {
    const Script s = Copy();
    int call = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      call = ++get_kv_calls_;
    }
    if (call <= s.unavailable_get_kv) {
      std::this_thread::sleep_for(s.unavailable_after);
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "scripted: not ready");
    }
    for (const auto& m : s.get_kv) {
      if (!writer->Write(m)) break;
    }
    return grpc::Status::OK;
  }
  // GetKv calls received so far.
  int get_kv_calls() {
    std::lock_guard<std::mutex> lock(mu_);
    return get_kv_calls_;
  }

 private:
  Script Copy() {
    std::lock_guard<std::mutex> lock(mu_);
    return script_;
  }
  std::mutex mu_;
  Script script_;
  int get_kv_calls_ = 0;
};

class ClientReply : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    // Without SO_REUSEPORT, as the real server: with it (gRPC's default), two
    // servers created at once on port 0 (another suite's fixture) may get
    // the same port, and this test's calls reach the other's fake
    // (grpc/grpc#10755).
    b.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    b.RegisterService(&fake_);
    server_ = b.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ClientOptions o;
    o.max_attempts = 1;
    o.deadline = std::chrono::milliseconds(10000);
    client_ = KvClient::Create(Target(), o);
    ASSERT_NE(client_, nullptr);
  }
  std::string Target() const { return "127.0.0.1:" + std::to_string(port_); }
  void TearDown() override { server_->Shutdown(); }

  // The header of a 2-layer tiny sequence of `tokens` tokens.
  static v1::GetKvResponse Header(int num_layers = 2, int64_t tokens = 4) {
    v1::GetKvResponse m;
    v1::SequenceInfo* h = m.mutable_header();
    h->set_sequence_id("s");
    h->set_model(kTinyModel);
    h->mutable_layout()->set_num_layers(num_layers);
    h->mutable_layout()->set_num_q_heads(8);
    h->mutable_layout()->set_num_kv_heads(2);
    h->mutable_layout()->set_head_dim(64);
    h->mutable_tiers()->set_sink_tokens(8);
    h->mutable_tiers()->set_recent_window(16);
    h->mutable_tiers()->set_page_tokens(8);
    h->mutable_tiers()->set_group_size(64);
    h->set_tokens(tokens);
    return m;
  }
  // BF16 rows of one layer: `rows` rows of 2 heads x 64 dims, claiming `tokens`.
  static v1::GetKvResponse Bf16(int layer, int tokens, int rows) {
    v1::GetKvResponse m;
    v1::KvChunk* c = m.mutable_bf16();
    c->set_layer(layer);
    c->set_start_token(0);
    c->set_num_tokens(tokens);
    const std::string bytes(size_t(rows) * 2 * 64 * 2, '\0');
    c->set_k(bytes);
    c->set_v(bytes);
    return m;
  }
  // A COMPRESSED sink chunk of `tokens` tokens whose rotation claims
  // `matrices` matrices but carries `floats` floats each.
  static v1::GetKvResponse Sink(int layer, int tokens, int matrices, size_t floats) {
    v1::GetKvResponse m;
    v1::CompressedChunk* c = m.mutable_compressed();
    c->set_layer(layer);
    c->set_tier(v1::TIER_SINK);
    c->set_start_token(0);
    c->set_num_tokens(tokens);
    const std::string bytes(size_t(tokens) * 2 * 64 * 2, '\0');
    c->set_k(bytes);
    c->set_v(bytes);
    c->mutable_rotation()->set_num_matrices(matrices);
    const std::string r(floats * 4, '\0');
    c->mutable_rotation()->set_r_k(r);
    c->mutable_rotation()->set_r_v(r);
    return m;
  }

  absl::Status Fetch(v1::KvFormat format) { return client_->GetKv("s", format).status(); }
  void SetGetKv(std::vector<v1::GetKvResponse> messages) {
    fake_.Edit([&](ScriptedKvCache::Script& s) { s.get_kv = std::move(messages); });
  }

  ScriptedKvCache fake_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<KvClient> client_;
};

TEST_F(ClientReply, AWellFormedReplyIsAccepted) {
  SetGetKv({Header(), Bf16(0, 4, 4), Bf16(1, 4, 4)});
  auto got = client_->GetKv("s", v1::KV_FORMAT_BF16);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->layers[1].tokens, 4);
  SetGetKv({Header(), Sink(0, 4, 1, 64 * 64), Sink(1, 4, 2, 2 * 64 * 64)});
  EXPECT_TRUE(Fetch(v1::KV_FORMAT_COMPRESSED).ok()) << Fetch(v1::KV_FORMAT_COMPRESSED);
}

TEST_F(ClientReply, AMalformedStreamIsDataLoss) {
  SetGetKv({Bf16(0, 4, 4), Header()});
  ExpectStatus(Fetch(v1::KV_FORMAT_BF16), absl::StatusCode::kDataLoss, "data before the header");
  SetGetKv({Header(-1)});
  ExpectStatus(Fetch(v1::KV_FORMAT_BF16), absl::StatusCode::kDataLoss, "header of -1 layers");
  SetGetKv({Header(), Bf16(5, 4, 4)});
  ExpectStatus(Fetch(v1::KV_FORMAT_BF16), absl::StatusCode::kDataLoss, "a chunk of layer 5");
  SetGetKv({Header(), Header()});
  ExpectStatus(Fetch(v1::KV_FORMAT_BF16), absl::StatusCode::kDataLoss, "a second header");
  SetGetKv({});
  ExpectStatus(Fetch(v1::KV_FORMAT_BF16), absl::StatusCode::kDataLoss, "no valid header");
}

TEST_F(ClientReply, ALayerThatDoesNotAddUpIsDataLoss) {
  SetGetKv({Header(), Bf16(0, 4, 4)});
  ExpectStatus(Fetch(v1::KV_FORMAT_BF16), absl::StatusCode::kDataLoss, "layer 1: missing");
  SetGetKv({Header(), Bf16(0, 4, 4), Bf16(1, 4, 3)});
  ExpectStatus(Fetch(v1::KV_FORMAT_BF16), absl::StatusCode::kDataLoss, "for 4 tokens");
  // A rotation of 2 kv heads' matrices declared as 8 (one matrix sent):
  // anyone reading num_matrices x D x D floats would run past it.
  SetGetKv({Header(), Sink(0, 4, 8, 64 * 64), Sink(1, 4, 1, 64 * 64)});
  ExpectStatus(Fetch(v1::KV_FORMAT_COMPRESSED), absl::StatusCode::kDataLoss,
               "8 rotation matrices for 2 kv heads");
  SetGetKv({Header(), Sink(0, 4, 2, 64 * 64), Sink(1, 4, 1, 64 * 64)});
  ExpectStatus(Fetch(v1::KV_FORMAT_COMPRESSED), absl::StatusCode::kDataLoss,
               "rotation has 4096 and 4096 floats; expected 8192");
}

// A read-only call is retried on UNAVAILABLE with the same reply as a first
// attempt would get.
TEST_F(ClientReply, GetKvIsRetriedAfterUnavailable) {
  SetGetKv({Header(), Bf16(0, 4, 4), Bf16(1, 4, 4)});
  fake_.Edit([](ScriptedKvCache::Script& s) { s.unavailable_get_kv = 2; });
  ClientOptions o;
  o.max_attempts = 3;
  o.backoff = std::chrono::milliseconds(10);
  o.deadline = std::chrono::milliseconds(10000);
  auto got = KvClient::Create(Target(), o)->GetKv("s", v1::KV_FORMAT_BF16);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->layers[1].tokens, 4);
  EXPECT_EQ(fake_.get_kv_calls(), 3);
}

// The deadline bounds a call with all its retries: each attempt gets what
// remains, and no attempt is made with too little left.
TEST_F(ClientReply, RetriesOfAReadOnlyCallShareItsDeadline) {
  SetGetKv({Header(), Bf16(0, 4, 4), Bf16(1, 4, 4)});
  fake_.Edit([](ScriptedKvCache::Script& s) {
    s.unavailable_get_kv = 100;
    s.unavailable_after = std::chrono::milliseconds(400);
  });
  ClientOptions o;
  o.max_attempts = 4;
  o.backoff = std::chrono::milliseconds(10);
  o.deadline = std::chrono::milliseconds(1000);
  auto client = KvClient::Create(Target(), o);
  // 400 ms + 10 + 400 + 20, then the third attempt runs into the deadline
  // (with a fresh deadline per attempt: 4 x 400 ms + backoffs).
  auto start = std::chrono::steady_clock::now();
  absl::Status s = client->GetKv("s", v1::KV_FORMAT_BF16).status();
  const auto took_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                           std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_LT(took_ms, 1600);  // 1.67 s with a fresh deadline per attempt; the call count decides
  EXPECT_LE(fake_.get_kv_calls(), 3);

  // 300 ms, then a 200 ms backoff would leave nothing of 500 ms: no retry.
  fake_.Edit([](ScriptedKvCache::Script& s) {
    s.unavailable_get_kv = 1000;
    s.unavailable_after = std::chrono::milliseconds(300);
  });
  const int calls_before = fake_.get_kv_calls();
  o.backoff = std::chrono::milliseconds(200);
  o.deadline = std::chrono::milliseconds(500);
  ExpectStatus(KvClient::Create(Target(), o)->GetKv("s", v1::KV_FORMAT_BF16).status(),
               absl::StatusCode::kUnavailable,
               "scripted: not ready (attempt 1; too little of the 500 ms deadline left to retry)");
  EXPECT_EQ(fake_.get_kv_calls(), calls_before + 1);
}

// Attend results whose sizes or ids do not match the request: the item (or
// the call) fails with DATA_LOSS instead of handing back a short output.
TEST_F(ClientReply, AttendResultsThatDoNotMatchTheRequestAreDataLoss) {
  const ModelLayout tiny{2, 8, 2, 64};
  const std::vector<float> q(8 * 64, 0.5f);
  const std::vector<AttendQuery> items = {{"s", 0, q.data()}, {"s", 1, q.data()}};
  const std::string out(8 * 64 * 4, '\0'), lse(8 * 4, '\0');
  v1::AttendResponse reply;
  v1::AttendResult* ok = reply.add_results();
  ok->set_out(out);
  ok->set_lse(lse);
  ok->set_tokens(3);
  v1::AttendResult* shortened = reply.add_results();
  shortened->set_out(std::string(4, '\0'));
  shortened->set_lse(lse);
  fake_.Edit([&](ScriptedKvCache::Script& s) { s.attend_reply = reply; });
  auto r = client_->Attend(items, tiny, /*return_lse=*/true);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE((*r)[0].status.ok()) << (*r)[0].status;
  EXPECT_EQ((*r)[0].out.size(), 8u * 64);
  ExpectStatus((*r)[1].status, absl::StatusCode::kDataLoss, "4 bytes of output");
  EXPECT_TRUE((*r)[1].out.empty());
  // An error code outside gRPC's range reads as UNKNOWN.
  shortened->Clear();
  shortened->set_code(99);
  shortened->set_error("odd");
  fake_.Edit([&](ScriptedKvCache::Script& s) { s.attend_reply = reply; });
  r = client_->Attend(items, tiny, true);
  ASSERT_TRUE(r.ok()) << r.status();
  ExpectStatus((*r)[1].status, absl::StatusCode::kUnknown, "odd");
  // A reply to another request.
  fake_.Edit([](ScriptedKvCache::Script& s) { s.attend_reply_id = 77; });
  ExpectStatus(client_->Attend(items, tiny, true).status(), absl::StatusCode::kDataLoss,
               "Attend reply 77");
}

// Answers received before the stream ends badly are returned: their fused
// appends were applied, so reporting the stream's error instead would invite
// a retry that appends them again.
TEST_F(ClientReply, AttendAnswersStandWhenTheStreamThenFails) {
  const ModelLayout tiny{2, 8, 2, 64};
  const std::vector<float> q(8 * 64, 0.5f);
  fake_.Edit([](ScriptedKvCache::Script& s) {
    v1::AttendResult* r0 = s.attend_reply.add_results();
    r0->set_out(std::string(8 * 64 * 4, '\0'));
    r0->set_tokens(9);
    s.attend_end = grpc::Status(grpc::StatusCode::UNAVAILABLE, "shutting down");
  });
  auto r = client_->Attend({AttendQuery{"s", 0, q.data()}}, tiny, /*return_lse=*/false);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE((*r)[0].status.ok()) << (*r)[0].status;
  EXPECT_EQ((*r)[0].tokens, 9);
}

}  // namespace
}  // namespace oscarkv::testing
