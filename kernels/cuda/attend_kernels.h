// Decode attention over the paged compressed cache on the GPU: the planner
// and the three launches (query prep, split-KV attention, merge), or variant
// 11's one cluster kernel.
//
// Query heads per kv head: HistoryWarpIntPv runs up to 4 on the integer
// tensor cores (D 128, G = D); 6 and 8 run there as paired heads
// (PairsHeads), or on HistoryWarpIntPv8 (variants 14 and 19, and auto's
// heavy batches), as do 5 and 7; other shapes run the float path.
//
// Limits of this implementation (checked by Prepare, which answers
// UNIMPLEMENTED outside them): at most 8 query heads per kv head, group size
// G >= D/4 (G = D is the default), page_tokens a multiple of 32.
//
// Thread-safety: an AttendLauncher is NOT thread-safe; the CUDA backend guards
// its launcher with a mutex. Launch() only enqueues kernels (no allocation, no
// host synchronization), so a prepared launcher can be captured in a CUDA graph
// and replayed until the next Prepare (which may move the buffers); the
// device pointers inside the batch must stay valid (the queries were copied
// by Prepare), and each replay's outputs land in the results buffer.
#ifndef OSCARKV_KERNELS_CUDA_ATTEND_KERNELS_H_
#define OSCARKV_KERNELS_CUDA_ATTEND_KERNELS_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/cuda/attend_schedule.h"
#include "kernels/cuda/page_table_cache.h"

namespace oscarkv {

// What the last Prepare() scheduled (for logs and benchmarks).
struct AttendSchedule {
  int num_items = 0;
  int exact_units = 0;
  int history_units = 0;
  int pages_per_unit = 0;
  int partials = 0;
  size_t upload_bytes = 0;
  // Page pointers copied to the device by this call: every page of an item
  // without a page_table_id, only the new pages of a known table.
  long pages_uploaded = 0;
  int page_tables_cleared = 0;  // 1 if the device page-table array was emptied (full)
  int page_tables_grown = 0;    // 1 if it was replaced by a larger one (full)
  // > 0: one cluster kernel (variant 11) runs the call, with this many
  // clusters of cluster_blocks blocks per (item, kv head).
  int clusters_per_head = 0;
  int cluster_blocks = 0;
  // The split-kernel variant that ran (variant 18 resolves to 14 or 19).
  int variant = 0;
  // Its kernel for this shape runs P·V on the integer tensor cores (else the
  // float path: UsesIntegerValueProduct).
  bool integer_pv = false;
  // The query heads of each kv head ran as two plan heads (PairsHeads);
  // exact_units, history_units and partials then count the plan heads'.
  bool paired_heads = false;
  int merge_slice = 32;  // output dims per merge block (32 or 64)
  int plan_reused = 0;   // 1: the units of the last Prepare, whose shapes were the same
  // Variant 19: some items' history cut flat over their kv heads; units
  // with a second history part (the next kv head's first pages), and units
  // with the next kv head's exact blocks.
  bool flat_cut = false;
  int second_parts = 0;
  int next_head_exact = 0;
  // Units cut and claimed by arrival rank (AttendLauncher::set_rank_skew):
  // the ranks (blocks per SM; 0: off) and the skew.
  int rank_pools = 0;
  double rank_skew = 0.0;
};

// For benchmarks: the per-block timeline of one call's kernels
// (AttendLauncher::set_trace): rows[k] holds kernel k's blocks
// (cuda_attend::TraceKernel), cuda_attend::kTraceMarks words each.
struct AttendTrace {
  std::vector<unsigned long long> rows[cuda_attend::kTraceKernels];
  size_t blocks(int kernel) const { return rows[kernel].size() / cuda_attend::kTraceMarks; }
};

class AttendLauncher {
 public:
  // `device` is the CUDA device the launcher's memory lives on.
  static absl::StatusOr<std::unique_ptr<AttendLauncher>> Create(int device);
  ~AttendLauncher();
  AttendLauncher(const AttendLauncher&) = delete;
  AttendLauncher& operator=(const AttendLauncher&) = delete;

