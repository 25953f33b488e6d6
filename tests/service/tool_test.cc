// The `oscarkv` tool's service subcommands against an in-process server:
// outputs and exit codes a script relies on.
#include <algorithm>
#include <cstdlib>
#include <fstream>

#include "gmock/gmock.h"
#include "service_fixture.h"
#include "tests/temp_path.h"

namespace oscarkv::testing {
namespace {

using ::testing::HasSubstr;

struct ToolRun {
  int code;
  std::string out;
};

ToolRun Tool(const std::string& args) {
  const std::string path = ::oscarkv::testing::UniqueTempPath("svc_tool_out.txt");
  const std::string cmd = std::string(OSCARKV_TOOL) + " " + args + " > " + path + " 2>&1";
  const int rc = std::system(cmd.c_str());
  std::ifstream f(path);
  std::string out((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  return ToolRun{WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, out};
}

TEST(ServiceTool, ServiceCommandsWorkEndToEndWithScriptableExitCodes) {
  TestServer ts;
  ASSERT_NE(ts.client, nullptr);
  const std::string server = "--server=" + ts.server->address();
  const std::string dump = ::oscarkv::testing::UniqueTempPath("svc_tool_dump.safetensors");
  const std::string back = ::oscarkv::testing::UniqueTempPath("svc_tool_back.safetensors");
  ASSERT_EQ(Tool("gen-synthetic --out " + dump +
                 " --layers 2 --q-heads 8 --kv-heads 2 --head-dim 64 --tokens 100 --dtype bf16")
                .code,
            0);
  ToolRun r = Tool("put " + server + " --id t1 --model tiny " + dump);
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_THAT(r.out, HasSubstr("stored t1: 100 tokens x 2 layers"));
  EXPECT_EQ(Tool("put " + server + " --id t1 --model tiny " + dump).code, 4);
  EXPECT_EQ(Tool("put " + server + " --id t9 --model nope " + dump).code, 3);
  r = Tool("attend " + server + " --id t1 --layer 1 --verify");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_THAT(r.out, HasSubstr("max |diff| = 0"));
  r = Tool("get " + server + " --id t1 --format bf16 --out " + back);
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(Tool("put " + server + " --id t2 --model tiny " + back).code, 0);
  r = Tool("ls " + server);
  EXPECT_THAT(r.out, HasSubstr("t1\tmodel=tiny\ttokens=100"));
  EXPECT_THAT(r.out, HasSubstr("t2\tmodel=tiny\ttokens=100"));
  // get -> put keeps the BF16 tiers bit-exact: sink [0, 8) and recent [80, 100).
  auto a1 = ts.client->GetKv("t1", v1::KV_FORMAT_BF16);
  auto a2 = ts.client->GetKv("t2", v1::KV_FORMAT_BF16);
  ASSERT_TRUE(a1.ok() && a2.ok());
  const size_t row = 2 * 64;
  for (int l = 0; l < 2; ++l) {
    const auto& x = a1->layers[l].k;
    const auto& y = a2->layers[l].k;
    ASSERT_EQ(x.size(), 100 * row);
    ASSERT_EQ(y.size(), 100 * row);
    EXPECT_TRUE(std::equal(x.begin(), x.begin() + 8 * row, y.begin()));
    EXPECT_TRUE(std::equal(x.begin() + 80 * row, x.end(), y.begin() + 80 * row));
  }
  r = Tool("stat " + server + " --id nope");
  EXPECT_EQ(r.code, 3);
  EXPECT_THAT(r.out, HasSubstr("NOT_FOUND"));
  EXPECT_EQ(Tool("drop " + server + " --id t1").code, 0);
  EXPECT_EQ(Tool("drop " + server + " --id t1").code, 3);
  r = Tool("info " + server);
  EXPECT_EQ(r.code, 0);
  EXPECT_THAT(r.out, HasSubstr("model tiny: layers=2 q_heads=8 kv_heads=2 head_dim=64"));
  EXPECT_EQ(Tool("stat " + server).code, 2);  // missing --id
  EXPECT_EQ(Tool("info --server=127.0.0.1:1 --timeout=2").code, 6);
  // A timeout that is not a positive number is a usage error, not a 0 s deadline.
  EXPECT_EQ(Tool("info --server=127.0.0.1:1 --timeout=abc").code, 2);
  EXPECT_EQ(Tool("info --server=127.0.0.1:1 --timeout=0").code, 2);
}

}  // namespace
}  // namespace oscarkv::testing
