// Host side of the CUDA decode attention: checks a batch, cuts it into work
// units (exact blocks, then history page ranges sized so that the split kernel
// runs in one wave; or variant 11's cluster units), uploads the queries, page
// tables and schedule in one copy from pinned memory (named page tables live
// on the device: only their new pages are copied), and launches; the merge
// kernel (or the cluster kernel) writes the outputs straight into mapped
// pinned memory (no download copy).
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/attend_kernels.h"
#include "kernels/cuda/attend_launch.h"
#include "kernels/cuda/attend_schedule.h"
#include "kernels/cuda/copy_batch.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/status_macros.h"

namespace oscarkv {

using cuda_attend::HeadPartials;
using cuda_attend::ItemPlan;
using cuda_attend::LaunchArgs;
using cuda_attend::LaunchShape;
using cuda_attend::WorkUnit;

struct AttendLauncher::Prepared {
  LaunchArgs args{};
  LaunchShape shape{};
  bool valid = false;  // Prepare succeeded; cleared when the next one starts
  // set_trace: blocks of each kernel (their rows follow each other in the
  // workspace; args.trace[k] is null for a kernel without rows); all 0 when
  // off.
  size_t trace_blocks[cuda_attend::kTraceKernels] = {};
  // set_results_in_device_memory: where the outputs are (else null), and
  // their size.
  const float* device_results = nullptr;
  size_t results_bytes = 0;
};

namespace {

constexpr size_t kAlign = 256;
size_t AlignUp(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

}  // namespace

absl::StatusOr<std::unique_ptr<AttendLauncher>> AttendLauncher::Create(int device) {
  OSCARKV_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  int sms = 0;
  OSCARKV_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  std::unique_ptr<AttendLauncher> l(new AttendLauncher(device, sms));
  // Operators (and the GPU tests) may pick the split-kernel variant.
  if (const char* v = std::getenv("OSCARKV_CUDA_ATTEND_VARIANT")) l->variant_ = std::atoi(v);
  if (const char* v = std::getenv("OSCARKV_CUDA_ATTEND_CLUSTER_BLOCKS")) {
    l->cluster_blocks_ = std::atoi(v);
  }
  if (const char* v = std::getenv("OSCARKV_CUDA_ATTEND_FOLD")) {
    l->fold_exact_ = cuda_attend::FoldExactFromNumber(std::atoi(v));
  }
  if (const char* v = std::getenv("OSCARKV_CUDA_ATTEND_WAVE_UNITS")) l->wave_units_ = std::atol(v);
  if (const char* v = std::getenv("OSCARKV_CUDA_ATTEND_PAIR_HEADS")) {
    l->pair_heads_ = std::atoi(v) != 0;
  }
  if (const char* v = std::getenv("OSCARKV_CUDA_ATTEND_RANK_SKEW")) l->rank_skew_ = std::atof(v);
  if (const char* v = std::getenv("OSCARKV_CUDA_ATTEND_RANK_MIN_PAGES")) {
    l->rank_min_unit_pages_ = std::atol(v);
  }
  // The split kernel's unit claims start at zero; each launch's merge kernel
  // zeroes them again (ResetClaims).
  OSCARKV_CUDA_ALLOC_OR_RETURN(
      l->claims_, cudaMalloc(&l->claims_, sizeof(int) * cuda_attend::kClaimSms),
      "cudaMalloc (attention unit claims)");
  OSCARKV_CUDA_RETURN_IF_ERROR(cudaMemset(l->claims_, 0, sizeof(int) * cuda_attend::kClaimSms));
  OSCARKV_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&l->upload_done_, cudaEventDisableTiming));
  return l;
}

AttendLauncher::AttendLauncher(int device, int num_sms)
    : device_(device), num_sms_(num_sms), prepared_(std::make_unique<Prepared>()) {}

AttendLauncher::~AttendLauncher() {
  cudaSetDevice(device_);
  // Kernels of earlier launches may still use every buffer below.
  cudaDeviceSynchronize();
  if (workspace_ != nullptr) cudaFree(workspace_);
  if (staging_ != nullptr) cudaFreeHost(staging_);
  if (results_ != nullptr) cudaFreeHost(results_);
  if (upload_done_ != nullptr) cudaEventDestroy(upload_done_);
  if (page_tables_ != nullptr) cudaFree(page_tables_);
  if (claims_ != nullptr) cudaFree(claims_);
}