  // Checks the batch (queries included: INVALID_ARGUMENT for a non-finite
  // value), plans the work units, grows its buffers if needed (rarely: they
  // keep the largest size seen; growing the results buffer, the workspace or
  // the page-table array waits for the device) and enqueues one upload of
  // the queries, unnamed page tables and schedule from pinned staging memory
  // on `stream`. Named page tables (AttendItem::page_table_id) stay on the
  // device: only their new pages are copied, ordered on `stream` after
  // earlier launches (use one stream per launcher). The batch's host arrays
  // and queries are read during the call only. Waits for the previous upload
  // from the staging buffer to finish before reusing it. After a failed
  // Prepare, Launch answers FAILED_PRECONDITION until one succeeds.
  absl::Status Prepare(const AttendBatch& batch, cudaStream_t stream);

  // Enqueues the kernels of the last prepared batch on `stream`. They write
  // the outputs into the launcher's mapped pinned results buffer, which the
  // next launch overwrites.
  absl::Status Launch(cudaStream_t stream) const;

  // Once `stream` has run the last launch, writes its outputs to the items'
  // host out and lse (`batch` is the one given to the last Prepare). With
  // the outputs in device memory (set_results_in_device_memory) it copies
  // them down first.
  absl::Status CopyResults(const AttendBatch& batch) const;

  const AttendSchedule& schedule() const { return schedule_; }

