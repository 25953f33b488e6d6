// The query-prep kernel of one decode-attention call. Included by
// attend_kernels.cu only.
//
// One block per (item, query head) computes q' = q·R_K·scale·log2e and the
// head's query fragments for the split kernel. (H200, 2026-11-29: 0.9 µs
// faster per call at B = 1 and 4 µs at B = 8 than the earlier cluster of 4
// blocks per head, each computing a quarter of the dims.)
#ifndef OSCARKV_KERNELS_CUDA_ATTEND_PREP_CUH_
#define OSCARKV_KERNELS_CUDA_ATTEND_PREP_CUH_

#include "kernels/cuda/attend_device.cuh"

namespace oscarkv {
namespace cuda_attend {

// Integer query fragments (B of the m16n8k32 u8·s8 MMA), 2·4·2·32 words per
// plan head (twice that for HistoryWarpIntPv8): word idx is n-tile t,
// k-step = code field kk, register rg = bytes [4rg, 4rg+4) of thread c's 8
// code bytes, column n; byte b holds the digit of dim d = 8c + 4rg + b +
// 32kk, where v = q'·inv·4^(3-kk) = Σ_j digit_j·128^-j. int_qk 1: column
// n is digit 2t + n/4 of head n%4; 2 (digits paired per head,
// HistoryWarpIntPv): digit 2t + n%2 of head n/2.
// At 5-8 query heads (HistoryWarpIntPv8, int_qk 2 only) twice that, 4
// n-tiles: tile t holds digits 2(t%2) + n%2 of head 4(t/2) + n/2.
constexpr int kIntFragWords = 2 * 4 * 2 * 32;
struct IntFragSlot {
  int col;    // the query head (column) of the word
  int digit;  // its base-128 digit
};
__device__ __forceinline__ IntFragSlot IntFragSlotOf(int idx, bool paired) {
  const int n = (idx & 31) >> 2, t = idx >> 8;
  if (paired) return {4 * (t >> 1) + (n >> 1), 2 * (t & 1) + (n & 1)};
  return {n & 3, 2 * t + (n >= 4 ? 1 : 0)};
}
// The weight 4^(3-kk) of code field kk in the integer digits' values.
__device__ __forceinline__ float DigitFieldScale(int kk) {
  return kk == 0 ? 64.0f : kk == 1 ? 16.0f : kk == 2 ? 4.0f : 1.0f;
}
// Word idx of the head whose scaled q' is qs (its digit scale inv).
__device__ __forceinline__ uint32_t IntFragWord(int idx, int digit, const float* qs, float inv) {
  const int ln = idx & 31, rg = (idx >> 5) & 1, kk = (idx >> 6) & 3;
  const int c = ln & 3;
  const float sc = inv * DigitFieldScale(kk);
  uint32_t packed = 0;
  for (int b = 0; b < 4; ++b) {
    float rest = qs[8 * c + 4 * rg + b + 32 * kk] * sc;
    int dig = 0;
    for (int j = 0; j < 4; ++j) {
      const float dj = rintf(rest);
      if (j == digit) dig = static_cast<int>(dj);
      rest = (rest - dj) * 128.0f;
    }
    packed |= (uint32_t(dig) & 0xffu) << (8 * b);
  }
  return packed;
}

// Writes the query head's fragment words of the QK MMA's B operand, from
// qs[d] = q' of dim d, and zeroes the unused columns (heads g .. HG-1) when hh == 0. fp16 format:
// hi / lo columns scaled to max |q'|·inv in [256, 512) times 4^-k for code
// field k; integer format: base-128 int8 digits of q'·inv·4^(3-k) (above).
template <int D, bool G8>
__device__ void WriteQueryFragments(const LaunchArgs& a, int item_idx, int h, int hh,
                                    bool int_format, const float* qs, float inv) {
  constexpr int NT = G8 ? 2 : 1, KS = D / 16, Q = D / 4;
  const int g = a.g;
  if (int_format) {
    constexpr int kWords = (G8 ? 2 : 1) * kIntFragWords;
    uint32_t* frag = a.qfrag + (size_t(item_idx) * a.PlanHeads() + h) * kWords;
    // Lane q of warp 0 makes the 4 digits of the 4 dims of one (c, rg, kk)
    // (IntFragWord's arithmetic, every digit of one chain at once) and
    // writes the head's 4 words that hold them: a B = 1 call waits on this
    // kernel's longest warp (H200, 2026-11-30, tests/bench/RESULTS.md run 19).
    if (threadIdx.x < 32) {
      const int q = threadIdx.x, c = q & 3, rg = (q >> 2) & 1, kk = q >> 3;
      const float sc = inv * DigitFieldScale(kk);
      uint32_t words[4] = {0u, 0u, 0u, 0u};
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        float rest = qs[8 * c + 4 * rg + b + 32 * kk] * sc;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float dj = rintf(rest);
          words[j] |= (uint32_t(static_cast<int>(dj)) & 0xffu) << (8 * b);
          rest = (rest - dj) * 128.0f;
        }
      }
      const bool paired = a.int_qk == 2;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        // Digit j sits in n-tile j / 2 (+ 2 for heads 4-7), column n
        // (IntFragSlotOf's inverse).
        const int tile = G8 ? 2 * (hh >> 2) + (j >> 1) : j >> 1;
        const int n = paired ? 2 * (hh & 3) + (j & 1) : hh + 4 * (j & 1);
        frag[(tile << 8) | (kk << 6) | (rg << 5) | (n << 2) | c] = words[j];
      }
    }
    if (hh == 0 && g < (G8 ? 8 : 4)) {  // the columns of heads g.. stay zero
      for (int idx = threadIdx.x; idx < kWords; idx += blockDim.x) {
        if (IntFragSlotOf(idx, a.int_qk == 2).col >= g) frag[idx] = 0;
      }
    }
    return;
  }
  uint32_t* frag = a.qfrag + (size_t(item_idx) * a.PlanHeads() + h) * (NT * KS * 2 * 32);
  for (int idx = threadIdx.x; idx < NT * KS * 2 * 32; idx += blockDim.x) {
    const int ln = idx & 31, rg = (idx >> 5) & 1, ks = (idx >> 6) % KS, nt = (idx >> 6) / KS;
    const int kq = ks & 3;
    const int c = ln & 3, n = ln >> 2, w = ks >> 2;
    const int col = G8 ? n : (n & 3);
    if (col == hh) {
      const bool lo_part = G8 ? nt == 1 : n >= 4;
      const int d0 = kq * Q + c * (D / 16) + 4 * w + rg, d1 = d0 + 2;
      const float sc = inv * (kq == 0 ? 1.0f : kq == 1 ? 0.25f : kq == 2 ? 0.0625f : 0.015625f);
      const float v[2] = {qs[d0] * sc, qs[d1] * sc};
      unsigned short hv[2];
      for (int i = 0; i < 2; ++i) {
        const __half hi = __float2half_rn(v[i]);
        hv[i] = __half_as_ushort(lo_part ? __float2half_rn(v[i] - __half2float(hi)) : hi);
      }
      frag[idx] = uint32_t(hv[0]) | (uint32_t(hv[1]) << 16);
    } else if (hh == 0 && col >= g) {
      frag[idx] = 0;
    }
  }
}

