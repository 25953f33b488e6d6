// The rotations a model's cache is encoded with (DESIGN sections 2 and 3).
//
// A ModelRotation is plain host data: it is produced by calibration, the
// RotationZoo importer or HadamardRotation(), read from / written to a
// calibration file (kernels/calib/), and uploaded to a backend by the store.
#ifndef OSCARKV_KERNELS_ROTATION_H_
#define OSCARKV_KERNELS_ROTATION_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/layout.h"

namespace oscarkv {

// Rotations of one layer. `num_matrices` is 1 (one rotation per layer) or
// num_kv_heads (per-head mode); matrix m of keys is r_k[m*D*D .. (m+1)*D*D),
// row-major, applied to a row vector as x · R.
struct LayerRotation {
  int num_matrices = 1;
  std::vector<float> r_k;
  std::vector<float> r_v;
  // [num_matrices][D], in U's column order (calibrate: descending; RotationZoo:
  // ascending, as the authors store them); empty if unknown.
  std::vector<float> eig_k;
  std::vector<float> eig_v;
  float clip_k = 0.96f;
  float clip_v = 0.92f;
};

struct ModelRotation {
  ModelLayout layout;
  // "hadamard" for the data-free default, "oscar" for calibrated, or the
  // objective string of an imported file (e.g. "qqt_r_h_pbr/sst_r_h_pbr").
  std::string objective;
  bool per_head = false;
  std::vector<LayerRotation> layers;  // num_layers entries

  bool calibrated() const { return objective != "hadamard"; }
};

// Tolerance on max |RᵀR − I| when loading a rotation.
inline constexpr double kOrthogonalityTolerance = 1e-4;

// The data-free default R = H (normalized Hadamard) for every layer and the
// given clip ratios. Fails on an invalid layout.
absl::StatusOr<ModelRotation> HadamardRotation(const ModelLayout& layout, float clip_k = 0.96f,
                                               float clip_v = 0.92f);

// Checks shapes against the layout, finiteness, clip ratios and orthogonality.
// The message names the layer, the tensor and what is wrong.
absl::Status ValidateRotation(const ModelRotation& rotation);

// A short stable identifier of the rotation contents (hex of a 64-bit hash),
// reported to clients so they can check they attend with the same matrices.
std::string RotationId(const ModelRotation& rotation);

}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_ROTATION_H_
