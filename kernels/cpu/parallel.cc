#include "kernels/cpu/parallel.h"

#include <algorithm>

namespace oscarkv {

ParallelFor::ParallelFor(int threads) {
  threads = std::max(threads, 1);
  for (int i = 0; i + 1 < threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ParallelFor::~ParallelFor() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ParallelFor::Run(int n, const std::function<void(int)>& fn) {
  if (n <= 0) return;
  if (workers_.empty() || n == 1) {
    for (int i = 0; i < n; ++i) fn(i);
    return;
  }
  std::lock_guard<std::mutex> run_lock(run_mu_);
  std::unique_lock<std::mutex> l(mu_);
  fn_ = &fn;
  n_ = n;
  next_ = 0;
  active_ = 0;
  ++generation_;
  work_cv_.notify_all();
  while (next_ < n_) {
    const int i = next_++;
    ++active_;
    l.unlock();
    fn(i);
    l.lock();
    --active_;
  }
  done_cv_.wait(l, [&] { return active_ == 0; });
  fn_ = nullptr;
}

void ParallelFor::WorkerLoop() {
  long seen = 0;
  std::unique_lock<std::mutex> l(mu_);
  for (;;) {
    work_cv_.wait(l, [&] { return stop_ || (generation_ != seen && fn_ != nullptr); });
    if (stop_) return;
    seen = generation_;
    while (fn_ != nullptr && next_ < n_) {
      const int i = next_++;
      ++active_;
      const auto* fn = fn_;
      l.unlock();
      (*fn)(i);
      l.lock();
      --active_;
      if (active_ == 0 && next_ >= n_) done_cv_.notify_all();
    }
  }
}

}  // namespace oscarkv
