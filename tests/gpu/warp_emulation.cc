#include "tests/gpu/warp_emulation.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <thread>
#include <vector>

#include "kernels/numeric.h"

namespace oscarkv {
namespace warp_emulation {
namespace {

// The 32 lanes' meeting point: a reusable barrier and one slot per lane.
class WarpState {
 public:
  void Barrier() {
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t generation = generation_;
    if (++arrived_ == kLanes) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    // A lane that never arrives (it skipped a collective, or returned early)
    // would hang the test: report it instead.
    if (!cv_.wait_for(lock, std::chrono::seconds(60), [&] { return generation_ != generation; })) {
      std::fprintf(stderr,
                   "warp emulation: %d of %d lanes waited 60 s at a collective (the lanes' "
                   "collectives diverged)\n",
                   arrived_, kLanes);
      std::abort();
    }
  }
  unsigned char* slot(int lane) { return slots_[lane]; }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  alignas(16) unsigned char slots_[kLanes][kSlotBytes];
};

thread_local WarpState* t_warp = nullptr;
thread_local int t_lane = -1;

WarpState& Current() {
  if (t_warp == nullptr) {
    std::fprintf(stderr, "warp emulation: a warp operation outside RunWarp\n");
    std::abort();
  }
  return *t_warp;
}

}  // namespace

void RunWarp(const std::function<void(int lane)>& body) {
  WarpState warp;
  std::vector<std::thread> lanes;
  lanes.reserve(kLanes);
  for (int lane = 0; lane < kLanes; ++lane) {
    lanes.emplace_back([&warp, &body, lane] {
      t_warp = &warp;
      t_lane = lane;
      threadIdx = {static_cast<unsigned>(lane), 0, 0};
      body(lane);
      t_warp = nullptr;
      t_lane = -1;
    });
  }
  for (std::thread& t : lanes) t.join();
}

int Lane() {
  Current();
  return t_lane;
}

void ExchangeBytes(const void* mine, int bytes, void* all) {
  WarpState& warp = Current();
  std::memcpy(warp.slot(t_lane), mine, bytes);
  warp.Barrier();  // every lane's value is in its slot
  for (int l = 0; l < kLanes; ++l) {
    std::memcpy(static_cast<unsigned char*>(all) + size_t(l) * bytes, warp.slot(l), bytes);
  }
  warp.Barrier();  // every lane has read: the slots may be reused
}

void SyncWarp() { Current().Barrier(); }

namespace {
std::atomic<FloatMmaSums> g_float_mma_sums{FloatMmaSums::kRoundToNearest};
}  // namespace

void SetFloatMmaSums(FloatMmaSums sums) { g_float_mma_sums.store(sums); }
FloatMmaSums GetFloatMmaSums() { return g_float_mma_sums.load(); }

float HalfLo(uint32_t w) { return Fp16ToFloat(static_cast<fp16_bits>(w & 0xffffu)); }
float HalfHi(uint32_t w) { return Fp16ToFloat(static_cast<fp16_bits>(w >> 16)); }
float Bf16Lo(uint32_t w) { return Bf16ToFloat(static_cast<bf16_bits>(w & 0xffffu)); }
float Bf16Hi(uint32_t w) { return Bf16ToFloat(static_cast<bf16_bits>(w >> 16)); }
uint32_t PackHalves(float lo, float hi) {
  return uint32_t(FloatToFp16(lo)) | (uint32_t(FloatToFp16(hi)) << 16);
}
uint32_t PackBf16s(float lo, float hi) {
  return uint32_t(FloatToBf16(lo)) | (uint32_t(FloatToBf16(hi)) << 16);
}

}  // namespace warp_emulation
}  // namespace oscarkv

thread_local EmulatedThreadIndex threadIdx = {0, 0, 0};

using oscarkv::warp_emulation::Exchange;
using oscarkv::warp_emulation::kLanes;
using oscarkv::warp_emulation::Lane;

int __any_sync(unsigned /*mask*/, int predicate) {
  const auto all = Exchange<int>(predicate != 0);
  for (int v : all) {
    if (v) return 1;
  }
  return 0;
}

void __syncwarp(unsigned /*mask*/) { oscarkv::warp_emulation::SyncWarp(); }

unsigned __ballot_sync(unsigned /*mask*/, int predicate) {
  const auto all = Exchange<int>(predicate != 0);
  unsigned bits = 0;
  for (int l = 0; l < kLanes; ++l) bits |= all[l] ? 1u << l : 0u;
  return bits;
}

