#include "kernels/calib/synthetic.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <numeric>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/hadamard.h"
#include "kernels/numeric.h"
#include "kernels/status_macros.h"

namespace oscarkv {
namespace {

// Acklam's rational approximation of the standard normal quantile (|rel err| < 1.2e-9).
double NormalQuantile(double p) {
  static const double a[] = {-3.969683028665376e+01, 2.209460984245205e+02,
                              -2.759285104469687e+02, 1.383577518672690e+02,
                              -3.066479806614716e+01, 2.506628277459239e+00};
  static const double b[] = {-5.447609879822406e+01, 1.615858368580409e+02,
                             -1.556989798598866e+02, 6.680131188771972e+01,
                             -1.328068155288572e+01};
  static const double c[] = {-7.784894002430293e-03, -3.223964580411365e-01,
                             -2.400758277161838e+00, -2.549671010224192e+00,
                             4.374664141464968e+00,  2.938163982698783e+00};
  static const double d[] = {7.784695709041462e-03, 3.224671290700398e-01,
                             2.445134137142996e+00, 3.754408661907416e+00};
  const double plow = 0.02425;
  if (p < plow) {
    double q = std::sqrt(-2 * std::log(p));
    return (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) /
           ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1);
  }
  if (p > 1 - plow) {
    double q = std::sqrt(-2 * std::log(1 - p));
    return -(((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) /
           ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1);
  }
  double q = p - 0.5, r = q * q;
  return (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q /
         (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1);
}

// Quantile table at u = i / 4096; the two end cells use the exact formula.
constexpr int kTableBits = 12;
constexpr int kTableSize = 1 << kTableBits;

struct QuantileTable {
  float v[kTableSize + 1];
  QuantileTable() {
    for (int i = 1; i < kTableSize; ++i) v[i] = float(NormalQuantile(double(i) / kTableSize));
    v[0] = v[1];
    v[kTableSize] = v[kTableSize - 1];
  }
};

const QuantileTable& Table() {
  static const QuantileTable* table = new QuantileTable();  // immutable, built once
  return *table;
}

inline float NormalFrom32(uint32_t x, const QuantileTable& t) {
  const uint32_t idx = x >> (32 - kTableBits);
  if (idx == 0 || idx == kTableSize - 1) {
    return float(NormalQuantile((double(x) + 0.5) * (1.0 / 4294967296.0)));
  }
  const float frac = float(x & ((1u << (32 - kTableBits)) - 1)) * (1.0f / (1u << (32 - kTableBits)));
  return t.v[idx] + frac * (t.v[idx + 1] - t.v[idx]);
}

uint64_t Mix(uint64_t a, uint64_t b) {
  SyntheticRng r(a ^ (b * 0xd1b54a32d192ed03ull + 0x8cb92ba72f3d8dd7ull));
  r.Next();
  return r.Next();
}

uint64_t StreamSeed(uint64_t seed, int layer, int head, uint64_t stream) {
  return Mix(Mix(Mix(seed, uint64_t(layer) + 1), uint64_t(head) + 1000003), stream);
}

// Distinct channels drawn uniformly.
std::vector<int> PickChannels(SyntheticRng& rng, int dim, int count) {
  std::vector<int> all(dim);
  std::iota(all.begin(), all.end(), 0);
  for (int i = 0; i < count; ++i) {
    int j = i + int(rng.Uniform() * (dim - i));
    std::swap(all[i], all[j]);
  }
  all.resize(count);
  return all;
}

// A random unit vector orthogonal to `basis` (rows of length dim, orthonormal).
std::vector<float> RandomOrthogonalDirection(SyntheticRng& rng, int dim,
                                             const std::vector<std::vector<float>>& basis) {
  std::vector<double> x(dim);
  for (;;) {
    for (int i = 0; i < dim; ++i) x[i] = rng.Normal();
    for (int pass = 0; pass < 2; ++pass) {
      for (const auto& b : basis) {
        double dot = 0;
        for (int i = 0; i < dim; ++i) dot += x[i] * b[i];
        for (int i = 0; i < dim; ++i) x[i] -= dot * b[i];
      }
    }
    double n = 0;
    for (double e : x) n += e * e;
    if (n > 1e-6) {
      std::vector<float> out(dim);
      for (int i = 0; i < dim; ++i) out[i] = float(x[i] / std::sqrt(n));
      return out;
    }
  }
}

// The fixed (seed, layer, kv head) structure of a layer.
struct HeadModel {
  std::vector<int> key_channels;
  std::vector<float> key_sign;
  std::vector<std::vector<float>> latent;  // key/query subspace directions (unit)
  std::vector<std::vector<float>> key_private;  // key-only directions (unit)
  std::vector<float> latent_query_std;     // per direction
  std::vector<std::vector<float>> q_head_mult;  // [g][n_out + latent] per query head
  std::vector<int> value_channels;
  std::vector<std::vector<float>> value_latent;
  std::vector<float> value_mean;  // D values
  std::vector<double> query_basis_scale;   // sqrt(eigenvalue) per basis column (real mode)
};

HeadModel BuildHeadModel(const SyntheticSpec& s, int layer, int head) {
  const int d = s.head_dim;
  SyntheticRng rng(StreamSeed(s.seed, layer, head, 0x5354525543ull));
  HeadModel m;
  // Outlier channels are the same indices in every KV head of a layer (as the
  // low-frequency RoPE dims are in real models); signs and the rest differ.
  SyntheticRng layer_rng(StreamSeed(s.seed, layer, -2, 0x4348414eull));
  m.key_channels = PickChannels(layer_rng, d, s.key_outlier_channels);
  for (size_t i = 0; i < m.key_channels.size(); ++i) {
    m.key_sign.push_back(rng.Uniform() < 0.5 ? -1.0f : 1.0f);
  }
  std::vector<std::vector<float>> basis;
  for (int c : m.key_channels) {
    std::vector<float> e(d, 0.0f);
    e[c] = 1.0f;
    basis.push_back(e);
  }
  // Key-only directions, shared by the layer's heads like a key bias would be.
  for (int j = 0; j < s.key_private_rank; ++j) {
    m.key_private.push_back(RandomOrthogonalDirection(layer_rng, d, basis));
    basis.push_back(m.key_private.back());
  }
  if (s.query_basis.empty()) {
    for (int j = 0; j < s.latent_rank; ++j) {
      m.latent.push_back(RandomOrthogonalDirection(rng, d, basis));
      basis.push_back(m.latent.back());
      m.latent_query_std.push_back(s.query_latent_std * std::pow(s.query_decay, float(j)));
    }
  } else {
    // Real mode: the top latent_rank eigen-directions of the given covariance.
    std::vector<int> order(d);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      return s.query_eigenvalues[a] > s.query_eigenvalues[b];
    });
    const double top = std::max(s.query_eigenvalues[order[0]], 1e-30);
    m.query_basis_scale.resize(d);
    for (int j = 0; j < d; ++j) {
      m.query_basis_scale[j] =
          s.query_outlier_std * std::sqrt(std::max(s.query_eigenvalues[j], 0.0) / top);
    }
    for (int j = 0; j < s.latent_rank; ++j) {
      std::vector<float> u(d);
      for (int i = 0; i < d; ++i) u[i] = float(s.query_basis[size_t(i) * d + order[j]]);
      m.latent.push_back(u);
      basis.push_back(u);
      m.latent_query_std.push_back(0.0f);  // queries come from the full basis instead
    }
  }
  const int g = s.num_q_heads / s.num_kv_heads;
  const int dirs = s.key_outlier_channels + s.latent_rank;
  m.q_head_mult.assign(g, std::vector<float>(dirs));
  for (auto& row : m.q_head_mult) {
    for (float& x : row) x = float(0.6 + 0.8 * rng.Uniform());
  }
  // Value outlier channels and the value mean direction are shared by the
  // layer's heads too (the sign of the mean differs per head).
  m.value_channels = PickChannels(layer_rng, d, s.value_outlier_channels);
  std::vector<std::vector<float>> vbasis;
  for (int j = 0; j < s.value_latent_rank; ++j) {
    vbasis.push_back(RandomOrthogonalDirection(rng, d, vbasis));
  }
  m.value_latent = vbasis;
  m.value_mean = RandomOrthogonalDirection(layer_rng, d, {});
  const float mean_sign = rng.Uniform() < 0.5 ? -1.0f : 1.0f;
  for (float& x : m.value_mean) x *= mean_sign * s.value_mean;
  return m;
}

bool FiniteNonNegative(float x) { return std::isfinite(x) && x >= 0.0f; }

}  // namespace

