// Shared helpers for the unit tests: seeded random data and a small cache
// fixture on the CPU backend.
#ifndef OSCARKV_TESTS_UNIT_TEST_UTIL_H_
#define OSCARKV_TESTS_UNIT_TEST_UTIL_H_

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/numeric.h"

namespace oscarkv::testing {

// Gaussian BF16 values with a few large channels, like real keys.
inline std::vector<bf16_bits> RandomBf16(size_t n, uint64_t seed, int dim = 128,
                                         float outlier = 8.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<bf16_bits> out(n);
  for (size_t i = 0; i < n; ++i) {
    float x = nd(rng);
    if (dim > 0 && (i % dim) % 37 == 3) x *= outlier;
    out[i] = FloatToBf16(x);
  }
  return out;
}

inline std::vector<float> RandomFloats(size_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> out(n);
  for (auto& x : out) x = nd(rng);
  return out;
}

// A random orthogonal D×D matrix (Gram–Schmidt on Gaussian rows), row-major.
inline std::vector<float> RandomOrthogonal(int d, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<double> m(size_t(d) * d);
  for (auto& x : m) x = nd(rng);
  for (int i = 0; i < d; ++i) {
    double* r = &m[size_t(i) * d];
    for (int pass = 0; pass < 2; ++pass) {
      for (int j = 0; j < i; ++j) {
        const double* q = &m[size_t(j) * d];
        double dot = 0;
        for (int k = 0; k < d; ++k) dot += r[k] * q[k];
        for (int k = 0; k < d; ++k) r[k] -= dot * q[k];
      }
    }
    double norm = 0;
    for (int k = 0; k < d; ++k) norm += r[k] * r[k];
    norm = std::sqrt(norm);
    for (int k = 0; k < d; ++k) r[k] /= norm;
  }
  return std::vector<float>(m.begin(), m.end());
}

}  // namespace oscarkv::testing

#endif  // OSCARKV_TESTS_UNIT_TEST_UTIL_H_
