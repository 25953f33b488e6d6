// The history warp of split-kernel variants 6, 7 and 8: q·K and P·V both on
// the integer tensor cores (D = 128, one quantization group per row, at most 4
// query heads per kv head). Included by attend_kernels.cu only.
//
// Each thread (r = lane/4, c = lane%4) owns one query head, hh = c, of the
// group, so the softmax of a chunk runs once per (token, head) instead of on
// two lanes of each pair (HistoryWarp):
//   q·K: m16n8k32 u8·s8 as in HistoryWarp's kIntQK, with the query digit
//        columns paired per head (column n of tile t: digit 2t + n%2 of head
//        n/2; the prep kernel writes this layout for int_qk == 2), so the
//        thread's own C columns 2c, 2c+1 hold all four digits of head c.
//   P·V: m16n8k32 u8·u8. A = 16 dims x 32 tokens of V codes as u8 values
//        c·4^k: the thread's four loaded words (dim bytes 4r..4r+3 of tokens
//        16τ + {2c, 2c+1, 2c+8, 2c+9}) transposed bytewise (8 PRMT per 16
//        tokens), then one AND per 4 codes. B = P' = p·s_V in 24-bit fixed
//        point, as three base-256 digits per head, scaled per chunk by
//        S = max p · max s_V >= max P' (the chunk's max logit is known from
//        the softmax; max s_V is reduced off the critical path),
//        moved from the C layout (token rows) to the B layout (token columns)
//        with movmatrix. One MMA takes the two high digits (columns 2h,
//        2h+1), a second the low one (columns 2h; 2h+1 are zero). int32 per
//        chunk, added into fp32 as scl·(digits' value), scl = S / (2^24 − 1).
// Accuracy: P' is kept to about 2^-23 of S per token (rounding to the grid
// plus the fp32 product p·s_V·(1/scl)), S up to ~10x the typical P' of a
// chunk: 1.2e-6 relative error vs fp64 (Qwen3 shape, H200, 2026-11-29;
// HistoryWarp's bf16 hi + lo P': 2.2e-6).
//
// kDigits = 2 (variants 8-17 and 19; 14 and 15 run by default): P' in 16-bit fixed point of S = the
// chunk's exact max P' per head (one more 3-step max reduction, after the
// exponentials), one MMA per 16 dims, about a third fewer instructions in
// P·V. Each term is kept to 2^-17 of the chunk's largest (fp16's precision
// for the largest P' of each chunk), and the codes' min term (exact) cancels
// part of the code term: relative L2 errors vs fp64 of 1e-5..6.3e-5 on the
// tests' inputs (Qwen3 shape 4.0e-5), up to 5e-4·(1 + |o|) for single
// elements near zero, against ~0.25 for the 2-bit cache itself vs BF16
// attention; 5-7 % faster than 24 bits at 64K-128K tokens and B8 (H200,
// 2026-11-29, tests/bench/RESULTS.md run 13). With S the bound
// (max p)·(max s_V) instead of the exact max, 16 bits measured 1.0e-4 (run 11).
// Unlike HistoryWarp, a NaN V scale (a corrupt page; the encoder writes
// finite scales >= 0) drops that token's P'·codes term instead of turning the
// output into NaN; its min term still counts.
#ifndef OSCARKV_KERNELS_CUDA_ATTEND_HISTORY_INT_CUH_
#define OSCARKV_KERNELS_CUDA_ATTEND_HISTORY_INT_CUH_

#include <cfloat>

#include "kernels/cuda/attend_history.cuh"

