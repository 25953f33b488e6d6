#include "kernels/cpu/attention_cpu.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace oscarkv {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int kMaxGroup = 64;   // query heads per kv head handled in one pass
constexpr int kMaxDim = 256;
constexpr int kChunk = 32;      // tokens whose logits are computed before one rescale

inline float Dot(const float* a, const float* b, int n) {
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int j = 0; j < n; j += 8) {
    for (int k = 0; k < 8; ++k) s[k] += a[j + k] * b[j + k];
  }
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

inline void Axpy(float a, const float* x, float* y, int n) {
  for (int j = 0; j < n; ++j) y[j] += a * x[j];
}

inline void Bf16RowToFloat(const bf16_bits* x, float* y, int n) {
  for (int j = 0; j < n; ++j) y[j] = Bf16ToFloat(x[j]);
}

// Online softmax state of the g query heads of one kv head.
struct GroupState {
  int g = 0;
  int d = 0;
  float m[kMaxGroup];
  float l[kMaxGroup];
  std::vector<float> acc;  // [g][d]

  GroupState(int g_, int d_) : g(g_), d(d_), acc(size_t(g_) * d_, 0.0f) {
    std::fill(m, m + g, kNegInf);
    std::fill(l, l + g, 0.0f);
  }
  // Rescales head i for a chunk whose max logit is cmax; returns the new max.
  float Rescale(int i, float cmax) {
    const float nm = std::max(m[i], cmax);
    if (nm != m[i]) {
      const float f = m[i] == kNegInf ? 0.0f : std::exp(m[i] - nm);
      l[i] *= f;
      float* a = &acc[size_t(i) * d];
      for (int j = 0; j < d; ++j) a[j] *= f;
      m[i] = nm;
    }
    return nm;
  }
  float Lse(int i) const { return l[i] > 0.0f ? m[i] + std::log(l[i]) : kNegInf; }
};

// Dot products of one key row with up to four query rows at once: the key is
// loaded once and each query keeps a 16-wide accumulator (no per-element
// horizontal sums).
inline void Dot4(const float* q, int nq, int d, const float* k, float* out) {
  alignas(64) float acc[4][16] = {};
  for (int j = 0; j < d; j += 16) {
    for (int i = 0; i < 4; ++i) {
      if (i >= nq) break;
      const float* qi = q + size_t(i) * d + j;
      for (int l = 0; l < 16; ++l) acc[i][l] += qi[l] * k[j + l];
    }
  }
  for (int i = 0; i < nq; ++i) {
    float s = 0.0f;
    for (int l = 0; l < 16; ++l) s += acc[i][l];
    out[i] = s;
  }
}

// Accumulates `n` tokens whose K and V rows are produced by the callbacks
// (each fills a float row of d), for all g heads with queries qs[g][d]. Rows
// are materialized a chunk at a time into L1-sized tiles.
template <typename KRow, typename VRow>
void AccumulateTokens(GroupState& st, const float* qs, float scale, int n, KRow&& krow,
                      VRow&& vrow, float* tile) {
  const int g = st.g, d = st.d;
  float logits[kMaxGroup][kChunk];
  for (int t0 = 0; t0 < n; t0 += kChunk) {
    const int c = std::min(kChunk, n - t0);
    for (int t = 0; t < c; ++t) krow(t0 + t, tile + size_t(t) * d);
    for (int t = 0; t < c; ++t) {
      float dots[4];
      for (int i0 = 0; i0 < g; i0 += 4) {
        const int nq = std::min(4, g - i0);
        Dot4(qs + size_t(i0) * d, nq, d, tile + size_t(t) * d, dots);
        for (int i = 0; i < nq; ++i) logits[i0 + i][t] = scale * dots[i];
      }
    }
    for (int i = 0; i < g; ++i) {
      float cm = kNegInf;
      for (int t = 0; t < c; ++t) cm = std::max(cm, logits[i][t]);
      const float mx = st.Rescale(i, cm);
      float sum = 0.0f;
      for (int t = 0; t < c; ++t) {
        logits[i][t] = std::exp(logits[i][t] - mx);
        sum += logits[i][t];
      }
      st.l[i] += sum;
    }
    for (int t = 0; t < c; ++t) vrow(t0 + t, tile + size_t(t) * d);
    for (int i = 0; i < g; ++i) {
      float* a = &st.acc[size_t(i) * d];
      for (int t = 0; t < c; ++t) Axpy(logits[i][t], tile + size_t(t) * d, a, d);
    }
  }
}

// Dequantizes row `t` of a page's K or V stream (codes + params) into y.
inline void DequantRow(const uint8_t* codes, const QuantParams* params, int t, int d, int group,
                       float* y) {
  const int quarter = d / 4;
  const int groups = d / group;
  const uint8_t* c = codes + size_t(t) * quarter;
  const QuantParams* p = params + size_t(t) * groups;
  float s[kMaxDim / 4], lo[kMaxDim / 4];
  for (int gi = 0; gi < groups; ++gi) {
    s[gi] = Fp16ToFloat(p[gi].scale);
    lo[gi] = Fp16ToFloat(p[gi].min);
  }
  if (groups == 1) {
    const float s0 = s[0], l0 = lo[0];
    for (int k = 0; k < 4; ++k) {
      float* yk = y + k * quarter;
      for (int j = 0; j < quarter; ++j) yk[j] = float((c[j] >> (2 * k)) & 3) * s0 + l0;
    }
    return;
  }
  for (int j = 0; j < quarter; ++j) {
    const uint32_t b = c[j];
    for (int k = 0; k < 4; ++k) {
      const int e = j + k * quarter;
      const int gi = e / group;
      y[e] = float((b >> (2 * k)) & 3u) * s[gi] + lo[gi];
    }
  }
}

}  // namespace

