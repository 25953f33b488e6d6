// The encode's row helpers, one warp per row (or R rows): the clip
// threshold (ClipThresholdsWarp), and clamp, quantize and pack
// (QuantizeRowsWarp). Included by codec_kernels.cu (and, through it,
// encode_strips.cuh), and by the warp emulation's test of them
// (tests/gpu/encode_rows_emulation_test.cc), which compares them with the CPU
// codec on the CPU.
#ifndef OSCARKV_KERNELS_CUDA_ENCODE_ROWS_CUH_
#define OSCARKV_KERNELS_CUDA_ENCODE_ROWS_CUH_

#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/page_format.h"
#include "kernels/quantize.h"

namespace oscarkv {
namespace cuda_encode {

// Clip threshold by repeated max extraction when it is among the largest
// kMaxExtraction magnitudes of the row (else a 31-step bitwise search).
constexpr bool kUseMaxExtraction = true;
constexpr int kMaxExtraction = 24;

__device__ __forceinline__ int DeviceClipRank(float ratio, int n) {
  int k = static_cast<int>(ceil(static_cast<double>(ratio) * n - 1e-9));
  return min(max(k, 1), n);
}

// Sorts n unsigned values in registers, largest first (an unrolled exchange
// network; n is a lane's element count, 2..8).
template <int N>
__device__ __forceinline__ void SortDescending(uint32_t (&a)[N]) {
  const auto exchange = [&](int j, int k) {
    const uint32_t hi = max(a[j], a[k]), lo = min(a[j], a[k]);
    a[j] = hi;
    a[k] = lo;
  };
  if constexpr (N == 4) {  // the optimal network: 5 exchanges instead of 6
    exchange(0, 1);
    exchange(2, 3);
    exchange(0, 2);
    exchange(1, 3);
    exchange(1, 2);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) {
#pragma unroll
      for (int j = (i & 1); j + 1 < N; j += 2) exchange(j, j + 1);
    }
  }
}

// The clip threshold's rank from the top for head dim D: the ClipRank-th
// smallest |y| is the (D - k + 1)-th largest; 0 for ratios >= 1 (no clipping).
__device__ __forceinline__ int ClipTopRank(float clip, int dim) {
  return clip < 1.0f ? dim - DeviceClipRank(clip, dim) + 1 : 0;
}

// Clip thresholds of R rotated rows held in shared memory; one warp, the R
// searches interleaved so their reductions overlap. tau = the top-th largest
// |y| (top from ClipTopRank), found on the float bits of |y| (monotone for
// non-negative floats): exactly nth_element's answer. Rows with top = 0 get
// tau = +inf (no clipping).
template <int D, int R>
__device__ void ClipThresholdsWarp(const float* const (&yrows)[R], const int (&top)[R],
                                   float (&tau)[R], int lane) {
  constexpr int E = D / 32;
  uint32_t u[R][E], x[R];
  int max_top = 0;
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int i = 0; i < E; ++i) u[r][i] = __float_as_uint(fabsf(yrows[r][lane + 32 * i]));
    x[r] = 0;
    max_top = max(max_top, top[r]);
  }
  // For the usual ratios (0.9..1) top is a handful of elements: each lane
  // sorts its E values (largest first), then every round takes the warp's
  // largest value left (one integer max-reduction: |y| bits order like the
  // floats) and the lanes holding it drop their head. If every round dropped
  // exactly one value (the drops add up to top), the last round's value is
  // the answer. A value repeated on several lanes makes a round drop several
  // at once; rows where that happened take rounds that count what they drop,
  // a run of equal values per round, as the CPU's MthLargest does.
  if (kUseMaxExtraction && max_top <= kMaxExtraction) {
    // With 4 or more values per lane the last one is not zeroed when the lane
    // drops its head. A lane that has dropped all of them (rare: all among the
    // row's `top` largest) keeps its last value as a stale head; if a round
    // follows, that value is the round's largest again, the lane drops it a
    // second time and ends with more drops than values, which sends the row
    // to the recount below. (If no round follows, its last value was the
    // answer.)
    constexpr bool kZeroFill = E < 4;
    int drops[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      SortDescending<E>(u[r]);
      drops[r] = 0;
    }
    // One round of row r: its largest value left, dropped by its holders.
    const auto take_largest = [&](int r) {
      const uint32_t gm = __reduce_max_sync(0xffffffffu, u[r][0]);
      const bool hit = u[r][0] == gm;
      x[r] = gm;
      drops[r] += hit ? 1 : 0;
#pragma unroll
      for (int i = 0; i + 1 < E; ++i) u[r][i] = hit ? u[r][i + 1] : u[r][i];
      if constexpr (kZeroFill) u[r][E - 1] = hit ? 0u : u[r][E - 1];
    };
    // The same round without recording the value (all rounds but the last);
    // for 4 values per lane the drop is 4 predicated instructions.
    const auto drop_largest = [&](int r) {
      if constexpr (E == 4) {  // (so kZeroFill is false: the last value stays)
        const uint32_t gm = __reduce_max_sync(0xffffffffu, u[r][0]);
#if defined(OSCARKV_WARP_EMULATION)
        // The same in C++ for the host emulation (tests/gpu/warp_emulation.h).
        if (u[r][0] == gm) {
          ++drops[r];
          u[r][0] = u[r][1];
          u[r][1] = u[r][2];
          u[r][2] = u[r][3];
        }
#else
        asm("{\n\t.reg .pred p;\n\t"
            "setp.eq.u32 p, %0, %5;\n\t"
            "@p add.s32 %3, %3, 1;\n\t"
            "@p mov.b32 %0, %1;\n\t"
            "@p mov.b32 %1, %2;\n\t"
            "@p mov.b32 %2, %4;\n\t}"
            : "+r"(u[r][0]), "+r"(u[r][1]), "+r"(u[r][2]), "+r"(drops[r])
            : "r"(u[r][3]), "r"(gm));
#endif
      } else {
        take_largest(r);
      }
    };
    bool same_top = true;
#pragma unroll
    for (int r = 1; r < R; ++r) same_top = same_top && top[r] == top[0];
    if (same_top) {  // the usual case (a tile's rows share a kind): no per-row test per round
      // Two rounds per iteration: the loop's own instructions are paid once
      // per two. The last round, which records the value, is peeled.
      int it = 0;
      const int rounds = max_top - 1;
#pragma unroll 1
      for (; it + 2 <= rounds; it += 2) {
#pragma unroll
        for (int r = 0; r < R; ++r) drop_largest(r);
#pragma unroll
        for (int r = 0; r < R; ++r) drop_largest(r);
      }
      if (it < rounds) {
#pragma unroll
        for (int r = 0; r < R; ++r) drop_largest(r);
      }
      if (max_top > 0) {
#pragma unroll
        for (int r = 0; r < R; ++r) take_largest(r);
      }
    } else {
      for (int it = 0; it < max_top; ++it) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
          if (it < top[r]) take_largest(r);  // warp-uniform
        }
      }
    }
    bool recount = false;
    bool wrong[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      // A lane with more drops than values counts as a wrong row.
      const int d = kZeroFill || drops[r] <= E ? drops[r] : D + 1;
      wrong[r] = top[r] > 0 && __reduce_add_sync(0xffffffffu, d) != top[r];
      recount = recount || wrong[r];
    }
    if (recount) {  // warp-uniform; rare (equal values among the largest)
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (!wrong[r]) continue;
#pragma unroll
        for (int i = 0; i < E; ++i) u[r][i] = __float_as_uint(fabsf(yrows[r][lane + 32 * i]));
        SortDescending<E>(u[r]);
        for (int found = 0; found < top[r];) {
          const uint32_t gm = __reduce_max_sync(0xffffffffu, u[r][0]);
          const bool hit = u[r][0] == gm;
          found += __popc(__ballot_sync(0xffffffffu, hit));
          x[r] = gm;
          if (hit) {
#pragma unroll
            for (int i = 0; i + 1 < E; ++i) u[r][i] = u[r][i + 1];
            u[r][E - 1] = 0;
          }
        }
      }
    }
  } else {
    for (int b = 30; b >= 0; --b) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const uint32_t t = x[r] | (1u << b);
        int cnt = 0;
#pragma unroll
        for (int i = 0; i < E; ++i) cnt += u[r][i] < t ? 1 : 0;
        cnt = __reduce_add_sync(0xffffffffu, cnt);
        if (cnt < D - top[r] + 1) x[r] = t;  // fewer than k values below t
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) tau[r] = top[r] > 0 ? __uint_as_float(x[r]) : INFINITY;
}