namespace oscarkv {
namespace cuda_attend {

// kDigits = 3: P' in 24-bit fixed point of S = (max p) · (max s_V) >= P', two
// MMAs per 16 dims; kDigits = 2: 16 bits of S = the exact max of P' over the
// chunk's tokens, one MMA per 16 dims (Accumulate16).
//
// kShortChain (kDigits = 2 only; variant 12): the same products with fewer
// steps on each chunk's dependency chain, which is what limits the loop
// (session 18 measured ~0.5 instruction per cycle per scheduler issued in it,
// RESULTS run 23):
//   - S = max P' from the logits' own max reduction: S = 2^(max(lg + log2
//     s_V) − m), the max riding in the same shuffle steps as the logits' max
//     (log2 s_V is taken when the scales arrive, off the chain), instead of
//     a second 3-step reduction after the exponentials. lg + log2 s_V rounds
//     at the logit's magnitude, so S can be ulp(|lg|)·ln 2 / 2 below the
//     largest P' (2e-5 of it at |lg| ~ 1000): P' is kept in units of
//     S / 65531, 4 below the digits' range, so such a P' still fits (the
//     digit clamp at 65535 bounds anything beyond);
//   - 1/S by rcp.approx, not a range-checked division;
//   - cumulative code masks in P·V: field k's MMA takes the byte's fields
//     0..k (masks 0x03, 0x0F, 0x3F, none: the last needs no AND), and Finish
//     takes the differences of adjacent accumulators. Exact in int32 (A <=
//     255: 256·acc + acc' <= 32·255·255·257 = 534,765,600 < 2^31).
template <int D, int NG, bool G8, int kDigits = 3, bool kShortChain = false>
struct HistoryWarpIntPv : ChunkLoads<D, NG, G8> {
  // P' in fixed point of the chunk's scale S.
  static constexpr float kFixedMax = kDigits == 3 ? 16777215.0f : 65535.0f;
  static_assert(kDigits == 2 || kDigits == 3, "two or three base-256 digits");
  static_assert(!kShortChain || kDigits == 2, "the short chain is the 16-bit path's");
  static_assert(D == 128 && NG == 1 && !G8, "integer P·V: D = 128, one group, g <= 4");
  using Base = ChunkLoads<D, NG, G8>;
  using typename Base::C;
  using typename Base::Regs;
  using Base::c;
  using Base::r;

  uint32_t qb[2][4][2];  // query digit fragments [n-tile][code field][reg]
  float mult, qsum;      // head c's digit-scale multiplier and Σq'
  float m, l, vlo;       // online softmax state of head c (vlo = Σ p·min_V)
  // P'·(V codes) of head c: [code field k][byte pair bp][row r / r+8], i.e.
  // dim 4r + 2bp + e + 32k, times 4^k.
  float o[4][2][2];

  __device__ void InitQuery(const LaunchArgs& a, int item, int h, int lane) {
    LoadDigitFragments(a.qfrag + (size_t(item) * a.PlanHeads() + h) * (2 * 4 * 2 * 32), lane,
                       qb);
    const bool valid = c < a.g;
    const float* meta = a.qmeta + (size_t(item) * a.hq + h * a.g + (valid ? c : 0)) * kQueryMetaFloats;
    mult = valid ? meta[0] : 0.0f;
    qsum = valid ? meta[1] : 0.0f;
    m = -INFINITY;
    l = 0.0f;
    vlo = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k)
#pragma unroll
      for (int bp = 0; bp < 2; ++bp) o[k][bp][0] = o[k][bp][1] = 0.0f;
  }

  __device__ __forceinline__ void Process(const Regs& x) {
    float lg[2][2];
    Logits(x, lg);
    Accumulate(x, lg);
  }

  // For ProcessChunk's benchmark stand-ins.
  static constexpr int kLogitsPerTile = 2;
  __device__ __forceinline__ float& AblationSink() { return l; }

  // Logits (base 2) of head c for tokens 16τ + r + 8e.
  __device__ __forceinline__ void Logits(const Regs& x, float (&lg)[2][2]) const {
#pragma unroll
    for (int tau = 0; tau < 2; ++tau) LogitsTile(x, tau, lg[tau]);
  }

