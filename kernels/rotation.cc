#include "kernels/rotation.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/hadamard.h"
#include "kernels/status_macros.h"

namespace oscarkv {

absl::StatusOr<ModelRotation> HadamardRotation(const ModelLayout& layout, float clip_k,
                                               float clip_v) {
  OSCARKV_RETURN_IF_ERROR(ValidateLayout(layout));
  OSCARKV_RETURN_IF_ERROR(ValidateClipRatio(clip_k, "key"));
  OSCARKV_RETURN_IF_ERROR(ValidateClipRatio(clip_v, "value"));
  const int d = layout.head_dim;
  std::vector<double> h = HadamardMatrix(d);
  std::vector<float> hf(h.begin(), h.end());
  ModelRotation rot;
  rot.layout = layout;
  rot.objective = "hadamard";
  rot.layers.resize(layout.num_layers);
  for (auto& l : rot.layers) {
    l.num_matrices = 1;
    l.r_k = hf;
    l.r_v = hf;
    l.clip_k = clip_k;
    l.clip_v = clip_v;
  }
  return rot;
}

absl::Status ValidateRotation(const ModelRotation& rot) {
  OSCARKV_RETURN_IF_ERROR(ValidateLayout(rot.layout));
  const int d = rot.layout.head_dim;
  if (static_cast<int>(rot.layers.size()) != rot.layout.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("rotation has ", rot.layers.size(),
                                                   " layers, layout says ",
                                                   rot.layout.num_layers));
  }
  const int want_m = rot.per_head ? rot.layout.num_kv_heads : 1;
  for (size_t li = 0; li < rot.layers.size(); ++li) {
    const LayerRotation& l = rot.layers[li];
    if (l.num_matrices != want_m) {
      return absl::InvalidArgumentError(absl::StrCat("layer ", li, ": ", l.num_matrices,
                                                     " matrices, expected ", want_m));
    }
    OSCARKV_RETURN_IF_ERROR(ValidateClipRatio(l.clip_k, "key"));
    OSCARKV_RETURN_IF_ERROR(ValidateClipRatio(l.clip_v, "value"));
    const size_t want = size_t(want_m) * d * d;
    for (int kind = 0; kind < 2; ++kind) {
      const std::vector<float>& r = kind == 0 ? l.r_k : l.r_v;
      const char* name = kind == 0 ? "R_K" : "R_V";
      if (r.size() != want) {
        return absl::InvalidArgumentError(absl::StrCat("layer ", li, " ", name, ": ", r.size(),
                                                       " values, expected ", want, " (",
                                                       want_m, "x", d, "x", d, ")"));
      }
      for (size_t i = 0; i < r.size(); ++i) {
        if (!std::isfinite(r[i])) {
          return absl::InvalidArgumentError(
              absl::StrCat("layer ", li, " ", name, ": non-finite value at index ", i));
        }
      }
      for (int m = 0; m < want_m; ++m) {
        const double err = OrthogonalityError(r.data() + size_t(m) * d * d, d);
        if (!(err < kOrthogonalityTolerance)) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "layer %d %s (matrix %d) is not orthogonal: max |R^T R - I| = %.3g > %.0e",
              li, name, m, err, kOrthogonalityTolerance));
        }
      }
      const std::vector<float>& e = kind == 0 ? l.eig_k : l.eig_v;
      if (!e.empty() && e.size() != size_t(want_m) * d) {
        return absl::InvalidArgumentError(absl::StrCat("layer ", li, " eigenvalues of ", name,
                                                       ": ", e.size(), " values, expected ",
                                                       size_t(want_m) * d));
      }
    }
  }
  return absl::OkStatus();
}

std::string RotationId(const ModelRotation& rot) {
  // FNV-1a over the layout, objective and all matrices and clip ratios.
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](const void* p, size_t n) {
    const unsigned char* b = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  };
  mix(&rot.layout, sizeof(rot.layout));
  mix(rot.objective.data(), rot.objective.size());
  for (const auto& l : rot.layers) {
    mix(l.r_k.data(), l.r_k.size() * 4);
    mix(l.r_v.data(), l.r_v.size() * 4);
    mix(&l.clip_k, 4);
    mix(&l.clip_v, 4);
  }
  return absl::StrFormat("%016x", h);
}

}  // namespace oscarkv
