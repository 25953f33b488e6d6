#include "client/tool/flags.h"

#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace oscarkv::tool {

absl::Status Flags::Parse(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) != 0 || a == "--") {
      positional_.push_back(a);
      continue;
    }
    std::string name = a.substr(2), value;
    const size_t eq = name.find('=');
    bool has_value = eq != std::string::npos;
    if (has_value) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    if (switches_.count(name)) {
      if (has_value) return absl::InvalidArgumentError(absl::StrCat("--", name, " takes no value"));
      values_[name] = "1";
    } else if (valued_.count(name)) {
      if (!has_value) {
        if (i + 1 >= argc) return absl::InvalidArgumentError(absl::StrCat("--", name, " needs a value"));
        value = argv[++i];
      }
      values_[name] = value;
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name));
    }
  }
  return absl::OkStatus();
}

std::string Flags::String(const std::string& name, const std::string& def) const {
  auto it = values_.find(name);
  return it == values_.end() ? def : it->second;
}

absl::StatusOr<int> Flags::Int(const std::string& name, int def) const {
  auto it = values_.find(name);
  if (it == values_.end()) return def;
  int v;
  if (!absl::SimpleAtoi(absl::string_view(it->second.data(), it->second.size()), &v)) {
    return absl::InvalidArgumentError(absl::StrCat("--", name, ": \"", it->second, "\" is not an integer"));
  }
  return v;
}

absl::StatusOr<double> Flags::Double(const std::string& name, double def) const {
  auto it = values_.find(name);
  if (it == values_.end()) return def;
  double v;
  if (!absl::SimpleAtod(absl::string_view(it->second.data(), it->second.size()), &v)) {
    return absl::InvalidArgumentError(absl::StrCat("--", name, ": \"", it->second, "\" is not a number"));
  }
  return v;
}

absl::StatusOr<ModelLayout> ParseLayout(const std::string& text) {
  ModelLayout l;
  if (text == "qwen3-8b" || text == "qwen3-4b-thinking-2507" || text == "qwen3-4b") {
    l = {36, 32, 8, 128};
  } else {
    std::vector<std::string> parts =
        absl::StrSplit(absl::string_view(text.data(), text.size()), ',');
    int v[4];
    if (parts.size() != 4) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--layout \"", text, "\": expected L,Hq,Hkv,D (e.g. 36,32,8,128) or a preset name"));
    }
    for (int i = 0; i < 4; ++i) {
      if (!absl::SimpleAtoi(absl::string_view(parts[i].data(), parts[i].size()), &v[i])) {
        return absl::InvalidArgumentError(absl::StrCat("--layout: \"", parts[i], "\" is not an integer"));
      }
    }
    l = {v[0], v[1], v[2], v[3]};
  }
  absl::Status s = ValidateLayout(l);
  if (!s.ok()) return s;
  return l;
}

}  // namespace oscarkv::tool
