// OSCAR calibration (DESIGN section 3): from post-RoPE Q/K/V activations of a
// layer to its rotations R = U · H · P_br, U the eigenvectors of
//   keys:   the query covariance of each KV head's GQA group,
//   values: the attention-weighted value covariance, exact (Vᵀ Sᵀ S V with S
//           the causal softmax) or the logit-second-moment proxy,
// plus an optional clip-ratio fit. Pure functions over caller-owned data;
// thread-safe. Errors are InvalidArgument naming the offending tensor/shape.
#ifndef OSCARKV_KERNELS_CALIB_CALIBRATE_H_
#define OSCARKV_KERNELS_CALIB_CALIBRATE_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/calib/synthetic.h"
#include "kernels/layout.h"
#include "kernels/rotation.h"

namespace oscarkv {

// One layer of activations in fp32; rows are token positions 0..tokens-1
// (row t of q is the query of token t, which attends keys 0..t causally).
struct LayerActivations {
  int tokens = 0;
  int num_q_heads = 0, num_kv_heads = 0, head_dim = 0;
  std::vector<float> q;  // [tokens][num_q_heads][D]
  std::vector<float> k;  // [tokens][num_kv_heads][D]
  std::vector<float> v;  // [tokens][num_kv_heads][D]
};

// Calibration activations from synthetic data generated with
// num_queries == tokens (query row t is token t's query). Fails otherwise.
absl::StatusOr<LayerActivations> ActivationsFromSynthetic(const SyntheticLayer& layer);

// Shapes of `acts` against the layout (q heads, kv heads, D) and finiteness.
absl::Status ValidateActivations(const LayerActivations& acts, const ModelLayout& layout);

enum class ValueTarget {
  kExactSoftmax,  // Vᵀ Sᵀ S V per query head, O(n² D); for n up to a few thousand
  kLogitProxy,    // Σ_t w_t v_tᵀ v_t / n, w_t = k_t C_K k_tᵀ normalized to mean 1
};

// "oscar" uses the attention targets; "self" is the DESIGN section 3 ablation
// (U from KᵀK and VᵀV).
enum class TargetKind { kAttention, kSelfCovariance };

struct CalibrationOptions {
  bool per_head = false;  // one rotation per KV head instead of per layer
  ValueTarget value_target = ValueTarget::kLogitProxy;
  TargetKind targets = TargetKind::kAttention;
  // Exact value target refuses more tokens than this (its cost is O(n²)).
  int max_exact_tokens = 8192;
  // Clip ratios: constants, or fitted per layer over `clip_grid`.
  float clip_k = 0.96f;
  float clip_v = 0.92f;
  bool fit_clip = false;
  std::vector<float> clip_grid = {0.80f, 0.84f, 0.88f, 0.90f, 0.92f, 0.94f,
                                  0.96f, 0.98f, 1.00f};
  int group_size = 0;  // quantizer group for the clip fit; 0 = D
};

// What calibration learned about one layer (for the summary).
struct LayerCalibrationReport {
  double top_eig_share_k = 0;  // largest eigenvalue / trace, averaged over matrices
  double top_eig_share_v = 0;
  float clip_k = 0, clip_v = 0;
  double clip_error_k = 0, clip_error_v = 0;  // fitted objective at the chosen ratios
};

// Symmetric covariance targets of one layer, fp64 D×D row-major, one per matrix.
struct LayerTargets {
  std::vector<std::vector<double>> key, value;
  std::vector<std::vector<double>> token_weight;  // per matrix: weight of each token (value fit)
};
absl::StatusOr<LayerTargets> ComputeTargets(const LayerActivations& acts,
                                            const CalibrationOptions& options);

// Eigendecomposition (fp64, Eigen) of a symmetric D×D target. U is row-major
// with column j the eigenvector of eigenvalues[j]; eigenvalues ascending (the
// order the reference and RotationZoo store them in).
struct Eigensystem {
  std::vector<double> u;
  std::vector<double> eigenvalues;
};
absl::StatusOr<Eigensystem> SymmetricEigen(const std::vector<double>& target, int dim);

// Calibrates one layer. Fills `report` when non-null.
absl::StatusOr<LayerRotation> CalibrateLayer(const LayerActivations& acts,
                                             const CalibrationOptions& options,
                                             LayerCalibrationReport* report);

// Mean over rows of the codec's reconstruction error for rows x_t (fp32, row t at
// x + t*row_stride, D values; rounded to bf16 first as the cache holds them),
// encoded with R (D×D) and `clip` by the real row codec: e_t M e_tᵀ with the
// metric M (D×D) when non-empty, else ‖e_t‖²; times the row weight w_t when
// `row_weight` is non-empty.
double WeightedCodecError(const float* x, int rows, size_t row_stride, int dim, const float* r,
                          float clip, int group_size, const std::vector<double>& metric,
                          const std::vector<double>& row_weight);

}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_CALIB_CALIBRATE_H_
