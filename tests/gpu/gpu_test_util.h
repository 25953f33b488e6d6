// Shared helpers of the GPU tests and the GPU benchmark: random data with the
// structure real caches have, random rotations, pages encoded on the CPU,
// tier splits, device uploads.
#ifndef OSCARKV_TESTS_GPU_GPU_TEST_UTIL_H_
#define OSCARKV_TESTS_GPU_GPU_TEST_UTIL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/numeric.h"

namespace oscarkv {
namespace gputest {

// Random orthogonal D×D (fp32, row-major), by Gram–Schmidt in fp64.
inline std::vector<float> RandomOrthogonal(int d, std::mt19937_64& rng) {
  std::normal_distribution<double> n(0.0, 1.0);
  std::vector<double> m(size_t(d) * d);
  for (auto& x : m) x = n(rng);
  for (int i = 0; i < d; ++i) {
    double* ri = &m[size_t(i) * d];
    for (int pass = 0; pass < 2; ++pass) {
      for (int j = 0; j < i; ++j) {
        const double* rj = &m[size_t(j) * d];
        double dot = 0;
        for (int k = 0; k < d; ++k) dot += ri[k] * rj[k];
        for (int k = 0; k < d; ++k) ri[k] -= dot * rj[k];
      }
    }
    double nn = 0;
    for (int k = 0; k < d; ++k) nn += ri[k] * ri[k];
    nn = std::sqrt(nn);
    for (int k = 0; k < d; ++k) ri[k] /= nn;
  }
  return std::vector<float>(m.begin(), m.end());
}

// BF16 rows [n][d] with a few outlier channels (x8) and per-token scale.
inline std::vector<bf16_bits> RandomKvRows(size_t n, int d, std::mt19937_64& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> ud(0.5f, 2.0f);
  std::vector<bf16_bits> x(n * d);
  for (size_t t = 0; t < n; ++t) {
    const float s = ud(rng);
    for (int j = 0; j < d; ++j) {
      const float outlier = (j % 37 == 3) ? 8.0f : 1.0f;
      x[t * d + j] = FloatToBf16(nd(rng) * s * outlier);
    }
  }
  return x;
}

// Tier split of a sequence of `tokens` tokens (DESIGN section 1).
struct Tiers {
  int sink = 0;
  int pages = 0;
  int recent = 0;
};
inline Tiers SplitTiers(int tokens, int sink_tokens, int window, int page_tokens) {
  Tiers t;
  t.sink = std::min(tokens, sink_tokens);
  const int rest = tokens - t.sink;
  if (rest >= window + page_tokens) {
    t.pages = (rest - window) / page_tokens;
  }
  t.recent = rest - t.pages * page_tokens;
  return t;
}

// Device allocation filled from host data.
template <typename T>
absl::StatusOr<DeviceBuffer> Upload(Backend& b, const std::vector<T>& host) {
  auto buf = b.Allocate(host.size() * sizeof(T));
  if (!buf.ok()) return buf.status();
  auto st = b.CopyToDevice(buf->data(), host.data(), host.size() * sizeof(T));
  if (!st.ok()) return st;
  return std::move(buf).value();
}

// Random orthogonal R_K and R_V of size d, on the host and on the device:
// `mats` = 1, one pair for every kv head (stride 0), or one per kv head
// (mats = kv heads, stride d·d). The device copy starts `device_offset`
// floats into its buffer (1: not 16-byte aligned).
struct Rotations {
  int d = 0, mats = 1, device_offset = 0;
  std::vector<float> host;  // mats R_K, then mats R_V
  DeviceBuffer device;
  size_t stride() const { return mats > 1 ? size_t(d) * d : 0; }
  RotationRef host_ref() const { return Ref(host.data()); }
  RotationRef device_ref() const { return Ref(device.as<float>() + device_offset); }

 private:
  RotationRef Ref(const float* base) const {
    return {base, base + size_t(mats) * d * d, stride()};
  }
};
inline absl::StatusOr<Rotations> RandomRotations(Backend& b, int d, int mats,
                                                 std::mt19937_64& rng, int device_offset = 0) {
  Rotations r;
  r.d = d;
  r.mats = mats;
  r.device_offset = device_offset;
  r.host.resize(2 * size_t(mats) * d * d);
  for (int m = 0; m < 2 * mats; ++m) {
    const std::vector<float> x = RandomOrthogonal(d, rng);
    std::copy(x.begin(), x.end(), r.host.begin() + size_t(m) * d * d);
  }
  std::vector<float> padded(size_t(device_offset), 0.0f);
  padded.insert(padded.end(), r.host.begin(), r.host.end());
  auto dev = Upload(b, padded);
  if (!dev.ok()) return dev.status();
  r.device = std::move(dev).value();
  return r;
}

// `count` history pages encoded by the CPU backend (clip ratios 0.96 / 0.92)
// from `count` consecutive exact blocks of geom at `blocks`.
inline absl::StatusOr<std::vector<uint8_t>> EncodePagesOnCpu(const PageGeometry& geom,
                                                             const bf16_bits* blocks, int count,
                                                             const RotationRef& rotation) {
  const size_t block_elems = geom.exact_block_bytes() / 2;
  std::vector<uint8_t> pages(size_t(count) * geom.page_bytes());
  std::vector<EncodeJob> jobs(count);
  for (int p = 0; p < count; ++p) {
    jobs[p] = EncodeJob{blocks + p * block_elems, &pages[p * geom.page_bytes()], rotation, 0.96f,
                        0.92f};
  }
  CpuBackend cpu(2);
  const absl::Status st = cpu.EncodePages(geom, jobs.data(), count);
  if (!st.ok()) return st;
  return pages;
}

template <typename T>
absl::StatusOr<std::vector<T>> Download(Backend& b, const void* dev, size_t count) {
  std::vector<T> host(count);
  auto st = b.CopyToHost(host.data(), dev, count * sizeof(T));
  if (!st.ok()) return st;
  return host;
}

}  // namespace gputest
}  // namespace oscarkv

#endif  // OSCARKV_TESTS_GPU_GPU_TEST_UTIL_H_
