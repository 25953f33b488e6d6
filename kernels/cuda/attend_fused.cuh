// The fused decode-attention kernel (variant 6): one launch per call, no
// query-prep or merge kernel. Included by attend_kernels.cu only.
//
// Every block takes one work unit (attend_plan.h) and:
//   1. history units: each warp's lane 0 starts bulk copies (TMA,
//      cp.async.bulk) of its first kStages 32-token chunks into a per-warp
//      ring in shared memory, completed on one mbarrier per slot; the copy
//      engine, not registers, holds the bytes in flight;
//   2. computes the query it needs itself while those copies fly: exact units
//      the scaled query q·scale·log2e, history units q' = q·R_K·scale·log2e
//      of the kv head's g query heads and the MMA fragments and sums of q'
//      (the same formats as the prep kernel of the 3-kernel path);
//   3. runs the same warp math as the split kernel (HistoryWarp / ExactWarp)
//      over the staged chunks, refilling each slot as soon as it is read;
//   4. writes its partial, and the last block of each (item, kv head) to
//      finish (a counter per (item, kv head), reset by that block) combines
//      the partials of the group with the online-softmax rule, un-rotates
//      the history part (o'·R_Vᵀ) and writes out and lse.
// Blocks past the work units write zeros and -inf for items with no tokens.
#ifndef OSCARKV_KERNELS_CUDA_ATTEND_FUSED_CUH_
#define OSCARKV_KERNELS_CUDA_ATTEND_FUSED_CUH_

#include "kernels/cuda/attend_device.cuh"
#include "kernels/cuda/attend_exact.cuh"
#include "kernels/cuda/attend_history.cuh"
#include "kernels/cuda/attend_merge.cuh"

namespace oscarkv {
namespace cuda_attend {
namespace fused {

// Shared-memory ring slots per warp, and bytes per slot: one 32-token chunk
// of one kv head laid out like a one-head, 32-token page (K codes, K params,
// V codes, V params).
template <int D>
constexpr int Stages() { return D <= 128 ? 4 : 2; }
template <int D, int NG>
constexpr int SlotBytes() { return 16 * D + 256 * NG; }
template <int D, int NG>
constexpr int RingBytes() { return kWarps * Stages<D>() * SlotBytes<D, NG>(); }

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void MbarInit(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(SmemAddr(bar)) : "memory");
}
// Makes the barrier inits visible to the async (copy) proxy.
__device__ __forceinline__ void FenceBarrierInit() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Orders this thread's (and, after __syncwarp, the warp's) generic reads of
// a slot before the async proxy's next write into it.
__device__ __forceinline__ void FenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void MbarExpectTx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(SmemAddr(bar)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void BulkCopy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
          SmemAddr(dst)),
      "l"(src), "r"(bytes), "r"(SmemAddr(bar))
      : "memory");
}
__device__ __forceinline__ void MbarWait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT_%=;\n"
      "}\n" ::"r"(SmemAddr(bar)),
      "r"(parity)
      : "memory");
}

// Words of the query fragments of one kv head: the integer format (D = 128,
// at most 4 heads) or the fp16 hi / lo format.
template <int D, bool G8, bool kInt>
constexpr int FragWords() { return kInt ? 2 * 4 * 2 * 32 : (G8 ? 2 : 1) * (D / 16) * 2 * 32; }

// Shared memory of the block's query (prologue) and partial (epilogue).
template <int D, bool G8, bool kInt>
struct BlockSmem {
  static constexpr int HG = G8 ? 8 : 4;
  static constexpr int kSlices = 512 / D;  // q·R_K row slices (4 column words per thread)
  float qin[HG][D];       // the raw query of the group
  float qr[HG][D];        // q' (history) or q·scale·log2e (exact)
  union {
    float red[kSlices][HG][D];   // q·R_K partial sums
    float o[kWarps][HG][D];      // the warps' accumulators (WritePartial)
    float merged[2][HG][D];      // last block: combined history / exact vectors
  } u;
  uint32_t frag[FragWords<D, G8, kInt>()];
  float meta[HG][kQueryMetaFloats];
  float m[kWarps][HG], l[kWarps][HG];
  float set_m[2][HG], set_l[2][HG];
  uint64_t bars[kWarps][Stages<D>()];
  int last;
};

