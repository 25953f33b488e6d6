// The merge kernel of one decode-attention call: combines the split kernel's
// partial results with the online-softmax rule, un-rotates the history part
// and writes out / lse. Included by attend_kernels.cu only.
#ifndef OSCARKV_KERNELS_CUDA_ATTEND_MERGE_CUH_
#define OSCARKV_KERNELS_CUDA_ATTEND_MERGE_CUH_

#include "kernels/cuda/attend_claim.cuh"
#include "kernels/cuda/attend_prep.cuh"

namespace oscarkv {
namespace cuda_attend {

constexpr float kLn2 = 0.69314718055994531f;

// Combines the W warps' (m, l, acc) of each of the g heads, held in shared
// memory, into one partial at `out` (acc [g][D], then m [g], then l [g]:
// PartialFloats) with the block's kBlockThreads threads (at least HG). Starts
// with a block barrier (the warps' states written). Each warp's weight per
// head is computed once (thread hh, into shared memory) rather than by every
// thread of the head: a B = 1 call waits on this tail of the split kernel.
template <int D, int HG, int W, int kBlockThreads>
__device__ void CombineWarpStates(int g, const float (*sm_o)[HG][D], const float (*sm_m)[HG],
                                  const float (*sm_l)[HG], float* out) {
  static_assert(kBlockThreads >= HG, "one thread per head computes the weights");
  __shared__ float wt[HG][W];
  __syncthreads();
  if (threadIdx.x < g) {
    const int hh = threadIdx.x;
    float M = -INFINITY;
    for (int w = 0; w < W; ++w) M = fmaxf(M, sm_m[w][hh]);
    float L = 0.0f;
    for (int w = 0; w < W; ++w) {
      // 2^(-inf) = 0 for a warp without tokens; all without: M = -inf.
      const float x = M == -INFINITY ? 0.0f : FastExp2(sm_m[w][hh] - M);
      wt[hh][w] = x;
      L += x * sm_l[w][hh];
    }
    out[g * D + hh] = M;
    out[g * D + g + hh] = L;
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < g * D; idx += kBlockThreads) {
    const int hh = idx / D, d = idx % D;
    float A = 0.0f;
    for (int w = 0; w < W; ++w) {
      // A warp without tokens left its sm_o unwritten (weight 0).
      if (wt[hh][w] != 0.0f) A += wt[hh][w] * sm_o[w][hh][d];
    }
    out[hh * D + d] = A;
  }
}

// One output dim from the exact set (normalized o_exact, base-2 LSE lse_e2)
// and the un-rotated history set (o_hist, lse_h2), merged with the
// online-softmax rule (as MergeAttention on the CPU, there in natural logs);
// *lse gets the head's natural-log LSE. Both sets empty: 0, and *lse = -inf.
__device__ __forceinline__ float MergeSets(float lse_e2, float o_exact, float lse_h2, float o_hist,
                                           float* lse) {
  const float mx = fmaxf(lse_e2, lse_h2);
  if (mx == -INFINITY) {
    *lse = -INFINITY;
    return 0.0f;
  }
  const float wa = FastExp2(lse_e2 - mx);  // 0 for an empty set
  const float wb = FastExp2(lse_h2 - mx);
  const float x = wa > 0.0f ? wa * o_exact : 0.0f;
  const float y = wb > 0.0f ? wb * o_hist : 0.0f;
  *lse = (mx + FastLog2(wa + wb)) * kLn2;
  return (x + y) * __frcp_rn(wa + wb);
}

// One online-softmax state (base-2 logits) over a warp's share of partials;
// lane owns dims lane + 32e.
template <int D>
struct MergeState {
  static constexpr int EL = D / 32;
  float m = -INFINITY, l = 0.0f, acc[EL];

