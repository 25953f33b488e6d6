#include "server/service/stream_watchdog.h"

#include <algorithm>

namespace oscarkv {
namespace {

// How often the streams are looked at: a stream is ended between `limit` and
// `limit` + this after its client stalled.
std::chrono::milliseconds CheckInterval(std::chrono::milliseconds limit) {
  return std::clamp(limit / 4, std::chrono::milliseconds(5), std::chrono::milliseconds(1000));
}

}  // namespace

StreamWatchdog::StreamWatchdog(std::chrono::milliseconds limit) : limit_(limit) {
  if (limit_.count() > 0) thread_ = std::thread([this] { Loop(); });
}

StreamWatchdog::~StreamWatchdog() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  stop_requested_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void StreamWatchdog::Add(StallableStream* stream) {
  if (limit_.count() == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  streams_.insert(stream);
}

void StreamWatchdog::Remove(StallableStream* stream) {
  if (limit_.count() == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  streams_.erase(stream);
}

void StreamWatchdog::Loop() {
  const std::chrono::milliseconds interval = CheckInterval(limit_);
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_requested_.wait_for(lock, interval, [this] { return stop_; })) {
    const auto now = std::chrono::steady_clock::now();
    // Under the lock: Remove waits, so every stream here is alive. gRPC runs
    // OnDone (which calls Remove) on its own threads, never inside the
    // Finish or TryCancel a stream calls here.
    for (StallableStream* stream : streams_) stream->CancelIfIdle(now, limit_);
  }
}

}  // namespace oscarkv
