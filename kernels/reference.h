// fp64 references for tests: attention over a dense cache. Slow and simple on
// purpose; every fast path is compared against these.
#ifndef OSCARKV_KERNELS_REFERENCE_H_
#define OSCARKV_KERNELS_REFERENCE_H_

#include <vector>

namespace oscarkv {

// Softmax attention of one query token (GQA). q [Hq][D]; k, v [T][Hkv][D].
// Returns out [Hq][D]; lse (natural log of Σ exp(scale·q·k)) per head in *lse.
std::vector<double> ReferenceAttention(const std::vector<double>& q, const std::vector<double>& k,
                                       const std::vector<double>& v, int tokens, int num_q_heads,
                                       int num_kv_heads, int head_dim, double scale,
                                       std::vector<double>* lse);

}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_REFERENCE_H_
