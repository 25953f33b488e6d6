// The history (compressed) warp of the split-KV kernel. Included by
// attend_kernels.cu only; see attend_device.cuh for the math.
#ifndef OSCARKV_KERNELS_CUDA_ATTEND_HISTORY_CUH_
#define OSCARKV_KERNELS_CUDA_ATTEND_HISTORY_CUH_

#include "kernels/cuda/attend_device.cuh"

namespace oscarkv {
namespace cuda_attend {

// A warp's (m, l) of every head set to "no tokens" (a warp that gets none
// leaves them so for the block's combine).
template <int HG>
__device__ __forceinline__ void ClearWarpState(float (&m)[HG], float (&l)[HG], int lane) {
  if (lane < HG) {
    m[lane] = -INFINITY;
    l[lane] = 0.0f;
  }
  __syncwarp();
}

// Where a warp's chunks are: warp w of a block of W takes the unit's chunks
// w, w + W, ... (iteration it: chunk w + W·it); Page(it) is that chunk's
// page and InPage(it) its index within the page. The page pointers are held
// one per lane for iterations [base, base + 32) and shuffled out, so Page is
// warp-collective: every lane calls it with the same it, in increasing order.
template <int W>
struct WarpPages {
  const ItemPlan& item;
  int first_page;  // the unit's first history page
  int n;           // the unit's chunks
  int cpp;         // chunks per page
  int warp, lane;
  int base = 0;
  const uint8_t* my_ptr;

  __device__ WarpPages(const ItemPlan& item_, int first, int chunks, int chunks_per_page, int w,
                       int l)
      : item(item_), first_page(first), n(chunks), cpp(chunks_per_page), warp(w), lane(l) {
    my_ptr = Fetch(0);
  }
  __device__ __forceinline__ int ChunkOf(int it) const { return warp + W * it; }
  // Chunk index within its page (no division for the usual one chunk per page).
  __device__ __forceinline__ int InPage(int it) const { return cpp == 1 ? 0 : ChunkOf(it) % cpp; }
  __device__ __forceinline__ const uint8_t* Fetch(int it0) const {
    const int ci = ChunkOf(it0 + lane);
    return ci < n ? item.pages[first_page + (cpp == 1 ? ci : ci / cpp)] : nullptr;
  }
  __device__ __forceinline__ const uint8_t* Page(int it) {
    if (it >= base + 32) {
      base += 32;
      my_ptr = Fetch(base);
    }
    return reinterpret_cast<const uint8_t*>(
        __shfl_sync(kFull, reinterpret_cast<unsigned long long>(my_ptr), it - base));
  }
  // Iterations of this warp.
  __device__ __forceinline__ int Iterations() const {
    return warp < n ? (n - warp + W - 1) / W : 0;
  }
};

// The loads of one warp's 32-token chunks of kv head h's history pages, shared
// by the history warps. Thread (r = lane/4, c = lane%4) loads the K codes and
// the K and V (scale, min) of tokens r, r+8, 16+r, 24+r, and the V codes of
// tokens 16τ + {2c, 2c+1, 2c+8, 2c+9} (see ChunkRegs).
template <int D, int NG, bool G8>
struct ChunkLoads {
  using C = Cfg<D, NG, G8>;
  using Regs = ChunkRegs<C, NG>;
  int r, c;
  // Byte offsets, inside a page, of this thread's first K / V code and param
  // bytes of chunk 0.
  size_t k_thread, v_thread, kp_thread, vp_thread;

  // Lane layout and page offsets (no data from the prep kernel needed).
  __device__ void InitOffsets(const PageGeometry& geom, int h, int lane) {
    r = lane >> 2;
    c = lane & 3;
    k_thread = geom.codes_offset(h, 0) + size_t(r) * (D / 4) + c * (D / 16);
    kp_thread = geom.params_offset(h, 0) + size_t(r) * NG * 4;
    v_thread = geom.codes_offset(h, 1) + size_t(2 * c) * (D / 4) + r * C::VB;
    vp_thread = geom.params_offset(h, 1) + size_t(r) * NG * 4;
  }

