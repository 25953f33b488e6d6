#include "kernels/hadamard.h"

#include <algorithm>
#include <numeric>
#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/test_util.h"

namespace oscarkv {
namespace {

using ::testing::ElementsAre;

class HadamardDims : public ::testing::TestWithParam<int> {};

TEST_P(HadamardDims, MatrixIsOrthogonalAndSymmetric) {
  const int d = GetParam();
  const std::vector<double> h = HadamardMatrix(d);
  EXPECT_LT(OrthogonalityError(h.data(), d), 1e-12);
  for (int i = 0; i < d; ++i)
    for (int j = 0; j < d; ++j) ASSERT_EQ(h[i * d + j], h[j * d + i]);
}

TEST_P(HadamardDims, FastTransformEqualsMatrixProduct) {
  const int d = GetParam();
  const std::vector<double> h = HadamardMatrix(d);
  std::vector<float> x = testing::RandomFloats(d, 7 + d);
  std::vector<double> want(d, 0.0);
  for (int i = 0; i < d; ++i)
    for (int j = 0; j < d; ++j) want[j] += double(x[i]) * h[i * d + j];
  FastWalshHadamard(x.data(), d);
  for (int j = 0; j < d; ++j) EXPECT_NEAR(x[j], want[j], 1e-5) << "j=" << j;
}

TEST_P(HadamardDims, TransformTwiceIsIdentity) {
  const int d = GetParam();
  std::vector<double> x(d);
  std::iota(x.begin(), x.end(), 1.0);
  std::vector<double> y = x;
  FastWalshHadamard(y.data(), d);
  FastWalshHadamard(y.data(), d);
  for (int j = 0; j < d; ++j) EXPECT_NEAR(y[j], x[j], 1e-9);
}

TEST_P(HadamardDims, BitReversalIsAPermutation) {
  const int d = GetParam();
  std::vector<double> eig = std::vector<double>(d);
  std::mt19937 rng(d);
  for (auto& e : eig) e = std::uniform_real_distribution<double>(0, 1)(rng);
  auto perm = BitReversalPermutation(eig);
  ASSERT_TRUE(perm.ok());
  std::vector<int> sorted = *perm;
  std::sort(sorted.begin(), sorted.end());
  std::vector<int> iota(d);
  std::iota(iota.begin(), iota.end(), 0);
  EXPECT_EQ(sorted, iota);
}

TEST_P(HadamardDims, ComposedRotationIsOrthogonalAndMatchesDefinition) {
  const int d = GetParam();
  const std::vector<float> uf = testing::RandomOrthogonal(d, 11 * d);
  const std::vector<double> u(uf.begin(), uf.end());
  std::vector<double> eig(d);
  for (int i = 0; i < d; ++i) eig[i] = std::pow(0.9, (i * 37) % d);  // scrambled order
  auto r = ComposeRotation(u, eig, d);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_LT(OrthogonalityError(r->data(), d), 1e-5);
  // R = U · H · P_br with (z · P_br)_k = z[perm[k]]: column k of R is column perm[k] of U·H.
  const std::vector<double> h = HadamardMatrix(d);
  auto perm = BitReversalPermutation(eig);
  ASSERT_TRUE(perm.ok());
  for (int i = 0; i < d; i += 7) {
    for (int k = 0; k < d; ++k) {
      double uh = 0;
      for (int m = 0; m < d; ++m) uh += u[i * d + m] * h[m * d + (*perm)[k]];
      ASSERT_NEAR((*r)[i * d + k], uh, 1e-9) << i << "," << k;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(HeadDims, HadamardDims, ::testing::Values(64, 128, 256));

TEST(BitReversal, MatchesDesignExampleForD128) {
  // Eigenvalues already descending: order = identity, so perm[bitrev(i)] = i.
  std::vector<double> eig(128);
  for (int i = 0; i < 128; ++i) eig[i] = 128 - i;
  auto perm = BitReversalPermutation(eig);
  ASSERT_TRUE(perm.ok());
  // order[0] -> coordinate 0, order[1] -> 64, order[2] -> 32, order[3] -> 96.
  EXPECT_EQ((*perm)[0], 0);
  EXPECT_EQ((*perm)[64], 1);
  EXPECT_EQ((*perm)[32], 2);
  EXPECT_EQ((*perm)[96], 3);
  EXPECT_EQ(BitReverse(1, 7), 64);
  EXPECT_EQ(BitReverse(3, 7), 96);
}

TEST(BitReversal, UsesDescendingEigenvalueOrder) {
  // Ascending eigenvalues (as RotationZoo stores them): order = 3,2,1,0.
  auto perm = BitReversalPermutation({1.0, 2.0, 3.0, 4.0});
  ASSERT_TRUE(perm.ok());
  // bitrev over 2 bits: 0->0, 1->2, 2->1, 3->3.
  EXPECT_THAT(*perm, ElementsAre(3, 1, 2, 0));
}

TEST(BitReversal, RejectsNonPowerOfTwo) {
  auto perm = BitReversalPermutation(std::vector<double>(96, 1.0));
  EXPECT_EQ(perm.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(perm.status().message()), ::testing::HasSubstr("power-of-two"));
}

TEST(ComposeRotation, RejectsMismatchedShapes) {
  auto r = ComposeRotation(std::vector<double>(100, 0.0), std::vector<double>(128, 1.0), 128);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace oscarkv
