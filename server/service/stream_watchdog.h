// Ends PutKv and GetKv streams that stall on their client. A PutKv stream
// waiting for a message holds its ingest's pool slots and its sequence id; a
// GetKv stream waiting for the client to take a write holds its sequence
// (un-evictable, and its memory after a Drop). gRPC has no per-message
// timeout on the server, so one thread looks at the registered streams a few
// times per limit and asks those idle for at least the limit to end.
//
// Thread-safety: Add and Remove may be called from any thread. The watchdog
// calls StallableStream::CancelIfIdle on its own thread while holding its
// lock, so a stream is never called after Remove returns. Lock order:
// StreamWatchdog's mutex -> the stream's own locks -> the store's.
#ifndef OSCARKV_SERVER_SERVICE_STREAM_WATCHDOG_H_
#define OSCARKV_SERVER_SERVICE_STREAM_WATCHDOG_H_

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <set>
#include <thread>

#include "absl/base/thread_annotations.h"

namespace oscarkv {

// A stream that can stall on its client (a reactor of kv_streams.cc).
class StallableStream {
 public:
  virtual ~StallableStream() = default;
  // Ends the stream (status, release of what it holds) if it has been
  // waiting on its client since at least `now - limit`; otherwise nothing.
  // Runs on the watchdog's thread: must not block on the client, nor call
  // the watchdog.
  virtual void CancelIfIdle(std::chrono::steady_clock::time_point now,
                            std::chrono::milliseconds limit) = 0;
};

class StreamWatchdog {
 public:
  // `limit` 0: streams are never ended and no thread runs.
  explicit StreamWatchdog(std::chrono::milliseconds limit);
  // Stops the thread. Every stream must have been removed.
  ~StreamWatchdog();
  StreamWatchdog(const StreamWatchdog&) = delete;
  StreamWatchdog& operator=(const StreamWatchdog&) = delete;

  // A stream registers once it may wait on its client, and removes itself
  // before it is destroyed (its reactor's OnDone). Removing a stream that was
  // never added is a no-op.
  void Add(StallableStream* stream);
  void Remove(StallableStream* stream);
  std::chrono::milliseconds limit() const { return limit_; }

 private:
  void Loop();

  const std::chrono::milliseconds limit_;
  std::mutex mu_;
  std::condition_variable stop_requested_;
  std::set<StallableStream*> streams_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace oscarkv

#endif  // OSCARKV_SERVER_SERVICE_STREAM_WATCHDOG_H_
