// The exact (BF16 sink / recent) warp of the split-KV kernel: fp32 math on the
// CUDA cores, the unrotated query. Included by attend_kernels.cu only.
#ifndef OSCARKV_KERNELS_CUDA_ATTEND_EXACT_CUH_
#define OSCARKV_KERNELS_CUDA_ATTEND_EXACT_CUH_

#include "kernels/cuda/attend_device.cuh"

namespace oscarkv {
namespace cuda_attend {

// Lane owns dims [lane*EL, (lane+1)*EL) of every row. A warp handles its
// share of each exact block in steps of kTokensPerStep tokens: the rows of a
// step are loaded into Rows (LoadRows) before they are used (Step), so the
// split kernel can issue the first step's loads before it waits for the prep
// kernel.
template <int D, int HG>
struct ExactWarp {
  static constexpr int EL = D / 32;
  static constexpr int kTokensPerStep = D <= 128 ? 8 : 4;
  float q[HG][EL];
  float acc[HG][EL];
  float m[HG], l[HG];

  struct Rows {
    float k[kTokensPerStep][EL], v[kTokensPerStep][EL];
  };

  __device__ static void LoadRow(const bf16_bits* row, float (&x)[EL]) {
    if constexpr (EL == 2) {
      const uint32_t v = __ldg(reinterpret_cast<const unsigned int*>(row));
      x[0] = Bf16ToFloat(static_cast<bf16_bits>(v & 0xffffu));
      x[1] = Bf16ToFloat(static_cast<bf16_bits>(v >> 16));
    } else {
#pragma unroll
      for (int w = 0; w < EL / 4; ++w) {
        const uint2 v = __ldg(reinterpret_cast<const uint2*>(row) + w);
        x[4 * w + 0] = Bf16ToFloat(static_cast<bf16_bits>(v.x & 0xffffu));
        x[4 * w + 1] = Bf16ToFloat(static_cast<bf16_bits>(v.x >> 16));
        x[4 * w + 2] = Bf16ToFloat(static_cast<bf16_bits>(v.y & 0xffffu));
        x[4 * w + 3] = Bf16ToFloat(static_cast<bf16_bits>(v.y >> 16));
      }
    }
  }

  // The query rows of the kv head's g heads (qg[hh·D + d]) times `scale`
  // (scale·log2e for the raw queries: no prep-kernel output is needed, so an
  // exact unit need not wait for that kernel before its work), and zero state.
  __device__ void Init(const float* qg, float scale, int g, int lane) {
    const int D0 = lane * EL;
#pragma unroll
    for (int hh = 0; hh < HG; ++hh) {
      m[hh] = -INFINITY;
      l[hh] = 0.0f;
#pragma unroll
      for (int e = 0; e < EL; ++e) {
        acc[hh][e] = 0.0f;
        q[hh][e] = hh < g ? qg[hh * D + D0 + e] * scale : 0.0f;
      }
    }
  }

  // K and V rows of tokens [t, min(t1, t + kTokensPerStep)) of one exact
  // block (zeros past t1). Reads no state.
  __device__ static void LoadRows(const LaunchArgs& a, int h, const ExactBlockRef& blk, int t,
                                  int t1, int lane, Rows& r) {
    const size_t row_elems = a.geom.exact_row_elems();
    const bf16_bits* kb = blk.block + size_t(h) * D + lane * EL;
    const bf16_bits* vb = kb + size_t(a.geom.page_tokens) * row_elems;
#pragma unroll
    for (int u = 0; u < kTokensPerStep; ++u) {
      if (t + u < t1) {
        LoadRow(kb + size_t(t + u) * row_elems, r.k[u]);
        LoadRow(vb + size_t(t + u) * row_elems, r.v[u]);
      } else {
#pragma unroll
        for (int e = 0; e < EL; ++e) r.k[u][e] = r.v[u][e] = 0.0f;
      }
    }
  }

  // Online softmax and accumulation over the tokens of one step.
  __device__ void Step(int g, const Rows& r, int t, int t1) {
#pragma unroll
    for (int hh = 0; hh < HG; ++hh) {
      if (hh >= g) break;
      float lg[kTokensPerStep];
#pragma unroll
      for (int u = 0; u < kTokensPerStep; ++u) {
        float s = 0.0f;
#pragma unroll
        for (int e = 0; e < EL; ++e) s = fmaf(q[hh][e], r.k[u][e], s);
#pragma unroll
        for (int off = 16; off >= 1; off >>= 1) s += __shfl_xor_sync(kFull, s, off);
        lg[u] = t + u < t1 ? s : -INFINITY;
      }
      float cm = lg[0];
#pragma unroll
      for (int u = 1; u < kTokensPerStep; ++u) cm = fmaxf(cm, lg[u]);
      const float mn = fmaxf(m[hh], cm);
      const float f = exp2f(m[hh] - mn);
      m[hh] = mn;
      l[hh] *= f;
#pragma unroll
      for (int e = 0; e < EL; ++e) acc[hh][e] *= f;
#pragma unroll
      for (int u = 0; u < kTokensPerStep; ++u) {
        const float p = exp2f(lg[u] - mn);
        l[hh] += p;
#pragma unroll
        for (int e = 0; e < EL; ++e) acc[hh][e] = fmaf(p, r.v[u][e], acc[hh][e]);
      }
    }
  }

  __device__ void Finish(int g, int lane, float (*sm_o)[D], float* sm_m, float* sm_l) const {
#pragma unroll
    for (int hh = 0; hh < HG; ++hh) {
      if (hh >= g) break;
#pragma unroll
      for (int e = 0; e < EL; ++e) sm_o[hh][lane * EL + e] = acc[hh][e];
      if (lane == 0) {
        sm_m[hh] = m[hh];
        sm_l[hh] = l[hh];
      }
    }
  }
};

// Prefetches into L2 the K and V rows of kv head wu.kv_head in the unit's
// exact blocks, for units that run them after their history part (so those
// rows do not come from DRAM on the unit's critical path). One 128-byte line
// per thread and step, over the block's kBlockThreads threads.
template <int D, int kBlockThreads = kThreads>
__device__ void PrefetchExactRowsL2(const LaunchArgs& a, const WorkUnit& wu) {
  constexpr int kLinesPerRow = (D * 2 + 127) / 128;
  const int P = a.geom.page_tokens;
  const size_t row_elems = a.geom.exact_row_elems();
  const int per_block = 2 * P * kLinesPerRow;
  const int total = (wu.exact_end - wu.exact_begin) * per_block;
  for (int idx = threadIdx.x; idx < total; idx += kBlockThreads) {
    const int b = idx / per_block, j = idx % per_block;
    const ExactBlockRef ref = wu.exact[b];
    const int kv = j / (P * kLinesPerRow), tok = (j / kLinesPerRow) % P, line = j % kLinesPerRow;
    if (tok >= ref.tokens) continue;
    const bf16_bits* row = ref.block + (size_t(kv) * P + tok) * row_elems + size_t(wu.kv_head) * D;
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(row + line * 64));
  }
}

}  // namespace cuda_attend
}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_CUDA_ATTEND_EXACT_CUH_