  // Logits of the chunk's 16-token tile tau (tokens 16τ + r + 8e, e = 0, 1).
  __device__ __forceinline__ void LogitsTile(const Regs& x, int tau, float (&lgt)[2]) const {
    int s[2][4];
    DigitSums(x, tau, qb, s);
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      // Digits 0..3 of head c: tile 0 columns 2c, 2c+1, tile 1 the same.
      const uint32_t kp = x.kp[2 * tau + e][0];
      lgt[e] = fmaf(mult * ParamScale(kp), DigitDot(s[0], s[1], e), ParamMin(kp) * qsum);
    }
  }

  // This lane's words of NT n-tiles of query digit fragments, from a plan
  // head's fragments as the prep kernel writes them (also HistoryWarpIntPv8's,
  // with 4).
  template <int NT>
  static __device__ __forceinline__ void LoadDigitFragments(const uint32_t* qf, int lane,
                                                            uint32_t (&q)[NT][4][2]) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int k = 0; k < 4; ++k)
#pragma unroll
        for (int rg = 0; rg < 2; ++rg) q[nt][k][rg] = qf[((nt * 4 + k) * 2 + rg) * 32 + lane];
  }

  // The q·K MMAs of the chunk's 16-token tile tau against NT n-tiles of
  // query digits (any chunk registers of D = 128: also HistoryWarpIntPv8's,
  // with 4): s[t] = tile t's C fragment. Each code field's A fragment (one
  // AND per 4 codes) serves every tile.
  template <int NT, class R>
  static __device__ __forceinline__ void DigitSums(const R& x, int tau,
                                                   const uint32_t (&q)[NT][4][2],
                                                   int (&s)[NT][4]) {
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[t][e] = 0;
    const uint32_t x0 = x.kc[2 * tau][0], x0b = x.kc[2 * tau][1];
    const uint32_t x1 = x.kc[2 * tau + 1][0], x1b = x.kc[2 * tau + 1][1];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t msk = 0x03030303u << (2 * k);
      const uint32_t a0 = x0 & msk, a1 = x1 & msk, a2 = x0b & msk, a3 = x1b & msk;
#pragma unroll
      for (int t = 0; t < NT; ++t) ImmaU8S8(s[t], a0, a1, a2, a3, q[t][k][0], q[t][k][1]);
    }
  }

  // A head's q'·codes for token row r + 8e from its digit sums: lo = the C
  // fragment of the tile with its digits 0, 1 (columns 2c, 2c+1), hi = that
  // of digits 2, 3. Pairs combined in int32 (|s| <= 128 · 192 · 64 < 2^21,
  // so 128·s + s' < 2^29): dot = (128 d0 + d1) / 128 + (128 d2 + d3) / 128^3.
  static __device__ __forceinline__ float DigitDot(const int (&lo)[4], const int (&hi)[4],
                                                   int e) {
    const int v01 = lo[2 * e] * 128 + lo[2 * e + 1];
    const int v23 = hi[2 * e] * 128 + hi[2 * e + 1];
    return fmaf(static_cast<float>(v23), 4.76837158203125e-07f,
                static_cast<float>(v01) * 0.0078125f);
  }

  // The online softmax's step to a chunk: its max logit for head c (over
  // the warp's 32 tokens; returned), the running max m moved to cover it, and
  // l, vlo and the accumulators rescaled to the new m.
  // kAlso: `also` (a lane's value for head c) is reduced to its max over the
  // same lanes in the same shuffle steps.
  template <bool kAlso = false>
  __device__ __forceinline__ float MoveMax(const float (&lg)[2][2], float* also = nullptr) {
    float cm = fmaxf(fmaxf(lg[0][0], lg[0][1]), fmaxf(lg[1][0], lg[1][1]));
#pragma unroll
    for (int off = 4; off <= 16; off <<= 1) {
      cm = fmaxf(cm, __shfl_xor_sync(kFull, cm, off));
      if constexpr (kAlso) *also = fmaxf(*also, __shfl_xor_sync(kFull, *also, off));
    }
    const float mn = fmaxf(m, cm);
    const float f = FastExp2(m - mn);
    m = mn;
    l *= f;
    vlo *= f;
    if (__any_sync(kFull, f != 1.0f)) {
#pragma unroll
      for (int k = 0; k < 4; ++k)
#pragma unroll
        for (int bp = 0; bp < 2; ++bp) {
          o[k][bp][0] *= f;
          o[k][bp][1] *= f;
        }
    }
    return cm;
  }

  // V codes: word r of tokens 16τ + {2c, 2c+1, 2c+8, 2c+9} -> t[τ][j] = dim
  // byte 4r + j of those four tokens (the P·V MMA's A rows, before masking).
  // (Any chunk registers of D = 128: also HistoryWarpIntPv8's.)
  template <class R>
  static __device__ __forceinline__ void VCodeBytes(const R& x, uint32_t (&t)[2][4]) {
#pragma unroll
    for (int tau = 0; tau < 2; ++tau) {
      const uint32_t v0 = x.vc[tau][0][0], v1 = x.vc[tau][1][0];
      const uint32_t v2 = x.vc[tau][2][0], v3 = x.vc[tau][3][0];
      const uint32_t lo01 = Prmt(v0, v1, 0x5140u), hi01 = Prmt(v0, v1, 0x7362u);
      const uint32_t lo23 = Prmt(v2, v3, 0x5140u), hi23 = Prmt(v2, v3, 0x7362u);
      t[tau][0] = Prmt(lo01, lo23, 0x5410u);
      t[tau][1] = Prmt(lo01, lo23, 0x7632u);
      t[tau][2] = Prmt(hi01, hi23, 0x5410u);
      t[tau][3] = Prmt(hi01, hi23, 0x7632u);
    }
  }

  // The P·V MMA's A fragment for code field k and byte pair bp (16 dims x 32
  // tokens of V codes as u8 values c·4^k), from VCodeBytes' t: one AND per
  // 4 codes.
  // With kShortChain, fields 0..k (c_0 + 4 c_1 + ... + 4^k c_k).
  static __device__ __forceinline__ void FieldFragment(const uint32_t (&t)[2][4], int k, int bp,
                                                       uint32_t (&a)[4]) {
    // Per byte: field k alone (0x03 << 2k), or with kShortChain fields 0..k
    // (4^(k+1) - 1: 0x03, 0x0F, 0x3F, 0xFF; k is a constant after
    // unrolling, so the last AND compiles away).
    const uint32_t msk = kShortChain ? ((1u << (2 * k + 2)) - 1u) * 0x01010101u
                                     : 0x03030303u << (2 * k);
    a[0] = t[0][2 * bp] & msk;
    a[1] = t[0][2 * bp + 1] & msk;
    a[2] = t[1][2 * bp] & msk;
    a[3] = t[1][2 * bp + 1] & msk;
  }

  // Online softmax and O' += P'V for one chunk, from its logits and V half.
  __device__ __forceinline__ void Accumulate(const Regs& x, const float (&lg)[2][2]) {
    if constexpr (kDigits == 2) {
      Accumulate16(x, lg);
      return;
    }
    // The max s_V of the chunk's tokens (independent of the logits).
    float sv[4], smax = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      sv[i] = ParamScale(x.vp[i][0]);
      smax = fmaxf(smax, sv[i]);
    }
