// How a split-kernel block finds its work unit. Included by attend_kernels.cu
// only.
//
// Without ranks (LaunchArgs::rank_pools 0) block b runs unit b. With R ranks
// the plan has cut unit w to the share of rank w % R (RankShares in
// attend_schedule.h: the units of later ranks lighter), and a block runs the
// unit of its slot (r, s), s·R + r, r its arrival order on SM s: so the
// blocks of one SM end together instead of in the order they started. A
// unit's bits do not depend on the block that runs it, so results stay the
// same from call to call.
#ifndef OSCARKV_KERNELS_CUDA_ATTEND_CLAIM_CUH_
#define OSCARKV_KERNELS_CUDA_ATTEND_CLAIM_CUH_

#include "kernels/cuda/attend_device.cuh"

namespace oscarkv {
namespace cuda_attend {

// A free slot of any SM for a block whose own slot has no unit: by
// compare-and-swap on that SM's count (the number of its slots taken, so
// a slot goes to one block only). Thread 0; rare (fewer units than slots,
// SM ids >= S, more blocks on an SM than ranks). (Inlined: as a call, it
// gave every 128-register split kernel a stack frame of 184-584 bytes.)
__device__ __forceinline__ int ClaimFreeSlot(const LaunchArgs& a) {
  const int R = a.rank_pools, S = a.claim_sms, n = static_cast<int>(gridDim.x);
  for (;;) {
    bool free_seen = false;
    for (int s = 0; s < S; ++s) {
      int c = *reinterpret_cast<volatile int*>(a.claims + s);
      while (c < R && s * R + c < n) {
        free_seen = true;
        const int old = atomicCAS(a.claims + s, c, c + 1);
        if (old == c) return s * R + c;
        c = old;
      }
    }
    if (!free_seen) __trap();  // every slot taken: the counters were not zero
  }
}

// Thread 0 of every block takes the next rank r of its SM s (one atomic)
// and runs unit s·R + r if it exists, else takes a free slot of any SM
// (ClaimFreeSlot). There are as many blocks as units (valid slots) and each
// block takes one slot, so every block finds one and every unit runs once,
// whatever SMs the blocks land on. The counters start at zero
// (AttendLauncher zeroes them once) and the merge kernel zeroes them for
// the next launch (ResetClaims; graph replays too). Counters that did not
// start at zero would leave a block without a unit: it traps (a launch
// error) instead of running a unit twice.
__device__ __forceinline__ int ClaimUnit(const LaunchArgs& a) {
  if (a.rank_pools <= 0) return blockIdx.x;
  __shared__ int claimed;
  if (threadIdx.x == 0) {
    const int R = a.rank_pools, S = a.claim_sms, n = static_cast<int>(gridDim.x);
    unsigned sm;
    asm("mov.u32 %0, %%smid;" : "=r"(sm));
    int unit = -1;
    if (int(sm) < S) {
      const int r = atomicAdd(a.claims + sm, 1);
      if (r < R && int(sm) * R + r < n) unit = int(sm) * R + r;
    }
    if (unit < 0) unit = ClaimFreeSlot(a);
    claimed = unit;
    if (a.trace[kTraceSplit] != nullptr) {
      a.trace[kTraceSplit][size_t(blockIdx.x) * kTraceMarks + kTraceSm] =
          sm | (static_cast<unsigned long long>(unit + 1) << 32);  // 0: unit = block
    }
  }
  __syncthreads();
  return claimed;
}

// The merge kernel's first block, once the split kernel is done (after its
// PDL wait): zeroes the claim counters for the next launch. Stores only, off
// the merge's critical path.
__device__ __forceinline__ void ResetClaims(const LaunchArgs& a) {
  if (a.rank_pools <= 0) return;
  for (int i = threadIdx.x; i < kClaimSms; i += blockDim.x) a.claims[i] = 0;
}

}  // namespace cuda_attend
}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_CUDA_ATTEND_CLAIM_CUH_
