// End-to-end over real gRPC (in-process server on 127.0.0.1:0, client library):
// put -> get, put -> attend, appends across the demotion boundary, admin calls.
#include <cstring>

#include "client/local_attention.h"
#include "gmock/gmock.h"
#include "server/service/kv_service.h"
#include "service_fixture.h"
#include "tests/temp_path.h"

namespace oscarkv::testing {
namespace {

using ::testing::ElementsAre;
using ::testing::Eq;
using ::testing::HasSubstr;
using ::testing::Le;
using ::testing::Lt;
using ::testing::SizeIs;

// Stores `data` (tiny model) as sequence `id` and fetches it back COMPRESSED.
absl::StatusOr<FetchedSequence> PutAndFetchCompressed(KvClient& client, const std::string& id,
                                                      const KvData& data) {
  auto put = client.PutSequence(id, kTinyModel, data.layout, data.tokens, data.k.data(),
                                data.v.data());
  if (!put.ok()) return put.status();
  return client.GetKv(id, v1::KV_FORMAT_COMPRESSED);
}

constexpr int kGroup = 64;   // G = D for the tiny model

TEST(Service, PutThenGetBf16IsBitExactOnSinkAndRecentAndBoundedOnHistory) {
  OSCARKV_SKIP_UNLESS_8_TOKEN_PAGES();
  TestServer ts;
  ASSERT_NE(ts.client, nullptr);
  const KvData data = MakeKv(TinyLayout(), 100, 1);
  auto put = ts.client->PutSequence("s1", kTinyModel, data.layout, data.tokens, data.k.data(),
                                    data.v.data());
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->tokens, 100);
  EXPECT_EQ(put->bf16_bytes_sent, int64_t(data.k.size() * 4));

  auto got = ts.client->GetKv("s1", v1::KV_FORMAT_BF16);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->info.tokens(), 100);
  // 100 tokens: sink 8, history (92-16)/8 = 9 pages = 72 tokens, recent 20.
  EXPECT_EQ(got->info.sink_tokens(), 8);
  EXPECT_EQ(got->info.history_tokens(), 72);
  EXPECT_EQ(got->info.recent_tokens(), 20);
  const size_t row = data.row();
  for (int l = 0; l < 2; ++l) {
    const FetchedLayer& f = got->layers[l];
    ASSERT_EQ(f.k.size(), 100 * row);
    // Sink [0, 8) and recent [80, 100) bit-exact.
    EXPECT_EQ(std::memcmp(f.k.data(), data.k_at(l, 0), 8 * row * 2), 0);
    EXPECT_EQ(std::memcmp(f.v.data(), data.v_at(l, 0), 8 * row * 2), 0);
    EXPECT_EQ(std::memcmp(f.k.data() + 80 * row, data.k_at(l, 80), 20 * row * 2), 0);
    EXPECT_EQ(std::memcmp(f.v.data() + 80 * row, data.v_at(l, 80), 20 * row * 2), 0);
    // History: 2-bit codec error, relative L2 per tensor well below 1 and not zero.
    double err = 0, norm = 0;
    for (size_t i = 8 * row; i < 80 * row; ++i) {
      const double x = Bf16ToFloat(data.k_at(l, 0)[i]);
      err += std::pow(Bf16ToFloat(f.k[i]) - x, 2);
      norm += x * x;
    }
    EXPECT_GT(err, 0.0);
    EXPECT_LT(std::sqrt(err / norm), 0.6) << "layer " << l;
  }
}