namespace {
template <class T, class Op>
T Reduce(T value, Op op) {
  const auto all = Exchange(value);
  T acc = all[0];
  for (int l = 1; l < kLanes; ++l) acc = op(acc, all[l]);
  return acc;
}
}  // namespace

unsigned __reduce_max_sync(unsigned, unsigned v) {
  return Reduce(v, [](unsigned a, unsigned b) { return a > b ? a : b; });
}
int __reduce_max_sync(unsigned, int v) {
  return Reduce(v, [](int a, int b) { return a > b ? a : b; });
}
int __reduce_min_sync(unsigned, int v) {
  return Reduce(v, [](int a, int b) { return a < b ? a : b; });
}
int __reduce_add_sync(unsigned, int v) {  // wraps like the hardware's
  return static_cast<int>(Reduce(static_cast<unsigned>(v), [](unsigned a, unsigned b) { return a + b; }));
}

int __float2int_rn(float x) {
  if (std::isnan(x)) return 0;
  if (x >= 2147483647.0f) return 2147483647;
  if (x <= -2147483648.0f) return -2147483647 - 1;
  return static_cast<int>(std::nearbyint(x));  // ties to even (default mode)
}

unsigned int __float2uint_rn(float x) {
  if (std::isnan(x) || x <= 0.0f) return 0u;
  if (x >= 4294967295.0f) return 0xffffffffu;
  return static_cast<unsigned int>(std::nearbyint(x));  // ties to even (default mode)
}

float __fdividef(float a, float b) {
  // The fast division returns 0 for 2^126 < |b| < 2^128 (CUDA's documentation).
  const float mag = std::fabs(b);
  if (mag > 8.507059e37f && std::isfinite(mag)) return 0.0f;
  return a / b;
}

float __frcp_rn(float x) { return 1.0f / x; }

namespace oscarkv {
namespace cuda_attend {
namespace {

using warp_emulation::Bf16Hi;
using warp_emulation::Bf16Lo;
using warp_emulation::HalfHi;
using warp_emulation::HalfLo;

uint32_t Byte(uint32_t w, int i) { return (w >> (8 * i)) & 0xffu; }

// The fragments of one mma.sync, as every lane passes them.
struct MmaRegs {
  uint32_t a[4];
  uint32_t b[2];
};


// FloatMmaSums::kAlignedTruncation's sum of 17 exact terms (each a product
// of two 16-bit floats, or the fp32 accumulator): every term cut toward
// zero to a multiple of 2^(e - 24), e the largest exponent among them (x =
// f·2^e, f in [0.5, 1)), the exact sum (at most 2^29 such units: exact in a
// double) cut toward zero to fp32.
float AlignedTruncatedSum(const double (&terms)[17]) {
  int e_max = std::numeric_limits<int>::min();
  for (const double x : terms) {
    if (x == 0.0) continue;
    int e = 0;
    std::frexp(x, &e);
    e_max = std::max(e_max, e);
  }
  if (e_max == std::numeric_limits<int>::min()) return 0.0f;
  const double unit = std::ldexp(1.0, e_max - 24);
  double sum = 0.0;
  for (const double x : terms) sum += std::trunc(x / unit) * unit;
  float f = static_cast<float>(sum);
  if (std::fabs(double(f)) > std::fabs(sum)) f = std::nextafter(f, 0.0f);
  return f;
}

// Float mma m16n8k16 (row.col): A 16x16 and B 16x8 elements from the lanes'
// fragments, with `lo` / `hi` reading a register's two 16-bit elements.
template <class Lo, class Hi>
void MmaFloat16(float (&c)[4], const MmaRegs& mine, Lo lo, Hi hi) {
  const auto all = Exchange(mine);
  float A[16][16], B[16][8];
  for (int l = 0; l < kLanes; ++l) {
    const int g = l >> 2, t = l & 3;
    const MmaRegs& r = all[l];
    for (int h = 0; h < 2; ++h) {
      const auto elem = [&](uint32_t w) { return h == 0 ? lo(w) : hi(w); };
      A[g][2 * t + h] = elem(r.a[0]);
      A[g + 8][2 * t + h] = elem(r.a[1]);
      A[g][2 * t + 8 + h] = elem(r.a[2]);
      A[g + 8][2 * t + 8 + h] = elem(r.a[3]);
      B[2 * t + h][g] = elem(r.b[0]);
      B[2 * t + 8 + h][g] = elem(r.b[1]);
    }
  }
  const int lane = Lane(), g = lane >> 2, t = lane & 3;
  const bool truncate = warp_emulation::GetFloatMmaSums() ==
                        warp_emulation::FloatMmaSums::kAlignedTruncation;
  for (int i = 0; i < 4; ++i) {
    const int row = g + (i >= 2 ? 8 : 0), col = 2 * t + (i & 1);
    if (truncate) {
      double terms[17];
      terms[16] = c[i];
      for (int k = 0; k < 16; ++k) terms[k] = double(A[row][k]) * double(B[k][col]);  // exact
      c[i] = AlignedTruncatedSum(terms);
      continue;
    }
    float sum = c[i];
    for (int k = 0; k < 16; ++k) sum = std::fma(A[row][k], B[k][col], sum);
    c[i] = sum;
  }
}

// Integer mma m16n8k32 (row.col): u8 A 16x32, B 32x8 (s8 when b_signed).
void MmaInt8(int (&c)[4], const MmaRegs& mine, bool b_signed) {
  const auto all = Exchange(mine);
  int A[16][32], B[32][8];
  for (int l = 0; l < kLanes; ++l) {
    const int g = l >> 2, t = l & 3;
    const MmaRegs& r = all[l];
    for (int j = 0; j < 4; ++j) {
      A[g][4 * t + j] = int(Byte(r.a[0], j));
      A[g + 8][4 * t + j] = int(Byte(r.a[1], j));
      A[g][16 + 4 * t + j] = int(Byte(r.a[2], j));
      A[g + 8][16 + 4 * t + j] = int(Byte(r.a[3], j));
      for (int reg = 0; reg < 2; ++reg) {
        const uint32_t b = Byte(r.b[reg], j);
        B[16 * reg + 4 * t + j][g] = b_signed ? int(int8_t(uint8_t(b))) : int(b);
      }
    }
  }
  const int lane = Lane(), g = lane >> 2, t = lane & 3;
  for (int i = 0; i < 4; ++i) {
    const int row = g + (i >= 2 ? 8 : 0), col = 2 * t + (i & 1);
    int64_t sum = c[i];
    for (int k = 0; k < 32; ++k) sum += int64_t(A[row][k]) * B[k][col];
    c[i] = static_cast<int>(static_cast<uint32_t>(sum));  // wraps like the hardware's s32
  }
}

}  // namespace

void MmaF16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
            uint32_t b1) {
  MmaFloat16(c, MmaRegs{{a0, a1, a2, a3}, {b0, b1}}, HalfLo, HalfHi);
}

void MmaBf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
             uint32_t b1) {
  MmaFloat16(c, MmaRegs{{a0, a1, a2, a3}, {b0, b1}}, Bf16Lo, Bf16Hi);
}

