#include "kernels/calib/rotationzoo.h"

#include "absl/strings/str_cat.h"
#include "kernels/calib/safetensors.h"
#include "kernels/calib/torch_pickle.h"
#include "kernels/hadamard.h"
#include "kernels/status_macros.h"

namespace oscarkv {
namespace {

absl::Status Bad(const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("RotationZoo file: ", what));
}

absl::StatusOr<RotationZooFile> Load(const std::string& path) {
  OSCARKV_ASSIGN_OR_RETURN(std::string bytes, ReadFileBytes(path));
  auto f = ParseRotationZoo(bytes);
  if (!f.ok()) return absl::InvalidArgumentError(absl::StrCat(path, ": ", f.status().message()));
  return f;
}

}  // namespace

absl::StatusOr<RotationZooFile> ParseRotationZoo(const std::string& bytes) {
  OSCARKV_ASSIGN_OR_RETURN(TorchArchive archive, ReadTorchArchive(bytes));
  const PyValue& root = *archive.root;
  if (root.kind != PyValue::Kind::kDict) return Bad("top level is not a dict");
  PyRef version = root.Get("format_version");
  if (!version || version->kind != PyValue::Kind::kInt || version->i != 1) {
    return Bad("format_version is not 1");
  }
  PyRef objective = root.Get("objective"), grouping = root.Get("source_grouping");
  if (!objective || objective->kind != PyValue::Kind::kString) return Bad("objective missing");
  if (!grouping || grouping->kind != PyValue::Kind::kString) return Bad("source_grouping missing");
  if (grouping->s != "layer") {
    return Bad(absl::StrCat("source_grouping \"", grouping->s, "\" is not supported (want \"layer\")"));
  }
  PyRef layers = root.Get("layers");
  if (!layers || layers->kind != PyValue::Kind::kDict || layers->entries.empty()) {
    return Bad("layers missing or empty");
  }
  RotationZooFile out;
  out.objective = objective->s;
  out.grouping = grouping->s;
  const int64_t n = int64_t(layers->entries.size());
  for (int64_t i = 0; i < n; ++i) {
    PyRef layer = layers->Get(i);
    if (!layer || layer->kind != PyValue::Kind::kDict) {
      return Bad(absl::StrCat("layer ", i, " missing (layer ids must be 0..", n - 1, ")"));
    }
    PyRef id = layer->Get("layer_id");
    if (id && (id->kind != PyValue::Kind::kInt || id->i != i)) {
      return Bad(absl::StrCat("layer ", i, " has layer_id ", id->i));
    }
    PyRef r = layer->Get("rotation"), e = layer->Get("eigenvalues");
    if (!r || r->kind != PyValue::Kind::kTensor) return Bad(absl::StrCat("layer ", i, ": no rotation tensor"));
    if (r->shape.size() != 2 || r->shape[0] != r->shape[1] || !IsPowerOfTwo(int(r->shape[0]))) {
      return Bad(absl::StrCat("layer ", i, ": rotation shape ", ShapeString(r->shape),
                              " is not [D, D] with D a power of two"));
    }
    const int d = int(r->shape[0]);
    if (out.dim == 0) out.dim = d;
    if (d != out.dim) return Bad(absl::StrCat("layer ", i, ": D ", d, " differs from layer 0 (", out.dim, ")"));
    auto rf = TensorFloats(archive, *r);
    if (!rf.ok()) return Bad(absl::StrCat("layer ", i, " rotation: ", rf.status().message()));
    out.rotation.push_back(std::move(*rf));
    std::vector<float> ev;
    if (e) {
      if (e->kind != PyValue::Kind::kTensor || e->shape != std::vector<int64_t>{d}) {
        return Bad(absl::StrCat("layer ", i, ": eigenvalues are not a [", d, "] tensor"));
      }
      auto ef = TensorFloats(archive, *e);
      if (!ef.ok()) return Bad(absl::StrCat("layer ", i, " eigenvalues: ", ef.status().message()));
      ev = std::move(*ef);
    }
    out.eigenvalues.push_back(std::move(ev));
  }
  return out;
}

absl::StatusOr<ModelRotation> ImportRotationZoo(const std::string& key_path,
                                                const std::string& value_path,
                                                const ModelLayout& layout, float clip_k,
                                                float clip_v) {
  OSCARKV_RETURN_IF_ERROR(ValidateLayout(layout));
  OSCARKV_ASSIGN_OR_RETURN(RotationZooFile k, Load(key_path));
  OSCARKV_ASSIGN_OR_RETURN(RotationZooFile v, Load(value_path));
  for (const auto* f : {&k, &v}) {
    const std::string& path = f == &k ? key_path : value_path;
    if (int(f->rotation.size()) != layout.num_layers || f->dim != layout.head_dim) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": has ", f->rotation.size(), " layers of ", f->dim, "x", f->dim,
          " rotations; layout ", layout.DebugString(), " needs ", layout.num_layers, " of ",
          layout.head_dim, "x", layout.head_dim));
    }
  }
  ModelRotation rot;
  rot.layout = layout;
  rot.objective = k.objective + "/" + v.objective;
  rot.per_head = false;
  rot.layers.resize(layout.num_layers);
  for (int i = 0; i < layout.num_layers; ++i) {
    LayerRotation& l = rot.layers[i];
    l.num_matrices = 1;
    l.r_k = k.rotation[i];
    l.r_v = v.rotation[i];
    l.eig_k = k.eigenvalues[i];
    l.eig_v = v.eigenvalues[i];
    l.clip_k = clip_k;
    l.clip_v = clip_v;
  }
  absl::Status valid = ValidateRotation(rot);
  if (!valid.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("RotationZoo import (", key_path, ", ",
                                                   value_path, "): ", valid.message()));
  }
  return rot;
}

}  // namespace oscarkv
