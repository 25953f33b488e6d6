#include "kernels/calib/calibration_file.h"

#include <cmath>
#include <cstring>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/calib/calibrate.h"
#include "kernels/calib/safetensors.h"
#include "kernels/calib/synthetic.h"
#include "kernels/rotation.h"
#include "tests/temp_path.h"

namespace oscarkv {
namespace {

using ::testing::HasSubstr;

std::string TempPath(const std::string& name) {
  return ::oscarkv::testing::UniqueTempPath(name);
}

// A calibrated 2-layer rotation (per layer or per head) from synthetic data.
ModelRotation Calibrated(bool per_head) {
  SyntheticSpec spec;
  spec.num_q_heads = 4;
  spec.num_kv_heads = 2;
  spec.head_dim = 64;
  spec.tokens = spec.num_queries = 128;
  ModelRotation rot;
  rot.layout = {2, 4, 2, 64};
  rot.objective = "oscar:qqt/logit-proxy";
  rot.per_head = per_head;
  CalibrationOptions opt;
  opt.per_head = per_head;
  for (int i = 0; i < 2; ++i) {
    auto acts = ActivationsFromSynthetic(*GenerateSyntheticLayer(spec, i));
    auto l = CalibrateLayer(*acts, opt, nullptr);
    EXPECT_TRUE(l.ok());
    rot.layers.push_back(*l);
  }
  rot.layers[1].clip_k = 0.9f;
  return rot;
}

void ExpectSameRotation(const ModelRotation& a, const ModelRotation& b) {
  EXPECT_EQ(a.layout, b.layout);
  EXPECT_EQ(a.objective, b.objective);
  EXPECT_EQ(a.per_head, b.per_head);
  ASSERT_EQ(a.layers.size(), b.layers.size());
  for (size_t i = 0; i < a.layers.size(); ++i) {
    EXPECT_EQ(a.layers[i].num_matrices, b.layers[i].num_matrices);
    EXPECT_EQ(a.layers[i].r_k, b.layers[i].r_k);
    EXPECT_EQ(a.layers[i].r_v, b.layers[i].r_v);
    EXPECT_EQ(a.layers[i].eig_k, b.layers[i].eig_k);
    EXPECT_EQ(a.layers[i].eig_v, b.layers[i].eig_v);
    EXPECT_EQ(a.layers[i].clip_k, b.layers[i].clip_k);
    EXPECT_EQ(a.layers[i].clip_v, b.layers[i].clip_v);
  }
  EXPECT_EQ(RotationId(a), RotationId(b));
}

TEST(CalibrationFile, RoundTripKeepsTensorsBitExact) {
  for (bool per_head : {false, true}) {
    const ModelRotation rot = Calibrated(per_head);
    const std::string path = TempPath(per_head ? "rt_head.safetensors" : "rt_layer.safetensors");
    ASSERT_TRUE(WriteCalibrationFile(path, rot).ok());
    auto back = ReadCalibrationFile(path, &rot.layout);
    ASSERT_TRUE(back.ok()) << back.status();
    ExpectSameRotation(rot, *back);
  }
}

TEST(CalibrationFile, DocumentedTensorNamesAndShapes) {
  auto f = CalibrationToSafetensors(Calibrated(true));
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(f->metadata.at("format"), "oscarkv-calibration");
  EXPECT_EQ(f->metadata.at("grouping"), "head");
  EXPECT_EQ(f->metadata.at("head_dim"), "64");
  EXPECT_EQ(f->tensors.at("layers.1.r_k").shape, (std::vector<int64_t>{2, 64, 64}));
  EXPECT_EQ(f->tensors.at("layers.0.eig_v").shape, (std::vector<int64_t>{2, 64}));
  EXPECT_EQ(f->tensors.at("clip_k").shape, (std::vector<int64_t>{2}));
  EXPECT_EQ(f->tensors.size(), 2u * 4 + 2);
}

TEST(CalibrationFile, HadamardRotationRoundTrips) {
  auto rot = HadamardRotation({3, 8, 2, 128});
  ASSERT_TRUE(rot.ok());
  const std::string path = TempPath("hadamard.safetensors");
  ASSERT_TRUE(WriteCalibrationFile(path, *rot).ok());
  auto back = ReadCalibrationFile(path);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_FALSE(back->calibrated());
  ExpectSameRotation(*rot, *back);
}

// Writes `f` (bypassing validation) and returns the load error.
std::string LoadError(const SafetensorsFile& f, const ModelLayout* expected = nullptr) {
  const std::string path = TempPath("bad.safetensors");
  auto bytes = SerializeSafetensors(f);
  EXPECT_TRUE(bytes.ok());
  EXPECT_TRUE(WriteFileBytes(path, *bytes).ok());
  auto r = ReadCalibrationFile(path, expected);
  EXPECT_FALSE(r.ok());
  return std::string(r.status().message());
}

void SetFloat(SafetensorsFile* f, const std::string& name, size_t index, float value) {
  std::memcpy(&f->tensors.at(name).bytes[index * 4], &value, 4);
}

TEST(CalibrationFile, RefusesNonOrthogonalRotation) {
  auto f = CalibrationToSafetensors(Calibrated(false));
  ASSERT_TRUE(f.ok());
  SetFloat(&*f, "layers.1.r_v", 5, 0.7f);
  EXPECT_THAT(LoadError(*f), HasSubstr("not orthogonal"));
}

TEST(CalibrationFile, RefusesNaN) {
  auto f = CalibrationToSafetensors(Calibrated(false));
  SetFloat(&*f, "layers.0.r_k", 3, NAN);
  EXPECT_THAT(LoadError(*f), HasSubstr("non-finite"));
  f = CalibrationToSafetensors(Calibrated(false));
  SetFloat(&*f, "layers.0.eig_k", 3, INFINITY);
  EXPECT_THAT(LoadError(*f), HasSubstr("eig_k has a non-finite"));
}

TEST(CalibrationFile, RefusesLayoutMismatchAndWrongShapes) {
  auto f = CalibrationToSafetensors(Calibrated(false));
  ModelLayout other{2, 8, 2, 64};
  EXPECT_THAT(LoadError(*f, &other), HasSubstr("expected"));
  f->tensors.at("layers.1.r_k").shape = {1, 32, 128};
  EXPECT_THAT(LoadError(*f), HasSubstr("layers.1.r_k"));
  f = CalibrationToSafetensors(Calibrated(false));
  f->tensors.erase("layers.0.r_v");
  EXPECT_THAT(LoadError(*f), HasSubstr("missing tensor \"layers.0.r_v\""));
  f = CalibrationToSafetensors(Calibrated(false));
  f->metadata["num_layers"] = "3";
  EXPECT_THAT(LoadError(*f), HasSubstr("clip_k"));
  f = CalibrationToSafetensors(Calibrated(false));
  f->metadata["format"] = "something-else";
  EXPECT_THAT(LoadError(*f), HasSubstr("not an oscarkv calibration file"));
  f = CalibrationToSafetensors(Calibrated(false));
  SetFloat(&*f, "clip_v", 0, 1.5f);
  EXPECT_FALSE(LoadError(*f).empty());
}

TEST(CalibrationFile, RefusesTruncatedAndGarbageFiles) {
  const std::string path = TempPath("trunc.safetensors");
  ASSERT_TRUE(WriteCalibrationFile(path, Calibrated(false)).ok());
  auto bytes = ReadFileBytes(path);
  ASSERT_TRUE(bytes.ok());
  ASSERT_TRUE(WriteFileBytes(path, bytes->substr(0, bytes->size() / 2)).ok());
  auto r = ReadCalibrationFile(path);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("outside"));
  std::string garbage(8, '\0');
  garbage[0] = 16;
  garbage += "{not json.......";
  ASSERT_TRUE(WriteFileBytes(path, garbage).ok());
  EXPECT_THAT(std::string(ReadCalibrationFile(path).status().message()), HasSubstr("JSON"));
  ASSERT_TRUE(WriteFileBytes(path, "abc").ok());
  EXPECT_THAT(std::string(ReadCalibrationFile(path).status().message()), HasSubstr("shorter"));
  EXPECT_EQ(ReadCalibrationFile(TempPath("does-not-exist")).status().code(),
            absl::StatusCode::kNotFound);
}

TEST(Safetensors, RejectsOverlappingAndMisSizedTensors) {
  SafetensorsFile f;
  const float x[4] = {1, 2, 3, 4};
  f.PutF32("a", {4}, x);
  auto bytes = SerializeSafetensors(f);
  ASSERT_TRUE(bytes.ok());
  auto back = ParseSafetensors(*bytes);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(ToFloats(back->tensors.at("a")), std::vector<float>({1, 2, 3, 4}));
  std::string hdr = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})";
  std::string raw(8, '\0');
  raw[0] = char(hdr.size());
  raw += hdr + std::string(16, '\0');
  EXPECT_THAT(std::string(ParseSafetensors(raw).status().message()), HasSubstr("overlap"));
  hdr = R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})";
  raw = std::string(8, '\0');
  raw[0] = char(hdr.size());
  raw += hdr + std::string(8, '\0');
  EXPECT_THAT(std::string(ParseSafetensors(raw).status().message()), HasSubstr("do not match shape"));
}

}  // namespace
}  // namespace oscarkv
