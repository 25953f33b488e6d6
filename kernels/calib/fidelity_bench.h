// The fidelity comparison behind `oscarkv bench-fidelity` and the ordering
// test: per layer, calibrate on one draw of synthetic tokens, then on other
// draws (held-out tokens, fresh needles) compare no rotation, Hadamard only,
// OSCAR, OSCAR with fitted clip ratios and the KᵀK/VᵀV ablation, each with and
// without sink/recent protection. Single-threaded; deterministic.
#ifndef OSCARKV_KERNELS_CALIB_FIDELITY_BENCH_H_
#define OSCARKV_KERNELS_CALIB_FIDELITY_BENCH_H_

#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/calib/calibrate.h"
#include "kernels/calib/fidelity.h"
#include "kernels/calib/synthetic.h"
#include "kernels/rotation.h"

namespace oscarkv {

struct FidelityBenchOptions {
  SyntheticSpec spec;      // distribution; tokens/num_queries/sample_seed are set per use
  int layers = 1;
  int calib_tokens = 1024;  // calibration draw (one query per token)
  int test_tokens = 2048;   // each held-out draw
  int test_queries = 16;    // decode queries per held-out draw (query 0 targets the needle)
  int trials = 4;           // held-out draws per layer
  CalibrationOptions calibration;
  FidelityOptions fidelity;  // `protect` is swept by the bench
  bool include_ablation = true;
  // Extra method evaluated as-is (e.g. a loaded calibration file); may be null.
  const ModelRotation* extra = nullptr;
  std::string extra_name = "file";
  std::function<void(const std::string&)> progress;  // optional, e.g. to stderr
};

struct FidelityRow {
  std::string method;  // "none", "hadamard", "oscar", "oscar+clip", "ablation-kkt", ...
  bool protect = false;
  double output_rel_error = 0;  // mean over layers × trials
  double logit_rmse = 0;
  double kl = 0;
  int needle_trials = 0, needle_hits = 0;
  double effective_bits = 0;
  float clip_k = 0, clip_v = 0;  // of the last layer
};

absl::StatusOr<std::vector<FidelityRow>> RunFidelityBench(const FidelityBenchOptions& options);

// The rows as an aligned text table with the output error ratio against the
// Hadamard row of the same protection setting.
std::string FormatFidelityTable(const std::vector<FidelityRow>& rows);

}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_CALIB_FIDELITY_BENCH_H_