// A float's bits as a signed integer of the same order (for the integer
// warp reductions), and back.
__device__ __forceinline__ int FloatToOrdered(float f) {
  const int b = __float_as_int(f);
  return b >= 0 ? b : b ^ 0x7fffffff;
}
__device__ __forceinline__ float OrderedToFloat(int b) {
  return __int_as_float(b >= 0 ? b : b ^ 0x7fffffff);
}

// A group's quantizer, from its clamped range [mn, mx] (the clamp of the raw
// group min and max to [-tau, tau]): (scale, min) in fp16, the min and
// 1/scale that the codes are computed with (0 for a zero scale), and the
// range [plo, phi] of the scaled values p(v) = (v - min) / scale of clamped
// elements, cut to [0, 3].
//
// Quantizing an element y is then round(clamp(p(y), plo, phi)), with no clamp
// of y itself: p is monotone, so clamping p(y) to [p(mn), p(mx)] gives
// p(clamp(y, -tau, tau)) exactly (y > tau exists only when mx = tau), and
// clamping to [0, 3] before rounding equals clamping the rounded code, as
// 0 and 3 are integers. (phi = min(max(p(mx), plo), 3), so that the range is
// never empty and the code never leaves [0, 3], even for a NaN.) The
// rounding is a float add of 1.5·2^23, whose sum's low mantissa bits are
// the code, rounded to nearest even as rintf: no float-to-int conversion.
struct GroupQuantizer {
  float loq, inv, plo, phi;
};

