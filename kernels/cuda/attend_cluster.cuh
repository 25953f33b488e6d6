// The cluster kernel of one decode-attention call for small batches (variant
// 11): query prep, split-KV attention and merge in one launch, the blocks of
// a cluster meeting through distributed shared memory instead of global
// memory and kernel boundaries. Included by attend_kernels.cu only.
//
// K clusters (LaunchArgs::clusters_per_head) of NB blocks (4, 8 or 16) per
// (item, kv head), blocks of 4 warps. Unit k·NB + r of an (item, kv head)
// (FillClusterUnits) is a contiguous range of the head's pages and some of
// its exact blocks. Per block of rank r in its cluster (S = D / NB dims):
//   1. prep: columns [S·r, S·r + S) of q' = q·R_K·scale·log2e for the g
//      query heads; a cluster barrier; every block gathers all of q' and
//      computes the digit scales and meta; block r makes 1/NB of the query
//      fragment words; a cluster barrier; every block gathers them (the
//      prep kernel's formats, in shared memory), while its warps' first
//      chunks are in flight;
//   2. its warps run variant 8's history loop (HistoryWarpIntPv) over its
//      pages, then its exact blocks (ExactWarp); the warps are combined into
//      one partial per set (history, exact) in shared memory;
//   3. block r combines dims [S·r, S·r + S) of both sets over the cluster's
//      NB partials with the online-softmax rule (reading the other blocks'
//      shared memory). With K = 1 that is the head's result. With K > 1 each
//      cluster writes its result to global memory and counts itself done;
//      the last cluster of the head combines the K results the same way;
//   4. the blocks gather the merged history o', and block r un-rotates its S
//      output dims (o'·R_Vᵀ), merges them with the exact set exactly like
//      MergeKernel and writes them (rank 0 the lse).
// For D = 128, G = D, at most 4 query heads per kv head (variant 8's shape)
// and batches with at least one cluster per (item, kv head) at once
// (AttendLauncher::Prepare checks; other batches run the default variant).
// Measured slower than variant 8 at every benchmark shape (H200, 2026-11-30,
// tests/bench/RESULTS.md run 18: B1 8K 26.7 against 18.5 µs with 8-block
// clusters): kept as an option, for the fixed cost it still has to lose.
#ifndef OSCARKV_KERNELS_CUDA_ATTEND_CLUSTER_CUH_
#define OSCARKV_KERNELS_CUDA_ATTEND_CLUSTER_CUH_

#include <cooperative_groups.h>

#include "kernels/cuda/attend_exact.cuh"
#include "kernels/cuda/attend_history_int.cuh"
#include "kernels/cuda/attend_merge.cuh"
#include "kernels/cuda/attend_prep.cuh"

namespace oscarkv {
namespace cuda_attend {
namespace cluster {

// Warps per block: 4, three blocks per SM, as the split kernel. (Clusters
// of 16 blocks of 12 warps, one block per SM, fit only 7 at once on the
// H200, not the 8 of a B = 1 call: the SMs of a cluster share a GPC.)
constexpr int kWarpsPerBlock = 4;
constexpr int kThreads = kWarpsPerBlock * 32;

// Split cluster barrier: arrive (releasing this thread's writes, shared
// memory included, to the cluster), then wait (acquiring the others').
__device__ __forceinline__ void Arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void Wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// dst[i] = *src(i) for i < n (n <= kPer · kThreads), thread t taking
// i = t + kThreads·u: all of a thread's loads (from other blocks' shared
// memory) are issued before its first store.
template <int kPer, typename T, typename Src>
__device__ __forceinline__ void Gather(T* dst, int n, Src src) {
  T v[kPer];
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int i = threadIdx.x + kThreads * u;
    if (i < n) v[u] = *src(i);
  }
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int i = threadIdx.x + kThreads * u;
    if (i < n) dst[i] = v[u];
  }
}

// The online-softmax combine of N states of one output dim (base-2 max m,
// sum l, accumulator a; kUnitL: every l is 1, for normalized outputs whose
// LSE is their m): the combined max M and sum L, and the normalized output
// (0 when every state is empty, L = 0).
struct Combined {
  float M, L, o;
  __device__ float Lse2() const { return L > 0.0f ? M + log2f(L) : -INFINITY; }
};
template <int N, bool kUnitL>
__device__ __forceinline__ Combined CombineStates(const float (&m)[N], const float (&l)[N],
                                                  const float (&acc)[N]) {
  float M = -INFINITY;
#pragma unroll
  for (int r = 0; r < N; ++r) M = fmaxf(M, m[r]);
  float L = 0.0f, A = 0.0f;
  if (M != -INFINITY) {
#pragma unroll
    for (int r = 0; r < N; ++r) {
      if (m[r] == -INFINITY) continue;
      const float wt = exp2f(m[r] - M);
      L += kUnitL ? wt : wt * l[r];
      A += wt * acc[r];
    }
  }
  return {M, L, L > 0.0f ? __fdividef(A, L) : 0.0f};
}

}  // namespace cluster

