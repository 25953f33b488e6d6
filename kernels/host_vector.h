// The host's widest float vector, as a GCC vector extension type, for the
// CPU kernels' hand-vectorized loops: 16 floats (one zmm) with AVX-512, else
// 8 (one ymm with AVX2; two xmm with SSE only). Code written for 16 floats
// on an AVX2-only host got two ymm per vector, its accumulators outgrew the
// 16 ymm and lived on the stack: attention and encode ran ~20x slower than on
// an AVX-512 host (tests/bench/RESULTS.md, "On a host without AVX-512").
#ifndef OSCARKV_KERNELS_HOST_VECTOR_H_
#define OSCARKV_KERNELS_HOST_VECTOR_H_

namespace oscarkv {
namespace host_vector {

#if defined(__AVX512F__)
inline constexpr int kLanes = 16;
#else
inline constexpr int kLanes = 8;
#endif
typedef float VF __attribute__((vector_size(4 * kLanes)));
typedef float VFu __attribute__((vector_size(4 * kLanes), aligned(4)));  // unaligned loads
typedef int VI __attribute__((vector_size(4 * kLanes)));

inline VF Load(const float* p) { return *reinterpret_cast<const VFu*>(p); }
inline void Store(float* p, VF v) { *reinterpret_cast<VFu*>(p) = v; }

}  // namespace host_vector
}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_HOST_VECTOR_H_