__device__ __forceinline__ void GroupParams(float mn, float mx, __half& s_h, __half& lo_h,
                                            GroupQuantizer& gq) {
  const float sc = fmaxf(__fsub_rn(mx, mn), kMinRange) / 3.0f;
  s_h = __float2half_rn(sc);
  lo_h = __float2half_rn(mn);
  const float sq = __half2float(s_h);
  gq.loq = __half2float(lo_h);
  gq.inv = sq > 0.0f ? 1.0f / sq : 0.0f;
  gq.plo = fmaxf(__fmul_rn(__fsub_rn(mn, gq.loq), gq.inv), 0.0f);
  gq.phi = fminf(fmaxf(__fmul_rn(__fsub_rn(mx, gq.loq), gq.inv), gq.plo), 3.0f);
}

// Magic number of the rounding add, and its bits (0x4B400000): code q in
// [0, 3] rounds to bits kRoundBits + q.
constexpr float kRoundMagic = 12582912.0f;  // 1.5 · 2^23
constexpr uint32_t kRoundBits = 0x4B400000u;
static_assert((kRoundBits & 0xFFu) == 0, "packing takes the codes from the low byte");

// Element y's code as kRoundBits + q (see GroupQuantizer).
__device__ __forceinline__ uint32_t CodeBits(float y, const GroupQuantizer& gq) {
  const float p = fminf(fmaxf(__fmul_rn(__fsub_rn(y, gq.loq), gq.inv), gq.plo), gq.phi);
  return __float_as_uint(__fadd_rn(p, kRoundMagic));
}

// A lane's elements per group, and the groups it holds part of.
template <int G>
constexpr int kLaneGroupElems = G > 32 ? G / 32 : 1;
template <int D, int G>
constexpr int kLaneGroups = (D / 32) / kLaneGroupElems<G>;

