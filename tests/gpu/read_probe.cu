// A read-only bandwidth probe for the GPU benchmark: the ceiling of a kernel
// that only streams bytes in (the split kernel's history loop), next to the
// copy bandwidth (read + write) that the issue's goals are stated against.
#include "tests/gpu/read_probe.h"

#include <cstdint>

#include "kernels/cuda/attend_device.cuh"
#include "kernels/cuda/pdl_launch.h"

namespace oscarkv {
namespace gputest {
namespace {

constexpr int kReadThreads = 512;

// Every thread reads 16-byte words, grid-stride, four in flight, with the
// attention kernels' page loads (Ld128: their L2 evict-first hint); the XOR
// of everything read goes to one word per block, so no load can be dropped.
__global__ void __launch_bounds__(kReadThreads) ReadKernel(const uint4* src, size_t words,
                                                            uint32_t* sink) {
  const size_t stride = size_t(gridDim.x) * kReadThreads;
  uint32_t x = 0;
  size_t i = size_t(blockIdx.x) * kReadThreads + threadIdx.x;
  for (; i + 3 * stride < words; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      v[k] = cuda_attend::Ld128(reinterpret_cast<const uint8_t*>(src + i + k * stride));
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) x ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
  }
  for (; i < words; i += stride) {
    const uint4 v = cuda_attend::Ld128(reinterpret_cast<const uint8_t*>(src + i));
    x ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  for (int off = 16; off >= 1; off >>= 1) x ^= __shfl_xor_sync(0xffffffffu, x, off);
  __shared__ uint32_t warp_x[kReadThreads / 32];
  if ((threadIdx.x & 31) == 0) warp_x[threadIdx.x / 32] = x;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kReadThreads / 32; ++w) x ^= warp_x[w];
    sink[blockIdx.x] = x;
  }
}

// No work: the wait for the kernel before (a no-op after a plain launch),
// then the early launch of the next, as the attention kernels do.
__global__ void EmptyPdlKernel() {
  cuda_attend::WaitForPrerequisites();
  cuda_attend::LaunchDependents();
}

// No work at all.
__global__ void EmptyKernel() {}

__device__ __forceinline__ unsigned long long GlobalTimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The writer of the handoff probe: thread t of block b writes word
// b·128 + t of `buf` (as the split kernel's blocks write their partials),
// then lets the reader launch.
__global__ void HandoffWriteKernel(float* buf) {
  cuda_attend::LaunchDependents();
  buf[size_t(blockIdx.x) * 128 + threadIdx.x] = float(blockIdx.x + threadIdx.x);
}

// The reader (one warp per block): waits for the writer, then each lane
// loads one word of `src` (another block's, as the merge reads the split's
// (m, l)) and the warp sums them with 5 shuffles, as the merge's first
// statistics do; lane 0 writes the ns from the wait's return to the sum
// (and the sum, so nothing is dropped) to out[2b], out[2b + 1].
__global__ void HandoffReadKernel(const float* src, int words, unsigned long long* out) {
  cuda_attend::WaitForPrerequisites();
  const unsigned long long t0 = GlobalTimer();
  const int lane = threadIdx.x & 31;
  float x = src[(size_t(blockIdx.x) * 977 + size_t(lane) * 131) % size_t(words)];
  for (int off = 16; off >= 1; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  const unsigned long long t1 = GlobalTimer();
  if (lane == 0) {
    out[2 * blockIdx.x] = t1 - t0;
    out[2 * blockIdx.x + 1] = __float_as_uint(x);
  }
}

}  // namespace

cudaError_t LaunchHandoffProbe(float* written, const float* other, int writer_blocks,
                               int reader_blocks, bool read_written, bool pdl,
                               unsigned long long* out, cudaStream_t stream) {
  if (writer_blocks <= 0 || reader_blocks <= 0) return cudaErrorInvalidValue;
  HandoffWriteKernel<<<writer_blocks, 128, 0, stream>>>(written);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg =
      PdlLaunchConfig(dim3(reader_blocks), dim3(32), 0, stream, &attr, pdl);
  return cudaLaunchKernelEx(&cfg, HandoffReadKernel, read_written ? written : other,
                            writer_blocks * 128, out);
}

cudaError_t LaunchEmptyChain(int kernels, int blocks, bool pdl_ops, cudaStream_t stream) {
  if (kernels <= 0 || blocks <= 0) return cudaErrorInvalidValue;
  if (pdl_ops) {
    EmptyPdlKernel<<<blocks, 128, 0, stream>>>();
  } else {
    EmptyKernel<<<blocks, 128, 0, stream>>>();
  }
  cudaError_t err = cudaGetLastError();
  for (int k = 1; k < kernels && err == cudaSuccess; ++k) {
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = PdlLaunchConfig(dim3(blocks), dim3(128), 0, stream, &attr);
    err = cudaLaunchKernelEx(&cfg, EmptyPdlKernel);
  }
  return err;
}

cudaError_t LaunchReadProbe(const void* src, size_t bytes, uint32_t* sink, int blocks,
                            cudaStream_t stream) {
  if (bytes % 16 != 0 || (reinterpret_cast<uintptr_t>(src) & 15u) != 0 || blocks <= 0) {
    return cudaErrorInvalidValue;
  }
  ReadKernel<<<blocks, kReadThreads, 0, stream>>>(static_cast<const uint4*>(src), bytes / 16,
                                                  sink);
  return cudaGetLastError();
}

}  // namespace gputest
}  // namespace oscarkv
