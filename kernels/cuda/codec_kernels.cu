#include "kernels/cuda/codec_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/quantize.h"
#include "kernels/status_macros.h"

namespace oscarkv {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kEncodeWarps = 16;
constexpr int kEncodeThreads = kEncodeWarps * 32;
constexpr int kEncodeTilesPerBlock = 8;
// Clip threshold by repeated max extraction when it is among the largest
// kMaxExtraction magnitudes of the row (else a 31-step bitwise search).
constexpr bool kUseMaxExtraction = true;
constexpr int kMaxExtraction = 24;

// Tile shapes of the encode kernel for head dim D: M rows per tile, the
// rotation staged in shared memory CW columns at a time as three bf16 terms
// (hi + mid + lo = R to ~2^-24 relative, so x·R keeps fp32 accuracy: x is
// exact in bf16).
template <int D>
struct EncodeShape {
  static constexpr int M = D == 256 ? 32 : 64;
  static constexpr int CW = D < 128 ? D : (D == 128 ? 128 : 64);
  static constexpr int NC = D / CW;
  static constexpr int LDX = D + 8;   // bf16 elements
  static constexpr int LDR = CW + 8;  // bf16 elements
  static constexpr int LDY = D + 4;   // floats
  static constexpr size_t kXBytes = size_t(M) * LDX * 2;
  static constexpr size_t kRBytes = size_t(D) * LDR * 2;
  static constexpr size_t kYBytes = size_t(M) * LDY * 4;
  static constexpr size_t kSmem = kXBytes + 3 * kRBytes + kYBytes + 2 * M * 4;
};

__device__ __forceinline__ int DeviceClipRank(float ratio, int n) {
  int k = static_cast<int>(ceil(static_cast<double>(ratio) * n - 1e-9));
  return min(max(k, 1), n);
}

__device__ __forceinline__ const float* RowRotation(const RotationRef& r, int kind, int h) {
  return (kind == 0 ? r.r_k : r.r_v) + r.stride * h;
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
        asm("{\n\t.reg .pred p;\n\t"
            "setp.eq.u32 p, %0, %5;\n\t"
            "@p add.s32 %3, %3, 1;\n\t"
            "@p mov.b32 %0, %1;\n\t"
            "@p mov.b32 %1, %2;\n\t"
            "@p mov.b32 %2, %4;\n\t}"
            : "+r"(u[r][0]), "+r"(u[r][1]), "+r"(u[r][2]), "+r"(drops[r])
            : "r"(u[r][3]), "r"(gm));
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

// A group's (scale, min) in fp16 from its clamped range [mn, mx], and the
// quantizer's min and 1/scale from those fp16 values (0 for a zero scale).
__device__ __forceinline__ void GroupParams(float mn, float mx, __half& s_h, __half& lo_h,
                                            float& loq, float& inv) {
  const float sc = fmaxf(__fsub_rn(mx, mn), kMinRange) / 3.0f;
  s_h = __float2half_rn(sc);
  lo_h = __float2half_rn(mn);
  const float sq = __half2float(s_h);
  loq = __half2float(lo_h);
  inv = sq > 0.0f ? 1.0f / sq : 0.0f;
}

// A lane's elements per group, and the groups it holds part of.
template <int G>
constexpr int kLaneGroupElems = G > 32 ? G / 32 : 1;
template <int D, int G>
constexpr int kLaneGroups = (D / 32) / kLaneGroupElems<G>;

// Quantize a lane's E clamped elements of one row with their groups' (min,
// 1/scale) (loq / inv per group the lane holds part of) and pack the codes
// (4 per byte). Code byte j holds elements j + k·D/4: for D >= 128 those are
// the lane's own elements; for D = 64, lane j < 16 takes two of them from
// lane j + 16 (every lane must call).
template <int D, int G>
__device__ __forceinline__ void QuantizePackWarp(const float (&y)[D / 32],
                                                 const float (&loq)[kLaneGroups<D, G>],
                                                 const float (&inv)[kLaneGroups<D, G>],
                                                 uint8_t* codes_out, int lane) {
  constexpr int E = D / 32;
  constexpr int kPer = kLaneGroupElems<G>;
  uint32_t c[E];
#pragma unroll
  for (int i = 0; i < E; ++i) {
    const int gl = i / kPer;
    // Round to nearest even as rintf; NaN converts to 0 and out-of-range
    // values saturate, so the clamp gives what clamping the float would.
    const int q = __float2int_rn(__fmul_rn(__fsub_rn(y[i], loq[gl]), inv[gl]));
    c[i] = static_cast<uint32_t>(min(max(q, 0), 3));
  }
  if constexpr (D >= 128) {
    // Quarter k of byte j = element j + k·D/4 = lane + 32 i with i = k·E/4 + b.
    constexpr int kBytes = E / 4;  // code bytes per lane: j = lane + 32 b
#pragma unroll
    for (int b = 0; b < kBytes; ++b) {
      uint32_t byte = 0;
#pragma unroll
      for (int k = 0; k < 4; ++k) byte |= c[k * kBytes + b] << (2 * k);
      codes_out[lane + 32 * b] = static_cast<uint8_t>(byte);
    }
  } else {
    static_assert(D == 64, "D = 64: byte j < 16 holds elements j, j + 16, j + 32, j + 48");
    const uint32_t mine = c[0] | (c[1] << 4);  // elements lane, lane + 32
    const uint32_t upper = __shfl_down_sync(0xffffffffu, mine, 16);  // lane + 16, lane + 48
    if (lane < 16) codes_out[lane] = static_cast<uint8_t>(mine | (upper << 2));
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
  for (int i = 0; i < E; ++i) y[i] = fminf(fmaxf(yrow[lane + 32 * i], -tau), tau);

  float loq[E], inv[E];
#pragma unroll
  for (int i = 0; i < E; ++i) {
    float mn = y[i], mx = mn;
#pragma unroll
    for (int off = G / 2; off >= 1; off >>= 1) {
      mn = fminf(mn, __shfl_xor_sync(0xffffffffu, mn, off));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    }
    __half s_h, lo_h;
    GroupParams(mn, mx, s_h, lo_h, loq[i], inv[i]);
    // Element lane + 32 i is its group's first on one lane only.
    const int e = lane + 32 * i;
    if (e % G == 0) {  // one 32-bit store: scale in the low half, min in the high half
      *reinterpret_cast<uint32_t*>(params_out + e / G) =
          uint32_t(__half_as_ushort(s_h)) | (uint32_t(__half_as_ushort(lo_h)) << 16);
    }
  }
  QuantizePackWarp<D, G>(y, loq, inv, codes_out, lane);
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
    float y[R][E];
    int mn_o[R][NG], mx_o[R][NG];  // each group's min and max, as ordered integers
#pragma unroll
    for (int k = 0; k < R; ++k) {
#pragma unroll
      for (int i = 0; i < E; ++i) y[k][i] = fminf(fmaxf(yrows[k][lane + 32 * i], -tau[k]), tau[k]);
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
#pragma unroll
    for (int t = 1; t < T; ++t) {
      if (lane == t) {
        my_mn = mn_o[t / NG][t % NG];
        my_mx = mx_o[t / NG][t % NG];
        my_params = params_out[t / NG];
        my_group = t % NG;
        my_use = use[t / NG];
      }
    }
    const float mn = OrderedToFloat(my_mn), mx = OrderedToFloat(my_mx);
    __half s_h, lo_h;
    float my_loq, my_inv;
    GroupParams(mn, mx, s_h, lo_h, my_loq, my_inv);
    if (lane < T && my_use) {  // one 32-bit store: scale in the low half, min in the high half
      *reinterpret_cast<uint32_t*>(my_params + my_group) =
          uint32_t(__half_as_ushort(s_h)) | (uint32_t(__half_as_ushort(lo_h)) << 16);
    }
#pragma unroll
    for (int k = 0; k < R; ++k) {
      float loq[NG], inv[NG];
#pragma unroll
      for (int gl = 0; gl < NG; ++gl) {
        loq[gl] = __shfl_sync(0xffffffffu, my_loq, k * NG + gl);
        inv[gl] = __shfl_sync(0xffffffffu, my_inv, k * NG + gl);
      }
      if (use[k]) QuantizePackWarp<D, G>(y[k], loq, inv, codes_out[k], lane);  // warp-uniform
    }
  }
}

// Warp index the compiler can prove warp-uniform (a shuffle from lane 0), so
// warp-collective code inside per-warp loops compiles without the divergence
// fallback (WARPSYNC / ENDCOLLECTIVE around every shuffle).
__device__ __forceinline__ int WarpIndex() {
  return __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) >> 5, 0);
}

}  // namespace
}  // namespace oscarkv