  __device__ __forceinline__ void Load(Regs& x, const uint8_t* page, int chunk) const {
    LoadK(x, page, chunk);
    LoadV(x, page, chunk);
  }

  // Where a chunk's words are read from: the pages in global memory (the
  // read-only path) or a shared-memory stage (StageRing).
  struct FromGlobal {
    static __device__ __forceinline__ uint32_t U16(const uint8_t* p) { return Ld16(p); }
    static __device__ __forceinline__ uint32_t U32(const uint8_t* p) { return Ld32(p); }
    static __device__ __forceinline__ uint2 U64(const uint8_t* p) { return Ld64(p); }
  };
  struct FromShared {
    static __device__ __forceinline__ uint32_t U16(const uint8_t* p) {
      return *reinterpret_cast<const unsigned short*>(p);
    }
    static __device__ __forceinline__ uint32_t U32(const uint8_t* p) {
      return *reinterpret_cast<const uint32_t*>(p);
    }
    static __device__ __forceinline__ uint2 U64(const uint8_t* p) {
      return *reinterpret_cast<const uint2*>(p);
    }
  };

  // The K half (codes and params) of a chunk. Per-thread base pointers; every
  // load then uses a compile-time offset (no per-load address arithmetic).
  __device__ __forceinline__ void LoadK(Regs& x, const uint8_t* page, int chunk) const {
    ReadK<FromGlobal>(x, page + k_thread + size_t(chunk) * (32 * D / 4),
                      page + kp_thread + size_t(chunk) * (32 * NG * 4));
  }

  // The V half (codes and params) of a chunk.
  __device__ __forceinline__ void LoadV(Regs& x, const uint8_t* page, int chunk) const {
    LoadVParams(x.vp, page, chunk);
    LoadVCodes(x, page, chunk);
  }

  // The V (scale, min) of a chunk's tokens r, r+8, 16+r, 24+r.
  __device__ __forceinline__ void LoadVParams(uint32_t (&vp)[4][NG], const uint8_t* page,
                                              int chunk) const {
    ReadParams<FromGlobal>(vp, page + vp_thread + size_t(chunk) * (32 * NG * 4));
  }

  // The V codes of a chunk.
  __device__ __forceinline__ void LoadVCodes(Regs& x, const uint8_t* page, int chunk) const {
    ReadVCodes<FromGlobal>(x, page + v_thread + size_t(chunk) * (32 * D / 4));
  }

  // The whole chunk from a shared-memory stage laid out as StageRing's:
  // [K codes][K params][V codes][V params], 32 tokens each; the same
  // registers as Load from the page.
  __device__ __forceinline__ void LoadStage(Regs& x, const uint8_t* stage) const {
    constexpr int kCode = 32 * D / 4, kParam = 32 * NG * 4;
    ReadK<FromShared>(x, stage + r * (D / 4) + c * (D / 16), stage + kCode + r * NG * 4);
    ReadParams<FromShared>(x.vp, stage + 2 * kCode + kParam + r * NG * 4);
    ReadVCodes<FromShared>(x, stage + kCode + kParam + 2 * c * (D / 4) + r * C::VB);
  }

 private:
  // K codes and params of tokens r, r+8, 16+r, 24+r from this thread's bases.
  template <class From>
  static __device__ __forceinline__ void ReadK(Regs& x, const uint8_t* kb, const uint8_t* kpb) {
    constexpr int kRowOff[4] = {0, 8, 16, 24};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint8_t* kp = kb + kRowOff[i] * (D / 4);
      if constexpr (C::KW == 1) {
        x.kc[i][0] = From::U32(kp);
      } else {
#pragma unroll
        for (int w = 0; w < C::KW; w += 2) {
          const uint2 v = From::U64(kp + 4 * w);
          x.kc[i][w] = v.x;
          x.kc[i][w + 1] = v.y;
        }
      }
#pragma unroll
      for (int gi = 0; gi < NG; ++gi) x.kp[i][gi] = From::U32(kpb + (kRowOff[i] * NG + gi) * 4);
    }
  }