// The digit scale of a head from its max |q'|: inv (applied to q' before the
// fragments are made) and the multiplier that undoes it (the meta's word 0).
// fp16 format: max |q'|·inv in [256, 512). Integer format: in [0.5, 1), so the
// digit-0 values q'·inv·4^(3-k) stay below 64. (Bit arithmetic,
// FrexpExponent and Exp2Int of kernels/numeric.h, not frexpf / ldexpf: this
// runs on a B = 1 call's critical path, once per head.)
__device__ __forceinline__ void QueryScale(float mx, bool int_format, float* inv, float* mult) {
  const bool ok = mx > 0.0f && isfinite(mx);
  const int e = ok ? FrexpExponent(mx) : 0;
  const int shift = int_format ? 0 : 9;
  const int mshift = int_format ? 6 : 9;
  *inv = ok ? Exp2Int(shift - e) : 1.0f;
  *mult = ok ? Exp2Int(e - mshift) : (int_format ? 1.0f / 64.0f : 1.0f);
}

// The meta words of a head: {mult, Σq' per quantization group (from the sums
// of the four quarters of the dims), 0...}. A row has 1, 2 or 4 groups (G is
// a divisor of D >= D/4, D a power of two); straight-line code, no division.
__device__ __forceinline__ void WriteQueryMeta(const LaunchArgs& a, int head_idx, float mult,
                                               const float (&quarter_sum)[4], int head_dim) {
  const int gsize = a.geom.group_size;
  // Quarter r belongs to group r >> pshift (4 / ng quarters per group).
  const int pshift = gsize >= head_dim ? 2 : 2 * gsize >= head_dim ? 1 : 0;
  float* meta = a.qmeta + size_t(head_idx) * kQueryMetaFloats;
  meta[0] = mult;
#pragma unroll
  for (int gi = 0; gi < 4; ++gi) {
    float sum = 0.0f;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      if ((r >> pshift) == gi) sum += quarter_sum[r];
    }
    meta[1 + gi] = sum;
  }
  meta[5] = meta[6] = meta[7] = 0.0f;
}