// Dynamic shared memory of a block: the ring, then BlockSmem.
template <int D, int NG, bool G8, bool kInt>
constexpr int DynamicSmemBytes() {
  return RingBytes<D, NG>() + static_cast<int>(sizeof(BlockSmem<D, G8, kInt>));
}

// Loads the group's raw query; for exact units also the scaled query.
template <int D, int HG>
__device__ void LoadQuery(const LaunchArgs& a, const ItemPlan& item, int h, bool scaled,
                          float (*qin)[D], float (*qr)[D]) {
  const int g = a.g;
  const float* q = item.q + size_t(h) * g * D;
  for (int idx = threadIdx.x; idx < g * D; idx += kThreads) {
    const float v = q[idx];
    qin[idx / D][idx % D] = v;
    if (scaled) qr[idx / D][idx % D] = v * a.scale_log2;
  }
}

// q' = q·R_K·scale·log2e of the group's heads, their meta {multiplier,
// per-group Σq'} and the MMA fragments (formats: see PrepKernel).
template <int D, bool G8, bool kInt>
__device__ __noinline__ void BuildRotatedQuery(const LaunchArgs& a, const ItemPlan& item, int h,
                                  BlockSmem<D, G8, kInt>& sm) {
  constexpr int HG = BlockSmem<D, G8, kInt>::HG, CG = D / 4, kSlices = 512 / D,
                kRows = D / kSlices;
  const int g = a.g, tid = threadIdx.x;
  const int cg = tid % CG, slice = tid / CG;
  const float* rk = item.rotation.r_k + item.rotation.stride * h;
  {
    float acc[HG][4];
#pragma unroll
    for (int hh = 0; hh < HG; ++hh)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[hh][e] = 0.0f;
    constexpr int kUnroll = kRows < 16 ? kRows : 16;
    for (int i0 = 0; i0 < kRows; i0 += kUnroll) {
      float4 r[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        r[u] = __ldg(reinterpret_cast<const float4*>(rk + size_t(slice * kRows + i0 + u) * D) + cg);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = slice * kRows + i0 + u;
#pragma unroll
        for (int hh = 0; hh < HG; ++hh) {
          if (hh < g) {
            const float x = sm.qin[hh][i];
            acc[hh][0] = fmaf(x, r[u].x, acc[hh][0]);
            acc[hh][1] = fmaf(x, r[u].y, acc[hh][1]);
            acc[hh][2] = fmaf(x, r[u].z, acc[hh][2]);
            acc[hh][3] = fmaf(x, r[u].w, acc[hh][3]);
          }
        }
      }
    }
#pragma unroll
    for (int hh = 0; hh < HG; ++hh)
#pragma unroll
      for (int e = 0; e < 4; ++e) sm.u.red[slice][hh][4 * cg + e] = acc[hh][e];
  }
  __syncthreads();
  for (int idx = tid; idx < g * D; idx += kThreads) {
    const int hh = idx / D, j = idx % D;
    float s = 0.0f;
#pragma unroll
    for (int sl = 0; sl < kSlices; ++sl) s += sm.u.red[sl][hh][j];
    sm.qr[hh][j] = s * a.scale_log2;
  }
  __syncthreads();
  // Per head: max |q'| and the per-group sums (a warp per head).
  const int warp = WarpIndex(), lane = tid & 31;
  const int ng = D / a.geom.group_size;
  for (int hh = warp; hh < g; hh += kWarps) {
    float mx = 0.0f, sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int e = 0; e < D / 32; ++e) {
      const int d = lane + 32 * e;
      const float v = sm.qr[hh][d];
      mx = fmaxf(mx, fabsf(v));
      const int gi = d / (D / ng);
#pragma unroll
      for (int k = 0; k < 4; ++k) sum[k] += gi == k ? v : 0.0f;
    }
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1) {
      mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, off));
