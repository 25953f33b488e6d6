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
    // Nothing is pending while the batch runs, so the reactor stays alive.
    // Small batches skip the hop to the executor (a null executor runs
    // everything inline anyway).
    const ServiceContext& c = svc_->context();
    const bool inline_slot = c.executor != nullptr &&
                             request_.items_size() <= c.attend_inline_items &&
                             svc_->TryEnterInline();
    RunOn(inline_slot ? nullptr : c.executor, [this, inline_slot] {
      AttendAll();
      if (inline_slot) svc_->LeaveInline();
      StartWrite(&response_);
    });
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
  // Checks one item and prepares its task (handle, shapes, output buffers).
  absl::Status Prepare(const v1::AttendItem& item, bool want_lse, v1::AttendResult* result,
                       SequenceHandle* handle, SequenceStore::AttendTask* task) {
    const ServiceContext& c = svc_->context();
    OSCARKV_ASSIGN_OR_RETURN(*handle, c.store->Acquire(item.sequence_id()));
    const ModelLayout& layout = (*handle)->model().layout;
    const size_t q_bytes = size_t(layout.num_q_heads) * layout.head_dim * sizeof(float);
    if (item.q().size() != q_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "q has ", item.q().size(), " bytes; expected ", q_bytes, " = ", layout.num_q_heads,
          " q heads x ", layout.head_dim, " head_dim x 4 bytes (FP32)"));
    }
    if (!item.k().empty() || !item.v().empty()) {
      const size_t kv_bytes = layout.kv_row_elems() * sizeof(bf16_bits);
      if (item.k().size() != kv_bytes || item.v().size() != kv_bytes) {
        return absl::InvalidArgumentError(absl::StrCat(
            "fused append: k has ", item.k().size(), " and v ", item.v().size(),
            " bytes; each must be ", kv_bytes, " = ", layout.num_kv_heads, " kv heads x ",
            layout.head_dim, " head_dim x 2 bytes (BF16)"));
      }
      task->k = reinterpret_cast<const bf16_bits*>(item.k().data());
      task->v = reinterpret_cast<const bf16_bits*>(item.v().data());
      if (c.metrics) c.metrics->AddIngestBytesIn(int64_t(2 * kv_bytes));
    }
    std::string* out = result->mutable_out();
    out->resize(q_bytes);
    task->out = reinterpret_cast<float*>(out->data());
    if (want_lse) {
      std::string* lse = result->mutable_lse();
      lse->resize(size_t(layout.num_q_heads) * sizeof(float));
      task->lse = reinterpret_cast<float*>(lse->data());
    }
    task->seq = handle;
    task->layer = item.layer();
    task->q = reinterpret_cast<const float*>(item.q().data());
    task->position = item.position() > 0 ? item.position() : -1;
    return absl::OkStatus();
  }

  // Answers every item of request_ in response_ (one backend batch per model).
  void AttendAll() {
    const ServiceContext& c = svc_->context();
    const int n = request_.items_size();
    std::vector<SequenceHandle> handles(n);
    std::vector<SequenceStore::AttendTask> tasks;
    std::vector<int> task_item;
    std::vector<absl::Status> status(n);
    for (int i = 0; i < n; ++i) {
      v1::AttendResult* result = response_.add_results();
      SequenceStore::AttendTask task;
      status[i] = Prepare(request_.items(i), request_.return_lse(), result, &handles[i], &task);
      if (status[i].ok()) {
        tasks.push_back(task);
        task_item.push_back(i);
      }
    }
    // The reply must fit one message. Its outputs are sized by now; the
    // tokens and code fields add a few bytes per item. A reply that would
    // not fit is refused item by item before anything runs, so no fused
    // append is applied for an answer the client cannot receive.
    const size_t reply_bound = response_.ByteSizeLong() + size_t(n) * 32;
    if (c.max_message_bytes > 0 && reply_bound > size_t(c.max_message_bytes)) {
      const absl::Status too_big = absl::ResourceExhaustedError(absl::StrCat(
          "the reply to this Attend message would take about ", reply_bound,
          " bytes; this server's message limit is ", c.max_message_bytes,
          " (send fewer items per message); nothing was appended"));
      for (int i = 0; i < n; ++i) {
        if (status[i].ok()) status[i] = too_big;
      }
      tasks.clear();
      task_item.clear();
    }
    const auto t0 = Clock::now();
    c.store->AttendMany(tasks);
    if (c.metrics && !tasks.empty()) {
      const double per_item =
          std::chrono::duration<double>(Clock::now() - t0).count() / double(tasks.size());
      for (size_t j = 0; j < tasks.size(); ++j) c.metrics->ObserveAttention(per_item);
    }
    for (size_t j = 0; j < tasks.size(); ++j) {
      const int i = task_item[j];
      status[i] = tasks[j].status;
      if (status[i].ok()) response_.mutable_results(i)->set_tokens(tasks[j].tokens);
    }
    for (int i = 0; i < n; ++i) {
      if (status[i].ok()) continue;
      v1::AttendResult* result = response_.mutable_results(i);
      result->Clear();
      result->set_code(static_cast<int32_t>(status[i].code()));
      result->set_error(std::string(status[i].message()));
    }
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