#include "kernels/cuda/encode_strips.cuh"

namespace oscarkv {
namespace {

// Per-row metadata of one tile, computed once per tile.
struct EncodeRow {
  const bf16_bits* src;  // the row's first element (kind, head)
  const float* rot;      // its rotation
  uint8_t* codes;        // destination code row
  QuantParams* params;   // destination params row
  int top;  // clip rank from the top (ClipTopRank)
  int done;
};

// grid.x: chunks of kEncodeTilesPerBlock*M rows over (job, token); grid.y: head*2 + kind.
template <int D, int G>
__global__ void __launch_bounds__(kEncodeThreads, 1)
    EncodeKernel(PageGeometry geom, const EncodeJob* __restrict__ jobs, int num_jobs) {
  using S = EncodeShape<D>;
  namespace wmma = nvcuda::wmma;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* xs = reinterpret_cast<bf16*>(smem);
  bf16* rhi = reinterpret_cast<bf16*>(smem + S::kXBytes);
  bf16* rmid = reinterpret_cast<bf16*>(smem + S::kXBytes + S::kRBytes);
  bf16* rlo = reinterpret_cast<bf16*>(smem + S::kXBytes + 2 * S::kRBytes);
  float* ys = reinterpret_cast<float*>(smem + S::kXBytes + 3 * S::kRBytes);
  __shared__ EncodeRow rows[S::M];
  __shared__ const float* cur_r;
  __shared__ const float* loaded_r;
  __shared__ int loaded_chunk;

  const int tid = threadIdx.x, warp = WarpIndex(), lane = tid & 31;
  const int h = blockIdx.y >> 1, kind = blockIdx.y & 1;
  const int P = geom.page_tokens;
  const size_t row_elems = geom.exact_row_elems();
  const int total_rows = num_jobs * P;  // < 2^31: checked by the launcher
  const int block_row0 = blockIdx.x * kEncodeTilesPerBlock * S::M;
  if (tid == 0) {
    loaded_r = nullptr;
    loaded_chunk = -1;
  }

  for (int tile = 0; tile < kEncodeTilesPerBlock; ++tile) {
    const int row0 = block_row0 + tile * S::M;
    if (row0 >= total_rows) break;
    const int n = min(S::M, total_rows - row0);
    for (int i = tid; i < S::M; i += kEncodeThreads) {
      EncodeRow er{};
      er.done = 1;
      if (i < n) {
        const int row = row0 + i;
        const int j = row / P, t = row - j * P;
        const EncodeJob& job = jobs[j];
        er.src = job.src_block + kind * size_t(P) * row_elems + size_t(t) * row_elems +
                 size_t(h) * D;
        er.rot = RowRotation(job.rotation, kind, h);
        er.codes = job.dst_page + geom.codes_offset(h, kind) + size_t(t) * (D / 4);
        er.params = reinterpret_cast<QuantParams*>(job.dst_page + geom.params_offset(h, kind)) +
                    size_t(t) * geom.groups();
        er.top = ClipTopRank(kind == 0 ? job.clip_k : job.clip_v, D);
        er.done = 0;
      }
      rows[i] = er;
    }
    __syncthreads();
    // Rows of one tile may belong to jobs with different rotations: one pass per
    // distinct rotation (one pass in the common case).
    while (true) {
      if (tid == 0) {
        cur_r = nullptr;
        for (int i = 0; i < n; ++i) {
          if (!rows[i].done) {
            cur_r = rows[i].rot;
            break;
          }
        }
      }
      __syncthreads();
      const float* r = cur_r;
      if (r == nullptr) break;
      // Stage x rows of this rotation (others zero), 8 bytes per thread-load.
      constexpr int kChunksPerRow = D / 4;
      for (int idx = tid; idx < S::M * kChunksPerRow; idx += kEncodeThreads) {
        const int i = idx / kChunksPerRow, c = idx % kChunksPerRow;
        uint2 v = make_uint2(0, 0);
        if (!rows[i].done && rows[i].rot == r) v = *reinterpret_cast<const uint2*>(rows[i].src + 4 * c);
        *reinterpret_cast<uint2*>(xs + i * S::LDX + 4 * c) = v;
      }
      for (int cc = 0; cc < S::NC; ++cc) {
        if (loaded_r != r || loaded_chunk != cc) {
          __syncthreads();  // previous users of the staged rotation are done
          for (int idx = tid; idx < D * S::CW; idx += kEncodeThreads) {
            const int i = idx / S::CW, j = idx % S::CW;
            const float v = r[size_t(i) * D + cc * S::CW + j];
            const bf16 vh = __float2bfloat16_rn(v);
            const float r1 = v - __bfloat162float(vh);
            const bf16 vm = __float2bfloat16_rn(r1);
            rhi[i * S::LDR + j] = vh;
            rmid[i * S::LDR + j] = vm;
            rlo[i * S::LDR + j] = __float2bfloat16_rn(r1 - __bfloat162float(vm));
          }
          __syncthreads();
          if (tid == 0) {
            loaded_r = r;
            loaded_chunk = cc;
          }
        }
        __syncthreads();
        constexpr int TN = S::CW / 16;
        constexpr int T = (S::M / 16) * TN;
        for (int t = warp; t < T; t += kEncodeWarps) {
          const int mi = t / TN, nj = t % TN;
          wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
          wmma::fill_fragment(acc, 0.0f);
#pragma unroll 4
          for (int kk = 0; kk < D / 16; ++kk) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> a;
            wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> b;
            wmma::load_matrix_sync(a, xs + mi * 16 * S::LDX + kk * 16, S::LDX);
            wmma::load_matrix_sync(b, rlo + kk * 16 * S::LDR + nj * 16, S::LDR);
            wmma::mma_sync(acc, a, b, acc);
            wmma::load_matrix_sync(b, rmid + kk * 16 * S::LDR + nj * 16, S::LDR);
            wmma::mma_sync(acc, a, b, acc);
            wmma::load_matrix_sync(b, rhi + kk * 16 * S::LDR + nj * 16, S::LDR);
            wmma::mma_sync(acc, a, b, acc);
          }
          wmma::store_matrix_sync(ys + mi * 16 * S::LDY + cc * S::CW + nj * 16, acc, S::LDY,
                                  wmma::mem_row_major);
        }
      }
      __syncthreads();
      // Each warp quantizes rows warp, warp + kEncodeWarps, ...; clip
      // searches of kRows rows at a time.
      constexpr int kRows = 4;
      for (int i0 = warp; i0 < n; i0 += kEncodeWarps * kRows) {
        const float* yr[kRows];
        int top[kRows];
        float tau[kRows];
        bool use[kRows];
#pragma unroll
        for (int k = 0; k < kRows; ++k) {
          const int i = i0 + k * kEncodeWarps;
          use[k] = i < n && !rows[i].done && rows[i].rot == r;
          yr[k] = ys + (i < S::M ? i : 0) * S::LDY;
          top[k] = use[k] ? rows[i].top : 0;
        }
        ClipThresholdsWarp<D, kRows>(yr, top, tau, lane);
        uint8_t* codes[kRows];
        QuantParams* params[kRows];
#pragma unroll
        for (int k = 0; k < kRows; ++k) {
          const EncodeRow* er = use[k] ? &rows[i0 + k * kEncodeWarps] : nullptr;
          codes[k] = er != nullptr ? er->codes : nullptr;
          params[k] = er != nullptr ? er->params : nullptr;
        }
        QuantizeRowsWarp<D, G, kRows>(yr, tau, codes, params, use, lane);
      }
      __syncthreads();
      // Mark the rows of this rotation done (after every warp has compared).
      for (int i = tid; i < n; i += kEncodeThreads) {
        if (!rows[i].done && rows[i].rot == r) rows[i].done = 1;
      }
      __syncthreads();
    }
  }
}

// Decode: one block per (job, head*2+kind), D threads; tokens in batches of 8
// so each rotation element read from L1 serves 8 rows.
constexpr int kDecodeBatch = 8;

template <int D>
__global__ void __launch_bounds__(D)
    DecodeKernel(PageGeometry geom, const DecodeJob* __restrict__ jobs) {
  __shared__ float ys[kDecodeBatch][D];
  const DecodeJob& job = jobs[blockIdx.x];
  const int h = blockIdx.y >> 1, kind = blockIdx.y & 1;
  const int i = threadIdx.x;
  const int P = geom.page_tokens, groups = geom.groups(), G = geom.group_size;
  const size_t row_elems = geom.exact_row_elems();
  const uint8_t* codes = job.src_page + geom.codes_offset(h, kind);
  const auto* params =
      reinterpret_cast<const QuantParams*>(job.src_page + geom.params_offset(h, kind));
  const float* r = RowRotation(job.rotation, kind, h) + size_t(i) * D;
  bf16_bits* dst = job.dst_block + kind * size_t(P) * row_elems + size_t(h) * D + i;
  constexpr int kQuarter = D / 4;
  for (int t0 = 0; t0 < P; t0 += kDecodeBatch) {
    const int nt = min(kDecodeBatch, P - t0);
    for (int tt = 0; tt < nt; ++tt) {
      const int t = t0 + tt;
      const uint8_t byte = codes[size_t(t) * kQuarter + (i % kQuarter)];
      const QuantParams p = params[size_t(t) * groups + i / G];
      ys[tt][i] = static_cast<float>(UnpackCode(byte, i / kQuarter)) * Fp16ToFloat(p.scale) +
                  Fp16ToFloat(p.min);
    }
    __syncthreads();
    float acc[kDecodeBatch];
#pragma unroll
    for (int tt = 0; tt < kDecodeBatch; ++tt) acc[tt] = 0.0f;
    for (int j = 0; j < D; ++j) {
      const float rv = __ldg(r + j);
#pragma unroll
      for (int tt = 0; tt < kDecodeBatch; ++tt) acc[tt] = fmaf(ys[tt][j], rv, acc[tt]);
    }
    for (int tt = 0; tt < nt; ++tt) dst[size_t(t0 + tt) * row_elems] = FloatToBf16(acc[tt]);
    __syncthreads();
  }
}

constexpr int kMaxCachedDevices = 64;
using PerDevice = std::array<std::atomic<int>, kMaxCachedDevices>;

// Resident blocks of `kernel` on the whole current device, after raising its
// dynamic shared-memory limit to `smem`. Both are driver calls that cost more
// than a small launch (a demotion batch of 64 pages encodes in ~45 µs), so the
// answer is kept per device in `cache` (one per kernel instantiation).
template <typename Kernel>
absl::StatusOr<int> ResidentBlocks(Kernel kernel, int threads, size_t smem, PerDevice& cache) {
  int device = 0;
  OSCARKV_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  const bool cached = device >= 0 && device < kMaxCachedDevices;
  if (cached) {
    const int known = cache[device].load(std::memory_order_relaxed);
    if (known > 0) return known;
  }
  OSCARKV_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  int sms = 0, per_sm = 0;
  OSCARKV_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  OSCARKV_CUDA_RETURN_IF_ERROR(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  const int blocks = std::max(sms, 1) * std::max(per_sm, 1);
  if (cached) cache[device].store(blocks, std::memory_order_relaxed);
  return blocks;
}

template <int D, int G>
absl::Status LaunchEncodeTiled(const PageGeometry& geom, const EncodeJob* jobs, int num_jobs,
                               cudaStream_t stream) {
  using S = EncodeShape<D>;
  const auto kernel = EncodeKernel<D, G>;
  static PerDevice setup{};  // the grid is sized by the rows; only the attribute is needed
  OSCARKV_RETURN_IF_ERROR(ResidentBlocks(kernel, kEncodeThreads, S::kSmem, setup).status());
  const long rows = static_cast<long>(num_jobs) * geom.page_tokens;
  if (rows > (1L << 30)) return absl::InvalidArgumentError("too many encode jobs for one launch");
  const long per_block = static_cast<long>(kEncodeTilesPerBlock) * S::M;
  const long blocks = (rows + per_block - 1) / per_block;
  dim3 grid(static_cast<unsigned>(blocks), 2 * geom.kv_heads);
  kernel<<<grid, kEncodeThreads, S::kSmem, stream>>>(geom, jobs, num_jobs);
  return CudaStatus(cudaGetLastError(), "EncodeKernel launch");
}

// The strip kernel (roles = false) or its warp-specialized twin (true): one
// wave of blocks, each walking a contiguous range of (kind, head, tile) items.
template <int D, int G, bool kRoles>
absl::Status LaunchEncodeStrips(const PageGeometry& geom, const EncodeJob* jobs, int num_jobs,
                                cudaStream_t stream) {
  using S = encode_strips::Shape<D>;
  const auto kernel = kRoles ? encode_strips::EncodeRolesKernel<D, G>
                             : encode_strips::EncodeStripsKernel<D, G>;
  const int threads = kRoles ? encode_strips::roles::kThreads : encode_strips::kThreads;
  const size_t smem = kRoles ? encode_strips::roles::Smem<D>::kBytes : S::kSmem;
  static PerDevice wave{};
  OSCARKV_ASSIGN_OR_RETURN(const int resident, ResidentBlocks(kernel, threads, smem, wave));
  const long rows = static_cast<long>(num_jobs) * geom.page_tokens;
  if (rows > (1L << 30)) return absl::InvalidArgumentError("too many encode jobs for one launch");
  const long tiles = (rows + S::M - 1) / S::M;
  const long items = tiles * 2 * geom.kv_heads;
  const long blocks = std::min<long>(items, resident);
  kernel<<<static_cast<unsigned>(blocks), threads, smem, stream>>>(
      geom, jobs, num_jobs, static_cast<int>(tiles), items);
  return CudaStatus(cudaGetLastError(),
                    kRoles ? "EncodeRolesKernel launch" : "EncodeStripsKernel launch");
}

// The encode launch for head dim D and group size G (compile-time both).
template <int D, int G>
absl::Status LaunchEncodeDG(const PageGeometry& geom, const EncodeJob* jobs, int num_jobs,
                            cudaStream_t stream, EncodeKernelChoice choice) {
  if constexpr (D <= 128) {
    // kAuto: the roles kernel where it was measured faster (D 128, H200).
    const bool roles = choice == EncodeKernelChoice::kRoles ||
                       (choice == EncodeKernelChoice::kAuto && D == 128);
    if (roles) return LaunchEncodeStrips<D, G, true>(geom, jobs, num_jobs, stream);
    if (choice != EncodeKernelChoice::kTiled) {
      return LaunchEncodeStrips<D, G, false>(geom, jobs, num_jobs, stream);
    }
  }
  return LaunchEncodeTiled<D, G>(geom, jobs, num_jobs, stream);
}

template <int D>
absl::Status LaunchEncodeD(const PageGeometry& geom, const EncodeJob* jobs, int num_jobs,
                           cudaStream_t stream, EncodeKernelChoice choice) {
  switch (geom.group_size) {  // a power of two in [4, D] (ValidateGeometry)
    case 4: return LaunchEncodeDG<D, 4>(geom, jobs, num_jobs, stream, choice);
    case 8: return LaunchEncodeDG<D, 8>(geom, jobs, num_jobs, stream, choice);
    case 16: return LaunchEncodeDG<D, 16>(geom, jobs, num_jobs, stream, choice);
    case 32: return LaunchEncodeDG<D, 32>(geom, jobs, num_jobs, stream, choice);
    case 64: return LaunchEncodeDG<D, 64>(geom, jobs, num_jobs, stream, choice);
    default: break;
  }
  if constexpr (D >= 128) {
    if (geom.group_size == 128) return LaunchEncodeDG<D, 128>(geom, jobs, num_jobs, stream, choice);
  }
  if constexpr (D >= 256) {
    if (geom.group_size == 256) return LaunchEncodeDG<D, 256>(geom, jobs, num_jobs, stream, choice);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("group_size ", geom.group_size, " is not a power of two in [4, ", D, "]"));
}

template <int D>
absl::Status LaunchDecodeD(const PageGeometry& geom, const DecodeJob* jobs, int num_jobs,
                           cudaStream_t stream) {
  dim3 grid(num_jobs, 2 * geom.kv_heads);
  DecodeKernel<D><<<grid, D, 0, stream>>>(geom, jobs);
  return CudaStatus(cudaGetLastError(), "DecodeKernel launch");
}

}  // namespace

absl::Status LaunchEncodePages(const PageGeometry& geom, const EncodeJob* dev_jobs, int num_jobs,
                               cudaStream_t stream, EncodeKernelChoice choice) {
  if (num_jobs <= 0) return absl::OkStatus();
  if (geom.kv_heads > 32767) return absl::InvalidArgumentError("too many kv heads");
  switch (geom.head_dim) {
    case 64: return LaunchEncodeD<64>(geom, dev_jobs, num_jobs, stream, choice);
    case 128: return LaunchEncodeD<128>(geom, dev_jobs, num_jobs, stream, choice);
    case 256: return LaunchEncodeD<256>(geom, dev_jobs, num_jobs, stream, choice);
    default:
      return absl::InvalidArgumentError(absl::StrCat("unsupported head_dim ", geom.head_dim));
  }
}

absl::Status LaunchDecodePages(const PageGeometry& geom, const DecodeJob* dev_jobs, int num_jobs,
                               cudaStream_t stream) {
  if (num_jobs <= 0) return absl::OkStatus();
  if (geom.kv_heads > 32767) return absl::InvalidArgumentError("too many kv heads");
  switch (geom.head_dim) {
    case 64: return LaunchDecodeD<64>(geom, dev_jobs, num_jobs, stream);
    case 128: return LaunchDecodeD<128>(geom, dev_jobs, num_jobs, stream);
    case 256: return LaunchDecodeD<256>(geom, dev_jobs, num_jobs, stream);
    default:
      return absl::InvalidArgumentError(absl::StrCat("unsupported head_dim ", geom.head_dim));
  }
}

}  // namespace oscarkv
