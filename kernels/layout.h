// Model layout, tier sizes and codec settings (DESIGN sections 1 and 2).
#ifndef OSCARKV_KERNELS_LAYOUT_H_
#define OSCARKV_KERNELS_LAYOUT_H_

#include <string>

#include "absl/status/status.h"
#include "kernels/page_format.h"

namespace oscarkv {

// The attention shape of one model. head_dim is a power of two in {64, 128, 256};
// num_q_heads is a multiple of num_kv_heads (GQA).
struct ModelLayout {
  int num_layers = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;

  int gqa_group() const { return num_kv_heads > 0 ? num_q_heads / num_kv_heads : 0; }
  // Elements of one token's K (or V) row of one layer: all kv heads.
  size_t kv_row_elems() const { return size_t(num_kv_heads) * head_dim; }
  std::string DebugString() const;
  friend bool operator==(const ModelLayout& a, const ModelLayout& b) {
    return a.num_layers == b.num_layers && a.num_q_heads == b.num_q_heads &&
           a.num_kv_heads == b.num_kv_heads && a.head_dim == b.head_dim;
  }
};

// Limits that keep one request's memory bounded; a layout outside them is refused.
inline constexpr int kMaxLayers = 512;
inline constexpr int kMaxKvHeads = 128;
inline constexpr int kMaxQHeads = 1024;

// Tier sizes: sink [0, S0) BF16, history pages of P tokens INT2, recent r BF16
// tokens with W <= r < W + P once the sequence has history.
struct TierConfig {
  int sink_tokens = 64;     // S0
  int recent_window = 256;  // W
  int page_tokens = 32;     // P
};

// Quantizer settings. group_size 0 means one group per row (G = D).
struct CodecConfig {
  int group_size = 0;
  float clip_k = 0.96f;
  float clip_v = 0.92f;
};

// Named checks; each returns InvalidArgument naming the offending field.
absl::Status ValidateLayout(const ModelLayout& layout);
absl::Status ValidateTiers(const TierConfig& tiers);
absl::Status ValidateClipRatio(float ratio, const char* what);
// Resolves group_size 0 to head_dim and checks that G divides D and is >= 4.
absl::Status ResolveGroupSize(int head_dim, int* group_size);

PageGeometry MakeGeometry(const ModelLayout& layout, const TierConfig& tiers, int group_size);

}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_LAYOUT_H_
