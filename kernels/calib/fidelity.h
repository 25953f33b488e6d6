// Fidelity of the OSCAR codec on one layer of KV data: encode every history
// token with a given rotation through the real row codec (EncodeRow /
// DequantizeRow, kernels/quantize.h), un-rotate, and compare attention over
// the dequantized cache with attention over the BF16 cache, both in fp64.
// Pure functions; thread-safe.
#ifndef OSCARKV_KERNELS_CALIB_FIDELITY_H_
#define OSCARKV_KERNELS_CALIB_FIDELITY_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/calib/synthetic.h"
#include "kernels/rotation.h"

namespace oscarkv {

struct FidelityOptions {
  int group_size = 0;  // quantizer group G; 0 = D
  // Sink/recent protection: tokens [0, sink_tokens) and the last
  // recent_window tokens stay BF16. Off: every token is quantized.
  bool protect = true;
  int sink_tokens = 64;
  int recent_window = 256;
};

struct FidelityMetrics {
  double output_rel_error = 0;  // sqrt(Σ‖o − o_ref‖² / Σ‖o_ref‖²) over queries × q heads
  double logit_rmse = 0;        // RMS of the scaled-logit error q·(k^ − k)/sqrt(D), all tokens
  double kl = 0;                // mean KL(p_ref ‖ p) of attention weights over queries × heads
  int needle_trials = 0;        // q heads of the needle query whose BF16 top-1 is the needle
  int needle_hits = 0;          // ... that still attend to it most after quantization
  double effective_bits = 0;    // bits per K/V element of the whole cache
};

// Identity D×D (the "no rotation" baseline).
LayerRotation IdentityLayerRotation(int dim, float clip_k, float clip_v);

// The dequantized cache with every token quantized: K^, V^ fp32 [T][Hkv][D]
// in the original basis. `rotation` has 1 or num_kv_heads matrices.
absl::Status DequantizedCache(const SyntheticLayer& data, const LayerRotation& rotation,
                              int group_size, std::vector<float>* k_hat,
                              std::vector<float>* v_hat);

// Metrics of a dequantized cache from DequantizedCache; options.protect puts
// the exact BF16 rows back for the sink and recent tokens.
absl::StatusOr<FidelityMetrics> MeasureCacheFidelity(const SyntheticLayer& data,
                                                     const std::vector<float>& k_hat,
                                                     const std::vector<float>& v_hat,
                                                     const FidelityOptions& options);

// DequantizedCache + MeasureCacheFidelity.
absl::StatusOr<FidelityMetrics> MeasureFidelity(const SyntheticLayer& data,
                                                const LayerRotation& rotation,
                                                const FidelityOptions& options);

}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_CALIB_FIDELITY_H_
