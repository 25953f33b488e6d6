// The query-prep kernel of one decode-attention call and the programmatic
// dependent launch (PDL) helpers. Included by attend_kernels.cu only.
//
// One cluster of 4 blocks per (item, query head); block k owns the quarter
// [kD/4, (k+1)D/4) of the head's dims: it computes that quarter of
// q' = q·R_K·scale·log2e, publishes its max |q'| and Σq' in shared memory, and
// after one cluster barrier reads the other three quarters' figures through
// distributed shared memory. So the digit scale uses the exact max over the
// whole head (the same values as a single block computing everything: the
// output format, and the q' values bit for bit, match the round-3 kernel)
// while 4·Hq·B blocks work in parallel instead of one block per kv head with
// serial phases.
#ifndef OSCARKV_KERNELS_CUDA_ATTEND_PREP_CUH_
#define OSCARKV_KERNELS_CUDA_ATTEND_PREP_CUH_

#include <cooperative_groups.h>

#include "kernels/cuda/attend_device.cuh"

namespace oscarkv {
namespace cuda_attend {

constexpr int kPrepThreads = 128;
constexpr int kPrepCluster = 4;  // blocks per query head, one per quarter of the dims

// Programmatic dependent launch (sm_90): a kernel lets the next one in the
// stream start launching early; the next one waits for this one's memory
// before it reads it. Both are no-ops when the launch was not programmatic.
__device__ __forceinline__ void LaunchDependents() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}
__device__ __forceinline__ void WaitForPrerequisites() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}

// Grid: kPrepCluster blocks per (item, query head), x = (item·Hq + qh)·4 + k.
// Writes, for the query head: its quarter of the unrotated scaled query
// (qexact); the fragment words of its column(s) of the QK MMA's B operand
// whose dims fall in the quarter (fp16 hi / lo columns scaled to max |q'| in
// [256, 512) times 4^-k for code field k, or, in the integer format, base-128
// int8 digits of q'·2^-E·4^(3-k)); and from quarter 0, the head's meta
// {2^E-derived multiplier, per-group Σq'}. Blocks of the first head of a
// kv-head group also zero the unused columns (heads g .. HG-1).
template <int D, bool G8>
__global__ void __cluster_dims__(kPrepCluster, 1, 1) __launch_bounds__(kPrepThreads)
    PrepKernel(LaunchArgs a) {
  constexpr int NT = G8 ? 2 : 1, KS = D / 16, Q = D / 4;
  constexpr int kSlices = kPrepThreads / Q;  // the i-range of q·R split over thread slices
  constexpr int kRows = D / kSlices;
  __shared__ float qin[D];
  __shared__ float red[kSlices][Q];
  __shared__ float qs[Q];
  __shared__ float stat[2];  // this quarter's max |q'| and Σ q'
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int k = static_cast<int>(cluster.block_rank());
  const int head_idx = blockIdx.x / kPrepCluster;  // item * Hq + qh
  const int item_idx = head_idx / a.hq, qh = head_idx % a.hq;
  const int g = a.g, h = qh / g, hh = qh % g;
  const int tid = threadIdx.x;
  const bool kIntFormat = a.int_qk && D == 128 && !G8;
  WaitForPrerequisites();
  LaunchDependents();
  const ItemPlan& item = a.items[item_idx];
  const bool has_history = item.num_pages > 0;
  const int dl = tid % Q, slice = tid / Q;
  // R_K column (quarter k, dim dl), rows of this slice: loaded before the
  // query so both latencies overlap.
  float rv[kRows];
  if (has_history) {
    const float* rk = item.rotation.r_k + item.rotation.stride * h + k * Q + dl;
#pragma unroll
    for (int ii = 0; ii < kRows; ++ii) rv[ii] = __ldg(rk + size_t(slice * kRows + ii) * D);
  }
  const float* q = item.q + size_t(qh) * D;
  for (int d = tid; d < D; d += kPrepThreads) qin[d] = q[d];
  __syncthreads();
  if (tid < Q) a.qexact[size_t(head_idx) * D + k * Q + tid] = qin[k * Q + tid] * a.scale_log2;
  {
    float acc = 0.0f;
    if (has_history) {
#pragma unroll
      for (int ii = 0; ii < kRows; ++ii) acc = fmaf(qin[slice * kRows + ii], rv[ii], acc);
    }
    red[slice][dl] = acc;
  }
  __syncthreads();
  if (tid < Q) {
    float s = 0.0f;
#pragma unroll
    for (int sl = 0; sl < kSlices; ++sl) s += red[sl][tid];
    qs[tid] = s * a.scale_log2;
  }
  __syncthreads();
  if (tid < 32) {
    float mx = 0.0f, sum = 0.0f;
    for (int d = tid; d < Q; d += 32) {
      mx = fmaxf(mx, fabsf(qs[d]));
      sum += qs[d];
    }
    for (int off = 16; off >= 1; off >>= 1) {
      mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, off));
      sum += __shfl_xor_sync(kFull, sum, off);
    }
    if (tid == 0) {
      stat[0] = mx;
      stat[1] = sum;
    }
  }
  cluster.sync();
  float mx = 0.0f, qsum[kPrepCluster];