TEST(Service, AttendEqualsLocalAttentionOnFetchedPagesAndFp64Reference) {
  TestServer ts;
  ASSERT_NE(ts.client, nullptr);
  const ModelLayout layout = TinyLayout();
  const KvData data = MakeKv(layout, 150, 2);
  auto fetched = PutAndFetchCompressed(*ts.client, "s", data);
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  EXPECT_EQ(fetched->info.objective(), "hadamard");
  // Keep an fp64 model of layer 1 before LocalAttention takes the pages.
  std::vector<double> kref, vref;
  DequantizedLayer(fetched->layers[1], layout, kGroup, TinyTiers().page_tokens, &kref, &vref);
  auto local = LocalAttention::Create(std::move(*fetched), 1);
  ASSERT_TRUE(local.ok()) << local.status();

  const std::vector<float> q = RandomQuery(layout, 7);
  AttendQuery query{"s", 1, q.data()};
  auto remote = ts.client->Attend({query}, layout, /*return_lse=*/true);
  ASSERT_TRUE(remote.ok()) << remote.status();
  ASSERT_THAT(*remote, SizeIs(1));
  ASSERT_TRUE((*remote)[0].status.ok()) << (*remote)[0].status;
  EXPECT_EQ((*remote)[0].tokens, 150);

  std::vector<float> out(q.size()), lse(layout.num_q_heads);
  ASSERT_TRUE((*local)->Attend(1, q.data(), out.data(), lse.data()).ok());
  std::vector<double> lse_ref;
  const std::vector<double> ref = ReferenceAttention(
      std::vector<double>(q.begin(), q.end()), kref, vref, 150, layout.num_q_heads,
      layout.num_kv_heads, layout.head_dim, 1.0 / std::sqrt(64.0), &lse_ref);
  EXPECT_THAT(MaxAbsDiff((*remote)[0].out, std::vector<double>(out.begin(), out.end())),
              Le(BackendTolerance()));
  EXPECT_THAT(MaxAbsDiff((*remote)[0].out, ref), Lt(1e-4));
  EXPECT_THAT(MaxAbsDiff((*remote)[0].lse, lse_ref), Lt(1e-4));
}

// A fetched layer's rotation is one matrix for all kv heads or one per kv
// head; any other count (a reply from a mismatched server) is refused, not
// read with a per-head stride past its end.
TEST(Service, LocalAttentionRefusesARotationOfTheWrongMatrixCount) {
  TestServer ts;
  ASSERT_NE(ts.client, nullptr);
  const ModelLayout layout = TinyLayout();
  auto fetched = PutAndFetchCompressed(*ts.client, "m", MakeKv(layout, 40, 4));
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  const int matrices = layout.num_kv_heads + 1;
  const size_t floats = size_t(matrices) * layout.head_dim * layout.head_dim;
  fetched->layers[1].num_matrices = matrices;
  fetched->layers[1].r_k.assign(floats, 0.0f);
  fetched->layers[1].r_v.assign(floats, 0.0f);
  auto local = LocalAttention::Create(std::move(*fetched), 1);
  ExpectStatus(local.status(), absl::StatusCode::kInvalidArgument, "rotation matrices for");
}

// A layer fetched without its rotation is attended with the rebuilt Hadamard
// rotation only when the sequence's rotation_id names it; another id (a
// server with other clip ratios, a model that only calls itself "hadamard")
// is refused instead of attended with matrices the server may not have used.
TEST(Service, LocalAttentionRebuildsHadamardOnlyForItsRotationId) {
  TestServer ts;
  ASSERT_NE(ts.client, nullptr);
  const ModelLayout layout = TinyLayout();
  const KvData data = MakeKv(layout, 60, 5);
  ASSERT_TRUE(ts.client->PutSequence("h", kTinyModel, layout, data.tokens, data.k.data(),
                                     data.v.data()).ok());
  auto fetched = ts.client->GetKv("h", v1::KV_FORMAT_COMPRESSED, {}, /*include_rotation=*/false);
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  ASSERT_EQ(fetched->layers[1].num_matrices, 0);
  FetchedSequence other_id = *fetched;
  other_id.info.set_rotation_id("0123456789abcdef");
  ExpectStatus(LocalAttention::Create(std::move(other_id), 1).status(),
               absl::StatusCode::kFailedPrecondition,
               "rotation_id '0123456789abcdef' is not the default Hadamard rotation");
  auto local = LocalAttention::Create(std::move(*fetched), 1);
  ASSERT_TRUE(local.ok()) << local.status();
  const auto diff = LocalVsServerLayer1(*ts.client, **local, "h", layout, 11);
  ASSERT_TRUE(diff.ok()) << diff.status();
  EXPECT_THAT(*diff, Le(BackendTolerance()));

  // The Hadamard default of a server with other clip ratios: its own id.
  ServerOptions options = TinyServerOptions();
  options.clip_k = 0.9f;
  TestServer clipped(options);
  ASSERT_NE(clipped.client, nullptr);
  ASSERT_TRUE(clipped.client->PutSequence("h", kTinyModel, layout, data.tokens, data.k.data(),
                                          data.v.data()).ok());
  auto bare = clipped.client->GetKv("h", v1::KV_FORMAT_COMPRESSED, {}, false);
  ASSERT_TRUE(bare.ok()) << bare.status();
  EXPECT_EQ(bare->info.objective(), "hadamard");
  ExpectStatus(LocalAttention::Create(std::move(*bare), 1).status(),
               absl::StatusCode::kFailedPrecondition, "fetch with include_rotation");
  auto with_rotation = clipped.client->GetKv("h", v1::KV_FORMAT_COMPRESSED);
  ASSERT_TRUE(with_rotation.ok()) << with_rotation.status();
  EXPECT_TRUE(LocalAttention::Create(std::move(*with_rotation), 1).ok());
}

