// Device side of the split-KV decode attention (included by attend_kernels.cu
// only). See attend_plan.h for the schedule and attend_kernels.h for limits.
//
// History unit, one warp per 32-token chunk of a page, for kv head h:
//   S = K·q'  on the tensor cores: mma.m16n8k16 with A = 16 tokens x 16 dims
//       of 2-bit codes turned into exact fp16 values, B = the rotated query
//       (scale·log2e folded in) split into fp16 hi + lo columns (so the
//       product keeps fp32 accuracy); the per-token (scale, min) are applied
//       to the 8 logits per thread afterwards: logit = s·(c·q') + min·Σq'.
//   O' += P'·V with P' = p·s_V split into bf16 hi + lo columns, transposed in
//       registers (movmatrix) into the B operand; A = 16 dims x 16 tokens of
//       V codes (byte-permuted pairs of tokens) less a center u (2 and 1 in
//       turn per chunk) as exact bf16 values; the rest is a scalar per head
//       and group, Σ p·(min_V + u·s_V).
// Every code byte and parameter of the page is read from memory exactly once
// for the whole GQA group (the group is the MMA's N dimension).
// That is HistoryWarp (attend_history.cuh). The default for D = 128, G = D and
// at most 4 query heads per kv head is HistoryWarpIntPv
// (attend_history_int.cuh): both products on the integer tensor cores; at 5-8
// it is HistoryWarpIntPv8 (attend_history_int8.cuh) or, at 6 and 8, paired
// heads (LaunchArgs::head_shift) on HistoryWarpIntPv.
#ifndef OSCARKV_KERNELS_CUDA_ATTEND_DEVICE_CUH_
#define OSCARKV_KERNELS_CUDA_ATTEND_DEVICE_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/cuda/attend_plan.h"

namespace oscarkv {
namespace cuda_attend {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr unsigned kFull = 0xffffffffu;

struct LaunchArgs {
  const ItemPlan* items;
  const WorkUnit* work;
  PageGeometry geom;
  int g;                 // query heads per plan head (per kv head unless paired)
  int hq;                // query heads
  float scale_log2;      // scale * log2(e)
  // [item][plan head][NT][KS][2][32]; integer formats [item][plan head][2][4][2][32],
  // HistoryWarpIntPv8's [item][kv head][4][4][2][32]
  uint32_t* qfrag;
  float* qmeta;          // [item][Hq][kQueryMetaFloats]
  float* partials;       // [partial][PartialFloats(g, D)] (cluster kernel: per (head, cluster,
                         // set) the normalized o [g][D], then the base-2 LSE [g])
  // Query fragments: 0 fp16, 1 integer digits (kIntQK), 2 integer digits
  // paired per head (HistoryWarpIntPv and HistoryWarpIntPv8).
  int int_qk;
  int ablate;            // benchmarks only: parts of the history loop skipped (wrong results)
  // The cluster kernel (attend_cluster.cuh): clusters per (item, kv head),
  // and a count per (item, kv head) of the clusters done (zero between launches).
  int clusters_per_head;
  unsigned int* cluster_counts;
  // The queries as uploaded, [item][Hq][D] (ItemPlan::q of item i is
  // queries + i·Hq·D), and, when every item has the same rotation (one
  // layer), that rotation (else r_k is null): the prep kernel then reads
  // R_K and q without first reading the item's plan.
  const float* queries;
  RotationRef rotation;
  // Benchmarks only, null in service: the rows of each TraceKernel's blocks
  // (kTraceMarks words each; see attend_plan.h). The cluster kernel has none.
  unsigned long long* trace[kTraceKernels];
  const HeadPartials* head_partials;  // [item][plan head]: what the merge combines
  // Paired heads (AttendLauncher::PairsHeads): 1 when each kv head's 2g
  // query heads (g = the field above) run as two "plan heads" of g each, plan
  // head v being query heads g·v .. g·v + g - 1 over the pages, exact rows and
  // rotations of kv head v >> 1; else 0 (plan heads are kv heads). Work
  // units, query fragments and head partials are per plan head.
  int head_shift;
  // Units claimed by arrival rank (attend_claim.cuh): 0, or the R of the
  // plan's RankShares, and its S (the SMs); each block claims its unit
  // through `claims` (kClaimSms counters, zero between launches).
  int rank_pools;
  int claim_sms;
  int* claims;
  OSCARKV_HDC int PlanHeads() const { return geom.kv_heads << head_shift; }
  OSCARKV_HDC int KvHead(int plan_head) const { return plan_head >> head_shift; }
};

template <int D, int NG, bool G8>
struct Cfg {
  static constexpr int KS = D / 16;      // QK k-steps (16 dims each)
  static constexpr int NT = G8 ? 2 : 1;  // n-tiles of the query / probability columns
  static constexpr int MT = D / 16;      // PV m-tiles (16 dims each)
  static constexpr int KW = D / 64;      // K code words per thread per token
  static constexpr int VB = D / 32;      // V code bytes per thread per token
  static constexpr int VW = VB >= 4 ? VB / 4 : 1;
  static constexpr int BP = VB / 2;      // V byte pairs per thread per token
  static constexpr int HG = G8 ? 8 : 4;  // query heads a block keeps in shared memory
  static constexpr int EL = D / 32;      // elements per lane (exact path)
  static constexpr bool kPrefetch = D <= 128;
};

// The PTX-level operations (and the kernels' Trace and WarpIndex), from here
// to FastRcp. With OSCARKV_WARP_EMULATION defined, a host emulation of one
// warp (tests/gpu/warp_emulation.h, included first) defines the same
// functions, so the warps' code runs and is tested on the CPU; the device
// code is the same either way.
#if !defined(OSCARKV_WARP_EMULATION)

// Programmatic dependent launch (sm_90): a kernel lets the next one in the
// stream start launching early; the next one waits for this one's memory
// before it reads it. Both are no-ops when the launch was not programmatic.
// (The attention kernels, and the GPU benchmark's launch-floor probe.)
__device__ __forceinline__ void LaunchDependents() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}
__device__ __forceinline__ void WaitForPrerequisites() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}

