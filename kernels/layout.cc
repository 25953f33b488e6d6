#include "kernels/layout.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace oscarkv {

std::string ModelLayout::DebugString() const {
  return absl::StrCat("layers=", num_layers, " q_heads=", num_q_heads,
                      " kv_heads=", num_kv_heads, " head_dim=", head_dim);
}

absl::Status ValidateLayout(const ModelLayout& l) {
  if (l.head_dim != 64 && l.head_dim != 128 && l.head_dim != 256) {
    return absl::InvalidArgumentError(absl::StrCat(
        "head_dim must be a power of two in {64, 128, 256}, got ", l.head_dim));
  }
  if (l.num_layers <= 0 || l.num_layers > kMaxLayers) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_layers must be in [1, ", kMaxLayers, "], got ", l.num_layers));
  }
  if (l.num_kv_heads <= 0 || l.num_kv_heads > kMaxKvHeads) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_kv_heads must be in [1, ", kMaxKvHeads, "], got ", l.num_kv_heads));
  }
  if (l.num_q_heads <= 0 || l.num_q_heads > kMaxQHeads) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_q_heads must be in [1, ", kMaxQHeads, "], got ", l.num_q_heads));
  }
  if (l.num_q_heads % l.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("num_q_heads (", l.num_q_heads,
                                                   ") must be a multiple of num_kv_heads (",
                                                   l.num_kv_heads, ")"));
  }
  return absl::OkStatus();
}

absl::Status ValidateTiers(const TierConfig& t) {
  if (t.sink_tokens < 0 || t.sink_tokens > 1 << 16) {
    return absl::InvalidArgumentError(
        absl::StrCat("sink_tokens must be in [0, 65536], got ", t.sink_tokens));
  }
  if (t.recent_window < 0 || t.recent_window > 1 << 16) {
    return absl::InvalidArgumentError(
        absl::StrCat("recent_window must be in [0, 65536], got ", t.recent_window));
  }
  if (t.page_tokens <= 0 || t.page_tokens > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_tokens must be in [1, 1024], got ", t.page_tokens));
  }
  return absl::OkStatus();
}

absl::Status ValidateClipRatio(float ratio, const char* what) {
  if (!std::isfinite(ratio) || ratio <= 0.0f || ratio > 1.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " clip ratio must be in (0, 1], got ", ratio));
  }
  return absl::OkStatus();
}

absl::Status ResolveGroupSize(int head_dim, int* group_size) {
  if (*group_size == 0) *group_size = head_dim;
  const int g = *group_size;
  if (g < 4 || g > head_dim || head_dim % g != 0) {
    return absl::InvalidArgumentError(absl::StrCat("group_size ", g,
                                                   " must divide head_dim ", head_dim,
                                                   " and be at least 4"));
  }
  return absl::OkStatus();
}

PageGeometry MakeGeometry(const ModelLayout& layout, const TierConfig& tiers, int group_size) {
  return PageGeometry{layout.num_kv_heads, layout.head_dim, group_size, tiers.page_tokens};
}

}  // namespace oscarkv