  // Split-kernel variant (measured on an H200, 2026-11-29, tests/bench/RESULTS.md):
  //   0 = 3 blocks/SM, register double buffer of whole chunks, fp16 q·K;
  //   1 = 4 blocks/SM, no prefetch (D = 128, G = D; else 0);
  //   2 = software pipeline (q·K of the next chunk next to P·V of this one);
  //   3 = 0 with q·K on the integer tensor cores (D = 128, <= 4 query heads
  //       per kv head; else 0);
  //   4 = 2 with integer q·K;
  //   5 = 3 held to 128 registers (4 blocks/SM);
  //   6 / 7 = q·K and P·V on the integer tensor cores (24-bit fixed-point
  //       P', relative errors ~1e-6), 3 / 4 blocks/SM (D = 128, G = D, <= 4
  //       query heads per kv head; else 3): 16-18 % faster than 3 at B1 128K
  //       and B8 32K / 64K, 4-13 % at the shorter shapes;
  //   8 = 6 with P' in 16-bit fixed point of each chunk's exact max (relative
  //       L2 errors up to ~6e-5, single elements up to ~5e-4·(1 + |o|)): the
  //       default until 2026-12-01, 5-7 % faster than 6 at 64K-128K tokens
  //       and at B8, ~1 % at 8K-32K; when the plan folds the exact blocks
  //       onto the history units (set_fold_exact), its kernel runs them
  //       before the pages (so do 12-17's and 19's);
  //   9 = 8 held to 128 registers (4 blocks/SM, 16 bytes of spills): 2-4 %
  //       faster than 8 at B1 128K and B8 64K, 9 % slower at 8K and 16 %
  //       at B8 32K (2026-11-30, run 14); kept for measurement;
  //   10 = 8 with each warp's chunks fed through a ring of 4 shared-memory
  //       stages filled by bulk copies (TMA; attend_stage_ring.cuh; other
  //       shapes run 3): its loads alone stream 10 % faster than 8's, the
  //       whole loop is within −3 %..+3 % of 8 (2026-11-30, run 15); kept
  //       as the load path for a leaner loop;
  //   11 = 8's loop in one cluster kernel (attend_cluster.cuh): clusters
  //       of set_cluster_blocks() blocks, as many per (item, kv head) as fit
  //       at once, do the query prep, the split and the merge, meeting in
  //       distributed shared memory (and the clusters of a head in global
  //       memory), with no prep or merge kernel (D = 128, G = D, <= 4 query
  //       heads per kv head, at least one cluster per (item, kv head) at
  //       once; other batches run the default);
  //   12 = 8 with a shorter dependency chain per chunk (the same products:
  //       S from the logits' max reduction, 1/S by rcp.approx, cumulative
  //       V code masks; HistoryWarpIntPv's kShortChain) and the service loop
  //       compiled without the benchmark's ablation tests (D = 128, G = D,
  //       <= 4 query heads per kv head; other shapes run what 3 runs there).
  //       Its P' is kept in units of S / 65531, so that S's rounding (it is
  //       computed from lg + log2 s_V) never clamps a digit. Against 8:
  //       B8 64K 118.2 -> 113.9 us, B8 32K 70.9 -> 68.8, B1 8K-128K within
  //       0.5 us, same errors (H200, 2026-12-01, RESULTS run 24);
  //   13 = 12 with each chunk's loads issued after the first use of the
  //       chunk before it (RunChunksLoadingAfterFirstUse): ptxas waits for
  //       all of the loop's loads at once, so 12's order makes every second
  //       chunk wait for loads just issued (same shapes as 12). Against 12:
  //       B8 64K 114 -> 108 us, B8 32K 68.8 -> 65.9, B1 128K 38.8 -> 38.2;
  //   14 = 13 with the next chunk's loads after the logits of the chunk's
  //       first 16-token tile, not after both (same shapes as 12): the
  //       default from 2026-12-01 until 18. Against 13 (same call): B8 64K
  //       107.9 -> 106.5 us, B8 32K 65.9 -> 64.9, B1 32K 19.9 -> 19.6, the
  //       other B1 shapes within 0.2 us; against 12, B8 64K 114.3 -> 106.5
  //       (RESULTS run 24);
  //   15 = 14 held to 128 registers (4 blocks/SM), as 9 is 8: more warps to
  //       hide the loads' latency (no spills in its exact-first kernel, 8
  //       bytes outside the loops in the other; same shapes as 12). Against
  //       14 (H200, 2026-12-01, RESULTS run 25, before the L2 hint): B8 64K
  //       105.6 -> 100.4 us, B8 32K 64.4 -> 61.6, B1 128K 38.0 -> 37.2, the
  //       same at B1 64K, 5-6 % slower at B1 8K-32K (more, shorter units and
  //       more partials);
  //   16 = 12's warp fed by 10's per-warp ring of 4 shared-memory stages
  //       (bulk copies): the loads wait on mbarriers, 3 chunks ahead, not on
  //       the loop's scoreboard (same shapes as 12). Against 14 (run 25):
  //       36.8 against 38.0 us at B1 128K, the same at B1 8K and 64K, slower
  //       at B1 32K and at B8 (108.8 against 105.6 us at 64K);
  //   17 = 16 at 4 blocks/SM (120 / 124 registers without spills, 45 KB of
  //       shared memory per block; same shapes as 12): slower than 14 at
  //       every shape but B8 64K (104.8 us) in run 25;
  //   18 = auto, the default: 19 (15 until 2026-12-01, session 22) when the
  //       batch's history gives each SM at least kHeavyTokenHeadsPerSm
  //       (token, kv head) pairs (plan heads' with paired heads), else 14
  //       (ResolveVariant);
  //   19 = 15 with the history cut flat (attend_schedule.h's FlatCuts): each
  //       item's kv heads end to end in units of even weight, which may span
  //       two kv heads (same shapes as 12; others run 3). At B8 64K on an
  //       H200 that is 528 units for 528 slots instead of 512 (8 SMs had
  //       fewer than 4 blocks). Against 15 (H200, 2026-12-01, RESULTS run
  //       26): B8 64K 98.5 -> 96.9 us, B1 128K 35.0 -> 34.4, B8 32K the same
  //       (60.5), slower at the light shapes (as 15 is).
  // Takes effect at the next Prepare(). The environment variable
  // OSCARKV_CUDA_ATTEND_VARIANT sets the initial value.
  static constexpr int kNumVariants = 20;
  static constexpr int kClusterVariant = 11;
  static constexpr int kAutoVariant = 18;
  static constexpr int kFlatCutVariant = 19;
  static constexpr int kDefaultVariant = kAutoVariant;
  // What variant 18 runs on light and on heavy batches.
  static constexpr int kAutoLightVariant = 14, kAutoHeavyVariant = 19;
  // History (token, kv head) pairs per SM from which variant 18 runs its
  // heavy variant: between B1 64K (3,952 per SM on 132 SMs, where 14, 15
  // and 19 take the same time) and B1 128K (7,924, 15 and 19 faster).
  static constexpr long kHeavyTokenHeadsPerSm = 6144;
  // The variant a Prepare() of `variant` runs for a batch whose history
  // holds `history_token_heads` (token, kv head) pairs on `num_sms` SMs:
  // `variant` itself unless it is kAutoVariant.
  static int ResolveVariant(int variant, long history_token_heads, int num_sms);
  void set_variant(int variant) { variant_ = variant; }
  int variant() const { return variant_; }

