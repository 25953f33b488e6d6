#include "kernels/calib/rotationzoo.h"

#include <algorithm>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/calib/calibration_file.h"
#include "kernels/calib/safetensors.h"
#include "kernels/calib/synthetic.h"
#include "kernels/calib/torch_pickle.h"
#include "kernels/hadamard.h"
#include "tests/temp_path.h"

namespace oscarkv {
namespace {

using ::testing::HasSubstr;

const std::string kDir = OSCARKV_ROTATIONZOO_DIR;
const std::string kKeyFile = kDir + "/k_rotation_qqt_r_h_pbr.pt";
const std::string kValueFile = kDir + "/v_rotation_sst_r_h_pbr.pt";
const ModelLayout kQwen3_4B{36, 32, 8, 128};

// A byte string from a literal that may contain NULs.
template <size_t N>
std::string Bytes(const char (&s)[N]) {
  return std::string(s, N - 1);
}

TEST(RotationZoo, ImportsPublishedSampleAsOrthogonalRotations) {
  auto rot = ImportRotationZoo(kKeyFile, kValueFile, kQwen3_4B);
  ASSERT_TRUE(rot.ok()) << rot.status();
  EXPECT_EQ(rot->objective, "qqt_r_h_pbr/sst_r_h_pbr");
  ASSERT_EQ(rot->layers.size(), 36u);
  for (const auto& l : rot->layers) {
    ASSERT_EQ(l.r_k.size(), 128u * 128);
    EXPECT_LT(OrthogonalityError(l.r_k.data(), 128), 1e-5);
    EXPECT_LT(OrthogonalityError(l.r_v.data(), 128), 1e-5);
    ASSERT_EQ(l.eig_k.size(), 128u);
    EXPECT_TRUE(std::is_sorted(l.eig_k.begin(), l.eig_k.end()));  // stored ascending
    EXPECT_GT(l.eig_k.back(), 0.0f);
  }
  // Not a Hadamard matrix in disguise: calibrated rotations differ per layer.
  EXPECT_NE(rot->layers[0].r_k, rot->layers[1].r_k);
}

TEST(RotationZoo, ImportWritesACalibrationFileTheLoaderAccepts) {
  auto rot = ImportRotationZoo(kKeyFile, kValueFile, kQwen3_4B, 0.95f, 0.9f);
  ASSERT_TRUE(rot.ok());
  const std::string path = ::oscarkv::testing::UniqueTempPath("zoo.safetensors");
  ASSERT_TRUE(WriteCalibrationFile(path, *rot).ok());
  auto back = ReadCalibrationFile(path, &kQwen3_4B);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->layers[35].r_v, rot->layers[35].r_v);
  EXPECT_EQ(back->layers[0].clip_k, 0.95f);
  EXPECT_EQ(RotationId(*back), RotationId(*rot));
}

TEST(RotationZoo, RecoveredQueryBasisRecomposesToTheRotation) {
  auto bytes = ReadFileBytes(kKeyFile);
  ASSERT_TRUE(bytes.ok());
  auto zoo = ParseRotationZoo(*bytes);
  ASSERT_TRUE(zoo.ok()) << zoo.status();
  for (int layer : {0, 17, 35}) {
    auto u = QueryBasisFromRotation(zoo->rotation[layer], zoo->eigenvalues[layer], 128);
    ASSERT_TRUE(u.ok());
    std::vector<double> eig(zoo->eigenvalues[layer].begin(), zoo->eigenvalues[layer].end());
    auto r = ComposeRotation(*u, eig, 128);
    ASSERT_TRUE(r.ok());
    double worst = 0;
    for (size_t e = 0; e < r->size(); ++e) {
      worst = std::max(worst, std::fabs((*r)[e] - zoo->rotation[layer][e]));
    }
    EXPECT_LT(worst, 1e-6) << "layer " << layer;
    EXPECT_LT(OrthogonalityError(u->data(), 128), 1e-5);
  }
}

TEST(RotationZoo, RefusesTruncatedFile) {
  auto bytes = ReadFileBytes(kKeyFile);
  ASSERT_TRUE(bytes.ok());
  for (size_t keep : {size_t(10), size_t(5000), bytes->size() / 2, bytes->size() - 30}) {
    auto r = ParseRotationZoo(bytes->substr(0, keep));
    ASSERT_FALSE(r.ok()) << "kept " << keep;
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("zip archive")) << keep;
  }
}