  // (scale, min) words of tokens r, r+8, 16+r, 24+r from this thread's base.
  template <class From>
  static __device__ __forceinline__ void ReadParams(uint32_t (&p)[4][NG], const uint8_t* pb) {
    constexpr int kRowOff[4] = {0, 8, 16, 24};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int gi = 0; gi < NG; ++gi) p[i][gi] = From::U32(pb + (kRowOff[i] * NG + gi) * 4);
    }
  }

  // V codes of tokens 16τ + {2c, 2c+1, 2c+8, 2c+9} from this thread's base.
  template <class From>
  static __device__ __forceinline__ void ReadVCodes(Regs& x, const uint8_t* vb) {
    constexpr int kTokOff[4] = {0, 1, 8, 9};
#pragma unroll
    for (int tau = 0; tau < 2; ++tau) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint8_t* vp = vb + (16 * tau + kTokOff[i]) * (D / 4);
        if constexpr (C::VB == 2) {
          x.vc[tau][i][0] = From::U16(vp);
        } else if constexpr (C::VB == 4) {
          x.vc[tau][i][0] = From::U32(vp);
        } else {
          const uint2 v = From::U64(vp);
          x.vc[tau][i][0] = v.x;
          x.vc[tau][i][1] = v.y;
        }
      }
    }
  }
};

// Online-softmax state and accumulators of one warp over its history chunks.
// Thread (r = lane/4, c = lane%4) owns query heads hh0, hh0+1 of the group.
// kInt: q·K on the integer tensor cores (D = 128, at most 4 query heads per
// kv head; other shapes ignore it): A = codes as u8 values c·4^k straight from
// the packed bytes (one AND per 4 codes), B = the query as four base-128 int8
// digits of q'·2^-E·4^(3-k), exact int32 accumulation (see the prep kernel).
template <int D, int NG, bool G8, bool kInt = false>
struct HistoryWarp : ChunkLoads<D, NG, G8> {
  using Base = ChunkLoads<D, NG, G8>;
  using typename Base::C;
  using typename Base::Regs;
  using Base::c;
  using Base::r;
  static constexpr bool kIntQK = kInt && D == 128 && !G8;
  static constexpr int QN = kIntQK ? 2 : C::NT;  // query fragment n-tiles
  static constexpr int QK = kIntQK ? 4 : C::KS;  // query fragment k-steps

  int hh0;
  uint32_t qb[QN][QK][2];
  float mult[2], qsum[2][NG];
  float m[2], l[2];
  float vlo[NG][2];
  float o[C::NT][C::MT][4];
  // The V codes' center u of this chunk (2 and 1 in turn, see
  // ValueProduct), as a float and in both halves of a word at bits 0-1.
  float vcen;
  uint32_t vcen_bits;

  __device__ void InitOffsets(const PageGeometry& geom, int h, int lane) {
    Base::InitOffsets(geom, h, lane);
    hh0 = G8 ? 2 * c : 2 * (c & 1);
  }

