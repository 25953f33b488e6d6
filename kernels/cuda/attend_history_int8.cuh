// The history warp of 5-8 query heads per kv head on the integer tensor cores
// (D = 128, one quantization group per row): HistoryWarpIntPv's 16-bit P'
// and short chunk chain (variants 14 and 19), with each chunk's codes
// dequantized once for the 8 heads. Included by attend_kernels.cu only.
//
// Thread (r = lane/4, c = lane%4) owns query heads c and c + 4 (j = 0, 1):
//   q·K: m16n8k32 u8·s8 against 4 n-tiles of query digits, tiles 2j and
//        2j + 1 = head 4j + n/2's digits 2t + n%2 in column n of tile 2j + t
//        (HistoryWarpIntPv's paired layout, twice; the prep kernel writes it
//        for int_qk == 2 at 8 heads), so the thread's C columns 2c, 2c + 1 of
//        tiles 2j, 2j + 1 hold all four digits of head c + 4j. The A
//        fragments (code fields masked from the packed bytes) serve all 4.
//   P·V: m16n8k32 u8·u8, one A fragment of V codes per (code field, byte
//        pair) for two MMAs, one per n-tile of P' (tile j: heads 4j..4j+3,
//        two digits each, in 16-bit fixed point of each head's chunk max).
// Against two plan heads of 4 (paired heads, which dequantize and load every
// chunk twice) the loads, the code masks and the V byte transposes are done
// once; the MMAs, the softmax and the accumulators are per head either way.
// Same products per head as HistoryWarpIntPv<.., 2 digits, kShortChain>, so
// the same accuracy (16-bit P': relative L2 ~4e-5, single elements up to
// ~5e-4·(1 + |o|)).
#ifndef OSCARKV_KERNELS_CUDA_ATTEND_HISTORY_INT8_CUH_
#define OSCARKV_KERNELS_CUDA_ATTEND_HISTORY_INT8_CUH_

#include "kernels/cuda/attend_history_int.cuh"

namespace oscarkv {
namespace cuda_attend {

template <int D, int NG, bool G8>
struct HistoryWarpIntPv8 : ChunkLoads<D, NG, G8> {
  static_assert(D == 128 && NG == 1 && G8, "integer P·V at 8 heads: D = 128, one group");
  using Base = ChunkLoads<D, NG, G8>;
  using typename Base::C;
  using typename Base::Regs;
  using Base::c;
  using Base::r;
  // The 4-head warp whose V code fragments (and fixed point) this one shares.
  using Four = HistoryWarpIntPv<D, NG, false, 2, true>;
  static constexpr float kFixedMax = Four::kFixedMax;

  uint32_t qb[4][4][2];  // query digit fragments [n-tile][code field][reg]
  float mult[2], qsum[2];    // heads c, c + 4: digit-scale multipliers and Σq'
  float m[2], l[2], vlo[2];  // their online softmax state (vlo = Σ p·min_V)
  // P'·(V codes) of head c + 4j: [j][code fields 0..k][byte pair bp][row r /
  // r + 8], i.e. dim 4r + 2bp + e + 32k (cumulative fields, as kShortChain).
  float o[2][4][2][2];

  __device__ void InitQuery(const LaunchArgs& a, int item, int h, int lane) {
    Four::LoadDigitFragments(a.qfrag + (size_t(item) * a.PlanHeads() + h) * (4 * 4 * 2 * 32),
                             lane, qb);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int hh = c + 4 * j;
      const bool valid = hh < a.g;
      const float* meta =
          a.qmeta + (size_t(item) * a.hq + h * a.g + (valid ? hh : 0)) * kQueryMetaFloats;
      mult[j] = valid ? meta[0] : 0.0f;
      qsum[j] = valid ? meta[1] : 0.0f;
      m[j] = -INFINITY;
      l[j] = 0.0f;
      vlo[j] = 0.0f;
#pragma unroll
      for (int k = 0; k < 4; ++k)
#pragma unroll
        for (int bp = 0; bp < 2; ++bp) o[j][k][bp][0] = o[j][k][bp][1] = 0.0f;
    }
  }

  __device__ __forceinline__ void Process(const Regs& x) {
    float lg[2][4];
    Logits(x, lg);
    Accumulate(x, lg);
  }

  // lg[τ][2j + e]: head c + 4j, token 16τ + r + 8e.
  static constexpr int kLogitsPerTile = 4;
  __device__ __forceinline__ float& AblationSink() { return l[0]; }

  __device__ __forceinline__ void Logits(const Regs& x, float (&lg)[2][4]) const {
#pragma unroll
    for (int tau = 0; tau < 2; ++tau) LogitsTile(x, tau, lg[tau]);
  }

