#include "kernels/quantize.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>

#include "kernels/host_vector.h"

#if defined(__AVX512F__)
// GCC 12's AVX-512 intrinsics pass an undefined vector as the unused merge
// operand and then warn about it (fixed in GCC 13); the warnings point into
// the header, so they are silenced for the header only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

namespace oscarkv {

int ClipRank(float ratio, int n) {
  int k = static_cast<int>(std::ceil(static_cast<double>(ratio) * n - 1e-9));
  return std::min(std::max(k, 1), n);
}

namespace {
// The m-th largest (1-based) of a[0, c) without branches on the data: each
// element's rank is the count of elements above it, ties broken by index,
// so exactly one element has rank m - 1 when c >= m and a holds no NaN
// (else the answer may be NaN: a row that overflowed in the rotation). For
// the few dozen values here this beats a sort, whose comparisons the branch
// predictor cannot learn (on an AVX2 host the encode spent a third of its
// time in ClipThreshold's sorts and filter, RESULTS "On a host without
// AVX-512").
inline float MthLargestByRank(const float* a, int c, int m) {
  float out = std::numeric_limits<float>::quiet_NaN();
  for (int i = 0; i < c; ++i) {
    const float v = a[i];
    int above = 0;
    for (int j = 0; j < c; ++j) above += (a[j] > v) | ((a[j] == v) & (j < i));
    out = above == m - 1 ? v : out;
  }
  return out;
}

#if defined(__AVX512F__)
// Max (kMax) or min over the 16 lanes, by shuffles (GCC's
// _mm512_reduce_max_ps trips -Wuninitialized in its own header).
template <bool kMax>
inline float HorizontalExtreme(__m512 x) {
  const auto op = [](__m512 a, __m512 b) {
    return kMax ? _mm512_max_ps(a, b) : _mm512_min_ps(a, b);
  };
  x = op(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(1, 0, 3, 2)));
  x = op(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(2, 3, 0, 1)));
  x = op(x, _mm512_permute_ps(x, _MM_SHUFFLE(1, 0, 3, 2)));
  x = op(x, _mm512_permute_ps(x, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_cvtss_f32(x);
}
inline float HorizontalMax(__m512 x) { return HorizontalExtreme<true>(x); }
inline float HorizontalMin(__m512 x) { return HorizontalExtreme<false>(x); }

// The m-th largest, counting repeats, of the nv vectors v (non-negative
// values; padding lanes hold -1). Each round takes the largest value left and
// how many lanes hold it, so a run of equal values costs one round.
inline float MthLargest(__m512* v, int nv, int m) {
  int rank = 0;
  for (;;) {
    __m512 x = v[0];
    for (int i = 1; i < nv; ++i) x = _mm512_max_ps(x, v[i]);
    const float mx = HorizontalMax(x);
    const __m512 vm = _mm512_set1_ps(mx);
    int found = 0;
    for (int i = 0; i < nv; ++i) {
      const __mmask16 eq = _mm512_cmp_ps_mask(v[i], vm, _CMP_EQ_OQ);
      found += __builtin_popcount(eq);
      v[i] = _mm512_mask_mov_ps(v[i], eq, _mm512_set1_ps(-1.0f));
    }
    rank += found;
    // found == 0 only for a NaN (a row that overflowed in the rotation): stop
    // rather than loop; the caller gets NaN, as the scalar path would give.
    if (rank >= m || found == 0) return mx;
  }
}

// ClipThreshold's usual case (m <= 16, n a multiple of 16) without branches
// on the data: the lane maxima's m-th largest L bounds the answer from below,
// the elements >= L are compressed into a few vectors, and the answer is
// their m-th largest.
inline float TopMthAbs(const float* y, int n, int m) {
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  __m512 lane_max = _mm512_and_ps(_mm512_loadu_ps(y), sign);
  for (int i = 16; i < n; i += 16) {
    lane_max = _mm512_max_ps(lane_max, _mm512_and_ps(_mm512_loadu_ps(y + i), sign));
  }
  __m512 lm[1] = {lane_max};
  const __m512 bound = _mm512_set1_ps(MthLargest(lm, 1, m));
  alignas(64) float cand[256 + 16];
  int c = 0;
  for (int i = 0; i < n; i += 16) {
    const __m512 a = _mm512_and_ps(_mm512_loadu_ps(y + i), sign);
    const __mmask16 keep = _mm512_cmp_ps_mask(a, bound, _CMP_GE_OQ);
    _mm512_mask_compressstoreu_ps(cand + c, keep, a);
    c += __builtin_popcount(keep);
  }
  // At least m elements reach the bound unless the row holds a NaN.
  if (c < m) return std::numeric_limits<float>::quiet_NaN();
  __m512 v[256 / 16];
  const int nv = (c + 15) / 16;
  for (int i = 0; i < nv; ++i) {
    const int left = c - 16 * i;
    const __mmask16 valid = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
    v[i] = _mm512_mask_loadu_ps(_mm512_set1_ps(-1.0f), valid, cand + 16 * i);
  }
  return MthLargest(v, nv, m);
}
#endif
}  // namespace

// Candidates (elements at or above the bound) ClipThreshold ranks; more
// (rows of ties) take std::nth_element. Rows of distinct values have about
// m..2m <= 32.
constexpr int kMaxRankedCandidates = 48;

float ClipThreshold(const float* y, int n, float ratio, float* scratch) {
  const int k = ClipRank(ratio, n);  // 1-based rank from the bottom
  const int m = n - k + 1;           // the same element's rank from the top
#if defined(__AVX512F__)
  if (m <= 16 && n % 16 == 0 && n <= 256) return TopMthAbs(y, n, m);
#endif
  if (m <= 16 && n % 16 == 0) {
    // The usual case (c = 0.9..1). The 16 per-lane maxima are a subset of the
    // row, so their m-th largest L is a lower bound of the row's m-th largest;
    // only elements >= L (a few more than m) need a real selection.
    float lane_max[16];
    for (int l = 0; l < 16; ++l) lane_max[l] = std::fabs(y[l]);
    for (int i = 16; i < n; i += 16) {
      for (int l = 0; l < 16; ++l) lane_max[l] = std::max(lane_max[l], std::fabs(y[i + l]));
    }
    const float bound = MthLargestByRank(lane_max, 16, m);
    // The candidates, compacted without a branch (c <= i at each store).
    int c = 0;
    for (int i = 0; i < n; ++i) {
      const float a = std::fabs(y[i]);
      scratch[c] = a;
      c += a >= bound;
    }
    // Rows of many equal magnitudes (a constant or zero row: every element
    // a candidate) would make the ranks quadratic: a linear selection there.
    if (c > kMaxRankedCandidates) {
      std::nth_element(scratch, scratch + (m - 1), scratch + c, std::greater<float>());
      return scratch[m - 1];
    }
    return MthLargestByRank(scratch, c, m);
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

#if defined(__AVX512F__)
namespace {
// QuantizeRow for groups of a multiple of 16 and dim a multiple of 64: the
// same arithmetic 16 lanes at a time, so the same codes and parameters (a
// group whose minimum is a signed zero may store the other zero).
void QuantizeRowAvx512(const float* y, int dim, int group, uint8_t* codes, QuantParams* params) {
  alignas(64) int32_t q[256];
  for (int g0 = 0, gi = 0; g0 < dim; g0 += group, ++gi) {
    __m512 vlo = _mm512_loadu_ps(y + g0), vhi = vlo;
    for (int j = g0 + 16; j < g0 + group; j += 16) {
      const __m512 x = _mm512_loadu_ps(y + j);
      vlo = _mm512_min_ps(vlo, x);
      vhi = _mm512_max_ps(vhi, x);
    }
    const float lo = HorizontalMin(vlo);
    const float hi = HorizontalMax(vhi);
    const float s = std::max(hi - lo, kMinRange) / 3.0f;
    const fp16_bits s_h = FloatToFp16(s);
    const fp16_bits lo_h = FloatToFp16(lo);
    params[gi] = QuantParams{s_h, lo_h};
    const __m512 loq = _mm512_set1_ps(Fp16ToFloat(lo_h));
    const float sq = Fp16ToFloat(s_h);
    const __m512 inv = _mm512_set1_ps(sq > 0.0f ? 1.0f / sq : 0.0f);
    const __m512 three = _mm512_set1_ps(3.0f);
    for (int j = g0; j < g0 + group; j += 16) {
      __m512 c = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(y + j), loq), inv);
      c = _mm512_roundscale_ps(c, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      c = _mm512_min_ps(_mm512_max_ps(c, _mm512_setzero_ps()), three);
      _mm512_store_si512(q + j, _mm512_cvtps_epi32(c));
    }
  }
  const int quarter = dim / 4;
  for (int j = 0; j < quarter; j += 16) {
    __m512i b = _mm512_load_si512(q + j);
    b = _mm512_or_si512(b, _mm512_slli_epi32(_mm512_load_si512(q + j + quarter), 2));
    b = _mm512_or_si512(b, _mm512_slli_epi32(_mm512_load_si512(q + j + 2 * quarter), 4));
    b = _mm512_or_si512(b, _mm512_slli_epi32(_mm512_load_si512(q + j + 3 * quarter), 6));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + j), _mm512_cvtepi32_epi8(b));
  }
}
}  // namespace
#endif

