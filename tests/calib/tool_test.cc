// End-to-end runs of the `oscarkv` binary: activation dump -> calibration
// file -> loader, RotationZoo import, usage errors.
#include <sys/wait.h>

#include <cstdlib>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/calib/calibration_file.h"
#include "kernels/calib/safetensors.h"
#include "tests/temp_path.h"

namespace oscarkv {
namespace {

using ::testing::HasSubstr;

const std::string kTool = OSCARKV_TOOL_PATH;
const std::string kDir = OSCARKV_ROTATIONZOO_DIR;

// Runs the tool with `args`; returns the exit code, output in *out.
int RunTool(const std::string& args, std::string* out) {
  const std::string log = ::oscarkv::testing::UniqueTempPath("tool_out.txt");
  const int rc = std::system((kTool + " " + args + " > " + log + " 2>&1").c_str());
  auto text = ReadFileBytes(log);
  *out = text.ok() ? *text : "";
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

TEST(Tool, HelpListsCalibrationCommands) {
  std::string out;
  EXPECT_EQ(RunTool("--help", &out), 0);
  for (const char* c : {"calibrate", "import-rotationzoo", "bench-fidelity", "gen-synthetic"}) {
    EXPECT_THAT(out, HasSubstr(c));
  }
  EXPECT_EQ(RunTool("no-such-command", &out), 2);
  EXPECT_THAT(out, HasSubstr("unknown command"));
}

TEST(Tool, DumpToCalibrationFileTheLoaderAccepts) {
  const std::string dump = ::oscarkv::testing::UniqueTempPath("tool_dump.safetensors");
  const std::string calib = ::oscarkv::testing::UniqueTempPath("tool_calib.safetensors");
  std::string out;
  ASSERT_EQ(RunTool("gen-synthetic --out " + dump +
                    " --layers 2 --q-heads 8 --kv-heads 2 --head-dim 64 --tokens 256",
                &out),
            0)
      << out;
  ASSERT_EQ(RunTool("calibrate --dump " + dump + " --out " + calib + " --value-target exact --fit-clip",
                &out),
            0)
      << out;
  EXPECT_THAT(out, HasSubstr("layer 2/2"));
  EXPECT_THAT(out, HasSubstr("calibration summary"));
  ModelLayout layout{2, 8, 2, 64};
  auto rot = ReadCalibrationFile(calib, &layout);
  ASSERT_TRUE(rot.ok()) << rot.status();
  EXPECT_TRUE(rot->calibrated());
  EXPECT_EQ(rot->objective, "oscar:qqt/sst");
  EXPECT_EQ(RunTool("calibrate --dump " + dump + " --out " + calib + " --layout 2,8,4,64", &out), 2);
  EXPECT_THAT(out, HasSubstr("--layout says"));
  // Per-head mode and the data-free mode.
  ASSERT_EQ(RunTool("calibrate --dump " + dump + " --out " + calib + " --per-head", &out), 0) << out;
  rot = ReadCalibrationFile(calib, &layout);
  ASSERT_TRUE(rot.ok()) << rot.status();
  EXPECT_EQ(rot->layers[0].num_matrices, 2);
  ASSERT_EQ(RunTool("calibrate --hadamard --layout 4,8,2,64 --out " + calib, &out), 0) << out;
  rot = ReadCalibrationFile(calib);
  ASSERT_TRUE(rot.ok());
  EXPECT_FALSE(rot->calibrated());
}

TEST(Tool, BenchFidelityPrintsEveryMethodSideBySide) {
  std::string out;
  ASSERT_EQ(RunTool("bench-fidelity --layers 1 --q-heads 8 --kv-heads 2 --head-dim 64 "
                    "--calib-tokens 128 --tokens 256 --queries 4 --trials 1 --sink 16 --recent 32",
                    &out),
            0)
      << out;
  for (const char* m : {"none ", "hadamard ", "oscar ", "oscar+clip ", "ablation-kkt/vvt "}) {
    EXPECT_THAT(out, HasSubstr(m));
  }
  EXPECT_THAT(out, HasSubstr("vs_had"));
  EXPECT_EQ(RunTool("bench-fidelity --spec no_such_knob=1", &out), 2);
  EXPECT_THAT(out, HasSubstr("unknown synthetic knob"));
}

TEST(Tool, ImportRotationZooAndRefuseBadInput) {
  const std::string calib = ::oscarkv::testing::UniqueTempPath("tool_zoo.safetensors");
  const std::string k = kDir + "/k_rotation_qqt_r_h_pbr.pt", v = kDir + "/v_rotation_sst_r_h_pbr.pt";
  std::string out;
  ASSERT_EQ(RunTool("import-rotationzoo " + k + " " + v + " --layout qwen3-4b-thinking-2507 --out " + calib, &out), 0)
      << out;
  EXPECT_THAT(out, HasSubstr("imported 36 layers"));
  ModelLayout layout{36, 32, 8, 128};
  EXPECT_TRUE(ReadCalibrationFile(calib, &layout).ok());
  EXPECT_EQ(RunTool("import-rotationzoo " + k + " " + v + " --layout 36,32,8,64 --out " + calib, &out), 2);
  EXPECT_THAT(out, HasSubstr("layout"));
  EXPECT_EQ(RunTool("calibrate --dump /nonexistent.safetensors --out " + calib, &out), 1);
  EXPECT_THAT(out, HasSubstr("cannot open"));
  EXPECT_EQ(RunTool("calibrate --dump " + k + " --out " + calib, &out), 2);  // not safetensors
  EXPECT_EQ(RunTool("calibrate --bogus-flag", &out), 2);
  EXPECT_THAT(out, HasSubstr("unknown flag --bogus-flag"));
}

}  // namespace
}  // namespace oscarkv
