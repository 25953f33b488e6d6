// CUDA runtime errors as absl::Status. Host-only; include from .cu or .cc files
// that link CUDA::cudart. Never aborts: every failure becomes a Status whose
// message names the call site.
#ifndef OSCARKV_KERNELS_CUDA_CUDA_STATUS_H_
#define OSCARKV_KERNELS_CUDA_CUDA_STATUS_H_

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace oscarkv {

// Maps a cudaError_t to a Status code: out of memory is RESOURCE_EXHAUSTED, no
// device / driver problems UNAVAILABLE, bad arguments INVALID_ARGUMENT, and
// everything else (launch failures, illegal addresses) INTERNAL.
inline absl::Status CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  const std::string msg = absl::StrCat(what, ": ", cudaGetErrorName(err), " (",
                                       cudaGetErrorString(err), ")");
  switch (err) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(msg);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
    case cudaErrorDevicesUnavailable:
      return absl::UnavailableError(msg);
    case cudaErrorInvalidValue:
    case cudaErrorInvalidConfiguration:
      return absl::InvalidArgumentError(msg);
    default:
      return absl::InternalError(msg);
  }
}

// For an allocation that failed: clears the error that CUDA also keeps for
// the next cudaGetLastError (a later launch check would report it as its
// own), then maps it like CudaStatus.
inline absl::Status CudaAllocationStatus(cudaError_t err, const char* what) {
  cudaGetLastError();
  return CudaStatus(err, what);
}

}  // namespace oscarkv

#define OSCARKV_CUDA_STRINGIFY_INNER_(x) #x
#define OSCARKV_CUDA_STRINGIFY_(x) OSCARKV_CUDA_STRINGIFY_INNER_(x)

// Returns a Status from the enclosing function if the CUDA call fails.
#define OSCARKV_CUDA_RETURN_IF_ERROR(call)                                                   \
  do {                                                                                       \
    const cudaError_t oscarkv_cuda_err_ = (call);                                            \
    if (oscarkv_cuda_err_ != cudaSuccess) {                                                  \
      return ::oscarkv::CudaStatus(oscarkv_cuda_err_,                                        \
                                   #call " at " __FILE__ ":" OSCARKV_CUDA_STRINGIFY_(__LINE__)); \
    }                                                                                        \
  } while (0)

// The same for an allocation `call` that sets `ptr`: on failure, `ptr` is
// null and CUDA's kept copy of the error is cleared (CudaAllocationStatus).
#define OSCARKV_CUDA_ALLOC_OR_RETURN(ptr, call, what)                     \
  do {                                                                    \
    const cudaError_t oscarkv_cuda_err_ = (call);                         \
    if (oscarkv_cuda_err_ != cudaSuccess) {                               \
      (ptr) = nullptr;                                                    \
      return ::oscarkv::CudaAllocationStatus(oscarkv_cuda_err_, (what));  \
    }                                                                     \
  } while (0)

#endif  // OSCARKV_KERNELS_CUDA_CUDA_STATUS_H_