#pragma unroll
  for (int r = 0; r < kPrepCluster; ++r) {
    const float* st = cluster.map_shared_rank(stat, r);
    mx = fmaxf(mx, st[0]);
    qsum[r] = st[1];
  }
  cluster.sync();  // no block leaves while the others read its stat
  int e = 0;
  const bool ok = mx > 0.0f && isfinite(mx);
  if (ok) frexpf(mx, &e);
  // fp16 format: max |q'|·inv in [256, 512). Integer format: max |q'|·inv in
  // [0.5, 1), so the digit-0 values q'·inv·4^(3-k) stay below 64.
  const int shift = kIntFormat ? 0 : 9;
  const int mshift = kIntFormat ? 6 : 9;
  const float inv = ok ? ldexpf(1.0f, shift - e) : 1.0f;
  if (k == 0 && tid == 0) {
    const float mult = ok ? ldexpf(1.0f, e - mshift) : (kIntFormat ? 1.0f / 64.0f : 1.0f);
    const int ng = D / a.geom.group_size, per_group = kPrepCluster / ng;
    float* meta = a.qmeta + size_t(head_idx) * kQueryMetaFloats;
    meta[0] = mult;
    for (int gi = 0; gi < 4; ++gi) {
      float sum = 0.0f;
      if (gi < ng) {
        for (int r = gi * per_group; r < (gi + 1) * per_group; ++r) sum += qsum[r];
      }
      meta[1 + gi] = sum;
    }
    meta[5] = meta[6] = meta[7] = 0.0f;
  }
  if (kIntFormat) {
    // B fragments of the m16n8k32 u8·s8 MMA: n-tile t, k-step = code field kk,
    // register rg = bytes [4rg, 4rg+4) of thread c's 8 code bytes; column n:
    // digit 2t + (n >= 4) of head n & 3; byte b holds the digit of dim
    // d = 8c + 4rg + b + 32kk, where v = q'·inv·4^(3-kk) = Σ_j digit_j·128^-j.
    uint32_t* frag = a.qfrag + (size_t(item_idx) * a.geom.kv_heads + h) * (2 * 4 * 2 * 32);
    for (int idx = tid; idx < 2 * 4 * 2 * 32; idx += kPrepThreads) {
      const int ln = idx & 31, rg = (idx >> 5) & 1, kk = (idx >> 6) & 3, t = idx >> 8;
      if (kk != k) continue;
      const int c = ln & 3, n = ln >> 2;
      const int col = n & 3, digit = 2 * t + (n >= 4 ? 1 : 0);
      if (col == hh) {
        const float sc = inv * (k == 0 ? 64.0f : k == 1 ? 16.0f : k == 2 ? 4.0f : 1.0f);
        uint32_t packed = 0;
        for (int b = 0; b < 4; ++b) {
          float rest = qs[8 * c + 4 * rg + b] * sc;
          int dig = 0;
          for (int j = 0; j < 4; ++j) {
            const float dj = rintf(rest);
            if (j == digit) dig = static_cast<int>(dj);
            rest = (rest - dj) * 128.0f;
          }
          packed |= (uint32_t(dig) & 0xffu) << (8 * b);
        }
        frag[idx] = packed;
      } else if (hh == 0 && col >= g) {
        frag[idx] = 0;
      }
    }
    return;
  }
  uint32_t* frag = a.qfrag + (size_t(item_idx) * a.geom.kv_heads + h) * (NT * KS * 2 * 32);
  for (int idx = tid; idx < NT * KS * 2 * 32; idx += kPrepThreads) {
    const int ln = idx & 31, rg = (idx >> 5) & 1, ks = (idx >> 6) % KS, nt = (idx >> 6) / KS;
    if ((ks & 3) != k) continue;
    const int c = ln & 3, n = ln >> 2, w = ks >> 2;
    const int col = G8 ? n : (n & 3);
    if (col == hh) {
      const bool lo_part = G8 ? nt == 1 : n >= 4;
      const int d0 = c * (D / 16) + 4 * w + rg, d1 = d0 + 2;  // inside the quarter
      const float sc = inv * (k == 0 ? 1.0f : k == 1 ? 0.25f : k == 2 ? 0.0625f : 0.015625f);
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

}  // namespace cuda_attend
}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_CUDA_ATTEND_PREP_CUH_
