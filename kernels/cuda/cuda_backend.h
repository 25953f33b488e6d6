// The CUDA backend: the cache's bytes in GPU memory and the codec and
// attention kernels of kernels/cuda/ (DESIGN sections 4 and 5).
//
// Same contract as kernels/backend.h: every pointer inside a job or item is
// memory from this backend's Allocate() (8-byte aligned), the job / item /
// page-table arrays are host memory read during the call. Every call is
// synchronous: when it returns OK, the results are in device memory. CUDA
// errors come back as Status, never as an abort.
//
// Thread-safety: calls may come from several threads; kernels and uploads are
// serialized on one stream of the device.
//
// Attend limits (UNIMPLEMENTED outside them): at most 8 query heads per kv
// head, group_size >= head_dim / 4, page_tokens a multiple of 32.
#ifndef OSCARKV_KERNELS_CUDA_CUDA_BACKEND_H_
#define OSCARKV_KERNELS_CUDA_CUDA_BACKEND_H_

#include <memory>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace oscarkv {

// Number of usable CUDA devices; 0 when there is no driver or no device.
int CudaDeviceCount();

// A backend on CUDA device `device`. UNAVAILABLE when no GPU (or no driver)
// is present, INVALID_ARGUMENT for a device index out of range.
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device = 0);

}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_CUDA_CUDA_BACKEND_H_