#pragma unroll
    for (int off = 4; off <= 16; off <<= 1) smax = fmaxf(smax, __shfl_xor_sync(kFull, smax, off));

    const float cm = MoveMax(lg);
    const float mn = m;
    // P' in 24-bit fixed point of S = (max p of the chunk) · smax >= P',
    // as base-256 digits: tile 0 columns 2h, 2h+1 = the two high digits of
    // head h, tile 1 column 2h = the low digit, 2h+1 = 0.
    const float scl = FastExp2(cm - mn) * smax * (1.0f / kFixedMax);
    // A scl too small to invert (S below ~2^-102, so p is negligible against
    // l >= 1) drops the chunk's P' terms, as when the exp2 flushes to 0.
    const float inv = scl >= FLT_MIN ? __frcp_rn(scl) : 0.0f;
    uint32_t pb[2][2];
#pragma unroll
    for (int tau = 0; tau < 2; ++tau) {
      uint32_t w[2], wlo[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float p = FastExp2(lg[tau][e] - mn);
        l += p;
        vlo = fmaf(p, ParamMin(x.vp[2 * tau + e][0]), vlo);
        const uint32_t u = min(__float2uint_rn(p * sv[2 * tau + e] * inv), uint32_t(kFixedMax));
        // (token, col 2c) = the highest digit, col 2c+1 = the next.
        w[e] = Prmt(u, 0u, 0x4142u);
        wlo[e] = u & 0xffu;  // col 2c = the low digit, col 2c+1 = 0
      }
      // Tokens {2c, 2c+1} (rows r) and {2c+8, 2c+9} (rows r+8) of column r.
      pb[0][tau] = Prmt(TransposeM8N8(w[0]), TransposeM8N8(w[1]), 0x6420u);
      pb[1][tau] = Prmt(TransposeM8N8(wlo[0]), TransposeM8N8(wlo[1]), 0x6420u);
    }
    AddCodeProducts(x, scl, [&](const uint32_t(&a)[4]) {
      int acc[4], acc_lo[4];
      ImmaU8U8(acc, a[0], a[1], a[2], a[3], pb[0][0], pb[0][1]);
      ImmaU8U8(acc_lo, a[0], a[1], a[2], a[3], pb[1][0], pb[1][1]);
      // Exact in int32: |acc| <= 32 · 192 · 255, so 256·acc + acc' < 2^31.
      return make_float2(fmaf(static_cast<float>(acc[0] * 256 + acc[1]), 256.0f,
                              static_cast<float>(acc_lo[0])),
                         fmaf(static_cast<float>(acc[2] * 256 + acc[3]), 256.0f,
                              static_cast<float>(acc_lo[2])));
    });
  }

  // Accumulate with 16-bit P' of the chunk's exact max (kDigits == 2).
  __device__ __forceinline__ void Accumulate16(const Regs& x, const float (&lg)[2][2]) {
    // kShortChain: the max over the chunk of lg + log2 s_V, reduced with the
    // logits' max (fmaxf skips a NaN scale's NaN; a zero scale gives -inf).
    float lgs = -INFINITY;
    if constexpr (kShortChain) {
#pragma unroll
      for (int tau = 0; tau < 2; ++tau)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          lgs = fmaxf(lgs, lg[tau][e] + FastLog2(ParamScale(x.vp[2 * tau + e][0])));
        }
    }
    MoveMax<kShortChain>(lg, &lgs);
    const float mn = m;
    // P' = p·s_V per token; S = its max over the chunk's 32 tokens (fmaxf
    // skips a NaN scale, whose token then gets digit 0).
    float pv[2][2], smax = 0.0f;
