// Attention on the decode node over a cache fetched with GetKv(COMPRESSED):
// the same CPU kernels the server's CPU backend runs (kernels/cpu), over the
// pages exactly as stored, so the result equals the server's Attend.
//
// Thread-safety: Attend() may be called concurrently once built.
#ifndef OSCARKV_CLIENT_LOCAL_ATTENTION_H_
#define OSCARKV_CLIENT_LOCAL_ATTENTION_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "client/kv_client.h"
#include "kernels/backend.h"
#include "kernels/layout.h"

namespace oscarkv {

class LocalAttention {
 public:
  // Takes the fetched layers (moved from `fetched`). Each present layer needs
  // its rotation (GetKv include_rotation), or the sequence must use the
  // default data-free Hadamard rotation, which is rebuilt here: the
  // sequence's rotation_id must be that rotation's RotationId (a model that
  // only calls itself "hadamard", or uses other clip ratios, has another id),
  // else FAILED_PRECONDITION naming both ids. `threads` as CpuBackend.
  static absl::StatusOr<std::unique_ptr<LocalAttention>> Create(FetchedSequence fetched,
                                                                int threads = 0);
  ~LocalAttention();

  const ModelLayout& layout() const { return layout_; }
  int64_t tokens(int layer) const;
  // q [Hq][D] fp32 -> out [Hq][D], lse [Hq] (or null).
  absl::Status Attend(int layer, const float* q, float* out, float* lse) const;

 private:
  struct Layer;
  LocalAttention() = default;
  ModelLayout layout_;
  PageGeometry geom_;
  std::unique_ptr<Backend> backend_;
  std::vector<std::unique_ptr<Layer>> layers_;
};

}  // namespace oscarkv

#endif  // OSCARKV_CLIENT_LOCAL_ATTENTION_H_
