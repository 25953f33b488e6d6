// The Attend bidirectional stream: one response per request, in order; each
// item is answered on its own (an item's error does not end the stream).
#include <chrono>
#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"
#include "server/service/convert.h"
#include "server/service/kv_service.h"

namespace oscarkv {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kMaxItemsPerMessage = 1024;

class AttendReactor final : public grpc::ServerBidiReactor<v1::AttendRequest, v1::AttendResponse> {
 public:
  AttendReactor(const KvCacheService* svc, grpc::CallbackServerContext* ctx)
      : svc_(svc), ctx_(ctx), start_(Clock::now()) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      Done(ctx_->IsCancelled() ? absl::CancelledError("Attend was cancelled") : absl::OkStatus());
      return;
    }
    if (request_.items_size() > kMaxItemsPerMessage) {
      Done(absl::InvalidArgumentError(absl::StrCat("Attend message has ", request_.items_size(),
                                                   " items; at most ", kMaxItemsPerMessage)));
      return;
    }
    response_.Clear();
    response_.set_request_id(request_.request_id());
    for (const v1::AttendItem& item : request_.items()) {
      v1::AttendResult* result = response_.add_results();
      const absl::Status status = AttendOne(item, request_.return_lse(), result);
      if (!status.ok()) {
        result->Clear();
        result->set_code(static_cast<int32_t>(status.code()));
        result->set_error(std::string(status.message()));
      }
    }
    StartWrite(&response_);
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Done(absl::CancelledError("Attend client went away"));
      return;
    }
    StartRead(&request_);
  }

  void OnDone() override { delete this; }

 private:
  absl::Status AttendOne(const v1::AttendItem& item, bool want_lse, v1::AttendResult* result) {
    const ServiceContext& c = svc_->context();
    OSCARKV_ASSIGN_OR_RETURN(SequenceHandle seq, c.store->Acquire(item.sequence_id()));
    const ModelLayout& layout = seq->model().layout;
    const size_t q_bytes = size_t(layout.num_q_heads) * layout.head_dim * sizeof(float);
    if (item.q().size() != q_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "q has ", item.q().size(), " bytes; expected ", q_bytes, " = ", layout.num_q_heads,
          " q heads x ", layout.head_dim, " head_dim x 4 bytes (FP32)"));
    }
    const bf16_bits* k = nullptr;
    const bf16_bits* v = nullptr;
    if (!item.k().empty() || !item.v().empty()) {
      const size_t kv_bytes = size_t(layout.num_kv_heads) * layout.head_dim * sizeof(bf16_bits);
      if (item.k().size() != kv_bytes || item.v().size() != kv_bytes) {
        return absl::InvalidArgumentError(absl::StrCat(
            "fused append: k has ", item.k().size(), " and v ", item.v().size(),
            " bytes; each must be ", kv_bytes, " = ", layout.num_kv_heads, " kv heads x ",
            layout.head_dim, " head_dim x 2 bytes (BF16)"));
      }
      k = reinterpret_cast<const bf16_bits*>(item.k().data());
      v = reinterpret_cast<const bf16_bits*>(item.v().data());
      if (c.metrics) c.metrics->AddIngestBytesIn(int64_t(2 * kv_bytes));
    }
    std::string* out = result->mutable_out();
    out->resize(q_bytes);
    std::string* lse = nullptr;
    if (want_lse) {
      lse = result->mutable_lse();
      lse->resize(size_t(layout.num_q_heads) * sizeof(float));
    }
    const int64_t position = item.position() > 0 ? item.position() : -1;
    int64_t tokens = 0;
    const auto t0 = Clock::now();
    OSCARKV_RETURN_IF_ERROR(c.store->Attend(
        seq, item.layer(), reinterpret_cast<const float*>(item.q().data()), k, v, position,
        reinterpret_cast<float*>(out->data()),
        lse ? reinterpret_cast<float*>(lse->data()) : nullptr, &tokens));
    if (c.metrics) {
      c.metrics->ObserveAttention(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    result->set_tokens(tokens);
    return absl::OkStatus();
  }

  void Done(const absl::Status& status) {
    svc_->Record("Attend", start_, status.code());
    Finish(ToGrpcStatus(status));
  }

  const KvCacheService* svc_;
  grpc::CallbackServerContext* ctx_;
  const Clock::time_point start_;
  v1::AttendRequest request_;
  v1::AttendResponse response_;
};

}  // namespace

grpc::ServerBidiReactor<v1::AttendRequest, v1::AttendResponse>* NewAttendReactor(
    const KvCacheService* service, grpc::CallbackServerContext* context) {
  return new AttendReactor(service, context);
}

}  // namespace oscarkv