  // Whether a batch of this shape runs, under `variant`, the history path
  // that keeps P·V's probabilities in 16-bit fixed point of each chunk's max
  // (variants 8-17 and 19 for D = 128, G = D, at most 4 query heads per kv head): output
  // errors up to ~5e-4 of the output's scale, against ~1e-6 for the other
  // paths (tests/gpu/cuda_attend_test.cc states the tolerances).
  static bool UsesFixedPoint16(int variant, int head_dim, int group_size, int gqa);
  // Whether a batch of this shape runs P·V on the integer tensor cores under
  // `variant` (D = 128, G = D: variants 6-17 and 19 at g <= 4 and at g = 6
  // or 8 with paired heads, set_pair_heads' default; 14 and 19 (and auto)
  // at 5-8 unpaired, with the 8-head warp HistoryWarpIntPv8); other shapes
  // run the float path (HistoryWarp: fp16 / bf16 hi-lo products, the g = 8
  // kernel at 5-8 query heads per kv head), whatever the variant.
  static bool UsesIntegerValueProduct(int variant, int head_dim, int group_size, int gqa);
  // Whether a batch of this shape runs with paired heads when set_pair_heads
  // is on: 6 or 8 query heads per kv head, whose halves (3 or 4 heads) would
  // run the integer P·V path; under auto (18), only batches it counts as
  // light in the kv heads' (token, head) pairs, the heavy ones running the
  // 8-head warp (variant 19). A paired batch then resolves auto in plan
  // heads' pairs (twice as many): B1 64K at 64 q / 8 kv heads on an H200
  // pairs and runs 19. Each kv head then becomes two plan
  // heads (LaunchArgs::head_shift), each unit of the kv heads' plan two
  // blocks that read the same pages (PairHeadUnits): twice the products and
  // the reads from L2, the same bytes from DRAM. The 8-head warp
  // (HistoryWarpIntPv8) loads and dequantizes each chunk once for 8 heads
  // but takes 168 registers (3 blocks per SM); at 64 q / 8 kv heads on an
  // H200 (RESULTS run 28), GPU side: B1 8K 17.8 / 19.2 us (paired / 8-head
  // warp), 32K 25.6 / 27.5, 64K 34.2 / 35.5, 128K 52.8 / 49.4, B8 32K 105.7
  // / 96.5, B8 64K 180.0 / 158.9.
  static bool PairsHeads(int variant, int head_dim, int group_size, int gqa);
  // Paired heads on (the default) or off (6 and 8 query heads per kv head
  // then run as g = 5 and 7 do: the 8-head warp under variants 14 and 19,
  // else the g = 8 float kernel; benchmarks and tests). The environment variable
  // OSCARKV_CUDA_ATTEND_PAIR_HEADS (0 off) sets the initial value. Takes
  // effect at the next Prepare().
  void set_pair_heads(bool on) { pair_heads_ = on; }

  // Blocks per cluster of variant 11's cluster kernel: 8 (the default), 4
  // or 16; other sizes run the default variant. The environment variable
  // OSCARKV_CUDA_ATTEND_CLUSTER_BLOCKS sets the initial value. Takes effect
  // at the next Prepare().
  void set_cluster_blocks(int blocks) { cluster_blocks_ = blocks; }

  // For benchmarks only (the time of each kernel in its place in the call):
  // Launch() enqueues the first `stages` kernels, 1 = prep, 2 = prep and
  // split, 3 = all (the default; with fewer, CopyResults copies whatever the
  // results buffer held). Variant 11's one kernel runs at 2 and 3, nothing
  // at 1.
  // Takes effect at the next Prepare().
  void set_launch_stages(int stages) { stages_ = stages; }
  // For benchmarks only, results are those of the previous call's query:
  // Launch() skips the prep kernel and launches the split kernel plainly
  // (not PDL), so that the split reads the query fragments the last launch
  // left. The call's time without the prep kernel and its hop: what folding
  // the prep into the split could gain at most. Takes effect at the next
  // Prepare().
  void set_skip_prep(bool on) { skip_prep_ = on; }

  // Where the merge kernel writes the outputs: to mapped pinned host memory,
  // over the bus (the default: the service's results go to the host, and a
  // download copy costs a round trip), or, for benchmarks, to device memory
  // (the kernels' time without the bus writes, like a BF16 attention whose
  // output stays on the device; CopyResults then copies them down). Takes
  // effect at the next Prepare().
  void set_results_in_device_memory(bool on) { results_in_device_memory_ = on; }

