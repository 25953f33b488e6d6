// A host emulation of one CUDA warp, for testing the kernels' warp-level code
// (kernels/cuda/attend_history*.cuh, attend_exact.cuh, encode_rows.cuh) on a
// machine without a GPU.
//
// Include this before any kernels/cuda header: it defines
// OSCARKV_WARP_EMULATION, which makes attend_device.cuh leave out its PTX
// operations, and defines the same operations here: the warp-collective ones
// (shuffles, vote, ballot, reductions, movmatrix, mma.sync) across 32 host
// threads, one per lane,
// that meet at every collective; the per-lane ones (prmt, ex2 / lg2 / rcp
// .approx, the fp16 / bf16 code-pair subtractions) in plain C++. Fragment
// layouts are those of the PTX ISA for mma.m16n8k16 (f16 / bf16) and
// mma.m16n8k32 (u8 / s8); the approximate MUFU functions are computed to
// float precision (the hardware's ex2 and rcp are within ~2 ulp of them,
// its lg2 within ~2^-22 absolute).
//
// What it is not: a timing model, or a check of anything outside one warp
// (blocks, shared memory between warps, the launches). Kernels are not run;
// the tests drive a warp's structs and helpers (WarpPages, ChunkLoads, the
// history and exact warps, the encode's row helpers) directly.
// Nor is it a second source for the fragment layouts: an emulated layout
// that were wrong the same way as a kernel's would pass. The P·V layouts
// are checked by the default warp matching fp64 as it does on the H200; the
// q·K side is not (the tests take the warps' own logits).
//
//   oscarkv::warp_emulation::RunWarp([&](int lane) { ...warp code... });
#ifndef OSCARKV_TESTS_GPU_WARP_EMULATION_H_
#define OSCARKV_TESTS_GPU_WARP_EMULATION_H_

#define OSCARKV_WARP_EMULATION 1

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <vector_types.h>

#include <array>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <functional>

#include "kernels/numeric.h"

namespace oscarkv {
namespace warp_emulation {

constexpr int kLanes = 32;

// Runs body(lane) for the 32 lanes of one warp, each on its own thread, and
// returns when all have returned. Collectives inside body must be reached by
// every lane in the same order, as on the GPU (a lane that skips one is
// reported and the process aborts, rather than hangs).
void RunWarp(const std::function<void(int lane)>& body);

// The calling lane (0..31) inside RunWarp.
int Lane();

// Every lane passes `bytes` bytes (at most kSlotBytes); each gets the 32
// lanes' bytes, lane by lane, in `all` (kLanes * bytes). A collective.
constexpr int kSlotBytes = 64;
void ExchangeBytes(const void* mine, int bytes, void* all);

template <class T>
std::array<T, kLanes> Exchange(const T& mine) {
  static_assert(sizeof(T) <= kSlotBytes, "a lane's slot is kSlotBytes");
  std::array<T, kLanes> all;
  ExchangeBytes(&mine, sizeof(T), all.data());
  return all;
}

// A barrier of the 32 lanes (__syncwarp).
void SyncWarp();

// How an emulated float mma.sync (f16 / bf16 inputs, f32 accumulator) adds
// its 16 products to the accumulator c:
// - kRoundToNearest (the default): one fp32 fma per product, in k order;
// - kAlignedTruncation: a model of the tensor cores' adder, after Fasi,
//   Higham, Mikaitis and Pranesh, "Numerical behavior of NVIDIA tensor
//   cores" (PeerJ CS, 2021): the products are exact, every term (c and the
//   16 products) is aligned to the largest exponent among them and cut
//   toward zero to 24 bits there, the sum is exact and cut toward zero to
//   fp32. Every addend smaller than c loses its bits below c's last bit, so a
//   sum of same-sign terms drifts toward zero by up to 17 ulp(c) per mma.
//   A model, not the H200's adder: it gives a long unit's drift the order
//   of size the H200 showed (history_warp_emulation_test's long-unit test),
//   not its bits.
// Process-wide; set it outside RunWarp.
enum class FloatMmaSums { kRoundToNearest, kAlignedTruncation };
void SetFloatMmaSums(FloatMmaSums sums);
FloatMmaSums GetFloatMmaSums();

// fp16 / bf16 halves of a 32-bit word as floats, and back (round to nearest).
float HalfLo(uint32_t w);
float HalfHi(uint32_t w);
float Bf16Lo(uint32_t w);
float Bf16Hi(uint32_t w);
uint32_t PackHalves(float lo, float hi);
uint32_t PackBf16s(float lo, float hi);

}  // namespace warp_emulation
}  // namespace oscarkv

// The thread index of the calling lane (a warp of its own: x = lane).
struct EmulatedThreadIndex {
  unsigned int x, y, z;
};
extern thread_local EmulatedThreadIndex threadIdx;

