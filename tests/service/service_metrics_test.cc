// Metrics: after a known workload the counters and gauges equal what was done,
// and `promtool check metrics` accepts the exposition (skipped without promtool).
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "gmock/gmock.h"
#include "service_fixture.h"
#include "tests/temp_path.h"

namespace oscarkv::testing {
namespace {

// The value of the sample `series` (name plus labels sorted by name, exactly
// as exposed), or NaN when absent.
double Sample(const std::string& text, const std::string& series) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(series + " ", 0) == 0) return std::strtod(line.c_str() + series.size() + 1, nullptr);
  }
  return NAN;
}

TEST(Metrics, CountersAndGaugesEqualAKnownWorkload) {
  OSCARKV_SKIP_UNLESS_8_TOKEN_PAGES();
  TestServer ts;
  ASSERT_NE(ts.client, nullptr);
  const ModelLayout layout = TinyLayout();
  const KvData data = MakeKv(layout, 100, 1);
  ASSERT_TRUE(ts.client->PutSequence("a", kTinyModel, layout, 100, data.k.data(), data.v.data()).ok());
  ASSERT_TRUE(ts.client->PutSequence("b", kTinyModel, layout, 100, data.k.data(), data.v.data()).ok());
  const KvData one = MakeKv(layout, 1, 2);
  ASSERT_TRUE(ts.client->Append("b", layout, -1, 100, 1, one.k.data(), one.v.data()).ok());
  const std::vector<float> q = RandomQuery(layout, 3);
  auto r = ts.client->Attend({AttendQuery{"b", 0, q.data()}, AttendQuery{"b", 1, q.data()},
                              AttendQuery{"a", 1, q.data()}},
                             layout, true);
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE(ts.client->Drop("a").ok());
  EXPECT_FALSE(ts.client->Stat("a").ok());

  const std::string m = Scrape(*ts.server);
  const double row_bytes = 2 * 64 * 2;  // Hkv x D x BF16
  EXPECT_EQ(Sample(m, "oscarkv_ingest_bytes_total{kind=\"bf16_in\"}"),
            2 * (2 * 100 * row_bytes * 2) + 2 * 1 * row_bytes * 2);
  EXPECT_EQ(Sample(m, "oscarkv_sequences{state=\"committed\"}"), 1);
  EXPECT_EQ(Sample(m, "oscarkv_sequences{state=\"ingesting\"}"), 0);
  // "b" has 101 tokens per layer: sink 8, history 9 pages = 72, recent 21.
  EXPECT_EQ(Sample(m, "oscarkv_tokens{tier=\"sink\"}"), 2 * 8);
  EXPECT_EQ(Sample(m, "oscarkv_tokens{tier=\"history\"}"), 2 * 72);
  EXPECT_EQ(Sample(m, "oscarkv_tokens{tier=\"recent\"}"), 2 * 21);
  const double page_bytes = 2 * 2 * (8 * 16 + 8 * 4);  // heads x (K,V) x (codes + params)
  EXPECT_EQ(Sample(m, "oscarkv_memory_bytes{tier=\"history\"}"), 18 * page_bytes);
  EXPECT_EQ(Sample(m, "oscarkv_memory_bytes{tier=\"sink\"}"), 2 * 8 * row_bytes * 2);
  EXPECT_EQ(Sample(m, "oscarkv_memory_bytes{tier=\"recent\"}"), 2 * 21 * row_bytes * 2);
  const double elements = 2 * 101 * 2 * 128.0;
  const double bits = 8 * (18 * page_bytes + 2 * 29 * row_bytes * 2) / elements;
  EXPECT_NEAR(Sample(m, "oscarkv_stored_bytes_per_element"), bits / 8, 1e-9);
  EXPECT_NEAR(Sample(m, "oscarkv_compression_ratio"), 16 / bits, 1e-9);
  EXPECT_EQ(Sample(m, "oscarkv_demotions_total"), 2 * 18);
  EXPECT_EQ(Sample(m, "oscarkv_evictions_total"), 0);
  EXPECT_EQ(Sample(m, "oscarkv_rpc_duration_seconds_count{code=\"OK\",method=\"PutKv\"}"), 2);
  EXPECT_EQ(Sample(m, "oscarkv_rpc_duration_seconds_count{code=\"OK\",method=\"AppendKv\"}"), 1);
  EXPECT_EQ(Sample(m, "oscarkv_rpc_duration_seconds_count{code=\"OK\",method=\"Attend\"}"), 1);
  EXPECT_EQ(Sample(m, "oscarkv_rpc_duration_seconds_count{code=\"NOT_FOUND\",method=\"GetSequence\"}"), 1);
  EXPECT_EQ(Sample(m, "oscarkv_attention_compute_seconds_count"), 3);
  EXPECT_EQ(Sample(m, "oscarkv_model_calibrated{model=\"tiny\",objective=\"hadamard\"}"), 0);
  EXPECT_EQ(Sample(m, "oscarkv_memory_bytes{tier=\"free\"}"),
            double(ts.client->Info()->pool().free_bytes()));
}

TEST(Metrics, PromtoolAcceptsTheExposition) {
  if (std::system("command -v promtool > /dev/null 2>&1") != 0) {
    GTEST_SKIP() << "promtool not installed (Debian package prometheus)";
  }
  TestServer ts;
  ASSERT_NE(ts.client, nullptr);
  const KvData data = MakeKv(TinyLayout(), 50, 1);
  ASSERT_TRUE(ts.client->PutSequence("p", kTinyModel, TinyLayout(), 50, data.k.data(), data.v.data()).ok());
  EXPECT_FALSE(ts.client->Stat("nope").ok());
  const std::string path = ::oscarkv::testing::UniqueTempPath("svc_oscarkv_metrics.txt");
  {
    std::ofstream f(path);
    f << Scrape(*ts.server);
  }
  const std::string cmd = "promtool check metrics < " + path + " > " + path + ".out 2>&1";
  const int rc = std::system(cmd.c_str());
  std::ifstream report(path + ".out");
  std::string text((std::istreambuf_iterator<char>(report)), std::istreambuf_iterator<char>());
  EXPECT_EQ(rc, 0) << text;
}

}  // namespace
}  // namespace oscarkv::testing