// A sidecar's clients on the same host may use a Unix domain socket.
TEST(Service, ServesOverAUnixDomainSocket) {
  const std::string path = ::oscarkv::testing::UniqueTempPath("uds");
  ServerOptions o = TinyServerOptions();
  o.listen_address = "unix:" + path;
  {
    TestServer ts(o);
    ASSERT_NE(ts.server, nullptr);
    EXPECT_EQ(ts.server->address(), "unix:" + path);
    EXPECT_EQ(ts.server->port(), 0);
    const ModelLayout layout = TinyLayout();
    const KvData data = MakeKv(layout, 150, 2);
    auto put = ts.client->PutSequence("s", kTinyModel, layout, data.tokens, data.k.data(),
                                      data.v.data());
    ASSERT_TRUE(put.ok()) << put.status();
    const std::vector<float> q = RandomQuery(layout, 7);
    auto remote = ts.client->Attend({AttendQuery{"s", 1, q.data()}}, layout, true);
    ASSERT_TRUE(remote.ok()) << remote.status();
    ASSERT_TRUE((*remote)[0].status.ok()) << (*remote)[0].status;
    EXPECT_EQ((*remote)[0].tokens, 150);
    // The same answer as the store computes in process.
    auto h = ts.server->store().Acquire("s");
    ASSERT_TRUE(h.ok());
    std::vector<float> out(q.size()), lse(layout.num_q_heads);
    int64_t n = 0;
    ASSERT_TRUE(ts.server->store()
                    .Attend(*h, 1, q.data(), nullptr, nullptr, -1, out.data(), lse.data(), &n)
                    .ok());
    EXPECT_EQ((*remote)[0].out, out);
    // A second server on the same socket is refused (gRPC alone would take
    // the address over), and the first one keeps serving.
    auto second = OscarkvServer::Start(o, nullptr);
    ASSERT_FALSE(second.ok());
    EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
    EXPECT_THAT(std::string(second.status().message()), HasSubstr("in use"));
    auto again = ts.client->Attend({AttendQuery{"s", 1, q.data()}}, layout, true);
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ((*again)[0].out, out);
  }
}

// AppendKv's reply carries the tokens now held by the appended layer(s): a
// per-layer append moves that layer past the others, whose minimum Stat
// reports.
TEST(Service, PerLayerAppendReportsTheAppendedLayersTokens) {
  TestServer ts;
  ASSERT_NE(ts.client, nullptr);
  const ModelLayout layout = TinyLayout();
  const KvData data = MakeKv(layout, 12, 8);
  ASSERT_TRUE(PutFirstTokens(*ts.client, "p", data, 10).ok());
  for (int t = 10; t < 12; ++t) {
    auto n = ts.client->Append("p", layout, 0, t, 1, data.k_at(0, t), data.v_at(0, t));
    ASSERT_TRUE(n.ok()) << n.status();
    EXPECT_EQ(*n, t + 1);
  }
  auto st = ts.client->Stat("p");
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->tokens(), 10);  // the minimum over layers: layer 1 holds 10
  auto n = ts.client->Append("p", layout, 1, 10, 1, data.k_at(1, 10), data.v_at(1, 10));
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, 11);
}

