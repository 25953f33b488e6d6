// Temporary file names that cannot collide: ctest runs every discovered test
// as its own process, in parallel, so a fixed name in TempDir() races.
#ifndef OSCARKV_TESTS_TEMP_PATH_H_
#define OSCARKV_TESTS_TEMP_PATH_H_

#include <unistd.h>

#include <string>

#include "gtest/gtest.h"

namespace oscarkv::testing {

// TempDir()/<suite>.<test>.<pid>.<name>
inline std::string UniqueTempPath(const std::string& name) {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string tag = info != nullptr ? std::string(info->test_suite_name()) + "." + info->name()
                                    : std::string("global");
  for (char& c : tag) {
    if (c == '/') c = '_';  // parameterized names
  }
  return ::testing::TempDir() + "/" + tag + "." + std::to_string(getpid()) + "." + name;
}

}  // namespace oscarkv::testing

#endif  // OSCARKV_TESTS_TEMP_PATH_H_
