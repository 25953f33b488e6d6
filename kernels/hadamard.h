// Hadamard transform, bit-reversal permutation and the OSCAR composition
// R = U · H · P_br (DESIGN section 2).
#ifndef OSCARKV_KERNELS_HADAMARD_H_
#define OSCARKV_KERNELS_HADAMARD_H_

#include <vector>

#include "absl/status/statusor.h"

namespace oscarkv {

inline bool IsPowerOfTwo(int n) { return n > 0 && (n & (n - 1)) == 0; }

// In-place normalized fast Walsh–Hadamard transform of x[0..n), n a power of
// two: x <- x · H with H the normalized Sylvester matrix (H = Hᵀ, H·H = I).
void FastWalshHadamard(float* x, int n);
void FastWalshHadamard(double* x, int n);

// The explicit normalized Sylvester Hadamard matrix, n×n row-major.
std::vector<double> HadamardMatrix(int n);

// Reverses the low `bits` bits of i.
int BitReverse(int i, int bits);

// perm with perm[bitrev(i)] = order[i], where order = indices of `eigenvalues`
// sorted descending (stable, so ties keep index order). (z · P_br)_k = z[perm[k]].
absl::StatusOr<std::vector<int>> BitReversalPermutation(const std::vector<double>& eigenvalues);

// R = U · H · P_br for U (D×D row-major; column j is the eigenvector of
// eigenvalues[j]). Returns R row-major, applied to row vectors as x · R.
absl::StatusOr<std::vector<double>> ComposeRotation(const std::vector<double>& u,
                                                    const std::vector<double>& eigenvalues,
                                                    int dim);

// max_ij |(RᵀR − I)_ij| for a D×D row-major matrix.
double OrthogonalityError(const float* r, int dim);
double OrthogonalityError(const double* r, int dim);

}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_HADAMARD_H_
