#include "server/service/convert.h"

#include <string>

namespace oscarkv {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // absl and gRPC status codes have the same numeric values.
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      std::string(status.message()));
}

void ToProto(const ModelLayout& l, v1::ModelLayout* out) {
  out->set_num_layers(l.num_layers);
  out->set_num_q_heads(l.num_q_heads);
  out->set_num_kv_heads(l.num_kv_heads);
  out->set_head_dim(l.head_dim);
}

ModelLayout FromProto(const v1::ModelLayout& l) {
  return ModelLayout{l.num_layers(), l.num_q_heads(), l.num_kv_heads(), l.head_dim()};
}

void ToProto(const TierConfig& t, int group_size, v1::TierConfig* out) {
  out->set_sink_tokens(t.sink_tokens);
  out->set_recent_window(t.recent_window);
  out->set_page_tokens(t.page_tokens);
  out->set_group_size(group_size);
}

void ToProto(const ModelEntry& m, int64_t sequences, v1::ModelInfo* out) {
  out->set_name(m.name);
  ToProto(m.layout, out->mutable_layout());
  ToProto(m.tiers, m.group_size, out->mutable_tiers());
  out->set_objective(m.rotation.objective);
  out->set_calibrated(m.rotation.calibrated());
  out->set_rotation_id(m.rotation_id);
  out->set_page_bytes(static_cast<int64_t>(m.geom.page_bytes()));
  out->set_sequences(sequences);
}

void ToProto(const SequenceStats& s, v1::SequenceInfo* out) {
  out->set_sequence_id(s.id);
  out->set_model(s.model->name);
  ToProto(s.model->layout, out->mutable_layout());
  ToProto(s.model->tiers, s.model->group_size, out->mutable_tiers());
  out->set_tokens(s.tokens);
  out->set_sink_tokens(s.layer0.sink);
  out->set_history_tokens(s.layer0.history);
  out->set_recent_tokens(s.layer0.recent);
  out->set_stored_bytes(s.totals.slot_bytes);
  out->set_effective_bits(s.totals.effective_bits());
  out->set_pinned(s.pinned);
  out->set_rotation_id(s.model->rotation_id);
  out->set_objective(s.model->rotation.objective);
  out->set_last_access_unix_ms(s.last_access_unix_ms);
}

}  // namespace oscarkv
