// The GPU benchmark's read-only bandwidth probe (read_probe.cu).
#ifndef OSCARKV_TESTS_GPU_READ_PROBE_H_
#define OSCARKV_TESTS_GPU_READ_PROBE_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace oscarkv {
namespace gputest {

// Reads `bytes` (a multiple of 16, 16-byte aligned) from `src` with `blocks`
// blocks of 512 threads, writing one word per block to `sink` (blocks words).
cudaError_t LaunchReadProbe(const void* src, size_t bytes, uint32_t* sink, int blocks,
                            cudaStream_t stream);

}  // namespace gputest
}  // namespace oscarkv

#endif  // OSCARKV_TESTS_GPU_READ_PROBE_H_