TEST(RotationZoo, RefusesCorruptedFile) {
  auto bytes = ReadFileBytes(kKeyFile);
  ASSERT_TRUE(bytes.ok());
  std::string bad = *bytes;
  bad[200000] ^= 0x40;  // inside a tensor storage
  EXPECT_THAT(std::string(ParseRotationZoo(bad).status().message()), HasSubstr("CRC-32"));
  bad = *bytes;
  bad[300] ^= 0x01;  // inside the pickle
  EXPECT_THAT(std::string(ParseRotationZoo(bad).status().message()), HasSubstr("CRC-32"));
  // A corrupted file written to disk is refused by the importer, naming the file.
  const std::string path = ::oscarkv::testing::UniqueTempPath("corrupt_k.pt");
  ASSERT_TRUE(WriteFileBytes(path, bad).ok());
  auto r = ImportRotationZoo(path, kValueFile, kQwen3_4B);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("corrupt_k.pt"));
}

TEST(RotationZoo, RefusesLayoutThatDoesNotMatch) {
  auto r = ImportRotationZoo(kKeyFile, kValueFile, {32, 32, 8, 128});
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("36 layers"));
  r = ImportRotationZoo(kKeyFile, kValueFile, {36, 32, 8, 64});
  EXPECT_FALSE(r.ok());
}

TEST(TorchPickle, RefusesArbitraryGlobals) {
  // pickle.dumps(os.system) at protocol 2 style: GLOBAL 'posix system'.
  const std::string evil = Bytes("\x80\x02" "cposix\nsystem\n" "X\x02\0\0\0ls" "\x85" "R.");
  auto r = RestrictedUnpickle(evil);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("refusing global \"posix system\""));
}

TEST(TorchPickle, ParsesPlainDictAndRejectsTruncation) {
  // {'a': 1, 'b': 'x'} at protocol 2.
  const std::string p = Bytes("\x80\x02}q\0(X\x01\0\0\0aK\x01X\x01\0\0\0bX\x01\0\0\0xu.");
  auto r = RestrictedUnpickle(p);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_NE((*r)->Get("a"), nullptr);
  EXPECT_EQ((*r)->Get("a")->i, 1);
  EXPECT_EQ((*r)->Get("b")->s, "x");
  EXPECT_FALSE(RestrictedUnpickle(p.substr(0, p.size() - 1)).ok());
  EXPECT_FALSE(RestrictedUnpickle(p.substr(0, 12)).ok());
}

}  // namespace
}  // namespace oscarkv

namespace oscarkv {
namespace {

// Bad input must give an error, never a crash: every truncation and many random
// byte flips of the real pickle, and random flips of a whole archive.
TEST(TorchPickle, SurvivesTruncationAndRandomCorruption) {
  auto bytes = ReadFileBytes(kKeyFile);
  ASSERT_TRUE(bytes.ok());
  auto entries = ReadStoredZip(*bytes);
  ASSERT_TRUE(entries.ok());
  const std::string& pickle = entries->at("k_rotation_qqt_r_h_pbr/data.pkl");
  ASSERT_TRUE(RestrictedUnpickle(pickle).ok());
  for (size_t n = 0; n < pickle.size(); ++n) {
    EXPECT_FALSE(RestrictedUnpickle(pickle.substr(0, n)).ok()) << n;
  }
  SyntheticRng rng(1234);
  for (int trial = 0; trial < 3000; ++trial) {
    std::string p = pickle;
    const int flips = 1 + int(rng.Uniform() * 4);
    for (int f = 0; f < flips; ++f) p[size_t(rng.Uniform() * p.size())] = char(rng.Next() & 0xff);
    auto r = RestrictedUnpickle(p);  // ok or error; must not crash
    (void)r;
  }
  for (int trial = 0; trial < 50; ++trial) {
    std::string b = *bytes;
    b[size_t(rng.Uniform() * b.size())] ^= char(1 + (rng.Next() % 255));
    auto r = ParseRotationZoo(b);
    (void)r;
  }
}

}  // namespace
}  // namespace oscarkv