template <int D, int NB>
__global__ void __launch_bounds__(cluster::kThreads, 12 / cluster::kWarpsPerBlock)
    ClusterKernel(LaunchArgs a) {
  namespace cg = cooperative_groups;
  using Warp = HistoryWarpIntPv<D, 1, false, 2>;
  using Ex = ExactWarp<D, Cfg<D, 1, false>::HG>;
  constexpr int HG = Cfg<D, 1, false>::HG;
  constexpr int W = cluster::kWarpsPerBlock, kThreadsB = cluster::kThreads;
  constexpr int S = D / NB;  // q' columns, merged dims and output dims per block
  static_assert(S * NB == D, "the blocks of a cluster split the head dim evenly");
  __shared__ __align__(16) float sm_o[W][HG][D];  // also the exact steps' scratch
  __shared__ float sm_m[W][HG], sm_l[W][HG];
  // This block's partials ([0] history, rotated; [1] exact), each acc [g][D],
  // m [g], l [g] (PartialFloats).
  constexpr int kPartFloats = PartialFloats(HG, D);
  __shared__ float part[2][kPartFloats];
  // q' columns: thread t takes column j = t % S over rows t / S + kRowGroups·i.
  constexpr int kRowGroups = kThreadsB / S, kRowsPerThread = D / kRowGroups;
  static_assert(kRowGroups * S == kThreadsB && kRowsPerThread * kRowGroups == D, "prep shape");
  __shared__ float q_red[kRowGroups][HG][S];  // partial sums of q' columns
  __shared__ float q_slice[HG][S];            // this block's columns of q'
  __shared__ float rv_t[D][S + 1];  // R_V[S·rank + j][d] at [d][j] (padded: no bank conflicts)
  __shared__ float qs[HG][D];       // all of q'; at the end the merged history o'
  __shared__ float q_inv[HG];
  __shared__ uint32_t qfrag[kIntFragWords];
  constexpr int kFragShare = kIntFragWords / NB;  // fragment words each block makes
  __shared__ uint32_t frag_share[kFragShare];
  __shared__ float qmeta[HG * kQueryMetaFloats];
  __shared__ float qexact[HG * D];  // q·scale·log2e, unrotated
  __shared__ float o_slice[2][HG][S];  // merged dims [S·rank, +S) of both sets
  __shared__ float lse2[2][HG];        // base-2 LSE of both sets (every block the same)
  __shared__ int last_flag;            // rank 0: this cluster is the head's last (K > 1)

  const cg::cluster_group cl = cg::this_cluster();
  const int rank = static_cast<int>(cl.block_rank());
  const int tid = threadIdx.x, warp = WarpIndex(), lane = tid & 31;
  const WorkUnit wu = a.work[blockIdx.x];
  const ItemPlan& item = a.items[wu.item];
  const int g = a.g, h = wu.kv_head;
  const bool item_history = item.num_pages > 0;
  const bool has_history = wu.begin < wu.end, has_exact = wu.exact_begin < wu.exact_end;
  // The warps read the query from this block's shared memory, as item 0 and
  // kv head 0 of these arguments.
  LaunchArgs la = a;
  la.qfrag = qfrag;
  la.qmeta = qmeta;
  auto clear_warp_state = [&] { ClearWarpState<HG>(sm_m[warp], sm_l[warp], lane); };
  clear_warp_state();
  if (has_history && has_exact) PrefetchExactRowsL2<D, kThreadsB>(a, wu);

  // The history loop's state; its first two chunks go in flight now.
  const int cpp = a.geom.page_tokens / 32;
  const int n = has_history ? (wu.end - wu.begin) * cpp : 0;
  Warp hw;
  hw.InitOffsets(a.geom, h, lane);
  WarpPages<W> pages(item, wu.begin, n, cpp, warp, lane);
  auto in_page = [&](int it) { return pages.InPage(it); };
  auto page_of = [&](int it) { return pages.Page(it); };
  const int iters = pages.Iterations();
  typename Warp::Regs ra, rb;
  if (iters > 0) hw.Load(ra, page_of(0), in_page(0));
  if (iters > 1) hw.Load(rb, page_of(1), in_page(1));

  // 1. Query prep. All of a thread's loads are issued before the first use.
  const float* rk = item.rotation.r_k + item.rotation.stride * h;
  const float* rv = item.rotation.r_v + item.rotation.stride * h;
  const int jcol = tid % S, row_group = tid / S;
  float rk_col[kRowsPerThread];
  if (item_history) {
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      rk_col[i] = __ldg(rk + size_t(row_group + kRowGroups * i) * D + S * rank + jcol);
    }
    // R_V's rows of this block's outputs, wanted at the end: into L2 now.
    for (int line = tid; line < S * (D / 32); line += kThreadsB) {
      asm volatile("prefetch.global.L2 [%0];\n" ::"l"(rv + size_t(S * rank) * D + line * 32));
    }
  }
  constexpr int kQPerThread = HG * D / kThreadsB;
  float qv[kQPerThread];
