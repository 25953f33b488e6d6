// The three kernels of one decode-attention call: query prep, split-KV
// attention (exact and history units), merge. Host planning lives in
// attend_launcher.cu.
#include "kernels/cuda/attend_launch.h"

#include "absl/strings/str_cat.h"
#include "kernels/cuda/attend_exact.cuh"
#include "kernels/cuda/attend_history.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/status_macros.h"

namespace oscarkv {
namespace cuda_attend {
namespace {

constexpr int kPrepThreads = 512;
constexpr float kLn2 = 0.69314718055994531f;

// Programmatic dependent launch (sm_90): a kernel lets the next one in the
// stream start launching early; the next one waits for this one's memory
// before it reads it. Both are no-ops when the launch was not programmatic.
__device__ __forceinline__ void LaunchDependents() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}
__device__ __forceinline__ void WaitForPrerequisites() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}

// Per (item, kv head): rotated, scaled query q' = q·R_K·scale·log2e of each
// head of the group, laid out as the B fragments of the QK MMA (fp16 hi / lo
// columns, times 2^-E so the largest |q'| is in [256, 512), times 4^-k for
// code field k), its per-group sums and 2^E; and the unrotated scaled query
// for the exact blocks.
template <int D, bool G8>
__global__ void __launch_bounds__(kPrepThreads) PrepKernel(LaunchArgs a) {
  constexpr int NT = G8 ? 2 : 1, KS = D / 16;
  const bool kIntFormat = a.int_qk && D == 128 && !G8;
  constexpr int kSlices = kPrepThreads / D;  // the i-range of q·R split over thread slices
  __shared__ float qs[8][D];
  __shared__ float qin[8][D];
  __shared__ float red[kSlices][8][D];
  __shared__ float inv_s[8];
  const int item_idx = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
  WaitForPrerequisites();
  LaunchDependents();
  const ItemPlan& item = a.items[item_idx];
  const int g = a.g;
  const bool has_history = item.num_pages > 0;
  for (int idx = tid; idx < g * D; idx += kPrepThreads) {
    const int hh = idx / D, d = idx % D;
    const int qh = h * g + hh;
    const float x = item.q[size_t(qh) * D + d];
    qin[hh][d] = x;
    a.qexact[(size_t(item_idx) * a.hq + qh) * D + d] = x * a.scale_log2;
  }
  __syncthreads();
  {
    // Thread (slice, d): partial q·R over rows i of its slice, for every head.
    const int d = tid % D, slice = tid / D;
    constexpr int kRows = D / kSlices;
    float acc[8];
#pragma unroll
    for (int hh = 0; hh < 8; ++hh) acc[hh] = 0.0f;
    if (has_history) {
      const float* rk = item.rotation.r_k + item.rotation.stride * h;
#pragma unroll
      for (int ii = 0; ii < kRows; ++ii) {
        const int i = slice * kRows + ii;
        const float rv = __ldg(rk + size_t(i) * D + d);
#pragma unroll
        for (int hh = 0; hh < 8; ++hh) {
          if (hh < g) acc[hh] = fmaf(qin[hh][i], rv, acc[hh]);
        }
      }
    }
#pragma unroll
    for (int hh = 0; hh < 8; ++hh) {
      if (hh < g) red[slice][hh][d] = acc[hh];
    }
  }
  __syncthreads();
  for (int idx = tid; idx < g * D; idx += kPrepThreads) {
    const int hh = idx / D, d = idx % D;
    float s = 0.0f;
#pragma unroll
    for (int sl = 0; sl < kSlices; ++sl) s += red[sl][hh][d];
    qs[hh][d] = s * a.scale_log2;
  }
  __syncthreads();
  const int warp = WarpIndex(), lane = tid & 31;
  if (warp < g) {
    const int hh = warp;
    float mx = 0.0f;
    for (int d = lane; d < D; d += 32) mx = fmaxf(mx, fabsf(qs[hh][d]));
    for (int off = 16; off >= 1; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, off));
    int e = 0;
    if (mx > 0.0f && isfinite(mx)) frexpf(mx, &e);
    // fp16 format: max |q'|·inv in [256, 512). Integer format: max |q'|·inv in
    // [0.5, 1), so the digit-0 values q'·inv·4^(3-k) stay below 64.
    const int shift = kIntFormat ? 0 : 9;
    const int mshift = kIntFormat ? 6 : 9;
    const bool ok = mx > 0.0f && isfinite(mx);
    const float inv = ok ? ldexpf(1.0f, shift - e) : 1.0f;
    const float mult = ok ? ldexpf(1.0f, e - mshift) : (kIntFormat ? 1.0f / 64.0f : 1.0f);
    const int G = a.geom.group_size, ng = D / G;
    float* meta = a.qmeta + (size_t(item_idx) * a.hq + h * g + hh) * kQueryMetaFloats;
    for (int gi = 0; gi < 4; ++gi) {
      float sum = 0.0f;
      if (gi < ng) {
        for (int d = gi * G + lane; d < (gi + 1) * G; d += 32) sum += qs[hh][d];
        for (int off = 16; off >= 1; off >>= 1) sum += __shfl_xor_sync(kFull, sum, off);
      }
      if (lane == 0) meta[1 + gi] = sum;
    }
    if (lane == 0) {
      meta[0] = mult;
      meta[5] = meta[6] = meta[7] = 0.0f;
      inv_s[hh] = inv;
    }
  }
  __syncthreads();
  if (kIntFormat) {
    // B fragments of the m16n8k32 u8·s8 MMA: n-tile t, k-step = code field k,
    // register rg = bytes [4rg, 4rg+4) of thread c's 8 code bytes; column n:
    // digit 2t + (n >= 4) of head n & 3; byte b holds the digit of dim
    // d = 8c + 4rg + b + 32k, where v = q'·inv·4^(3-k) = Σ_j digit_j·128^-j.
    uint32_t* frag = a.qfrag + (size_t(item_idx) * a.geom.kv_heads + h) * (2 * 4 * 2 * 32);
    for (int idx = tid; idx < 2 * 4 * 2 * 32; idx += kPrepThreads) {
      const int ln = idx & 31, rg = (idx >> 5) & 1, k = (idx >> 6) & 3, t = idx >> 8;
      const int c = ln & 3, n = ln >> 2;
      const int hh = n & 3, digit = 2 * t + (n >= 4 ? 1 : 0);
      uint32_t packed = 0;
      if (hh < g) {
        const float sc = inv_s[hh] * (k == 0 ? 64.0f : k == 1 ? 16.0f : k == 2 ? 4.0f : 1.0f);
        for (int b = 0; b < 4; ++b) {
          const int d = 8 * c + 4 * rg + b + 32 * k;
          float rest = qs[hh][d] * sc;
          int dig = 0;
          for (int j = 0; j < 4; ++j) {
            const float dj = rintf(rest);
            if (j == digit) dig = static_cast<int>(dj);
            rest = (rest - dj) * 128.0f;
          }
          packed |= (uint32_t(dig) & 0xffu) << (8 * b);
        }
      }
      frag[idx] = packed;
    }
    return;
  }
  uint32_t* frag = a.qfrag + (size_t(item_idx) * a.geom.kv_heads + h) * (NT * KS * 2 * 32);
  for (int idx = tid; idx < NT * KS * 2 * 32; idx += kPrepThreads) {
    const int ln = idx & 31, rg = (idx >> 5) & 1, ks = (idx >> 6) % KS, nt = (idx >> 6) / KS;
    const int c = ln & 3, n = ln >> 2, w = ks >> 2, k = ks & 3;
    const int hh = G8 ? n : (n & 3);
    const bool lo_part = G8 ? nt == 1 : n >= 4;
    const int b0 = c * (D / 16) + 4 * w + rg;
    const int d0 = b0 + k * (D / 4), d1 = d0 + 2;
    uint32_t packed = 0;
    if (hh < g) {
      const float sc = inv_s[hh] * (k == 0 ? 1.0f : k == 1 ? 0.25f : k == 2 ? 0.0625f : 0.015625f);
      const float v[2] = {qs[hh][d0] * sc, qs[hh][d1] * sc};
      unsigned short hv[2];
      for (int i = 0; i < 2; ++i) {
        const __half hi = __float2half_rn(v[i]);
        hv[i] = __half_as_ushort(lo_part ? __float2half_rn(v[i] - __half2float(hi)) : hi);
      }
      packed = uint32_t(hv[0]) | (uint32_t(hv[1]) << 16);
    }
    frag[idx] = packed;
  }
}

