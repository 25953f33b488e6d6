// A seeded synthetic KV-cache generator with the structure real caches have
// (DESIGN section 9): a few key channels of large magnitude (outlier channels,
// with a consistent sign), queries that are anisotropic and correlated with
// those channels, a shared low-rank "attention subspace" that keys and queries
// both live in, an attention sink on token 0 (its key aligned with the mean
// query, its value small), values with milder outliers, and a planted needle
// token that the designated query (query 0) attends to most.
//
// Two seeds: `seed` fixes the *distribution* of a layer (outlier channels,
// subspace, scales), `sample_seed` picks which tokens are drawn from it. To
// calibrate on some tokens and test on others, keep `seed` and change
// `sample_seed`.
//
// Everything is deterministic given (spec, layer) and independent of the
// machine: the PRNG is splitmix64 and normals come from a fixed inverse-CDF
// table. Pure functions; thread-safe.
#ifndef OSCARKV_KERNELS_CALIB_SYNTHETIC_H_
#define OSCARKV_KERNELS_CALIB_SYNTHETIC_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace oscarkv {

struct SyntheticSpec {
  int num_q_heads = 32;
  int num_kv_heads = 8;
  int head_dim = 128;
  int tokens = 4096;     // T
  int num_queries = 16;  // n query rows (decode queries); query 0 is the needle query
  uint64_t seed = 1;         // the layer's distribution
  uint64_t sample_seed = 0;  // which tokens / queries are drawn from it

  // Keys: mean + outlier channels + low-rank subspace + isotropic noise.
  int key_outlier_channels = 4;     // channels with large magnitude (same in all heads of a layer)
  float key_outlier_mean = 6.0f;    // |mean| of an outlier channel (sign random per channel)
  float key_outlier_std = 3.0f;     // std of an outlier channel
  int latent_rank = 8;              // dims of the shared key/query subspace beyond the outliers
  float key_latent_std = 1.5f;      // key std along each latent direction
  float key_noise_std = 0.3f;       // isotropic key noise per channel
  // Key directions with large variance that queries hardly look at (so the
  // keys' own covariance KᵀK ranks them first while the query covariance does
  // not: the DESIGN section 3 ablation).
  int key_private_rank = 2;
  float key_private_std = 4.0f;
  // Queries: mean along the outlier channels, strong variance on the subspace.
  float query_outlier_mean = 1.0f;  // mean query along each outlier channel (sign matches keys)
  float query_outlier_std = 3.0f;
  float query_latent_std = 1.5f;    // top latent direction; later ones decay by query_decay
  float query_decay = 0.8f;
  float query_noise_std = 0.3f;
  // Values: milder outliers (channels shared by the layer's heads), a mean,
  // a small per-head subspace, noise.
  int value_outlier_channels = 2;
  float value_outlier_std = 4.0f;
  int value_latent_rank = 4;
  float value_latent_std = 2.0f;
  float value_noise_std = 0.3f;
  float value_mean = 4.0f;          // |mean| along one random direction (per layer, sign per head)
  // Token 0 is an attention sink: the mean query's logit on it is this much
  // (scaled logit units, q·k/sqrt(D)) above the mean logit of other tokens.
  float sink_logit_boost = 6.0f;
  float sink_value_scale = 0.1f;
  // The needle's logit under query 0 is this much above every other token's,
  // for every query head of its KV group. Placed in [T/4, 3T/4).
  float needle_margin = 1.0f;
  bool plant_needle = true;

  // Optional real query statistics, e.g. from a RotationZoo file
  // (QueryBasisFromRotation): D×D row-major basis whose column j has variance
  // query_eigenvalues[j]. When set, queries are the outlier-channel mean plus
  // sum_j query_outlier_std·sqrt(l_j / l_max)·z_j·u_j (this replaces the
  // synthetic query variance), and the keys' latent subspace is spanned by the
  // top latent_rank columns. Empty: the synthetic model above.
  std::vector<double> query_basis;
  std::vector<double> query_eigenvalues;
};

// One layer of synthetic activations.
struct SyntheticLayer {
  int tokens = 0, num_q_heads = 0, num_kv_heads = 0, head_dim = 0, num_queries = 0;
  std::vector<uint16_t> k;  // bf16 bits [T][Hkv][D]
  std::vector<uint16_t> v;  // bf16 bits [T][Hkv][D]
  std::vector<float> q;     // fp32 [n][Hq][D], post-RoPE style
  int needle = -1;          // planted needle position, -1 when none
  int needle_query = 0;     // the query row that attends to the needle most
};

// Checks the spec: positive sizes, GQA divisibility, head_dim a power of two,
// channel counts <= D, finite non-negative scales, basis/eigenvalue shapes.
absl::Status ValidateSyntheticSpec(const SyntheticSpec& spec);

// Generates one layer. Fails only on an invalid spec.
absl::StatusOr<SyntheticLayer> GenerateSyntheticLayer(const SyntheticSpec& spec, int layer);

// Sets one numeric knob of `spec` by its field name (e.g. "key_private_std",
// "needle_margin", "latent_rank"), for command-line overrides. InvalidArgument
// for an unknown name or a value that does not parse.
absl::Status SetSyntheticKnob(SyntheticSpec* spec, const std::string& name, const std::string& value);
// "name=value,name=value".
absl::Status SetSyntheticKnobs(SyntheticSpec* spec, const std::string& assignments);

// Recovers the query eigenbasis from an OSCAR rotation R = U·H·P_br:
// U = R · P_brᵀ · H, where P_br is built from `eigenvalues` (in U's column
// order). Returns U (D×D row-major, column j ↔ eigenvalues[j]); the query
// covariance is C = U·diag(eigenvalues)·Uᵀ.
absl::StatusOr<std::vector<double>> QueryBasisFromRotation(const std::vector<float>& rotation,
                                                           const std::vector<float>& eigenvalues,
                                                           int dim);

// Splitmix64 stream and standard normals, exposed for tests and calibration.
class SyntheticRng {
 public:
  explicit SyntheticRng(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double Uniform() { return (Next() >> 11) * (1.0 / 9007199254740992.0); }  // [0, 1)
  // Two standard normals from one 64-bit draw (inverse-CDF table, |z| < 5.4).
  void Normal2(float* a, float* b);
  float Normal() {
    float a, b;
    Normal2(&a, &b);
    return a;
  }

 private:
  uint64_t state_;
};

}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_CALIB_SYNTHETIC_H_
