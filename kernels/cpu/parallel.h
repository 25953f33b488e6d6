// A fixed set of worker threads for data-parallel loops on the CPU backend.
#ifndef OSCARKV_KERNELS_CPU_PARALLEL_H_
#define OSCARKV_KERNELS_CPU_PARALLEL_H_

#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace oscarkv {

// Runs fn(i) for i in [0, n) on `threads` threads (the caller's included).
// Calls from several threads serialize on one pool; fn must not call back in.
class ParallelFor {
 public:
  explicit ParallelFor(int threads);
  ~ParallelFor();
  ParallelFor(const ParallelFor&) = delete;
  ParallelFor& operator=(const ParallelFor&) = delete;

  int threads() const { return static_cast<int>(workers_.size()) + 1; }
  void Run(int n, const std::function<void(int)>& fn);

 private:
  void WorkerLoop();

  std::mutex run_mu_;  // one Run at a time
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  const std::function<void(int)>* fn_ = nullptr;  // guarded by mu_
  int n_ = 0;
  int next_ = 0;
  int active_ = 0;
  long generation_ = 0;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_CPU_PARALLEL_H_
