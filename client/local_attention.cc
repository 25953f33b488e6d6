#include "client/local_attention.h"

#include <cmath>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/rotation.h"
#include "kernels/status_macros.h"

namespace oscarkv {

struct LocalAttention::Layer {
  int64_t tokens = 0;
  std::vector<bf16_bits> blocks;  // exact blocks, P tokens each: K [P][H][D] then V
  std::vector<ExactBlockRef> exact;
  std::vector<uint8_t> pages;
  std::vector<const uint8_t*> page_ptrs;
  std::vector<float> r_k, r_v;
  RotationRef rotation;
};

namespace {

// The data-free Hadamard rotation for a layer fetched without its rotation.
// The objective string alone does not say which matrices the server encoded
// with (a calibration file may claim "hadamard"), so the rebuilt rotation is
// used only when the server's rotation_id names exactly it: the default
// Hadamard rotation of this layout. (A server's --clip_k / --clip_v give the
// same matrices another id, which cannot be told from other matrices: those
// sequences need include_rotation too.)
absl::StatusOr<ModelRotation> RebuildHadamard(const ModelLayout& layout,
                                              const std::string& rotation_id, int layer) {
  OSCARKV_ASSIGN_OR_RETURN(ModelRotation hadamard, HadamardRotation(layout));
  const std::string rebuilt_id = RotationId(hadamard);
  if (rotation_id != rebuilt_id) {
    return absl::FailedPreconditionError(absl::StrCat(
        "layer ", layer, " was fetched without its rotation, and the sequence's rotation_id '",
        rotation_id, "' is not the default Hadamard rotation this client can rebuild ('",
        rebuilt_id, "'); fetch with include_rotation"));
  }
  return hadamard;
}

}  // namespace

LocalAttention::~LocalAttention() = default;

int64_t LocalAttention::tokens(int layer) const {
  return layer >= 0 && layer < int(layers_.size()) && layers_[layer] ? layers_[layer]->tokens : 0;
}

absl::StatusOr<std::unique_ptr<LocalAttention>> LocalAttention::Create(FetchedSequence fetched,
                                                                       int threads) {
  if (fetched.format != v1::KV_FORMAT_COMPRESSED) {
    return absl::InvalidArgumentError("LocalAttention needs a COMPRESSED fetch");
  }
  {
    // The tiers' and rotations' sizes, as GetKv checks its replies (a
    // FetchedSequence may also come from elsewhere).
    std::vector<int> present;
    for (size_t l = 0; l < fetched.present.size(); ++l) {
      if (fetched.present[l]) present.push_back(int(l));
    }
    const absl::Status consistent = CheckFetchedSequence(fetched, present);
    if (!consistent.ok()) return absl::InvalidArgumentError(consistent.message());
  }
  std::unique_ptr<LocalAttention> la(new LocalAttention());
  const v1::SequenceInfo& info = fetched.info;
  la->layout_ = ModelLayout{info.layout().num_layers(), info.layout().num_q_heads(),
                            info.layout().num_kv_heads(), info.layout().head_dim()};
  OSCARKV_RETURN_IF_ERROR(ValidateLayout(la->layout_));
  TierConfig tiers{info.tiers().sink_tokens(), info.tiers().recent_window(),
                   info.tiers().page_tokens()};
  la->geom_ = MakeGeometry(la->layout_, tiers, info.tiers().group_size());
  OSCARKV_RETURN_IF_ERROR(ValidateGeometry(la->geom_));
  la->backend_ = std::make_unique<CpuBackend>(threads);

  ModelRotation hadamard;
  const int d = la->layout_.head_dim;
  const int p = la->geom_.page_tokens;
  const size_t row = la->geom_.exact_row_elems();
  la->layers_.resize(la->layout_.num_layers);
  for (int l = 0; l < la->layout_.num_layers; ++l) {
    if (l >= int(fetched.present.size()) || !fetched.present[l]) continue;
    FetchedLayer& f = fetched.layers[l];
    auto layer = std::make_unique<Layer>();
    layer->tokens = f.tokens;
    if (f.num_matrices > 0) {
      // 1 matrix for all kv heads or one per kv head (CheckFetchedSequence).
      layer->r_k = std::move(f.r_k);
      layer->r_v = std::move(f.r_v);
      layer->rotation.stride = f.num_matrices > 1 ? size_t(d) * d : 0;
    } else if (info.objective() == "hadamard") {
      if (hadamard.layers.empty()) {
        OSCARKV_ASSIGN_OR_RETURN(hadamard,
                                 RebuildHadamard(la->layout_, info.rotation_id(), l));
      }
      layer->r_k = hadamard.layers[l].r_k;
      layer->r_v = hadamard.layers[l].r_v;
    } else {
      return absl::FailedPreconditionError(absl::StrCat(
          "layer ", l, " was fetched without its rotation (objective ", info.objective(),
          "); fetch with include_rotation"));
    }
    layer->rotation.r_k = layer->r_k.data();
    layer->rotation.r_v = layer->r_v.data();
    // Re-block sink and recent rows into exact blocks of P tokens.
    const int64_t sink_blocks = (f.sink_tokens + p - 1) / p;
    const int64_t recent_blocks = (f.recent_tokens + p - 1) / p;
    const size_t block_elems = 2 * size_t(p) * row;
    layer->blocks.assign(size_t(sink_blocks + recent_blocks) * block_elems, 0);
    auto fill = [&](const std::vector<bf16_bits>& k, const std::vector<bf16_bits>& v,
                    int64_t tokens, int64_t first_block) {
      for (int64_t t0 = 0, b = first_block; t0 < tokens; t0 += p, ++b) {
        const int64_t n = std::min<int64_t>(p, tokens - t0);
        bf16_bits* dst = layer->blocks.data() + size_t(b) * block_elems;
        std::memcpy(dst, k.data() + t0 * row, size_t(n) * row * 2);
        std::memcpy(dst + size_t(p) * row, v.data() + t0 * row, size_t(n) * row * 2);
      }
    };
    fill(f.sink_k, f.sink_v, f.sink_tokens, 0);
    fill(f.recent_k, f.recent_v, f.recent_tokens, sink_blocks);
    auto refs = [&](int64_t tokens, int64_t first_block) {
      for (int64_t t0 = 0, b = first_block; t0 < tokens; t0 += p, ++b) {
        layer->exact.push_back(ExactBlockRef{layer->blocks.data() + size_t(b) * block_elems,
                                             int(std::min<int64_t>(p, tokens - t0))});
      }
    };
    refs(f.sink_tokens, 0);
    refs(f.recent_tokens, sink_blocks);
    layer->pages = std::move(f.pages);
    for (size_t i = 0; i < layer->pages.size(); i += la->geom_.page_bytes()) {
      layer->page_ptrs.push_back(layer->pages.data() + i);
    }
    la->layers_[l] = std::move(layer);
  }
  return la;
}

absl::Status LocalAttention::Attend(int layer, const float* q, float* out, float* lse) const {
  if (layer < 0 || layer >= int(layers_.size()) || !layers_[layer]) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " was not fetched"));
  }
  const Layer& l = *layers_[layer];
  AttendItem item;
  item.q = q;
  item.out = out;
  item.lse = lse;
  item.rotation = l.rotation;
  item.exact = l.exact.data();
  item.num_exact = int(l.exact.size());
  item.pages = l.page_ptrs.data();
  item.num_pages = int(l.page_ptrs.size());
  AttendBatch batch;
  batch.geom = geom_;
  batch.num_q_heads = layout_.num_q_heads;
  batch.scale = 1.0f / std::sqrt(float(layout_.head_dim));
  batch.items = &item;
  batch.num_items = 1;
  return backend_->Attend(batch);
}

}  // namespace oscarkv
