#include "kernels/hadamard.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"

namespace oscarkv {
namespace {

template <typename T>
void Fwht(T* x, int n) {
  for (int len = 1; len < n; len <<= 1) {
    for (int i = 0; i < n; i += 2 * len) {
      for (int j = i; j < i + len; ++j) {
        const T a = x[j], b = x[j + len];
        x[j] = a + b;
        x[j + len] = a - b;
      }
    }
  }
  const T norm = T(1) / std::sqrt(T(n));
  for (int i = 0; i < n; ++i) x[i] *= norm;
}

template <typename T>
double OrthError(const T* r, int d) {
  double worst = 0.0;
  for (int i = 0; i < d; ++i) {
    for (int j = i; j < d; ++j) {
      double dot = 0.0;
      for (int k = 0; k < d; ++k) dot += double(r[k * d + i]) * double(r[k * d + j]);
      worst = std::max(worst, std::abs(dot - (i == j ? 1.0 : 0.0)));
    }
  }
  return worst;
}

}  // namespace

void FastWalshHadamard(float* x, int n) { Fwht(x, n); }
void FastWalshHadamard(double* x, int n) { Fwht(x, n); }

std::vector<double> HadamardMatrix(int n) {
  std::vector<double> h(size_t(n) * n);
  const double norm = 1.0 / std::sqrt(double(n));
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      // Sylvester: H[i][j] = (-1)^popcount(i & j).
      h[size_t(i) * n + j] = (__builtin_popcount(unsigned(i & j)) & 1) ? -norm : norm;
    }
  }
  return h;
}

int BitReverse(int i, int bits) {
  int r = 0;
  for (int b = 0; b < bits; ++b) r |= ((i >> b) & 1) << (bits - 1 - b);
  return r;
}

absl::StatusOr<std::vector<int>> BitReversalPermutation(const std::vector<double>& eigenvalues) {
  const int d = static_cast<int>(eigenvalues.size());
  if (!IsPowerOfTwo(d)) {
    return absl::InvalidArgumentError(
        absl::StrCat("bit reversal needs a power-of-two dimension, got ", d));
  }
  int bits = 0;
  while ((1 << bits) < d) ++bits;
  std::vector<int> order(d);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return eigenvalues[a] > eigenvalues[b]; });
  std::vector<int> perm(d);
  for (int i = 0; i < d; ++i) perm[BitReverse(i, bits)] = order[i];
  return perm;
}

absl::StatusOr<std::vector<double>> ComposeRotation(const std::vector<double>& u,
                                                    const std::vector<double>& eigenvalues,
                                                    int dim) {
  if (!IsPowerOfTwo(dim)) {
    return absl::InvalidArgumentError(absl::StrCat("head_dim must be a power of two, got ", dim));
  }
  if (u.size() != size_t(dim) * dim || eigenvalues.size() != size_t(dim)) {
    return absl::InvalidArgumentError(absl::StrCat("ComposeRotation: U must be ", dim, "x", dim,
                                                   " and eigenvalues ", dim, " long"));
  }
  auto perm = BitReversalPermutation(eigenvalues);
  if (!perm.ok()) return perm.status();
  // UH = U · H: each row of U transformed by the FWHT.
  std::vector<double> uh(u);
  for (int i = 0; i < dim; ++i) FastWalshHadamard(&uh[size_t(i) * dim], dim);
  std::vector<double> r(size_t(dim) * dim);
  for (int i = 0; i < dim; ++i) {
    for (int k = 0; k < dim; ++k) r[size_t(i) * dim + k] = uh[size_t(i) * dim + (*perm)[k]];
  }
  return r;
}

double OrthogonalityError(const float* r, int dim) { return OrthError(r, dim); }
double OrthogonalityError(const double* r, int dim) { return OrthError(r, dim); }

}  // namespace oscarkv