  // The query fragments and sums from the prep kernel; zero state.
  __device__ void InitQuery(const LaunchArgs& a, int item, int h, int lane) {
    const uint32_t* qf = a.qfrag + (size_t(item) * a.PlanHeads() + h) * (QN * QK * 2 * 32);
#pragma unroll
    for (int nt = 0; nt < QN; ++nt)
#pragma unroll
      for (int ks = 0; ks < QK; ++ks)
#pragma unroll
        for (int rg = 0; rg < 2; ++rg) qb[nt][ks][rg] = qf[((nt * QK + ks) * 2 + rg) * 32 + lane];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int hh = hh0 + j;
      const float* meta = a.qmeta + (size_t(item) * a.hq + h * a.g + hh) * kQueryMetaFloats;
      const bool valid = hh < a.g;
      mult[j] = valid ? meta[0] : 0.0f;
#pragma unroll
      for (int gi = 0; gi < NG; ++gi) qsum[j][gi] = valid ? meta[1 + gi] : 0.0f;
      m[j] = -INFINITY;
      l[j] = 0.0f;
#pragma unroll
      for (int gi = 0; gi < NG; ++gi) vlo[gi][j] = 0.0f;
    }
    vcen = 2.0f;
    vcen_bits = 0x00020002u;
#pragma unroll
    for (int nt = 0; nt < C::NT; ++nt)
#pragma unroll
      for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[nt][mt][e] = 0.0f;
  }

  __device__ __forceinline__ void Process(const Regs& x) {
    float lg[2][4];
    Logits(x, lg);
    Accumulate(x, lg);
  }

  // For ProcessChunk's benchmark stand-ins.
  static constexpr int kLogitsPerTile = 4;
  __device__ __forceinline__ float& AblationSink() { return l[0]; }

  // Logits (base 2) of tokens {r, r+8} of each 16-token tile, heads hh0 + (j & 1),
  // from the K half of a chunk. No state is touched.
  __device__ __forceinline__ void Logits(const Regs& x, float (&lg)[2][4]) const {
    if constexpr (kIntQK) {
      LogitsInt(x, lg);
    } else {
      LogitsF16(x, lg);
    }
  }

  // Logits on the fp16 tensor cores (query as hi / lo fp16 columns).
  __device__ __forceinline__ void LogitsF16(const Regs& x, float (&lg)[2][4]) const {
#pragma unroll
    for (int tau = 0; tau < 2; ++tau) {
      constexpr int kChains = C::KW >= 2 ? 2 : 1;  // independent MMA accumulation chains
      float s[kChains][C::NT][NG][4];
#pragma unroll
      for (int ch = 0; ch < kChains; ++ch)
#pragma unroll
        for (int nt = 0; nt < C::NT; ++nt)
#pragma unroll
          for (int gi = 0; gi < NG; ++gi)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[ch][nt][gi][e] = 0.0f;
#pragma unroll
      for (int w = 0; w < C::KW; ++w) {
        const uint32_t x0 = x.kc[2 * tau][w], x1 = x.kc[2 * tau + 1][w];
        const uint32_t x0s = x0 >> 8, x1s = x1 >> 8;
#define OSCARKV_QK_STEP(K)                                                                  \
  {                                                                                         \
    constexpr int gi = (K) * NG / 4;                                                        \
    const uint32_t a0 = KeyCodePair<K>(x0), a1 = KeyCodePair<K>(x1);                        \
    const uint32_t a2 = KeyCodePair<K>(x0s), a3 = KeyCodePair<K>(x1s);                      \
    _Pragma("unroll") for (int nt = 0; nt < C::NT; ++nt)                                    \
        MmaF16(s[w % kChains][nt][gi], a0, a1, a2, a3, qb[nt][w * 4 + (K)][0],              \
               qb[nt][w * 4 + (K)][1]);                                                    \
  }
        OSCARKV_QK_STEP(0)
        OSCARKV_QK_STEP(1)
        OSCARKV_QK_STEP(2)
        OSCARKV_QK_STEP(3)
#undef OSCARKV_QK_STEP
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = e & 1;
        const int row = 2 * tau + (e >> 1);
        float v = 0.0f;
#pragma unroll
        for (int gi = 0; gi < NG; ++gi) {
          float dot;
          if constexpr (G8) {
            dot = s[0][0][gi][e] + s[0][1][gi][e];
            if constexpr (kChains == 2) dot += s[1][0][gi][e] + s[1][1][gi][e];
          } else {
            float part = s[0][0][gi][e];
            if constexpr (kChains == 2) part += s[1][0][gi][e];
            dot = part + __shfl_xor_sync(kFull, part, 2);
          }
          const uint32_t kp = x.kp[row][gi];
          v += mult[j] * ParamScale(kp) * dot + ParamMin(kp) * qsum[j][gi];
        }
        lg[tau][e] = v;
      }
    }
  }

  // Logits on the integer tensor cores (kIntQK). Columns of n-tile t: n < 4 is
  // digit 2t of head n, n >= 4 digit 2t+1 of head n-4, so thread c < 2 holds
  // digits 0 and 2 of heads hh0, hh0+1 and thread c ^ 2 digits 1 and 3.
  __device__ __forceinline__ void LogitsInt(const Regs& x, float (&lg)[2][4]) const {
    const float w0 = c < 2 ? 1.0f : 0.0078125f;                 // 128^0 or 128^-1
    const float w1 = c < 2 ? 6.103515625e-05f : 4.76837158203125e-07f;  // 128^-2 or 128^-3
#pragma unroll
    for (int tau = 0; tau < 2; ++tau) {
      int s[2][NG][4];
#pragma unroll
      for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int gi = 0; gi < NG; ++gi)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[t][gi][e] = 0;
      const uint32_t x0 = x.kc[2 * tau][0], x0b = x.kc[2 * tau][1];
      const uint32_t x1 = x.kc[2 * tau + 1][0], x1b = x.kc[2 * tau + 1][1];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int gi = k * NG / 4;
        const uint32_t m = 0x03030303u << (2 * k);
        const uint32_t a0 = x0 & m, a1 = x1 & m, a2 = x0b & m, a3 = x1b & m;
#pragma unroll
        for (int t = 0; t < 2; ++t) ImmaU8S8(s[t][gi], a0, a1, a2, a3, qb[t][k][0], qb[t][k][1]);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = e & 1;
        const int row = 2 * tau + (e >> 1);
        float v = 0.0f;
#pragma unroll
        for (int gi = 0; gi < NG; ++gi) {
          const float part = fmaf(static_cast<float>(s[1][gi][e]), w1,
                                  static_cast<float>(s[0][gi][e]) * w0);
          const float dot = part + __shfl_xor_sync(kFull, part, 2);
          const uint32_t kp = x.kp[row][gi];
          v += mult[j] * ParamScale(kp) * dot + ParamMin(kp) * qsum[j][gi];
        }
        lg[tau][e] = v;
      }
    }
  }

  // Online softmax, P' and O' += P'V for one chunk, from its logits and the V
  // half of the chunk.
  __device__ __forceinline__ void Accumulate(const Regs& x, const float (&lg)[2][4]) {
    float cm[2];
    LaneMax(lg, cm);
    Rescale(cm);
    uint32_t pb[C::NT][NG][2][2];
    Probabilities(x.vp, lg, pb);
    ValueProduct(x, pb);
    vcen = 3.0f - vcen;  // 2, 1, 2, ...
    vcen_bits ^= 0x00030003u;
  }

  // This lane's max of each of its two heads over its logits of a chunk.
  __device__ __forceinline__ static void LaneMax(const float (&lg)[2][4], float (&cm)[2]) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      cm[j] = fmaxf(fmaxf(lg[0][j], lg[0][j + 2]), fmaxf(lg[1][j], lg[1][j + 2]));
    }
  }

  // Online softmax: the running max of each head moves to the max over the
  // warp of cm (lane maxima of the new tokens); l, vlo and o are rescaled.
  __device__ __forceinline__ void Rescale(float (&cm)[2]) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int off = 4; off <= 16; off <<= 1) cm[j] = fmaxf(cm[j], __shfl_xor_sync(kFull, cm[j], off));
    }
    float f[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float mn = fmaxf(m[j], cm[j]);
      f[j] = FastExp2(m[j] - mn);
      m[j] = mn;
      l[j] *= f[j];
#pragma unroll
      for (int gi = 0; gi < NG; ++gi) vlo[gi][j] *= f[j];
    }
    // The running max rarely moves after the first chunks: skip the rescale of
    // the accumulators when it did not move for any lane.
    if (__any_sync(kFull, f[0] != 1.0f || f[1] != 1.0f)) {
#pragma unroll
      for (int nt = 0; nt < C::NT; ++nt)
#pragma unroll
        for (int mt = 0; mt < C::MT; ++mt) {
          o[nt][mt][0] *= f[0];
          o[nt][mt][1] *= f[1];
          o[nt][mt][2] *= f[0];
          o[nt][mt][3] *= f[1];
        }
    }
  }

  // Probabilities of a chunk at the current running max, P' = p * s_V split
  // into hi / lo, transposed into B fragments; adds to l and vlo (the min
  // terms, and the chunk's center times P': ValueProduct).
  __device__ __forceinline__ void Probabilities(const uint32_t (&vps)[4][NG],
                                                const float (&lg)[2][4],
                                                uint32_t (&pb)[C::NT][NG][2][2]) {
#pragma unroll
    for (int tau = 0; tau < 2; ++tau) {
      float p[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        p[e] = FastExp2(lg[tau][e] - m[e & 1]);
        l[e & 1] += p[e];
      }
#pragma unroll
      for (int gi = 0; gi < NG; ++gi) {
        float pp[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const uint32_t vp = vps[2 * tau + (e >> 1)][gi];
          pp[e] = p[e] * ParamScale(vp);
          vlo[gi][e & 1] += p[e] * fmaf(vcen, ParamScale(vp), ParamMin(vp));
        }
#pragma unroll
        for (int nt = 0; nt < C::NT; ++nt) {
          const bool lo_part = G8 ? nt == 1 : c >= 2;
          float q[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float hi = Bf16Rn(pp[e]);
            q[e] = lo_part ? pp[e] - hi : hi;
          }
          pb[nt][gi][tau][0] = TransposeM8N8(PackBf16(q[0], q[1]));
          pb[nt][gi][tau][1] = TransposeM8N8(PackBf16(q[2], q[3]));
        }
      }
    }
  }

  // O' += P' (c - u) over the two 16-token tiles of a chunk, u the chunk's
  // center (vlo holds Σ p·(min + u·s)). The accumulators o are carried
  // through every chunk of the warp's unit, and the tensor cores' adder
  // cuts each product at the accumulator's last bit (toward zero): with the
  // codes as stored (c = 0..3, mean ~1.5) o grows as 1.5·Σ P' while the
  // output is a small difference of it and the min terms, so a long unit
  // drifted (H200, 2026-12-02: one 300-page unit per kv head erred by
  // 1.0-1.3e-4·(1 + |o|) at D 64, 128 and 256, ~2e-6 with short units).
  // Centers 2 and 1 in turn (c - u of mean -0.5, then +0.5) keep o near the
  // size of the output: 1.0-1.3e-5 on the same units (RESULTS run 27). The
  // codes stay exact in bf16, and the cost is 1-2 % on this path's long
  // shapes.
  __device__ __forceinline__ void ValueProduct(const Regs& x,
                                               const uint32_t (&pb)[C::NT][NG][2][2]) {
    const uint32_t sub[4] = {0x43004300u | vcen_bits, 0x43004300u | (vcen_bits << 2),
                             0x43004300u | (vcen_bits << 4), 0x43004300u | vcen_bits};
#pragma unroll
    for (int tau = 0; tau < 2; ++tau) {
#pragma unroll
      for (int bp = 0; bp < C::BP; ++bp) {
        const uint32_t sel = (bp & 1) ? 0x7632u : 0x5410u;
        const int wi = C::VB >= 4 ? bp / 2 : 0;
        const uint32_t X = Prmt(x.vc[tau][0][wi], x.vc[tau][1][wi], sel);
        const uint32_t Y = Prmt(x.vc[tau][2][wi], x.vc[tau][3][wi], sel);
        const uint32_t Xs = X >> 8, Ys = Y >> 8;
#define OSCARKV_PV_STEP(K)                                                            \
  {                                                                                   \
    constexpr int gi = (K) * NG / 4;                                                  \
    const uint32_t a0 = ValueCodePair<K>(X, sub[K]), a1 = ValueCodePair<K>(Xs, sub[K]); \
    const uint32_t a2 = ValueCodePair<K>(Y, sub[K]), a3 = ValueCodePair<K>(Ys, sub[K]); \
    _Pragma("unroll") for (int nt = 0; nt < C::NT; ++nt)                              \
        MmaBf16(o[nt][bp * 4 + (K)], a0, a1, a2, a3, pb[nt][gi][tau][0], pb[nt][gi][tau][1]); \
  }
        OSCARKV_PV_STEP(0)
        OSCARKV_PV_STEP(1)
        OSCARKV_PV_STEP(2)
        OSCARKV_PV_STEP(3)
#undef OSCARKV_PV_STEP
      }
    }
  }

  // Reduces across the warp and writes this warp's (m, l, acc) of each head
  // into shared memory (acc in the rotated basis, un-normalized).
  __device__ void Finish(int g, float (*sm_o)[D], float* sm_m, float* sm_l) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int off = 4; off <= 16; off <<= 1) {
        l[j] += __shfl_xor_sync(kFull, l[j], off);
#pragma unroll
        for (int gi = 0; gi < NG; ++gi) vlo[gi][j] += __shfl_xor_sync(kFull, vlo[gi][j], off);
      }
    }
    const bool writer = G8 || c < 2;
