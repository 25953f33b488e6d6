// The emulation tests' fp64 reference: softmax attention of one head over
// given base-2 logits and value rows, against a warp's un-normalized state
// (acc, running max m, running sum l, as Finish writes them).
#ifndef OSCARKV_TESTS_GPU_SOFTMAX_CHECK_H_
#define OSCARKV_TESTS_GPU_SOFTMAX_CHECK_H_

#include <algorithm>
#include <cmath>
#include <iterator>
#include <vector>

#include "gtest/gtest.h"

namespace oscarkv {

// What a warp's Finish writes for up to 8 heads of D <= 256: acc [head][D],
// m, l; NaN until written.
struct FinishedState {
  static constexpr int kMaxHeads = 8, kMaxDim = 256;  // a block's query heads, head dim
  float o[kMaxHeads][kMaxDim];
  float m[kMaxHeads], l[kMaxHeads];
  FinishedState() {
    for (auto& row : o) std::fill(std::begin(row), std::end(row), std::nanf(""));
    std::fill(std::begin(m), std::end(m), std::nanf(""));
    std::fill(std::begin(l), std::end(l), std::nanf(""));
  }
};

struct SoftmaxErrors {
  double o = 0.0;  // relative L2 error of o = acc / l
  double l = 0.0;  // relative error of l, rescaled to the reference's max
};

// value(i, d): dim d of the value row of logits[i]. Every element of acc / l
// must be finite.
template <class Value>
SoftmaxErrors CompareWithSoftmax(const std::vector<double>& logits, Value value, int D,
                                 const float* acc, float m, float l) {
  const double M = *std::max_element(logits.begin(), logits.end());
  std::vector<double> o(D, 0.0);
  double sum = 0.0;
  for (size_t i = 0; i < logits.size(); ++i) {
    const double w = std::exp2(logits[i] - M);
    sum += w;
    for (int d = 0; d < D; ++d) o[d] += w * value(i, d);
  }
  double num = 0.0, den = 0.0;
  for (int d = 0; d < D; ++d) {
    const double got = double(acc[d]) / l, want = o[d] / sum;
    EXPECT_TRUE(std::isfinite(got)) << "dim " << d;
    num += (got - want) * (got - want);
    den += want * want;
  }
  SoftmaxErrors err;
  err.o = std::sqrt(num / den);
  err.l = std::fabs(double(l) * std::exp2(double(m) - M) - sum) / sum;
  return err;
}

}  // namespace oscarkv

#endif  // OSCARKV_TESTS_GPU_SOFTMAX_CHECK_H_