absl::Status AttendLauncher::Reserve(size_t staging_bytes, size_t results_bytes,
                                     size_t device_bytes) {
  if (staging_bytes > staging_bytes_) {
    // Only the upload reads it, and Prepare has waited for that.
    const size_t want = std::max(staging_bytes, staging_bytes_ * 3 / 2);
    if (staging_ != nullptr) OSCARKV_CUDA_RETURN_IF_ERROR(cudaFreeHost(staging_));
    staging_ = nullptr;
    ++staging_generation_;  // its contents (the last plan's units) are gone
    staging_bytes_ = 0;
    OSCARKV_CUDA_ALLOC_OR_RETURN(staging_, cudaHostAlloc(&staging_, want, cudaHostAllocDefault),
                                 "cudaHostAlloc (attention staging)");
    staging_bytes_ = want;
  }
  if (results_bytes > results_bytes_) {
    const size_t want = std::max(results_bytes, results_bytes_ * 3 / 2);
    if (results_ != nullptr) {
      // Kernels of earlier launches may still write their results there.
      OSCARKV_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
      OSCARKV_CUDA_RETURN_IF_ERROR(cudaFreeHost(results_));
    }
    results_ = results_dev_ = nullptr;
    results_bytes_ = 0;
    OSCARKV_CUDA_ALLOC_OR_RETURN(results_, cudaHostAlloc(&results_, want, cudaHostAllocMapped),
                                 "cudaHostAlloc (attention results)");
    void* dev = nullptr;
    if (const cudaError_t err = cudaHostGetDevicePointer(&dev, results_, 0); err != cudaSuccess) {
      cudaFreeHost(results_);
      results_ = nullptr;
      return CudaStatus(err, "cudaHostGetDevicePointer");
    }
    results_dev_ = dev;
    results_bytes_ = want;
  }
  if (device_bytes > workspace_bytes_) {
    const size_t want = std::max(device_bytes, workspace_bytes_ * 3 / 2);
    if (workspace_ != nullptr) {
      // Kernels of earlier launches may still read the old workspace.
      OSCARKV_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
      OSCARKV_CUDA_RETURN_IF_ERROR(cudaFree(workspace_));
    }
    workspace_ = nullptr;
    workspace_bytes_ = 0;
    OSCARKV_CUDA_ALLOC_OR_RETURN(workspace_, cudaMalloc(&workspace_, want),
                                 "cudaMalloc (attention workspace)");
    workspace_bytes_ = want;
  }
  return absl::OkStatus();
}