TEST(Service, AppendAcrossDemotionBoundaryKeepsTiersAndAttention) {
  OSCARKV_SKIP_UNLESS_8_TOKEN_PAGES();
  TestServer ts;
  ASSERT_NE(ts.client, nullptr);
  const ModelLayout layout = TinyLayout();
  const KvData data = MakeKv(layout, 60, 3);
  // 30 tokens: below S0 + W + P = 32, so no history yet.
  ASSERT_TRUE(PutFirstTokens(*ts.client, "a", data, 30).ok());
  auto st = ts.client->Stat("a");
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->history_tokens(), 0);

  // Tokens 30..44 by AppendKv on all layers, one at a time.
  const size_t row = data.row();
  std::vector<bf16_bits> k(2 * row), v(2 * row);
  for (int t = 30; t < 45; ++t) {
    for (int l = 0; l < 2; ++l) {
      std::memcpy(k.data() + l * row, data.k_at(l, t), row * 2);
      std::memcpy(v.data() + l * row, data.v_at(l, t), row * 2);
    }
    auto n = ts.client->Append("a", layout, -1, t, 1, k.data(), v.data());
    ASSERT_TRUE(n.ok()) << n.status();
    EXPECT_EQ(*n, t + 1);
  }
  // Tokens 45..59 by fused Append+Attend, layer by layer.
  auto session = ts.client->OpenAttend();
  ASSERT_TRUE(session.ok());
  const std::vector<float> q = RandomQuery(layout, 9);
  for (int t = 45; t < 60; ++t) {
    for (int l = 0; l < 2; ++l) {
      AttendQuery a{"a", l, q.data(), data.k_at(l, t), data.v_at(l, t), t};
      auto r = (*session)->Call({a}, {layout}, false);
      ASSERT_TRUE(r.ok()) << r.status();
      ASSERT_TRUE((*r)[0].status.ok()) << (*r)[0].status;
      EXPECT_EQ((*r)[0].tokens, t + 1);
    }
  }
  EXPECT_TRUE((*session)->Close().ok());
  st = ts.client->Stat("a");
  ASSERT_TRUE(st.ok());
  // 60 tokens: sink 8, (52-16)/8 = 4 pages = 32 history, recent 20.
  EXPECT_EQ(st->tokens(), 60);
  EXPECT_EQ(st->history_tokens(), 32);
  EXPECT_EQ(st->recent_tokens(), 20);

  // Same state as putting all 60 at once: identical BF16 read-back.
  ASSERT_TRUE(ts.client->PutSequence("b", kTinyModel, layout, 60, data.k.data(), data.v.data()).ok());
  auto ga = ts.client->GetKv("a", v1::KV_FORMAT_BF16);
  auto gb = ts.client->GetKv("b", v1::KV_FORMAT_BF16);
  ASSERT_TRUE(ga.ok() && gb.ok());
  for (int l = 0; l < 2; ++l) {
    EXPECT_EQ(ga->layers[l].k, gb->layers[l].k) << "layer " << l;
    EXPECT_EQ(ga->layers[l].v, gb->layers[l].v) << "layer " << l;
  }
  // A stale position is refused and changes nothing.
  AttendQuery stale{"a", 0, q.data(), data.k_at(0, 5), data.v_at(0, 5), 42};
  auto r = ts.client->Attend({stale}, layout, false);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ((*r)[0].status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ts.client->Stat("a")->tokens(), 60);
}