#pragma unroll
  for (int i = 0; i < kQPerThread; ++i) {
    const int idx = tid + kThreadsB * i;
    qv[i] = idx < g * D ? item.q[size_t(h * g) * D + idx] : 0.0f;
  }
#pragma unroll
  for (int i = 0; i < kQPerThread; ++i) qexact[tid + kThreadsB * i] = qv[i] * a.scale_log2;
  __syncthreads();
  if (item_history) {
    float acc[HG];
#pragma unroll
    for (int hh = 0; hh < HG; ++hh) acc[hh] = 0.0f;
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int d = row_group + kRowGroups * i;
#pragma unroll
      for (int hh = 0; hh < HG; ++hh) acc[hh] = fmaf(qexact[hh * D + d], rk_col[i], acc[hh]);
    }
#pragma unroll
    for (int hh = 0; hh < HG; ++hh) q_red[row_group][hh][jcol] = acc[hh];
    __syncthreads();
    for (int idx = tid; idx < HG * S; idx += kThreadsB) {
      const int hh = idx / S, j = idx % S;
      float sum = 0.0f;
#pragma unroll
      for (int r = 0; r < kRowGroups; ++r) sum += q_red[r][hh][j];
      q_slice[hh][j] = sum;
    }
  }
  cl.sync();  // every block's q_slice written
  if (item_history) {
    cluster::Gather<HG * D / kThreadsB>(&qs[0][0], g * D, [&](int i) {
      return cl.map_shared_rank(&q_slice[i / D][(i % D) % S], (i % D) / S);
    });
    __syncthreads();
    if (warp < g) {  // head `warp`: digit scale and meta, as the prep kernel
      const int hh = warp;
      float mx = 0.0f, qsum[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float v = qs[hh][32 * k + lane];
        mx = fmaxf(mx, fabsf(v));
        float sum = v;
#pragma unroll
        for (int off = 16; off >= 1; off >>= 1) sum += __shfl_xor_sync(kFull, sum, off);
        qsum[k] = sum;
      }
#pragma unroll
      for (int off = 16; off >= 1; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, off));
      float inv, mult;
      QueryScale(mx, true, &inv, &mult);
      if (lane == 0) {
        q_inv[hh] = inv;
        WriteQueryMeta(la, hh, mult, qsum, D);
      }
    }
    __syncthreads();
    // This block's share of the fragment words, then all of them from the
    // cluster (HistoryWarpIntPv's paired integer format).
    for (int w = tid; w < kFragShare; w += kThreadsB) {
      const int idx = rank * kFragShare + w;
      const IntFragSlot slot = IntFragSlotOf(idx, true);
      frag_share[w] = slot.col < g ? IntFragWord(idx, slot.digit, qs[slot.col], q_inv[slot.col]) : 0u;
    }
  }
  cl.sync();  // every block's share of the fragments written
  if (item_history) {
    cluster::Gather<kIntFragWords / kThreadsB>(qfrag, kIntFragWords, [&](int i) {
      return cl.map_shared_rank(&frag_share[i % kFragShare], i / kFragShare);
    });
  }
  __syncthreads();

  // 2. History, then exact blocks.
  if (iters > 0) {
    hw.InitQuery(la, 0, 0, lane);
    // a.ablate (benchmarks only, see AttendLauncher::set_ablate) is 0 in service.
    RunDoubleBufferedChunks(hw, ra, rb, iters, a.ablate, page_of, in_page);
    hw.Finish(g, sm_o[warp], sm_m[warp], sm_l[warp]);
  }
  CombineWarpStates<D, HG, W, kThreadsB>(g, sm_o, sm_m, sm_l, part[0]);
  __syncthreads();  // every thread is done reading the history state
  clear_warp_state();
  if (has_exact) {
    // Each exact block's tokens split over the W warps (as the split kernel
    // does over its 4).
    Ex ex;
    const int nb = wu.exact_end - wu.exact_begin;
    int e = 0, t = 0, t1 = 0;
    ExactBlockRef blk{nullptr, 0};
    auto seek = [&](int from) {
      for (e = from; e < nb; ++e) {
        blk = wu.exact[e];
        if (Ex::WarpTokens(blk.tokens, W, warp, t, t1)) return;
      }
    };
    typename Ex::Rows rows;
    seek(0);
    if (e < nb) {
      ex.Init(qexact, 1.0f, g, lane);  // scaled already
      Ex::LoadRows(a, h, blk, t, t1, lane, rows);
      while (e < nb) {
        ex.Step(g, rows, t, t1, lane, &sm_o[warp][0][0]);  // free until Finish
        t += Ex::kTokensPerStep;
        if (t >= t1) seek(e + 1);
        if (e < nb) Ex::LoadRows(a, h, blk, t, t1, lane, rows);
      }
      ex.Finish(g, lane, sm_o[warp], sm_m[warp], sm_l[warp]);
    }
  }
  CombineWarpStates<D, HG, W, kThreadsB>(g, sm_o, sm_m, sm_l, part[1]);

  // R_V's rows of this block's outputs (L2 hits since the prefetch),
  // transposed.
  if (item_history) {
    constexpr int kPer = S * D / kThreadsB;
    float v[kPer];
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int i = tid + kThreadsB * u, j = i / D, d = i % D;
      v[u] = __ldg(rv + size_t(S * rank + j) * D + d);
    }
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int i = tid + kThreadsB * u;
      rv_t[i % D][i / D] = v[u];
    }
  }

  // 3. Merge: dims [S·rank, +S) of both sets over the cluster's partials.
  cl.sync();  // every block's partials written
  for (int idx = tid; idx < 2 * HG * S; idx += kThreadsB) {
    const int set = idx / (HG * S), hh = (idx / S) % HG, j = idx % S;
    if (hh < g) {
      float pm[NB], pl[NB], pa[NB];
#pragma unroll
      for (int r = 0; r < NB; ++r) {
        pm[r] = *cl.map_shared_rank(&part[set][g * D + hh], r);
        pl[r] = *cl.map_shared_rank(&part[set][g * D + g + hh], r);
        pa[r] = *cl.map_shared_rank(&part[set][hh * D + S * rank + j], r);
      }
      const cluster::Combined c = cluster::CombineStates<NB, false>(pm, pl, pa);
      o_slice[set][hh][j] = c.o;
      if (j == 0) lse2[set][hh] = c.Lse2();
    }
  }
  const int K = a.clusters_per_head;
  if (K > 1) {
    // This cluster's result of the head: {o[set][hh][D], lse2[set][hh]} per
    // set at partials + (head_cluster·2 + set)·PartialFloats(g, D).
    const int head = wu.item * a.geom.kv_heads + h;
    const int kc = static_cast<int>(blockIdx.x / NB) % K;
    auto result_of = [&](int k, int set) {
      return a.partials + size_t((head * K + k) * 2 + set) * PartialFloats(g, D);
    };
    __syncthreads();  // o_slice, lse2 written
    for (int idx = tid; idx < 2 * HG * S; idx += kThreadsB) {
      const int set = idx / (HG * S), hh = (idx / S) % HG, j = idx % S;
      if (hh < g) {
        float* res = result_of(kc, set);
        res[hh * D + S * rank + j] = o_slice[set][hh][j];
        if (rank == 0 && j == 0) res[g * D + hh] = lse2[set][hh];
      }
    }
    __threadfence();
    cl.sync();  // the cluster's result written and fenced
    if (rank == 0 && tid == 0) {
      const unsigned done = atomicAdd(a.cluster_counts + head, 1u);
      const bool last = done + 1 == static_cast<unsigned>(K);
      if (last) a.cluster_counts[head] = 0;  // for the next launch (replays)
      last_flag = last ? 1 : 0;
    }
    cl.sync();  // rank 0's flag written
    if (*cl.map_shared_rank(&last_flag, 0) == 0) {
      cl.sync();  // no block exits while another reads its shared memory
      return;
    }
    __threadfence();
    // The last cluster: dims [S·rank, +S) of both sets over the K results
    // (L2 reads: other clusters wrote them during this launch).
    for (int idx = tid; idx < 2 * HG * S; idx += kThreadsB) {
      const int set = idx / (HG * S), hh = (idx / S) % HG, j = idx % S;
      if (hh < g) {
        // All K results' loads in flight at once (K <= kMaxClustersPerHead).
        float lk[kMaxClustersPerHead], ok[kMaxClustersPerHead];
#pragma unroll
        for (int k = 0; k < kMaxClustersPerHead; ++k) {
          const float* res = result_of(min(k, K - 1), set);
          lk[k] = k < K ? __ldcg(res + g * D + hh) : -INFINITY;
          ok[k] = k < K ? __ldcg(res + hh * D + S * rank + j) : 0.0f;
        }
        // A cluster's normalized o weighs 2^(its lse).
        const cluster::Combined c = cluster::CombineStates<kMaxClustersPerHead, true>(lk, lk, ok);
        o_slice[set][hh][j] = c.o;
        if (j == 0) lse2[set][hh] = c.Lse2();
      }
    }
    cl.sync();  // every block's merged dims written
  } else {
    cl.sync();  // every block's merged dims written
  }
  // 4. Un-rotation and output.
  cluster::Gather<HG * D / kThreadsB>(&qs[0][0], g * D, [&](int i) {
    return cl.map_shared_rank(&o_slice[0][i / D][(i % D) % S], (i % D) / S);
  });
  // No block reads another's shared memory after this; each waits for the
  // others' reads of its own before it exits.
  cluster::Arrive();
  __syncthreads();
  {
    // Warp hh, lane: output dim j = lane % S of head hh over dims
    // [piece·D·S/32, +D·S/32), piece = lane / S, summed over the pieces.
    static_assert(W == HG, "one warp per head of the group");
    constexpr int kPieces = 32 / S, kDims = D / kPieces;
    const int hh = warp, j = lane % S, piece = lane / S;
    const float lse_h2 = hh < g ? lse2[0][hh] : -INFINITY;
    const float lse_e2 = hh < g ? lse2[1][hh] : -INFINITY;
    float y = 0.0f;
    if (item_history && lse_h2 != -INFINITY) {
#pragma unroll 8
      for (int e = 0; e < kDims; ++e) {
        const int d = piece * kDims + e;
        y = fmaf(qs[hh][d], rv_t[d][j], y);
      }
    }
#pragma unroll
    for (int off = S; off < 32; off <<= 1) y += __shfl_xor_sync(kFull, y, off);
    if (hh < g && piece == 0) {
      const int qh = h * g + hh;
      float lse;
      item.out[size_t(qh) * D + S * rank + j] = MergeSets(lse_e2, o_slice[1][hh][j], lse_h2, y, &lse);
      if (rank == 0 && j == 0 && item.lse != nullptr) item.lse[qh] = lse;
    }
  }
  cluster::Wait();
}

}  // namespace cuda_attend
}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_CUDA_ATTEND_CLUSTER_CUH_