  // For tests: plan for this many resident split blocks (units in one
  // wave) instead of the device's (0, the default), so that small batches
  // get the long units of large ones. The environment variable
  // OSCARKV_CUDA_ATTEND_WAVE_UNITS sets the initial value. Takes effect at
  // the next Prepare().
  void set_wave_units(long units) { wave_units_ = units; }

  // Where the exact (BF16) blocks run (cuda_attend::FoldExact and
  // SizeAttendUnits; kAuto is the default). For tests and benchmarks; the
  // environment variable OSCARKV_CUDA_ATTEND_FOLD (0 auto, 1 always, 2 never)
  // sets the initial value. Takes effect at the next Prepare().
  void set_fold_exact(cuda_attend::FoldExact mode) { fold_exact_ = mode; }

  // Units cut by arrival rank (cuda_attend::RankShares, attend_claim.cuh):
  // under a flat cut, the unit a block claims weighs 1 - skew x r / (R - 1)
  // of an even one, r = the block's arrival rank on its SM, R = blocks per
  // SM, where the even cut's units are long (set_rank_min_unit_pages). 0
  // turns it off (block b runs unit b, even cuts). Default
  // kDefaultRankSkew; the environment variable OSCARKV_CUDA_ATTEND_RANK_SKEW
  // sets the initial value. Takes effect at the next Prepare().
  static constexpr double kDefaultRankSkew = 0.165;
  void set_rank_skew(double skew) { rank_skew_ = skew; }
  // Rank shares only where the even flat cut's units weigh at least this
  // many pages (cuda_attend::kRankSharePagesPerUnit; environment variable
  // OSCARKV_CUDA_ATTEND_RANK_MIN_PAGES). For tests and benchmarks.
  void set_rank_min_unit_pages(long pages) { rank_min_unit_pages_ = pages; }

  // For benchmarks only, results are wrong: parts of the history loop of
  // variants 0, 3, 5-8 and 11 (D <= 128) to skip, to time the rest in place
  // (bit 1: q·K, bit 2: softmax and P·V, bit 4: the loads after the first
  // two chunks). Variants 12-15 and 19 with bits set run 12's loop order (the
  // load orders of 13-15 are their service loops only); 16 and 17 ignore
  // them.
  // Takes effect at the next Prepare().
  void set_ablate(int bits) { ablate_ = bits; }

  // For benchmarks only: every block of the prep, split and merge kernels
  // records when it passes each cuda_attend::TraceMarkIndex (a few stores
  // per block from thread 0; variant 11's cluster kernel records nothing).
  // TakeTrace waits for `stream`, which must be the stream of the launches,
  // returns the rows the launches since the last take wrote (the latest
  // mark of each) and clears them. Takes effect at the next Prepare().
  void set_trace(bool on) { trace_ = on; }
  absl::StatusOr<AttendTrace> TakeTrace(cudaStream_t stream);

  // Entries (page pointers) of the device array that holds the copies of
  // named page tables (AttendItem::page_table_id; see page_table_cache.h):
  // it starts at `initial` (at least twice the first batch's need) and, when
  // full, doubles up to `max` while the tables in use fill more than half of
  // it (else it is emptied). Batches needing more than `max` copy their
  // tables with the call. Defaults: 256 K entries (2 MiB), at most 32 M
  // (256 MiB). Tests set small sizes. Takes effect at the next Prepare()
  // (which then waits for the device).
  void set_page_table_entries(size_t initial, size_t max) {
    page_table_initial_ = initial;
    page_table_max_ = max;
    table_sizes_changed_ = true;
  }

 private:
  AttendLauncher(int device, int num_sms);
  absl::Status Reserve(size_t staging_bytes, size_t results_bytes, size_t device_bytes);
  // Fills table_plans_ for batch b: where each named page table lives in
  // page_tables_ and what it uploads (grows the array if needed).
  absl::Status PlacePageTables(const AttendBatch& b);
  // A new, empty array of `entries` (waits for the device first).
  absl::Status ResizePageTables(size_t entries);