#pragma unroll
    for (int tau = 0; tau < 2; ++tau)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float p = FastExp2(lg[tau][e] - mn);
        l += p;
        vlo = fmaf(p, ParamMin(x.vp[2 * tau + e][0]), vlo);
        pv[tau][e] = p * ParamScale(x.vp[2 * tau + e][0]);
        if constexpr (!kShortChain) smax = fmaxf(smax, pv[tau][e]);
      }
    if constexpr (kShortChain) {
      smax = FastExp2(lgs - mn);  // 0 when every scale is 0 (or NaN)
    } else {
#pragma unroll
      for (int off = 4; off <= 16; off <<= 1) smax = fmaxf(smax, __shfl_xor_sync(kFull, smax, off));
    }
    // An S too small to matter (p negligible against l >= 1) drops the
    // chunk's P' terms. kShortChain: S in kUnits units, 4 below the digits'
    // range, so a max P' up to 6e-5 above S (S's rounding, at logits up to
    // |lg| ~ 2900) still fits without the clamp.
    constexpr float kUnits = kShortChain ? kFixedMax - 4.0f : kFixedMax;
    const bool live = smax >= 1e-30f;
    const float scl = live ? smax * (1.0f / kUnits) : 0.0f;
    const float inv = !live ? 0.0f : kShortChain ? kUnits * FastRcp(smax)
                                                 : __fdividef(kFixedMax, smax);
    uint32_t pb[2];
