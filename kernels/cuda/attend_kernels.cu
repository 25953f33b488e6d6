// The split-KV attention kernel (exact and history units) and the launches
// of one decode-attention call: query prep (attend_prep.cuh), split, merge
// (attend_merge.cuh), or variant 11's one cluster kernel (attend_cluster.cuh).
// Host planning lives in attend_launcher.cu.
#include "kernels/cuda/attend_launch.h"

#include <algorithm>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/attend_claim.cuh"
#include "kernels/cuda/attend_cluster.cuh"
#include "kernels/cuda/attend_exact.cuh"
#include "kernels/cuda/attend_history.cuh"
#include "kernels/cuda/attend_history_int.cuh"
#include "kernels/cuda/attend_history_int8.cuh"
#include "kernels/cuda/attend_kernels.h"
#include "kernels/cuda/attend_merge.cuh"
#include "kernels/cuda/attend_prep.cuh"
#include "kernels/cuda/attend_stage_ring.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/pdl_launch.h"
#include "kernels/status_macros.h"

namespace oscarkv {
namespace cuda_attend {
namespace {

// Combines the 4 warps' (m, l, acc) of each head into the unit's partial.
template <int D, int HG>
__device__ void WritePartial(const LaunchArgs& a, int partial, float (*sm_o)[HG][D],
                             float (*sm_m)[HG], float (*sm_l)[HG]) {
  CombineWarpStates<D, HG, kWarps, kThreads>(a.g, sm_o, sm_m, sm_l,
                                             a.partials + size_t(partial) * PartialFloats(a.g, D));
}

// kPrefetch: register double buffer of whole chunks. kPipeline: software
// pipeline, QK of chunk i+1 next to softmax / PV of chunk i (two independent
// instruction streams per warp), K and V halves loaded on separate schedules.
// kIntPv: the history warp is HistoryWarpIntPv with that many P' digits
// (with kPrefetch only); 0: HistoryWarp. kStages > 0: chunks come through a
// per-warp ring of that many shared-memory stages filled by bulk copies
// (attend_stage_ring.cuh; the block's dynamic shared memory is
// StageRing::kBlockBytes) instead of the register double buffer.
// kExactFirst: a unit with both parts (the plan folds the exact blocks onto
// the history units, see FoldExact) runs its exact part before its pages,
// while the prep kernel runs, instead of after them. kShortChain (variant
// 12, with kIntPv = 2): HistoryWarpIntPv's shorter chunk chain, and the
// service's loop (a.ablate == 0) compiled with a literal 0, so it has no
// per-chunk tests of the benchmark's ablation bits (with kStages, variants
// 16 and 17: the ring's loop has none). kLoadOrder (with
// kShortChain): 0 = that service loop is RunDoubleBufferedChunks (variant
// 12); 1 = it issues each chunk's loads after the chunk before it is first
// used (RunChunksLoadingAfterFirstUse, variant 13); 2 = 1 with the loads
// after the chunk's first 16-token tile of logits (variant 14). kTwoHeads
// (variant 19): the plan cuts the history flat (UnitSizes::flat), so a unit
// may hold the exact blocks of the next kv head (WorkUnit::exact_head) and
// that head's first pages as a second history part, run after the first.
template <int D, int NG, bool G8, int kMinBlocks, bool kPrefetch, bool kPipeline = false,
          bool kInt = false, int kIntPv = 0, int kStages = 0, bool kExactFirst = false,
          bool kShortChain = false, int kLoadOrder = 0, bool kTwoHeads = false>
__global__ void __launch_bounds__(kThreads, kMinBlocks) SplitKernel(LaunchArgs a) {
  using C = Cfg<D, NG, G8>;
  // (At 5-8 query heads the integer path is HistoryWarpIntPv8: 16-bit P',
  // the short chain.)
  using IntWarp = std::conditional_t<G8, HistoryWarpIntPv8<D, NG, G8>,
                                     HistoryWarpIntPv<D, NG, G8, kIntPv, kShortChain>>;
  using Warp = std::conditional_t<(kIntPv > 0), IntWarp, HistoryWarp<D, NG, G8, kInt>>;
  static_assert(!G8 || kIntPv == 0 || (kIntPv == 2 && kShortChain), "8 heads: 14's warp");
  static_assert(kIntPv == 0 || (kPrefetch && !kPipeline), "integer P·V runs the prefetch loop");
  static_assert(!kShortChain || kIntPv == 2, "the short chain: variant 8's warp");
  static_assert(kLoadOrder == 0 || kStages == 0, "load orders of the register double buffer");
  static_assert(kLoadOrder == 0 || kShortChain, "the load orders of variant 12's loop");
  static_assert(kStages == 0 || !kPipeline, "the stage ring replaces the register buffers");
  static_assert(!kTwoHeads || (kShortChain && kStages == 0), "two heads: variant 15's loop");
  constexpr int HG = C::HG;
  __shared__ __align__(16) float sm_o[kWarps][HG][D];  // also the exact steps' scratch
  __shared__ float sm_m[kWarps][HG];
  __shared__ float sm_l[kWarps][HG];
  const int warp = WarpIndex(), lane = threadIdx.x & 31;
  unsigned long long* const trace = a.trace[kTraceSplit];
  Trace(trace, blockIdx.x, kTraceStart);
  // Work and page tables were uploaded before the prep kernel ran: safe to
  // read before waiting for it.
  // (The claimed unit through a shuffle from lane 0, which ptxas can prove
  // uniform as it can blockIdx.x: read from shared memory as is, its unit's
  // fields took vector registers and the 128-register kernels spilled 24 to
  // 120 bytes; H200 builds, 2026-12-02.)
  const WorkUnit wu = a.work[__shfl_sync(kFull, ClaimUnit(a), 0)];
  const ItemPlan& item = a.items[wu.item];
  // This warp's (m, l) of every head: "no tokens", for warps that get none.
  auto clear_warp_state = [&] { ClearWarpState<HG>(sm_m[warp], sm_l[warp], lane); };
  clear_warp_state();
  // Between a unit's two parts: every thread is done reading the first
  // part's state (its partial is written), then the second starts empty.
  auto next_part = [&] {
    __syncthreads();
    clear_warp_state();
  };
  const bool has_history = wu.partial >= 0, has_exact = wu.exact_partial >= 0;
  // (Equal to kv_head but under a flat cut; the other kernels read kv_head,
  // so their code stays the one measured.)
  const int exact_head = kTwoHeads ? wu.exact_head : wu.kv_head;
  // The exact part: the unit's exact blocks into its exact partial.
  auto run_exact = [&] {
    // Exact blocks [exact_begin, exact_end); each block's tokens split over
    // the 4 warps, in steps of Ex::kTokensPerStep tokens. The block references
    // are held one per lane (blocks [base, base + 32)); the first block's is
    // also in the unit, so its rows need not wait for the lanes' loads (at
    // B1 8K each exact unit has just that block). The exact part reads
    // the raw queries, not the prep kernel's output, so an exact-only unit
    // issues its loads before it waits for that kernel. A unit with a
    // history part runs this after its pages (its rows prefetched into L2
    // at its start), or with kExactFirst before them, without waiting for
    // that kernel at all: then it overlaps the prep kernel instead of being
    // a tail of several us on the call's critical path (commit 545fe5f,
    // with folding from 64 pages per unit: B1 128K 40.3 -> 39.2 us, B8 32K
    // 74.5 -> 71.2, B8 64K 121.4 -> 119.1; H200, 2026-11-30,
    // tests/bench/RESULTS.md run 21).
    using Ex = ExactWarp<D, HG>;
    Ex ex;
    const int nb = wu.exact_end - wu.exact_begin;
    int base = 0;
    auto fetch_ref = [&](int b0) {
      ExactBlockRef r{nullptr, 0};
      if (b0 + lane < nb) r = wu.exact[b0 + lane];
      return r;
    };
    ExactBlockRef my_ref = fetch_ref(0);
    ExactBlockRef blk{nullptr, 0};
    int e = 0, t = 0, t1 = 0;
    // Moves to the first block at or after `from` with tokens for this warp.
    auto seek = [&](int from) {
      for (e = from; e < nb; ++e) {
        if (e >= base + 32) {
          base += 32;
          my_ref = fetch_ref(base);
        }
        if (e == 0) {
          blk = wu.first_exact;  // without waiting for my_ref
        } else {
          blk.block = reinterpret_cast<const bf16_bits*>(__shfl_sync(
              kFull, reinterpret_cast<unsigned long long>(my_ref.block), e - base));
          blk.tokens = __shfl_sync(kFull, my_ref.tokens, e - base);
        }
        if (Ex::WarpTokens(blk.tokens, kWarps, warp, t, t1)) return;
      }
    };
    // One step's rows at a time: two in flight (the next step's loads before
    // this step's math) measured the same at B1 and B8 (H200, 2026-11-30,
    // RESULTS run 20) and took more registers.
    typename Ex::Rows rows;
    seek(0);
    if (e < nb) {
      // The queries' loads first, then the rows', without waiting between.
      ex.Init(a.queries + (size_t(wu.item) * a.hq + size_t(exact_head) * a.g) * D, a.scale_log2,
              a.g, lane);
      Ex::LoadRows(a, exact_head, blk, t, t1, lane, rows);
    }
    if (!has_history) {
      LaunchDependents();
      // An exact-only unit needs nothing from the prep kernel, but it does
      // its math only once that kernel is done: computing during the prep-to-
      // split handoff (the rows of one block arrive by then) delayed the
      // history units' wait by ~0.5 us and the call by 0.35 us at B1 32K and
      // 64K (H200, 2026-11-30, RESULTS run 20). The wait also keeps "split
      // done" implying "prep done" in a batch without history, where no other
      // block waits: the next call reuses the prep kernel's buffers.
      WaitForPrerequisites();
    }
    if (e < nb) {
      float* const scratch = &sm_o[warp][0][0];  // free until Finish
      ex.Step(a.g, rows, t, t1, lane, scratch);
      Trace(trace, blockIdx.x, kTraceExactFirstStep);
      while (true) {
        t += Ex::kTokensPerStep;
        if (t >= t1) seek(e + 1);
        if (e >= nb) break;
        Ex::LoadRows(a, exact_head, blk, t, t1, lane, rows);
        ex.Step(a.g, rows, t, t1, lane, scratch);
      }
      ex.Finish(a.g, lane, sm_o[warp], sm_m[warp], sm_l[warp]);
    }
    Trace(trace, blockIdx.x, kTraceExactDone);
    WritePartial<D, HG>(a, wu.exact_partial, sm_o, sm_m, sm_l);
  };
  if constexpr (kExactFirst) {
    if (has_exact) {
      run_exact();
      if (has_history) next_part();
    }
  } else if (has_history && has_exact) {
    // (The blocks of wu.kv_head: a flat cut folds none onto a kernel that
    // runs them after the pages, CutFlat.)
    PrefetchExactRowsL2<D>(a, wu);
  }
  // A history part: pages [begin, end) of (plan) head `kv_head` into `partial`.
  auto run_history = [&](int kv_head, int begin, int end, int partial) {
    const int cpp = a.geom.page_tokens / 32;
    const int n = (end - begin) * cpp;
    Warp hw;
    hw.InitOffsets(a.geom, a.KvHead(kv_head), lane);
    WarpPages<kWarps> pages(item, begin, n, cpp, warp, lane);
    // The same code as calling pages' methods directly, which ptxas
    // schedules differently (checked on the dev VM: these forwards keep the
    // SASS of every split kernel byte-identical to the lambdas they replaced).
    auto in_page = [&](int it) { return pages.InPage(it); };
    auto page_of = [&](int it) { return pages.Page(it); };
    const int iters = pages.Iterations();
    if constexpr (kStages > 0) {
      extern __shared__ __align__(128) uint8_t ring_smem[];
      StageRing<D, NG, kStages> ring;
      ring.Init(ring_smem, warp, lane, a.geom, a.KvHead(kv_head));
      // The first kStages chunks go in flight before the prep kernel's
      // results are needed. page_of is a warp shuffle: all lanes call it.
      for (int it = 0; it < iters && it < kStages; ++it) {
        const uint8_t* page = page_of(it);
        if (lane == 0) ring.Fill(it, page, in_page(it));
      }
      WaitForPrerequisites();  // the prep kernel's query fragments
      LaunchDependents();
      Trace(trace, blockIdx.x, kTraceWaited);
      if (iters > 0) {
        hw.InitQuery(a, wu.item, kv_head, lane);
        const int ablate = a.ablate;
        int s = 0;
        uint32_t phase = 0;
        for (int it = 0; it < iters; ++it) {
          BarrierWait(ring.full + s, phase);
          typename Warp::Regs x;
          hw.LoadStage(x, ring.Stage(s));
          if constexpr (kShortChain) {
            hw.Process(x);  // variants 16 and 17: no ablation tests
          } else {
            ProcessChunk(hw, x, ablate);
          }
          BarrierArrive(ring.empty + s);  // this lane is done with stage s
          if (it + kStages < iters) {
            const uint8_t* page = page_of(it + kStages);
            if (lane == 0) {
              BarrierWait(ring.empty + s, phase);
              ring.Fill(s, page, in_page(it + kStages));
            }
          }
          if (++s == kStages) {
            s = 0;
            phase ^= 1;
          }
        }
        hw.Finish(a.g, sm_o[warp], sm_m[warp], sm_l[warp]);
      }
    } else {
      typename Warp::Regs ra, rb;
      if constexpr (kPipeline) {
        // ra / rb: K halves (QK); va / vb: V halves (PV). At the loop top:
        // lga = logits(it), va = V(it), rb = K(it+1), ra = K(it+2) and
        // vb = V(it+1) in flight. Loads go in non-decreasing chunk order.
        typename Warp::Regs va = {}, vb = {};
        ra = {};
        rb = {};
        float lga[2][4], lgb[2][4];
        if (iters > 0) {
          hw.LoadK(ra, page_of(0), in_page(0));
          hw.LoadV(va, page_of(0), in_page(0));
        }
        if (iters > 1) hw.LoadK(rb, page_of(1), in_page(1));
        WaitForPrerequisites();  // the prep kernel's query fragments
        LaunchDependents();
        Trace(trace, blockIdx.x, kTraceWaited);
        if (iters > 0) {
          hw.InitQuery(a, wu.item, kv_head, lane);
          hw.Logits(ra, lga);
          if (iters > 1) hw.LoadV(vb, page_of(1), in_page(1));
          if (iters > 2) hw.LoadK(ra, page_of(2), in_page(2));
          int it = 0;
          while (true) {
            hw.Logits(rb, lgb);  // chunk it+1 (unused past the end)
            hw.Accumulate(va, lga);
            if (++it >= iters) break;
            if (it + 1 < iters) hw.LoadV(va, page_of(it + 1), in_page(it + 1));
            if (it + 2 < iters) hw.LoadK(rb, page_of(it + 2), in_page(it + 2));
            hw.Logits(ra, lga);  // chunk it+1
            hw.Accumulate(vb, lgb);
            if (++it >= iters) break;
            if (it + 1 < iters) hw.LoadV(vb, page_of(it + 1), in_page(it + 1));
            if (it + 2 < iters) hw.LoadK(ra, page_of(it + 2), in_page(it + 2));
          }
          hw.Finish(a.g, sm_o[warp], sm_m[warp], sm_l[warp]);
        }
      } else {
        // The first chunks' loads overlap the prep kernel.
        if (iters > 0) hw.Load(ra, page_of(0), in_page(0));
        if (kPrefetch && iters > 1) hw.Load(rb, page_of(1), in_page(1));
        WaitForPrerequisites();  // the prep kernel's query fragments
        LaunchDependents();
        Trace(trace, blockIdx.x, kTraceWaited);
        if (iters > 0) {
          hw.InitQuery(a, wu.item, kv_head, lane);
          if constexpr (kPrefetch) {
            // a.ablate (benchmarks only, see AttendLauncher::set_ablate) is 0 in
            // service; kShortChain compiles that loop with a literal 0.
            if (kShortChain && a.ablate == 0) {
              if constexpr (kLoadOrder > 0) {
                RunChunksLoadingAfterFirstUse<kLoadOrder == 2>(hw, ra, rb, iters, page_of,
                                                                in_page);
              } else {
                RunDoubleBufferedChunks(hw, ra, rb, iters, 0, page_of, in_page);
              }
            } else {
              RunDoubleBufferedChunks(hw, ra, rb, iters, a.ablate, page_of, in_page);
            }
          } else {
            int it = 0;
            while (true) {
              hw.Process(ra);
              if (++it >= iters) break;
              hw.Load(ra, page_of(it), in_page(it));
            }
          }
          hw.Finish(a.g, sm_o[warp], sm_m[warp], sm_l[warp]);
        }
      }
    }
    Trace(trace, blockIdx.x, kTraceLoopDone);
    WritePartial<D, HG>(a, partial, sm_o, sm_m, sm_l);
    Trace(trace, blockIdx.x, kTraceWritten);
  };
  if (has_history) run_history(wu.kv_head, wu.begin, wu.end, wu.partial);
  if constexpr (kTwoHeads) {
    // The next kv head's first pages (its trace marks overwrite the first
    // part's). It waits for the prep kernel again, which returns at once.
    if (wu.next_partial >= 0) {
      next_part();
      run_history(wu.kv_head + (1 << a.head_shift), 0, wu.next_end, wu.next_partial);
    }
  }
  if constexpr (!kExactFirst) {
    if (has_exact) {
      if (has_history) next_part();
      run_exact();
    }
  }
  Trace(trace, blockIdx.x, kTraceEnd);
}

// Launches `kernel` with programmatic stream serialization (PDL) allowed.
// (pdl false: a plain launch, for the benchmarks' skip_prep.)
template <typename Kernel>
absl::Status LaunchPdl(Kernel kernel, dim3 grid, dim3 block, cudaStream_t stream,
                       const LaunchArgs& a, size_t dynamic_smem = 0, bool pdl = true) {
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = PdlLaunchConfig(grid, block, dynamic_smem, stream, &attr, pdl);
  OSCARKV_CUDA_RETURN_IF_ERROR(cudaLaunchKernelEx(&cfg, kernel, a));
  return absl::OkStatus();
}

// Variants: 0 = 3 resident blocks per SM with a register double buffer;
// 1 (D = 128, one group only) = 4 blocks per SM, no prefetch; 2 = software
// pipeline (QK of the next chunk next to PV of this one), 3 blocks per SM;
// 3 / 4 = variants 0 / 2 with q·K on the integer tensor cores (D = 128 and at
// most 4 query heads per kv head; other shapes run variants 0 / 2); 6 / 7 =
// q·K and P·V on the integer tensor cores (HistoryWarpIntPv, 24-bit P'; D =
// 128, one quantization group, at most 4 query heads per kv head; other
// shapes run 3) at 3 / 4 blocks per SM; 8 / 9 = 6 / 7 with 16-bit P';
// 10 = 8 fed by a ring of kRingStages shared-memory stages per warp (bulk
// copies; other shapes run 3); 12 = 8 with the short chunk chain
// (kShortChain; other shapes run 3); 13 = 12 with each chunk's loads after
// the first use of the chunk before it (kLoadOrder 1; other shapes run 3);
// 14 = 13 with the loads after the chunk's first tile of logits (kLoadOrder
// 2; other shapes run 3); 15 = 14 at 4 blocks per SM (128 registers); 16 =
// 10's stage ring feeding 12's warp (kShortChain; other shapes run 3); 17 =
// 16 at 4 blocks per SM; 19 = 15 with units of two kv heads (kTwoHeads),
// which the plan then cuts flat (HasTwoHeadKernel; other shapes run 3).
// At D 128, one group and 5-8 query heads per kv head (unpaired), 14 and 19
// run HistoryWarpIntPv8 at 3 blocks per SM. (18, auto, is resolved to 14 or
// 19 by Prepare.)
constexpr int kLastVariant = AttendLauncher::kNumVariants - 1;
constexpr int kRingStages = 4;
// Variants from `first` on (auto, which Prepare resolves first, not among them).
inline bool VariantFrom(int variant, int first) {
  return variant >= first && variant <= kLastVariant && variant != AttendLauncher::kAutoVariant;
}
inline bool UsesIntPv(int variant, int head_dim, int groups, bool g8) {
  return VariantFrom(variant, 6) && head_dim == 128 && groups == 1 && !g8;
}
inline bool UsesIntQk(int variant, int head_dim, bool g8) {
  return VariantFrom(variant, 3) && head_dim == 128 && !g8;
}
// 5-8 query heads per kv head (unpaired) on the integer tensor cores:
// HistoryWarpIntPv8 in variant 14's and 19's kernels.
inline bool UsesIntPv8(int variant, int head_dim, int groups) {
  return (variant == 14 || variant == 19) && head_dim == 128 && groups == 1;
}

// The split kernels of 16-bit P' on the integer tensor cores with the
// exact blocks first or after the pages (variants 8, 12-17 and 19): kMinBlocks
// blocks per SM, kStages ring stages (0: the register double buffer),
// kShortChain and kLoadOrder as SplitKernel's.
template <int D, int NG, bool G8, int kMinBlocks, int kStages, bool kShortChain, int kLoadOrder,
          bool kTwoHeads = false>
auto IntPv16Kernel(bool exact_first) {
  return exact_first ? &SplitKernel<D, NG, G8, kMinBlocks, true, false, false, 2, kStages, true,
                                    kShortChain, kLoadOrder, kTwoHeads>
                     : &SplitKernel<D, NG, G8, kMinBlocks, true, false, false, 2, kStages, false,
                                    kShortChain, kLoadOrder, kTwoHeads>;
}

// Whether the variant's kernel for D = 128, G = D, g <= 4 reads its chunks
// through the per-warp stage ring (StageRing, dynamic shared memory).
inline bool UsesStageRing(int variant) { return variant == 10 || variant == 16 || variant == 17; }

// exact_first: the plan folds the exact blocks onto the history units;
// variants 8, 12-17 and 19 then run their exact-first kernels (the others run
// the exact blocks after the pages; HasExactFirstKernel asks this function).
template <int D, int NG, bool G8>
auto SplitKernelFor(int variant, bool exact_first) {
  if constexpr (D == 128 && NG == 1) {
    if (variant == 1) return &SplitKernel<D, NG, G8, 4, false>;
  }
  if constexpr (D == 128 && NG == 1 && G8) {
    // HistoryWarpIntPv8 (UsesIntPv8) at 3 blocks per SM.
    if (variant == 14) return IntPv16Kernel<D, NG, G8, 3, 0, true, 2>(exact_first);
    if (variant == 19) return IntPv16Kernel<D, NG, G8, 3, 0, true, 2, true>(exact_first);
  }
  if constexpr (D == 128 && NG == 1 && !G8) {
    // kInt is HistoryWarp's; HistoryWarpIntPv always runs q·K on integers.
    if (variant == 6) return &SplitKernel<D, NG, G8, 3, true, false, false, 3>;
    if (variant == 7) return &SplitKernel<D, NG, G8, 4, true, false, false, 3>;
    if (variant == 8) return IntPv16Kernel<D, NG, G8, 3, 0, false, 0>(exact_first);
    if (variant == 9) return &SplitKernel<D, NG, G8, 4, true, false, false, 2>;
    switch (variant) {
      case 12: return IntPv16Kernel<D, NG, G8, 3, 0, true, 0>(exact_first);
      case 13: return IntPv16Kernel<D, NG, G8, 3, 0, true, 1>(exact_first);
      case 14: return IntPv16Kernel<D, NG, G8, 3, 0, true, 2>(exact_first);
      case 15: return IntPv16Kernel<D, NG, G8, 4, 0, true, 2>(exact_first);
      case 16: return IntPv16Kernel<D, NG, G8, 3, kRingStages, true, 0>(exact_first);
      case 17: return IntPv16Kernel<D, NG, G8, 4, kRingStages, true, 0>(exact_first);
      case 19: return IntPv16Kernel<D, NG, G8, 4, 0, true, 2, true>(exact_first);
      default: break;
    }
    if (variant == 10) return &SplitKernel<D, NG, G8, 3, true, false, false, 2, kRingStages>;
  }
  if constexpr (D == 128 && !G8) {
    if (variant == 3 || VariantFrom(variant, 6)) {
      return &SplitKernel<D, NG, G8, 3, true, false, true>;
    }
    // 5 = 3 held to 4 blocks per SM (at most 128 registers): more warps to hide latency.
    if (variant == 5) return &SplitKernel<D, NG, G8, 4, true, false, true>;
    if (variant == 4) return &SplitKernel<D, NG, G8, 3, false, true, true>;
  }
  if (variant == 2 || variant == 4) return &SplitKernel<D, NG, G8, 3, false, true>;
  return &SplitKernel<D, NG, G8, 3, Cfg<D, NG, G8>::kPrefetch>;
}

// The split kernel of `variant` for this shape and its dynamic shared
// memory (the stage ring's, for variants 10, 16 and 17 on their shape). The
// ring of 4 stages takes 36 KB per block, under the default 48 KB limit.
struct SplitLaunch {
  void (*kernel)(LaunchArgs);
  size_t dynamic_smem;
};
template <int D, int NG, bool G8>
SplitLaunch SplitLaunchFor(int variant, bool exact_first) {
  SplitLaunch l{SplitKernelFor<D, NG, G8>(variant, exact_first), 0};
  if constexpr (D == 128 && NG == 1 && !G8) {  // the shape variants 10, 16, 17 run on
    if (!UsesStageRing(variant)) return l;
    using Ring = StageRing<D, NG, kRingStages>;
    // With the kernel's static shared memory (sm_o, sm_m, sm_l and
    // CombineWarpStates' weights).
    constexpr int kStaticBytes = kWarps * Cfg<D, NG, G8>::HG * (D + 3) * 4;
    static_assert(Ring::kBlockBytes + kStaticBytes <= 48 * 1024,
                  "above 48 KB needs the dynamic smem attribute");
    l.dynamic_smem = Ring::kBlockBytes;
  }
  return l;
}

// The cluster kernel's launch: clusters of `cluster_blocks` blocks.
inline cudaLaunchConfig_t ClusterConfig(int num_work, int cluster_blocks, cudaStream_t stream,
                                        cudaLaunchAttribute* attr) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(num_work);
  cfg.blockDim = dim3(cluster::kThreads);
  cfg.stream = stream;
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = cluster_blocks;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}

// The cluster kernel (D = 128) with `cluster_blocks` blocks per cluster.
using ClusterKernelFn = void (*)(LaunchArgs);
inline ClusterKernelFn ClusterKernelFor(int cluster_blocks) {
  switch (cluster_blocks) {
    case 4: return &ClusterKernel<128, 4>;
    case 8: return &ClusterKernel<128, 8>;
    case 16: return &ClusterKernel<128, 16>;
    default: return nullptr;
  }
}

// The merge kernel with `slice`-dim blocks (Prepare asks for 64 only at
// D = 128 without the wide merge); null when there is none.
template <int D>
auto MergeKernelFor(bool wide, int slice) {
  decltype(&MergeKernel<D, false, 32>) kernel = nullptr;
  if (slice == 32) kernel = wide ? &MergeKernel<D, true, 32> : &MergeKernel<D, false, 32>;
  if constexpr (D == 128) {
    if (slice == 64 && !wide) kernel = &MergeKernel<D, false, 64>;
  }
  return kernel;
}

template <int D, int NG, bool G8>
absl::Status LaunchTyped(const LaunchArgs& args, const LaunchShape& s, cudaStream_t stream) {
  LaunchArgs a = args;
  const bool int_pv = RunsIntegerValueProduct(s.variant, D, NG, G8);
  a.int_qk = int_pv ? 2 : UsesIntQk(s.variant, D, G8) ? 1 : 0;
  if constexpr (D == 128 && NG == 1 && !G8) {
    if (s.cluster_blocks > 0) {
      if (s.stages < 2 || s.num_work == 0) return absl::OkStatus();  // no prep stage of its own
      const ClusterKernelFn kernel = ClusterKernelFor(s.cluster_blocks);
      if (kernel == nullptr) return absl::InvalidArgumentError("no cluster kernel of that size");
      cudaLaunchAttribute attr[1];
      const cudaLaunchConfig_t cfg = ClusterConfig(s.num_work, s.cluster_blocks, stream, attr);
      OSCARKV_CUDA_RETURN_IF_ERROR(cudaLaunchKernelEx(&cfg, kernel, a));
      return absl::OkStatus();
    }
  }
  // Variant 11 runs only as the cluster kernel (Prepare plans the default otherwise):
  // its paired query fragments would not match SplitKernelFor(11)'s kernel.
  if (s.variant == AttendLauncher::kClusterVariant) {
    return absl::InternalError("variant 11 launched without its cluster plan");
  }
  // One prep block per (item, query head). A plain launch, not PDL: it
  // starts after the previous call's merge and this call's uploads, so the
  // split kernel's units (which start once every prep block is running) may
  // read the queries and write partials before they wait for the prep
  // kernel, as the exact parts do.
  const long heads = long(s.num_items) * s.hq;
  if (heads > 0x7fffffffL) return absl::InvalidArgumentError("attention batch too large");
  if (!s.skip_prep) {
    PrepKernel<D, G8><<<dim3(static_cast<unsigned>(heads)), PrepThreads(D), 0, stream>>>(a);
    OSCARKV_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  }
  if (s.stages >= 2 && s.num_work > 0) {
    const SplitLaunch split = SplitLaunchFor<D, NG, G8>(s.variant, s.exact_first);
    OSCARKV_RETURN_IF_ERROR(LaunchPdl(split.kernel, dim3(s.num_work), dim3(kThreads), stream, a,
                                      split.dynamic_smem, !s.skip_prep));
  }
  // Without a merge kernel after a split that claimed its units (the
  // benchmarks' stage timing, or a merge launch that failed), the claim
  // counters are zeroed here for the next launch (else ResetClaims does it).
  const bool claimed = s.num_work > 0 && a.rank_pools > 0;
  auto reset_claims = [&] {
    return claimed ? cudaMemsetAsync(a.claims, 0, sizeof(int) * kClaimSms, stream)
                   : cudaSuccess;
  };
  if (s.stages == 2) OSCARKV_CUDA_RETURN_IF_ERROR(reset_claims());
  if (s.stages >= 3) {
    const auto merge = MergeKernelFor<D>(s.wide_merge, s.merge_slice);
    absl::Status launched = merge == nullptr
                                ? absl::InternalError("no merge kernel for that slice")
                                : LaunchPdl(merge, dim3(s.num_items, s.hq, D / s.merge_slice),
                                            dim3(kThreads), stream, a);
    if (!launched.ok()) {
      reset_claims();  // the launch's error is the one to report
      return launched;
    }
  }
  return absl::OkStatus();
}

// Asked by AttendLauncher::Prepare once per kernel, on the launcher's device,
// before any launch of that kernel there: a kernel with a stage ring first
// gets its carveout set to favour shared memory (a per-device attribute).
// The variant's kernels with the exact blocks after and before the pages
// (the plan, sized by this answer, picks one): the fewer of the two.
template <int D, int NG, bool G8>
absl::StatusOr<int> BlocksPerSmTyped(const LaunchShape& s) {
  int fewest = 0;
  for (const bool exact_first : {false, true}) {
    const SplitLaunch split = SplitLaunchFor<D, NG, G8>(s.variant, exact_first);
    if (split.dynamic_smem > 0) {
      OSCARKV_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
          split.kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
          cudaSharedmemCarveoutMaxShared));
    }
    int blocks = 0;
    OSCARKV_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &blocks, split.kernel, kThreads, split.dynamic_smem));
    fewest = exact_first ? std::min(fewest, blocks) : blocks;
  }
  return fewest;
}

