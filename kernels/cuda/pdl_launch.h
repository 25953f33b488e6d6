// The launch configuration of a programmatic dependent launch (PDL, sm_90):
// the kernel may start while the previous one in the stream runs, and waits
// for its memory with griddepcontrol.wait. Used by the attention launcher
// and the GPU benchmark's launch-floor probe. Host-only.
#ifndef OSCARKV_KERNELS_CUDA_PDL_LAUNCH_H_
#define OSCARKV_KERNELS_CUDA_PDL_LAUNCH_H_

#include <cuda_runtime.h>

#include <cstddef>

namespace oscarkv {

// A config for cudaLaunchKernelEx with programmatic stream serialization
// allowed; it points at *attr, which must outlive the launch call. With
// `programmatic` false, a plain launch's config (no attribute: the kernel
// starts after the one before it, and its griddepcontrol.wait returns at
// once: the benchmarks' skip_prep and first-access probe).
inline cudaLaunchConfig_t PdlLaunchConfig(dim3 grid, dim3 block, size_t dynamic_smem,
                                          cudaStream_t stream, cudaLaunchAttribute* attr,
                                          bool programmatic = true) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = dynamic_smem;
  cfg.stream = stream;
  attr->id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr->val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = programmatic ? 1 : 0;
  return cfg;
}

}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_CUDA_PDL_LAUNCH_H_