absl::Status AttendLauncher::Prepare(const AttendBatch& b, cudaStream_t stream) {
  prepared_->valid = false;  // until this one succeeds (its buffers may move)
  OSCARKV_RETURN_IF_ERROR(cuda_attend::CheckAttendBatch(b));
  OSCARKV_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  const PageGeometry& geom = b.geom;
  const int H = geom.kv_heads, D = geom.head_dim, g = b.num_q_heads / H;
  const int n = b.num_items;
  long total_pages = 0, total_exact = 0;
  for (int i = 0; i < n; ++i) {
    total_pages += b.items[i].num_pages;
    total_exact += b.items[i].num_exact;
  }
  // Paired heads (PairsHeads): 6 or 8 query heads per kv head run as two
  // plan heads of 3 or 4 each on the integer kernel (variant 11 runs the
  // default there). Hp plan heads of gp query heads each; the planner cuts
  // the H kv heads and PairHeadUnits doubles every unit. Under auto only
  // light batches pair (counted in kv heads); heavy ones run the 8-head
  // warp (variant 19's kernel): at 64 q / 8 kv heads on an H200 paired
  // heads were 4-8 % faster at B1 8K-64K, the 8-head warp 6-12 % at B1 128K
  // and B8 32K-64K (RESULTS run 28).
  const int plan_variant = variant_ == kClusterVariant ? kDefaultVariant : variant_;
  const bool heavy = plan_variant == kAutoVariant &&
                     ResolveVariant(kAutoVariant, total_pages * geom.page_tokens * H,
                                    num_sms_) == kAutoHeavyVariant;
  const bool paired = pair_heads_ && !heavy && PairsHeads(plan_variant, D, geom.group_size, g);
  const int head_shift = paired ? 1 : 0;
  const int Hp = H << head_shift, gp = g >> head_shift;

  LaunchShape shape;
  shape.head_dim = D;
  shape.groups = D / geom.group_size;
  shape.g8 = gp > 4;
  shape.num_items = n;
  shape.kv_heads = H;
  shape.hq = b.num_q_heads;
  const long history_token_heads = total_pages * geom.page_tokens * Hp;
  shape.variant = ResolveVariant(variant_, history_token_heads, num_sms_);
  shape.stages = stages_;
  shape.skip_prep = skip_prep_;
  // Variant 11: one cluster kernel with as many clusters per (item, kv
  // head) as fit at once for all of them; else the default variant's three
  // kernels.
  int clusters_per_head = 0;
  if (variant_ == kClusterVariant && D == 128 && shape.groups == 1 && !shape.g8 && !paired) {
    shape.cluster_blocks = cluster_blocks_;
    auto known_capacity = cluster_capacity_.find(cluster_blocks_);
    if (known_capacity == cluster_capacity_.end()) {
      OSCARKV_ASSIGN_OR_RETURN(const int clusters, cuda_attend::ClusterCapacity(shape));
      known_capacity = cluster_capacity_.emplace(cluster_blocks_, clusters).first;
    }
    const long heads = long(n) * H;
    clusters_per_head = heads > 0 ? static_cast<int>(std::min<long>(
                                        cuda_attend::kMaxClustersPerHead,
                                        known_capacity->second / heads))
                                  : 1;
    if (clusters_per_head < 1) shape.cluster_blocks = 0;
  }
  if (variant_ == kClusterVariant && shape.cluster_blocks == 0) {
    shape.variant = ResolveVariant(kDefaultVariant, history_token_heads, num_sms_);
  }

  // Work units: exact-only units first (short), then history ranges (which
  // may carry exact blocks) sized so that all units fit in one wave of
  // resident blocks (attend_schedule.h).
  // A batch of the last plan's inputs (plan_shape_, plan_counts_) reuses
  // it: its sizes, and its units and head partials where it left them in
  // the staging buffer (checked below, once the layout is known).
  const bool had_plan = plan_in_staging_;
  plan_in_staging_ = false;  // until this Prepare's plan is in place
  bool same_plan = false;
  cuda_attend::UnitSizes cluster_sizes;
  const cuda_attend::UnitSizes* sizes_ptr = &plan_sizes_;
  if (shape.cluster_blocks > 0) {
    cluster_sizes.history_units = long(n) * H * clusters_per_head * shape.cluster_blocks;
    // Each cluster's result of both sets (normalized o, then the base-2
    // LSE, in a partial's slot), when the clusters of a head meet in memory.
    cluster_sizes.partials = clusters_per_head > 1 ? 2L * n * H * clusters_per_head : 0;
    sizes_ptr = &cluster_sizes;
  } else {
    // Resident split blocks per SM: a driver query, asked once per kernel.
    const std::pair<int, int> kernel_key{(D * 8 + shape.groups) * 2 + (shape.g8 ? 1 : 0),
                                         shape.variant};
    auto known = split_blocks_per_sm_.find(kernel_key);
    if (known == split_blocks_per_sm_.end()) {
      OSCARKV_ASSIGN_OR_RETURN(const int blocks, cuda_attend::SplitBlocksPerSm(shape));
      known = split_blocks_per_sm_.emplace(kernel_key, blocks).first;
    }
    const long wave =
        wave_units_ > 0 ? wave_units_ : std::max<long>(1, long(known->second) * num_sms_);
    // Paired heads: each unit of the kv heads' plan takes two blocks.
    const long capacity = std::max<long>(1, wave >> head_shift);
    OSCARKV_ASSIGN_OR_RETURN(const bool exact_first, cuda_attend::HasExactFirstKernel(shape));
    // Rank shares need the blocks of a unit's rank to be the plan's units
    // (not paired heads' halves) and a claim counter per SM.
    cuda_attend::RankShares shares;
    if (!paired && known->second >= 2 && known->second <= cuda_attend::kMaxRankPools &&
        num_sms_ <= cuda_attend::kClaimSms) {
      shares = cuda_attend::RankShares{known->second, rank_skew_, rank_min_unit_pages_};
    }
    if (!shares.active()) shares = cuda_attend::RankShares{};
    const PlanShape plan_shape{capacity, H, static_cast<int>(fold_exact_), exact_first,
                               cuda_attend::HasTwoHeadKernel(shape), paired, shares};
    auto counts = [&](int i) { return std::make_pair(b.items[i].num_pages, b.items[i].num_exact); };
    same_plan = had_plan && plan_shape == plan_shape_ && plan_counts_.size() == size_t(n);
    for (int i = 0; same_plan && i < n; ++i) same_plan = plan_counts_[i] == counts(i);
    if (!same_plan) {
      plan_shape_ = plan_shape;
      plan_counts_.resize(n);
      for (int i = 0; i < n; ++i) plan_counts_[i] = counts(i);
      plan_sizes_ = cuda_attend::SizeAttendUnits(b.items, n, H, capacity, fold_exact_, exact_first,
                                                 plan_shape.flat_cut, shares);
    }
    shape.exact_first = plan_sizes_.fold_exact && exact_first;
  }
  const cuda_attend::UnitSizes& sizes = *sizes_ptr;
  // Units and partials of the plan heads (twice the kv heads' plan when paired).
  const long num_work = sizes.num_work() << head_shift;
  const long num_partials = sizes.partials << head_shift;
  // The merge kernel addresses the partials with 32-bit float offsets.
  const long partial_floats = num_partials * static_cast<long>(cuda_attend::PartialFloats(gp, D));
  if (num_work > (1L << 30) || partial_floats >= (1L << 31) || total_pages > (1L << 30)) {
    return absl::InvalidArgumentError("attention batch too large for one launch");
  }
  // Named page tables have device copies: only their new entries are
  // uploaded (into the array, after the main upload); the others go into the
  // upload's page table. Until this Prepare succeeds, the cache's record of
  // what is on the device is ahead of the copies: forget it on any failure.
  schedule_.page_tables_cleared = 0;
  schedule_.page_tables_grown = 0;
  bool tables_committed = false;
  struct ForgetTablesUnlessCommitted {
    bool& committed;
    cuda_attend::PageTableCache& tables;
    ~ForgetTablesUnlessCommitted() {
      if (!committed) tables.Clear();
    }
  } forget_tables{tables_committed, tables_};
  OSCARKV_RETURN_IF_ERROR(PlacePageTables(b));
  long table_pages = 0, new_entries = 0;
  for (int i = 0; i < n; ++i) {
    const TablePlan& tp = table_plans_[i];
    if (tp.named) {
      new_entries += b.items[i].num_pages - tp.upload_from;
    } else {
      table_pages += b.items[i].num_pages;
    }
  }

  // Layout: [items][page table][exact blocks][work][head partials][queries]
  // (uploaded from the staging buffer), then [qfrag][qmeta][partials]
  // [results, with set_results_in_device_memory][cluster counts][trace]
  // (device only).
  // The outputs, [item][Hq * D + Hq] floats (out, then lse), go to the mapped
  // pinned results buffer, written by the merge kernel over the bus (a few
  // KB per item: cheaper than a download copy's round trip), or to the
  // workspace's results.
  const int nt = gp > 4 ? 2 : 1;
  const size_t q_floats = size_t(b.num_q_heads) * D;
  const size_t result_floats = q_floats + b.num_q_heads;  // out, then lse
  const size_t off_items = 0;
  const size_t off_pages = AlignUp(off_items + sizeof(ItemPlan) * n);
  const size_t off_exact = AlignUp(off_pages + sizeof(void*) * table_pages);
  const size_t off_work = AlignUp(off_exact + sizeof(ExactBlockRef) * total_exact);
  const size_t off_heads = AlignUp(off_work + sizeof(WorkUnit) * num_work);
  const size_t off_q = AlignUp(off_heads + sizeof(HeadPartials) * n * Hp);
  const size_t upload = AlignUp(off_q + size_t(n) * q_floats * 4);
  // Staging only: the new entries of named tables, copied into the array.
  const size_t off_updates = upload;
  const size_t staging_bytes = off_updates + sizeof(void*) * new_entries;
  const size_t results_bytes = size_t(n) * result_floats * 4;
  const size_t off_qfrag = upload;
  const size_t off_qmeta = AlignUp(off_qfrag + size_t(n) * Hp * nt * (D / 16) * 2 * 32 * 4);
  const size_t off_part =
      AlignUp(off_qmeta + size_t(n) * b.num_q_heads * cuda_attend::kQueryMetaFloats * 4);
  // set_results_in_device_memory: the outputs in the workspace instead.
  const size_t off_results = AlignUp(off_part + size_t(partial_floats) * 4);
  const size_t device_results_bytes = results_in_device_memory_ ? results_bytes : 0;
  const size_t off_counts = AlignUp(off_results + device_results_bytes);
  const size_t counts_bytes =
      shape.cluster_blocks > 0 && clusters_per_head > 1 ? sizeof(unsigned) * n * H : 0;
  // set_trace: one row per block of each kernel (none for the cluster kernel).
  size_t trace_blocks[cuda_attend::kTraceKernels] = {};
  if (trace_ && shape.cluster_blocks == 0) {
    trace_blocks[cuda_attend::kTracePrep] = size_t(n) * b.num_q_heads;
    trace_blocks[cuda_attend::kTraceSplit] = size_t(num_work);
    trace_blocks[cuda_attend::kTraceMerge] = size_t(n) * b.num_q_heads * (D / 32);
  }
  const size_t trace_words =
      std::accumulate(std::begin(trace_blocks), std::end(trace_blocks), size_t{0}) *
      cuda_attend::kTraceMarks;
  const size_t off_trace = AlignUp(off_counts + counts_bytes);
  const size_t total = AlignUp(off_trace + trace_words * sizeof(unsigned long long));

  // The staging buffer may still feed the previous upload.
  OSCARKV_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(upload_done_));
  OSCARKV_RETURN_IF_ERROR(Reserve(staging_bytes, results_bytes, total));
  auto* host = static_cast<uint8_t*>(staging_);
  auto* dev = static_cast<uint8_t*>(workspace_);
  auto* items = reinterpret_cast<ItemPlan*>(host + off_items);
  auto* pages = reinterpret_cast<const uint8_t**>(host + off_pages);
  auto* exact = reinterpret_cast<ExactBlockRef*>(host + off_exact);
  auto* work = reinterpret_cast<WorkUnit*>(host + off_work);
  auto* heads = reinterpret_cast<HeadPartials*>(host + off_heads);
  auto* queries = reinterpret_cast<float*>(host + off_q);
  auto* updates = reinterpret_cast<const uint8_t**>(host + off_updates);
  auto* dev_queries = reinterpret_cast<float*>(dev + off_q);
  auto* dev_results = results_in_device_memory_ ? reinterpret_cast<float*>(dev + off_results)
                                                : static_cast<float*>(results_dev_);

  // Misaligned, or null: 0 - 1 wraps to the top bit (which no user-space
  // or device address has).
  auto bad_page = [](const uint8_t* pg) {
    const auto addr = reinterpret_cast<uintptr_t>(pg);
    return (addr & 7u) | ((addr - 1) >> 63);
  };
  // Copies `count` page pointers to `dst` (host), then checks them in one
  // branch-free pass (a 128K-token item has 4096 pages).
  auto copy_pages = [&](const uint8_t** dst, const uint8_t* const* src, int count, int item,
                        int first) -> absl::Status {
    std::memcpy(dst, src, sizeof(void*) * count);
    uintptr_t bad = 0;
    for (int p = 0; p < count; ++p) bad |= bad_page(dst[p]);
    if (bad == 0) return absl::OkStatus();
    int p = 0;
    while (p + 1 < count && bad_page(src[p]) == 0) ++p;
    return absl::InvalidArgumentError(absl::StrCat("attention item ", item, " page ", first + p,
                                                   " is null or not 8-byte aligned"));
  };
  // The call's copies: the upload (entry 0, sized below), then the new
  // entries of named tables; one driver call.
  long page_pos = 0, exact_pos = 0, update_pos = 0;
  copy_dsts_.assign(1, dev);
  copy_srcs_.assign(1, host);
  copy_sizes_.assign(1, 0);
  for (int i = 0; i < n; ++i) {
    const AttendItem& it = b.items[i];
    ItemPlan& ip = items[i];
    ip = ItemPlan{};
    // The kernels do not check their inputs: a non-finite query is refused here.
    if (const absl::Status s = ValidateQuery(it.q, q_floats); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("attention item ", i, ": ", s.message()));
    }
    std::memcpy(queries + i * q_floats, it.q, q_floats * sizeof(float));
    ip.q = dev_queries + i * q_floats;
    ip.out = dev_results + i * result_floats;
    ip.lse = it.lse != nullptr ? ip.out + q_floats : nullptr;
    ip.rotation = it.rotation;
    ip.exact = reinterpret_cast<const ExactBlockRef*>(dev + off_exact) + exact_pos;
    ip.num_pages = it.num_pages;
    ip.num_exact = it.num_exact;
    const TablePlan& tp = table_plans_[i];
    if (tp.named) {
      ip.pages = page_tables_ + tp.offset;
      const int from = tp.upload_from, count = it.num_pages - tp.upload_from;
      if (count > 0) {
        OSCARKV_RETURN_IF_ERROR(copy_pages(updates + update_pos, it.pages + from, count, i, from));
        copy_dsts_.push_back(page_tables_ + tp.offset + from);
        copy_srcs_.push_back(updates + update_pos);
        copy_sizes_.push_back(sizeof(void*) * count);
        update_pos += count;
      }
    } else {
      ip.pages = reinterpret_cast<const uint8_t* const*>(dev + off_pages) + page_pos;
      if (it.num_pages > 0) {
        OSCARKV_RETURN_IF_ERROR(copy_pages(pages + page_pos, it.pages, it.num_pages, i, 0));
      }
      page_pos += it.num_pages;
    }
    if (it.num_exact > 0) std::memcpy(exact + exact_pos, it.exact, sizeof(ExactBlockRef) * it.num_exact);
    exact_pos += it.num_exact;
  }
  bool plan_reused = false;
  if (shape.cluster_blocks > 0) {
    cuda_attend::FillClusterUnits(b.items, n, H, shape.cluster_blocks, clusters_per_head, work);
  } else {
    // The last plan's units and head partials are still in place when
    // nothing moved them: same inputs, offsets and staging buffer.
    plan_reused = same_plan && off_work == plan_off_work_ && off_heads == plan_off_heads_ &&
                  staging_generation_ == plan_staging_generation_;
    if (!plan_reused && paired) {
      // The kv heads' plan, then each unit twice (PairHeadUnits).
      pair_plan_work_.resize(sizes.num_work());
      pair_plan_heads_.resize(size_t(n) * H);
      cuda_attend::FillAttendUnits(sizes, b.items, n, H, pair_plan_work_.data(),
                                   pair_plan_heads_.data());
      cuda_attend::PairHeadUnits(pair_plan_work_.data(), sizes.num_work(),
                                 pair_plan_heads_.data(), n, H, sizes.partials, work, heads);
    } else if (!plan_reused) {
      cuda_attend::FillAttendUnits(sizes, b.items, n, H, work, heads);
    }
    plan_off_work_ = off_work;
    plan_off_heads_ = off_heads;
    plan_staging_generation_ = staging_generation_;
    plan_in_staging_ = true;
  }
  int second_parts = 0, next_head_exact = 0;
  for (long u = 0; u < num_work; ++u) {
    WorkUnit& wu = work[u];
    wu.exact = wu.exact_end > wu.exact_begin ? items[wu.item].exact + wu.exact_begin : nullptr;
    wu.first_exact = wu.exact != nullptr ? b.items[wu.item].exact[wu.exact_begin] : ExactBlockRef{};
    second_parts += wu.next_partial >= 0;
    next_head_exact += wu.exact != nullptr && wu.exact_head != wu.kv_head;
  }
  // The cluster kernel has no merge kernel and no head partials.
  int max_splits = 0;
  for (long ih = 0; shape.cluster_blocks == 0 && ih < long(n) * Hp; ++ih) {
    max_splits = std::max(max_splits, heads[ih].hist_count + heads[ih].exact_count);
  }
  shape.wide_merge = max_splits > cuda_attend::kWarps * cuda_attend::MergeBatch(D, false);
  // 64-dim merge slices when the 32-dim grid would take two waves (B8 at
  // D 128 on an H200: 1024 blocks, 4 per SM). The trace kept room for the
  // 32-dim grid; the merge's rows come last, so fewer blocks move nothing.
  if (!shape.wide_merge && D == 128 && shape.cluster_blocks == 0 && shape.stages >= 3) {
    if (merge_blocks_per_sm_ == 0) {
      OSCARKV_ASSIGN_OR_RETURN(merge_blocks_per_sm_, cuda_attend::MergeBlocksPerSm());
    }
    const long grid32 = long(n) * b.num_q_heads * (D / 32);
    shape.merge_slice = grid32 > long(merge_blocks_per_sm_) * num_sms_ ? 64 : 32;
  }
  if (trace_blocks[cuda_attend::kTraceMerge] > 0) {
    trace_blocks[cuda_attend::kTraceMerge] = size_t(n) * b.num_q_heads * (D / shape.merge_slice);
  }
  const int w = static_cast<int>(num_work);
  copy_sizes_[0] = upload;
  OSCARKV_RETURN_IF_ERROR(CopyBatchToDevice(copy_dsts_.data(), copy_srcs_.data(),
                                            copy_sizes_.data(), copy_dsts_.size(), stream));
  OSCARKV_CUDA_RETURN_IF_ERROR(cudaEventRecord(upload_done_, stream));
  tables_committed = true;
  // The cluster kernel's counts start at zero; each launch leaves them so.
  if (counts_bytes > 0) {
    OSCARKV_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dev + off_counts, 0, counts_bytes, stream));
  }
  // Marks a block does not pass stay 0.
  if (trace_words > 0) {
    OSCARKV_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(
        dev + off_trace, 0, trace_words * sizeof(unsigned long long), stream));
  }

  shape.num_work = w;
  LaunchArgs& a = prepared_->args;
  a.items = reinterpret_cast<const ItemPlan*>(dev + off_items);
  a.work = reinterpret_cast<const WorkUnit*>(dev + off_work);
  a.head_partials = reinterpret_cast<const HeadPartials*>(dev + off_heads);
  a.geom = geom;
  a.g = gp;
  a.head_shift = head_shift;
  // Units claimed by arrival rank where the plan cut them by it (else block
  // b runs unit b), when a slot (rank, SM) exists for every unit: one wave.
  const bool rank_cut = shape.cluster_blocks == 0 && sizes.rank_shares &&
                        num_work <= long(plan_shape_.shares.pools) * num_sms_;
  a.rank_pools = rank_cut ? plan_shape_.shares.pools : 0;
  a.claim_sms = num_sms_;
  a.claims = claims_;
  a.hq = b.num_q_heads;
  a.scale_log2 = b.scale * 1.4426950408889634f;
  a.ablate = ablate_;
  a.qfrag = reinterpret_cast<uint32_t*>(dev + off_qfrag);
  a.qmeta = reinterpret_cast<float*>(dev + off_qmeta);
  a.partials = reinterpret_cast<float*>(dev + off_part);
  a.clusters_per_head = clusters_per_head;
  a.cluster_counts = reinterpret_cast<unsigned*>(dev + off_counts);
  a.queries = dev_queries;
  // One rotation for every item (the usual one-layer batch): the prep
  // kernel skips reading the item plans. Only when some item has history,
  // the only case in which the batch's rotation must be valid.
  a.rotation = RotationRef{};
  if (n > 0 && total_pages > 0 && b.items[0].rotation.r_k != nullptr &&
      b.items[0].rotation.r_v != nullptr) {
    bool same = true;
    for (int i = 1; i < n && same; ++i) {
      const RotationRef& r = b.items[i].rotation;
      same = r.r_k == b.items[0].rotation.r_k && r.r_v == b.items[0].rotation.r_v &&
             r.stride == b.items[0].rotation.stride;
    }
    if (same) a.rotation = b.items[0].rotation;
  }
  auto* trace_rows = reinterpret_cast<unsigned long long*>(dev + off_trace);
  for (int k = 0; k < cuda_attend::kTraceKernels; ++k) {
    prepared_->trace_blocks[k] = trace_blocks[k];
    a.trace[k] = trace_blocks[k] > 0 ? trace_rows : nullptr;
    trace_rows += trace_blocks[k] * cuda_attend::kTraceMarks;
  }
  prepared_->shape = shape;
  prepared_->device_results = results_in_device_memory_ ? dev_results : nullptr;
  prepared_->results_bytes = results_bytes;
  prepared_->valid = true;

  schedule_.num_items = n;
  schedule_.exact_units = static_cast<int>(sizes.exact_units << head_shift);
  schedule_.history_units = static_cast<int>(sizes.history_units << head_shift);
  schedule_.pages_per_unit = static_cast<int>(sizes.pages_per_unit);
  schedule_.partials = static_cast<int>(num_partials);
  schedule_.upload_bytes = upload + sizeof(void*) * new_entries;
  schedule_.pages_uploaded = table_pages + new_entries;
  schedule_.clusters_per_head = shape.cluster_blocks > 0 ? clusters_per_head : 0;
  schedule_.variant = shape.variant;
  schedule_.integer_pv =
      cuda_attend::RunsIntegerValueProduct(shape.variant, D, shape.groups, shape.g8);
  schedule_.paired_heads = paired;
  schedule_.merge_slice = shape.merge_slice;
  schedule_.flat_cut = sizes.flat;
  schedule_.rank_pools = a.rank_pools;
  schedule_.rank_skew = rank_cut ? plan_shape_.shares.skew : 0.0;
  schedule_.plan_reused = plan_reused ? 1 : 0;
  schedule_.second_parts = second_parts;
  schedule_.next_head_exact = next_head_exact;
  schedule_.cluster_blocks = shape.cluster_blocks;
  return absl::OkStatus();
}

