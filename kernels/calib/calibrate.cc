#include "kernels/calib/calibrate.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include <Eigen/Dense>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/hadamard.h"
#include "kernels/numeric.h"
#include "kernels/quantize.h"
#include "kernels/status_macros.h"

namespace oscarkv {
namespace {

using RowMatrixF = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using RowMatrixD = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// Rows of head `head` of a [tokens][heads][D] tensor as an n×D matrix.
RowMatrixF HeadRows(const std::vector<float>& x, int tokens, int heads, int head, int d) {
  RowMatrixF m(tokens, d);
  for (int t = 0; t < tokens; ++t) {
    std::copy_n(&x[(size_t(t) * heads + head) * d], d, m.row(t).data());
  }
  return m;
}

std::vector<double> ToVector(const Eigen::MatrixXd& m) {
  const int d = int(m.rows());
  std::vector<double> out(size_t(d) * d);
  for (int i = 0; i < d; ++i)
    for (int j = 0; j < d; ++j) out[size_t(i) * d + j] = 0.5 * (m(i, j) + m(j, i));
  return out;
}

// Σ_i (S_i V)ᵀ(S_i V) over the query heads of group h, S_i the causal softmax;
// also adds each token's received attention to `mass`.
Eigen::MatrixXd ExactValueTarget(const LayerActivations& a, int h, std::vector<double>* mass) {
  const int n = a.tokens, d = a.head_dim, g = a.num_q_heads / a.num_kv_heads;
  const RowMatrixF k = HeadRows(a.k, n, a.num_kv_heads, h, d);
  const RowMatrixF v = HeadRows(a.v, n, a.num_kv_heads, h, d);
  Eigen::MatrixXd acc = Eigen::MatrixXd::Zero(d, d);
  const float scale = 1.0f / std::sqrt(float(d));
  for (int i = 0; i < g; ++i) {
    const RowMatrixF q = HeadRows(a.q, n, a.num_q_heads, h * g + i, d);
    RowMatrixF s = (q * k.transpose()) * scale;
    for (int t = 0; t < n; ++t) {
      float* row = s.row(t).data();
      float mx = -std::numeric_limits<float>::infinity();
      for (int j = 0; j <= t; ++j) mx = std::max(mx, row[j]);
      double sum = 0;
      for (int j = 0; j <= t; ++j) {
        row[j] = std::exp(row[j] - mx);
        sum += row[j];
      }
      const float inv = float(1.0 / sum);
      for (int j = 0; j <= t; ++j) {
        row[j] *= inv;
        (*mass)[j] += row[j];
      }
      for (int j = t + 1; j < n; ++j) row[j] = 0.0f;
    }
    const RowMatrixF o = s * v;
    acc += (o.transpose() * o).cast<double>();
  }
  return acc / double(n * g);
}

}  // namespace

absl::StatusOr<LayerActivations> ActivationsFromSynthetic(const SyntheticLayer& l) {
  if (l.num_queries != l.tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "calibration needs one query per token: ", l.num_queries, " queries, ", l.tokens,
        " tokens"));
  }
  LayerActivations a;
  a.tokens = l.tokens;
  a.num_q_heads = l.num_q_heads;
  a.num_kv_heads = l.num_kv_heads;
  a.head_dim = l.head_dim;
  a.q = l.q;
  a.k.resize(l.k.size());
  a.v.resize(l.v.size());
  for (size_t i = 0; i < l.k.size(); ++i) a.k[i] = Bf16ToFloat(l.k[i]);
  for (size_t i = 0; i < l.v.size(); ++i) a.v[i] = Bf16ToFloat(l.v[i]);
  return a;
}