void QuantizeRow(const float* y, int dim, int group, uint8_t* codes, QuantParams* params) {
#if defined(__AVX512F__)
  if (group % 16 == 0 && dim % 64 == 0 && dim <= 256) {
    return QuantizeRowAvx512(y, dim, group, codes, params);
  }
#endif
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

// Output columns per pass of RotateBlock, in the host's widest vectors
// (kernels/host_vector.h), so that its T x kRotateColumns / kLanes
// accumulators stay in registers: every column in one pass with AVX-512 (at
// most 16 zmm), 32 with AVX2 (8 ymm; with 16-float vectors the encode ran at
// 11 k tokens/s on an AVX2-only EPYC, 2026-12-02, RESULTS). Each output's sum
// over i keeps its order, so the bits do not depend on the pass width.
using host_vector::kLanes;
using host_vector::VF;
using host_vector::VFu;
#if defined(__AVX512F__)
constexpr int kRotateColumns = 256;
#else
constexpr int kRotateColumns = 32;
#endif

// Rotates T rows at once with their outputs held in registers, up to
// kRotateColumns output columns per pass: each row of R is loaded once per
// T tokens and pass, and nothing is stored until the end of a pass.
template <int D, int T>
void RotateBlock(const bf16_bits* x, size_t x_stride, const float* r, float* y) {
  constexpr int kCols = D < kRotateColumns ? D : kRotateColumns;
  constexpr int kVecs = kCols / kLanes;
  static_assert(D % kCols == 0 && kCols % kLanes == 0, "whole passes of whole vectors");
  for (int c0 = 0; c0 < D; c0 += kCols) {
    VF acc[T][kVecs] = {};
    for (int i = 0; i < D; ++i) {
      float xi[T];
      for (int t = 0; t < T; ++t) xi[t] = Bf16ToFloat(x[t * x_stride + i]);
      const VFu* ri = reinterpret_cast<const VFu*>(r + size_t(i) * D + c0);
      for (int v = 0; v < kVecs; ++v) {
        const VF rv = ri[v];
        for (int t = 0; t < T; ++t) acc[t][v] += xi[t] * rv;
      }
    }
    for (int t = 0; t < T; ++t) {
      VFu* yt = reinterpret_cast<VFu*>(y + size_t(t) * D + c0);
      for (int v = 0; v < kVecs; ++v) yt[v] = acc[t][v];
    }
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
