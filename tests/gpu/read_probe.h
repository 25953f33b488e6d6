// The GPU benchmark's probes (read_probe.cu): the read-only bandwidth
// ceiling, the floor of a chain of empty kernels, and the first access
// after a PDL wait.
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

// Enqueues `kernels` empty kernels of `blocks` blocks of 128 threads: the
// first a plain launch, the rest with programmatic stream serialization
// (PDL), each block of those calling griddepcontrol.wait and
// launch_dependents, as the attention call's prep, split and merge kernels
// do; the first one too with `pdl_ops` (as the prep kernel does), else it
// has no instruction but its exit.
cudaError_t LaunchEmptyChain(int kernels, int blocks, bool pdl_ops, cudaStream_t stream);

// The first access after a PDL wait: a plain kernel of `writer_blocks`
// blocks of 128 threads writes one float per thread to `written`
// (writer_blocks·128 floats); a PDL kernel of `reader_blocks` one-warp
// blocks waits for it, then each lane loads one float of `written`
// (read_written) or of `other` (as many floats, not written by the
// writer) and the warp sums them. out[2b] = ns from block b's wait
// returning to its sum (out: 2·reader_blocks words). Without `pdl` the
// reader is a plain launch (it starts after the writer; the wait is a no-op).
cudaError_t LaunchHandoffProbe(float* written, const float* other, int writer_blocks,
                               int reader_blocks, bool read_written, bool pdl,
                               unsigned long long* out, cudaStream_t stream);

}  // namespace gputest
}  // namespace oscarkv

#endif  // OSCARKV_TESTS_GPU_READ_PROBE_H_
