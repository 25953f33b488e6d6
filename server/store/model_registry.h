// The models a server stores caches for: layout, tiers, codec settings and the
// rotation uploaded to the backend (DESIGN sections 2, 5 and 6).
//
// A ModelEntry is immutable once registered and shared (shared_ptr) by every
// sequence of the model, so replacing a model's rotation never changes the
// matrices a stored sequence was encoded with.
//
// Thread-safety: ModelRegistry methods may be called concurrently.
#ifndef OSCARKV_SERVER_STORE_MODEL_REGISTRY_H_
#define OSCARKV_SERVER_STORE_MODEL_REGISTRY_H_

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/layout.h"
#include "kernels/page_format.h"
#include "kernels/rotation.h"
#include "server/cache/layer_cache.h"

namespace oscarkv {

struct ModelEntry {
  std::string name;
  ModelLayout layout;
  TierConfig tiers;
  int group_size = 0;  // resolved G
  PageGeometry geom;
  ModelRotation rotation;  // host copy (GetKv include_rotation, GetServerInfo)
  std::string rotation_id;
  DeviceBuffer device_rotation;  // all layers' R_K, R_V on the backend
  std::vector<LayerCodec> codecs;  // per layer, pointing into device_rotation

  // Bytes of one token of one layer in BF16 (K and V).
  size_t bf16_token_bytes() const { return 2 * geom.exact_row_elems() * sizeof(bf16_bits); }

  // INVALID_ARGUMENT ("layer L out of range [0, N)") unless 0 <= layer < N.
  absl::Status CheckLayer(int layer) const;
};

// Builds an entry: validates the rotation against the layout and the tiers
// against the layout, uploads the matrices to `backend`.
absl::StatusOr<std::shared_ptr<const ModelEntry>> MakeModelEntry(const std::string& name,
                                                                 ModelRotation rotation,
                                                                 const TierConfig& tiers,
                                                                 int group_size, Backend& backend);

// The default of ServerOptions::max_models (--max_models). Every model holds
// its rotation on the backend and on the host, and no RPC unregisters one, so
// registrations by clients (LoadCalibration) are bounded.
inline constexpr int kDefaultMaxModels = 64;

class ModelRegistry {
 public:
  // Holds at most `max_models` (>= 1) models.
  explicit ModelRegistry(int max_models = kDefaultMaxModels) : max_models_(max_models) {}

  // Registers `entry`. ALREADY_EXISTS when the name is taken and !replace;
  // RESOURCE_EXHAUSTED naming the limit when a new name would exceed
  // max_models (replacing a registered model is always within it).
  absl::Status Register(std::shared_ptr<const ModelEntry> entry, bool replace);
  // What Register would answer for `name` now (it checks again itself).
  absl::Status CheckRegistrable(const std::string& name, bool replace) const;
  // NOT_FOUND naming the model and the registered names.
  absl::StatusOr<std::shared_ptr<const ModelEntry>> Find(const std::string& name) const;
  std::vector<std::shared_ptr<const ModelEntry>> List() const;  // by name

 private:
  absl::Status CheckRegistrableLocked(const std::string& name, bool replace) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int max_models_;
  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<const ModelEntry>> models_ ABSL_GUARDED_BY(mu_);
};

// Parses "name:layers:q_heads:kv_heads:head_dim" (the --model flag).
absl::StatusOr<std::pair<std::string, ModelLayout>> ParseModelSpec(const std::string& spec);

}  // namespace oscarkv

#endif  // OSCARKV_SERVER_STORE_MODEL_REGISTRY_H_
