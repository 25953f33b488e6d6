// Conversions between the store's types and oscarkv.v1 messages, and the one
// place where absl::Status becomes grpc::Status.
#ifndef OSCARKV_SERVER_SERVICE_CONVERT_H_
#define OSCARKV_SERVER_SERVICE_CONVERT_H_

#include "absl/status/status.h"
#include "grpcpp/support/status.h"
#include "oscarkv/v1/kvcache.pb.h"
#include "server/store/sequence_store.h"

namespace oscarkv {

grpc::Status ToGrpcStatus(const absl::Status& status);

void ToProto(const ModelLayout& layout, v1::ModelLayout* out);
ModelLayout FromProto(const v1::ModelLayout& layout);
void ToProto(const TierConfig& tiers, int group_size, v1::TierConfig* out);
// `sequences`: committed sequences of the model (reported in ModelInfo).
void ToProto(const ModelEntry& model, int64_t sequences, v1::ModelInfo* out);
void ToProto(const SequenceStats& stats, v1::SequenceInfo* out);

}  // namespace oscarkv

#endif  // OSCARKV_SERVER_SERVICE_CONVERT_H_
