// Internal to the client library (not installed): the KvChunk of n tokens
// that AppendKv and PutKv send.
#ifndef OSCARKV_CLIENT_KV_CHUNK_H_
#define OSCARKV_CLIENT_KV_CHUNK_H_

#include <cstddef>
#include <cstdint>
#include <limits>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

#include "client/kv_client.h"

namespace oscarkv {

// Fills `c` with tokens [start_token, start_token + n) of one layer
// (layer >= 0) or of all layers (-1, layer-major); returns the bytes of k
// (the same for v). Refuses what would make the copy itself undefined (a
// negative or oversized n, missing rows); the server checks the rest.
inline absl::StatusOr<size_t> FillKvChunk(const ModelLayout& layout, int layer,
                                          int64_t start_token, int64_t n, const bf16_bits* k,
                                          const bf16_bits* v, v1::KvChunk* c) {
  if (n < 0 || n > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("token count ", n, " out of range [0, 2^31)"));
  }
  if (n > 0 && (k == nullptr || v == nullptr)) {
    return absl::InvalidArgumentError("k and v rows are needed for a non-empty chunk");
  }
  const int layers = layer < 0 ? layout.num_layers : 1;
  const size_t bytes = size_t(layers) * n * layout.kv_row_elems() * sizeof(bf16_bits);
  c->set_layer(layer);
  c->set_start_token(start_token);
  c->set_num_tokens(static_cast<int32_t>(n));
  c->set_k(reinterpret_cast<const char*>(k), bytes);
  c->set_v(reinterpret_cast<const char*>(v), bytes);
  return bytes;
}

}  // namespace oscarkv

#endif  // OSCARKV_CLIENT_KV_CHUNK_H_