// Combines the 4 warps' (m, l, acc) of each head into the unit's partial.
template <int D, int HG>
__device__ void WritePartial(const LaunchArgs& a, int partial, float (*sm_o)[HG][D],
                             float (*sm_m)[HG], float (*sm_l)[HG]) {
  __syncthreads();
  const int g = a.g;
  float* out = a.partials + size_t(partial) * PartialFloats(g, D);
  for (int idx = threadIdx.x; idx < g * D; idx += kThreads) {
    const int hh = idx / D, d = idx % D;
    float M = -INFINITY;
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, sm_m[w][hh]);
    float L = 0.0f, A = 0.0f;
    if (M != -INFINITY) {
      for (int w = 0; w < kWarps; ++w) {
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

// kPrefetch: register double buffer of whole chunks. kPipeline: software
// pipeline, QK of chunk i+1 next to softmax / PV of chunk i (two independent
// instruction streams per warp), K and V halves loaded on separate schedules.
template <int D, int NG, bool G8, int kMinBlocks, bool kPrefetch, bool kPipeline = false,
          bool kInt = false>
__global__ void __launch_bounds__(kThreads, kMinBlocks) SplitKernel(LaunchArgs a) {
  using C = Cfg<D, NG, G8>;
  constexpr int HG = C::HG;
  __shared__ float sm_o[kWarps][HG][D];
  __shared__ float sm_m[kWarps][HG];
  __shared__ float sm_l[kWarps][HG];
  const int warp = WarpIndex(), lane = threadIdx.x & 31;
  // Work and page tables were uploaded before the prep kernel ran: safe to
  // read before waiting for it.
  const WorkUnit wu = a.work[blockIdx.x];
  const ItemPlan& item = a.items[wu.item];
  if (lane < HG) {
    sm_m[warp][lane] = -INFINITY;
    sm_l[warp][lane] = 0.0f;
  }
  __syncwarp();
  if (wu.exact) {
    WaitForPrerequisites();  // the prep kernel's scaled queries
    LaunchDependents();
    // Exact blocks [begin, end); each block's tokens split over the 4 warps.
    ExactWarp<D, HG> ex;
    ex.Init(a, wu.item, wu.kv_head, lane);
    bool any = false;
    for (int e = wu.begin; e < wu.end; ++e) {
      const ExactBlockRef blk = item.exact[e];
      const int per = (blk.tokens + kWarps - 1) / kWarps;
      const int t0 = warp * per, t1 = min(blk.tokens, t0 + per);
      if (t0 < t1) {
        ex.Run(a, wu.kv_head, blk, t0, t1, lane);
        any = true;
      }
    }
    if (any) ex.Finish(a.g, lane, sm_o[warp], sm_m[warp], sm_l[warp]);
  } else {
    const int cpp = a.geom.page_tokens / 32;
    const int n = (wu.end - wu.begin) * cpp;
    HistoryWarp<D, NG, G8, kInt> hw;
    hw.InitOffsets(a.geom, wu.kv_head, lane);
    // Page pointers for iterations [base, base + 32), one per lane.
    int base = 0;
    auto chunk_of = [&](int it) { return warp + kWarps * it; };
    auto fetch_ptr = [&](int it0) -> const uint8_t* {
      const int ci = chunk_of(it0 + lane);
      return ci < n ? item.pages[wu.begin + ci / cpp] : nullptr;
    };
    const uint8_t* my_ptr = fetch_ptr(0);
    auto page_of = [&](int it) -> const uint8_t* {
      if (it >= base + 32) {
        base += 32;
        my_ptr = fetch_ptr(base);
      }
      return reinterpret_cast<const uint8_t*>(
          __shfl_sync(kFull, reinterpret_cast<unsigned long long>(my_ptr), it - base));
    };
    const int iters = warp < n ? (n - warp + kWarps - 1) / kWarps : 0;
    typename HistoryWarp<D, NG, G8, kInt>::Regs ra, rb;
    if constexpr (kPipeline) {
      // ra / rb: K halves (QK); va / vb: V halves (PV). At the loop top:
      // lga = logits(it), va = V(it), rb = K(it+1), ra = K(it+2) and
      // vb = V(it+1) in flight. Loads go in non-decreasing chunk order.
      typename HistoryWarp<D, NG, G8, kInt>::Regs va = {}, vb = {};
      ra = {};
      rb = {};
      float lga[2][4], lgb[2][4];
      if (iters > 0) {
        hw.LoadK(ra, page_of(0), chunk_of(0) % cpp);
        hw.LoadV(va, page_of(0), chunk_of(0) % cpp);
      }
      if (iters > 1) hw.LoadK(rb, page_of(1), chunk_of(1) % cpp);
      WaitForPrerequisites();  // the prep kernel's query fragments
      LaunchDependents();
      if (iters > 0) {
        hw.InitQuery(a, wu.item, wu.kv_head, lane);
        hw.Logits(ra, lga);
        if (iters > 1) hw.LoadV(vb, page_of(1), chunk_of(1) % cpp);
        if (iters > 2) hw.LoadK(ra, page_of(2), chunk_of(2) % cpp);
        int it = 0;
        while (true) {
          hw.Logits(rb, lgb);  // chunk it+1 (unused past the end)
          hw.Accumulate(va, lga);
          if (++it >= iters) break;
          if (it + 1 < iters) hw.LoadV(va, page_of(it + 1), chunk_of(it + 1) % cpp);
          if (it + 2 < iters) hw.LoadK(rb, page_of(it + 2), chunk_of(it + 2) % cpp);
          hw.Logits(ra, lga);  // chunk it+1
          hw.Accumulate(vb, lgb);
          if (++it >= iters) break;
          if (it + 1 < iters) hw.LoadV(vb, page_of(it + 1), chunk_of(it + 1) % cpp);
          if (it + 2 < iters) hw.LoadK(ra, page_of(it + 2), chunk_of(it + 2) % cpp);
        }
        hw.Finish(a.g, sm_o[warp], sm_m[warp], sm_l[warp]);
      }
    } else {
      // The first chunks' loads overlap the prep kernel.
      if (iters > 0) hw.Load(ra, page_of(0), chunk_of(0) % cpp);
      if (kPrefetch && iters > 1) hw.Load(rb, page_of(1), chunk_of(1) % cpp);
      WaitForPrerequisites();  // the prep kernel's query fragments
      LaunchDependents();
      if (iters > 0) {
        hw.InitQuery(a, wu.item, wu.kv_head, lane);
        int it = 0;
        if constexpr (kPrefetch) {
          while (true) {
            hw.Process(ra);
            if (++it >= iters) break;
            if (it + 1 < iters) hw.Load(ra, page_of(it + 1), chunk_of(it + 1) % cpp);
            hw.Process(rb);
            if (++it >= iters) break;
            if (it + 1 < iters) hw.Load(rb, page_of(it + 1), chunk_of(it + 1) % cpp);
          }
        } else {
          while (true) {
            hw.Process(ra);
            if (++it >= iters) break;
            hw.Load(ra, page_of(it), chunk_of(it) % cpp);
          }
        }
        hw.Finish(a.g, sm_o[warp], sm_m[warp], sm_l[warp]);
      }
    }
  }
  WritePartial<D, HG>(a, wu.partial, sm_o, sm_m, sm_l);
}

// Combines partials [first, first + count) of query head hh into the shared
// vector o (normalized) and returns the base-2 LSE (or -inf when empty).
template <int D>
__device__ float CombinePartials(const LaunchArgs& a, int first, int count, int hh, float* o,
                                 float (*sm_a)[D], float* sm_m, float* sm_l) {
  constexpr int EL = D / 32;
  const int warp = WarpIndex(), lane = threadIdx.x & 31;
  const int g = a.g;
  float m = -INFINITY, l = 0.0f, acc[EL];
#pragma unroll
  for (int e = 0; e < EL; ++e) acc[e] = 0.0f;
  constexpr int kBatch = 12;  // partials loaded before they are combined
  for (int s0 = warp; s0 < count; s0 += kBatch * kWarps) {
    float pm[kBatch], pl[kBatch], pa[kBatch][EL];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int s = s0 + u * kWarps;
      pm[u] = -INFINITY;
      pl[u] = 0.0f;
#pragma unroll
      for (int e = 0; e < EL; ++e) pa[u][e] = 0.0f;
      if (s < count) {
        const float* p = a.partials + size_t(first + s) * PartialFloats(g, D);
        pm[u] = p[g * D + hh];
        pl[u] = p[g * D + g + hh];
#pragma unroll
        for (int e = 0; e < EL; ++e) pa[u][e] = p[hh * D + lane + 32 * e];
      }
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (pm[u] == -INFINITY) continue;
      const float mn = fmaxf(m, pm[u]);
      const float f1 = exp2f(m - mn), f2 = exp2f(pm[u] - mn);
      l = l * f1 + pl[u] * f2;
#pragma unroll
      for (int e = 0; e < EL; ++e) acc[e] = acc[e] * f1 + pa[u][e] * f2;
      m = mn;
    }
  }
#pragma unroll
  for (int e = 0; e < EL; ++e) sm_a[warp][lane + 32 * e] = acc[e];
  if (lane == 0) {
    sm_m[warp] = m;
    sm_l[warp] = l;
  }
  __syncthreads();
  float M = -INFINITY;
  for (int w = 0; w < kWarps; ++w) M = fmaxf(M, sm_m[w]);
  float L = 0.0f;
  float wt[kWarps];
  for (int w = 0; w < kWarps; ++w) {
    wt[w] = (M == -INFINITY || sm_m[w] == -INFINITY) ? 0.0f : exp2f(sm_m[w] - M);
    L += wt[w] * sm_l[w];
  }
  for (int d = threadIdx.x; d < D; d += kThreads) {
    float A = 0.0f;
    for (int w = 0; w < kWarps; ++w) A += wt[w] * sm_a[w][d];
    o[d] = L > 0.0f ? A / L : 0.0f;
  }
  __syncthreads();
  return L > 0.0f ? M + log2f(L) : -INFINITY;
}

// One block per (item, query head, slice of 32 output dims): combine history
// partials, un-rotate (o'·R_Vᵀ) the slice, combine exact partials, merge the
// two with the online-softmax rule exactly like MergeAttention, write the
// slice of out (and lse from slice 0). The R_V rows of the slice are loaded
// before waiting for the split kernel, so their latency is hidden.
template <int D>
__global__ void __launch_bounds__(kThreads) MergeKernel(LaunchArgs a) {
  constexpr int EL = D / 32, kSlice = 32, kPerWarp = kSlice / kWarps;
  __shared__ float sm_a[kWarps][D];
  __shared__ float sm_m[kWarps], sm_l[kWarps];
  __shared__ float o_rot[D], o_hist[kSlice], o_exact[D];
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

  const float lse_h2 = CombinePartials<D>(a, item.hist_begin + h * item.hist_splits,
                                          item.hist_splits, hh, o_rot, sm_a, sm_m, sm_l);
  if (lse_h2 != -INFINITY) {
#pragma unroll
    for (int jj = 0; jj < kPerWarp; ++jj) {
      float s = 0.0f;
#pragma unroll
      for (int e = 0; e < EL; ++e) s = fmaf(o_rot[lane + 32 * e], rr[jj][e], s);
#pragma unroll
      for (int off = 16; off >= 1; off >>= 1) s += __shfl_xor_sync(kFull, s, off);
      if (lane == 0) o_hist[warp * kPerWarp + jj] = s;
    }
  } else {
    if (threadIdx.x < kSlice) o_hist[threadIdx.x] = 0.0f;
  }
  const float lse_e2 = CombinePartials<D>(a, item.exact_begin + h * item.exact_splits,
                                          item.exact_splits, hh, o_exact, sm_a, sm_m, sm_l);
  const float lse_a = lse_e2 == -INFINITY ? -INFINITY : lse_e2 * kLn2;
  const float lse_b = lse_h2 == -INFINITY ? -INFINITY : lse_h2 * kLn2;
  const float mx = fmaxf(lse_a, lse_b);
  float* out = item.out + size_t(qh) * D + j0;
  if (mx == -INFINITY) {
    if (threadIdx.x < kSlice) out[threadIdx.x] = 0.0f;
    if (threadIdx.x == 0 && blockIdx.z == 0 && item.lse != nullptr) item.lse[qh] = -INFINITY;
    return;
  }
  const float wa = lse_a == -INFINITY ? 0.0f : expf(lse_a - mx);
  const float wb = lse_b == -INFINITY ? 0.0f : expf(lse_b - mx);
  const float inv = 1.0f / (wa + wb);
  if (threadIdx.x < kSlice) {
    const int d = threadIdx.x;
    const float x = wa > 0.0f ? wa * o_exact[j0 + d] : 0.0f;
    const float y = wb > 0.0f ? wb * o_hist[d] : 0.0f;
    out[d] = (x + y) * inv;
  }
  if (threadIdx.x == 0 && blockIdx.z == 0 && item.lse != nullptr) item.lse[qh] = mx + logf(wa + wb);
}

// Launches `kernel` with programmatic stream serialization (PDL) allowed.
template <typename Kernel>
absl::Status LaunchPdl(Kernel kernel, dim3 grid, dim3 block, cudaStream_t stream,
                       const LaunchArgs& a) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  OSCARKV_CUDA_RETURN_IF_ERROR(cudaLaunchKernelEx(&cfg, kernel, a));
  return absl::OkStatus();
}

// Variants: 0 = 3 resident blocks per SM with a register double buffer;
// 1 (D = 128, one group only) = 4 blocks per SM, no prefetch; 2 = software
// pipeline (QK of the next chunk next to PV of this one), 3 blocks per SM;
// 3 / 4 = variants 0 / 2 with q·K on the integer tensor cores (D = 128 and at
// most 4 query heads per kv head; other shapes run variants 0 / 2).
inline bool UsesIntQk(int variant, int head_dim, bool g8) {
  return (variant == 3 || variant == 4) && head_dim == 128 && !g8;
}

template <int D, int NG, bool G8>
auto SplitKernelFor(int variant) {
  if constexpr (D == 128 && NG == 1) {
    if (variant == 1) return &SplitKernel<D, NG, G8, 4, false>;
  }
  if constexpr (D == 128 && !G8) {
    if (variant == 3) return &SplitKernel<D, NG, G8, 3, true, false, true>;
    if (variant == 4) return &SplitKernel<D, NG, G8, 3, false, true, true>;
  }
  if (variant == 2 || variant == 4) return &SplitKernel<D, NG, G8, 3, false, true>;
  return &SplitKernel<D, NG, G8, 3, Cfg<D, NG, G8>::kPrefetch>;
}

template <int D, int NG, bool G8>
absl::Status LaunchTyped(const LaunchArgs& args, const LaunchShape& s, cudaStream_t stream) {
  LaunchArgs a = args;
  a.int_qk = UsesIntQk(s.variant, D, G8) ? 1 : 0;
  PrepKernel<D, G8><<<dim3(s.num_items, s.kv_heads), kPrepThreads, 0, stream>>>(a);
  OSCARKV_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  if (s.num_work > 0) {
    OSCARKV_RETURN_IF_ERROR(
        LaunchPdl(SplitKernelFor<D, NG, G8>(s.variant), dim3(s.num_work), dim3(kThreads), stream, a));
  }
  OSCARKV_RETURN_IF_ERROR(
      LaunchPdl(MergeKernel<D>, dim3(s.num_items, s.hq, D / 32), dim3(kThreads), stream, a));
  return absl::OkStatus();
}

template <int D, int NG, bool G8>
absl::StatusOr<int> BlocksPerSmTyped(const LaunchShape& s) {
  int blocks = 0;
  OSCARKV_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &blocks, SplitKernelFor<D, NG, G8>(s.variant), kThreads, 0));
  return blocks;
}

