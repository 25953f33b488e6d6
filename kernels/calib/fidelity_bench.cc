#include "kernels/calib/fidelity_bench.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/hadamard.h"
#include "kernels/status_macros.h"

namespace oscarkv {

absl::StatusOr<std::vector<FidelityRow>> RunFidelityBench(const FidelityBenchOptions& o) {
  if (o.layers <= 0 || o.trials <= 0 || o.calib_tokens < 2 || o.test_tokens <= 0 ||
      o.test_queries <= 0) {
    return absl::InvalidArgumentError("fidelity bench: layers, trials, token and query counts must be positive");
  }
  const int d = o.spec.head_dim;
  if (o.extra != nullptr) {
    const ModelLayout& l = o.extra->layout;
    if (l.head_dim != d || l.num_kv_heads != o.spec.num_kv_heads ||
        l.num_q_heads != o.spec.num_q_heads || l.num_layers < o.layers) {
      return absl::InvalidArgumentError(absl::StrCat("fidelity bench: extra rotation layout ",
                                                     l.DebugString(), " does not fit the bench"));
    }
  }
  std::vector<std::string> names = {"none", "hadamard", "oscar", "oscar+clip"};
  if (o.include_ablation) names.push_back("ablation-kkt/vvt");
  if (o.extra != nullptr) names.push_back(o.extra_name);
  std::vector<FidelityRow> rows;
  for (int prot = 0; prot < 2; ++prot) {
    for (const auto& n : names) {
      FidelityRow r;
      r.method = n;
      r.protect = prot == 1;
      rows.push_back(r);
    }
  }
  const std::vector<double> h = HadamardMatrix(d);
  for (int layer = 0; layer < o.layers; ++layer) {
    SyntheticSpec cs = o.spec;
    cs.tokens = o.calib_tokens;
    cs.num_queries = o.calib_tokens;
    cs.sample_seed = 1000003;  // calibration draw; held-out draws use 1..trials
    OSCARKV_ASSIGN_OR_RETURN(SyntheticLayer cal, GenerateSyntheticLayer(cs, layer));
    OSCARKV_ASSIGN_OR_RETURN(LayerActivations acts, ActivationsFromSynthetic(cal));
    std::vector<LayerRotation> rots;
    rots.push_back(IdentityLayerRotation(d, o.calibration.clip_k, o.calibration.clip_v));
    LayerRotation had = rots[0];
    had.r_k.assign(h.begin(), h.end());
    had.r_v = had.r_k;
    rots.push_back(had);
    CalibrationOptions copt = o.calibration;
    copt.fit_clip = false;
    OSCARKV_ASSIGN_OR_RETURN(LayerRotation oscar, CalibrateLayer(acts, copt, nullptr));
    rots.push_back(oscar);
    copt.fit_clip = true;
    OSCARKV_ASSIGN_OR_RETURN(LayerRotation oscar_clip, CalibrateLayer(acts, copt, nullptr));
    rots.push_back(oscar_clip);
    if (o.include_ablation) {
      copt.fit_clip = false;
      copt.targets = TargetKind::kSelfCovariance;
      OSCARKV_ASSIGN_OR_RETURN(LayerRotation self, CalibrateLayer(acts, copt, nullptr));
      rots.push_back(self);
    }
    if (o.extra != nullptr) rots.push_back(o.extra->layers[layer]);
    for (int trial = 0; trial < o.trials; ++trial) {
      SyntheticSpec ts = o.spec;
      ts.tokens = o.test_tokens;
      ts.num_queries = o.test_queries;
      ts.sample_seed = uint64_t(trial) + 1;
      OSCARKV_ASSIGN_OR_RETURN(SyntheticLayer test, GenerateSyntheticLayer(ts, layer));
      std::vector<std::vector<float>> k_hat(rots.size()), v_hat(rots.size());
      for (size_t m = 0; m < rots.size(); ++m) {
        OSCARKV_RETURN_IF_ERROR(
            DequantizedCache(test, rots[m], o.fidelity.group_size, &k_hat[m], &v_hat[m]));
      }
      for (size_t i = 0; i < rows.size(); ++i) {
        FidelityOptions fo = o.fidelity;
        fo.protect = rows[i].protect;
        const size_t m_idx = i % names.size();
        const LayerRotation& rot = rots[m_idx];
        OSCARKV_ASSIGN_OR_RETURN(FidelityMetrics m,
                                 MeasureCacheFidelity(test, k_hat[m_idx], v_hat[m_idx], fo));
        FidelityRow& r = rows[i];
        r.output_rel_error += m.output_rel_error;
        r.logit_rmse += m.logit_rmse;
        r.kl += m.kl;
        r.needle_trials += m.needle_trials;
        r.needle_hits += m.needle_hits;
        r.effective_bits = m.effective_bits;
        r.clip_k = rot.clip_k;
        r.clip_v = rot.clip_v;
      }
      if (o.progress) {
        o.progress(absl::StrCat("layer ", layer + 1, "/", o.layers, " trial ", trial + 1, "/",
                                o.trials, " done"));
      }
    }
  }
  const double n = double(o.layers) * o.trials;
  for (auto& r : rows) {
    r.output_rel_error /= n;
    r.logit_rmse /= n;
    r.kl /= n;
  }
  return rows;
}

std::string FormatFidelityTable(const std::vector<FidelityRow>& rows) {
  std::string out = absl::StrFormat("%-18s %-8s %10s %8s %10s %10s %10s %6s %11s\n", "method",
                                    "protect", "out_err", "vs_had", "logit_rms", "KL",
                                    "needle", "bits", "clip_K/V");
  for (const auto& r : rows) {
    double had = 0;
    for (const auto& b : rows) {
      if (b.method == "hadamard" && b.protect == r.protect) had = b.output_rel_error;
    }
    out += absl::StrFormat("%-18s %-8s %10.4f %8.3f %10.4f %10.5f %4d/%-5d %6.2f %5.2f/%-5.2f\n",
                           r.method, r.protect ? "sink+rec" : "none", r.output_rel_error,
                           had > 0 ? r.output_rel_error / had : 0.0, r.logit_rmse, r.kl,
                           r.needle_hits, r.needle_trials, r.effective_bits, r.clip_k, r.clip_v);
  }
  return out;
}

}  // namespace oscarkv