// Clusters of `cluster_blocks` blocks of `threads` threads of the cluster
// kernel of that size (the 4-block one for other sizes) resident at once on
// the current device.
absl::StatusOr<int> ClusterKernelCapacity(int threads, int cluster_blocks) {
  ClusterKernelFn kernel = ClusterKernelFor(cluster_blocks);
  if (kernel == nullptr) kernel = ClusterKernelFor(4);
  OSCARKV_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  cudaLaunchAttribute attr[1];
  cudaLaunchConfig_t cfg = ClusterConfig(cluster_blocks, cluster_blocks, nullptr, attr);
  cfg.blockDim = dim3(threads);
  int clusters = 0;
  OSCARKV_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg));
  return clusters;
}

// Whether the variant's split kernel for this shape with the exact blocks
// first is another kernel than the one with them after the pages.
template <int D, int NG, bool G8>
absl::StatusOr<bool> ExactFirstTyped(const LaunchShape& s) {
  return SplitKernelFor<D, NG, G8>(s.variant, true) != SplitKernelFor<D, NG, G8>(s.variant, false);
}

// Asked by AttendLauncher::Prepare once per cluster size, on the launcher's
// device: how many clusters of the cluster kernel fit at once (0: this shape
// has no cluster kernel, or no kernel of that size).
template <int D, int NG, bool G8>
absl::StatusOr<int> ClusterCapacityTyped(const LaunchShape& s) {
  if constexpr (D == 128 && NG == 1 && !G8) {
    if (ClusterKernelFor(s.cluster_blocks) == nullptr) return 0;
    return ClusterKernelCapacity(cluster::kThreads, s.cluster_blocks);
  }
  return 0;
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

absl::StatusOr<int> MergeBlocksPerSm() {
  int blocks = 0;
  OSCARKV_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &blocks, MergeKernelFor<128>(false, 32), kThreads, 0));
  return blocks;
}

