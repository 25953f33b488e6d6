#include "kernels/quantize.h"

#include <algorithm>
#include <cmath>
#include <functional>

namespace oscarkv {

int ClipRank(float ratio, int n) {
  int k = static_cast<int>(std::ceil(static_cast<double>(ratio) * n - 1e-9));
  return std::min(std::max(k, 1), n);
}

namespace {
// Insertion sort, largest first: the arrays here hold a few dozen values.
inline void SortDescending(float* a, int n) {
  for (int i = 1; i < n; ++i) {
    const float v = a[i];
    int j = i;
    while (j > 0 && a[j - 1] < v) {
      a[j] = a[j - 1];
      --j;
    }
    a[j] = v;
  }
}
}  // namespace

float ClipThreshold(const float* y, int n, float ratio, float* scratch) {
  const int k = ClipRank(ratio, n);  // 1-based rank from the bottom
  const int m = n - k + 1;           // the same element's rank from the top
  if (m <= 16 && n % 16 == 0) {
    // The usual case (c = 0.9..1). The 16 per-lane maxima are a subset of the
    // row, so their m-th largest L is a lower bound of the row's m-th largest;
    // only elements >= L (a few more than m) need a real selection.
    float lane_max[16];
    for (int l = 0; l < 16; ++l) lane_max[l] = std::fabs(y[l]);
    for (int i = 16; i < n; i += 16) {
      for (int l = 0; l < 16; ++l) lane_max[l] = std::max(lane_max[l], std::fabs(y[i + l]));
    }
    SortDescending(lane_max, 16);
    const float bound = lane_max[m - 1];
    int c = 0;
    for (int i = 0; i < n; ++i) {
      const float a = std::fabs(y[i]);
      if (a >= bound) scratch[c++] = a;
    }
    SortDescending(scratch, c);
    return scratch[m - 1];
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

namespace {

typedef float V16 __attribute__((vector_size(64)));
typedef float V16u __attribute__((vector_size(64), aligned(4)));

// Rotates T rows at once with their outputs held in registers: each row of R
// is loaded once per T tokens and nothing is stored until the end.
template <int D, int T>
void RotateBlock(const bf16_bits* x, size_t x_stride, const float* r, float* y) {
  constexpr int kVecs = D / 16;
  V16 acc[T][kVecs] = {};
  for (int i = 0; i < D; ++i) {
    float xi[T];
    for (int t = 0; t < T; ++t) xi[t] = Bf16ToFloat(x[t * x_stride + i]);
    const V16u* ri = reinterpret_cast<const V16u*>(r + size_t(i) * D);
    for (int v = 0; v < kVecs; ++v) {
      const V16 rv = ri[v];
      for (int t = 0; t < T; ++t) acc[t][v] += xi[t] * rv;
    }
  }
  for (int t = 0; t < T; ++t) {
    V16u* yt = reinterpret_cast<V16u*>(y + size_t(t) * D);
    for (int v = 0; v < kVecs; ++v) yt[v] = acc[t][v];
  }
}

template <int D, int T>
void RotateRowsD(const bf16_bits* x, size_t x_stride, int n, const float* r, float* y) {
  int t = 0;
  for (; t + T <= n; t += T) RotateBlock<D, T>(x + t * x_stride, x_stride, r, y + size_t(t) * D);
  for (; t < n; ++t) RotateBlock<D, 1>(x + t * x_stride, x_stride, r, y + size_t(t) * D);
}

}  // namespace

void RotateRows(const bf16_bits* x, size_t x_stride, int n, const float* r, int dim, float* y) {
  switch (dim) {
    case 64: return RotateRowsD<64, 4>(x, x_stride, n, r, y);
    case 128: return RotateRowsD<128, 2>(x, x_stride, n, r, y);
    case 256: return RotateRowsD<256, 1>(x, x_stride, n, r, y);
    default: break;
  }
  for (size_t e = 0; e < size_t(n) * dim; ++e) y[e] = 0.0f;
  for (int t = 0; t < n; ++t) RotateRow(x + t * x_stride, r, dim, y + size_t(t) * dim);
}

void EncodeRow(const bf16_bits* x, const float* r, int dim, int group, float clip_ratio,
               uint8_t* codes, QuantParams* params, float* scratch) {
  float* y = scratch;
  RotateRow(x, r, dim, y);
  ClipRow(y, dim, clip_ratio, scratch + dim);
  QuantizeRow(y, dim, group, codes, params);
}

}  // namespace oscarkv