#pragma unroll
    for (int mt = 0; mt < C::MT; ++mt) {
      const int bp = mt / 4, k = mt % 4;
      constexpr int kQuarter = D / 4;
      const int gi = k * NG / 4;
      const float ks = ValueFieldScale(k);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float v;
        if constexpr (G8) {
          v = o[0][mt][e] + o[1][mt][e];
        } else {
          v = o[0][mt][e] + __shfl_xor_sync(kFull, o[0][mt][e], 2);
        }
        const int j = e & 1;
        const int d = r * C::VB + 2 * bp + (e >> 1) + k * kQuarter;
        const int hh = hh0 + j;
        if (writer && hh < g) sm_o[hh][d] = ks * v + vlo[gi][j];
      }
    }
    if (writer && r == 0) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        if (hh0 + j < g) {
          sm_m[hh0 + j] = m[j];
          sm_l[hh0 + j] = l[j];
        }
      }
    }
  }
};

// The register double buffer's loop over a warp's `iters` chunks (the split
// kernel's and the cluster kernel's): chunk it is in ra (even it) or rb (odd
// it), loaded one chunk ahead; ra holds chunk 0 and rb chunk 1 when it
// starts. page_of(it) / in_page(it): the page and chunk-in-page of
// iteration it (page_of is warp-collective). `ablate` is the benchmark's
// (0 in service; bit 4 skips the loads).
template <class W, class PageOf, class InPage>
__device__ __forceinline__ void RunDoubleBufferedChunks(W& hw, typename W::Regs& ra,
                                                        typename W::Regs& rb, int iters,
                                                        int ablate, PageOf page_of,
                                                        InPage in_page) {
  const bool loads = !(ablate & 4);
  int it = 0;
  while (true) {
    ProcessChunk(hw, ra, ablate);
    if (++it >= iters) break;
    if (loads && it + 1 < iters) hw.Load(ra, page_of(it + 1), in_page(it + 1));
    ProcessChunk(hw, rb, ablate);
    if (++it >= iters) break;
    if (loads && it + 1 < iters) hw.Load(rb, page_of(it + 1), in_page(it + 1));
  }
}

