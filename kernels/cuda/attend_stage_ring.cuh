// A per-warp ring of shared-memory stages that the Hopper bulk-copy engine
// (TMA, cp.async.bulk) fills with whole 32-token chunks of history pages,
// several chunks ahead of the warp's math (split-kernel variant 10).
// Included by attend_kernels.cu only.
//
// Why: the register double buffer of variant 8 keeps one chunk (2.3 KB at
// D 128) in flight per warp, ~27 KB per SM at 11-12 warps. A ring of S
// stages keeps S - 1 chunks in flight while one is consumed, and the copies
// cost one instruction per chunk on one lane instead of 20 loads per lane.
// Measured (H200, 2026-11-30, tests/bench/RESULTS.md run 15): the loads
// alone (benchmark ablation 3) stream 10 % faster than variant 8's (B8 64K
// 77 % of copy against 69 %), but the whole loop gains at most 3 %: the
// stages arrive in time (~3 % of stall samples on the full barrier), and lane
// 0's refill in the consumer warps costs 46 instructions and ~14 % of the
// samples per chunk (a divergent branch; ptxas loops the copy over an
// elected lane). Kept, not the default, as the load path for a
// warp-specialized loop: a producer warp issuing every warp's copies.
//
// Protocol, per warp and stage s (sm_90, sm_90 PTX ISA 8.0):
//   full[s]  (count 1): lane 0 arms it with the stage's byte count and issues
//            the bulk copies, whose completion the barrier counts; all lanes
//            wait on its phase before reading the stage.
//   empty[s] (count 32): every lane arrives once it no longer needs the
//            stage's bytes (its reads are consumed); lane 0 waits on it
//            before refilling the stage. This orders the lanes' generic-proxy
//            reads before the copy engine's writes (the pattern of CUTLASS's
//            TMA pipelines).
// Stage layout mirrors one kv head's part of a page, for one chunk:
// [K codes 32·D/4][K params 32·NG·4][V codes 32·D/4][V params 32·NG·4]. With
// 32-token pages (one chunk per page) that is one contiguous run of the page
// and one copy; longer pages take four copies.
#ifndef OSCARKV_KERNELS_CUDA_ATTEND_STAGE_RING_CUH_
#define OSCARKV_KERNELS_CUDA_ATTEND_STAGE_RING_CUH_

#include <cstdint>

#include "kernels/cuda/attend_device.cuh"
#include "kernels/cuda/mbarrier.cuh"

namespace oscarkv {
namespace cuda_attend {

// Copies `bytes` (a multiple of 16; both addresses 16-byte aligned) from
// global to shared memory; completion is counted on `bar`. The data is read
// once per call: evict it from L2 first.
__device__ __forceinline__ void BulkCopy(void* dst, const void* src, uint32_t bytes, uint64_t* bar,
                                         uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint "
      "[%0], [%1], %2, [%3], %4;\n" ::"r"(SharedAddr(dst)),
      "l"(src), "r"(bytes), "r"(SharedAddr(bar)), "l"(policy)
      : "memory");
}

// One warp's ring of kStages chunk stages for kv head h of its work unit.
template <int D, int NG, int kStages>
struct StageRing {
  static constexpr int kCodeBytes = 32 * D / 4;   // one kind's codes of a chunk
  static constexpr int kParamBytes = 32 * NG * 4;  // one kind's (scale, min) of a chunk
  static constexpr int kStageBytes = 2 * (kCodeBytes + kParamBytes);
  static_assert(kStageBytes % 128 == 0, "stages stay 128-byte aligned");
  // Dynamic shared memory of a block: the barriers, then the stages.
  static constexpr int kBarrierBytes = ((2 * kStages * kWarps * 8 + 127) / 128) * 128;
  static constexpr int kBlockBytes = kBarrierBytes + kWarps * kStages * kStageBytes;

  uint64_t* full;
  uint64_t* empty;
  uint8_t* stages;
  uint64_t policy;
  // Byte offsets in a page of kv head h's K and V codes; each kind's params
  // follow its codes (page_codes bytes).
  uint32_t k_codes, v_codes, page_codes;
  bool one_copy;  // 32-token pages: a chunk is one contiguous run

  // `smem`: the block's dynamic shared memory (kBlockBytes).
  __device__ void Init(uint8_t* smem, int warp, int lane, const PageGeometry& geom, int h) {
    full = reinterpret_cast<uint64_t*>(smem) + 2 * kStages * warp;
    empty = full + kStages;
    stages = smem + kBarrierBytes + size_t(warp) * kStages * kStageBytes;
    k_codes = static_cast<uint32_t>(geom.codes_offset(h, 0));
    v_codes = static_cast<uint32_t>(geom.codes_offset(h, 1));
    page_codes = static_cast<uint32_t>(geom.codes_bytes());
    one_copy = geom.page_tokens == 32;
    policy = PageStreamPolicy();
    if (lane == 0) {
      for (int s = 0; s < kStages; ++s) {
        BarrierInit(full + s, 1);
        BarrierInit(empty + s, 32);
      }
      FenceBarrierInit();
    }
    __syncwarp();
  }

  __device__ __forceinline__ const uint8_t* Stage(int s) const {
    return stages + s * kStageBytes;
  }

  // Lane 0: fills stage s with chunk `chunk` (within its page) of `page`.
  __device__ __forceinline__ void Fill(int s, const uint8_t* page, int chunk) {
    uint8_t* dst = stages + s * kStageBytes;
    BarrierArriveExpectTx(full + s, kStageBytes);
    if (one_copy) {
      BulkCopy(dst, page + k_codes, kStageBytes, full + s, policy);
      return;
    }
    // Longer pages: [K codes][K params][V codes][V params], each kind's
    // chunks in token order.
    const uint32_t code_off = chunk * kCodeBytes, param_off = page_codes + chunk * kParamBytes;
    BulkCopy(dst, page + k_codes + code_off, kCodeBytes, full + s, policy);
    BulkCopy(dst + kCodeBytes, page + k_codes + param_off, kParamBytes, full + s, policy);
    BulkCopy(dst + kCodeBytes + kParamBytes, page + v_codes + code_off, kCodeBytes, full + s,
             policy);
    BulkCopy(dst + 2 * kCodeBytes + kParamBytes, page + v_codes + param_off, kParamBytes,
             full + s, policy);
  }
};

}  // namespace cuda_attend
}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_CUDA_ATTEND_STAGE_RING_CUH_
