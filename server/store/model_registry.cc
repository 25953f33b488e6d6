#include "server/store/model_registry.h"

#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "kernels/status_macros.h"

namespace oscarkv {

absl::Status ModelEntry::CheckLayer(int layer) const {
  if (layer < 0 || layer >= layout.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " out of range [0, ", layout.num_layers, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const ModelEntry>> MakeModelEntry(const std::string& name,
                                                                 ModelRotation rotation,
                                                                 const TierConfig& tiers,
                                                                 int group_size, Backend& backend) {
  if (name.empty() || name.size() > 128) {
    return absl::InvalidArgumentError("model name must be 1..128 characters");
  }
  OSCARKV_RETURN_IF_ERROR(ValidateRotation(rotation));
  OSCARKV_RETURN_IF_ERROR(ValidateTiers(tiers));
  const ModelLayout& layout = rotation.layout;
  if (layout.gqa_group() > 64) {
    return absl::InvalidArgumentError(absl::StrCat("model ", name, ": ", layout.gqa_group(),
                                                   " query heads per kv head (at most 64)"));
  }
  auto entry = std::make_shared<ModelEntry>();
  entry->name = name;
  entry->layout = layout;
  entry->tiers = tiers;
  entry->group_size = group_size;
  OSCARKV_RETURN_IF_ERROR(ResolveGroupSize(layout.head_dim, &entry->group_size));
  entry->geom = MakeGeometry(layout, tiers, entry->group_size);
  entry->rotation_id = RotationId(rotation);

  const size_t dd = size_t(layout.head_dim) * layout.head_dim;
  size_t floats = 0;
  for (const LayerRotation& l : rotation.layers) floats += 2 * size_t(l.num_matrices) * dd;
  OSCARKV_ASSIGN_OR_RETURN(entry->device_rotation, backend.Allocate(floats * sizeof(float)));
  float* base = entry->device_rotation.as<float>();
  size_t off = 0;
  for (const LayerRotation& l : rotation.layers) {
    const size_t n = size_t(l.num_matrices) * dd;
    OSCARKV_RETURN_IF_ERROR(backend.CopyToDevice(base + off, l.r_k.data(), n * sizeof(float)));
    OSCARKV_RETURN_IF_ERROR(
        backend.CopyToDevice(base + off + n, l.r_v.data(), n * sizeof(float)));
    LayerCodec codec;
    codec.rotation.r_k = base + off;
    codec.rotation.r_v = base + off + n;
    codec.rotation.stride = l.num_matrices > 1 ? dd : 0;
    codec.clip_k = l.clip_k;
    codec.clip_v = l.clip_v;
    entry->codecs.push_back(codec);
    off += 2 * n;
  }
  entry->rotation = std::move(rotation);
  return std::shared_ptr<const ModelEntry>(std::move(entry));
}

absl::Status ModelRegistry::CheckRegistrableLocked(const std::string& name, bool replace) const {
  const bool registered = models_.count(name) != 0;
  if (registered && !replace) {
    return absl::AlreadyExistsError(
        absl::StrCat("model '", name, "' is already registered (set replace to swap it)"));
  }
  if (!registered && models_.size() >= static_cast<size_t>(max_models_)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot register model '", name, "': this server holds ", models_.size(),
        " models, its limit (--max_models ", max_models_,
        "); replace a registered model (replace) or restart the server with a higher "
        "--max_models"));
  }
  return absl::OkStatus();
}

absl::Status ModelRegistry::CheckRegistrable(const std::string& name, bool replace) const {
  std::lock_guard<std::mutex> lock(mu_);
  return CheckRegistrableLocked(name, replace);
}

absl::Status ModelRegistry::Register(std::shared_ptr<const ModelEntry> entry, bool replace) {
  std::lock_guard<std::mutex> lock(mu_);
  OSCARKV_RETURN_IF_ERROR(CheckRegistrableLocked(entry->name, replace));
  models_[entry->name] = std::move(entry);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const ModelEntry>> ModelRegistry::Find(
    const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = models_.find(name);
  if (it == models_.end()) {
    std::vector<std::string> names;
    for (const auto& [n, e] : models_) names.push_back(n);
    return absl::NotFoundError(absl::StrCat("unknown model '", name, "'; registered: ",
                                            names.empty() ? "none" : absl::StrJoin(names, ", ")));
  }
  return it->second;
}

std::vector<std::shared_ptr<const ModelEntry>> ModelRegistry::List() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::shared_ptr<const ModelEntry>> out;
  for (const auto& [n, e] : models_) out.push_back(e);
  return out;
}

absl::StatusOr<std::pair<std::string, ModelLayout>> ParseModelSpec(const std::string& spec) {
  std::vector<std::string> parts = absl::StrSplit(spec, ':');
  if (parts.size() != 5 || parts[0].empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model spec '", spec, "' must be name:layers:q_heads:kv_heads:head_dim"));
  }
  int v[4];
  for (int i = 0; i < 4; ++i) {
    if (!absl::SimpleAtoi(parts[i + 1], &v[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("model spec '", spec, "': '", parts[i + 1], "' is not an integer"));
    }
  }
  ModelLayout layout{v[0], v[1], v[2], v[3]};
  OSCARKV_RETURN_IF_ERROR(ValidateLayout(layout));
  return std::make_pair(parts[0], layout);
}

}  // namespace oscarkv
