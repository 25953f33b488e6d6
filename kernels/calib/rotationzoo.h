// Import of the OSCAR authors' published rotations (OSCAR-RotationZoo,
// DESIGN section 3): torch.save files holding
//   {format_version: 1, objective, source_grouping: "layer",
//    layers: {i: {layer_id: i, rotation: fp32[D, D], eigenvalues: fp32[D]}}}
// read without PyTorch (kernels/calib/torch_pickle.h). `rotation` is the full
// R = U·H·P_br applied as x · R; eigenvalues are in U's column order.
#ifndef OSCARKV_KERNELS_CALIB_ROTATIONZOO_H_
#define OSCARKV_KERNELS_CALIB_ROTATIONZOO_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/rotation.h"

namespace oscarkv {

struct RotationZooFile {
  std::string objective;
  std::string grouping;
  int dim = 0;
  std::vector<std::vector<float>> rotation;     // per layer, D×D row-major
  std::vector<std::vector<float>> eigenvalues;  // per layer, D
};

// Parses one file's bytes; checks the format version, the grouping, layer ids
// 0..L-1 without gaps, square power-of-two rotations, eigenvalue shapes.
absl::StatusOr<RotationZooFile> ParseRotationZoo(const std::string& bytes);

// Imports a key file and a value file for `layout` (which must match their
// layer count and head_dim), with the given clip ratios, and validates the
// result (orthogonality, finiteness). Errors name the file.
absl::StatusOr<ModelRotation> ImportRotationZoo(const std::string& key_path,
                                                const std::string& value_path,
                                                const ModelLayout& layout, float clip_k = 0.96f,
                                                float clip_v = 0.92f);

}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_CALIB_ROTATIONZOO_H_
