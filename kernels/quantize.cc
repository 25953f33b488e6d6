#include "kernels/quantize.h"

#include <algorithm>
#include <cmath>

namespace oscarkv {

int ClipRank(float ratio, int n) {
  int k = static_cast<int>(std::ceil(static_cast<double>(ratio) * n - 1e-9));
  return std::min(std::max(k, 1), n);
}

float ClipThreshold(const float* y, int n, float ratio, float* scratch) {
  const int k = ClipRank(ratio, n);  // 1-based rank from the bottom
  const int m = n - k + 1;           // the same element's rank from the top
  if (m <= 16) {
    // The usual case (c = 0.9..1): keep the m largest |y| in a small sorted list.
    float top[16];
    int have = 0;
    for (int i = 0; i < n; ++i) {
      const float a = std::fabs(y[i]);
      if (have == m && a <= top[m - 1]) continue;
      int pos = have < m ? have++ : m - 1;
      while (pos > 0 && top[pos - 1] < a) {
        top[pos] = top[pos - 1];
        --pos;
      }
      top[pos] = a;
    }
    return top[m - 1];
  }
  for (int i = 0; i < n; ++i) scratch[i] = std::fabs(y[i]);
  std::nth_element(scratch, scratch + (k - 1), scratch + n);
  return scratch[k - 1];
}

void ClipRow(float* y, int n, float ratio, float* scratch) {
  if (ratio >= 1.0f) return;
  const float tau = ClipThreshold(y, n, ratio, scratch);
  for (int i = 0; i < n; ++i) y[i] = std::min(std::max(y[i], -tau), tau);
}

void QuantizeRow(const float* y, int dim, int group, uint8_t* codes, QuantParams* params) {
  const int quarter = dim / 4;
  uint8_t q[256];
  for (int g0 = 0, gi = 0; g0 < dim; g0 += group, ++gi) {
    float lo = y[g0], hi = y[g0];
    for (int j = g0 + 1; j < g0 + group; ++j) {
      lo = std::min(lo, y[j]);
      hi = std::max(hi, y[j]);
    }
    const float s = std::max(hi - lo, kMinRange) / 3.0f;
    const fp16_bits s_h = FloatToFp16(s);
    const fp16_bits lo_h = FloatToFp16(lo);
    params[gi] = QuantParams{s_h, lo_h};
    const float sq = Fp16ToFloat(s_h);
    const float loq = Fp16ToFloat(lo_h);
    // s can underflow fp16 for a constant group: then every code is 0.
    const float inv = sq > 0.0f ? 1.0f / sq : 0.0f;
    for (int j = g0; j < g0 + group; ++j) {
      float c = std::rint((y[j] - loq) * inv);
      c = std::min(std::max(c, 0.0f), 3.0f);
      q[j] = static_cast<uint8_t>(c);
    }
  }
  for (int j = 0; j < quarter; ++j) {
    codes[j] = PackCodes4(q[j], q[j + quarter], q[j + 2 * quarter], q[j + 3 * quarter]);
  }
}

void UnpackRow(const uint8_t* codes, int dim, uint8_t* q) {
  const int quarter = dim / 4;
  for (int j = 0; j < quarter; ++j) {
    for (int k = 0; k < 4; ++k) q[j + k * quarter] = static_cast<uint8_t>(UnpackCode(codes[j], k));
  }
}

void DequantizeRow(const uint8_t* codes, const QuantParams* params, int dim, int group,
                   float* out) {
  const int quarter = dim / 4;
  for (int j = 0; j < quarter; ++j) {
    for (int k = 0; k < 4; ++k) {
      const int e = j + k * quarter;
      const QuantParams p = params[e / group];
      out[e] = static_cast<float>(UnpackCode(codes[j], k)) * Fp16ToFloat(p.scale) +
               Fp16ToFloat(p.min);
    }
  }
}

void RotateRow(const bf16_bits* x, const float* r, int dim, float* y) {
  for (int j = 0; j < dim; ++j) y[j] = 0.0f;
  for (int i = 0; i < dim; ++i) {
    const float xi = Bf16ToFloat(x[i]);
    const float* row = r + size_t(i) * dim;
    for (int j = 0; j < dim; ++j) y[j] += xi * row[j];
  }
}

void RotateRows(const bf16_bits* x, size_t x_stride, int n, const float* r, int dim, float* y) {
  for (size_t e = 0; e < size_t(n) * dim; ++e) y[e] = 0.0f;
  for (int i = 0; i < dim; ++i) {
    const float* row = r + size_t(i) * dim;
    for (int t = 0; t < n; ++t) {
      const float xi = Bf16ToFloat(x[t * x_stride + i]);
      float* yt = y + size_t(t) * dim;
      for (int j = 0; j < dim; ++j) yt[j] += xi * row[j];
    }
  }
}

void EncodeRow(const bf16_bits* x, const float* r, int dim, int group, float clip_ratio,
               uint8_t* codes, QuantParams* params, float* scratch) {
  float* y = scratch;
  RotateRow(x, r, dim, y);
  ClipRow(y, dim, clip_ratio, scratch + dim);
  QuantizeRow(y, dim, group, codes, params);
}

}  // namespace oscarkv
