// Shared-memory barriers (mbarrier, sm_90): the stage ring of the attention
// kernels (filled by the bulk-copy engine) and the encode kernel's hand-off
// between its multiplying and quantizing warps. Included by the CUDA kernel
// sources only.
//
// An arrive releases the arriving thread's earlier memory accesses, and
// those it has ordered before it (a __syncwarp of its warp); a wait on the
// phase acquires them.
#ifndef OSCARKV_KERNELS_CUDA_MBARRIER_CUH_
#define OSCARKV_KERNELS_CUDA_MBARRIER_CUH_

#include <cstdint>

namespace oscarkv {

__device__ __forceinline__ uint32_t SharedAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void BarrierInit(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(SharedAddr(bar)), "r"(count)
               : "memory");
}

// Makes the barriers' initialization visible to the copy engine.
__device__ __forceinline__ void FenceBarrierInit() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

__device__ __forceinline__ void BarrierArriveExpectTx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(SharedAddr(bar)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void BarrierArrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(SharedAddr(bar)) : "memory");
}

// Spins until the barrier's phase with this parity has completed.
__device__ __forceinline__ void BarrierWait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(SharedAddr(bar)),
      "r"(parity)
      : "memory");
}

}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_CUDA_MBARRIER_CUH_
