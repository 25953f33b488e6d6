#include "kernels/calib/activation_dump.h"

#include <cmath>
#include <cstring>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/calib/synthetic.h"
#include "kernels/numeric.h"
#include "tests/temp_path.h"

namespace oscarkv {
namespace {

using ::testing::HasSubstr;

ActivationDump SmallDump() {
  SyntheticSpec spec;
  spec.num_q_heads = 4;
  spec.num_kv_heads = 2;
  spec.head_dim = 64;
  spec.tokens = spec.num_queries = 24;
  ActivationDump dump;
  dump.layout = {2, 4, 2, 64};
  for (int i = 0; i < 2; ++i) {
    dump.layers.push_back(*ActivationsFromSynthetic(*GenerateSyntheticLayer(spec, i)));
  }
  return dump;
}

TEST(ActivationDump, RoundTripsInEveryDtype) {
  const ActivationDump dump = SmallDump();
  for (TensorDType dtype : {TensorDType::kF32, TensorDType::kF16, TensorDType::kBF16}) {
    auto f = ActivationDumpToSafetensors(dump, dtype);
    ASSERT_TRUE(f.ok()) << f.status();
    auto bytes = SerializeSafetensors(*f);
    ASSERT_TRUE(bytes.ok());
    auto parsed = ParseSafetensors(*bytes);
    ASSERT_TRUE(parsed.ok());
    auto back = ParseActivationDump(*parsed);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->layout, dump.layout);
    ASSERT_EQ(back->layers.size(), 2u);
    for (int i = 0; i < 2; ++i) {
      const auto& a = dump.layers[i];
      const auto& b = back->layers[i];
      ASSERT_EQ(a.q.size(), b.q.size());
      // K and V came from bf16, so bf16 and f32 keep them exactly; f16 rounds.
      const double tol = dtype == TensorDType::kF32 ? 0.0 : 1e-2;
      for (size_t e = 0; e < a.q.size(); ++e) {
        ASSERT_NEAR(a.q[e], b.q[e], tol * (1 + std::fabs(a.q[e]))) << e;
      }
      if (dtype != TensorDType::kF16) EXPECT_EQ(a.k, b.k);
    }
  }
}

TEST(ActivationDump, FileRoundTrip) {
  const std::string path = ::oscarkv::testing::UniqueTempPath("dump.safetensors");
  ASSERT_TRUE(WriteActivationDump(path, SmallDump(), TensorDType::kBF16).ok());
  auto back = ReadActivationDump(path);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->layers[1].tokens, 24);
}

SafetensorsFile DumpFile() { return *ActivationDumpToSafetensors(SmallDump(), TensorDType::kF32); }

std::string ParseError(const SafetensorsFile& f) {
  auto r = ParseActivationDump(f);
  EXPECT_FALSE(r.ok());
  return std::string(r.status().message());
}

TEST(ActivationDump, RejectsInconsistentShapes) {
  SafetensorsFile f = DumpFile();
  // k with a different token count than q.
  StoredTensor& k = f.tensors.at("layers.1.k");
  k.shape = {12, 2, 128};
  EXPECT_THAT(ParseError(f), HasSubstr("inconsistent shapes"));
  f = DumpFile();
  f.tensors.at("layers.0.v").shape = {24, 1, 128};
  EXPECT_THAT(ParseError(f), HasSubstr("inconsistent shapes"));
  f = DumpFile();
  f.tensors.at("layers.0.q").shape = {24, 256};
  EXPECT_THAT(ParseError(f), HasSubstr("[n, heads, D]"));
  f = DumpFile();
  f.tensors.at("layers.1.q").shape = {48, 2, 64};  // layer 1 has another layout
  EXPECT_THAT(ParseError(f), HasSubstr("inconsistent shapes"));
}

TEST(ActivationDump, RejectsLayoutMetadataMismatchGapsAndNaN) {
  SafetensorsFile f = DumpFile();
  f.metadata["num_kv_heads"] = "4";
  EXPECT_THAT(ParseError(f), HasSubstr("num_kv_heads"));
  f = DumpFile();
  f.tensors["layers.3.q"] = f.tensors.at("layers.0.q");
  EXPECT_THAT(ParseError(f), HasSubstr("without gaps"));
  f = DumpFile();
  f.tensors.erase("layers.1.v");
  EXPECT_THAT(ParseError(f), HasSubstr("missing tensor \"layers.1.v\""));
  f = DumpFile();
  const float nan = NAN;
  std::memcpy(&f.tensors.at("layers.1.k").bytes[40], &nan, 4);
  EXPECT_THAT(ParseError(f), HasSubstr("non-finite"));
  f = DumpFile();
  f.metadata["format"] = "oscarkv-calibration";
  EXPECT_THAT(ParseError(f), HasSubstr("expected \"oscarkv-activations\""));
}

}  // namespace
}  // namespace oscarkv