#pragma unroll
      for (int k = 0; k < 4; ++k) sum[k] += __shfl_xor_sync(kFull, sum[k], off);
    }
    if (lane == 0) {
      int e = 0;
      const bool ok = mx > 0.0f && isfinite(mx);
      if (ok) frexpf(mx, &e);
      // fp16 format: max |q'|·inv in [256, 512); integer: in [0.5, 1).
      const int shift = kInt ? 0 : 9, mshift = kInt ? 6 : 9;
      sm.meta[hh][0] = ok ? ldexpf(1.0f, e - mshift) : (kInt ? 1.0f / 64.0f : 1.0f);
#pragma unroll
      for (int k = 0; k < 4; ++k) sm.meta[hh][1 + k] = k < ng ? sum[k] : 0.0f;
      sm.meta[hh][5] = ok ? ldexpf(1.0f, shift - e) : 1.0f;  // inv, used below
      sm.meta[hh][6] = sm.meta[hh][7] = 0.0f;
    }
  }
  __syncthreads();
  if constexpr (kInt) {
    // Base-128 digits j of v = q'·inv·4^(3-kk) for every (head, dim), kk =
    // the dim's quarter (v = Σ_j digit_j·128^-j), as bytes [j][head][dim] ...
    constexpr int Q = D / 4;
    auto* digits = reinterpret_cast<int8_t(*)[HG][D]>(&sm.u.red[0][0][0]);
    for (int idx = tid; idx < g * D; idx += kThreads) {
      const int col = idx / D, d = idx % D, kk = d / Q;
      float rest = sm.qr[col][d] * sm.meta[col][5] *
                   (kk == 0 ? 64.0f : kk == 1 ? 16.0f : kk == 2 ? 4.0f : 1.0f);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float dj = rintf(rest);
        digits[j][col][d] = static_cast<int8_t>(static_cast<int>(dj));
        rest = (rest - dj) * 128.0f;
      }
    }
    __syncthreads();
    // ... packed into the B fragments of the m16n8k32 u8·s8 MMA (see
    // PrepKernel): n-tile t, k-step kk, register rg; column n: digit
    // 2t + (n >= 4) of head n & 3, byte b: dim kk·Q + 8c + 4rg + b.
    for (int idx = tid; idx < FragWords<D, G8, kInt>(); idx += kThreads) {
      const int ln = idx & 31, rg = (idx >> 5) & 1, kk = (idx >> 6) & 3, t = idx >> 8;
      const int c = ln & 3, n = ln >> 2;
      const int col = n & 3, digit = 2 * t + (n >= 4 ? 1 : 0);
      sm.frag[idx] = col < g ? *reinterpret_cast<const uint32_t*>(
                                   &digits[digit][col][kk * Q + 8 * c + 4 * rg])
                             : 0u;
    }
  } else {
    constexpr int NT = G8 ? 2 : 1, KS = D / 16, Q = D / 4;
    for (int idx = tid; idx < NT * KS * 2 * 32; idx += kThreads) {
      const int ln = idx & 31, rg = (idx >> 5) & 1, ks = (idx >> 6) % KS, nt = (idx >> 6) / KS;
      const int k = ks & 3, c = ln & 3, n = ln >> 2, w = ks >> 2;
      const int col = G8 ? n : (n & 3);
      uint32_t word = 0;
      if (col < g) {
        const bool lo_part = G8 ? nt == 1 : n >= 4;
        const int d0 = k * Q + c * (D / 16) + 4 * w + rg, d1 = d0 + 2;
        const float sc =
            sm.meta[col][5] * (k == 0 ? 1.0f : k == 1 ? 0.25f : k == 2 ? 0.0625f : 0.015625f);
        const float v[2] = {sm.qr[col][d0] * sc, sm.qr[col][d1] * sc};
        unsigned short hv[2];
        for (int i = 0; i < 2; ++i) {
          const __half hi = __float2half_rn(v[i]);
          hv[i] = __half_as_ushort(lo_part ? __float2half_rn(v[i] - __half2float(hi)) : hi);
        }
        word = uint32_t(hv[0]) | (uint32_t(hv[1]) << 16);
      }
      sm.frag[idx] = word;
    }
  }
  __syncthreads();
}