// Grid: one block per (item, query head), x = item·Hq + qh. The block
// computes all of q' = q·R_K·scale·log2e with 2·D threads (4·D for D = 256).
// Thread t owns the 4 columns [4(t % CG), +4) (CG = D/4 column groups) over
// the rows of slice t / CG (8 slices; 16 for D = 256), read as float4 (the
// scalar path when R_K is not 16-byte aligned) and all issued before the
// first product; the slices are summed in shared memory. Then it writes the
// head's meta (digit-scale multiplier, per-group Σq') and its columns of the
// query fragments. (The exact units scale the raw queries themselves, see
// ExactWarp::Init.) D = 256: 1024 threads leave 64 registers each, and ptxas
// spills part of the 16 float4 rows, 116 bytes; measured correct on the H200,
// not timed. Loading the rows in two batches at 512 threads would avoid it.
constexpr int PrepThreads(int d) { return d <= 128 ? 2 * d : 4 * d; }

template <int D, bool G8>
__global__ void __launch_bounds__(PrepThreads(D)) PrepKernel(LaunchArgs a) {
  constexpr int kThreadsH = PrepThreads(D);
  constexpr int CG = D / 4, kSlices = kThreadsH / CG, kRows = D / kSlices, Q = D / 4;
  static_assert(kSlices >= 8 && D % kSlices == 0 && kThreadsH >= 128, "prep shape");
  __shared__ float qin[D];
  __shared__ float red[kSlices][D];
  __shared__ float qs[D];
  __shared__ float stat[4][2];  // per quarter: max |q'|, Σ q'
  const int head_idx = blockIdx.x;  // item * Hq + qh
  const int item_idx = head_idx / a.hq, qh = head_idx % a.hq;
  const int g = a.g, h = qh / g, hh = qh % g;
  const int tid = threadIdx.x;
  // At 5-8 heads, only HistoryWarpIntPv8's paired digits (int_qk 2).
  const bool kIntFormat = D == 128 && (G8 ? a.int_qk == 2 : a.int_qk != 0);
  Trace(a.trace[kTracePrep], blockIdx.x, kTraceStart);
  WaitForPrerequisites();
  LaunchDependents();
  // With one rotation for the batch, R_K and q are read straight away (an
  // item without history then gets fragments nobody reads); else the item's
  // plan says whether it has history and where its rotation is.
  const float* rk;
  bool has_history;
  if (a.rotation.r_k != nullptr) {
    rk = a.rotation.r_k + a.rotation.stride * a.KvHead(h);
    has_history = true;
  } else {
    const ItemPlan& item = a.items[item_idx];
    rk = item.rotation.r_k + item.rotation.stride * a.KvHead(h);
    has_history = item.num_pages > 0;
  }
  const int cg = tid % CG, slice = tid / CG;
  const bool vec = (reinterpret_cast<uintptr_t>(rk) & 15u) == 0;
  float4 rv[kRows];
  if (has_history) {
    const float* base = rk + size_t(slice * kRows) * D + 4 * cg;
    if (vec) {
#pragma unroll
      for (int ii = 0; ii < kRows; ++ii) {
        rv[ii] = __ldg(reinterpret_cast<const float4*>(base + size_t(ii) * D));
      }
    } else {
#pragma unroll
      for (int ii = 0; ii < kRows; ++ii) {
        const float* r = base + size_t(ii) * D;
        rv[ii] = make_float4(__ldg(r), __ldg(r + 1), __ldg(r + 2), __ldg(r + 3));
      }
    }
  }
  const float* q = a.queries + size_t(head_idx) * D;
  static_assert(kThreadsH >= D, "one thread per dim");
  if (tid < D) qin[tid] = q[tid];
  __syncthreads();
  {
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (has_history) {
#pragma unroll
      for (int ii = 0; ii < kRows; ++ii) {
        const float x = qin[slice * kRows + ii];
        acc.x = fmaf(x, rv[ii].x, acc.x);
        acc.y = fmaf(x, rv[ii].y, acc.y);
        acc.z = fmaf(x, rv[ii].z, acc.z);
        acc.w = fmaf(x, rv[ii].w, acc.w);
      }
    }
    red[slice][4 * cg + 0] = acc.x;
    red[slice][4 * cg + 1] = acc.y;
    red[slice][4 * cg + 2] = acc.z;
    red[slice][4 * cg + 3] = acc.w;
  }
  __syncthreads();
  Trace(a.trace[kTracePrep], blockIdx.x, kTraceWaited);
  if (tid < D) {
    float s = 0.0f;
#pragma unroll
    for (int sl = 0; sl < kSlices; ++sl) s += red[sl][tid];
    qs[tid] = s * a.scale_log2;
  }
  __syncthreads();
  {
    // Warp w < 4 reduces quarter w of the dims.
    const int w = tid >> 5, lane = tid & 31;
    if (w < 4) {
      float mx = 0.0f, sum = 0.0f;
#pragma unroll
      for (int i = 0; i < (Q + 31) / 32; ++i) {
        if (lane + 32 * i < Q) {
          const float v = qs[w * Q + lane + 32 * i];
          mx = fmaxf(mx, fabsf(v));
          sum += v;
        }
      }
      for (int off = 16; off >= 1; off >>= 1) {
        mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, off));
        sum += __shfl_xor_sync(kFull, sum, off);
      }
      if (lane == 0) {
        stat[w][0] = mx;
        stat[w][1] = sum;
      }
    }
  }
  __syncthreads();
  Trace(a.trace[kTracePrep], blockIdx.x, kTraceLoopDone);
  float mx = 0.0f, qsum[4];
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    mx = fmaxf(mx, stat[r][0]);
    qsum[r] = stat[r][1];
  }
  float inv, mult;
  QueryScale(mx, kIntFormat, &inv, &mult);
  // Warp 1 writes the meta, so that warp 0's fragment words (the integer
  // format's) do not wait behind it.
  if (tid == 32) WriteQueryMeta(a, head_idx, mult, qsum, D);
  WriteQueryFragments<D, G8>(a, item_idx, h, hh, kIntFormat, qs, inv);
  Trace(a.trace[kTracePrep], blockIdx.x, kTraceEnd);
}

}  // namespace cuda_attend
}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_CUDA_ATTEND_PREP_CUH_