  int device_;
  int num_sms_;
  int variant_ = kDefaultVariant;
  cuda_attend::FoldExact fold_exact_ = cuda_attend::FoldExact::kAuto;
  int ablate_ = 0;
  bool trace_ = false;
  bool results_in_device_memory_ = false;
  long wave_units_ = 0;
  double rank_skew_ = kDefaultRankSkew;
  long rank_min_unit_pages_ = cuda_attend::kRankSharePagesPerUnit;
  int* claims_ = nullptr;  // [cuda_attend::kClaimSms], zero between launches
  bool pair_heads_ = true;
  // Paired heads: the kv heads' plan, before PairHeadUnits doubles it into
  // the staging buffer.
  std::vector<cuda_attend::WorkUnit> pair_plan_work_;
  std::vector<cuda_attend::HeadPartials> pair_plan_heads_;
  int stages_ = 3;
  bool skip_prep_ = false;
  // Pinned staging of the upload; the workspace (device): the uploaded region,
  // then device-only scratch (query fragments, partials, cluster counts,
  // trace rows); the outputs, in mapped pinned memory that the merge kernel
  // writes. All only grow.
  void* staging_ = nullptr;
  size_t staging_bytes_ = 0;
  unsigned long staging_generation_ = 0;  // counts its allocations
  void* results_ = nullptr;
  void* results_dev_ = nullptr;  // the device's address of results_
  size_t results_bytes_ = 0;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  cudaEvent_t upload_done_ = nullptr;
  // Device copies of named page tables (tables_ says where each one lives).
  const uint8_t** page_tables_ = nullptr;
  size_t page_table_initial_ = size_t(1) << 18;
  size_t page_table_max_ = size_t(1) << 25;
  bool table_sizes_changed_ = false;
  cuda_attend::PageTableCache tables_;
  struct TablePlan {
    bool named = false;  // in page_tables_; else in the upload's page table
    size_t offset = 0;
    int upload_from = 0;
  };
  std::vector<TablePlan> table_plans_;  // per item of the batch being prepared
  // The call's copies (CopyBatchToDevice): the upload, then table updates.
  std::vector<void*> copy_dsts_;
  std::vector<const void*> copy_srcs_;
  std::vector<size_t> copy_sizes_;
  // Resident blocks per SM of each split kernel used so far (by shape and variant).
  std::map<std::pair<int, int>, int> split_blocks_per_sm_;
  // Resident blocks per SM of the 32-dim narrow merge kernel at D 128 (0:
  // not asked yet).
  int merge_blocks_per_sm_ = 0;
  // Blocks per cluster of the cluster kernel, and clusters of each size
  // resident at once (asked once per size).
  int cluster_blocks_ = cuda_attend::kClusterBlocks;
  std::map<int, int> cluster_capacity_;

  // What the last plan (SizeAttendUnits, FillAttendUnits) was made from:
  // its shape and each item's counts. A Prepare with the same inputs
  // reuses its sizes and, when the layout and the staging buffer are the
  // same, its work units and head partials where it wrote them
  // (plan_in_staging_), skipping the planning (~1 us per call per-head, ~5
  // for a flat cut, on the dev VM); the fields that vary per call (the
  // units' exact block references) are written every time. A decode loop
  // keeps its page counts for up to 32 steps.
  struct PlanShape {
    long capacity = 0;
    int kv_heads = 0;
    int fold = 0;
    bool exact_first = false;
    bool flat_cut = false;
    bool paired = false;
    cuda_attend::RankShares shares;
    bool operator==(const PlanShape& o) const {
      return capacity == o.capacity && kv_heads == o.kv_heads && fold == o.fold &&
             exact_first == o.exact_first && flat_cut == o.flat_cut && paired == o.paired &&
             shares == o.shares;
    }
  };
  PlanShape plan_shape_;
  std::vector<std::pair<int, int>> plan_counts_;  // per item: (num_pages, num_exact)
  cuda_attend::UnitSizes plan_sizes_;
  size_t plan_off_work_ = 0, plan_off_heads_ = 0;
  unsigned long plan_staging_generation_ = 0;
  bool plan_in_staging_ = false;

  // The prepared launch.
  struct Prepared;
  std::unique_ptr<Prepared> prepared_;
  AttendSchedule schedule_;
};

// For benchmarks: clusters of the cluster kernel (variant 11, D = 128) that
// fit at once on the current device with `threads` threads per block and
// `cluster_size` blocks per cluster (the multiprocessors of a cluster share
// a GPC).
absl::StatusOr<int> AttendClusterCapacity(int threads, int cluster_size);

// For benchmarks: the smallest step, in ns, of the %globaltimer that
// AttendLauncher::set_trace's timestamps read (measured on the current
// device by one thread reading it in a loop).
absl::StatusOr<double> AttendTraceTimerStepNs();

}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_CUDA_ATTEND_KERNELS_H_
