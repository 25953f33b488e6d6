#include "kernels/cpu/attention_cpu.h"

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "kernels/host_vector.h"

namespace oscarkv {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int kMaxGroup = 64;   // query heads per kv head handled in one pass
constexpr int kMaxDim = 256;
constexpr int kChunk = 32;      // tokens whose logits are computed before one rescale

// The host's widest float vectors (kernels/host_vector.h): with AVX-512 the
// 16-float code this file was tuned with, else 8 floats, with LogitsTile's
// tile and WeightedRowSum's passes sized so that the accumulators stay in
// the 16 ymm.
using host_vector::kLanes;
using host_vector::Load;
using host_vector::Store;
using host_vector::VF;
using host_vector::VI;
inline float HSum(VF v) {
  float s = 0.0f;
  for (int l = 0; l < kLanes; ++l) s += v[l];
  return s;
}

// e^x for kLanes lanes, x <= 0 (logit minus running max): Cody–Waite range
// reduction x = n·ln2 + r and a degree-6 polynomial for e^r; relative error
// below 2e-7, and exactly 0 below -87.
inline VF ExpNonPositive(VF x) {
  const VF lo = x < -87.0f ? VF{} - 87.0f : x;  // lanes stay finite; masked to 0 below
  x = (x < -87.0f) ? lo : x;
  VF n = x * 1.44269504088896341f;
  // round to nearest: add and subtract 1.5·2^23
  n = (n + 12582912.0f) - 12582912.0f;
  VF r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  VF p = VF{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  VI ni = __builtin_convertvector(n, VI);
  VI bits = (ni + 127) << 23;
  VF scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  VF out = p * scale;
  VI under = x <= -87.0f;
  VF zero = {};
  return under ? zero : out;
}

// Per-thread scratch of kChunk rows, 64-byte aligned, on the heap: a static
// thread_local array this size would sit in every thread's static TLS block,
// which glibc carves out of the thread's stack, and overflows threads with
// small stacks (the metrics exposer's civetweb workers get 100 KiB).
inline float* ThreadRowBuffer() {
  static thread_local std::vector<float> storage(size_t(kChunk) * kMaxDim + 16);
  const auto addr = reinterpret_cast<uintptr_t>(storage.data());
  return reinterpret_cast<float*>((addr + 63) & ~uintptr_t{63});
}

inline float Dot(const float* a, const float* b, int n) {
  VF acc = {};
  for (int j = 0; j < n; j += kLanes) acc += Load(a + j) * Load(b + j);
  return HSum(acc);
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

// Logits of one key row against NQ query rows: the key chunk is loaded once,
// each query keeps a register accumulator.
template <int D, int NQ>
inline void DotN(const float* q, const float* k, float* out) {
  VF acc[NQ] = {};
  for (int j = 0; j < D; j += kLanes) {
    const VF kv = Load(k + j);
    for (int i = 0; i < NQ; ++i) acc[i] += Load(q + i * D + j) * kv;
  }
  for (int i = 0; i < NQ; ++i) out[i] = HSum(acc[i]);
}

// Lane i of one interleave-and-add round of width w over a pair (a, b):
// the shuffle indices of a's and b's lanes alternating in runs of w (b's
// index kLanes + j), e.g. w = 1: 0, 16, 2, 18, ... for 16 lanes; the round
// adds this and the same shifted by w.
constexpr int InterleaveLane(int i, int w) {
  return i / (2 * w) * (2 * w) + i % w + (i / w % 2) * kLanes;
}
template <int W, int... I>
inline VF InterleaveAdd(VF a, VF b, std::integer_sequence<int, I...>) {
  const VI lo = {InterleaveLane(I, W)...};
  const VI hi = lo + W;
  return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}
// Rounds W, 2W, ... < kLanes over the n vectors x (halved by each round).
template <int W>
inline void SumLanesRounds(VF* x, int n) {
  for (int m = 0; m < n / 2; ++m) {
    x[m] = InterleaveAdd<W>(x[2 * m], x[2 * m + 1], std::make_integer_sequence<int, kLanes>{});
  }
  if constexpr (2 * W < kLanes) SumLanesRounds<2 * W>(x, n / 2);
}

// r[k] = Σ_l a[k][l] for the kLanes vectors a[0..kLanes): log2(kLanes)
// rounds of pairwise interleave-and-add (kLanes - 1 adds and twice as many
// two-source shuffles), instead of kLanes horizontal sums of kLanes - 1
// dependent scalar adds each. Overwrites a.
inline VF SumLanes(VF (&a)[kLanes]) {
  SumLanesRounds<1>(a, kLanes);
  return a[0];
}

// logits[i][t] = scale · q_i·k_t for the g heads and the c rows of `tile`,
// kTileHeads heads x 4 tokens per step (4 x 4 with AVX-512, 2 x 4 with
// AVX2, so that the accumulators, keys and queries fit the registers): each
// loaded key vector feeds kTileHeads FMAs and each query vector 4, and the
// kLanes dot products are summed across lanes together (SumLanes).
// Rows past c are read (the tile holds kChunk rows) but not reported.
constexpr int kTileHeads = kLanes / 4;
template <int D>
inline void LogitsTile(const float* qs, int g, const float* tile, int c, float scale,
                       float (*logits)[kChunk]) {
  for (int i0 = 0; i0 < g; i0 += kTileHeads) {
    const int nh = std::min(kTileHeads, g - i0);
    const float* qh[kTileHeads];
    for (int h = 0; h < kTileHeads; ++h) qh[h] = qs + size_t(i0 + std::min(h, nh - 1)) * D;
    for (int t0 = 0; t0 < c; t0 += 4) {
      VF acc[kLanes] = {};
      for (int j = 0; j < D; j += kLanes) {
        VF kv[4], qv[kTileHeads];
        for (int tt = 0; tt < 4; ++tt) kv[tt] = Load(tile + (t0 + tt) * D + j);
        for (int h = 0; h < kTileHeads; ++h) qv[h] = Load(qh[h] + j);
        for (int h = 0; h < kTileHeads; ++h) {
          for (int tt = 0; tt < 4; ++tt) acc[4 * h + tt] += qv[h] * kv[tt];
        }
      }
      const VF r = SumLanes(acc) * scale;
      const int nt = std::min(4, c - t0);
      for (int h = 0; h < nh; ++h) {
        for (int tt = 0; tt < nt; ++tt) logits[i0 + h][t0 + tt] = r[4 * h + tt];
      }
    }
  }
}

template <int D>
inline void Logits(const float* q, int nq, const float* k, float* out) {
  switch (nq) {
    case 4: return DotN<D, 4>(q, k, out);
    case 3: return DotN<D, 3>(q, k, out);
    case 2: return DotN<D, 2>(q, k, out);
    default: return DotN<D, 1>(q, k, out);
  }
}

// Output columns per pass of WeightedRowSum, so that its accumulators stay
// in registers: all of D <= 256 with AVX-512 (at most 16 zmm), 64 with AVX2
// (8 ymm). Each output's sum over t keeps its order at any pass width.
#if defined(__AVX512F__)
constexpr int kRowSumColumns = 256;
#else
constexpr int kRowSumColumns = 64;
#endif

// acc[0..D) += Σ_t p[t] · tile[t][0..D), accumulating in registers.
template <int D>
inline void WeightedRowSum(const float* p, const float* tile, int c, float* acc) {
  constexpr int kCols = D < kRowSumColumns ? D : kRowSumColumns;
  constexpr int kVecs = kCols / kLanes;
  static_assert(D % kCols == 0 && kCols % kLanes == 0, "whole passes of whole vectors");
  for (int c0 = 0; c0 < D; c0 += kCols) {
    VF a[kVecs];
    for (int v = 0; v < kVecs; ++v) a[v] = Load(acc + c0 + kLanes * v);
    for (int t = 0; t < c; ++t) {
      const float w = p[t];
      const float* row = tile + t * D + c0;
      for (int v = 0; v < kVecs; ++v) a[v] += w * Load(row + kLanes * v);
    }
    for (int v = 0; v < kVecs; ++v) Store(acc + c0 + kLanes * v, a[v]);
  }
}

// Accumulates `n` tokens whose K and V rows are produced by the callbacks
// (each fills a float row of D), for all g heads with queries qs[g][D]. Rows
// are materialized a chunk at a time into an L1-sized tile. kTiled: logits
// 4 heads x 4 tokens at a time (LogitsTile), else token by token; measured
// (dev VM, 2026-11-29, RESULTS): tiled is 1.4x faster on dequantized pages
// and 10 % slower in the BF16 baseline (AttendBf16KvHead), which therefore
// runs untiled; the compressed path's few BF16 sink / recent blocks run tiled
// (not measured separately).
template <int D, bool kTiled, typename KRow, typename VRow>
void AccumulateTokensD(GroupState& st, const float* qs, float scale, int n, KRow&& krow,
                       VRow&& vrow, float* tile) {
  const int g = st.g;
  float logits[kMaxGroup][kChunk];
  for (int t0 = 0; t0 < n; t0 += kChunk) {
    const int c = std::min(kChunk, n - t0);
    for (int t = 0; t < c; ++t) krow(t0 + t, tile + t * D);
    if constexpr (kTiled) {
      LogitsTile<D>(qs, g, tile, c, scale, logits);
    } else {
      for (int t = 0; t < c; ++t) {
        float dots[4];
        for (int i0 = 0; i0 < g; i0 += 4) {
          const int nq = std::min(4, g - i0);
          Logits<D>(qs + size_t(i0) * D, nq, tile + t * D, dots);
          for (int i = 0; i < nq; ++i) logits[i0 + i][t] = scale * dots[i];
        }
      }
    }
    for (int i = 0; i < g; ++i) {
      float cm = kNegInf;
      for (int t = 0; t < c; ++t) cm = std::max(cm, logits[i][t]);
      const float mx = st.Rescale(i, cm);
      float sum = 0.0f;
      if (c == kChunk) {
        for (int t = 0; t < kChunk; t += kLanes) {
          const VF e = ExpNonPositive(Load(&logits[i][t]) - mx);
          Store(&logits[i][t], e);
          sum += HSum(e);
        }
      } else {
        for (int t = 0; t < c; ++t) {
          logits[i][t] = std::exp(logits[i][t] - mx);
          sum += logits[i][t];
        }
      }
      st.l[i] += sum;
    }
    for (int t = 0; t < c; ++t) vrow(t0 + t, tile + t * D);
    for (int i = 0; i < g; ++i) WeightedRowSum<D>(logits[i], tile, c, &st.acc[size_t(i) * D]);
  }
}

template <bool kTiled = false, typename KRow, typename VRow>
void AccumulateTokens(GroupState& st, const float* qs, float scale, int n, KRow&& krow,
                      VRow&& vrow, float* tile) {
  switch (st.d) {
    case 64: return AccumulateTokensD<64, kTiled>(st, qs, scale, n, krow, vrow, tile);
    case 128: return AccumulateTokensD<128, kTiled>(st, qs, scale, n, krow, vrow, tile);
    default: return AccumulateTokensD<256, kTiled>(st, qs, scale, n, krow, vrow, tile);
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
  float* const rowbuf = ThreadRowBuffer();

  // Sink and recent: BF16, plain query.
  GroupState exact(g, d);
  for (int b = 0; b < item.num_exact; ++b) {
    const bf16_bits* kb = item.exact[b].block;
    const bf16_bits* vb = kb + size_t(P) * row;
    AccumulateTokens</*kTiled=*/true>(
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
      for (int a = 0; a < d; ++a) {
        const float qa = q[size_t(i) * d + a];
        const float* ra = rk + size_t(a) * d;
        for (int j = 0; j < d; ++j) y[j] += qa * ra[j];
      }
    }
    const size_t head_bytes = geom.head_stride();  // K and V codes and params of head h
    for (int p = 0; p < item.num_pages; ++p) {
      const uint8_t* page = item.pages[p];
      // The pages are scattered in the pool: ask for the next page's bytes of
      // this head while this one is computed (its first rows otherwise stall
      // on memory).
      if (p + 1 < item.num_pages) {
        const uint8_t* next = item.pages[p + 1] + geom.codes_offset(h, 0);
        for (size_t b = 0; b < head_bytes; b += 64) __builtin_prefetch(next + b);
      }
      const uint8_t* kc = page + geom.codes_offset(h, 0);
      const auto* kp = reinterpret_cast<const QuantParams*>(page + geom.params_offset(h, 0));
      const uint8_t* vc = page + geom.codes_offset(h, 1);
      const auto* vp = reinterpret_cast<const QuantParams*>(page + geom.params_offset(h, 1));
      AccumulateTokens</*kTiled=*/true>(
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
  float* const rowbuf = ThreadRowBuffer();
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
