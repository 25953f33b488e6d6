// Activation dumps: the input of `oscarkv calibrate`. A safetensors file with
//
//   __metadata__: format "oscarkv-activations" (optional), num_layers,
//                 num_q_heads, num_kv_heads, head_dim (optional; checked
//                 against the shapes when present)
//   layers.{i}.q  [n_i, num_q_heads, D]   post-RoPE queries of layer i
//   layers.{i}.k  [n_i, num_kv_heads, D]  post-RoPE keys
//   layers.{i}.v  [n_i, num_kv_heads, D]  values
//
// dtype F32, F16 or BF16 (each tensor independently); row t of q, k and v is
// token position t of the calibration text (causal attention within a layer).
// Layers 0..L-1 must all be present; n_i may differ between layers.
#ifndef OSCARKV_KERNELS_CALIB_ACTIVATION_DUMP_H_
#define OSCARKV_KERNELS_CALIB_ACTIVATION_DUMP_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/calib/calibrate.h"
#include "kernels/calib/safetensors.h"
#include "kernels/layout.h"

namespace oscarkv {

inline constexpr char kActivationFormat[] = "oscarkv-activations";

struct ActivationDump {
  ModelLayout layout;
  std::vector<LayerActivations> layers;
};

// Reads and checks a dump (consistent shapes across q/k/v and layers, GQA
// divisibility, metadata agreement, finite values); errors name the tensor.
absl::StatusOr<ActivationDump> ParseActivationDump(const SafetensorsFile& file);
absl::StatusOr<ActivationDump> ReadActivationDump(const std::string& path);

// Writes a dump with tensors stored as `dtype` (F32, F16 or BF16).
absl::StatusOr<SafetensorsFile> ActivationDumpToSafetensors(const ActivationDump& dump,
                                                            TensorDType dtype);
absl::Status WriteActivationDump(const std::string& path, const ActivationDump& dump,
                                 TensorDType dtype);

}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_CALIB_ACTIVATION_DUMP_H_
