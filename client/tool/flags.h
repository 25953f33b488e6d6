// A tiny flag parser for subcommands: `--name=value`, `--name value`, bare
// `--switch`, and positional arguments. Unknown flags are usage errors.
#ifndef OSCARKV_CLIENT_TOOL_FLAGS_H_
#define OSCARKV_CLIENT_TOOL_FLAGS_H_

#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/layout.h"

namespace oscarkv::tool {

class Flags {
 public:
  // `valued`: flags that take a value; `switches`: boolean flags.
  Flags(std::set<std::string> valued, std::set<std::string> switches)
      : valued_(std::move(valued)), switches_(std::move(switches)) {}

  // Parses argv[1..argc) (argv[0] is the subcommand).
  absl::Status Parse(int argc, char** argv);

  bool Has(const std::string& name) const { return values_.count(name) > 0; }
  bool Switch(const std::string& name) const { return values_.count(name) > 0; }
  std::string String(const std::string& name, const std::string& def) const;
  absl::StatusOr<int> Int(const std::string& name, int def) const;
  absl::StatusOr<double> Double(const std::string& name, double def) const;
  const std::vector<std::string>& positional() const { return positional_; }

 private:
  std::set<std::string> valued_, switches_;
  std::map<std::string, std::string> values_;
  std::vector<std::string> positional_;
};

// "L,Hq,Hkv,D" (e.g. 36,32,8,128) or a preset: qwen3-8b, qwen3-4b-thinking-2507.
absl::StatusOr<ModelLayout> ParseLayout(const std::string& text);

}  // namespace oscarkv::tool

#endif  // OSCARKV_CLIENT_TOOL_FLAGS_H_
