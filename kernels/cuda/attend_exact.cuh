// The exact (BF16 sink / recent) warp of the split-KV kernel: fp32 math on the
// CUDA cores, the unrotated query. Included by attend_kernels.cu only.
#ifndef OSCARKV_KERNELS_CUDA_ATTEND_EXACT_CUH_
#define OSCARKV_KERNELS_CUDA_ATTEND_EXACT_CUH_

#include "kernels/cuda/attend_device.cuh"

namespace oscarkv {
namespace cuda_attend {

// Lane owns dims [lane*EL, (lane+1)*EL) of every row. A warp handles its
// share of each exact block in steps of kTokensPerStep tokens: the rows of a
// step are loaded into Rows (LoadRows, as raw bf16 words: half the registers
// of fp32) before they are used (Step, which converts them).
template <int D, int HG>
struct ExactWarp {
  static constexpr int EL = D / 32;
  static constexpr int kWords = EL / 2;  // bf16 pairs per lane and row
  static constexpr int kTokensPerStep = D <= 128 ? 8 : 4;
  float q[HG][EL];
  float acc[HG][EL];
  float m[HG], l[HG];

  struct Rows {
    uint32_t k[kTokensPerStep][kWords], v[kTokensPerStep][kWords];
  };

  __device__ static void LoadRow(const bf16_bits* row, uint32_t (&x)[kWords]) {
    if constexpr (kWords == 1) {
      x[0] = __ldg(reinterpret_cast<const unsigned int*>(row));
    } else {
#pragma unroll
      for (int w = 0; w < kWords / 2; ++w) {
        const uint2 v = __ldg(reinterpret_cast<const uint2*>(row) + w);
        x[2 * w] = v.x;
        x[2 * w + 1] = v.y;
      }
    }
  }
  // Element e of a lane's row (its dim lane·EL + e).
  __device__ static __forceinline__ float Elem(const uint32_t (&x)[kWords], int e) {
    return __uint_as_float(e % 2 == 0 ? x[e / 2] << 16 : x[e / 2] & 0xffff0000u);
  }

  // This warp's tokens [t, t1) of a block of `tokens` split evenly over
  // `warps` warps; false when it gets none.
  __device__ static bool WarpTokens(int tokens, int warps, int warp, int& t, int& t1) {
    const int per = (tokens + warps - 1) / warps;
    t = warp * per;
    t1 = min(tokens, t + per);
    return t < t1;
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
  // block (zeros past t1), for plan head h. Reads no state.
  __device__ static void LoadRows(const LaunchArgs& a, int h, const ExactBlockRef& blk, int t,
                                  int t1, int lane, Rows& r) {
    const size_t row_elems = a.geom.exact_row_elems();
    const bf16_bits* kb = blk.block + size_t(a.KvHead(h)) * D + lane * EL;
    const bf16_bits* vb = kb + size_t(a.geom.page_tokens) * row_elems;
#pragma unroll
    for (int u = 0; u < kTokensPerStep; ++u) {
      if (t + u < t1) {
        LoadRow(kb + size_t(t + u) * row_elems, r.k[u]);
        LoadRow(vb + size_t(t + u) * row_elems, r.v[u]);
      } else {
#pragma unroll
        for (int w = 0; w < kWords; ++w) r.k[u][w] = r.v[u][w] = 0u;  // +0.0 pairs
      }
    }
  }

  // (head, token) logits of one step, and how many one reduce-scatter sums.
  static constexpr int kLogits = HG * kTokensPerStep;
  static constexpr int kScatter = kLogits < 32 ? kLogits : 32;
  static_assert(kLogits % kScatter == 0 && kLogits % 4 == 0, "whole reduce-scatters, float4 reads");

  // Online softmax and accumulation over the tokens of one step. `scratch`:
  // kLogits floats of this warp's shared memory, 16-byte aligned, free until
  // Finish. The lanes' shares of the (head, token) dot products are summed
  // over the warp by reduce-scatters of kScatter (32; 16 at D 256, g <= 4)
  // values, 31 shuffles each for 32, and gathered through `scratch`, not
  // reduced one by one (5 shuffles
  // per logit, 160 per step at D 128, g 4: the exact units were the last of
  // a B1 8K call's split blocks, H200 2026-11-30, run 20). Heads past g have
  // zero queries (Init) and are skipped after the sums.
  __device__ void Step(int g, const Rows& r, int t, int t1, int lane, float* scratch) {
    __syncwarp();  // every lane's reads of the last step's logits are done
#pragma unroll
    for (int c = 0; c < kLogits / kScatter; ++c) {
      float v[kScatter];
#pragma unroll
      for (int i = 0; i < kScatter; ++i) {
        const int hh = (c * kScatter + i) / kTokensPerStep, u = (c * kScatter + i) % kTokensPerStep;
        float dot = 0.0f;
#pragma unroll
        for (int e = 0; e < EL; ++e) dot = fmaf(q[hh][e], Elem(r.k[u], e), dot);
        v[i] = dot;
      }
      const float sum = WarpSumScatter(v, lane);
      const int slot = WarpSumScatterSlot<kScatter>(lane);
      if (slot >= 0) scratch[c * kScatter + slot] = sum;
    }
    __syncwarp();
#pragma unroll
    for (int hh = 0; hh < HG; ++hh) {
      if (hh >= g) break;
      float lg[kTokensPerStep];
#pragma unroll
      for (int u4 = 0; u4 < kTokensPerStep; u4 += 4) {
        const float4 x = reinterpret_cast<const float4*>(scratch + hh * kTokensPerStep)[u4 / 4];
        lg[u4] = x.x;
        lg[u4 + 1] = x.y;
        lg[u4 + 2] = x.z;
        lg[u4 + 3] = x.w;
      }
#pragma unroll
      for (int u = 0; u < kTokensPerStep; ++u) lg[u] = t + u < t1 ? lg[u] : -INFINITY;
      float cm = lg[0];
#pragma unroll
      for (int u = 1; u < kTokensPerStep; ++u) cm = fmaxf(cm, lg[u]);
      const float mn = fmaxf(m[hh], cm);
      const float f = FastExp2(m[hh] - mn);  // 0 while empty
      m[hh] = mn;
      l[hh] *= f;
#pragma unroll
      for (int e = 0; e < EL; ++e) acc[hh][e] *= f;
#pragma unroll
      for (int u = 0; u < kTokensPerStep; ++u) {
        const float p = FastExp2(lg[u] - mn);
        l[hh] += p;
#pragma unroll
        for (int e = 0; e < EL; ++e) acc[hh][e] = fmaf(p, Elem(r.v[u], e), acc[hh][e]);
      }
    }
  }

  // Writes the warp's state; sm_o may be the steps' scratch.
  __device__ void Finish(int g, int lane, float (*sm_o)[D], float* sm_m, float* sm_l) const {
    __syncwarp();  // every lane's reads of the last step's logits are done
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
    const bf16_bits* row =
        ref.block + (size_t(kv) * P + tok) * row_elems + size_t(a.KvHead(wu.kv_head)) * D;
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(row + line * 64));
  }
}

}  // namespace cuda_attend
}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_CUDA_ATTEND_EXACT_CUH_