  // Logits of the chunk's 16-token tile tau for both heads.
  __device__ __forceinline__ void LogitsTile(const Regs& x, int tau, float (&lgt)[4]) const {
    int s[4][4];
    Four::DigitSums(x, tau, qb, s);
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const uint32_t kp = x.kp[2 * tau + e][0];
      const float ks = ParamScale(kp), kmin = ParamMin(kp);
      // As HistoryWarpIntPv::LogitsTile, from tiles 2j (digits 0, 1) and
      // 2j + 1 (digits 2, 3).
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        lgt[2 * j + e] =
            fmaf(mult[j] * ks, Four::DigitDot(s[2 * j], s[2 * j + 1], e), kmin * qsum[j]);
      }
    }
  }

  // Online softmax and O' += P'V for one chunk (HistoryWarpIntPv's
  // Accumulate16 with kShortChain, per head).
  __device__ __forceinline__ void Accumulate(const Regs& x, const float (&lg)[2][4]) {
    float sv[2][2], lsv[2][2];
#pragma unroll
    for (int tau = 0; tau < 2; ++tau)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        sv[tau][e] = ParamScale(x.vp[2 * tau + e][0]);
        lsv[tau][e] = FastLog2(sv[tau][e]);
      }
    // Per head: the max logit and the max of lg + log2 s_V over the chunk.
    float cm[2], lgs[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      cm[j] = fmaxf(fmaxf(lg[0][2 * j], lg[0][2 * j + 1]), fmaxf(lg[1][2 * j], lg[1][2 * j + 1]));
      lgs[j] = -INFINITY;
#pragma unroll
      for (int tau = 0; tau < 2; ++tau)
#pragma unroll
        for (int e = 0; e < 2; ++e) lgs[j] = fmaxf(lgs[j], lg[tau][2 * j + e] + lsv[tau][e]);
    }
#pragma unroll
    for (int off = 4; off <= 16; off <<= 1) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        cm[j] = fmaxf(cm[j], __shfl_xor_sync(kFull, cm[j], off));
        lgs[j] = fmaxf(lgs[j], __shfl_xor_sync(kFull, lgs[j], off));
      }
    }
    float f[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float mn = fmaxf(m[j], cm[j]);
      f[j] = FastExp2(m[j] - mn);
      m[j] = mn;
      l[j] *= f[j];
      vlo[j] *= f[j];
    }
    if (__any_sync(kFull, f[0] != 1.0f || f[1] != 1.0f)) {
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int k = 0; k < 4; ++k)
#pragma unroll
          for (int bp = 0; bp < 2; ++bp) {
            o[j][k][bp][0] *= f[j];
            o[j][k][bp][1] *= f[j];
          }
    }
    constexpr float kUnits = kFixedMax - 4.0f;  // as kShortChain's
    float scl[2];
    uint32_t pb[2][2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float mn = m[j];
      const float smax = FastExp2(lgs[j] - mn);
      const bool live = smax >= 1e-30f;
      scl[j] = live ? smax * (1.0f / kUnits) : 0.0f;
      const float inv = live ? kUnits * FastRcp(smax) : 0.0f;
#pragma unroll
      for (int tau = 0; tau < 2; ++tau) {
        uint32_t w[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float p = FastExp2(lg[tau][2 * j + e] - mn);
          l[j] += p;
          vlo[j] = fmaf(p, ParamMin(x.vp[2 * tau + e][0]), vlo[j]);
          const uint32_t u = min(__float2uint_rn(p * sv[tau][e] * inv), uint32_t(kFixedMax));
          w[e] = Prmt(u, 0u, 0x4041u);  // (token, col 2c) high digit, col 2c+1 low
        }
        pb[j][tau] = Prmt(TransposeM8N8(w[0]), TransposeM8N8(w[1]), 0x6420u);
      }
    }
    uint32_t t[2][4];
    Four::VCodeBytes(x, t);
#pragma unroll
    for (int k = 0; k < 4; ++k)
#pragma unroll
      for (int bp = 0; bp < 2; ++bp) {
        uint32_t a[4];
        Four::FieldFragment(t, k, bp, a);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          int acc[4];
          ImmaU8U8(acc, a[0], a[1], a[2], a[3], pb[j][0], pb[j][1]);
          o[j][k][bp][0] = fmaf(scl[j], static_cast<float>(acc[0] * 256 + acc[1]), o[j][k][bp][0]);
          o[j][k][bp][1] = fmaf(scl[j], static_cast<float>(acc[2] * 256 + acc[3]), o[j][k][bp][1]);
        }
      }
  }

  // Reduces l and vlo over the warp and writes heads c and c + 4's (m, l,
  // acc) into shared memory (acc in the rotated basis, un-normalized).
  __device__ void Finish(int g, float (*sm_o)[D], float* sm_m, float* sm_l) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int off = 4; off <= 16; off <<= 1) {
        l[j] += __shfl_xor_sync(kFull, l[j], off);
        vlo[j] += __shfl_xor_sync(kFull, vlo[j], off);
      }
      const int hh = c + 4 * j;
      if (hh >= g) continue;
      Four::StoreHeadOutput(o[j], vlo[j], r, sm_o[hh]);
      if (r == 0) {
        sm_m[hh] = m[j];
        sm_l[hh] = l[j];
      }
    }
  }
};

}  // namespace cuda_attend
}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_CUDA_ATTEND_HISTORY_INT8_CUH_