// The CUDA intrinsics the warp code calls (mask: always the full warp there).
template <class T>
T __shfl_sync(unsigned /*mask*/, T var, int src_lane, int /*width*/ = 32) {
  return oscarkv::warp_emulation::Exchange(var)[src_lane & 31];
}
template <class T>
T __shfl_xor_sync(unsigned /*mask*/, T var, int lane_mask, int /*width*/ = 32) {
  return oscarkv::warp_emulation::Exchange(var)[(oscarkv::warp_emulation::Lane() ^ lane_mask) & 31];
}
int __any_sync(unsigned mask, int predicate);
unsigned __ballot_sync(unsigned mask, int predicate);
unsigned __reduce_max_sync(unsigned mask, unsigned value);
int __reduce_max_sync(unsigned mask, int value);
int __reduce_min_sync(unsigned mask, int value);
int __reduce_add_sync(unsigned mask, int value);
template <class T>
T __shfl_down_sync(unsigned /*mask*/, T var, unsigned delta, int /*width*/ = 32) {
  const int src = oscarkv::warp_emulation::Lane() + int(delta);
  const auto all = oscarkv::warp_emulation::Exchange(var);
  return src < 32 ? all[src] : var;
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
void __syncwarp(unsigned mask = 0xffffffffu);
template <class T>
T __ldg(const T* p) {
  return *p;
}
unsigned int __float2uint_rn(float x);
float __fdividef(float a, float b);
float __frcp_rn(float x);
inline uint32_t min(uint32_t a, uint32_t b) { return a < b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline uint32_t max(uint32_t a, uint32_t b) { return a > b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
int __float2int_rn(float x);  // ties to even; NaN -> 0; saturating
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline int __float_as_int(float f) { return static_cast<int>(oscarkv::FloatBits(f)); }
inline float __int_as_float(int i) { return oscarkv::BitsToFloat(static_cast<uint32_t>(i)); }
inline float __uint_as_float(unsigned int u) { return oscarkv::BitsToFloat(u); }
inline unsigned int __float_as_uint(float f) { return oscarkv::FloatBits(f); }

namespace oscarkv {
namespace cuda_attend {

// attend_device.cuh's page loads (an L2 evict-first hint on the GPU).
inline uint32_t Ld16(const uint8_t* p) { return *reinterpret_cast<const uint16_t*>(p); }
inline uint32_t Ld32(const uint8_t* p) { return *reinterpret_cast<const uint32_t*>(p); }
inline uint2 Ld64(const uint8_t* p) { return *reinterpret_cast<const uint2*>(p); }

// D (f32, 16x8) += A (f16, 16x16) · B (f16, 16x8).
void MmaF16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
            uint32_t b1);
// The same with bf16 A and B.
void MmaBf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
             uint32_t b1);
// D (s32, 16x8) += A (u8, 16x32) · B (s8, 32x8).
void ImmaU8S8(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
              uint32_t b1);
// D (s32) = A (u8, 16x32) · B (u8, 32x8), from zero.
void ImmaU8U8(int (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
              uint32_t b1);
// movmatrix.m8n8.trans.b16.
uint32_t TransposeM8N8(uint32_t x);
// prmt.b32 (default mode).
uint32_t Prmt(uint32_t a, uint32_t b, uint32_t sel);
// ex2 / lg2 / rcp .approx.ftz.f32.
float FastExp2(float x);
float FastLog2(float x);
float FastRcp(float x);

// As attend_device.cuh's: field K of bytes 0 and 2 of x as an exact fp16 pair
// (c·4^K) and, less a center (see attend_device.cuh), as an exact bf16 pair.
template <int K>
uint32_t KeyCodePair(uint32_t x) {
  const uint32_t v = (x & (0x00030003u << (2 * K))) | 0x64006400u;
  using warp_emulation::HalfHi;
  using warp_emulation::HalfLo;
  return warp_emulation::PackHalves(HalfLo(v) - 1024.0f, HalfHi(v) - 1024.0f);
}
template <int K>
uint32_t ValueCodePair(uint32_t x, uint32_t sub) {
  const uint32_t v = K < 3 ? ((x & (0x00030003u << (2 * K))) | 0x43004300u)
                           : (((x >> 6) & 0x00030003u) | 0x43004300u);
  using warp_emulation::Bf16Hi;
  using warp_emulation::Bf16Lo;
  return warp_emulation::PackBf16s(Bf16Lo(v) - Bf16Lo(sub), Bf16Hi(v) - Bf16Hi(sub));
}

}  // namespace cuda_attend
}  // namespace oscarkv

#endif  // OSCARKV_TESTS_GPU_WARP_EMULATION_H_
