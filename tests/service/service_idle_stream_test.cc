// Streams that stall on their client: past the server's idle limit a PutKv
// that receives nothing is ended ABORTED with its ingest discarded, and a
// GetKv whose client takes nothing is cancelled, letting go of its sequence.
// Streams that make progress are not ended however long they last.
#include <chrono>
#include <limits>
#include <thread>

#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "service_fixture.h"

namespace oscarkv::testing {
namespace {

using ::testing::HasSubstr;

// Long enough that a loaded CI machine's scheduling hiccups (a test thread
// not run for a few hundred ms) neither end an active stream nor end a
// stalled one before the test has looked at what it holds.
constexpr std::chrono::milliseconds kIdleLimit{1000};

ServerOptions IdleLimitedOptions(size_t pool_bytes = size_t{8} << 20) {
  ServerOptions o = TinyServerOptions(pool_bytes);
  o.stream_idle_timeout = kIdleLimit;
  return o;
}

TEST(IdleStream, StalledPutIsAbortedAndFreesItsSlotsAndId) {
  TestServer ts(IdleLimitedOptions());
  ASSERT_NE(ts.client, nullptr);
  const int64_t free0 = ts.client->Info()->pool().free_bytes();
  const KvData data = MakeKv(TinyLayout(), 100, 1);
  auto stream = ts.client->OpenPut("stalled", kTinyModel, TinyLayout(), false, 0);
  ASSERT_TRUE(stream.ok()) << stream.status();
  ASSERT_TRUE((*stream)->Write(0, 0, 60, data.k_at(0, 0), data.v_at(0, 0)).ok());
  // The server holds the partial layer; the client then sends nothing more.
  WaitForFreeToChange(*ts.client, free0, std::chrono::milliseconds(500));
  EXPECT_LT(ts.client->Info()->pool().free_bytes(), free0);
  EXPECT_EQ(WaitForFree(*ts.client, free0), free0);
  EXPECT_EQ(ts.server->store().Stats().ingesting, 0);
  EXPECT_EQ(ts.client->Stat("stalled").status().code(), absl::StatusCode::kNotFound);
  ExpectStatus((*stream)->Finish().status(), absl::StatusCode::kAborted,
               "PutKv stream idle for ");
  // The id is free again.
  EXPECT_TRUE(ts.client->PutSequence("stalled", kTinyModel, TinyLayout(), 100, data.k.data(),
                                     data.v.data()).ok());
}

TEST(IdleStream, PutWhoseMessagesKeepComingOutlastsTheLimit) {
  TestServer ts(IdleLimitedOptions());
  ASSERT_NE(ts.client, nullptr);
  const KvData data = MakeKv(TinyLayout(), 100, 2);
  auto stream = ts.client->OpenPut("slow", kTinyModel, TinyLayout(), false, 100);
  ASSERT_TRUE(stream.ok()) << stream.status();
  // Twenty chunks a tenth of the limit apart: the stream lives twice the limit.
  for (int l = 0; l < 2; ++l) {
    for (int t = 0; t < 100; t += 10) {
      std::this_thread::sleep_for(kIdleLimit / 10);
      ASSERT_TRUE((*stream)->Write(l, t, 10, data.k_at(l, t), data.v_at(l, t)).ok());
    }
  }
  auto put = (*stream)->Finish();
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->tokens, 100);
}

// A raw GetKv reader that takes the header and then nothing: without BDP
// probing the client's HTTP/2 window stays small, so the server's writes of a
// reply of several MiB cannot all complete.
TEST(IdleStream, GetKvWhoseClientStopsReadingIsCancelledAndLetsGoOfItsSequence) {
  TestServer ts(IdleLimitedOptions(size_t{32} << 20));
  ASSERT_NE(ts.client, nullptr);
  const int64_t free0 = ts.client->Info()->pool().free_bytes();
  const int64_t tokens = 8192;  // 8 MiB of BF16 over both layers
  const KvData data = MakeKv(TinyLayout(), tokens, 3);
  auto put = ts.client->PutSequence("big", kTinyModel, TinyLayout(), tokens, data.k.data(),
                                    data.v.data());
  ASSERT_TRUE(put.ok()) << put.status();

  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  auto stub = v1::KvCache::NewStub(grpc::CreateCustomChannel(
      ts.server->address(), grpc::InsecureChannelCredentials(), args));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::GetKvRequest req;
  req.set_sequence_id("big");
  req.set_format(v1::KV_FORMAT_BF16);
  req.set_max_chunk_bytes(1 << 20);
  auto reader = stub->GetKv(&ctx, req);
  v1::GetKvResponse header;
  ASSERT_TRUE(reader->Read(&header));  // the server holds the sequence now
  ASSERT_TRUE(header.has_header());

  // Dropped while the stalled reader holds it: the memory stays until the
  // server lets go of the stream.
  ASSERT_TRUE(ts.client->Drop("big").ok());
  EXPECT_LT(ts.client->Info()->pool().free_bytes(), free0);
  EXPECT_EQ(WaitForFree(*ts.client, free0), free0);

  v1::GetKvResponse rest;
  while (reader->Read(&rest)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_THAT(Scrape(*ts.server),
              HasSubstr("oscarkv_rpc_duration_seconds_count{code=\"ABORTED\",method=\"GetKv\"} 1"));
}

// A negative limit, or one so large that comparing it with clock durations
// in nanoseconds would overflow (and end every stream at once), is refused.
TEST(IdleStream, NegativeOrHugeLimitIsRefusedAtStart) {
  for (const int64_t ms : {int64_t{-1}, kMaxStreamIdleTimeout.count() + 1,
                           std::numeric_limits<int64_t>::max()}) {
    ServerOptions o = TinyServerOptions();
    o.stream_idle_timeout = std::chrono::milliseconds(ms);
    ExpectStatus(OscarkvServer::Start(o, nullptr).status(), absl::StatusCode::kInvalidArgument,
                 "stream idle timeout must be in [0, 604800000] ms");
  }
}

}  // namespace
}  // namespace oscarkv::testing
