// The compute backend: where the cache's bytes live and the kernels that read
// and write them. One interface, two implementations: cpu/ (reference and
// embedded default, always built) and cuda/ (built when nvcc is found).
//
// All pointers inside the job structs point into memory returned by the same
// backend's Allocate() ("device memory": host memory for the CPU backend),
// except the job arrays themselves and an attention item's query and outputs,
// which are host memory owned by the caller and used during the call only.
// Kernels never allocate on the request path except to grow their staging
// and workspace when a call is larger than any before (kept for later calls),
// and never abort: failures come back as Status.
//
// Thread-safety: a Backend may be called from several threads at once.
#ifndef OSCARKV_KERNELS_BACKEND_H_
#define OSCARKV_KERNELS_BACKEND_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/numeric.h"
#include "kernels/page_format.h"

namespace oscarkv {

// Move-only owner of one backend allocation.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(void* data, size_t bytes, std::function<void(void*)> release)
      : data_(data), bytes_(bytes), release_(std::move(release)) {}
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      Reset();
      data_ = o.data_;
      bytes_ = o.bytes_;
      release_ = std::move(o.release_);
      o.data_ = nullptr;
      o.bytes_ = 0;
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { Reset(); }

  void* data() const { return data_; }
  size_t size() const { return bytes_; }
  template <typename T>
  T* as() const { return static_cast<T*>(data_); }

 private:
  void Reset() {
    if (data_ != nullptr && release_) release_(data_);
    data_ = nullptr;
  }
  void* data_ = nullptr;
  size_t bytes_ = 0;
  std::function<void(void*)> release_;
};

// The rotation of one layer as the kernels see it: matrix for kv head h is
// r + h * stride (stride 0: one matrix for all heads), fp32 D×D row-major.
struct RotationRef {
  const float* r_k = nullptr;
  const float* r_v = nullptr;
  size_t stride = 0;  // in floats
};

// Encode one full exact block (P tokens, BF16, K then V) into one history page:
// rotate, clip, quantize, pack, for every token and kv head.
struct EncodeJob {
  const bf16_bits* src_block = nullptr;  // exact block layout (page_format.h)
  uint8_t* dst_page = nullptr;           // history page layout
  RotationRef rotation;
  float clip_k = 0.96f;
  float clip_v = 0.92f;
};

// Decode one history page back into an exact block in the original basis:
// dequantize, then un-rotate (y^ · Rᵀ), rounded to BF16.
struct DecodeJob {
  const uint8_t* src_page = nullptr;
  bf16_bits* dst_block = nullptr;
  RotationRef rotation;
};

// `tokens` valid leading rows of one exact block.
struct ExactBlockRef {
  const bf16_bits* block = nullptr;
  int tokens = 0;
};

// Decode attention of one query token against one sequence-layer's cache.
// q, out and lse are HOST memory: the caller's query is read during the call
// and the outputs are written when Attend returns (a GPU backend moves them
// with its own staging: the CUDA backend uploads the queries with its page
// tables and its kernels write the outputs to pinned host memory).
struct AttendItem {
  const float* q = nullptr;  // host [num_q_heads][D] fp32, unrotated
  float* out = nullptr;      // host [num_q_heads][D] fp32
  float* lse = nullptr;      // host [num_q_heads] natural log of sum exp(scale * logit); may be null
  RotationRef rotation;
  // Sink and recent blocks, in token order (host array of device pointers).
  const ExactBlockRef* exact = nullptr;
  int num_exact = 0;
  // History pages, each full (P tokens), in token order.
  const uint8_t* const* pages = nullptr;
  int num_pages = 0;
  // Names this page table across calls; 0 = no name. The caller promises
  // that while an id is in use its table only grows at the end: a later call
  // with the same id starts with the same pages in the same order. A table
  // that is cleared or rebuilt gets a new id, and ids are never reused. The
  // CUDA backend then keeps a device copy of the table and uploads only the
  // pages added since the last call (a decode step: none, or one).
  uint64_t page_table_id = 0;
};

struct AttendBatch {
  PageGeometry geom;
  int num_q_heads = 0;
  float scale = 0.0f;  // usually 1/sqrt(D)
  const AttendItem* items = nullptr;
  int num_items = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;

  // "cpu" or "cuda".
  virtual std::string name() const = 0;
  // One-line description (device name, memory), for logs and GetServerInfo.
  virtual std::string description() const = 0;

  // Bytes Allocate() could still take now: available host memory (CPU), free
  // memory of the device (CUDA). What a fractional --pool_size is taken of;
  // a snapshot, other processes may take or free memory right after.
  // UNIMPLEMENTED for a backend that cannot tell.
  virtual absl::StatusOr<size_t> AvailableBytes() const {
    return absl::UnimplementedError(
        "backend " + name() + " cannot report its available memory; give the pool size in bytes");
  }
  // What AvailableBytes() measures, for messages ("available host memory").
  virtual std::string AvailableMemoryName() const { return "free " + name() + " device memory"; }
  // True when the kernels run on the host's cores (the CPU backend): a call
  // then takes milliseconds of CPU time, where an accelerator's caller only
  // waits briefly. By default the server runs small Attend batches on gRPC's
  // own threads only for a backend that answers false. True unless a backend
  // says otherwise (the safe answer for one that does not know).
  virtual bool ComputesOnHost() const { return true; }

  virtual absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) = 0;
  // Copies are ordered with every later call on the backend. When
  // CopyToDevice returns, `src` may be reused; when CopyToHost returns, `dst`
  // holds the data. A device-side copy may still be in flight when
  // CopyToDevice / CopyOnDevice return: its error, if any, is reported by a
  // later call.
  virtual absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) = 0;
  virtual absl::Status CopyToHost(void* dst, const void* src, size_t bytes) = 0;
  virtual absl::Status CopyOnDevice(void* dst, const void* src, size_t bytes) = 0;

  // Small CopyToDevice calls made by this thread between BeginCopyBatch and
  // EndCopyBatch may be issued together (one driver call, the CUDA backend)
  // at EndCopyBatch, or earlier when anything else is enqueued on the
  // backend: the order with every other call is kept. A decode step's fused
  // appends make two small copies per item. EndCopyBatch fails if issuing
  // them failed, whichever call issued them (that call fails too). One batch
  // per thread at a time. Default: copies go at once.
  virtual void BeginCopyBatch() {}
  virtual absl::Status EndCopyBatch() { return absl::OkStatus(); }

  virtual absl::Status EncodePages(const PageGeometry& geom, const EncodeJob* jobs,
                                   int num_jobs) = 0;
  virtual absl::Status DecodePages(const PageGeometry& geom, const DecodeJob* jobs,
                                   int num_jobs) = 0;
  virtual absl::Status Attend(const AttendBatch& batch) = 0;
};

}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_BACKEND_H_