// Lane 0 of a warp: starts the copies of chunk `ci` of the unit (page
// `page`, chunk `c` inside it) into `slot`, completing on `bar`.
template <int D, int NG>
__device__ __forceinline__ void IssueChunk(const PageGeometry& geom, int h, const uint8_t* page,
                                           int c, uint8_t* slot, uint64_t* bar) {
  constexpr uint32_t kCodes = 8 * D, kParams = 128 * NG;
  MbarExpectTx(bar, SlotBytes<D, NG>());
  if (geom.page_tokens == 32) {
    BulkCopy(slot, page + geom.codes_offset(h, 0), SlotBytes<D, NG>(), bar);
  } else {
    BulkCopy(slot, page + geom.codes_offset(h, 0) + size_t(c) * kCodes, kCodes, bar);
    BulkCopy(slot + kCodes, page + geom.params_offset(h, 0) + size_t(c) * kParams, kParams, bar);
    BulkCopy(slot + kCodes + kParams, page + geom.codes_offset(h, 1) + size_t(c) * kCodes, kCodes,
             bar);
    BulkCopy(slot + 2 * kCodes + kParams, page + geom.params_offset(h, 1) + size_t(c) * kParams,
             kParams, bar);
  }
}

// The last block of an (item, kv head): combines the group's partials
// (history ones in the rotated basis, exact ones unrotated), un-rotates the
// history part and writes out and lse of the g query heads. Three rounds of
// independent loads: every partial's (m, l) (a lane per partial), then the
// accumulators (each thread owns float4s of the group's accumulators and
// has kBatch partials in flight), then R_V (prefetched into L2 earlier).
template <int D, bool G8, bool kInt>
__device__ __noinline__ void MergeGroup(const LaunchArgs& a, const ItemPlan& item, int h,
                                        BlockSmem<D, G8, kInt>& sm, float* weights,
                                        int max_weights) {
  constexpr int HG = BlockSmem<D, G8, kInt>::HG, kBatch = 16, F = D / 4;
  const int g = a.g, tid = threadIdx.x, warp = WarpIndex(), lane = tid & 31;
  const int nh = item.hist_splits, ne = item.exact_splits, total = nh + ne;
  const size_t stride = PartialFloats(g, D);
  const float* hist = a.partials + size_t(item.hist_begin + h * nh) * stride;
  const float* exact = a.partials + size_t(item.exact_begin + h * ne) * stride;
  auto partial = [&](int s) { return s < nh ? hist + size_t(s) * stride : exact + size_t(s - nh) * stride; };
  // 1. Per (set, head): M = max m, L = Σ 2^(m - M)·l; weights[s][hh] = 2^(m_s - M) / L.
  //    A warp per (set, head) pair, lanes over partials (all loads first).
  for (int pair = warp; pair < 2 * g; pair += kWarps) {
    const int set = pair / g, hh = pair % g;
    const int s0 = set == 0 ? 0 : nh, s1 = set == 0 ? nh : total;
    float M = -INFINITY;
    for (int s = s0 + lane; s < s1; s += 32) {
      const float pm = __ldcg(partial(s) + g * D + hh);
      if (s < max_weights) weights[s * HG + hh] = pm;
      M = fmaxf(M, pm);
    }
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1) M = fmaxf(M, __shfl_xor_sync(kFull, M, off));
    float L = 0.0f;
    for (int s = s0 + lane; s < s1; s += 32) {
      const float pm = s < max_weights ? weights[s * HG + hh] : __ldcg(partial(s) + g * D + hh);
      const float w = pm == -INFINITY ? 0.0f : exp2f(pm - M);
      L += w * __ldcg(partial(s) + g * D + g + hh);
      if (s < max_weights) weights[s * HG + hh] = w;
    }
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1) L += __shfl_xor_sync(kFull, L, off);
    const float inv = L > 0.0f ? 1.0f / L : 0.0f;
    for (int s = s0 + lane; s < s1 && s < max_weights; s += 32) weights[s * HG + hh] *= inv;
    if (lane == 0) {
      sm.set_m[set][hh] = M;
      sm.set_l[set][hh] = L;
    }
  }
  __syncthreads();
  // 2. The normalized vectors of both sets.
  for (int f = tid; f < g * F; f += kThreads) {
    const int hh = f / F;
    float4 acc[2] = {make_float4(0.0f, 0.0f, 0.0f, 0.0f), make_float4(0.0f, 0.0f, 0.0f, 0.0f)};
    for (int s0 = 0; s0 < total; s0 += kBatch) {
      float4 pa[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        pa[u] = s0 + u < total ? __ldcg(reinterpret_cast<const float4*>(partial(s0 + u)) + f)
                               : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int s = s0 + u;
        if (s >= total) break;
        float w;
        if (s < max_weights) {
          w = weights[s * HG + hh];
        } else {  // more partials than shared memory holds: recompute
          const int set = s < nh ? 0 : 1;
          const float pm = __ldcg(partial(s) + g * D + hh), L = sm.set_l[set][hh];
          w = pm == -INFINITY || !(L > 0.0f) ? 0.0f : exp2f(pm - sm.set_m[set][hh]) / L;
        }
        float4& o = acc[s < nh ? 0 : 1];
        o.x = fmaf(w, pa[u].x, o.x);
        o.y = fmaf(w, pa[u].y, o.y);
        o.z = fmaf(w, pa[u].z, o.z);
        o.w = fmaf(w, pa[u].w, o.w);
      }
    }
#pragma unroll
    for (int set = 0; set < 2; ++set) {
      *reinterpret_cast<float4*>(&sm.u.merged[set][hh][4 * (f % F)]) = acc[set];
    }
  }
  __syncthreads();
  // 3. Un-rotate the history vectors (o'·R_Vᵀ: row j of R_V per output dim
  //    j), then merge with the exact part by the two sets' LSEs.
  const float* rv = item.rotation.r_v + item.rotation.stride * h;
  for (int j = tid; j < D; j += kThreads) {
    float oh[HG];
#pragma unroll
    for (int hh = 0; hh < HG; ++hh) oh[hh] = 0.0f;
    if (nh > 0 && !(a.debug & 128)) {
      const float4* row = reinterpret_cast<const float4*>(rv + size_t(j) * D);
#pragma unroll 16
      for (int i4 = 0; i4 < F; ++i4) {
        const float4 r = __ldg(row + i4);
#pragma unroll
        for (int hh = 0; hh < HG; ++hh) {
          if (hh < g) {
            const float4 x = *reinterpret_cast<const float4*>(&sm.u.merged[0][hh][4 * i4]);
            oh[hh] = fmaf(x.x, r.x, oh[hh]);
            oh[hh] = fmaf(x.y, r.y, oh[hh]);
            oh[hh] = fmaf(x.z, r.z, oh[hh]);
            oh[hh] = fmaf(x.w, r.w, oh[hh]);
          }
        }
      }
    }
#pragma unroll
    for (int hh = 0; hh < HG; ++hh) {
      if (hh >= g) break;
      const float lh2 = sm.set_l[0][hh] > 0.0f ? sm.set_m[0][hh] + log2f(sm.set_l[0][hh]) : -INFINITY;
      const float le2 = sm.set_l[1][hh] > 0.0f ? sm.set_m[1][hh] + log2f(sm.set_l[1][hh]) : -INFINITY;
      const float lse_a = le2 == -INFINITY ? -INFINITY : le2 * kLn2;
      const float lse_b = lh2 == -INFINITY ? -INFINITY : lh2 * kLn2;
      const float mx = fmaxf(lse_a, lse_b);
      const int qh = h * g + hh;
      float* out = item.out + size_t(qh) * D;
      if (mx == -INFINITY) {
        out[j] = 0.0f;
        if (j == 0 && item.lse != nullptr) item.lse[qh] = -INFINITY;
        continue;
      }
      const float wa = lse_a == -INFINITY ? 0.0f : expf(lse_a - mx);
      const float wb = lse_b == -INFINITY ? 0.0f : expf(lse_b - mx);
      const float x = wa > 0.0f ? wa * sm.u.merged[1][hh][j] : 0.0f;
      const float y = wb > 0.0f ? wb * oh[hh] : 0.0f;
      out[j] = (x + y) / (wa + wb);
      if (j == 0 && item.lse != nullptr) item.lse[qh] = mx + logf(wa + wb);
    }
  }
}

// Asks L2 to fetch R_V of kv head h (read by the group's last block).
template <int D>
__device__ __forceinline__ void PrefetchRv(const ItemPlan& item, int h) {
  const char* rv = reinterpret_cast<const char*>(item.rotation.r_v + item.rotation.stride * h);
  for (int off = threadIdx.x * 128; off < D * D * 4; off += kThreads * 128) {
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(rv + off));
  }
}

}  // namespace fused
}  // namespace cuda_attend
}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_CUDA_ATTEND_FUSED_CUH_
