// Faults: cancelled and killed ingest streams, a full pool under both
// policies, and many concurrent clients; pool accounting must come back exact.
#include <spawn.h>
#include <sys/wait.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "gmock/gmock.h"
#include "kernels/rotation.h"
#include "kernels/status_macros.h"
#include "server/store/sequence_store.h"
#include "service_fixture.h"

extern char** environ;

namespace oscarkv::testing {
namespace {

// The CPU backend, with a copy batch (Backend::BeginCopyBatch) whose issue
// fails on demand, as a GPU's driver call could.
class CopyBatchFailsBackend final : public CpuBackendWrapper {
 public:
  void BeginCopyBatch() override { ++batches; }
  absl::Status EndCopyBatch() override {
    return fail ? absl::InternalError("copy batch failed (test)") : absl::OkStatus();
  }

  bool fail = false;
  int batches = 0;
};

// A store of the test's own on `backend`: model "m" (tiny layout, Hadamard
// rotation) in a 4 MiB pool.
struct TinyStore {
  ModelRegistry models;
  std::unique_ptr<PagePool> pool;
  std::unique_ptr<SequenceStore> store;
};

absl::Status MakeTinyStore(Backend& backend, TinyStore* out) {
  OSCARKV_ASSIGN_OR_RETURN(ModelRotation rotation, HadamardRotation(TinyLayout()));
  OSCARKV_ASSIGN_OR_RETURN(auto entry,
                           MakeModelEntry("m", std::move(rotation), TinyTiers(), 0, backend));
  PoolOptions po;
  po.total_bytes = size_t(4) << 20;
  po.exact_fraction = 0.5;
  po.page_bytes = entry->geom.page_bytes();
  po.block_bytes = entry->geom.exact_block_bytes();
  OSCARKV_ASSIGN_OR_RETURN(out->pool, PagePool::Create(&backend, po));
  OSCARKV_RETURN_IF_ERROR(out->models.Register(entry, false));
  out->store = std::make_unique<SequenceStore>(&backend, out->pool.get(), &out->models,
                                               EvictionPolicy::kLru);
  return absl::OkStatus();
}

// Commits all of `data` as sequence `id` of model "m".
absl::Status IngestAll(SequenceStore& store, const std::string& id, const KvData& data) {
  OSCARKV_ASSIGN_OR_RETURN(auto ingest, store.BeginIngest(id, "m", false, 0));
  OSCARKV_RETURN_IF_ERROR(ingest->Append(-1, 0, data.tokens, data.k.data(), data.k.size() * 2,
                                         data.v.data(), data.v.size() * 2));
  return ingest->Commit().status();
}

// A decode step's fused appends whose row copies fail to reach the device:
// those items get the error and their sequences become unusable (a row they
// counted may be missing); items without an append are answered as usual.
TEST(Fault, FusedAppendsWhoseCopyBatchFailsLeaveTheirSequencesUnusable) {
  CopyBatchFailsBackend backend;
  const ModelLayout layout = TinyLayout();
  TinyStore tiny;
  const absl::Status made = MakeTinyStore(backend, &tiny);
  ASSERT_TRUE(made.ok()) << made;
  SequenceStore& store = *tiny.store;
  const KvData data = MakeKv(layout, 40, 3);
  for (const char* id : {"a", "b"}) ASSERT_TRUE(IngestAll(store, id, data).ok());
  auto ha = store.Acquire("a");
  auto hb = store.Acquire("b");
  ASSERT_TRUE(ha.ok() && hb.ok());
  const std::vector<float> q = RandomQuery(layout, 4);
  const size_t out_floats = size_t(layout.num_q_heads) * layout.head_dim;
  std::vector<float> out_a(out_floats), out_b(out_floats), want_b(out_floats);
  std::vector<SequenceStore::AttendTask> tasks(2);
  tasks[0].seq = &*ha;
  tasks[0].q = q.data();
  tasks[0].k = data.k_at(0, 0);  // a fused append of one token
  tasks[0].v = data.v_at(0, 0);
  tasks[0].out = out_a.data();
  tasks[1].seq = &*hb;
  tasks[1].q = q.data();
  tasks[1].out = out_b.data();
  backend.fail = true;
  store.AttendMany(tasks);
  EXPECT_EQ(backend.batches, 1);
  ExpectStatus(tasks[0].status, absl::StatusCode::kInternal, "copy batch failed");
  ASSERT_TRUE(tasks[1].status.ok()) << tasks[1].status;
  EXPECT_EQ(tasks[1].tokens, 40);
  backend.fail = false;
  int64_t n = 0;
  ExpectStatus(store.Attend(*ha, 0, q.data(), nullptr, nullptr, -1, out_a.data(), nullptr, &n),
               absl::StatusCode::kFailedPrecondition, "unusable after a backend error");
  ASSERT_TRUE(
      store.Attend(*hb, 0, q.data(), nullptr, nullptr, -1, want_b.data(), nullptr, &n).ok());
  EXPECT_EQ(out_b, want_b) << "the other item was answered as usual";
}

TEST(Fault, CancelledPutLeavesNoSequenceAndNoPages) {
  TestServer ts;
  ASSERT_NE(ts.client, nullptr);
  const int64_t free0 = ts.client->Info()->pool().free_bytes();
  const KvData data = MakeKv(TinyLayout(), 100, 1);
  auto stream = ts.client->OpenPut("c", kTinyModel, TinyLayout(), false, 0);
  ASSERT_TRUE(stream.ok());
  ASSERT_TRUE((*stream)->Write(0, 0, 100, data.k_at(0, 0), data.v_at(0, 0)).ok());
  ASSERT_TRUE((*stream)->Write(1, 0, 50, data.k_at(1, 0), data.v_at(1, 0)).ok());
  // Wait until the server holds the partial stream's pages, then cancel.
  WaitForFreeToChange(*ts.client, free0, std::chrono::seconds(1));
  EXPECT_LT(ts.client->Info()->pool().free_bytes(), free0);
  (*stream)->Cancel();
  EXPECT_EQ(WaitForFree(*ts.client, free0), free0);
  EXPECT_EQ(ts.client->Stat("c").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ts.server->store().Stats().ingesting, 0);
  // The id is free again.
  EXPECT_TRUE(ts.client->PutSequence("c", kTinyModel, TinyLayout(), 100, data.k.data(),
                                     data.v.data()).ok());
}

TEST(Fault, PutPastItsDeadlineLeavesNothing) {
  ClientOptions quick;
  quick.deadline = std::chrono::milliseconds(300);
  TestServer ts(TinyServerOptions(), quick);
  ASSERT_NE(ts.client, nullptr);
  const int64_t free0 = ts.client->Info()->pool().free_bytes();
  const KvData data = MakeKv(TinyLayout(), 64, 2);
  auto stream = ts.client->OpenPut("d", kTinyModel, TinyLayout(), false, 0);
  ASSERT_TRUE(stream.ok());
  ASSERT_TRUE((*stream)->Write(0, 0, 64, data.k_at(0, 0), data.v_at(0, 0)).ok());
  ASSERT_TRUE((*stream)->Write(1, 0, 64, data.k_at(1, 0), data.v_at(1, 0)).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(600));
  auto done = (*stream)->Finish();
  EXPECT_EQ(done.status().code(), absl::StatusCode::kDeadlineExceeded) << done.status();
  EXPECT_EQ(WaitForFree(*ts.client, free0), free0);
  EXPECT_EQ(ts.client->Stat("d").status().code(), absl::StatusCode::kNotFound);
}

TEST(Fault, KilledClientMidPutLeavesNoSequenceAndNoPages) {
  TestServer ts;
  ASSERT_NE(ts.client, nullptr);
  const int64_t free0 = ts.client->Info()->pool().free_bytes();
  const char* env_helper = std::getenv("OSCARKV_PUT_AND_DIE");  // bundles run elsewhere
  const std::string helper = env_helper ? env_helper : OSCARKV_PUT_AND_DIE;
  const std::string target = ts.server->address();
  char* argv[] = {const_cast<char*>(helper.c_str()), const_cast<char*>(target.c_str()),
                  const_cast<char*>("killed"), nullptr};
  pid_t pid = 0;
  ASSERT_EQ(posix_spawn(&pid, helper.c_str(), nullptr, nullptr, argv, environ), 0);
  int wstatus = 0;
  ASSERT_EQ(waitpid(pid, &wstatus, 0), pid);
  ASSERT_TRUE(WIFSIGNALED(wstatus) && WTERMSIG(wstatus) == SIGKILL) << "helper did not die mid-put";
  EXPECT_EQ(WaitForFree(*ts.client, free0), free0);
  EXPECT_EQ(ts.client->Stat("killed").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ts.server->store().Stats().ingesting, 0);
}

TEST(Fault, DropWhileReadingFreesWhenTheReaderFinishes) {
  TestServer ts;
  ASSERT_NE(ts.client, nullptr);
  const int64_t free0 = ts.client->Info()->pool().free_bytes();
  const KvData data = MakeKv(TinyLayout(), 100, 8);
  ASSERT_TRUE(ts.client->PutSequence("r", kTinyModel, TinyLayout(), 100, data.k.data(),
                                     data.v.data()).ok());
  const int64_t held = free0 - ts.client->Info()->pool().free_bytes();
  ASSERT_GT(held, 0);
  {
    auto reader = ts.server->store().Acquire("r");  // e.g. a GetKv in progress
    ASSERT_TRUE(reader.ok());
    auto freed = ts.client->Drop("r");
    ASSERT_TRUE(freed.ok());
    EXPECT_EQ(*freed, held);
    // Gone for new calls, but its memory stays until the reader is done.
    EXPECT_EQ(ts.client->Stat("r").status().code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(ts.client->Info()->pool().free_bytes(), free0 - held);
    CompressedLayer layer;
    EXPECT_TRUE(ts.server->store().ReadCompressed(*reader, 1, &layer).ok());
    EXPECT_EQ(layer.tokens, 100);
    // The id can be reused at once.
    EXPECT_TRUE(ts.client->PutSequence("r", kTinyModel, TinyLayout(), 100, data.k.data(),
                                       data.v.data()).ok());
    EXPECT_TRUE(ts.client->Drop("r").ok());
  }
  EXPECT_EQ(ts.client->Info()->pool().free_bytes(), free0);
  EXPECT_EQ(ts.server->store().Stats().committed.slot_bytes, 0);
}

// The CPU backend, whose Attend waits while the gate is closed.
class GatedAttendBackend final : public CpuBackendWrapper {
 public:
  absl::Status Attend(const AttendBatch& batch) override {
    {
      std::unique_lock<std::mutex> lock(mu_);
      ++waiting_;
      changed_.notify_all();
      changed_.wait(lock, [&] { return open_; });
      --waiting_;
    }
    return cpu_.Attend(batch);
  }
  void Close() { Set(false); }
  void Open() { Set(true); }
  // Whether an Attend reached the gate within `limit`.
  bool WaitForAnAttend(std::chrono::milliseconds limit) {
    std::unique_lock<std::mutex> lock(mu_);
    return changed_.wait_for(lock, limit, [&] { return waiting_ > 0; });
  }

 private:
  void Set(bool open) {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = open;
    changed_.notify_all();
  }
  std::mutex mu_;
  std::condition_variable changed_;
  bool open_ = true;
  int waiting_ = 0;
};

// Drop while the last reader is inside an Attend (holding the sequence's
// lock) and lets go right after it: whichever of the two frees the layers,
// Drop reports the bytes the sequence held. (Drop used to count them after
// taking the sequence out of the map and letting go of the store's lock; a
// reader that released in between had already freed them: 0 bytes.) The
// interleaving is up to the scheduler, so it is tried several times.
TEST(Fault, DropReportsTheBytesFreedWhenTheLastReaderReleasesMeanwhile) {
  GatedAttendBackend backend;
  const ModelLayout layout = TinyLayout();
  TinyStore tiny;
  const absl::Status made = MakeTinyStore(backend, &tiny);
  ASSERT_TRUE(made.ok()) << made;
  SequenceStore& store = *tiny.store;
  const KvData data = MakeKv(layout, 100, 12);
  const std::vector<float> q = RandomQuery(layout, 13);
  const int64_t free0 = store.Stats().pool_free_bytes;
  for (int round = 0; round < 10; ++round) {
    const std::string id = "d" + std::to_string(round);
    ASSERT_TRUE(IngestAll(store, id, data).ok());
    const int64_t held = free0 - store.Stats().pool_free_bytes;
    ASSERT_GT(held, 0);
    backend.Close();
    auto handle = store.Acquire(id);
    ASSERT_TRUE(handle.ok()) << handle.status();
    std::thread reader([&] {
      SequenceHandle h = std::move(*handle);
      std::vector<float> out(q.size());
      EXPECT_TRUE(store.Attend(h, 0, q.data(), nullptr, nullptr, -1, out.data(), nullptr,
                               nullptr).ok());
    });  // the handle is released right after the Attend
    // An Attend that fails before the backend never reaches the gate: fail
    // the test instead of waiting for it.
    if (!backend.WaitForAnAttend(std::chrono::seconds(10))) {
      backend.Open();
      reader.join();
      FAIL() << "no Attend reached the backend in round " << round;
    }
    absl::StatusOr<int64_t> freed;
    std::thread dropper([&] { freed = store.Drop(id); });
    // Time for Drop to reach the sequence's lock, which the Attend holds.
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    backend.Open();
    reader.join();
    dropper.join();
    ASSERT_TRUE(freed.ok()) << freed.status();
    EXPECT_EQ(*freed, held) << "round " << round;
    EXPECT_EQ(store.Stats().pool_free_bytes, free0);
    EXPECT_EQ(store.Stats().committed.slot_bytes, 0);
  }
}

// 28 exact blocks (a 100-token tiny sequence holds 8 and needs 17 at its
// ingest peak) and ~150 pages: two sequences fit, not three.
ServerOptions SmallPool(EvictionPolicy policy) {
  ServerOptions o = TinyServerOptions(224 << 10);
  o.eviction = policy;
  return o;
}

TEST(Fault, FullPoolEvictsLeastRecentlyUsedUnpinnedSequence) {
  OSCARKV_SKIP_UNLESS_8_TOKEN_PAGES();
  TestServer ts(SmallPool(EvictionPolicy::kLru));
  ASSERT_NE(ts.client, nullptr);
  const KvData data = MakeKv(TinyLayout(), 100, 3);
  auto put = [&](const std::string& id, bool pin) {
    return ts.client->PutSequence(id, kTinyModel, TinyLayout(), 100, data.k.data(),
                                  data.v.data(), pin);
  };
  ASSERT_TRUE(put("pinned", true).ok());
  ASSERT_TRUE(put("old", false).ok());
  auto third = put("new", false);
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_EQ(ts.client->Stat("old").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(ts.client->Stat("pinned").ok());
  EXPECT_EQ(ts.client->Info()->evictions(), 1);

  // A sequence in use (a handle held, as during a read) is never evicted:
  // with "new" held and "pinned" pinned, nothing can go.
  {
    auto held = ts.server->store().Acquire("new");
    ASSERT_TRUE(held.ok());
    auto refused = put("another", false);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
    EXPECT_THAT(std::string(refused.status().message()), ::testing::HasSubstr("pinned or in use"));
    EXPECT_TRUE(ts.client->Stat("new").ok());
  }
  EXPECT_TRUE(put("another", false).ok());
  EXPECT_EQ(ts.client->Info()->evictions(), 2);
  EXPECT_EQ(ts.client->Stat("new").status().code(), absl::StatusCode::kNotFound);
}

TEST(Fault, HopelessRequestEvictsNothing) {
  OSCARKV_SKIP_UNLESS_8_TOKEN_PAGES();
  TestServer ts(SmallPool(EvictionPolicy::kLru));
  ASSERT_NE(ts.client, nullptr);
  const KvData data = MakeKv(TinyLayout(), 100, 6);
  // Two pinned 100-token sequences (8 blocks each) and one idle 20-token one
  // (6 blocks) leave 6 of 28 blocks free; a 100-token ingest needs 17 at its
  // peak: even evicting "idle" (6 more) cannot make room.
  ASSERT_TRUE(ts.client->PutSequence("p1", kTinyModel, TinyLayout(), 100, data.k.data(),
                                     data.v.data(), true).ok());
  ASSERT_TRUE(ts.client->PutSequence("p2", kTinyModel, TinyLayout(), 100, data.k.data(),
                                     data.v.data(), true).ok());
  ASSERT_TRUE(PutFirstTokens(*ts.client, "idle", data, 20).ok());
  auto big = ts.client->PutSequence("big", kTinyModel, TinyLayout(), 100, data.k.data(),
                                    data.v.data());
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted) << big.status();
  EXPECT_THAT(std::string(big.status().message()), ::testing::HasSubstr("nothing was evicted"));
  EXPECT_TRUE(ts.client->Stat("idle").ok());
  EXPECT_EQ(ts.client->Info()->evictions(), 0);
}

TEST(Fault, FullPoolWithRefusePolicyIsResourceExhaustedAndChangesNothing) {
  OSCARKV_SKIP_UNLESS_8_TOKEN_PAGES();
  TestServer ts(SmallPool(EvictionPolicy::kRefuse));
  ASSERT_NE(ts.client, nullptr);
  const KvData data = MakeKv(TinyLayout(), 100, 4);
  ASSERT_TRUE(ts.client->PutSequence("a", kTinyModel, TinyLayout(), 100, data.k.data(), data.v.data()).ok());
  ASSERT_TRUE(ts.client->PutSequence("b", kTinyModel, TinyLayout(), 100, data.k.data(), data.v.data()).ok());
  const int64_t free_before = ts.client->Info()->pool().free_bytes();
  auto c = ts.client->PutSequence("c", kTinyModel, TinyLayout(), 100, data.k.data(), data.v.data());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted) << c.status();
  EXPECT_THAT(std::string(c.status().message()), ::testing::HasSubstr("eviction policy refuse"));
  EXPECT_EQ(WaitForFree(*ts.client, free_before), free_before);
  EXPECT_TRUE(ts.client->Stat("a").ok());
  EXPECT_TRUE(ts.client->Stat("b").ok());
  EXPECT_EQ(ts.client->Info()->evictions(), 0);
}

// LoadCalibration probes a new model with one page and one block from the
// pool. A request that is refused anyway (the name is taken, no replace)
// must be refused before that probe: on a full pool the probe would evict a
// stored sequence (lru) or answer RESOURCE_EXHAUSTED (refuse).
TEST(Fault, RefusedLoadCalibrationTakesNothingFromAFullPool) {
  OSCARKV_SKIP_UNLESS_8_TOKEN_PAGES();
  for (const EvictionPolicy policy : {EvictionPolicy::kRefuse, EvictionPolicy::kLru}) {
    SCOPED_TRACE(policy == EvictionPolicy::kLru ? "lru" : "refuse");
    TestServer ts(SmallPool(policy));
    ASSERT_NE(ts.client, nullptr);
    // 8-token sequences (one exact block per layer) until the blocks run out.
    const KvData data = MakeKv(TinyLayout(), 8, 5);
    int stored = 0;
    for (; stored < 64; ++stored) {
      auto put = ts.client->PutSequence("s" + std::to_string(stored), kTinyModel, TinyLayout(), 8,
                                        data.k.data(), data.v.data());
      if (!put.ok()) {
        ASSERT_EQ(put.status().code(), absl::StatusCode::kResourceExhausted) << put.status();
        break;
      }
      if (ts.client->Info()->evictions() > 0) break;  // lru: the pool was full
    }
    ASSERT_GT(stored, 0);
    const int64_t evictions = ts.client->Info()->evictions();
    const int64_t sequences = ts.client->Info()->sequences();
    v1::LoadCalibrationRequest req = TinyHadamardRequest(kTinyModel, false);
    ExpectStatus(ts.client->LoadCalibration(req).status(), absl::StatusCode::kAlreadyExists,
                 "already registered");
    EXPECT_EQ(ts.client->Info()->evictions(), evictions);
    EXPECT_EQ(ts.client->Info()->sequences(), sequences);
  }
}

TEST(Fault, SixteenConcurrentClientsKeepExactAccounting) {
  TestServer ts(TinyServerOptions(size_t{16} << 20));
  ASSERT_NE(ts.client, nullptr);
  const int64_t free0 = ts.client->Info()->pool().free_bytes();
  const ModelLayout layout = TinyLayout();
  const KvData data = MakeKv(layout, 120, 5);
  const std::vector<float> q = RandomQuery(layout, 6);
  std::atomic<int> errors{0}, rounds{0};
  std::vector<std::string> messages(16);
  const auto stop_at = std::chrono::steady_clock::now() + std::chrono::milliseconds(1500);
  std::vector<std::thread> threads;
  for (int c = 0; c < 16; ++c) {
    threads.emplace_back([&, c] {
      auto client = KvClient::Create(ts.server->address());
      for (int i = 0; std::chrono::steady_clock::now() < stop_at; ++i) {
        const std::string id = "c" + std::to_string(c) + "-" + std::to_string(i);
        absl::Status s = client->PutSequence(id, kTinyModel, layout, 120, data.k.data(),
                                             data.v.data()).status();
        if (s.ok()) {
          auto r = client->Attend({AttendQuery{id, i % 2, q.data()}}, layout, true);
          s = r.ok() ? (*r)[0].status : r.status();
        }
        if (s.ok()) s = client->Append(id, layout, -1, 120, 1, data.k.data(), data.v.data()).status();
        if (s.ok()) s = client->GetKv(id, v1::KV_FORMAT_COMPRESSED).status();
        if (s.ok()) s = client->Drop(id).status();
        if (!s.ok()) {
          ++errors;
          messages[c] = s.ToString();
        }
        ++rounds;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(errors.load(), 0) << ::testing::PrintToString(messages);
  EXPECT_GT(rounds.load(), 16);
  auto info = ts.client->Info();
  EXPECT_EQ(info->sequences(), 0);
  // A dropped sequence's pages go back when the last server-side reader lets
  // go of it, which can be just after the client's last call returned (a
  // GetKv reactor finishing): wait for it rather than race it.
  EXPECT_EQ(WaitForFree(*ts.client, free0), free0);
  const StoreStats st = ts.server->store().Stats();
  EXPECT_EQ(st.committed.elements, 0);
  EXPECT_EQ(st.committed.slot_bytes, 0);
}

}  // namespace
}  // namespace oscarkv::testing