void MergeAttention(const float* o_a, float lse_a, const float* o_b, float lse_b, int dim,
                    float* out, float* lse) {
  const float m = std::max(lse_a, lse_b);
  if (m == kNegInf) {
    std::fill(out, out + dim, 0.0f);
    if (lse) *lse = kNegInf;
    return;
  }
  const float wa = lse_a == kNegInf ? 0.0f : std::exp(lse_a - m);
  const float wb = lse_b == kNegInf ? 0.0f : std::exp(lse_b - m);
  const float inv = 1.0f / (wa + wb);
  for (int j = 0; j < dim; ++j) {
    const float a = wa > 0.0f ? wa * o_a[j] : 0.0f;
    const float b = wb > 0.0f ? wb * o_b[j] : 0.0f;
    out[j] = (a + b) * inv;
  }
  if (lse) *lse = m + std::log(wa + wb);
}

void AttendCompressedKvHead(const PageGeometry& geom, int num_q_heads, float scale,
                            const AttendItem& item, int h) {
  const int d = geom.head_dim;
  const int hkv = geom.kv_heads;
  const int g = num_q_heads / hkv;
  const int P = geom.page_tokens;
  const size_t row = geom.exact_row_elems();
  const float* q = item.q + size_t(h) * g * d;
  alignas(64) static thread_local float rowbuf[kChunk * kMaxDim];

  // Sink and recent: BF16, plain query.
  GroupState exact(g, d);
  for (int b = 0; b < item.num_exact; ++b) {
    const bf16_bits* kb = item.exact[b].block;
    const bf16_bits* vb = kb + size_t(P) * row;
    AccumulateTokens(
        exact, q, scale, item.exact[b].tokens,
        [&](int t, float* y) { Bf16RowToFloat(kb + t * row + size_t(h) * d, y, d); },
        [&](int t, float* y) { Bf16RowToFloat(vb + t * row + size_t(h) * d, y, d); }, rowbuf);
  }

  // History: rotated query, dequantized rotated keys and values.
  GroupState hist(g, d);
  if (item.num_pages > 0) {
    const float* rk = item.rotation.r_k + item.rotation.stride * h;
    std::vector<float> qr(size_t(g) * d, 0.0f);
    for (int i = 0; i < g; ++i) {
      float* y = &qr[size_t(i) * d];
      for (int a = 0; a < d; ++a) Axpy(q[size_t(i) * d + a], rk + size_t(a) * d, y, d);
    }
    for (int p = 0; p < item.num_pages; ++p) {
      const uint8_t* page = item.pages[p];
      const uint8_t* kc = page + geom.codes_offset(h, 0);
      const auto* kp = reinterpret_cast<const QuantParams*>(page + geom.params_offset(h, 0));
      const uint8_t* vc = page + geom.codes_offset(h, 1);
      const auto* vp = reinterpret_cast<const QuantParams*>(page + geom.params_offset(h, 1));
      AccumulateTokens(
          hist, qr.data(), scale, P,
          [&](int t, float* y) { DequantRow(kc, kp, t, d, geom.group_size, y); },
          [&](int t, float* y) { DequantRow(vc, vp, t, d, geom.group_size, y); }, rowbuf);
    }
  }

  // Normalize, un-rotate the history output (o · R_Vᵀ), merge.
  const float* rv = item.rotation.r_v + item.rotation.stride * h;
  std::vector<float> oe(d), oh(d);
  for (int i = 0; i < g; ++i) {
    const int qh = h * g + i;
    const float le = exact.Lse(i), lh = hist.Lse(i);
    for (int j = 0; j < d; ++j) oe[j] = exact.l[i] > 0 ? exact.acc[size_t(i) * d + j] / exact.l[i] : 0;
    if (hist.l[i] > 0) {
      const float* a = &hist.acc[size_t(i) * d];
      const float inv = 1.0f / hist.l[i];
      for (int j = 0; j < d; ++j) oh[j] = inv * Dot(a, rv + size_t(j) * d, d);  // (a·R_Vᵀ)_j
    } else {
      std::fill(oh.begin(), oh.end(), 0.0f);
    }
    MergeAttention(oe.data(), le, oh.data(), lh, d, item.out + size_t(qh) * d,
                   item.lse ? item.lse + qh : nullptr);
  }
}

void AttendBf16KvHead(const bf16_bits* k, const bf16_bits* v, int tokens, int kv_heads,
                      int head_dim, int num_q_heads, float scale, const float* q, float* out,
                      float* lse, int h) {
  const int d = head_dim;
  const int g = num_q_heads / kv_heads;
  const size_t row = size_t(kv_heads) * d;
  alignas(64) static thread_local float rowbuf[kChunk * kMaxDim];
  GroupState st(g, d);
  const float* qh = q + size_t(h) * g * d;
  AccumulateTokens(
      st, qh, scale, tokens,
      [&](int t, float* y) { Bf16RowToFloat(k + t * row + size_t(h) * d, y, d); },
      [&](int t, float* y) { Bf16RowToFloat(v + t * row + size_t(h) * d, y, d); }, rowbuf);
  for (int i = 0; i < g; ++i) {
    const int qi = h * g + i;
    for (int j = 0; j < d; ++j) {
      out[size_t(qi) * d + j] = st.l[i] > 0 ? st.acc[size_t(i) * d + j] / st.l[i] : 0.0f;
    }
    if (lse) lse[qi] = st.Lse(i);
  }
}

}  // namespace oscarkv