absl::Status AttendLauncher::ResizePageTables(size_t entries) {
  if (page_tables_ != nullptr) {
    // Kernels of earlier launches may still read the old array.
    OSCARKV_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
    OSCARKV_CUDA_RETURN_IF_ERROR(cudaFree(page_tables_));
    page_tables_ = nullptr;
  }
  tables_.Reset(0);
  void* mem = nullptr;
  OSCARKV_CUDA_ALLOC_OR_RETURN(mem, cudaMalloc(&mem, sizeof(void*) * entries),
                               "cudaMalloc (attention page tables)");
  page_tables_ = static_cast<const uint8_t**>(mem);
  tables_.Reset(entries);
  return absl::OkStatus();
}

absl::Status AttendLauncher::PlacePageTables(const AttendBatch& b) {
  using cuda_attend::PageTableCache;
  const int n = b.num_items;
  table_plans_.assign(n, TablePlan{});
  size_t need = 0;
  for (int i = 0; i < n; ++i) {
    const AttendItem& it = b.items[i];
    if (it.page_table_id != 0 && it.num_pages > 0) need += PageTableCache::CapacityFor(it.num_pages);
  }
  if (need == 0) return absl::OkStatus();
  // Too big for the largest array allowed: uploaded with the call.
  if (need > page_table_max_) return absl::OkStatus();
  // The first array, or a new one after set_page_table_entries: the initial
  // size, and at least twice what this batch needs.
  if (page_tables_ == nullptr || table_sizes_changed_) {
    size_t want = std::max<size_t>(page_table_initial_, PageTableCache::kMinEntries);
    while (want < 2 * need && want < page_table_max_) want *= 2;
    OSCARKV_RETURN_IF_ERROR(ResizePageTables(std::min(want, page_table_max_)));
    table_sizes_changed_ = false;
  }
  for (int attempt = 0; attempt < 2; ++attempt) {
    bool placed_all = true;
    for (int i = 0; i < n && placed_all; ++i) {
      const AttendItem& it = b.items[i];
      if (it.page_table_id == 0 || it.num_pages <= 0) continue;
      const auto p = tables_.Place(it.page_table_id,
                                   reinterpret_cast<const void* const*>(it.pages), it.num_pages);
      if (p.has_value()) {
        table_plans_[i] = TablePlan{true, p->offset, p->upload_from};
      } else {
        placed_all = false;
      }
    }
    if (placed_all) return absl::OkStatus();
    // Full: a larger array if the tables in use need one (every layer of
    // every sequence decoded has its own), else this one emptied; then the
    // batch is placed again (it fits: need <= capacity), its tables whole.
    const size_t grown = tables_.CapacityWhenFull(need, page_table_max_);
    if (grown > tables_.capacity()) {
      OSCARKV_RETURN_IF_ERROR(ResizePageTables(grown));
      schedule_.page_tables_grown = 1;
    } else {
      tables_.Clear();
      schedule_.page_tables_cleared = 1;
    }
    table_plans_.assign(n, TablePlan{});
  }
  return absl::InternalError("page tables do not fit an emptied array");
}