bool RunsIntegerValueProduct(int variant, int head_dim, int groups, bool g8) {
  return g8 ? UsesIntPv8(variant, head_dim, groups) : UsesIntPv(variant, head_dim, groups, false);
}

bool HasTwoHeadKernel(const LaunchShape& s) {
  return s.variant == AttendLauncher::kFlatCutVariant && s.head_dim == 128 && s.groups == 1 &&
         s.cluster_blocks == 0;
}

absl::StatusOr<bool> HasExactFirstKernel(const LaunchShape& s) {
  OSCARKV_DISPATCH(ExactFirstTyped, s)
}

absl::StatusOr<int> ClusterCapacity(const LaunchShape& s) { OSCARKV_DISPATCH(ClusterCapacityTyped, s) }

}  // namespace cuda_attend

absl::StatusOr<int> AttendClusterCapacity(int threads, int cluster_size) {
  return cuda_attend::ClusterKernelCapacity(threads, cluster_size);
}

namespace {
// One thread reads %globaltimer `n` times; out[0] = the smallest nonzero step.
__global__ void TimerStepKernel(int n, unsigned long long* out) {
  unsigned long long prev, best = ~0ull;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(prev));
  for (int i = 0; i < n; ++i) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (t != prev && t - prev < best) best = t - prev;
    prev = t;
  }
  out[0] = best;
}
}  // namespace

