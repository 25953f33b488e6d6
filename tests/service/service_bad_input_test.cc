// Bad input: each case gets a precise status and message, the server stays up,
// nothing becomes visible and no pool byte leaks.
#include <chrono>
#include <cmath>
#include <limits>

#include "gmock/gmock.h"
#include "service_fixture.h"

namespace oscarkv::testing {
namespace {

using ::testing::HasSubstr;

v1::PutKvRequest Header(const std::string& id, const std::string& model = kTinyModel) {
  v1::PutKvRequest r;
  r.mutable_header()->set_sequence_id(id);
  r.mutable_header()->set_model(model);
  return r;
}

v1::PutKvRequest Chunk(const KvData& d, int layer, int64_t start, int64_t n,
                       int64_t k_bytes_delta = 0) {
  v1::PutKvRequest r;
  v1::KvChunk* c = r.mutable_chunk();
  c->set_layer(layer);
  c->set_start_token(start);
  c->set_num_tokens(int32_t(n));
  const int l = layer < 0 ? 0 : layer;
  const size_t bytes = size_t(layer < 0 ? d.layout.num_layers : 1) * n * d.row() * 2;
  c->set_k(reinterpret_cast<const char*>(d.k_at(l, start)), bytes + k_bytes_delta);
  c->set_v(reinterpret_cast<const char*>(d.v_at(l, start)), bytes);
  return r;
}

// Sends the messages on one PutKv stream and returns the final status.
grpc::Status RawPut(KvClient& client, const std::vector<v1::PutKvRequest>& messages) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  v1::PutKvResponse resp;
  auto writer = client.stub().PutKv(&ctx, &resp);
  for (const auto& m : messages) {
    if (!writer->Write(m)) break;
  }
  writer->WritesDone();
  return writer->Finish();
}

class BadInput : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_NE(ts_.client, nullptr);
    free0_ = ts_.client->Info()->pool().free_bytes();
  }
  void TearDown() override {
    // A cancelled stream is cleaned up when the server sees the cancellation.
    int64_t free = -1;
    bool info_ok = true;
    WaitUntil(
        [&] {
          auto info = ts_.client->Info();
          info_ok = info.ok();
          if (info_ok) free = info->pool().free_bytes();
          return !info_ok || free == free0_ + committed_bytes_;
        },
        std::chrono::seconds(2));
    ASSERT_TRUE(info_ok);
    EXPECT_EQ(free, free0_ + committed_bytes_) << "pool bytes leaked";
  }
  TestServer ts_;
  KvData data_ = MakeKv(TinyLayout(), 40, 11);
  int64_t free0_ = 0;
  int64_t committed_bytes_ = 0;  // negative: bytes held by sequences the test keeps
};

TEST_F(BadInput, UnknownModelIsNotFound) {
  ExpectStatus(RawPut(*ts_.client, {Header("a", "nope"), Chunk(data_, 0, 0, 4)}),
               grpc::StatusCode::NOT_FOUND, "unknown model 'nope'");
}

TEST_F(BadInput, UnknownSequenceIsNotFoundEverywhere) {
  ExpectStatus(ts_.client->Stat("ghost").status(), absl::StatusCode::kNotFound, "ghost");
  ExpectStatus(ts_.client->Drop("ghost").status(), absl::StatusCode::kNotFound, "ghost");
  ExpectStatus(ts_.client->GetKv("ghost", v1::KV_FORMAT_BF16).status(),
               absl::StatusCode::kNotFound, "ghost");
  ExpectStatus(ts_.client->Append("ghost", TinyLayout(), 0, 0, 1, data_.k.data(), data_.v.data())
                   .status(),
               absl::StatusCode::kNotFound, "ghost");
  const std::vector<float> q = RandomQuery(TinyLayout(), 1);
  auto r = ts_.client->Attend({AttendQuery{"ghost", 0, q.data()}}, TinyLayout(), false);
  ASSERT_TRUE(r.ok());
  ExpectStatus((*r)[0].status, absl::StatusCode::kNotFound, "ghost");
}