absl::Status AttendLauncher::Launch(cudaStream_t stream) const {
  if (!prepared_->valid) {
    return absl::FailedPreconditionError("attention launch without a successful Prepare");
  }
  return cuda_attend::LaunchAttention(prepared_->args, prepared_->shape, stream);
}

absl::StatusOr<AttendTrace> AttendLauncher::TakeTrace(cudaStream_t stream) {
  if (!prepared_->valid) {
    return absl::FailedPreconditionError("attention trace without a successful Prepare");
  }
  AttendTrace t;
  OSCARKV_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  // The kernels' rows follow each other from the first non-null one.
  unsigned long long* first = nullptr;
  size_t total = 0;
  for (int k = 0; k < cuda_attend::kTraceKernels; ++k) {
    const size_t words = prepared_->trace_blocks[k] * cuda_attend::kTraceMarks;
    if (words == 0) continue;
    if (first == nullptr) first = prepared_->args.trace[k];
    total += words;
    t.rows[k].resize(words);
    OSCARKV_CUDA_RETURN_IF_ERROR(cudaMemcpy(t.rows[k].data(), prepared_->args.trace[k],
                                            words * sizeof(unsigned long long),
                                            cudaMemcpyDeviceToHost));
  }
  if (total > 0) {
    OSCARKV_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(first, 0, total * sizeof(unsigned long long), stream));
  }
  return t;
}

absl::Status AttendLauncher::CopyResults(const AttendBatch& b) const {
  if (!prepared_->valid) {
    return absl::FailedPreconditionError("attention results without a successful Prepare");
  }
  if (prepared_->device_results != nullptr) {
    OSCARKV_CUDA_RETURN_IF_ERROR(cudaMemcpy(results_, prepared_->device_results,
                                            prepared_->results_bytes, cudaMemcpyDeviceToHost));
  }
  const size_t q_floats = size_t(b.num_q_heads) * b.geom.head_dim;
  const size_t result_floats = q_floats + b.num_q_heads;
  const auto* results = static_cast<const float*>(results_);
  for (int i = 0; i < b.num_items; ++i) {
    const AttendItem& it = b.items[i];
    const float* r = results + i * result_floats;
    std::memcpy(it.out, r, q_floats * sizeof(float));
    if (it.lse != nullptr) std::memcpy(it.lse, r + q_floats, b.num_q_heads * sizeof(float));
  }
  return absl::OkStatus();
}

}  // namespace oscarkv