// `attend_inline_items` 0: the batch runs on the compute threads; 16: on the
// gRPC thread that read it. The answers must not depend on where it ran.
void MixedAttendMessage(int attend_inline_items) {
  ServerOptions o = TinyServerOptions();
  o.attend_inline_items = attend_inline_items;
  TestServer ts(o);
  ASSERT_NE(ts.client, nullptr);
  const ModelLayout layout = TinyLayout();
  const KvData data = MakeKv(layout, 61, 12);
  ASSERT_TRUE(PutFirstTokens(*ts.client, "m1", data, 60).ok());
  ASSERT_TRUE(PutFirstTokens(*ts.client, "m2", data, 60).ok());
  ASSERT_TRUE(ts.client->PutSequence("ref", kTinyModel, layout, 61, data.k.data(), data.v.data()).ok());
  const std::vector<float> q = RandomQuery(layout, 4);
  // m1: append token 60 on both layers (same sequence twice in one message),
  // a bad layer in between, m2 without append, an unknown sequence.
  std::vector<AttendQuery> batch = {
      {"m1", 0, q.data(), data.k_at(0, 60), data.v_at(0, 60), 60},
      {"m1", 5, q.data()},
      {"m1", 1, q.data(), data.k_at(1, 60), data.v_at(1, 60), 60},
      {"m2", 1, q.data()},
      {"nope", 0, q.data()},
  };
  auto r = ts.client->Attend(batch, layout, true);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_THAT(*r, SizeIs(5));
  EXPECT_TRUE((*r)[0].status.ok()) << (*r)[0].status;
  EXPECT_EQ((*r)[1].status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE((*r)[2].status.ok()) << (*r)[2].status;
  EXPECT_TRUE((*r)[3].status.ok()) << (*r)[3].status;
  EXPECT_EQ((*r)[4].status.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ((*r)[0].tokens, 61);
  EXPECT_EQ((*r)[2].tokens, 61);
  EXPECT_EQ((*r)[3].tokens, 60);
  EXPECT_EQ(ts.client->Stat("m1")->tokens(), 61);
  // The fused results equal attention over a sequence put with all 61 tokens.
  auto ref = ts.client->Attend({AttendQuery{"ref", 0, q.data()}, AttendQuery{"ref", 1, q.data()}},
                               layout, true);
  ASSERT_TRUE(ref.ok());
  EXPECT_EQ((*r)[0].out, (*ref)[0].out);
  EXPECT_EQ((*r)[2].out, (*ref)[1].out);
  EXPECT_EQ((*r)[2].lse, (*ref)[1].lse);
}

TEST(Service, OneAttendMessageMixesSequencesLayersAppendsAndErrors) { MixedAttendMessage(0); }

TEST(Service, OneAttendMessageRunInlineOnTheGrpcThreadGivesTheSameAnswers) {
  MixedAttendMessage(16);
}

TEST(Service, AtMostTwoAttendBatchesHoldGrpcThreadsAtOnce) {
  const KvCacheService svc{ServiceContext{}};
  ASSERT_EQ(KvCacheService::kMaxInlineAttends, 2);
  EXPECT_TRUE(svc.TryEnterInline());
  EXPECT_TRUE(svc.TryEnterInline());
  EXPECT_FALSE(svc.TryEnterInline());  // the third goes to the compute threads
  svc.LeaveInline();
  EXPECT_TRUE(svc.TryEnterInline());
}

TEST(Service, AttendInlineItemsBelowAutoIsRefusedAtStart) {
  ServerOptions o = TinyServerOptions();
  o.attend_inline_items = -2;
  auto s = OscarkvServer::Start(o, nullptr);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("attend_inline_items must be -1"));
}

// Two fused appends to one layer in one message, the second one demoting the
// oldest recent block: every item attends after all appends (the API's rule),
// so both see the same 32 tokens and no item reads a block freed by demotion.
TEST(Service, FusedAppendsThatDemoteInOneMessageAttendTheFinalCache) {
  TestServer ts;
  ASSERT_NE(ts.client, nullptr);
  const ModelLayout layout = TinyLayout();  // S0 8, W 16, P 8: demotion at 32 tokens
  const KvData data = MakeKv(layout, 32, 21);
  ASSERT_TRUE(PutFirstTokens(*ts.client, "d", data, 30).ok());
  ASSERT_TRUE(ts.client->PutSequence("ref", kTinyModel, layout, 32, data.k.data(), data.v.data()).ok());
  const std::vector<float> q = RandomQuery(layout, 9);
  auto r = ts.client->Attend({{"d", 0, q.data(), data.k_at(0, 30), data.v_at(0, 30), 30},
                              {"d", 0, q.data(), data.k_at(0, 31), data.v_at(0, 31), 31}},
                             layout, true);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE((*r)[0].status.ok()) << (*r)[0].status;
  ASSERT_TRUE((*r)[1].status.ok()) << (*r)[1].status;
  EXPECT_EQ((*r)[0].tokens, 32);
  EXPECT_EQ((*r)[1].tokens, 32);
  auto ref = ts.client->Attend({AttendQuery{"ref", 0, q.data()}}, layout, true);
  ASSERT_TRUE(ref.ok());
  EXPECT_EQ((*r)[0].out, (*ref)[0].out);
  EXPECT_EQ((*r)[1].out, (*ref)[0].out);
  EXPECT_EQ((*r)[0].lse, (*ref)[0].lse);
}

TEST(Service, DropListAndInfoReflectTheStore) {
  TestServer ts;
  ASSERT_NE(ts.client, nullptr);
  const ModelLayout layout = TinyLayout();
  auto info0 = ts.client->Info();
  ASSERT_TRUE(info0.ok());
  EXPECT_EQ(info0->backend(), TestBackend() == "auto" ? info0->backend() : TestBackend());
  ASSERT_THAT(info0->models(), SizeIs(1));
  EXPECT_EQ(info0->models(0).name(), "tiny");
  EXPECT_EQ(info0->models(0).objective(), "hadamard");
  EXPECT_FALSE(info0->models(0).calibrated());
  const int64_t free0 = info0->pool().free_bytes();

  const KvData data = MakeKv(layout, 64, 4);
  for (const char* id : {"x", "y", "z"}) {
    ASSERT_TRUE(ts.client->PutSequence(id, kTinyModel, layout, 64, data.k.data(), data.v.data()).ok());
  }
  auto list = ts.client->List();
  ASSERT_TRUE(list.ok());
  std::vector<std::string> ids;
  for (const auto& s : *list) ids.push_back(s.sequence_id());
  EXPECT_THAT(ids, ElementsAre("x", "y", "z"));
  EXPECT_LT(ts.client->Info()->pool().free_bytes(), free0);

  // Paging through the raw API, two per page.
  std::vector<std::string> paged;
  std::string token;
  int pages = 0;
  do {
    grpc::ClientContext ctx;
    v1::ListSequencesRequest req;
    req.set_page_size(2);
    req.set_page_token(token);
    v1::ListSequencesResponse resp;
    ASSERT_TRUE(ts.client->stub().ListSequences(&ctx, req, &resp).ok());
    for (const auto& s : resp.sequences()) paged.push_back(s.sequence_id());
    token = resp.next_page_token();
    ++pages;
  } while (!token.empty() && pages < 10);
  EXPECT_THAT(paged, ElementsAre("x", "y", "z"));
  EXPECT_EQ(pages, 2);
  EXPECT_EQ(ts.client->List("nope").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ts.client->List("tiny")->size(), 3u);

  auto freed = ts.client->Drop("y");
  ASSERT_TRUE(freed.ok());
  EXPECT_GT(*freed, 0);
  EXPECT_EQ(ts.client->Stat("y").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ts.client->Drop("y").status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(ts.client->Drop("x").ok());
  ASSERT_TRUE(ts.client->Drop("z").ok());
  auto info1 = ts.client->Info();
  EXPECT_EQ(info1->pool().free_bytes(), free0);
  EXPECT_EQ(info1->sequences(), 0);
}

TEST(Service, AsyncCallsCompleteWithTheSameResults) {
  TestServer ts;
  ASSERT_NE(ts.client, nullptr);
  const ModelLayout layout = TinyLayout();
  const KvData data = MakeKv(layout, 40, 5);
  auto put = ts.client->PutSequenceAsync("q", kTinyModel, layout, 40, data.k.data(), data.v.data());
  ASSERT_TRUE(put.get().ok());
  auto st = ts.client->StatAsync("q").get();
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->tokens(), 40);
  const KvData more = MakeKv(layout, 1, 6);
  auto n = ts.client->AppendAsync("q", layout, -1, 40, 1, more.k.data(), more.v.data()).get();
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, 41);
  EXPECT_EQ(ts.client->InfoAsync().get()->sequences(), 1);
  const std::vector<float> q = RandomQuery(layout, 8);
  auto sync = ts.client->Attend({AttendQuery{"q", 1, q.data()}}, layout, true);
  auto async = ts.client->AttendAsync({AttendQuery{"q", 1, q.data()}}, layout, true).get();
  ASSERT_TRUE(sync.ok() && async.ok());
  EXPECT_EQ((*async)[0].tokens, 41);
  EXPECT_EQ((*async)[0].out, (*sync)[0].out);
  EXPECT_TRUE(ts.client->DropAsync("q").get().ok());
  EXPECT_EQ(ts.client->StatAsync("q").get().status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace oscarkv::testing