void ImmaU8S8(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
              uint32_t b1) {
  MmaInt8(c, MmaRegs{{a0, a1, a2, a3}, {b0, b1}}, true);
}

void ImmaU8U8(int (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
              uint32_t b1) {
  d[0] = d[1] = d[2] = d[3] = 0;
  MmaInt8(d, MmaRegs{{a0, a1, a2, a3}, {b0, b1}}, false);
}

uint32_t TransposeM8N8(uint32_t x) {
  const auto all = Exchange(x);
  // Lane l holds row l/4, columns 2(l%4) and 2(l%4)+1 of the 8x8 matrix.
  const auto at = [&](int row, int col) {
    return (all[4 * row + col / 2] >> (16 * (col & 1))) & 0xffffu;
  };
  const int lane = Lane(), i = lane >> 2, j = 2 * (lane & 3);
  return at(j, i) | (at(j + 1, i) << 16);
}

uint32_t Prmt(uint32_t a, uint32_t b, uint32_t sel) {
  const uint64_t bytes = uint64_t(a) | (uint64_t(b) << 32);
  uint32_t d = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t s = (sel >> (4 * i)) & 0xfu;
    uint32_t byte = uint32_t(bytes >> (8 * (s & 7u))) & 0xffu;
    if (s & 8u) byte = (byte & 0x80u) ? 0xffu : 0u;  // replicate the sign bit
    d |= byte << (8 * i);
  }
  return d;
}

float FastExp2(float x) {
  const float y = std::exp2(x);
  return y < FLT_MIN ? 0.0f : y;  // .ftz
}

float FastLog2(float x) {
  if (std::isnan(x)) return NAN;
  if (std::fabs(x) < FLT_MIN) return -INFINITY;  // ±0 and subnormals flush to 0 (.ftz)
  if (x < 0.0f) return NAN;
  return std::log2(x);
}

float FastRcp(float x) {
  if (std::fabs(x) < FLT_MIN) return std::signbit(x) ? -INFINITY : INFINITY;  // .ftz
  return 1.0f / x;
}

}  // namespace cuda_attend
}  // namespace oscarkv
