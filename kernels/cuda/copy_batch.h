// Several host-to-device copies in one driver call (cudaMemcpyBatchAsync, as
// declared by CUDA 13; older toolkits get one cudaMemcpyAsync per copy): each
// cudaMemcpyAsync costs a few µs of host time, which a decode step with many
// small copies pays many times over.
#ifndef OSCARKV_KERNELS_CUDA_COPY_BATCH_H_
#define OSCARKV_KERNELS_CUDA_COPY_BATCH_H_

#include <cuda_runtime.h>

#include <cstddef>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_status.h"

namespace oscarkv {

// Enqueues dsts[i] <- srcs[i] (sizes[i] bytes, host to device) on `stream`,
// in stream order with everything before and after; the copies of the batch
// may run in any order among themselves (their destinations must not
// overlap). The sources are read in stream order: they must stay valid until
// the stream has run the copies (pinned memory for truly asynchronous ones).
inline absl::Status CopyBatchToDevice(void* const* dsts, const void* const* srcs,
                                      const size_t* sizes, size_t n, cudaStream_t stream) {
#if CUDART_VERSION >= 13000
  if (n > 1 && stream != nullptr) {  // the batch call refuses the legacy stream
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    size_t first = 0;
    return CudaStatus(cudaMemcpyBatchAsync(dsts, srcs, sizes, n, &attr, &first, 1, stream),
                      "cudaMemcpyBatchAsync");
  }
#endif
  for (size_t i = 0; i < n; ++i) {
    OSCARKV_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyHostToDevice, stream));
  }
  return absl::OkStatus();
}

}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_CUDA_COPY_BATCH_H_