// Records the time of `mark` in row `block` of `rows` (thread 0; nothing when
// tracing is off), and at kTraceStart also the block's multiprocessor.
__device__ __forceinline__ void Trace(unsigned long long* rows, int block, int mark) {
  if (rows == nullptr || threadIdx.x != 0) return;
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  unsigned long long* row = rows + size_t(block) * kTraceMarks;
  row[mark] = t;
  if (mark == kTraceStart) {
    unsigned sm;
    asm("mov.u32 %0, %%smid;" : "=r"(sm));
    row[kTraceSm] = sm;
  }
}

// Warp index the compiler can prove warp-uniform (a shuffle from lane 0), so
// warp-collective code inside per-warp loops compiles without the divergence
// fallback (WARPSYNC / ENDCOLLECTIVE around every shuffle).
__device__ __forceinline__ int WarpIndex() {
  return __shfl_sync(kFull, static_cast<int>(threadIdx.x) >> 5, 0);
}

__device__ __forceinline__ void MmaF16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                       uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void MmaBf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                        uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// D (s32) += A (u8, 16x32) · B (s8, 32x8).
__device__ __forceinline__ void ImmaU8S8(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// D (s32) = A (u8, 16x32) · B (u8, 32x8), from zero.
__device__ __forceinline__ void ImmaU8U8(int (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.u8.u8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%10,%10,%10,%10};\n"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(0));
}

__device__ __forceinline__ uint32_t TransposeM8N8(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

__device__ __forceinline__ uint32_t Prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// Field k of bytes 0 and 2 of x as an fp16 pair (c0 * 4^k, c2 * 4^k), exact:
// 0x6400 | bits is 1024 + value in fp16 (10-bit mantissa).
template <int K>
__device__ __forceinline__ uint32_t KeyCodePair(uint32_t x) {
  const uint32_t v = (x & (0x00030003u << (2 * K))) | 0x64006400u;
  uint32_t d;
  asm("sub.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(v), "r"(0x64006400u));
  return d;
}

// Field k of bytes 0 and 2 of x less a center u as a bf16 pair, exact:
// 0x4300 | bits is 128 + value in bf16 (7-bit mantissa), so field 3 is
// shifted down first, and `sub` is 0x4300 | (u << 2k) in both halves
// (k = 3: 0x4300 | u), u = 0..3. Values are (c - u) * 4^k for k < 3 and
// c - u for k = 3 (see ValueFieldScale).
template <int K>
__device__ __forceinline__ uint32_t ValueCodePair(uint32_t x, uint32_t sub) {
  const uint32_t v = K < 3 ? ((x & (0x00030003u << (2 * K))) | 0x43004300u)
                           : (((x >> 6) & 0x00030003u) | 0x43004300u);
  uint32_t d;
  asm("sub.rn.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(v), "r"(sub));
  return d;
}

// 2^x with the MUFU unit (flush-to-zero below 2^-126; exp2(-inf) = 0).
__device__ __forceinline__ float FastExp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// log2 with the MUFU unit: lg2.approx, ~2^-22 absolute error for normal x;
// 0 and subnormals give -inf (ftz), NaN gives NaN. Used on sums of softmax
// weights (>= 1) and on V scales (variant 12's S).
__device__ __forceinline__ float FastLog2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// 1/x with the MUFU unit (rcp.approx.ftz, ~1 ulp), for normal x: no range
// checks (subnormal x flushes to 0 and gives inf).
__device__ __forceinline__ float FastRcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Loads of page bytes (read-only path; the stage ring's bulk copies take the
// same policy). A call reads each page byte once, so its lines are the
// first to leave L2 (evict-first policy): the partials, R_V and plans that
// the merge kernel reads next stay there. The policy is
// a constant: ptxas keeps it in a uniform register pair, the load's memory
// descriptor, and the loads take no other register. (The warp emulation's
// are plain reads.) The asm is not volatile and has no memory clobber, so
// the compiler may move these loads across barriers and the PDL wait: safe
// because no kernel of a call writes pages (they are written by earlier
// copies and kernels, done before the prep kernel, a plain launch, starts).
__device__ __forceinline__ uint64_t PageStreamPolicy() {
  uint64_t policy;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}
__device__ __forceinline__ uint32_t Ld16(const uint8_t* p) {
  unsigned short v;
  asm("ld.global.nc.L2::cache_hint.u16 %0, [%1], %2;\n" : "=h"(v) : "l"(p), "l"(PageStreamPolicy()));
  return v;
}
__device__ __forceinline__ uint32_t Ld32(const uint8_t* p) {
  uint32_t v;
  asm("ld.global.nc.L2::cache_hint.u32 %0, [%1], %2;\n" : "=r"(v) : "l"(p), "l"(PageStreamPolicy()));
  return v;
}
__device__ __forceinline__ uint2 Ld64(const uint8_t* p) {
  uint2 v;
  asm("ld.global.nc.L2::cache_hint.v2.u32 {%0, %1}, [%2], %3;\n"
      : "=r"(v.x), "=r"(v.y)
      : "l"(p), "l"(PageStreamPolicy()));
  return v;
}
// (16 bytes: used by the benchmark's read-only probe, tests/gpu/read_probe.cu,
// so that its ceiling is measured with the page loads' own hint.)
__device__ __forceinline__ uint4 Ld128(const uint8_t* p) {
  uint4 v;
  asm("ld.global.nc.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p), "l"(PageStreamPolicy()));
  return v;
}

#endif  // !OSCARKV_WARP_EMULATION

// One round of WarpSumScatter: each lane keeps kHalf of its 2·kHalf values
// (the upper half when its lane bit `off` is set), adds the partner's copy of
// them, then the next round. A template per round, so every index is a
// constant: a runtime-bounded loop left v in local memory (N = 16, 32).
template <int N, int kHalf>
__device__ __forceinline__ void WarpSumScatterRound(float (&v)[N], int lane) {
  if constexpr (kHalf >= 1) {
    constexpr int off = 32 / N * kHalf;  // 16, 8, ... for N = 32
    const bool upper = (lane & off) != 0;
#pragma unroll
    for (int i = 0; i < kHalf; ++i) {
      const float send = upper ? v[i] : v[i + kHalf];
      const float keep = upper ? v[i + kHalf] : v[i];
      v[i] = keep + __shfl_xor_sync(kFull, send, off);
    }
    WarpSumScatterRound<N, kHalf / 2>(v, lane);
  }
}

// The warp sums of N values held by every lane (v[i] of each lane summed
// over the warp), scattered: lane l returns the sum of index l·N/32, which
// lanes l·N/32·(32/N) .. +32/N−1 all hold (WarpSumScatterSlot names one of
// them). A transposing butterfly: log2(N) rounds that each halve the values
// a lane keeps (N−1 shuffles in all), then log2(32/N) plain rounds, where N
// separate 5-round reductions would take 5·N shuffles in chains five deep.
// Clobbers v.
template <int N>
__device__ __forceinline__ float WarpSumScatter(float (&v)[N], int lane) {
  static_assert(N >= 1 && N <= 32 && (N & (N - 1)) == 0, "a power of two up to 32");
  WarpSumScatterRound<N, N / 2>(v, lane);
#pragma unroll
  for (int off = 16 / N; off >= 1; off /= 2) v[0] += __shfl_xor_sync(kFull, v[0], off);
  return v[0];
}
// The index whose sum WarpSumScatter<N> returned to `lane` if that lane is
// the first of the lanes holding it, else -1: one writer per sum.
template <int N>
__device__ __forceinline__ int WarpSumScatterSlot(int lane) {
  return lane % (32 / N) == 0 ? lane / (32 / N) : -1;
}

__device__ __forceinline__ float ValueFieldScale(int k) {
  return k == 0 ? 1.0f : k == 1 ? 0.25f : k == 2 ? 0.0625f : 1.0f;
}

__device__ __forceinline__ uint32_t PackBf16(float lo_elem, float hi_elem) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo_elem, hi_elem);
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ float Bf16Rn(float x) {
  return __bfloat162float(__float2bfloat16_rn(x));
}

__device__ __forceinline__ float ParamScale(uint32_t p) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(p & 0xffffu)));
}
__device__ __forceinline__ float ParamMin(uint32_t p) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(p >> 16)));
}

// Registers of one 32-token chunk of one page for one kv head.
template <class C, int NG>
struct ChunkRegs {
  uint32_t kc[4][C::KW];     // K codes of tokens r, r+8, 16+r, 24+r: bytes [c*D/16, +D/16)
  uint32_t vc[2][4][C::VW];  // V codes of tokens 16τ + {2c, 2c+1, 2c+8, 2c+9}: bytes [r*VB, +VB)
  uint32_t kp[4][NG];        // K (scale, min) of tokens r, r+8, 16+r, 24+r
  uint32_t vp[4][NG];        // V (scale, min) of the same tokens
};

}  // namespace cuda_attend
}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_CUDA_ATTEND_DEVICE_CUH_
