// Calibrated rotations through the service: a calibration file (per-layer and
// per-head) registered with LoadCalibration, used for encoding, reported by
// GetServerInfo, shipped with GetKv, and matched by local attention and the
// fp64 reference. Also: all-layer PutKv chunks and the client's retry rule.
#include <cmath>
#include <random>
#include <thread>

#include "client/local_attention.h"
#include "gmock/gmock.h"
#include "kernels/calib/calibration_file.h"
#include "service_fixture.h"
#include "tests/temp_path.h"
#include "tests/unit/test_util.h"

namespace oscarkv::testing {
namespace {

ModelRotation RandomRotation(const ModelLayout& layout, bool per_head, uint64_t seed) {
  ModelRotation rot;
  rot.layout = layout;
  rot.objective = "oscar";
  rot.per_head = per_head;
  const int m = per_head ? layout.num_kv_heads : 1;
  for (int l = 0; l < layout.num_layers; ++l) {
    LayerRotation lr;
    lr.num_matrices = m;
    for (int i = 0; i < m; ++i) {
      const auto rk = RandomOrthogonal(layout.head_dim, seed + 100 * l + 2 * i);
      const auto rv = RandomOrthogonal(layout.head_dim, seed + 100 * l + 2 * i + 1);
      lr.r_k.insert(lr.r_k.end(), rk.begin(), rk.end());
      lr.r_v.insert(lr.r_v.end(), rv.begin(), rv.end());
    }
    lr.clip_k = 0.95f;
    lr.clip_v = 0.9f;
    rot.layers.push_back(std::move(lr));
  }
  return rot;
}

// Writes `rot` to a fresh file named after `file_name` in the test temp dir
// (the server's calibration_dir) and fills the LoadCalibration request of
// `model` for it.
void WriteCalibrationRequest(const ModelRotation& rot, const std::string& model,
                             const std::string& file_name, v1::LoadCalibrationRequest* req) {
  const std::string path = ::oscarkv::testing::UniqueTempPath(file_name);
  const absl::Status written = WriteCalibrationFile(path, rot);
  ASSERT_TRUE(written.ok()) << written;
  req->set_model(model);
  req->set_path(path);
}

class Calibrated : public ::testing::TestWithParam<bool> {};

TEST_P(Calibrated, LoadCalibrationEncodesWithTheFileAndAttendMatchesReference) {
  const bool per_head = GetParam();
  ServerOptions options = TinyServerOptions();
  options.calibration_dir = ::oscarkv::testing::TestTempDir();  // where UniqueTempPath writes
  TestServer ts(options);
  ASSERT_NE(ts.client, nullptr);
  const ModelLayout layout = TinyLayout();
  const ModelRotation rot = RandomRotation(layout, per_head, 42);
  v1::LoadCalibrationRequest req;
  ASSERT_NO_FATAL_FAILURE(WriteCalibrationRequest(
      rot, "tiny-oscar", per_head ? "svc_calib_head.safetensors" : "svc_calib_layer.safetensors",
      &req));
  auto model = ts.client->LoadCalibration(req);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_TRUE(model->calibrated());
  EXPECT_EQ(model->objective(), "oscar");
  EXPECT_EQ(model->rotation_id(), RotationId(rot));

  // Ingest with all-layer chunks ([L][n][Hkv][D] per message).
  const KvData data = MakeKv(layout, 120, 9);
  auto stream = ts.client->OpenPut("c", "tiny-oscar", layout, false, 120);
  ASSERT_TRUE(stream.ok());
  const size_t row = data.row();
  for (int t = 0; t < 120; t += 40) {
    std::vector<bf16_bits> k, v;
    for (int l = 0; l < 2; ++l) {
      k.insert(k.end(), data.k_at(l, t), data.k_at(l, t) + 40 * row);
      v.insert(v.end(), data.v_at(l, t), data.v_at(l, t) + 40 * row);
    }
    ASSERT_TRUE((*stream)->Write(-1, t, 40, k.data(), v.data()).ok());
  }
  auto put = (*stream)->Finish();
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->tokens, 120);

  auto fetched = ts.client->GetKv("c", v1::KV_FORMAT_COMPRESSED);
  ASSERT_TRUE(fetched.ok());
  EXPECT_EQ(fetched->info.rotation_id(), RotationId(rot));
  EXPECT_EQ(fetched->layers[1].num_matrices, per_head ? 2 : 1);
  EXPECT_EQ(fetched->layers[1].r_k, rot.layers[1].r_k);
  std::vector<double> kref, vref;
  DequantizedLayer(fetched->layers[1], layout, 64, TinyTiers().page_tokens, &kref, &vref);
  auto local = LocalAttention::Create(std::move(*fetched), 1);
  ASSERT_TRUE(local.ok()) << local.status();