// Quantize a lane's E elements of one row (raw: the clamp is in the
// quantizers, see GroupQuantizer) with their groups' quantizers (one per
// group the lane holds part of) and pack the codes (4 per byte). Code byte j
// holds elements j + k·D/4: for D >= 128 those are the lane's own elements;
// for D = 64, lane j < 16 takes two of them from lane j + 16 (every lane must
// call). Bytes are sums of code bits times powers of 4, whose low byte is
// the packed codes (kRoundBits' low byte is 0).
template <int D, int G>
__device__ __forceinline__ void QuantizePackWarp(const float (&y)[D / 32],
                                                 const GroupQuantizer (&gq)[kLaneGroups<D, G>],
                                                 uint8_t* codes_out, int lane) {
  constexpr int E = D / 32;
  constexpr int kPer = kLaneGroupElems<G>;
  uint32_t c[E];
#pragma unroll
  for (int i = 0; i < E; ++i) c[i] = CodeBits(y[i], gq[i / kPer]);
  if constexpr (D >= 128) {
    // Quarter k of byte j = element j + k·D/4 = lane + 32 i with i = k·E/4 + b.
    constexpr int kBytes = E / 4;  // code bytes per lane: j = lane + 32 b
#pragma unroll
    for (int b = 0; b < kBytes; ++b) {
      uint32_t byte = c[3 * kBytes + b];
#pragma unroll
      for (int k = 2; k >= 0; --k) byte = byte * 4u + c[k * kBytes + b];
      codes_out[lane + 32 * b] = static_cast<uint8_t>(byte);
    }
  } else {
    static_assert(D == 64, "D = 64: byte j < 16 holds elements j, j + 16, j + 32, j + 48");
    const uint32_t mine = c[0] + 16u * c[1];  // elements lane, lane + 32
    const uint32_t upper = __shfl_down_sync(0xffffffffu, mine, 16);  // lane + 16, lane + 48
    if (lane < 16) codes_out[lane] = static_cast<uint8_t>(mine + 4u * upper);
  }
}

// Clamp to [-tau, tau], quantize and pack one rotated row held in shared
// memory; one warp, a group size G < 32 (a compile-time power of two: a
// group's min and max come from log2 G shuffle steps; QuantizeRowsWarp takes
// G >= 32). Lane owns elements lane + 32 i, each in its own group, whose
// (scale, min) every lane computes (hardware fp16 conversion, round to nearest
// even: the same bits as the CPU's FloatToFp16 for finite values) and the
// group's first lane stores.
template <int D, int G>
__device__ void QuantizeRowWarp(const float* yrow, float tau, uint8_t* codes_out,
                                QuantParams* params_out, int lane) {
  constexpr int E = D / 32;
  static_assert(G >= 4 && G < 32 && (G & (G - 1)) == 0, "G: a power of two below 32");
  float y[E];
#pragma unroll
  for (int i = 0; i < E; ++i) y[i] = yrow[lane + 32 * i];

  GroupQuantizer gq[E];
#pragma unroll
  for (int i = 0; i < E; ++i) {
    float mn = y[i], mx = mn;
#pragma unroll
    for (int off = G / 2; off >= 1; off >>= 1) {
      mn = fminf(mn, __shfl_xor_sync(0xffffffffu, mn, off));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    }
    // The clamped group's range: the clamp of its raw one.
    mn = fminf(fmaxf(mn, -tau), tau);
    mx = fminf(fmaxf(mx, -tau), tau);
    __half s_h, lo_h;
    GroupParams(mn, mx, s_h, lo_h, gq[i]);
    // Element lane + 32 i is its group's first on one lane only.
    const int e = lane + 32 * i;
    if (e % G == 0) {  // one 32-bit store: scale in the low half, min in the high half
      *reinterpret_cast<uint32_t*>(params_out + e / G) =
          uint32_t(__half_as_ushort(s_h)) | (uint32_t(__half_as_ushort(lo_h)) << 16);
    }
  }
  QuantizePackWarp<D, G>(y, gq, codes_out, lane);
}

