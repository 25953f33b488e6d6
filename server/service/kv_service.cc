#include "server/service/kv_service.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"
#include "server/service/calibration_path.h"
#include "server/service/convert.h"

namespace oscarkv {
namespace {

using Clock = std::chrono::steady_clock;

// Finishes a unary call with `status`, recording it.
grpc::ServerUnaryReactor* FinishUnary(const KvCacheService* svc, const char* method,
                                      grpc::CallbackServerContext* context, Clock::time_point start,
                                      const absl::Status& status) {
  svc->Record(method, start, status.code());
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

}  // namespace

void KvCacheService::Record(const char* method, Clock::time_point start,
                            absl::StatusCode code) const {
  if (ctx_.metrics == nullptr) return;
  ctx_.metrics->ObserveRpc(method, code,
                           std::chrono::duration<double>(Clock::now() - start).count());
}

grpc::ServerReadReactor<v1::PutKvRequest>* KvCacheService::PutKv(
    grpc::CallbackServerContext* context, v1::PutKvResponse* response) {
  return NewPutKvReactor(this, context, response);
}

grpc::ServerWriteReactor<v1::GetKvResponse>* KvCacheService::GetKv(
    grpc::CallbackServerContext* context, const v1::GetKvRequest* request) {
  return NewGetKvReactor(this, context, request);
}

grpc::ServerBidiReactor<v1::AttendRequest, v1::AttendResponse>* KvCacheService::Attend(
    grpc::CallbackServerContext* context) {
  return NewAttendReactor(this, context);
}

grpc::ServerUnaryReactor* KvCacheService::AppendKv(grpc::CallbackServerContext* context,
                                                   const v1::AppendKvRequest* request,
                                                   v1::AppendKvResponse* response) {
  const auto start = Clock::now();
  absl::Status status = [&]() -> absl::Status {
    if (!request->has_chunk()) return absl::InvalidArgumentError("AppendKv needs a chunk");
    OSCARKV_ASSIGN_OR_RETURN(SequenceHandle seq, ctx_.store->Acquire(request->sequence_id()));
    const v1::KvChunk& c = request->chunk();
    OSCARKV_RETURN_IF_ERROR(ctx_.store->Append(seq, c.layer(), c.start_token(), c.num_tokens(),
                                               c.k().data(), c.k().size(), c.v().data(),
                                               c.v().size()));
    if (ctx_.metrics) ctx_.metrics->AddIngestBytesIn(int64_t(c.k().size() + c.v().size()));
    const SequenceStats st = ctx_.store->Stat(seq);
    // Append took each appended layer from start_token to start_token + n
    // (it refuses a chunk that does not start at the layer's end); st.tokens
    // is the minimum over all layers, which a per-layer append need not move.
    response->set_tokens(c.start_token() + c.num_tokens());
    response->set_stored_bytes(st.totals.slot_bytes);
    return absl::OkStatus();
  }();
  return FinishUnary(this, "AppendKv", context, start, status);
}

grpc::ServerUnaryReactor* KvCacheService::DropSequence(grpc::CallbackServerContext* context,
                                                       const v1::DropSequenceRequest* request,
                                                       v1::DropSequenceResponse* response) {
  const auto start = Clock::now();
  absl::StatusOr<int64_t> freed = ctx_.store->Drop(request->sequence_id());
  if (freed.ok()) response->set_freed_bytes(*freed);
  return FinishUnary(this, "DropSequence", context, start, freed.status());
}

grpc::ServerUnaryReactor* KvCacheService::GetSequence(grpc::CallbackServerContext* context,
                                                      const v1::GetSequenceRequest* request,
                                                      v1::SequenceInfo* response) {
  const auto start = Clock::now();
  absl::Status status = [&]() -> absl::Status {
    OSCARKV_ASSIGN_OR_RETURN(SequenceHandle seq, ctx_.store->Acquire(request->sequence_id()));
    ToProto(ctx_.store->Stat(seq), response);
    return absl::OkStatus();
  }();
  return FinishUnary(this, "GetSequence", context, start, status);
}

grpc::ServerUnaryReactor* KvCacheService::ListSequences(grpc::CallbackServerContext* context,
                                                        const v1::ListSequencesRequest* request,
                                                        v1::ListSequencesResponse* response) {
  const auto start = Clock::now();
  absl::Status status = [&]() -> absl::Status {
    if (request->page_size() < 0 || request->page_size() > 10000) {
      return absl::InvalidArgumentError(
          absl::StrCat("page_size must be in [0, 10000], got ", request->page_size()));
    }
    if (!request->model().empty()) {
      OSCARKV_RETURN_IF_ERROR(ctx_.models->Find(request->model()).status());
    }
    const int limit = request->page_size() == 0 ? 1000 : request->page_size();
    std::vector<SequenceStats> page =
        ctx_.store->List(request->model(), request->page_token(), limit + 1);
    const bool more = static_cast<int>(page.size()) > limit;
    if (more) page.resize(limit);
    for (const SequenceStats& s : page) ToProto(s, response->add_sequences());
    if (more && !page.empty()) response->set_next_page_token(page.back().id);
    return absl::OkStatus();
  }();
  return FinishUnary(this, "ListSequences", context, start, status);
}

grpc::ServerUnaryReactor* KvCacheService::GetServerInfo(grpc::CallbackServerContext* context,
                                                        const v1::GetServerInfoRequest*,
                                                        v1::ServerInfo* response) {
  const auto start = Clock::now();
  const StoreStats st = ctx_.store->Stats();
  response->set_version(ctx_.version);
  response->set_backend(ctx_.backend->name());
  response->set_backend_description(ctx_.backend->description());
  v1::PoolInfo* pool = response->mutable_pool();
  pool->set_total_bytes(st.pool_total_bytes);
  pool->set_free_bytes(st.pool_free_bytes);
  pool->set_history_bytes(st.pool_history_bytes);
  pool->set_exact_bytes(st.pool_exact_bytes);
  for (const auto& m : ctx_.models->List()) {
    ToProto(*m, ctx_.store->CountSequences(m->name), response->add_models());
  }
  response->set_eviction_policy(ctx_.store->policy() == EvictionPolicy::kLru ? "lru" : "refuse");
  response->set_max_message_bytes(ctx_.max_message_bytes);
  response->set_sequences(st.sequences);
  response->set_evictions(st.evictions);
  return FinishUnary(this, "GetServerInfo", context, start, absl::OkStatus());
}

absl::Status KvCacheService::DoLoadCalibration(const v1::LoadCalibrationRequest& request,
                                               v1::LoadCalibrationResponse* response) {
  if (request.model().empty()) return absl::InvalidArgumentError("model name is empty");
  ModelRotation rotation;
  switch (request.source_case()) {
    case v1::LoadCalibrationRequest::kHadamardLayout: {
      OSCARKV_ASSIGN_OR_RETURN(rotation, HadamardRotation(FromProto(request.hadamard_layout()),
                                                          ctx_.clip_k, ctx_.clip_v));
      break;
    }
    case v1::LoadCalibrationRequest::kPath:
    case v1::LoadCalibrationRequest::kContent: {
      if (!ctx_.calibration_reader) {
        return absl::FailedPreconditionError(
            "this server was built without the calibration file reader; use hadamard_layout");
      }
      // A path is read here, through a checked descriptor (calibration_path.h),
      // and parsed from its bytes like content.
      std::string bytes;
      const std::string* source = &request.content();
      if (request.source_case() == v1::LoadCalibrationRequest::kPath) {
        OSCARKV_ASSIGN_OR_RETURN(bytes, ReadCalibrationFile(ctx_.calibration_dir, request.path(),
                                                            kMaxCalibrationFileBytes));
        source = &bytes;
      }
      OSCARKV_ASSIGN_OR_RETURN(rotation,
                               ctx_.calibration_reader(*source, /*is_path=*/false, nullptr));
      break;
    }
    default:
      return absl::InvalidArgumentError("LoadCalibration needs a source: path, content or "
                                        "hadamard_layout");
  }
  OSCARKV_ASSIGN_OR_RETURN(std::shared_ptr<const ModelEntry> entry,
                           MakeModelEntry(request.model(), std::move(rotation), ctx_.tiers,
                                          ctx_.group_size, *ctx_.backend));
  // The refusals first: the probe takes a page and a block from the pool and,
  // under lru, may evict a stored sequence to get them. A model in use (stored
  // sequences, or PutKv streams ingesting under its current rotation) is not
  // replaced: its sequences would keep the old rotation.
  OSCARKV_RETURN_IF_ERROR(ctx_.models->CheckRegistrable(entry->name, request.replace()));
  OSCARKV_RETURN_IF_ERROR(ctx_.store->CheckModelUnused(entry->name));
  OSCARKV_RETURN_IF_ERROR(ctx_.store->ProbeModel(*entry));
  // Checked again with the registration, atomically with ingests beginning.
  OSCARKV_RETURN_IF_ERROR(ctx_.store->RegisterIfModelUnused(
      entry->name, [&] { return ctx_.models->Register(entry, request.replace()); }));
  ToProto(*entry, 0, response->mutable_model());
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* KvCacheService::LoadCalibration(
    grpc::CallbackServerContext* context, const v1::LoadCalibrationRequest* request,
    v1::LoadCalibrationResponse* response) {
  const auto start = Clock::now();
  return FinishUnary(this, "LoadCalibration", context, start,
                     DoLoadCalibration(*request, response));
}

}  // namespace oscarkv
