// Host-only planning of a batched decode-attention call: how the batch is cut
// into work units (one thread block each) and where each unit's partial
// result goes. Pure functions; used by AttendLauncher, tested on the CPU.
#ifndef OSCARKV_KERNELS_CUDA_ATTEND_SCHEDULE_H_
#define OSCARKV_KERNELS_CUDA_ATTEND_SCHEDULE_H_

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "kernels/cuda/attend_plan.h"

namespace oscarkv {
namespace cuda_attend {

// Checks a batch against the backend contract and this implementation's
// limits: INVALID_ARGUMENT for bad input (null pointers, counts, token counts
// outside [0, P], unaligned blocks), UNIMPLEMENTED for shapes the CUDA kernels
// do not cover (more than 8 query heads per kv head, G < D/4, P not a multiple
// of 32). Page pointers are checked while they are copied (AttendLauncher).
absl::Status CheckAttendBatch(const AttendBatch& batch);

struct UnitSizes {
  long exact_per_unit = 1;  // sink / recent blocks per exact unit
  long pages_per_unit = 1;  // history pages per history unit
  long exact_units = 0;
  long history_units = 0;
  long num_work() const { return exact_units + history_units; }
};

// History is "light" when the history units would hold at most this many
// pages each in one full wave.
inline constexpr long kLightPagesPerUnit = 16;

// Sizes the units so that they fit in one wave of `capacity` resident
// blocks: exact units (item, kv head, up to exact_per_unit blocks) take at
// most capacity / 4 when the history is light, else capacity / 8, where the
// batch allows; history units (item, kv head, up to pages_per_unit pages)
// the rest, at least capacity / 2. (H200, 2026-11-29: capacity / 4 for all
// shapes took B1 8K from 23.6 to 19.7 us but B1 128K from 57.0 to 61.5 us.)
UnitSizes SizeAttendUnits(const AttendItem* items, int num_items, int kv_heads, long capacity);

// Writes sizes.num_work() units into `work`: every item's exact units (kv head
// major), then every item's history units; unit u writes partial u. Sets the
// partial ranges of plans[i] (exact_begin, exact_splits, hist_begin,
// hist_splits) and leaves its other fields alone.
void FillAttendUnits(const UnitSizes& sizes, const AttendItem* items, int num_items,
                     int kv_heads, WorkUnit* work, ItemPlan* plans);

}  // namespace cuda_attend
}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_CUDA_ATTEND_SCHEDULE_H_
