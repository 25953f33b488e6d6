// The oscarkv calibration file: a safetensors file holding one model's
// rotations (DESIGN section 3). Layout (all tensors F32, little-endian):
//
//   __metadata__: format "oscarkv-calibration", version "1", objective,
//                 grouping ("layer" | "head"), num_layers, num_q_heads,
//                 num_kv_heads, head_dim (decimal strings), rotation_id
//   layers.{i}.r_k    [M, D, D]  key rotation(s) R_K, applied as x · R
//   layers.{i}.r_v    [M, D, D]  value rotation(s) R_V
//   layers.{i}.eig_k  [M, D]     eigenvalues of the key target, in U's column
//                                order (optional: absent when unknown)
//   layers.{i}.eig_v  [M, D]     eigenvalues of the value target (optional)
//   clip_k            [L]        key clip ratio per layer
//   clip_v            [L]        value clip ratio per layer
//
// with L = num_layers, M = 1 (grouping "layer") or num_kv_heads ("head").
// Loading validates everything (ValidateRotation: shapes, finiteness,
// ‖RᵀR − I‖max < 1e-4, clip ratios) and, when given, the expected layout.
#ifndef OSCARKV_KERNELS_CALIB_CALIBRATION_FILE_H_
#define OSCARKV_KERNELS_CALIB_CALIBRATION_FILE_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/calib/safetensors.h"
#include "kernels/rotation.h"

namespace oscarkv {

inline constexpr char kCalibrationFormat[] = "oscarkv-calibration";

// Validates `rotation` and converts it to the file layout.
absl::StatusOr<SafetensorsFile> CalibrationToSafetensors(const ModelRotation& rotation);
// Parses and validates; `expected` (optional) must equal the file's layout.
absl::StatusOr<ModelRotation> CalibrationFromSafetensors(const SafetensorsFile& file,
                                                         const ModelLayout* expected);

absl::Status WriteCalibrationFile(const std::string& path, const ModelRotation& rotation);
// Errors name the path and what is wrong (missing tensor, shape, NaN, not
// orthogonal, layout mismatch, truncated file).
absl::StatusOr<ModelRotation> ReadCalibrationFile(const std::string& path,
                                                  const ModelLayout* expected = nullptr);

}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_CALIB_CALIBRATION_FILE_H_