absl::Status ValidateActivations(const LayerActivations& a, const ModelLayout& layout) {
  if (a.num_q_heads != layout.num_q_heads || a.num_kv_heads != layout.num_kv_heads ||
      a.head_dim != layout.head_dim) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "activations have %d q heads, %d kv heads, head_dim %d; layout says %d, %d, %d",
        a.num_q_heads, a.num_kv_heads, a.head_dim, layout.num_q_heads, layout.num_kv_heads,
        layout.head_dim));
  }
  if (a.tokens < 2) {
    return absl::InvalidArgumentError(absl::StrCat("activations have ", a.tokens,
                                                   " tokens; calibration needs at least 2"));
  }
  const size_t d = size_t(a.head_dim), n = size_t(a.tokens);
  struct Check {
    const char* name;
    const std::vector<float>* x;
    size_t want;
  } checks[] = {{"Q", &a.q, n * a.num_q_heads * d},
                {"K", &a.k, n * a.num_kv_heads * d},
                {"V", &a.v, n * a.num_kv_heads * d}};
  for (const Check& c : checks) {
    if (c.x->size() != c.want) {
      return absl::InvalidArgumentError(absl::StrCat(c.name, " has ", c.x->size(),
                                                     " values, expected ", c.want));
    }
    for (size_t i = 0; i < c.x->size(); ++i) {
      if (!std::isfinite((*c.x)[i])) {
        return absl::InvalidArgumentError(absl::StrCat(c.name, " has a non-finite value at token ",
                                                       i / (c.want / n)));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<LayerTargets> ComputeTargets(const LayerActivations& a,
                                            const CalibrationOptions& opt) {
  ModelLayout layout{1, a.num_q_heads, a.num_kv_heads, a.head_dim};
  OSCARKV_RETURN_IF_ERROR(ValidateLayout(layout));
  OSCARKV_RETURN_IF_ERROR(ValidateActivations(a, layout));
  const bool exact =
      opt.targets == TargetKind::kAttention && opt.value_target == ValueTarget::kExactSoftmax;
  if (exact && a.tokens > opt.max_exact_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "exact value target needs O(n^2) work: ", a.tokens, " tokens > limit ",
        opt.max_exact_tokens, "; use the logit proxy or fewer tokens"));
  }
  const int n = a.tokens, d = a.head_dim, hkv = a.num_kv_heads, g = a.num_q_heads / hkv;
  std::vector<Eigen::MatrixXd> key(hkv), value(hkv);
  LayerTargets out;
  out.token_weight.assign(hkv, std::vector<double>(n, 1.0));
  for (int h = 0; h < hkv; ++h) {
    const RowMatrixF k = HeadRows(a.k, n, hkv, h, d);
    const RowMatrixF v = HeadRows(a.v, n, hkv, h, d);
    if (opt.targets == TargetKind::kSelfCovariance) {
      key[h] = (k.transpose() * k).cast<double>() / double(n);
      value[h] = (v.transpose() * v).cast<double>() / double(n);
      continue;
    }
    Eigen::MatrixXd ck = Eigen::MatrixXd::Zero(d, d);
    for (int i = 0; i < g; ++i) {
      const RowMatrixF q = HeadRows(a.q, n, a.num_q_heads, h * g + i, d);
      ck += (q.transpose() * q).cast<double>();
    }
    key[h] = ck / double(n * g);
    std::vector<double>& w = out.token_weight[h];
    if (exact) {
      std::fill(w.begin(), w.end(), 0.0);
      value[h] = ExactValueTarget(a, h, &w);
    } else {
      // w_t = k_t C_h k_tᵀ, the second moment of token t's logits.
      const Eigen::MatrixXd kd = k.cast<double>();
      const Eigen::MatrixXd kc = kd * key[h];
      for (int t = 0; t < n; ++t) w[t] = kc.row(t).dot(kd.row(t));
      double mean = 0;
      for (double x : w) mean += x;
      mean /= n;
      if (!(mean > 0)) mean = 1;
      for (double& x : w) x /= mean;
      Eigen::MatrixXd vw = v.cast<double>();
      for (int t = 0; t < n; ++t) vw.row(t) *= std::sqrt(std::max(w[t], 0.0));
      value[h] = vw.transpose() * vw / double(n);
      continue;
    }
    double mean = 0;
    for (double x : w) mean += x;
    mean /= n;
    for (double& x : w) x = mean > 0 ? x / mean : 1.0;
  }
  if (opt.per_head) {
    for (int h = 0; h < hkv; ++h) {
      out.key.push_back(ToVector(key[h]));
      out.value.push_back(ToVector(value[h]));
    }
  } else {
    Eigen::MatrixXd ck = Eigen::MatrixXd::Zero(d, d), cv = Eigen::MatrixXd::Zero(d, d);
    for (int h = 0; h < hkv; ++h) {
      ck += key[h];
      cv += value[h];
    }
    out.key.push_back(ToVector(ck / hkv));
    out.value.push_back(ToVector(cv / hkv));
  }
  return out;
}

absl::StatusOr<Eigensystem> SymmetricEigen(const std::vector<double>& target, int dim) {
  if (target.size() != size_t(dim) * dim) {
    return absl::InvalidArgumentError(absl::StrCat("target must be ", dim, "x", dim));
  }
  for (double x : target) {
    if (!std::isfinite(x)) return absl::InvalidArgumentError("target has a non-finite value");
  }
  const Eigen::Map<const RowMatrixD> m(target.data(), dim, dim);
  Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> solver(Eigen::MatrixXd(m),
                                                        Eigen::ComputeEigenvectors);
  if (solver.info() != Eigen::Success) {
    return absl::InternalError("symmetric eigendecomposition did not converge");
  }
  // Eigen returns ascending eigenvalues; store them descending (column 0 of U
  // is the top eigenvector), as DESIGN section 3 says.
  Eigensystem es;
  es.eigenvalues.resize(dim);
  es.u.resize(size_t(dim) * dim);
  for (int j = 0; j < dim; ++j) {
    const int src = dim - 1 - j;
    es.eigenvalues[j] = solver.eigenvalues()(src);
    for (int i = 0; i < dim; ++i) es.u[size_t(i) * dim + j] = solver.eigenvectors()(i, src);
  }
  return es;
}

double WeightedCodecError(const float* x, int rows, size_t row_stride, int dim, const float* r,
                          float clip, int group_size, const std::vector<double>& metric,
                          const std::vector<double>& row_weight) {
  if (rows <= 0) return 0.0;
  const int g = group_size > 0 ? group_size : dim;
  // Rotate all rows at once (bf16-rounded, as the cache holds them): Y = X · R.
  RowMatrixF xm(rows, dim);
  for (int t = 0; t < rows; ++t) {
    for (int j = 0; j < dim; ++j) xm(t, j) = Bf16ToFloat(FloatToBf16(x[size_t(t) * row_stride + j]));
  }
  const Eigen::Map<const RowMatrixF> rm(r, dim, dim);
  const RowMatrixF y = xm * rm;
  // The codec on each rotated row (the steps of EncodeRow after RotateRow).
  RowMatrixD e(rows, dim);
  std::vector<float> yc(dim), yq(dim), scratch(dim);
  std::vector<uint8_t> codes(dim / 4);
  std::vector<QuantParams> params(dim / g);
  for (int t = 0; t < rows; ++t) {
    std::copy_n(y.row(t).data(), dim, yc.data());
    ClipRow(yc.data(), dim, clip, scratch.data());
    QuantizeRow(yc.data(), dim, g, codes.data(), params.data());
    DequantizeRow(codes.data(), params.data(), dim, g, yq.data());
    for (int j = 0; j < dim; ++j) e(t, j) = double(yq[j]) - double(y(t, j));
  }
  // Error in the original basis is e · Rᵀ; under metric M that is e (Rᵀ M R) eᵀ.
  Eigen::VectorXd per_row;
  if (!metric.empty()) {
    const Eigen::Map<const RowMatrixD> mm(metric.data(), dim, dim);
    const Eigen::MatrixXd rd = rm.cast<double>();
    const Eigen::MatrixXd m_rot = rd.transpose() * mm * rd;
    per_row = ((e * m_rot).array() * e.array()).rowwise().sum();
  } else {
    per_row = e.array().square().rowwise().sum();  // R is orthogonal
  }
  double total = 0;
  for (int t = 0; t < rows; ++t) total += per_row(t) * (row_weight.empty() ? 1.0 : row_weight[t]);
  return total / rows;
}

absl::StatusOr<LayerRotation> CalibrateLayer(const LayerActivations& a,
                                             const CalibrationOptions& opt,
                                             LayerCalibrationReport* report) {
  OSCARKV_RETURN_IF_ERROR(ValidateClipRatio(opt.clip_k, "key"));
  OSCARKV_RETURN_IF_ERROR(ValidateClipRatio(opt.clip_v, "value"));
  for (float c : opt.clip_grid) OSCARKV_RETURN_IF_ERROR(ValidateClipRatio(c, "clip grid"));
  if (opt.fit_clip && opt.clip_grid.empty()) {
    return absl::InvalidArgumentError("clip fit requested with an empty grid");
  }
  OSCARKV_ASSIGN_OR_RETURN(LayerTargets targets, ComputeTargets(a, opt));
  int group = opt.group_size;
  OSCARKV_RETURN_IF_ERROR(ResolveGroupSize(a.head_dim, &group));
  const int d = a.head_dim, m_count = int(targets.key.size());
  LayerRotation lr;
  lr.num_matrices = m_count;
  lr.clip_k = opt.clip_k;
  lr.clip_v = opt.clip_v;
  LayerCalibrationReport rep;
  for (int kind = 0; kind < 2; ++kind) {
    for (int m = 0; m < m_count; ++m) {
      const std::vector<double>& target = kind == 0 ? targets.key[m] : targets.value[m];
      OSCARKV_ASSIGN_OR_RETURN(Eigensystem es, SymmetricEigen(target, d));
      OSCARKV_ASSIGN_OR_RETURN(std::vector<double> r, ComposeRotation(es.u, es.eigenvalues, d));
      const double orth = OrthogonalityError(r.data(), d);
      if (!(orth < 1e-5)) {
        return absl::InternalError(absl::StrFormat(
            "composed rotation is not orthogonal: max |R^T R - I| = %.3g", orth));
      }
      std::vector<float>& rv = kind == 0 ? lr.r_k : lr.r_v;
      std::vector<float>& ev = kind == 0 ? lr.eig_k : lr.eig_v;
      rv.insert(rv.end(), r.begin(), r.end());
      ev.insert(ev.end(), es.eigenvalues.begin(), es.eigenvalues.end());
      double trace = 0, top = 0;
      for (double x : es.eigenvalues) {
        trace += std::max(x, 0.0);
        top = std::max(top, x);
      }
      (kind == 0 ? rep.top_eig_share_k : rep.top_eig_share_v) +=
          (trace > 0 ? top / trace : 0.0) / m_count;
    }
  }
  if (opt.fit_clip) {
    // Attention-weighted reconstruction error on (at most 1024 of) the
    // calibration tokens: keys under the query metric, values under the
    // tokens' attention weights.
    const int rows = std::min(a.tokens, 1024);
    const int hkv = a.num_kv_heads;
    for (int kind = 0; kind < 2; ++kind) {
      float best_c = kind == 0 ? opt.clip_k : opt.clip_v;
      double best = std::numeric_limits<double>::infinity();
      for (float c : opt.clip_grid) {
        double err = 0;
        for (int h = 0; h < hkv; ++h) {
          const int m = m_count == 1 ? 0 : h;
          const float* r = (kind == 0 ? lr.r_k : lr.r_v).data() + size_t(m) * d * d;
          const std::vector<float>& x = kind == 0 ? a.k : a.v;
          std::vector<double> w(targets.token_weight[h].begin(),
                                targets.token_weight[h].begin() + rows);
          err += WeightedCodecError(&x[size_t(h) * d], rows, size_t(hkv) * d, d, r, c, group,
                                    kind == 0 ? targets.key[m] : std::vector<double>(), w);
        }
        if (err < best) {
          best = err;
          best_c = c;
        }
      }
      (kind == 0 ? lr.clip_k : lr.clip_v) = best_c;
      (kind == 0 ? rep.clip_error_k : rep.clip_error_v) = best / hkv;
    }
  }
  rep.clip_k = lr.clip_k;
  rep.clip_v = lr.clip_v;
  if (report != nullptr) *report = rep;
  return lr;
}

}  // namespace oscarkv