  __device__ void Clear() {
#pragma unroll
    for (int e = 0; e < EL; ++e) acc[e] = 0.0f;
  }
  // Moves the running max to cover `mx` (a round's max), rescaling l and acc.
  __device__ void MoveMax(float mx) {
    const float mn = fmaxf(m, mx);
    if (mn == -INFINITY) return;  // still empty
    const float f = FastExp2(m - mn);  // 0 while empty
    l *= f;
#pragma unroll
    for (int e = 0; e < EL; ++e) acc[e] *= f;
    m = mn;
  }
  // Adds a partial's acc with weight w = 2^(its m - this m) (its l is added
  // by the caller).
  __device__ __forceinline__ void Add(float w, const float (&pa)[EL]) {
#pragma unroll
    for (int e = 0; e < EL; ++e) acc[e] = fmaf(w, pa[e], acc[e]);
  }
};

// Combines the 4 warps' states of each of the two sets in shared memory into
// the normalized vectors o[set][D]; returns the base-2 LSE of each set (-inf
// when empty) in lse2[set].
template <int D>
__device__ void CombineWarps(const MergeState<D> (&st)[2], float (*sm_a)[kWarps][D],
                             float (*sm_m)[kWarps], float (*sm_l)[kWarps], float (*o)[D],
                             float (&lse2)[2]) {
  const int warp = WarpIndex(), lane = threadIdx.x & 31;
#pragma unroll
  for (int set = 0; set < 2; ++set) {
#pragma unroll
    for (int e = 0; e < D / 32; ++e) sm_a[set][warp][lane + 32 * e] = st[set].acc[e];
    if (lane == 0) {
      sm_m[set][warp] = st[set].m;
      sm_l[set][warp] = st[set].l;
    }
  }
  __syncthreads();
  // Approximate exp2 / log2 (ex2.approx, lg2.approx: relative errors near
  // 2^-22, inside the tests' 1e-4 on outputs and LSE) and one reciprocal per
  // set: the accurate library calls and a division per dim were most of
  // this step's instructions, on a B = 1 call's critical path.
#pragma unroll
  for (int set = 0; set < 2; ++set) {
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, sm_m[set][w]);
    float L = 0.0f;
    float wt[kWarps];
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      // 2^(-inf) = 0 for an empty warp; all empty: M = -inf, weights 0.
      wt[w] = M == -INFINITY ? 0.0f : FastExp2(sm_m[set][w] - M);
      L += wt[w] * sm_l[set][w];
    }
    const float inv = L > 0.0f ? __frcp_rn(L) : 0.0f;
#pragma unroll
    for (int i = 0; i < (D + kThreads - 1) / kThreads; ++i) {
      const int d = threadIdx.x + i * kThreads;
      if (d >= D) break;
      float A = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) A = fmaf(wt[w], sm_a[set][w][d], A);
      o[set][d] = L > 0.0f ? A * inv : 0.0f;  // 0 for an empty set
    }
    lse2[set] = L > 0.0f ? M + FastLog2(L) : -INFINITY;
  }
  __syncthreads();
}