#pragma unroll
    for (int tau = 0; tau < 2; ++tau) {
      uint32_t w[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const uint32_t u = min(__float2uint_rn(pv[tau][e] * inv), uint32_t(kFixedMax));
        // (token, col 2c) = the high digit, col 2c+1 = the low one.
        w[e] = Prmt(u, 0u, 0x4041u);
      }
      pb[tau] = Prmt(TransposeM8N8(w[0]), TransposeM8N8(w[1]), 0x6420u);
    }
    AddCodeProducts(x, scl, [&](const uint32_t(&a)[4]) {
      int acc[4];
      ImmaU8U8(acc, a[0], a[1], a[2], a[3], pb[0], pb[1]);
      // Exact in int32: |acc| <= 32 · 192 · 255 (kShortChain: 32 · 255 · 255),
      // so 256·acc + acc' < 2^31.
      return make_float2(static_cast<float>(acc[0] * 256 + acc[1]),
                         static_cast<float>(acc[2] * 256 + acc[3]));
    });
  }

  // O' += scl · (P' · V codes) for the chunk: the V codes' A fragment of each
  // code field and byte pair goes to `products`, which runs the P·V MMAs and
  // returns the two rows' sums (r, r + 8) in units of scl.
  template <class Products>
  __device__ __forceinline__ void AddCodeProducts(const Regs& x, float scl, Products products) {
    uint32_t t[2][4];
    VCodeBytes(x, t);
#pragma unroll
    for (int k = 0; k < 4; ++k)
#pragma unroll
      for (int bp = 0; bp < 2; ++bp) {
        uint32_t a[4];
        FieldFragment(t, k, bp, a);
        const float2 sum = products(a);
        o[k][bp][0] = fmaf(scl, sum.x, o[k][bp][0]);
        o[k][bp][1] = fmaf(scl, sum.y, o[k][bp][1]);
      }
  }

  // A head's accumulator acc ([code field k][byte pair bp][row r / r + 8],
  // as o) plus its min term vlo into out[4r + 2bp + e + 32k]: field k times
  // 4^-k (kShortChain: acc[k] holds fields 0..k, field k alone is the
  // difference). Also HistoryWarpIntPv8's, per head.
  static __device__ __forceinline__ void StoreHeadOutput(const float (&acc)[4][2][2], float vlo,
                                                         int r, float* out) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float ks = k == 0 ? 1.0f : k == 1 ? 0.25f : k == 2 ? 0.0625f : 0.015625f;
#pragma unroll
      for (int bp = 0; bp < 2; ++bp)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float field =
              kShortChain && k > 0 ? acc[k][bp][e] - acc[k - 1][bp][e] : acc[k][bp][e];
          out[4 * r + 2 * bp + e + 32 * k] = fmaf(ks, field, vlo);
        }
    }
  }

  // Reduces l and vlo over the warp and writes head c's (m, l, acc) into
  // shared memory (acc in the rotated basis, un-normalized).
  __device__ void Finish(int g, float (*sm_o)[D], float* sm_m, float* sm_l) {
#pragma unroll
    for (int off = 4; off <= 16; off <<= 1) {
      l += __shfl_xor_sync(kFull, l, off);
      vlo += __shfl_xor_sync(kFull, vlo, off);
    }
    if (c >= g) return;
    StoreHeadOutput(o, vlo, r, sm_o[c]);
    if (r == 0) {
      sm_m[c] = m;
      sm_l[c] = l;
    }
  }
};

}  // namespace cuda_attend
}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_CUDA_ATTEND_HISTORY_INT_CUH_
