// The sharded client over three in-process servers: placement by rendezvous
// hashing, and every call reaching the owner.
#include <map>

#include "client/sharded_client.h"
#include "gmock/gmock.h"
#include "service_fixture.h"

namespace oscarkv::testing {
namespace {

TEST(Sharded, RendezvousMovesOnlyTheRemovedServersSequences) {
  const std::vector<std::string> four = {"a:1", "b:2", "c:3", "d:4"};
  const std::vector<std::string> three = {"a:1", "b:2", "d:4"};
  int moved = 0, owned_by_c = 0;
  std::map<int, int> counts;
  for (int i = 0; i < 2000; ++i) {
    const std::string id = "seq-" + std::to_string(i);
    const int before = RendezvousPick(four, id);
    const int after = RendezvousPick(three, id);
    ++counts[before];
    if (four[before] == "c:3") {
      ++owned_by_c;
    } else {
      moved += three[after] != four[before];
    }
  }
  EXPECT_EQ(moved, 0);
  for (const auto& [server, n] : counts) EXPECT_NEAR(n, 500, 100) << four[server];
  EXPECT_GT(owned_by_c, 0);
  EXPECT_EQ(RendezvousPick({}, "x"), -1);
}

TEST(Sharded, SequencesSpreadOverServersAndCallsReachTheOwner) {
  TestServer s0, s1, s2;
  ASSERT_TRUE(s0.client && s1.client && s2.client);
  const std::vector<std::string> targets = {s0.server->address(), s1.server->address(),
                                            s2.server->address()};
  ShardedClient sharded(targets);
  const ModelLayout layout = TinyLayout();
  const KvData data = MakeKv(layout, 50, 1);
  for (int i = 0; i < 24; ++i) {
    const std::string id = "s" + std::to_string(i);
    ASSERT_TRUE(sharded.PutSequence(id, kTinyModel, layout, 50, data.k.data(), data.v.data()).ok());
  }
  KvClient* direct[3] = {s0.client.get(), s1.client.get(), s2.client.get()};
  size_t total = 0;
  for (int s = 0; s < 3; ++s) {
    auto list = direct[s]->List();
    ASSERT_TRUE(list.ok());
    EXPECT_GT(list->size(), 0u) << "server " << s << " got nothing";
    for (const auto& info : *list) EXPECT_EQ(RendezvousPick(targets, info.sequence_id()), s);
    total += list->size();
  }
  EXPECT_EQ(total, 24u);
  EXPECT_EQ(sharded.List()->size(), 24u);

  // One Attend batch spanning all servers, answered in order.
  const std::vector<float> q = RandomQuery(layout, 2);
  std::vector<AttendQuery> batch;
  for (int i = 0; i < 24; ++i) batch.push_back(AttendQuery{"s" + std::to_string(i), i % 2, q.data()});
  auto out = sharded.Attend(batch, layout, true);
  ASSERT_TRUE(out.ok()) << out.status();
  for (int i = 0; i < 24; ++i) {
    ASSERT_TRUE((*out)[i].status.ok()) << (*out)[i].status;
    auto one = sharded.For(batch[i].sequence_id).Attend({batch[i]}, layout, true);
    ASSERT_TRUE(one.ok());
    EXPECT_EQ((*out)[i].out, (*one)[0].out) << batch[i].sequence_id;
  }
  ASSERT_TRUE(sharded.Append("s3", layout, -1, 50, 1, data.k.data(), data.v.data()).ok());
  EXPECT_EQ(sharded.Stat("s3")->tokens(), 51);
  EXPECT_TRUE(sharded.GetKv("s3", v1::KV_FORMAT_COMPRESSED).ok());
  for (int i = 0; i < 24; ++i) ASSERT_TRUE(sharded.Drop("s" + std::to_string(i)).ok());
  EXPECT_TRUE(sharded.List()->empty());
}

TEST(Sharded, AServerThatFailsFailsOnlyItsOwnItems) {
  TestServer live;
  ASSERT_NE(live.client, nullptr);
  const std::vector<std::string> targets = {live.server->address(), "127.0.0.1:1"};
  ClientOptions quick;
  quick.deadline = std::chrono::milliseconds(2000);
  ShardedClient sharded(targets, quick);
  // One id owned by each server.
  std::string on_live, on_dead;
  for (int i = 0; on_live.empty() || on_dead.empty(); ++i) {
    const std::string id = "p" + std::to_string(i);
    (RendezvousPick(targets, id) == 0 ? on_live : on_dead) = id;
  }
  const ModelLayout layout = TinyLayout();
  const KvData data = MakeKv(layout, 40, 3);
  ASSERT_TRUE(sharded.PutSequence(on_live, kTinyModel, layout, 40, data.k.data(), data.v.data()).ok());
  const std::vector<float> q = RandomQuery(layout, 5);
  auto out = sharded.Attend({AttendQuery{on_dead, 0, q.data()}, AttendQuery{on_live, 0, q.data()}},
                            layout, false);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ((*out)[0].status.code(), absl::StatusCode::kUnavailable) << (*out)[0].status;
  EXPECT_TRUE((*out)[1].status.ok()) << (*out)[1].status;
  EXPECT_EQ((*out)[1].tokens, 40);
}

}  // namespace
}  // namespace oscarkv::testing
