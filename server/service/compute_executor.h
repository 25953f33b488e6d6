// Worker threads for the service's heavy work (encoding ingested chunks,
// attention), so that gRPC's callback threads mostly move messages: a reactor
// posts the work here and resumes the stream (StartRead / StartWrite) from the
// worker when it is done. gRPC asks reactions to be short and non-blocking; a
// 10 ms CPU attention in one would hold a callback thread that other calls
// need. The one exception: small Attend batches on a GPU backend, a short
// wait, may run inline, two at a time at most (--attend_inline_items).
//
// Thread-safety: Post may be called from any thread. The destructor runs every
// task already posted, then joins the workers.
#ifndef OSCARKV_SERVER_SERVICE_COMPUTE_EXECUTOR_H_
#define OSCARKV_SERVER_SERVICE_COMPUTE_EXECUTOR_H_

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"

namespace oscarkv {

class ComputeExecutor {
 public:
  // threads <= 0: one per hardware thread.
  explicit ComputeExecutor(int threads);
  ~ComputeExecutor();
  ComputeExecutor(const ComputeExecutor&) = delete;
  ComputeExecutor& operator=(const ComputeExecutor&) = delete;

  void Post(std::function<void()> task);
  int threads() const { return static_cast<int>(workers_.size()); }

 private:
  void Loop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

// Runs `task` on `executor`, or inline when there is none (tests that build a
// service by hand, and the inline Attend batches).
inline void RunOn(ComputeExecutor* executor, std::function<void()> task) {
  if (executor != nullptr) {
    executor->Post(std::move(task));
  } else {
    task();
  }
}

}  // namespace oscarkv

#endif  // OSCARKV_SERVER_SERVICE_COMPUTE_EXECUTOR_H_