// The same double buffer with each chunk's loads issued after the previous
// chunk's first use (variants 13-15; the service loop, no ablation).
// ptxas puts every global load of the loop on one scoreboard, and the first
// use of a chunk waits for that scoreboard to drain: in
// RunDoubleBufferedChunks the first use of ra's chunk also waits for rb's
// loads, issued just before it, so every second chunk waits a whole memory
// latency (the SASS of variant 12's loop: all 40 LDGs write SB5; ncu on the
// H200, B8 64K: that first use holds 25 % of the kernel's stall samples,
// the other buffer's 0.4 %; tests/bench/RESULTS.md run 24). Here a chunk's
// Logits (its first use, which drains the scoreboard) come before the next
// chunk's loads, so only one chunk's loads are in flight at each wait,
// issued a chunk earlier. The branch around the loads keeps ptxas from
// hoisting them above it. Same products in the same order as
// RunDoubleBufferedChunks. ra holds chunk 0 and rb chunk 1 when it starts
// (rb's loads drain with chunk 0's). kAfterFirstTile (variant 14): the
// loads go in after the logits of the chunk's first 16-token tile, not
// after all of them (W::LogitsTile).
template <bool kAfterFirstTile, class W, class PageOf, class InPage>
__device__ __forceinline__ void RunChunksLoadingAfterFirstUse(W& hw, typename W::Regs& ra,
                                                              typename W::Regs& rb, int iters,
                                                              PageOf page_of, InPage in_page) {
  hw.Process(ra);
  int it = 1;
  // Chunk it is in x; the other buffer, free, gets chunk it + 1.
  auto step = [&](const typename W::Regs& x, typename W::Regs& next) {
    float lg[2][W::kLogitsPerTile];
    if constexpr (kAfterFirstTile) {
      hw.LogitsTile(x, 0, lg[0]);
    } else {
      hw.Logits(x, lg);
    }
    if (it + 1 < iters) hw.Load(next, page_of(it + 1), in_page(it + 1));
    if constexpr (kAfterFirstTile) hw.LogitsTile(x, 1, lg[1]);
    hw.Accumulate(x, lg);
    ++it;
  };
  while (it < iters) {
    step(rb, ra);
    if (it >= iters) break;
    step(ra, rb);
  }
}

