// Temporary file names that cannot collide, in a directory that goes away
// with the test process: ctest runs every discovered test as its own process,
// in parallel, so a fixed name in TempDir() races, and files left in TempDir()
// pile up run after run.
#ifndef OSCARKV_TESTS_TEMP_PATH_H_
#define OSCARKV_TESTS_TEMP_PATH_H_

#include <unistd.h>

#include <filesystem>
#include <string>
#include <system_error>

#include "gtest/gtest.h"

namespace oscarkv::testing {

// TempDir()/oscarkv-test.<pid>: made on first use, removed with everything in
// it when this process exits normally (not by a child forked from it, which
// runs the same static destructors).
inline const std::string& TestTempDir() {
  struct Dir {
    pid_t owner = getpid();
    std::string path = ::testing::TempDir() + "/oscarkv-test." + std::to_string(owner);
    Dir() { std::filesystem::create_directories(path); }
    ~Dir() {
      if (getpid() != owner) return;
      std::error_code ignored;
      std::filesystem::remove_all(path, ignored);
    }
  };
  static const Dir dir;
  return dir.path;
}

// TestTempDir()/<suite>.<test>.<name>
inline std::string UniqueTempPath(const std::string& name) {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string tag = info != nullptr ? std::string(info->test_suite_name()) + "." + info->name()
                                    : std::string("global");
  for (char& c : tag) {
    if (c == '/') c = '_';  // parameterized names
  }
  return TestTempDir() + "/" + tag + "." + name;
}

}  // namespace oscarkv::testing

#endif  // OSCARKV_TESTS_TEMP_PATH_H_