TEST_F(BadInput, DuplicateSequenceIdIsAlreadyExists) {
  auto put = ts_.client->PutSequence("dup", kTinyModel, TinyLayout(), 40, data_.k.data(),
                                     data_.v.data());
  ASSERT_TRUE(put.ok());
  committed_bytes_ = -put->stored_bytes;
  ExpectStatus(RawPut(*ts_.client, {Header("dup"), Chunk(data_, 0, 0, 4)}),
               grpc::StatusCode::ALREADY_EXISTS, "already exists");
  // Two streams ingesting the same id at once: the second is refused.
  auto first = ts_.client->OpenPut("dup2", kTinyModel, TinyLayout(), false, 0);
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE((*first)->Write(0, 0, 4, data_.k_at(0, 0), data_.v_at(0, 0)).ok());
  // Wait until the server has taken the first stream's header.
  WaitUntil([&] { return ts_.server->store().Stats().ingesting != 0; }, std::chrono::seconds(1));
  ASSERT_EQ(ts_.server->store().Stats().ingesting, 1);
  ExpectStatus(RawPut(*ts_.client, {Header("dup2"), Chunk(data_, 0, 0, 4)}),
               grpc::StatusCode::ALREADY_EXISTS, "being ingested");
  // Reads and appends of a sequence still ingesting: FAILED_PRECONDITION, not NOT_FOUND.
  ExpectStatus(ts_.client->Stat("dup2").status(), absl::StatusCode::kFailedPrecondition,
               "still being ingested");
  ExpectStatus(ts_.client->Append("dup2", TinyLayout(), 0, 4, 1, data_.k_at(0, 4),
                                  data_.v_at(0, 4)).status(),
               absl::StatusCode::kFailedPrecondition, "still being ingested");
  // So is a drop: the stream's owner cancels it to discard it.
  ExpectStatus(ts_.client->Drop("dup2").status(), absl::StatusCode::kFailedPrecondition,
               "still being ingested");
  (*first)->Cancel();
}

