// LoadCalibration by path is confined to --calibration_dir: refused without
// it, and inside it refused for anything that resolves outside (`..`,
// symlinks), missing files and non-files, each with a status the client can
// act on. Content loading and --calibration at start are not limited.
#include <sys/stat.h>
#include <unistd.h>

#include <string>

#include "gmock/gmock.h"
#include "kernels/calib/calibration_file.h"
#include "server/service/calibration_path.h"
#include "service_fixture.h"
#include "tests/temp_path.h"

namespace oscarkv::testing {
namespace {

using ::testing::HasSubstr;

// A directory served as --calibration_dir, a calibration file inside it, and
// one next to it (outside).
class CalibrationDir : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = UniqueTempPath("calib_dir");
    outside_ = UniqueTempPath("outside.safetensors");
    ASSERT_EQ(mkdir(dir_.c_str(), 0755), 0) << dir_;
    ASSERT_EQ(mkdir((dir_ + "/sub").c_str(), 0755), 0);
    auto rot = HadamardRotation(TinyLayout(), 0.95f, 0.9f);
    ASSERT_TRUE(rot.ok()) << rot.status();
    ASSERT_TRUE(WriteCalibrationFile(dir_ + "/sub/tiny.safetensors", *rot).ok());
    ASSERT_TRUE(WriteCalibrationFile(outside_, *rot).ok());
  }
  void TearDown() override {
    unlink((dir_ + "/sub/tiny.safetensors").c_str());
    unlink((dir_ + "/escape.safetensors").c_str());
    rmdir((dir_ + "/sub").c_str());
    rmdir(dir_.c_str());
    unlink(outside_.c_str());
  }

  ServerOptions WithDir() const {
    ServerOptions o = TinyServerOptions();
    o.calibration_dir = dir_;
    return o;
  }
  static absl::Status Load(KvClient& client, const std::string& path) {
    v1::LoadCalibrationRequest req;
    req.set_model("tiny-file");
    req.set_path(path);
    return client.LoadCalibration(req).status();
  }
  std::string dir_, outside_;
};