// One block per (item, query head, slice of 32 output dims): combine the
// history partials and the exact partials of the head (both sets loaded in
// one pass, so the block waits for memory once, not once per set), un-rotate
// (o'·R_Vᵀ) the history part's slice, merge the two with the online-softmax
// rule exactly like MergeAttention, write the slice of out (and lse from
// slice 0). The R_V rows of the slice and the item's plan are read before
// waiting for the split kernel, so their latency is hidden. A B = 1 call
// waits on this kernel's instructions, one warp per scheduler (H200,
// 2026-11-30, run 19): the partials' statistics are read one per lane and
// combined with shuffles (below), not one partial after another.
// kSlice 64 (D = 128, not kWide; AttendLauncher::Prepare) halves the grid for batches
// whose 32-dim grid would not be resident at once (two waves at B8 on an
// H200); its R_V rows wait in shared memory, not registers (5 blocks per SM
// instead of 4).
template <int D, bool kWide, int kSlice>
__global__ void __launch_bounds__(kThreads, kWide ? 1 : 4) MergeKernel(LaunchArgs a) {
  static_assert(kSlice == 32 || (kSlice == 64 && D == 128 && !kWide), "slices of 32 or 64 dims");
  constexpr bool kRvShared = kSlice > 32;
  constexpr int EL = D / 32, kPerWarp = kSlice / kWarps;
  constexpr int kBatch = MergeBatch(D, kWide);  // partials per warp loaded before combining
  __shared__ float sm_a[2][kWarps][D];
  __shared__ float sm_m[2][kWarps], sm_l[2][kWarps];
  __shared__ float o_set[2][D];  // [0]: history (rotated basis), [1]: exact
  __shared__ float o_hist[kSlice];
  __shared__ __align__(16) float rv_s[kRvShared ? kSlice : 1][kRvShared ? D : 4];
  const int item_idx = blockIdx.x, qh = blockIdx.y, j0 = blockIdx.z * kSlice;
  const int warp = WarpIndex(), lane = threadIdx.x & 31;
  const int block = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  unsigned long long* const trace = a.trace[kTraceMerge];
  Trace(trace, block, kTraceStart);
  // The item's plan and its head's partial ranges were uploaded before the
  // prep kernel: read before waiting.
  const ItemPlan& item = a.items[item_idx];
  const int g = a.g, h = qh / g, hh = qh % g;
  const HeadPartials hp = a.head_partials[item_idx * a.PlanHeads() + h];
  const int nh = hp.hist_count, ne = hp.exact_count, n = nh + ne;
  const int hfirst = hp.hist_first, efirst = hp.exact_first;
  float* const out = item.out;
  float* const lse_out = item.lse;
  float rr[kRvShared ? 1 : kPerWarp][EL];
  if (item.num_pages > 0) {
    const float* rv = item.rotation.r_v + item.rotation.stride * a.KvHead(h);
    if constexpr (kRvShared) {
      // Rows j0 .. j0 + kSlice - 1 (read after CombineWarps' barriers), as
      // float4 when R_V is 16-byte aligned (the backend's rotations are;
      // the batch's need not be, as for R_K in the prep kernel).
      const float* src = rv + size_t(j0) * D;
      if ((reinterpret_cast<uintptr_t>(src) & 15u) == 0) {
        const float4* src4 = reinterpret_cast<const float4*>(src);
#pragma unroll 4
        for (int i = threadIdx.x; i < kSlice * D / 4; i += kThreads) {
          *reinterpret_cast<float4*>(&rv_s[i / (D / 4)][4 * (i % (D / 4))]) = __ldg(src4 + i);
        }
      } else {
        for (int i = threadIdx.x; i < kSlice * D; i += kThreads) rv_s[i / D][i % D] = __ldg(src + i);
      }
    } else {
#pragma unroll
      for (int jj = 0; jj < kPerWarp; ++jj) {
        const int j = j0 + warp * kPerWarp + jj;
#pragma unroll
        for (int e = 0; e < EL; ++e) rr[jj][e] = __ldg(rv + size_t(j) * D + lane + 32 * e);
      }
    }
  }
  WaitForPrerequisites();  // the split kernel's partials
  Trace(trace, block, kTraceWaited);
  if (block == 0) ResetClaims(a);

  // Entries [0, nh) are history partials, [nh, n) exact ones. Warp w takes
  // entries w + kWarps·i, 32 per round: lane i reads entry i's (m, l), so the
  // round's max per set, the weights 2^(m - max) and the weighted sum of l
  // are one load and a few shuffles per warp. The entries' acc rows are
  // loaded kBatch at a time and added with each weight shuffled from its
  // lane. (The first batch is written before the shuffles, but ptxas places
  // its loads after them, a second round of memory latency. Unconditional
  // loads made ptxas split them over the adds' branches, 1.5 us slower at
  // B1 8K; volatile loads were slower too; a __threadfence_block() after
  // them keeps them first and saved ~0.2 us of this phase but nothing
  // measurable per call, so it is not used: H200 SASS and timelines,
  // 2026-11-30, RESULTS run 20.) Offsets are 32-bit, in floats from
  // a.partials (< 2^31: Prepare refuses larger batches): the earlier loop
  // of one 64-bit address computation per load took 2.3 us after the wait
  // at B1 8K (run 19). An empty partial (m = -inf) weighs 0 against its acc
  // row, which the split kernel writes as zeros (CombineWarpStates), so
  // 0·row adds nothing.
  const float* const parts = a.partials;
  const int pf = static_cast<int>(PartialFloats(g, D));
  const int m_off = g * D + hh, l_off = g * D + g + hh, a_off = hh * D + lane;
  // Entry s's row (entries past the end, never read, give the last row's).
  auto row = [&](int s) {
    s = min(s, n - 1);
    return (s < nh ? hfirst + s : efirst + (s - nh)) * pf;
  };
  // The acc rows of this warp's entries i0 .. i0 + kBatch - 1 of the round
  // at r0 (of `count`; zeros past it).
  auto load_batch = [&](int r0, int i0, int count, float (&pa)[kBatch][EL]) {
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = i0 + u;
      const float* p = parts + row(r0 + kWarps * i) + a_off;
#pragma unroll
      for (int e = 0; e < EL; ++e) pa[u][e] = i < count ? p[32 * e] : 0.0f;
    }
  };
  MergeState<D> st[2];
  st[0].Clear();
  st[1].Clear();
  // Adds a loaded batch, entry i's weight from lane i % 32's w.
  auto add_batch = [&](int r0, int i0, int count, const float (&pa)[kBatch][EL], float w) {
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const float wt = __shfl_sync(kFull, w, (i0 + u) & 31);
      // Each entry adds to its own set only (a weight of 0 would still
      // carry a NaN of the other set's row).
      if (i0 + u >= count) break;
      if (r0 + kWarps * (i0 + u) >= nh) {
        st[1].Add(wt, pa[u]);
      } else {
        st[0].Add(wt, pa[u]);
      }
    }
  };
  for (int r0 = warp; r0 < n; r0 += 32 * kWarps) {
    const int mine = r0 + kWarps * lane;  // this lane's entry
    const bool my_exact = mine >= nh;
    float pm = -INFINITY, pl = 0.0f;
    if (mine < n) {
      const float* p = parts + row(mine);
      pm = p[m_off];
      pl = p[l_off];
    }
    const int count = min(32, (n - r0 + kWarps - 1) / kWarps);  // this warp's entries
    float pa[kBatch][EL];
    load_batch(r0, 0, count, pa);
    float mx[2] = {my_exact ? -INFINITY : pm, my_exact ? pm : -INFINITY};
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1) {
      mx[0] = fmaxf(mx[0], __shfl_xor_sync(kFull, mx[0], off));
      mx[1] = fmaxf(mx[1], __shfl_xor_sync(kFull, mx[1], off));
    }
    st[0].MoveMax(mx[0]);
    st[1].MoveMax(mx[1]);
    // An empty partial (m = -inf) weighs 0.
    const float w = pm == -INFINITY ? 0.0f : FastExp2(pm - (my_exact ? st[1].m : st[0].m));
    float lw[2] = {my_exact ? 0.0f : w * pl, my_exact ? w * pl : 0.0f};
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1) {
      lw[0] += __shfl_xor_sync(kFull, lw[0], off);
      lw[1] += __shfl_xor_sync(kFull, lw[1], off);
    }
    st[0].l += lw[0];
    st[1].l += lw[1];
    add_batch(r0, 0, count, pa, w);
    for (int i0 = kBatch; i0 < count; i0 += kBatch) {
      load_batch(r0, i0, count, pa);
      add_batch(r0, i0, count, pa, w);
    }
  }
  Trace(trace, block, kTraceWritten);
  float lse2[2];
  CombineWarps<D>(st, sm_a, sm_m, sm_l, o_set, lse2);
  Trace(trace, block, kTraceLoopDone);
  const float lse_h2 = lse2[0], lse_e2 = lse2[1];
  if (lse_h2 != -INFINITY) {
    // Warp w's kPerWarp (8 or 16) rows of R_V: every lane's share of each
    // dot product, then one reduce-scatter (9 or 16 shuffles, not 8 or 16
    // chains of 5).
    float ov[EL], s[kPerWarp];
#pragma unroll
    for (int e = 0; e < EL; ++e) ov[e] = o_set[0][lane + 32 * e];
#pragma unroll
    for (int jj = 0; jj < kPerWarp; ++jj) {
      s[jj] = 0.0f;
#pragma unroll
      for (int e = 0; e < EL; ++e) {
        if constexpr (kRvShared) {
          s[jj] = fmaf(ov[e], rv_s[warp * kPerWarp + jj][lane + 32 * e], s[jj]);
        } else {
          s[jj] = fmaf(ov[e], rr[jj][e], s[jj]);
        }
      }
    }
    const float sum = WarpSumScatter(s, lane);
    const int slot = WarpSumScatterSlot<kPerWarp>(lane);
    if (slot >= 0) o_hist[warp * kPerWarp + slot] = sum;
  } else {
    if (threadIdx.x < kSlice) o_hist[threadIdx.x] = 0.0f;
  }
  __syncthreads();
  float lse = -INFINITY;
  if (threadIdx.x < kSlice) {
    const int d = threadIdx.x;
    out[size_t(qh) * D + j0 + d] = MergeSets(lse_e2, o_set[1][j0 + d], lse_h2, o_hist[d], &lse);
  }
  if (threadIdx.x == 0 && blockIdx.z == 0 && lse_out != nullptr) lse_out[qh] = lse;
  Trace(trace, block, kTraceEnd);
}

}  // namespace cuda_attend
}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_CUDA_ATTEND_MERGE_CUH_