// W::Process(x), or for benchmarks only (wrong results, ablate != 0): bit 1
// skips q·K (logits from the raw K params), bit 2 skips the softmax and P·V
// (the logits and V bytes are only summed into W::AblationSink()), so the
// time of each part can be measured in place. W is a history warp with Regs,
// kLogitsPerTile (logits per thread per 16-token tile), Logits, Accumulate.
template <class W>
__device__ __forceinline__ void ProcessChunk(W& w, const typename W::Regs& x, int ablate) {
  if (ablate == 0) {
    w.Process(x);
    return;
  }
  constexpr int E = W::kLogitsPerTile;
  float lg[2][E];
  if (ablate & 1) {
#pragma unroll
    for (int tau = 0; tau < 2; ++tau)
#pragma unroll
      for (int e = 0; e < E; ++e) {
        lg[tau][e] = __uint_as_float(x.kp[2 * tau + 2 * e / E][0] & 0x3f7fffffu);
      }
  } else {
    w.Logits(x, lg);
  }
  if (ablate & 2) {
    uint32_t v = 0;
    float sum = 0.0f;
#pragma unroll
    for (int tau = 0; tau < 2; ++tau) {
#pragma unroll
      for (int i = 0; i < 4; ++i) v ^= x.vc[tau][i][0] ^ x.vp[i][0];
#pragma unroll
      for (int e = 0; e < E; ++e) sum += lg[tau][e];
    }
    w.AblationSink() += sum + __uint_as_float(v & 0x3f7fffffu);
  } else {
    w.Accumulate(x, lg);
  }
}

}  // namespace cuda_attend
}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_CUDA_ATTEND_HISTORY_CUH_