// Clamp, quantize and pack R rotated rows held in shared memory (rows with
// use[k] false are not stored; for G >= 32 their reductions still run); one
// warp. G < 32 goes row by row through QuantizeRowWarp. For G >= 32 a group's
// min and max come from one warp reduction, so the group's scalar work
// (range, scale, fp16 rounding, reciprocal) is done once, by lane t for group
// t of the pass (row t / NG, group t % NG), and broadcast, instead of by all
// 32 lanes. Both take a group's parameters from GroupParams: the same bits.
template <int D, int G, int R>
__device__ void QuantizeRowsWarp(const float* const (&yrows)[R], const float (&tau)[R],
                                 uint8_t* const (&codes_out)[R],
                                 QuantParams* const (&params_out)[R], const bool (&use)[R],
                                 int lane) {
  if constexpr (G < 32) {
#pragma unroll
    for (int k = 0; k < R; ++k) {
      if (use[k]) QuantizeRowWarp<D, G>(yrows[k], tau[k], codes_out[k], params_out[k], lane);
    }
  } else {
    constexpr int E = D / 32;
    constexpr int kPer = kLaneGroupElems<G>;  // a lane's elements per group
    constexpr int NG = kLaneGroups<D, G>;     // groups per row (= D / G)
    constexpr int T = R * NG;            // groups of the pass
    static_assert(T <= 32, "a lane per group of the pass");
    float y[R][E];  // raw: the clamp is in the quantizers (GroupQuantizer)
    int mn_o[R][NG], mx_o[R][NG];  // each group's raw min and max, as ordered integers
#pragma unroll
    for (int k = 0; k < R; ++k) {
#pragma unroll
      for (int i = 0; i < E; ++i) y[k][i] = yrows[k][lane + 32 * i];
#pragma unroll
      for (int gl = 0; gl < NG; ++gl) {
        float mn = y[k][gl * kPer], mx = mn;
#pragma unroll
        for (int j = 1; j < kPer; ++j) {
          mn = fminf(mn, y[k][gl * kPer + j]);
          mx = fmaxf(mx, y[k][gl * kPer + j]);
        }
        mn_o[k][gl] = __reduce_min_sync(0xffffffffu, FloatToOrdered(mn));
        mx_o[k][gl] = __reduce_max_sync(0xffffffffu, FloatToOrdered(mx));
      }
    }
    // Lane t's group (lanes >= T compute group 0 again and store nothing).
    int my_mn = mn_o[0][0], my_mx = mx_o[0][0];
    QuantParams* my_params = params_out[0];
    int my_group = 0;
    bool my_use = use[0];
    float my_tau = tau[0];
#pragma unroll
    for (int t = 1; t < T; ++t) {
      if (lane == t) {
        my_mn = mn_o[t / NG][t % NG];
        my_mx = mx_o[t / NG][t % NG];
        my_params = params_out[t / NG];
        my_group = t % NG;
        my_use = use[t / NG];
        my_tau = tau[t / NG];
      }
    }
    // The clamped group's range: the clamp of its raw one. (A row with a NaN,
    // one that overflowed in the rotation, gets codes in [0, 3] like any
    // other, not necessarily the CPU's.)
    const float mn = fminf(fmaxf(OrderedToFloat(my_mn), -my_tau), my_tau);
    const float mx = fminf(fmaxf(OrderedToFloat(my_mx), -my_tau), my_tau);
    __half s_h, lo_h;
    GroupQuantizer my_gq;
    GroupParams(mn, mx, s_h, lo_h, my_gq);
    if (lane < T && my_use) {  // one 32-bit store: scale in the low half, min in the high half
      *reinterpret_cast<uint32_t*>(my_params + my_group) =
          uint32_t(__half_as_ushort(s_h)) | (uint32_t(__half_as_ushort(lo_h)) << 16);
    }
#pragma unroll
    for (int k = 0; k < R; ++k) {
      GroupQuantizer gq[NG];
#pragma unroll
      for (int gl = 0; gl < NG; ++gl) {
        const int src = k * NG + gl;
        gq[gl] = {__shfl_sync(0xffffffffu, my_gq.loq, src),
                  __shfl_sync(0xffffffffu, my_gq.inv, src),
                  __shfl_sync(0xffffffffu, my_gq.plo, src),
                  __shfl_sync(0xffffffffu, my_gq.phi, src)};
      }
      if (use[k]) QuantizePackWarp<D, G>(y[k], gq, codes_out[k], lane);  // warp-uniform
    }
  }
}

}  // namespace cuda_encode
}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_CUDA_ENCODE_ROWS_CUH_
