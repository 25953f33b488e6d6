// The schedule of one batched decode-attention call on the GPU, as the kernels
// read it from device memory (shared by the host planner and the kernels).
//
// A batch is cut into work units, one thread block each:
//   - exact units: one (item, kv head, range of sink/recent blocks), BF16 attention;
//   - history units: one (item, kv head, range of history pages) (split-KV),
//     which may also take a range of the same kv head's exact blocks; under
//     a flat cut (variant 19) a unit may go on into the next kv head.
// Every part of a unit writes one partial result (un-normalized accumulator,
// running max and running sum per query head of the GQA group, base-2
// logits) that the merge kernel combines with the online-softmax rule; the
// partials of each (item, kv head) are listed by its HeadPartials.
// With paired heads (LaunchArgs::head_shift = 1, PairHeadUnits) every "kv
// head" below is a plan head: half of a kv head's query heads, over that kv
// head's pages and exact rows.
#ifndef OSCARKV_KERNELS_CUDA_ATTEND_PLAN_H_
#define OSCARKV_KERNELS_CUDA_ATTEND_PLAN_H_

#include <cstddef>
#include <cstdint>

#include "kernels/backend.h"

namespace oscarkv {
namespace cuda_attend {

struct ItemPlan {
  const float* q = nullptr;  // [Hq][D]
  float* out = nullptr;      // [Hq][D]
  float* lse = nullptr;      // [Hq] or null
  RotationRef rotation;
  const uint8_t* const* pages = nullptr;  // device copy of the page table
  const ExactBlockRef* exact = nullptr;   // device copy of the exact blocks
  int num_pages = 0;
  int num_exact = 0;
};

// The partials of one (item, kv head) that the merge combines: history
// partials [hist_first, hist_first + hist_count) (in the rotated basis) and
// exact ones [exact_first, exact_first + exact_count). LaunchArgs::
// head_partials holds one per (item, kv head), item major.
struct HeadPartials {
  int hist_first = 0;
  int hist_count = 0;
  int exact_first = 0;
  int exact_count = 0;
};

// A unit has a history part (pages [begin, end) of one kv head, written to
// partial `partial`) and / or an exact part (exact blocks [exact_begin,
// exact_end), written to partial `exact_partial`); a partial index < 0 means
// the unit has no such part. A unit with both runs the history first, or
// the exact part first in the default variant's exact-first kernel
// (SplitKernel's kExactFirst). (The cluster kernel's units leave both
// indices at -1 and read the ranges.) Under a flat cut (UnitSizes::flat,
// variant 19's kernel: SplitKernel's kTwoHeads) the exact blocks may be
// those of kv head exact_head = kv_head + 1, and a unit may have a second
// history part: pages [0, next_end) of kv head kv_head + 1, written to
// partial next_partial (-1: none), run after the first. (With paired heads
// "+ 1" is the next kv head's same half: plan head + 2.)
struct WorkUnit {
  int item = 0;
  int kv_head = 0;
  int begin = 0;  // first history page
  int end = 0;    // one past the last history page
  int partial = -1;
  int exact_begin = 0;
  int exact_end = 0;
  int exact_partial = -1;
  // The item's exact + exact_begin on the device (set by the launcher for a
  // unit with exact blocks, else null): its blocks are found without reading
  // the item plan first, one dependent load less before their rows.
  const ExactBlockRef* exact = nullptr;
  // exact[0] itself (when `exact` is set): the first block's rows are loaded
  // straight after the unit, one more dependent load less.
  ExactBlockRef first_exact;
  int exact_head = 0;  // the exact blocks' kv head (kv_head but under a flat cut)
  int next_end = 0;
  int next_partial = -1;
};

// Floats per partial: acc [g][D], then m [g], then l [g].
inline constexpr size_t PartialFloats(int g, int d) { return size_t(g) * (d + 2); }

// Partials each warp of the merge kernel loads before combining them (one
// round of memory latency covers 4 warps x this many): the wide merge is for
// batches with many splits per kv head (few items), the narrow one needs
// fewer registers (more resident blocks when there are many items).
inline constexpr int MergeBatch(int d, bool wide) { return (wide ? 16 : 8) / (d > 128 ? 2 : 1); }

// Blocks per cluster of the cluster kernel (attend_cluster.cuh), the
// default of AttendLauncher::set_cluster_blocks (4 and 16 are built too;
// 8 measured fastest: tests/bench/RESULTS.md run 18).
inline constexpr int kClusterBlocks = 8;
// At most this many clusters per (item, kv head) (their results meet in
// global memory, combined in registers by the last one).
inline constexpr int kMaxClustersPerHead = 16;

// The split kernel's unit claims (attend_claim.cuh): one counter of the
// slots taken per SM id below kClaimSms (blocks on higher ids take a free
// slot of another). At most kMaxRankPools ranks.
inline constexpr int kMaxRankPools = 8;
inline constexpr int kClaimSms = 256;

// Per query head: {2^E, qsum[4 groups], 0, 0, 0} (see the prep kernel).
inline constexpr int kQueryMetaFloats = 8;

// Benchmarks only (AttendLauncher::set_trace): a per-block timeline of the
// prep, split and merge kernels of one call. Each block writes one row of
// kTraceMarks 64-bit words: %globaltimer (ns) at the marks it passes (0 at
// the others) and, in word kTraceSm, the multiprocessor it ran on (low 32
// bits) and, for a split block that claimed its unit (rank pools), the unit
// + 1 (high 32 bits; 0: the block's index is its unit). Thread 0
// writes them, so "done" marks of a warp are warp 0's; a mark is when thread
// 0 reads the timer (the compiler may move neighbouring memory operations
// across it). An index means different points in different kernels (the
// benchmark's names for them: tests/gpu/attend_trace_summary.h).
inline constexpr int kTraceMarks = 8;
enum TraceKernel : int { kTracePrep = 0, kTraceSplit = 1, kTraceMerge = 2, kTraceKernels = 3 };
enum TraceMarkIndex : int {
  kTraceStart = 0,  // every kernel: the block's first instruction
  kTraceSm = 1,     // every kernel: %smid (not a time)
  // split, history part / merge: the PDL wait returned; prep: the products
  // of q and its rows of R_K done (before the slices are summed)
  kTraceWaited = 2,
  // split: warp 0's history loop ended; merge: the block's warps combined;
  // prep: q' and its statistics in shared memory
  kTraceLoopDone = 3,
  // split: the history partial written; merge: warp 0's partials added
  // (before kTraceLoopDone)
  kTraceWritten = 4,
  // split, exact part: warp 0's first step done (its rows arrived and used;
  // an exact-only unit waits for the prep kernel before its math)
  kTraceExactFirstStep = 5,
  kTraceExactDone = 6,  // split: warp 0's exact blocks done
  kTraceEnd = 7,        // every kernel: thread 0's last instruction
};

}  // namespace cuda_attend
}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_CUDA_ATTEND_PLAN_H_