void SyntheticRng::Normal2(float* a, float* b) {
  const QuantileTable& t = Table();
  const uint64_t x = Next();
  *a = NormalFrom32(uint32_t(x), t);
  *b = NormalFrom32(uint32_t(x >> 32), t);
}

absl::Status ValidateSyntheticSpec(const SyntheticSpec& s) {
  if (s.num_q_heads <= 0 || s.num_kv_heads <= 0 || s.tokens <= 0 || s.num_queries <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "synthetic spec: sizes must be positive (q_heads ", s.num_q_heads, ", kv_heads ",
        s.num_kv_heads, ", tokens ", s.tokens, ", queries ", s.num_queries, ")"));
  }
  if (s.num_q_heads % s.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("synthetic spec: num_q_heads ", s.num_q_heads,
                                                   " is not a multiple of num_kv_heads ",
                                                   s.num_kv_heads));
  }
  if (!IsPowerOfTwo(s.head_dim) || s.head_dim < 8 || s.head_dim > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("synthetic spec: head_dim ", s.head_dim, " is not a power of two in [8, 1024]"));
  }
  if (s.key_outlier_channels < 0 || s.latent_rank < 0 || s.key_private_rank < 0 ||
      s.key_outlier_channels + s.latent_rank + s.key_private_rank > s.head_dim || s.value_outlier_channels < 0 ||
      s.value_latent_rank < 0 || s.key_outlier_channels + s.latent_rank > s.head_dim ||
      s.value_outlier_channels > s.head_dim || s.value_latent_rank > s.head_dim) {
    return absl::InvalidArgumentError(
        "synthetic spec: outlier channel and latent rank counts must be >= 0 and fit in head_dim");
  }
  for (float x : {s.key_outlier_mean, s.key_outlier_std, s.key_latent_std, s.key_noise_std,
                  s.key_private_std, s.value_mean, s.query_outlier_mean, s.query_outlier_std, s.query_latent_std,
                  s.query_noise_std, s.value_outlier_std, s.value_latent_std, s.value_noise_std,
                  s.sink_logit_boost, s.sink_value_scale, s.needle_margin}) {
    if (!FiniteNonNegative(x)) {
      return absl::InvalidArgumentError("synthetic spec: scales must be finite and >= 0");
    }
  }
  if (!(s.query_decay > 0.0f && s.query_decay <= 1.0f)) {
    return absl::InvalidArgumentError("synthetic spec: query_decay must be in (0, 1]");
  }
  if (!s.query_basis.empty() || !s.query_eigenvalues.empty()) {
    const size_t d = size_t(s.head_dim);
    if (s.query_basis.size() != d * d || s.query_eigenvalues.size() != d) {
      return absl::InvalidArgumentError(absl::StrCat(
          "synthetic spec: query_basis must be ", d, "x", d, " and query_eigenvalues ", d,
          " values (got ", s.query_basis.size(), " and ", s.query_eigenvalues.size(), ")"));
    }
    for (double x : s.query_basis) {
      if (!std::isfinite(x)) return absl::InvalidArgumentError("synthetic spec: non-finite query_basis");
    }
    for (double x : s.query_eigenvalues) {
      if (!std::isfinite(x)) {
        return absl::InvalidArgumentError("synthetic spec: non-finite query_eigenvalues");
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<SyntheticLayer> GenerateSyntheticLayer(const SyntheticSpec& s, int layer) {
  OSCARKV_RETURN_IF_ERROR(ValidateSyntheticSpec(s));
  if (layer < 0) return absl::InvalidArgumentError(absl::StrCat("synthetic layer ", layer, " < 0"));
  const int d = s.head_dim, hkv = s.num_kv_heads, hq = s.num_q_heads, t_count = s.tokens;
  const int g = hq / hkv, n = s.num_queries;
  const float inv_sqrt_d = 1.0f / std::sqrt(float(d));
  SyntheticLayer out;
  out.tokens = t_count;
  out.num_q_heads = hq;
  out.num_kv_heads = hkv;
  out.head_dim = d;
  out.num_queries = n;
  out.k.resize(size_t(t_count) * hkv * d);
  out.v.resize(size_t(t_count) * hkv * d);
  out.q.resize(size_t(n) * hq * d);
  SyntheticRng layer_rng(StreamSeed(s.seed, layer, -1, s.sample_seed * 7 + 3));
  out.needle = s.plant_needle ? t_count / 4 + int(layer_rng.Uniform() * (t_count / 2)) : -1;
  if (out.needle >= t_count) out.needle = t_count - 1;
  out.needle_query = 0;

  // Each kv head has random streams of its own and writes only its own
  // slices of k, v and q, so the heads run on threads of their own with the
  // same output, bit for bit, as one after another.
  auto generate_head = [&](int h) {
    std::vector<float> row(d), mean_q(d);
    const HeadModel m = BuildHeadModel(s, layer, h);
    const int n_out = int(m.key_channels.size());
    // Queries of this group.
    SyntheticRng qrng(StreamSeed(s.seed, layer, h, s.sample_seed * 7 + 1));
    std::fill(mean_q.begin(), mean_q.end(), 0.0f);
    for (int c = 0; c < n_out; ++c) mean_q[m.key_channels[c]] = m.key_sign[c] * s.query_outlier_mean;
    for (int r = 0; r < n; ++r) {
      for (int i = 0; i < g; ++i) {
        float* q = &out.q[(size_t(r) * hq + h * g + i) * d];
        for (int j = 0; j < d; j += 2) qrng.Normal2(&q[j], &q[j + 1]);
        for (int j = 0; j < d; ++j) q[j] = q[j] * s.query_noise_std + mean_q[j];
        const auto& mult = m.q_head_mult[i];
        for (int c = 0; c < n_out && m.query_basis_scale.empty(); ++c) {
          q[m.key_channels[c]] +=
              qrng.Normal() * s.query_outlier_std * std::pow(s.query_decay, float(c)) * mult[c];
        }
        if (m.query_basis_scale.empty()) {
          for (size_t j = 0; j < m.latent.size(); ++j) {
            const float a = qrng.Normal() * m.latent_query_std[j] * mult[n_out + j];
            for (int x = 0; x < d; ++x) q[x] += a * m.latent[j][x];
          }
        } else {
          for (int col = 0; col < d; ++col) {
            const float a = float(qrng.Normal() * m.query_basis_scale[col]);
            if (a == 0.0f) continue;
            for (int x = 0; x < d; ++x) q[x] += a * float(s.query_basis[size_t(x) * d + col]);
          }
        }
      }
    }
    // Keys and values.
    SyntheticRng krng(StreamSeed(s.seed, layer, h, s.sample_seed * 7 + 2));
    std::vector<float> vrow(d);
    for (int t = 0; t < t_count; ++t) {
      for (int j = 0; j < d; j += 2) krng.Normal2(&row[j], &row[j + 1]);
      for (int j = 0; j < d; ++j) row[j] *= s.key_noise_std;
      for (int c = 0; c < n_out; ++c) {
        row[m.key_channels[c]] += m.key_sign[c] * s.key_outlier_mean + krng.Normal() * s.key_outlier_std;
      }
      for (const auto& dir : m.latent) {
        const float a = krng.Normal() * s.key_latent_std;
        for (int x = 0; x < d; ++x) row[x] += a * dir[x];
      }
      for (const auto& dir : m.key_private) {
        const float a = krng.Normal() * s.key_private_std;
        for (int x = 0; x < d; ++x) row[x] += a * dir[x];
      }
      for (int j = 0; j < d; j += 2) krng.Normal2(&vrow[j], &vrow[j + 1]);
      for (int j = 0; j < d; ++j) vrow[j] = vrow[j] * s.value_noise_std + m.value_mean[j];
      for (int c : m.value_channels) vrow[c] += krng.Normal() * s.value_outlier_std;
      for (const auto& dir : m.value_latent) {
        const float a = krng.Normal() * s.value_latent_std;
        for (int x = 0; x < d; ++x) vrow[x] += a * dir[x];
      }
      if (t == 0) {
        // Sink: key along the mean query, large enough for a logit boost; small value.
        double mq_norm2 = 0, mq_dot_mk = 0;
        for (int c = 0; c < n_out; ++c) {
          mq_norm2 += double(s.query_outlier_mean) * s.query_outlier_mean;
          mq_dot_mk += double(s.query_outlier_mean) * s.key_outlier_mean;
        }
        std::vector<float> u(d, 0.0f);
        double alpha;
        if (mq_norm2 > 0) {
          for (int j = 0; j < d; ++j) u[j] = float(mean_q[j] / std::sqrt(mq_norm2));
          alpha = (s.sink_logit_boost * std::sqrt(double(d)) + mq_dot_mk) / std::sqrt(mq_norm2);
        } else {
          u[n_out > 0 ? m.key_channels[0] : 0] = 1.0f;
          alpha = s.sink_logit_boost * std::sqrt(double(d));
        }
        for (int j = 0; j < d; ++j) row[j] = 0.1f * row[j] + float(alpha) * u[j];
        for (float& x : vrow) x *= s.sink_value_scale;
      }
      uint16_t* kd = &out.k[(size_t(t) * hkv + h) * d];
      uint16_t* vd = &out.v[(size_t(t) * hkv + h) * d];
      for (int j = 0; j < d; ++j) {
        kd[j] = FloatToBf16(row[j]);
        vd[j] = FloatToBf16(vrow[j]);
      }
    }
    // Needle: push the needle key along query 0's group direction until every
    // query head of the group (with positive alignment) prefers it by the margin.
    if (out.needle >= 0) {
      const int p = out.needle;
      std::vector<float> u(d, 0.0f);
      for (int i = 0; i < g; ++i) {
        const float* q = &out.q[(size_t(out.needle_query) * hq + h * g + i) * d];
        for (int j = 0; j < d; ++j) u[j] += q[j];
      }
      double un = 0;
      for (float x : u) un += double(x) * x;
      un = std::sqrt(std::max(un, 1e-30));
      for (float& x : u) x = float(x / un);
      std::vector<float> base(d);
      uint16_t* kd = &out.k[(size_t(p) * hkv + h) * d];
      for (int j = 0; j < d; ++j) base[j] = Bf16ToFloat(kd[j]);
      double alpha = 0;
      for (int i = 0; i < g; ++i) {
        const float* q = &out.q[(size_t(out.needle_query) * hq + h * g + i) * d];
        double best = -1e300;
        for (int t = 0; t < t_count; ++t) {
          if (t == p) continue;
          const uint16_t* k = &out.k[(size_t(t) * hkv + h) * d];
          float dot = 0;
          for (int j = 0; j < d; ++j) dot += q[j] * Bf16ToFloat(k[j]);
          best = std::max(best, double(dot) * inv_sqrt_d);
        }
        double qb = 0, qu = 0;
        for (int j = 0; j < d; ++j) {
          qb += double(q[j]) * base[j];
          qu += double(q[j]) * u[j];
        }
        if (qu <= 1e-9) continue;
        const double need = ((best + s.needle_margin) / inv_sqrt_d - qb) / qu;
        alpha = std::max(alpha, need);
      }
      // A little extra so that bf16 rounding cannot eat the margin.
      alpha *= 1.002;
      for (int j = 0; j < d; ++j) kd[j] = FloatToBf16(base[j] + float(alpha) * u[j]);
    }
  };
  std::atomic<int> next_head{0};
  auto work = [&] {
    for (int h = next_head++; h < hkv; h = next_head++) generate_head(h);
  };
  const int threads = std::max(1, std::min<int>(hkv, std::thread::hardware_concurrency()));
  std::vector<std::thread> workers;
  try {
    for (int w = 1; w < threads; ++w) workers.emplace_back(work);
  } catch (const std::system_error&) {
    // No more threads to be had: this one takes the heads left over.
  }
  work();
  for (std::thread& t : workers) t.join();
  return out;
}

absl::Status SetSyntheticKnob(SyntheticSpec* s, const std::string& name, const std::string& value) {
  const struct {
    const char* name;
    float* f;
    int* i;
  } knobs[] = {
      {"key_outlier_channels", nullptr, &s->key_outlier_channels},
      {"key_outlier_mean", &s->key_outlier_mean, nullptr},
      {"key_outlier_std", &s->key_outlier_std, nullptr},
      {"latent_rank", nullptr, &s->latent_rank},
      {"key_latent_std", &s->key_latent_std, nullptr},
      {"key_noise_std", &s->key_noise_std, nullptr},
      {"key_private_rank", nullptr, &s->key_private_rank},
      {"key_private_std", &s->key_private_std, nullptr},
      {"query_outlier_mean", &s->query_outlier_mean, nullptr},
      {"query_outlier_std", &s->query_outlier_std, nullptr},
      {"query_latent_std", &s->query_latent_std, nullptr},
      {"query_decay", &s->query_decay, nullptr},
      {"query_noise_std", &s->query_noise_std, nullptr},
      {"value_outlier_channels", nullptr, &s->value_outlier_channels},
      {"value_outlier_std", &s->value_outlier_std, nullptr},
      {"value_latent_rank", nullptr, &s->value_latent_rank},
      {"value_latent_std", &s->value_latent_std, nullptr},
      {"value_noise_std", &s->value_noise_std, nullptr},
      {"value_mean", &s->value_mean, nullptr},
      {"sink_logit_boost", &s->sink_logit_boost, nullptr},
      {"sink_value_scale", &s->sink_value_scale, nullptr},
      {"needle_margin", &s->needle_margin, nullptr},
  };
  for (const auto& k : knobs) {
    if (name != k.name) continue;
    char* end = nullptr;
    const double v = std::strtod(value.c_str(), &end);
    if (value.empty() || end == nullptr || *end != '\0' || !std::isfinite(v)) {
      return absl::InvalidArgumentError(absl::StrCat("synthetic knob ", name, ": \"", value,
                                                     "\" is not a number"));
    }
    if (k.f != nullptr) {
      *k.f = float(v);
    } else {
      if (v != std::floor(v) || v < 0 || v > 4096) {
        return absl::InvalidArgumentError(absl::StrCat("synthetic knob ", name, " needs a small integer"));
      }
      *k.i = int(v);
    }
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown synthetic knob \"", name, "\""));
}

absl::Status SetSyntheticKnobs(SyntheticSpec* spec, const std::string& assignments) {
  size_t pos = 0;
  while (pos < assignments.size()) {
    size_t comma = assignments.find(',', pos);
    if (comma == std::string::npos) comma = assignments.size();
    const std::string item = assignments.substr(pos, comma - pos);
    const size_t eq = item.find('=');
    if (eq == std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat("synthetic knob \"", item, "\": want name=value"));
    }
    OSCARKV_RETURN_IF_ERROR(SetSyntheticKnob(spec, item.substr(0, eq), item.substr(eq + 1)));
    pos = comma + 1;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<double>> QueryBasisFromRotation(const std::vector<float>& rotation,
                                                           const std::vector<float>& eigenvalues,
                                                           int dim) {
  if (!IsPowerOfTwo(dim)) {
    return absl::InvalidArgumentError(absl::StrCat("dimension ", dim, " is not a power of two"));
  }
  if (rotation.size() != size_t(dim) * dim || eigenvalues.size() != size_t(dim)) {
    return absl::InvalidArgumentError(absl::StrCat("rotation must be ", dim, "x", dim,
                                                   " and eigenvalues ", dim, " values"));
  }
  std::vector<double> eig(eigenvalues.begin(), eigenvalues.end());
  OSCARKV_ASSIGN_OR_RETURN(std::vector<int> perm, BitReversalPermutation(eig));
  // z = y · P_brᵀ: z[perm[k]] = y[k]. Then U row i = (R row i · P_brᵀ) · H.
  std::vector<double> u(size_t(dim) * dim);
  std::vector<double> z(dim);
  for (int i = 0; i < dim; ++i) {
    for (int k = 0; k < dim; ++k) z[perm[k]] = rotation[size_t(i) * dim + k];
    FastWalshHadamard(z.data(), dim);
    for (int j = 0; j < dim; ++j) u[size_t(i) * dim + j] = z[j];
  }
  return u;
}

}  // namespace oscarkv
