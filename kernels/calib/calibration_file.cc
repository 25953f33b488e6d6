#include "kernels/calib/calibration_file.h"

#include <cmath>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"

namespace oscarkv {
namespace {

absl::StatusOr<int> MetaInt(const SafetensorsFile& f, const std::string& key) {
  auto it = f.metadata.find(key);
  if (it == f.metadata.end()) {
    return absl::InvalidArgumentError(absl::StrCat("calibration file: metadata \"", key, "\" missing"));
  }
  int v = 0;
  if (!absl::SimpleAtoi(absl::string_view(it->second.data(), it->second.size()), &v)) {
    return absl::InvalidArgumentError(absl::StrCat("calibration file: metadata \"", key,
                                                   "\" is not an integer: \"", it->second, "\""));
  }
  return v;
}

absl::Status CheckFinite(const std::vector<float>& x, const std::string& name) {
  for (size_t i = 0; i < x.size(); ++i) {
    if (!std::isfinite(x[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("calibration file: ", name, " has a non-finite value at index ", i));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<SafetensorsFile> CalibrationToSafetensors(const ModelRotation& rot) {
  OSCARKV_RETURN_IF_ERROR(ValidateRotation(rot));
  const ModelLayout& l = rot.layout;
  const int64_t d = l.head_dim, m = rot.per_head ? l.num_kv_heads : 1;
  SafetensorsFile f;
  f.metadata = {{"format", kCalibrationFormat},
                {"version", "1"},
                {"objective", rot.objective},
                {"grouping", rot.per_head ? "head" : "layer"},
                {"num_layers", std::to_string(l.num_layers)},
                {"num_q_heads", std::to_string(l.num_q_heads)},
                {"num_kv_heads", std::to_string(l.num_kv_heads)},
                {"head_dim", std::to_string(l.head_dim)},
                {"rotation_id", RotationId(rot)}};
  std::vector<float> clip_k, clip_v;
  for (int i = 0; i < l.num_layers; ++i) {
    const LayerRotation& lr = rot.layers[i];
    const std::string p = absl::StrCat("layers.", i, ".");
    f.PutF32(p + "r_k", {m, d, d}, lr.r_k.data());
    f.PutF32(p + "r_v", {m, d, d}, lr.r_v.data());
    if (!lr.eig_k.empty()) f.PutF32(p + "eig_k", {m, d}, lr.eig_k.data());
    if (!lr.eig_v.empty()) f.PutF32(p + "eig_v", {m, d}, lr.eig_v.data());
    clip_k.push_back(lr.clip_k);
    clip_v.push_back(lr.clip_v);
  }
  f.PutF32("clip_k", {l.num_layers}, clip_k.data());
  f.PutF32("clip_v", {l.num_layers}, clip_v.data());
  return f;
}

absl::StatusOr<ModelRotation> CalibrationFromSafetensors(const SafetensorsFile& f,
                                                         const ModelLayout* expected) {
  auto fmt = f.metadata.find("format");
  if (fmt == f.metadata.end() || fmt->second != kCalibrationFormat) {
    return absl::InvalidArgumentError(
        absl::StrCat("not an oscarkv calibration file (metadata format is \"",
                     fmt == f.metadata.end() ? "" : fmt->second, "\", expected \"",
                     kCalibrationFormat, "\")"));
  }
  ModelRotation rot;
  OSCARKV_ASSIGN_OR_RETURN(rot.layout.num_layers, MetaInt(f, "num_layers"));
  OSCARKV_ASSIGN_OR_RETURN(rot.layout.num_q_heads, MetaInt(f, "num_q_heads"));
  OSCARKV_ASSIGN_OR_RETURN(rot.layout.num_kv_heads, MetaInt(f, "num_kv_heads"));
  OSCARKV_ASSIGN_OR_RETURN(rot.layout.head_dim, MetaInt(f, "head_dim"));
  OSCARKV_RETURN_IF_ERROR(ValidateLayout(rot.layout));
  if (expected != nullptr && !(*expected == rot.layout)) {
    return absl::InvalidArgumentError(absl::StrCat("calibration file is for layout ",
                                                   rot.layout.DebugString(), ", expected ",
                                                   expected->DebugString()));
  }
  auto obj = f.metadata.find("objective");
  rot.objective = obj == f.metadata.end() ? "" : obj->second;
  if (rot.objective.empty()) return absl::InvalidArgumentError("calibration file: objective missing");
  auto grouping = f.metadata.find("grouping");
  if (grouping == f.metadata.end() || (grouping->second != "layer" && grouping->second != "head")) {
    return absl::InvalidArgumentError("calibration file: grouping must be \"layer\" or \"head\"");
  }
  rot.per_head = grouping->second == "head";
  const ModelLayout& l = rot.layout;
  const int64_t d = l.head_dim, m = rot.per_head ? l.num_kv_heads : 1;
  OSCARKV_ASSIGN_OR_RETURN(std::vector<float> clip_k, f.GetFloats("clip_k", {l.num_layers}));
  OSCARKV_ASSIGN_OR_RETURN(std::vector<float> clip_v, f.GetFloats("clip_v", {l.num_layers}));
  rot.layers.resize(l.num_layers);
  for (int i = 0; i < l.num_layers; ++i) {
    LayerRotation& lr = rot.layers[i];
    const std::string p = absl::StrCat("layers.", i, ".");
    lr.num_matrices = int(m);
    OSCARKV_ASSIGN_OR_RETURN(lr.r_k, f.GetFloats(p + "r_k", {m, d, d}));
    OSCARKV_ASSIGN_OR_RETURN(lr.r_v, f.GetFloats(p + "r_v", {m, d, d}));
    if (f.tensors.count(p + "eig_k")) {
      OSCARKV_ASSIGN_OR_RETURN(lr.eig_k, f.GetFloats(p + "eig_k", {m, d}));
      OSCARKV_RETURN_IF_ERROR(CheckFinite(lr.eig_k, p + "eig_k"));
    }
    if (f.tensors.count(p + "eig_v")) {
      OSCARKV_ASSIGN_OR_RETURN(lr.eig_v, f.GetFloats(p + "eig_v", {m, d}));
      OSCARKV_RETURN_IF_ERROR(CheckFinite(lr.eig_v, p + "eig_v"));
    }
    lr.clip_k = clip_k[i];
    lr.clip_v = clip_v[i];
  }
  absl::Status valid = ValidateRotation(rot);
  if (!valid.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("calibration file: ", valid.message()));
  }
  return rot;
}

absl::Status WriteCalibrationFile(const std::string& path, const ModelRotation& rotation) {
  OSCARKV_ASSIGN_OR_RETURN(SafetensorsFile f, CalibrationToSafetensors(rotation));
  OSCARKV_ASSIGN_OR_RETURN(std::string bytes, SerializeSafetensors(f));
  return WriteFileBytes(path, bytes);
}

absl::StatusOr<ModelRotation> ReadCalibrationFile(const std::string& path,
                                                  const ModelLayout* expected) {
  OSCARKV_ASSIGN_OR_RETURN(std::string bytes, ReadFileBytes(path));
  auto f = ParseSafetensors(bytes);
  if (!f.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", f.status().message()));
  }
  auto rot = CalibrationFromSafetensors(*f, expected);
  if (!rot.ok()) {
    return absl::Status(rot.status().code(), absl::StrCat(path, ": ", rot.status().message()));
  }
  return rot;
}

}  // namespace oscarkv