TEST_F(CalibrationDir, PathIsPermissionDeniedWithoutTheFlagAndSaysHowToEnableIt) {
  TestServer ts;  // no calibration_dir
  ASSERT_NE(ts.client, nullptr);
  const absl::Status s = Load(*ts.client, dir_ + "/sub/tiny.safetensors");
  ExpectStatus(s, absl::StatusCode::kPermissionDenied, "--calibration_dir");
  EXPECT_THAT(std::string(s.message()), HasSubstr("content"));
  EXPECT_EQ(ts.client->ModelLayoutOf("tiny-file").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(CalibrationDir, FileInsideIsLoadedByRelativeAndAbsolutePath) {
  TestServer ts(WithDir());
  ASSERT_NE(ts.client, nullptr);
  v1::LoadCalibrationRequest req;
  req.set_model("tiny-file");
  req.set_path("sub/tiny.safetensors");
  auto model = ts.client->LoadCalibration(req);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(model->name(), "tiny-file");
  EXPECT_EQ(model->layout().num_kv_heads(), 2);
  req.set_path(dir_ + "/sub/../sub/tiny.safetensors");  // `..` that stays inside
  req.set_replace(true);
  EXPECT_TRUE(ts.client->LoadCalibration(req).ok());
}

TEST_F(CalibrationDir, DotDotEscapeIsPermissionDenied) {
  TestServer ts(WithDir());
  ASSERT_NE(ts.client, nullptr);
  const std::string name = outside_.substr(outside_.rfind('/') + 1);
  const std::string escape = "../" + name;
  ASSERT_EQ(access((dir_ + "/" + escape).c_str(), R_OK), 0) << "the escape target must exist";
  ExpectStatus(Load(*ts.client, escape), absl::StatusCode::kPermissionDenied,
               "resolves outside --calibration_dir");
  ExpectStatus(Load(*ts.client, outside_), absl::StatusCode::kPermissionDenied,
               "resolves outside --calibration_dir");
  // A missing file outside is refused the same way, not NOT_FOUND.
  ExpectStatus(Load(*ts.client, "../no-such-file.safetensors"), absl::StatusCode::kPermissionDenied,
               "outside --calibration_dir");
}

TEST_F(CalibrationDir, SymlinkLeadingOutsideIsPermissionDenied) {
  TestServer ts(WithDir());
  ASSERT_NE(ts.client, nullptr);
  ASSERT_EQ(symlink(outside_.c_str(), (dir_ + "/escape.safetensors").c_str()), 0);
  ExpectStatus(Load(*ts.client, "escape.safetensors"), absl::StatusCode::kPermissionDenied,
               "'escape.safetensors' resolves outside --calibration_dir");
  EXPECT_EQ(ts.client->ModelLayoutOf("tiny-file").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(CalibrationDir, MissingFileInsideIsNotFoundAndADirectoryIsInvalidArgument) {
  TestServer ts(WithDir());
  ASSERT_NE(ts.client, nullptr);
  ExpectStatus(Load(*ts.client, "sub/missing.safetensors"), absl::StatusCode::kNotFound,
               "'sub/missing.safetensors' not found in --calibration_dir");
  ExpectStatus(Load(*ts.client, "sub"), absl::StatusCode::kInvalidArgument, "not a regular file");
  ExpectStatus(Load(*ts.client, ""), absl::StatusCode::kInvalidArgument, "empty");
}

TEST_F(CalibrationDir, FileIsReadThroughOneCheckedDescriptorWithASizeLimit) {
  auto real_dir = RealCalibrationDir(dir_);
  ASSERT_TRUE(real_dir.ok()) << real_dir.status();
  struct stat st;
  ASSERT_EQ(stat((dir_ + "/sub/tiny.safetensors").c_str(), &st), 0);
  auto bytes = ReadCalibrationFile(*real_dir, "sub/tiny.safetensors", kMaxCalibrationFileBytes);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_EQ(bytes->size(), static_cast<size_t>(st.st_size));
  // A symlink inside that stays inside is followed.
  ASSERT_EQ(symlink((dir_ + "/sub/tiny.safetensors").c_str(), (dir_ + "/escape.safetensors").c_str()),
            0);
  auto linked = ReadCalibrationFile(*real_dir, "escape.safetensors", kMaxCalibrationFileBytes);
  ASSERT_TRUE(linked.ok()) << linked.status();
  EXPECT_EQ(*linked, *bytes);
  ExpectStatus(ReadCalibrationFile(*real_dir, "sub/tiny.safetensors", 16).status(),
               absl::StatusCode::kInvalidArgument, "at most 16 are read");
  ExpectStatus(ReadCalibrationFile("", "sub/tiny.safetensors", 16).status(),
               absl::StatusCode::kPermissionDenied, "--calibration_dir");
}

TEST_F(CalibrationDir, MissingDirectoryFailsStartNamingIt) {
  ServerOptions o = TinyServerOptions();
  o.calibration_dir = dir_ + "/no-such-dir";
  auto s = OscarkvServer::Start(o, nullptr, DefaultCalibrationReader());
  ASSERT_FALSE(s.ok());
  ExpectStatus(s.status(), absl::StatusCode::kInvalidArgument, "no-such-dir");
  o.calibration_dir = dir_ + "/sub/tiny.safetensors";
  ExpectStatus(OscarkvServer::Start(o, nullptr, DefaultCalibrationReader()).status(),
               absl::StatusCode::kInvalidArgument, "not a directory");
}

TEST_F(CalibrationDir, StartupCalibrationFlagReadsAnyPath) {
  ServerOptions o = TinyServerOptions();  // no calibration_dir
  o.calibrations = {"tiny=" + outside_};
  auto s = OscarkvServer::Start(o, nullptr, DefaultCalibrationReader());
  ASSERT_TRUE(s.ok()) << s.status();
  auto tiny = (*s)->models().Find("tiny");
  ASSERT_TRUE(tiny.ok());
  EXPECT_EQ((*tiny)->rotation.layers[0].clip_k, 0.95f);
}

}  // namespace
}  // namespace oscarkv::testing