TEST_F(BadInput, WrongByteCountsNameTheFieldAndSizes) {
  ExpectStatus(RawPut(*ts_.client, {Header("w"), Chunk(data_, 0, 0, 4, /*k_bytes_delta=*/-2)}),
               grpc::StatusCode::INVALID_ARGUMENT, "k has 1022 bytes; expected 1024 = 1 layers x 4 tokens");
  const std::vector<float> q = RandomQuery(TinyLayout(), 1);
  ASSERT_TRUE(ts_.client->PutSequence("w2", kTinyModel, TinyLayout(), 40, data_.k.data(),
                                      data_.v.data()).ok());
  committed_bytes_ = -ts_.client->Stat("w2")->stored_bytes();
  v1::AttendRequest req;
  v1::AttendItem* item = req.add_items();
  item->set_sequence_id("w2");
  item->set_q(std::string(100, '\0'));
  grpc::ClientContext ctx;
  auto stream = ts_.client->stub().Attend(&ctx);
  ASSERT_TRUE(stream->Write(req));
  v1::AttendResponse resp;
  ASSERT_TRUE(stream->Read(&resp));
  EXPECT_EQ(resp.results(0).code(), int(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_THAT(resp.results(0).error(), HasSubstr("q has 100 bytes; expected 2048"));
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
}

TEST_F(BadInput, TokensOutOfOrderOrOverlappingAreRefused) {
  ExpectStatus(RawPut(*ts_.client, {Header("o"), Chunk(data_, 0, 0, 4), Chunk(data_, 0, 8, 4)}),
               grpc::StatusCode::INVALID_ARGUMENT, "layer 0 holds 4 tokens; chunk starts at token 8");
  ExpectStatus(RawPut(*ts_.client, {Header("o"), Chunk(data_, 0, 0, 8), Chunk(data_, 0, 4, 4)}),
               grpc::StatusCode::INVALID_ARGUMENT, "layer 0 holds 8 tokens; chunk starts at token 4");
  EXPECT_EQ(ts_.client->Stat("o").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(BadInput, LayerOutOfRangeIsRefused) {
  ExpectStatus(RawPut(*ts_.client, {Header("l"), Chunk(data_, 0, 0, 4), [&] {
                 auto c = Chunk(data_, 0, 0, 4);
                 c.mutable_chunk()->set_layer(2);
                 return c;
               }()}),
               grpc::StatusCode::INVALID_ARGUMENT, "layer 2 out of range [0, 2)");
}

TEST_F(BadInput, NonFiniteValuesAreRefused) {
  KvData bad = data_;
  bad.v[bad.row() * 3 + 5] = FloatToBf16(std::numeric_limits<float>::quiet_NaN());
  bad.k[bad.row() * 2] = FloatToBf16(std::numeric_limits<float>::infinity());
  ExpectStatus(RawPut(*ts_.client, {Header("n"), Chunk(bad, 0, 0, 8)}),
               grpc::StatusCode::INVALID_ARGUMENT, "k of layer 0 contains NaN or Inf");
}

TEST_F(BadInput, NonFiniteQueryFailsItsItemOnlyAndAppendsNothing) {
  ASSERT_TRUE(ts_.client->PutSequence("fq", kTinyModel, TinyLayout(), 40, data_.k.data(),
                                      data_.v.data())
                  .ok());
  const std::vector<float> good = RandomQuery(TinyLayout(), 2);
  std::vector<float> bad = good;
  bad[7] = std::numeric_limits<float>::quiet_NaN();
  // The bad item also carries a fused append: it must not be applied.
  auto r = ts_.client->Attend({AttendQuery{"fq", 0, good.data()},
                               AttendQuery{"fq", 1, bad.data(), data_.k_at(1, 0),
                                           data_.v_at(1, 0), 40}},
                              TinyLayout(), false);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE((*r)[0].status.ok()) << (*r)[0].status;
  ExpectStatus((*r)[1].status, absl::StatusCode::kInvalidArgument,
               "query contains a non-finite value at index 7");
  auto stat = ts_.client->Stat("fq");
  ASSERT_TRUE(stat.ok());
  EXPECT_EQ(stat->tokens(), 40);
  ASSERT_TRUE(ts_.client->Drop("fq").ok());
}

TEST_F(BadInput, GetKvRefusesALayerListedTwice) {
  ASSERT_TRUE(ts_.client->PutSequence("g2", kTinyModel, TinyLayout(), 40, data_.k.data(),
                                      data_.v.data())
                  .ok());
  ExpectStatus(ts_.client->GetKv("g2", v1::KV_FORMAT_BF16, {1, 0, 1}).status(),
               absl::StatusCode::kInvalidArgument, "layer 1 is listed twice");
  ASSERT_TRUE(ts_.client->Drop("g2").ok());
}

TEST_F(BadInput, ClientRefusesAFusedAppendWithOnlyKOrOnlyV) {
  const std::vector<float> q = RandomQuery(TinyLayout(), 3);
  auto r = ts_.client->Attend({AttendQuery{"any", 0, q.data(), data_.k.data(), nullptr, 0}},
                              TinyLayout(), false);
  ExpectStatus(r.status(), absl::StatusCode::kInvalidArgument, "needs both k and v");
}

// Chunk arguments the client cannot even copy are refused before any RPC.
TEST_F(BadInput, ClientRefusesANegativeTokenCountOrMissingRows) {
  const ModelLayout layout = TinyLayout();
  ExpectStatus(ts_.client->Append("any", layout, 0, 0, -1, data_.k.data(), data_.v.data()).status(),
               absl::StatusCode::kInvalidArgument, "token count -1");
  ExpectStatus(ts_.client->Append("any", layout, 0, 0, 1, nullptr, data_.v.data()).status(),
               absl::StatusCode::kInvalidArgument, "rows are needed");
  auto put = ts_.client->OpenPut("neg", kTinyModel, layout, false, 0);
  ASSERT_TRUE(put.ok()) << put.status();
  ExpectStatus((*put)->Write(-1, 0, -5, data_.k.data(), data_.v.data()),
               absl::StatusCode::kInvalidArgument, "token count -5");
}

// An Attend message whose reply would not fit the message limit (each item's
// reply holds out and lse, more than its query) is refused item by item
// before anything runs: its fused append is not applied, and the stream
// stays usable.
TEST(AttendLimits, AReplyLargerThanTheMessageLimitAppliesNothing) {
  ServerOptions o = TinyServerOptions();
  o.max_message_bytes = 1 << 20;
  TestServer ts(o);
  ASSERT_NE(ts.client, nullptr);
  const ModelLayout layout = TinyLayout();
  const KvData data = MakeKv(layout, 25, 12);
  ASSERT_TRUE(PutFirstTokens(*ts.client, "r", data, 24).ok());
  const std::vector<float> q = RandomQuery(layout, 5);
  // ~2.06 KB of query per item, ~2.09 KB of reply with lse: 500 items fit a
  // 1 MiB request but not their reply.
  std::vector<AttendQuery> items(500, AttendQuery{"r", 0, q.data()});
  items[0] = AttendQuery{"r", 0, q.data(), data.k_at(0, 24), data.v_at(0, 24), 24};
  auto session = ts.client->OpenAttend();
  ASSERT_TRUE(session.ok()) << session.status();
  auto r = (*session)->Call(items, {layout}, /*return_lse=*/true);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->size(), items.size());
  for (const AttendOutput& o : *r) {
    ExpectStatus(o.status, absl::StatusCode::kResourceExhausted, "message limit");
  }
  auto st = ts.client->Stat("r");
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->tokens(), 24) << "the fused append was applied";
  // The same stream answers a batch that fits, the append included.
  items.resize(2);
  r = (*session)->Call(items, {layout}, true);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE((*r)[0].status.ok()) << (*r)[0].status;
  EXPECT_EQ((*r)[0].tokens, 25);
  EXPECT_TRUE((*session)->Close().ok());
}

// GetKv with include_rotation: a layer's first message carries the rotation
// (512 KiB at D = 256) next to its first chunk (the 64-token sink, 1 MiB of
// BF16), so the chunk must shrink by the rotation's bytes to keep the message
// within the server's limit.
TEST(GetKvLimits, ARotationAndItsChunkStayWithinTheMessageLimit) {
  ServerOptions o = TinyServerOptions(size_t{64} << 20);
  o.max_message_bytes = 1 << 20;
  o.models = {"big:1:16:16:256"};
  o.tiers = TierConfig{64, 64, 32};
  TestServer ts(o);
  ASSERT_NE(ts.client, nullptr);
  const ModelLayout big{1, 16, 16, 256};
  const KvData data = MakeKv(big, 100, 3);
  ASSERT_TRUE(ts.client->PutSequence("g", "big", big, 100, data.k.data(), data.v.data()).ok());
  // The server's own chunk size (max_chunk_bytes 0), read raw.
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  v1::GetKvRequest req;
  req.set_sequence_id("g");
  req.set_format(v1::KV_FORMAT_COMPRESSED);
  req.set_include_rotation(true);
  auto reader = ts.client->stub().GetKv(&ctx, req);
  v1::GetKvResponse msg;
  int64_t rotation_floats = 0, tokens = 0;
  while (reader->Read(&msg)) {
    EXPECT_LE(msg.ByteSizeLong(), size_t{1} << 20);
    if (!msg.has_compressed()) continue;
    tokens += msg.compressed().num_tokens();
    if (msg.compressed().has_rotation()) {
      rotation_floats += int64_t(msg.compressed().rotation().r_k().size() / 4);
    }
  }
  const grpc::Status st = reader->Finish();
  EXPECT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(rotation_floats, 256 * 256);
  EXPECT_EQ(tokens, 100);
}

// A client whose own limits are larger than the server's sizes its PutKv
// chunks to the server's limit (GetServerInfo), so a long ingest goes
// through instead of failing on its first 4 MiB chunk.
TEST(PutLimits, ChunksFollowTheServersSmallerMessageLimit) {
  ServerOptions o = TinyServerOptions(size_t{32} << 20);
  o.max_message_bytes = 1 << 20;
  TestServer ts(o);
  ASSERT_NE(ts.server, nullptr);
  auto client = KvClient::Create(ts.server->address());  // 64 MiB messages, 4 MiB chunks
  ASSERT_NE(client, nullptr);
  EXPECT_EQ(client->PutChunkBytes(), (1 << 20) - (64 << 10));
  const ModelLayout layout = TinyLayout();
  const KvData data = MakeKv(layout, 4096, 21);  // 2 MiB of K + V per layer
  auto put = client->PutSequence("long", kTinyModel, layout, 4096, data.k.data(), data.v.data());
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->tokens, 4096);
}

TEST_F(BadInput, EmptyStreamsAreRefused) {
  ExpectStatus(RawPut(*ts_.client, {}), grpc::StatusCode::INVALID_ARGUMENT, "without a header");
  ExpectStatus(RawPut(*ts_.client, {Header("e")}), grpc::StatusCode::INVALID_ARGUMENT,
               "without any tokens");
  ExpectStatus(RawPut(*ts_.client, {Chunk(data_, 0, 0, 4)}), grpc::StatusCode::INVALID_ARGUMENT,
               "first PutKv message must be a header");
  ExpectStatus(RawPut(*ts_.client, {Header("e"), Header("e")}),
               grpc::StatusCode::INVALID_ARGUMENT, "second header");
  // Layers that end with different counts.
  ExpectStatus(RawPut(*ts_.client, {Header("e"), Chunk(data_, 0, 0, 8), Chunk(data_, 1, 0, 4)}),
               grpc::StatusCode::INVALID_ARGUMENT, "layer 1 holding 4 tokens but layer 0 holding 8");
  EXPECT_EQ(ts_.client->Stat("e").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(BadInput, OversizedMessageIsResourceExhausted) {
  // The server accepts 4 MiB messages; send 6 MiB (K and V) in one chunk.
  ClientOptions big;
  big.max_message_bytes = 32 << 20;
  auto client = KvClient::Create(ts_.server->address(), big);
  const KvData huge = MakeKv(TinyLayout(), 12000, 3);
  ExpectStatus(RawPut(*client, {Header("big"), Chunk(huge, 0, 0, 12000)}),
               grpc::StatusCode::RESOURCE_EXHAUSTED, "");
  // gRPC refuses the message before the server's stream has ended: until its
  // reactor finishes, the sequence is still "ingesting" (FAILED_PRECONDITION).
  // It must then be gone, not committed.
  absl::StatusCode code = absl::StatusCode::kUnknown;
  WaitUntil(
      [&] {
        code = ts_.client->Stat("big").status().code();
        return code != absl::StatusCode::kFailedPrecondition;
      },
      std::chrono::seconds(5));
  EXPECT_EQ(code, absl::StatusCode::kNotFound);
}

TEST_F(BadInput, TooManyHeadsAndBadLayoutsAreRefused) {
  v1::LoadCalibrationRequest req;
  req.set_model("huge");
  v1::ModelLayout* l = req.mutable_hadamard_layout();
  l->set_num_layers(2);
  l->set_num_q_heads(4096);
  l->set_num_kv_heads(2);
  l->set_head_dim(64);
  ExpectStatus(ts_.client->LoadCalibration(req).status(), absl::StatusCode::kInvalidArgument,
               "q_heads");
  l->set_num_q_heads(8);
  l->set_head_dim(96);
  ExpectStatus(ts_.client->LoadCalibration(req).status(), absl::StatusCode::kInvalidArgument,
               "head_dim");
  // A model whose pages do not fit this pool's slots.
  l->set_head_dim(128);
  l->set_num_kv_heads(8);
  l->set_num_q_heads(32);
  ExpectStatus(ts_.client->LoadCalibration(req).status(),
               absl::StatusCode::kFailedPrecondition, "pool slots");
  // A fitting one registers; a second registration without replace is refused.
  l->set_num_kv_heads(1);
  l->set_num_q_heads(4);
  l->set_head_dim(64);
  auto ok = ts_.client->LoadCalibration(req);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->objective(), "hadamard");
  ExpectStatus(ts_.client->LoadCalibration(req).status(), absl::StatusCode::kAlreadyExists,
               "already registered");
  v1::LoadCalibrationRequest from_file;
  from_file.set_model("f");
  from_file.set_path("/nonexistent/calib.safetensors");
  // This server has no --calibration_dir: path loading is off.
  ExpectStatus(ts_.client->LoadCalibration(from_file).status(),
               absl::StatusCode::kPermissionDenied, "--calibration_dir");
}

// A sequence still being ingested was encoded from its first chunk with the
// model's current rotation: replacing the rotation is refused until the
// stream ends, as it is while committed sequences exist.
TEST_F(BadInput, ReplacingAModelWhileASequenceOfItIsIngestedIsRefused) {
  auto stream = ts_.client->OpenPut("ingesting", kTinyModel, TinyLayout(), false, 40);
  ASSERT_TRUE(stream.ok()) << stream.status();
  ASSERT_TRUE((*stream)->Write(0, 0, 40, data_.k_at(0, 0), data_.v_at(0, 0)).ok());
  WaitUntil([&] { return ts_.server->store().Stats().ingesting != 0; }, std::chrono::seconds(1));
  ASSERT_EQ(ts_.server->store().Stats().ingesting, 1);
  ExpectStatus(ts_.client->LoadCalibration(TinyHadamardRequest(kTinyModel, true)).status(),
               absl::StatusCode::kFailedPrecondition, "1 sequence(s) being ingested");
  ASSERT_TRUE((*stream)->Write(1, 0, 40, data_.k_at(1, 0), data_.v_at(1, 0)).ok());
  ASSERT_TRUE((*stream)->Finish().ok());
  ExpectStatus(ts_.client->LoadCalibration(TinyHadamardRequest(kTinyModel, true)).status(),
               absl::StatusCode::kFailedPrecondition, "1 stored sequence(s)");
  ASSERT_TRUE(ts_.client->Drop("ingesting").ok());
  auto replaced = ts_.client->LoadCalibration(TinyHadamardRequest(kTinyModel, true));
  EXPECT_TRUE(replaced.ok()) << replaced.status();
}

TEST(ModelLimit, ANewModelBeyondMaxModelsIsResourceExhaustedAndReplacingStillWorks) {
  ServerOptions o = TinyServerOptions();
  o.max_models = 2;  // "tiny" and one more
  TestServer ts(o);
  ASSERT_NE(ts.client, nullptr);
  ASSERT_TRUE(ts.client->LoadCalibration(TinyHadamardRequest("second", false)).ok());
  for (const bool replace : {false, true}) {
    ExpectStatus(ts.client->LoadCalibration(TinyHadamardRequest("third", replace)).status(),
                 absl::StatusCode::kResourceExhausted, "--max_models 2");
  }
  EXPECT_EQ(ts.client->Info()->models_size(), 2);
  auto replaced = ts.client->LoadCalibration(TinyHadamardRequest("second", true));
  EXPECT_TRUE(replaced.ok()) << replaced.status();
  EXPECT_EQ(ts.client->Info()->models_size(), 2);
}

TEST(ModelLimit, MoreStartupModelsThanTheLimitOrALimitBelowOneIsRefusedAtStart) {
  ServerOptions o = TinyServerOptions();
  o.models = {"a:2:8:2:64", "b:2:8:2:64", "c:2:8:2:64"};
  o.max_models = 2;
  ExpectStatus(OscarkvServer::Start(o, nullptr).status(), absl::StatusCode::kInvalidArgument,
               "--max_models 2");
  o.max_models = 0;
  ExpectStatus(OscarkvServer::Start(o, nullptr).status(), absl::StatusCode::kInvalidArgument,
               "max_models must be >= 1");
}

}  // namespace
}  // namespace oscarkv::testing
