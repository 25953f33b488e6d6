#include "kernels/calib/fidelity.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include <Eigen/Dense>

#include "absl/strings/str_cat.h"
#include "kernels/layout.h"
#include "kernels/numeric.h"
#include "kernels/quantize.h"
#include "kernels/status_macros.h"

namespace oscarkv {
namespace {

using RowMatrixD = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using RowMatrixF = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

absl::Status CheckData(const SyntheticLayer& s) {
  const size_t kv = size_t(s.tokens) * s.num_kv_heads * s.head_dim;
  if (s.tokens <= 0 || s.num_kv_heads <= 0 || s.num_q_heads % s.num_kv_heads != 0 ||
      s.k.size() != kv || s.v.size() != kv ||
      s.q.size() != size_t(s.num_queries) * s.num_q_heads * s.head_dim) {
    return absl::InvalidArgumentError("fidelity: KV data shapes are inconsistent");
  }
  return absl::OkStatus();
}

// Scaled logits of one query head against one kv head's keys.
void Logits(const float* q, const float* k, int tokens, int stride, int d, double* out) {
  const double scale = 1.0 / std::sqrt(double(d));
  for (int t = 0; t < tokens; ++t) {
    const float* kt = k + size_t(t) * stride;
    double dot = 0;
    for (int j = 0; j < d; ++j) dot += double(q[j]) * kt[j];
    out[t] = dot * scale;
  }
}

void Softmax(const std::vector<double>& z, std::vector<double>* p) {
  const double mx = *std::max_element(z.begin(), z.end());
  double sum = 0;
  for (size_t t = 0; t < z.size(); ++t) sum += ((*p)[t] = std::exp(z[t] - mx));
  for (double& x : *p) x /= sum;
}

}  // namespace

LayerRotation IdentityLayerRotation(int dim, float clip_k, float clip_v) {
  LayerRotation l;
  l.num_matrices = 1;
  l.r_k.assign(size_t(dim) * dim, 0.0f);
  for (int i = 0; i < dim; ++i) l.r_k[size_t(i) * dim + i] = 1.0f;
  l.r_v = l.r_k;
  l.clip_k = clip_k;
  l.clip_v = clip_v;
  return l;
}

absl::Status DequantizedCache(const SyntheticLayer& s, const LayerRotation& rot,
                              int group_size, std::vector<float>* k_hat,
                              std::vector<float>* v_hat) {
  OSCARKV_RETURN_IF_ERROR(CheckData(s));
  const int d = s.head_dim, hkv = s.num_kv_heads, T = s.tokens;
  int group = group_size;
  OSCARKV_RETURN_IF_ERROR(ResolveGroupSize(d, &group));
  if (rot.num_matrices != 1 && rot.num_matrices != hkv) {
    return absl::InvalidArgumentError(absl::StrCat("fidelity: rotation has ", rot.num_matrices,
                                                   " matrices for ", hkv, " kv heads"));
  }
  const size_t want = size_t(rot.num_matrices) * d * d;
  if (rot.r_k.size() != want || rot.r_v.size() != want) {
    return absl::InvalidArgumentError("fidelity: rotation size does not match head_dim");
  }
  k_hat->resize(s.k.size());
  v_hat->resize(s.v.size());
  std::vector<float> y(size_t(T) * d), scratch(2 * d);
  std::vector<uint8_t> codes(d / 4);
  std::vector<QuantParams> params(d / group);
  for (int kind = 0; kind < 2; ++kind) {
    const std::vector<uint16_t>& x = kind == 0 ? s.k : s.v;
    std::vector<float>& out = kind == 0 ? *k_hat : *v_hat;
    const float clip = kind == 0 ? rot.clip_k : rot.clip_v;
    for (int h = 0; h < hkv; ++h) {
      const int m = rot.num_matrices == 1 ? 0 : h;
      const float* r = (kind == 0 ? rot.r_k : rot.r_v).data() + size_t(m) * d * d;
      for (int t = 0; t < T; ++t) {
        const uint16_t* row = &x[(size_t(t) * hkv + h) * d];
        EncodeRow(row, r, d, group, clip, codes.data(), params.data(), scratch.data());
        DequantizeRow(codes.data(), params.data(), d, group, &y[size_t(t) * d]);
      }
      // x^ = y^ · Rᵀ for all tokens of this head at once.
      const Eigen::Map<const RowMatrixF> rm(r, d, d);
      const Eigen::Map<const RowMatrixF> ym(y.data(), T, d);
      const RowMatrixF xh = ym * rm.transpose();
      for (int t = 0; t < T; ++t) std::copy_n(xh.row(t).data(), d, &out[(size_t(t) * hkv + h) * d]);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<FidelityMetrics> MeasureFidelity(const SyntheticLayer& s,
                                                const LayerRotation& rot,
                                                const FidelityOptions& opt) {
  std::vector<float> k_hat, v_hat;
  OSCARKV_RETURN_IF_ERROR(DequantizedCache(s, rot, opt.group_size, &k_hat, &v_hat));
  return MeasureCacheFidelity(s, k_hat, v_hat, opt);
}

absl::StatusOr<FidelityMetrics> MeasureCacheFidelity(const SyntheticLayer& s,
                                                     const std::vector<float>& k_quant,
                                                     const std::vector<float>& v_quant,
                                                     const FidelityOptions& opt) {
  OSCARKV_RETURN_IF_ERROR(CheckData(s));
  if (k_quant.size() != s.k.size() || v_quant.size() != s.v.size()) {
    return absl::InvalidArgumentError("fidelity: dequantized cache size does not match the data");
  }
  const int d = s.head_dim, hkv = s.num_kv_heads, hq = s.num_q_heads, T = s.tokens;
  const int g = hq / hkv;
  std::vector<float> k_ref(s.k.size()), v_ref(s.v.size());
  for (size_t i = 0; i < s.k.size(); ++i) k_ref[i] = Bf16ToFloat(s.k[i]);
  for (size_t i = 0; i < s.v.size(); ++i) v_ref[i] = Bf16ToFloat(s.v[i]);
  std::vector<float> k_hat = k_quant, v_hat = v_quant;
  if (opt.protect) {
    const size_t row = size_t(hkv) * d;
    for (int t = 0; t < T; ++t) {
      if (t < opt.sink_tokens || t >= T - opt.recent_window) {
        std::copy_n(&k_ref[t * row], row, &k_hat[t * row]);
        std::copy_n(&v_ref[t * row], row, &v_hat[t * row]);
      }
    }
  }
  FidelityMetrics fm;
  double err2 = 0, ref2 = 0, logit2 = 0, kl = 0;
  std::vector<double> z_ref(T), z(T), p_ref(T), p(T);
  for (int r = 0; r < s.num_queries; ++r) {
    for (int i = 0; i < hq; ++i) {
      const int h = i / g;
      const float* q = &s.q[(size_t(r) * hq + i) * d];
      const size_t off = size_t(h) * d, stride = size_t(hkv) * d;
      Logits(q, &k_ref[off], T, int(stride), d, z_ref.data());
      Logits(q, &k_hat[off], T, int(stride), d, z.data());
      Softmax(z_ref, &p_ref);
      Softmax(z, &p);
      for (int t = 0; t < T; ++t) {
        logit2 += (z[t] - z_ref[t]) * (z[t] - z_ref[t]);
        if (p_ref[t] > 0) kl += p_ref[t] * (std::log(p_ref[t]) - std::log(std::max(p[t], 1e-300)));
      }
      std::vector<double> o_ref(d, 0.0), o(d, 0.0);
      for (int t = 0; t < T; ++t) {
        const float* vr = &v_ref[off + t * stride];
        const float* vh = &v_hat[off + t * stride];
        for (int j = 0; j < d; ++j) {
          o_ref[j] += p_ref[t] * vr[j];
          o[j] += p[t] * vh[j];
        }
      }
      for (int j = 0; j < d; ++j) {
        err2 += (o[j] - o_ref[j]) * (o[j] - o_ref[j]);
        ref2 += o_ref[j] * o_ref[j];
      }
      if (r == s.needle_query && s.needle >= 0) {
        const int top_ref = int(std::max_element(z_ref.begin(), z_ref.end()) - z_ref.begin());
        if (top_ref == s.needle) {
          ++fm.needle_trials;
          const int top = int(std::max_element(z.begin(), z.end()) - z.begin());
          fm.needle_hits += top == s.needle;
        }
      }
    }
  }
  const double rows = double(s.num_queries) * hq;
  fm.output_rel_error = ref2 > 0 ? std::sqrt(err2 / ref2) : 0.0;
  fm.logit_rmse = std::sqrt(logit2 / (rows * T));
  fm.kl = kl / rows;
  int group = opt.group_size;
  OSCARKV_RETURN_IF_ERROR(ResolveGroupSize(d, &group));
  int exact = 0;
  if (opt.protect) {
    for (int t = 0; t < T; ++t) exact += t < opt.sink_tokens || t >= T - opt.recent_window;
  }
  fm.effective_bits = (16.0 * exact + (2.0 + 32.0 / group) * (T - exact)) / T;
  return fm;
}

}  // namespace oscarkv