  const std::vector<float> q = RandomQuery(layout, 3);
  auto remote = ts.client->Attend({AttendQuery{"c", 1, q.data()}}, layout, true);
  ASSERT_TRUE(remote.ok() && (*remote)[0].status.ok());
  std::vector<float> out(q.size()), lse(8);
  ASSERT_TRUE((*local)->Attend(1, q.data(), out.data(), lse.data()).ok());
  std::vector<double> lse_ref;
  const auto ref = ReferenceAttention(std::vector<double>(q.begin(), q.end()), kref, vref, 120, 8,
                                      2, 64, 1.0 / 8.0, &lse_ref);
  EXPECT_LT(MaxAbsDiff((*remote)[0].out, std::vector<double>(out.begin(), out.end())),
            BackendTolerance());
  EXPECT_LT(MaxAbsDiff((*remote)[0].out, ref), 1e-4);
  EXPECT_LT(MaxAbsDiff((*remote)[0].lse, lse_ref), 1e-4);

  // Replacing a model's rotation is refused while it has sequences.
  req.set_replace(true);
  EXPECT_EQ(ts.client->LoadCalibration(req).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(ts.client->Drop("c").ok());
  EXPECT_TRUE(ts.client->LoadCalibration(req).ok());
}

INSTANTIATE_TEST_SUITE_P(Grouping, Calibrated, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "PerHead" : "PerLayer"; });

// A calibration file whose objective says "hadamard" over other matrices:
// a client that fetched without the rotation must not rebuild the Hadamard
// rotation for it (its rotation_id is not the Hadamard one).
TEST(Calibration, AFileCalledHadamardIsNotAttendedWithTheRebuiltHadamard) {
  ServerOptions options = TinyServerOptions();
  options.calibration_dir = ::oscarkv::testing::TestTempDir();
  TestServer ts(options);
  ASSERT_NE(ts.client, nullptr);
  const ModelLayout layout = TinyLayout();
  ModelRotation rot = RandomRotation(layout, false, 7);
  rot.objective = "hadamard";
  v1::LoadCalibrationRequest req;
  ASSERT_NO_FATAL_FAILURE(
      WriteCalibrationRequest(rot, "tiny-fake-h", "svc_calib_fake_h.safetensors", &req));
  auto model = ts.client->LoadCalibration(req);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(model->objective(), "hadamard");
  const KvData data = MakeKv(layout, 60, 6);
  ASSERT_TRUE(ts.client->PutSequence("f", "tiny-fake-h", layout, data.tokens, data.k.data(),
                                     data.v.data()).ok());
  auto bare = ts.client->GetKv("f", v1::KV_FORMAT_COMPRESSED, {}, /*include_rotation=*/false);
  ASSERT_TRUE(bare.ok()) << bare.status();
  ExpectStatus(LocalAttention::Create(std::move(*bare), 1).status(),
               absl::StatusCode::kFailedPrecondition,
               "rotation_id '" + RotationId(rot) + "' is not the default Hadamard rotation");
  auto fetched = ts.client->GetKv("f", v1::KV_FORMAT_COMPRESSED);
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  auto local = LocalAttention::Create(std::move(*fetched), 1);
  ASSERT_TRUE(local.ok()) << local.status();
  const auto diff = LocalVsServerLayer1(*ts.client, **local, "f", layout, 5);
  ASSERT_TRUE(diff.ok()) << diff.status();
  EXPECT_LT(*diff, BackendTolerance());
}

TEST(Calibration, CorruptFileContentIsInvalidArgument) {
  TestServer ts;
  ASSERT_NE(ts.client, nullptr);
  v1::LoadCalibrationRequest req;
  req.set_model("bad");
  req.set_content("not a safetensors file");
  const auto s = ts.client->LoadCalibration(req).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
}

TEST(ClientRetry, UnavailableBeforeConnectingIsRetriedUntilTheServerComesUp) {
  // Reserve a port, then start the server on it only after the client began.
  int port = 0;
  {
    TestServer probe;
    ASSERT_NE(probe.server, nullptr);
    port = probe.server->port();
  }
  ClientOptions options;
  options.max_attempts = 8;
  options.backoff = std::chrono::milliseconds(100);  // 100+200+400+800 ms ...
  options.deadline = std::chrono::milliseconds(10000);  // for all the attempts together
  auto client = KvClient::Create("127.0.0.1:" + std::to_string(port), options);
  std::unique_ptr<TestServer> late;
  std::thread starter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(400));
    ServerOptions o = TinyServerOptions();
    o.listen_address = "127.0.0.1:" + std::to_string(port);
    late = std::make_unique<TestServer>(o);
  });
  auto info = client->Info();
  starter.join();
  ASSERT_NE(late->server, nullptr);
  EXPECT_TRUE(info.ok()) << info.status();

  // Nothing listening at all: UNAVAILABLE after the attempts, no hang.
  ClientOptions quick;
  quick.max_attempts = 2;
  quick.backoff = std::chrono::milliseconds(10);
  quick.deadline = std::chrono::milliseconds(300);
  auto dead = KvClient::Create("127.0.0.1:1", quick);
  EXPECT_EQ(dead->Info().status().code(), absl::StatusCode::kUnavailable);
  // Errors other than UNAVAILABLE are returned at once, not retried.
  EXPECT_EQ(late->client->Stat("none").status().code(), absl::StatusCode::kNotFound);
  // Mutating calls: only the connection is retried; the call itself is sent once.
  const absl::Status drop_dead = dead->Drop("x").status();
  EXPECT_EQ(drop_dead.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(drop_dead.message()), ::testing::HasSubstr("cannot connect"));
  EXPECT_EQ(client->Drop("none").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace oscarkv::testing
