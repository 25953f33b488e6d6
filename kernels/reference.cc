#include "kernels/reference.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace oscarkv {

std::vector<double> ReferenceAttention(const std::vector<double>& q, const std::vector<double>& k,
                                       const std::vector<double>& v, int tokens, int hq, int hkv,
                                       int d, double scale, std::vector<double>* lse) {
  std::vector<double> out(size_t(hq) * d, 0.0);
  if (lse) lse->assign(hq, -std::numeric_limits<double>::infinity());
  const int g = hq / hkv;
  std::vector<double> logit(tokens);
  for (int qh = 0; qh < hq; ++qh) {
    const int h = qh / g;
    double mx = -std::numeric_limits<double>::infinity();
    for (int t = 0; t < tokens; ++t) {
      double s = 0.0;
      for (int j = 0; j < d; ++j) s += q[size_t(qh) * d + j] * k[(size_t(t) * hkv + h) * d + j];
      logit[t] = s * scale;
      mx = std::max(mx, logit[t]);
    }
    if (tokens == 0) continue;
    double sum = 0.0;
    for (int t = 0; t < tokens; ++t) {
      const double p = std::exp(logit[t] - mx);
      sum += p;
      for (int j = 0; j < d; ++j) out[size_t(qh) * d + j] += p * v[(size_t(t) * hkv + h) * d + j];
    }
    for (int j = 0; j < d; ++j) out[size_t(qh) * d + j] /= sum;
    if (lse) (*lse)[qh] = mx + std::log(sum);
  }
  return out;
}

}  // namespace oscarkv