absl::StatusOr<double> AttendTraceTimerStepNs() {
  unsigned long long* dev = nullptr;
  OSCARKV_CUDA_ALLOC_OR_RETURN(dev, cudaMalloc(&dev, sizeof(unsigned long long)),
                               "cudaMalloc (trace timer step)");
  TimerStepKernel<<<1, 1>>>(1 << 16, dev);
  unsigned long long step = 0;
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) err = cudaMemcpy(&step, dev, sizeof(step), cudaMemcpyDeviceToHost);
  cudaFree(dev);
  OSCARKV_CUDA_RETURN_IF_ERROR(err);
  if (step == ~0ull) return absl::InternalError("%globaltimer did not advance in 65536 reads");
  return static_cast<double>(step);
}

int AttendLauncher::ResolveVariant(int variant, long history_token_heads, int num_sms) {
  if (variant != kAutoVariant) return variant;
  return history_token_heads >= kHeavyTokenHeadsPerSm * std::max(1, num_sms) ? kAutoHeavyVariant
                                                                              : kAutoLightVariant;
}

bool AttendLauncher::PairsHeads(int variant, int head_dim, int group_size, int gqa) {
  if (variant == kAutoVariant) variant = kAutoLightVariant;  // 14 and 19: the same shapes
  return (gqa == 6 || gqa == 8) && group_size > 0 &&
         cuda_attend::UsesIntPv(variant, head_dim, head_dim / group_size, false);
}

bool AttendLauncher::UsesIntegerValueProduct(int variant, int head_dim, int group_size,
                                             int gqa) {
  // 14 and 19: the same shapes; variant 11 above 4 heads runs auto (Prepare).
  if (variant == kAutoVariant || (variant == kClusterVariant && gqa > 4)) {
    variant = kAutoLightVariant;
  }
  if (group_size <= 0) return false;
  const int kernel_gqa = PairsHeads(variant, head_dim, group_size, gqa) ? gqa / 2 : gqa;
  return cuda_attend::RunsIntegerValueProduct(variant, head_dim, head_dim / group_size,
                                              kernel_gqa > 4);
}

bool AttendLauncher::UsesFixedPoint16(int variant, int head_dim, int group_size, int gqa) {
  // Both of auto's variants have the same shapes and P'; 6 and 7 keep 24 bits.
  if (variant == kAutoVariant) variant = kAutoLightVariant;
  return variant >= 8 && UsesIntegerValueProduct(variant, head_dim, group_size, gqa);
}
}  // namespace oscarkv
