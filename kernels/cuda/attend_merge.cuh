// The merge kernel of one decode-attention call: combines the split kernel's
// partial results with the online-softmax rule, un-rotates the history part
// and writes out / lse. Included by attend_kernels.cu only.
#ifndef OSCARKV_KERNELS_CUDA_ATTEND_MERGE_CUH_
#define OSCARKV_KERNELS_CUDA_ATTEND_MERGE_CUH_

#include "kernels/cuda/attend_prep.cuh"

namespace oscarkv {
namespace cuda_attend {

constexpr float kLn2 = 0.69314718055994531f;

// Combines the W warps' (m, l, acc) of each of the g heads, held in shared
// memory, into one partial at `out` (acc [g][D], then m [g], then l [g]:
// PartialFloats) with the block's kBlockThreads threads. Starts with a block
// barrier (the warps' states written).
template <int D, int HG, int W, int kBlockThreads>
__device__ void CombineWarpStates(int g, const float (*sm_o)[HG][D], const float (*sm_m)[HG],
                                  const float (*sm_l)[HG], float* out) {
  __syncthreads();
  for (int idx = threadIdx.x; idx < g * D; idx += kBlockThreads) {
    const int hh = idx / D, d = idx % D;
    float M = -INFINITY;
    for (int w = 0; w < W; ++w) M = fmaxf(M, sm_m[w][hh]);
    float L = 0.0f, A = 0.0f;
    if (M != -INFINITY) {
      for (int w = 0; w < W; ++w) {
        if (sm_m[w][hh] == -INFINITY) continue;
        const float wt = exp2f(sm_m[w][hh] - M);
        L += wt * sm_l[w][hh];
        A += wt * sm_o[w][hh][d];
      }
    }
    out[hh * D + d] = A;
    if (d == 0) {
      out[g * D + hh] = M;
      out[g * D + g + hh] = L;
    }
  }
}

// One output dim from the exact set (normalized o_exact, base-2 LSE lse_e2)
// and the un-rotated history set (o_hist, lse_h2), merged with the
// online-softmax rule (as MergeAttention on the CPU); *lse gets the head's
// natural-log LSE. Both sets empty: 0, and *lse = -inf.
__device__ __forceinline__ float MergeSets(float lse_e2, float o_exact, float lse_h2, float o_hist,
                                           float* lse) {
  const float lse_a = lse_e2 == -INFINITY ? -INFINITY : lse_e2 * kLn2;
  const float lse_b = lse_h2 == -INFINITY ? -INFINITY : lse_h2 * kLn2;
  const float mx = fmaxf(lse_a, lse_b);
  if (mx == -INFINITY) {
    *lse = -INFINITY;
    return 0.0f;
  }
  const float wa = lse_a == -INFINITY ? 0.0f : expf(lse_a - mx);
  const float wb = lse_b == -INFINITY ? 0.0f : expf(lse_b - mx);
  const float x = wa > 0.0f ? wa * o_exact : 0.0f;
  const float y = wb > 0.0f ? wb * o_hist : 0.0f;
  *lse = mx + logf(wa + wb);
  return (x + y) * (1.0f / (wa + wb));
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
  __device__ void Add(float pm, float pl, const float (&pa)[EL]) {
    const float mn = fmaxf(m, pm);
    const float f1 = exp2f(m - mn), f2 = exp2f(pm - mn);
    l = l * f1 + pl * f2;
#pragma unroll
    for (int e = 0; e < EL; ++e) acc[e] = acc[e] * f1 + pa[e] * f2;
    m = mn;
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
#pragma unroll
  for (int set = 0; set < 2; ++set) {
    float M = -INFINITY;
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, sm_m[set][w]);
    float L = 0.0f;
    float wt[kWarps];
    for (int w = 0; w < kWarps; ++w) {
      wt[w] = (M == -INFINITY || sm_m[set][w] == -INFINITY) ? 0.0f : exp2f(sm_m[set][w] - M);
      L += wt[w] * sm_l[set][w];
    }
    for (int d = threadIdx.x; d < D; d += kThreads) {
      float A = 0.0f;
      for (int w = 0; w < kWarps; ++w) A += wt[w] * sm_a[set][w][d];
      o[set][d] = L > 0.0f ? A / L : 0.0f;
    }
    lse2[set] = L > 0.0f ? M + log2f(L) : -INFINITY;
  }
  __syncthreads();
}

// One block per (item, query head, slice of 32 output dims): combine the
// history partials and the exact partials of the head (both sets loaded in
// one pass, so the block waits for memory once, not once per set), un-rotate
// (o'·R_Vᵀ) the history part's slice, merge the two with the online-softmax
// rule exactly like MergeAttention, write the slice of out (and lse from
// slice 0). The R_V rows of the slice are loaded before waiting for the split
// kernel, so their latency is hidden.
template <int D, bool kWide>
__global__ void __launch_bounds__(kThreads, kWide ? 1 : 4) MergeKernel(LaunchArgs a) {
  constexpr int EL = D / 32, kSlice = 32, kPerWarp = kSlice / kWarps;
  constexpr int kBatch = MergeBatch(D, kWide);  // partials per warp loaded before combining
  __shared__ float sm_a[2][kWarps][D];
  __shared__ float sm_m[2][kWarps], sm_l[2][kWarps];
  __shared__ float o_set[2][D];  // [0]: history (rotated basis), [1]: exact
  __shared__ float o_hist[kSlice];
  const int item_idx = blockIdx.x, qh = blockIdx.y, j0 = blockIdx.z * kSlice;
  const int warp = WarpIndex(), lane = threadIdx.x & 31;
  const ItemPlan& item = a.items[item_idx];  // uploaded before the prep kernel
  const int g = a.g, h = qh / g, hh = qh % g;
  float rr[kPerWarp][EL];
  if (item.num_pages > 0) {
    const float* rv = item.rotation.r_v + item.rotation.stride * h;
#pragma unroll
    for (int jj = 0; jj < kPerWarp; ++jj) {
      const int j = j0 + warp * kPerWarp + jj;
#pragma unroll
      for (int e = 0; e < EL; ++e) rr[jj][e] = __ldg(rv + size_t(j) * D + lane + 32 * e);
    }
  }
  WaitForPrerequisites();  // the split kernel's partials

  // Entries [0, nh) are history partials, [nh, nh + ne) exact ones.
  const int nh = item.hist_splits, ne = item.exact_splits;
  const int hfirst = item.hist_begin + h * nh, efirst = item.exact_begin + h * ne;
  MergeState<D> st[2];
  st[0].Clear();
  st[1].Clear();
  for (int s0 = warp; s0 < nh + ne; s0 += kBatch * kWarps) {
    float pm[kBatch], pl[kBatch], pa[kBatch][EL];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int s = s0 + u * kWarps;
      pm[u] = -INFINITY;
      pl[u] = 0.0f;
#pragma unroll
      for (int e = 0; e < EL; ++e) pa[u][e] = 0.0f;
      if (s < nh + ne) {
        const int partial = s < nh ? hfirst + s : efirst + (s - nh);
        const float* p = a.partials + size_t(partial) * PartialFloats(g, D);
        pm[u] = p[g * D + hh];
        pl[u] = p[g * D + g + hh];
#pragma unroll
        for (int e = 0; e < EL; ++e) pa[u][e] = p[hh * D + lane + 32 * e];
      }
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (pm[u] == -INFINITY) continue;
      if (s0 + u * kWarps < nh) {
        st[0].Add(pm[u], pl[u], pa[u]);
      } else {
        st[1].Add(pm[u], pl[u], pa[u]);
      }
    }
  }
  float lse2[2];
  CombineWarps<D>(st, sm_a, sm_m, sm_l, o_set, lse2);
  const float lse_h2 = lse2[0], lse_e2 = lse2[1];
  if (lse_h2 != -INFINITY) {
#pragma unroll
    for (int jj = 0; jj < kPerWarp; ++jj) {
      float s = 0.0f;
#pragma unroll
      for (int e = 0; e < EL; ++e) s = fmaf(o_set[0][lane + 32 * e], rr[jj][e], s);
#pragma unroll
      for (int off = 16; off >= 1; off >>= 1) s += __shfl_xor_sync(kFull, s, off);
      if (lane == 0) o_hist[warp * kPerWarp + jj] = s;
    }
  } else {
    if (threadIdx.x < kSlice) o_hist[threadIdx.x] = 0.0f;
  }
  __syncthreads();
  float lse = -INFINITY;
  if (threadIdx.x < kSlice) {
    const int d = threadIdx.x;
    item.out[size_t(qh) * D + j0 + d] = MergeSets(lse_e2, o_set[1][j0 + d], lse_h2, o_hist[d], &lse);
  }
  if (threadIdx.x == 0 && blockIdx.z == 0 && item.lse != nullptr) item.lse[qh] = lse;
}

}  // namespace cuda_attend
}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_CUDA_ATTEND_MERGE_CUH_
