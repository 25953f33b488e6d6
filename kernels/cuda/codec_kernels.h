// Launchers of the CUDA codec kernels (the twins of kernels/quantize.h and the
// CPU backend's EncodePages/DecodePages).
//
// Job arrays are in device memory; every pointer inside them is device memory
// (8-byte aligned). Launchers only enqueue on `stream`: they never allocate,
// never synchronize (except the first encode on a device whose encode kernel
// nobody asked for: EncodeWarpgroupAvailable below) and never abort; a launch
// error comes back as a Status.
// Callers check the geometry first (ValidateGeometry in kernels/cpu).
#ifndef OSCARKV_KERNELS_CUDA_CODEC_KERNELS_H_
#define OSCARKV_KERNELS_CUDA_CODEC_KERNELS_H_

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "kernels/backend.h"

namespace oscarkv {

// Which encode kernel runs. kAuto: for head dim 128 the wgmma kernel where the
// loaded code has it (EncodeWarpgroupAvailable: built for sm_90a, run on a
// Hopper GPU; encode_warpgroup.cuh), else the roles kernel (the
// strip kernel's work split between multiplying and quantizing warps), for 64
// the strip kernel (each warp keeps its strip of R in registers and does both;
// encode_strips.cuh), else the tiled kernel (R staged in shared memory per
// tile). kStrips / kRoles force the strip kernel / the roles kernel (the same
// pages) for head dims 64 and 128 (at 256 they run the tiled kernel); kTiled
// forces the tiled kernel for every head dim: the side-by-side benchmark's
// baseline. kWarpgroup forces the wgmma kernel (head dim 128 only; a
// FailedPrecondition error where it is not available).
enum class EncodeKernelChoice { kAuto, kStrips, kRoles, kTiled, kWarpgroup };

// Whether the current device runs the wgmma encode kernel (the module's code
// it loaded was built for sm_90a). The first call per device runs a one-thread
// probe kernel and waits for it (the only launcher call that synchronizes;
// CudaBackend asks at creation, so that its encodes never do); later calls
// return the cached answer.
absl::StatusOr<bool> EncodeWarpgroupAvailable();

// Rotate (x · R on the tensor cores, with R split into two fp16 terms (strip
// and roles kernels) or three bf16 terms (tiled and wgmma kernels) so that the
// product keeps fp32 accuracy), clip, quantize and pack every row of every job
// in one launch.
// Codes are computed against the fp16-rounded (scale, min) exactly like
// QuantizeRow; only the fp32 summation order of the rotation differs from the
// CPU, which can flip a code that sits on a rounding boundary.
absl::Status LaunchEncodePages(const PageGeometry& geom, const EncodeJob* dev_jobs, int num_jobs,
                               cudaStream_t stream,
                               EncodeKernelChoice choice = EncodeKernelChoice::kAuto);

// Dequantize and un-rotate (y^ · Rᵀ, fp32, the CPU's summation order) every
// row of every job into the exact-block BF16 layout, in one launch.
absl::Status LaunchDecodePages(const PageGeometry& geom, const DecodeJob* dev_jobs, int num_jobs,
                               cudaStream_t stream);

}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_CUDA_CODEC_KERNELS_H_