#define OSCARKV_DISPATCH(FN, ...)                                                         \
  switch (s.head_dim * 100 + s.groups * 10 + (s.g8 ? 1 : 0)) {                           \
    case 6410: return FN<64, 1, false>(__VA_ARGS__);                                     \
    case 6411: return FN<64, 1, true>(__VA_ARGS__);                                      \
    case 6420: return FN<64, 2, false>(__VA_ARGS__);                                     \
    case 6421: return FN<64, 2, true>(__VA_ARGS__);                                      \
    case 6440: return FN<64, 4, false>(__VA_ARGS__);                                     \
    case 6441: return FN<64, 4, true>(__VA_ARGS__);                                      \
    case 12810: return FN<128, 1, false>(__VA_ARGS__);                                   \
    case 12811: return FN<128, 1, true>(__VA_ARGS__);                                    \
    case 12820: return FN<128, 2, false>(__VA_ARGS__);                                   \
    case 12821: return FN<128, 2, true>(__VA_ARGS__);                                    \
    case 12840: return FN<128, 4, false>(__VA_ARGS__);                                   \
    case 12841: return FN<128, 4, true>(__VA_ARGS__);                                    \
    case 25610: return FN<256, 1, false>(__VA_ARGS__);                                   \
    case 25611: return FN<256, 1, true>(__VA_ARGS__);                                    \
    case 25620: return FN<256, 2, false>(__VA_ARGS__);                                   \
    case 25621: return FN<256, 2, true>(__VA_ARGS__);                                    \
    case 25640: return FN<256, 4, false>(__VA_ARGS__);                                   \
    case 25641: return FN<256, 4, true>(__VA_ARGS__);                                    \
    default:                                                                             \
      return absl::UnimplementedError(absl::StrCat("no CUDA attention kernel for head_dim ", \
                                                   s.head_dim, " with ", s.groups,       \
                                                   " quantization groups"));             \
  }

}  // namespace

absl::Status LaunchAttention(const LaunchArgs& args, const LaunchShape& s, cudaStream_t stream) {
  if (s.num_items == 0) return absl::OkStatus();
  OSCARKV_DISPATCH(LaunchTyped, args, s, stream)
}

absl::StatusOr<int> SplitBlocksPerSm(const LaunchShape& s) { OSCARKV_DISPATCH(BlocksPerSmTyped, s) }

}  // namespace cuda_attend
}  // namespace oscarkv
