// Internal: the kernel launches of one decode-attention call (attend_kernels.cu),
// used by AttendLauncher (attend_launcher.cu). Not a public header.
#ifndef OSCARKV_KERNELS_CUDA_ATTEND_LAUNCH_H_
#define OSCARKV_KERNELS_CUDA_ATTEND_LAUNCH_H_

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/cuda/attend_device.cuh"

namespace oscarkv {
namespace cuda_attend {

struct LaunchShape {
  int head_dim = 0;
  int groups = 0;   // D / G: 1, 2 or 4
  bool g8 = false;  // more than 4 query heads per kv head
  int num_items = 0;
  int num_work = 0;
  int kv_heads = 0;
  int hq = 0;
  int variant = 0;  // split-kernel variant: set by AttendLauncher::Prepare (set_variant)
  int stages = 3;   // kernels enqueued: 1 = prep, 2 = + split, 3 = + merge (all)
  // Benchmarks only (AttendLauncher::set_skip_prep): no prep kernel; the
  // split kernel, launched plainly, reads the fragments the last call left.
  bool skip_prep = false;
  bool wide_merge = false;  // MergeBatch(head_dim, true): some kv head has many partials
  // Output dims per merge block: 32, or 64 (D = 128, not wide_merge) when
  // the grid of 32-dim blocks would not be resident at once.
  int merge_slice = 32;
  // The plan folds the exact blocks onto the history units (UnitSizes::
  // fold_exact): variants 8, 12-17 and 19 then run their exact-first kernels.
  bool exact_first = false;
  // > 0: one cluster kernel (attend_cluster.cuh) with clusters of this many
  // blocks instead of the three kernels.
  int cluster_blocks = 0;
};

// Prep, split-KV and merge kernels, or the cluster kernel (shape.cluster_blocks
// > 0), enqueued on `stream`.
absl::Status LaunchAttention(const LaunchArgs& args, const LaunchShape& shape,
                             cudaStream_t stream);

// Whether this shape's split kernel under shape.variant runs folded exact
// blocks before the pages (the default variant at D 128, one group, at most
// 4 query heads per kv head): the launcher's kernel choice itself, asked
// without the device. SizeAttendUnits plans folding by it.
absl::StatusOr<bool> HasExactFirstKernel(const LaunchShape& shape);

// Whether this shape's split kernel under shape.variant runs units of two
// kv heads (variant 19 at D 128, one group: HistoryWarpIntPv at most 4
// query heads per kv head, HistoryWarpIntPv8 at more), so that
// SizeAttendUnits may cut the history flat.
bool HasTwoHeadKernel(const LaunchShape& shape);

// Whether the split kernel of `variant` runs P·V on the integer tensor
// cores at D = head_dim, `groups` quantization groups, and at most 4 query
// heads per (plan) head (HistoryWarpIntPv) or, with g8, 5-8
// (HistoryWarpIntPv8).
bool RunsIntegerValueProduct(int variant, int head_dim, int groups, bool g8);

// Resident blocks per multiprocessor of the split kernel for this shape.
absl::StatusOr<int> SplitBlocksPerSm(const LaunchShape& shape);

// Resident blocks per multiprocessor of the narrow merge kernel with 32-dim
// slices at D 128 (the only head dim with 64-dim slices).
absl::StatusOr<int> MergeBlocksPerSm();

// Clusters of the cluster kernel with shape.cluster_blocks blocks each
// resident at once for this shape (0: no such kernel for the shape).
absl::StatusOr<int> ClusterCapacity(const LaunchShape& shape);

}  // namespace cuda_attend
}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_CUDA_ATTEND_LAUNCH_H_
