#include "kernels/cuda/cuda_backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/attend_kernels.h"
#include "kernels/cuda/codec_kernels.h"
#include "kernels/cuda/copy_batch.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/status_macros.h"

namespace oscarkv {
namespace {

bool Aligned8(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 7u) == 0; }

// Pinned staging + device copy of a job array, grown on demand.
class JobUpload {
 public:
  ~JobUpload() {
    if (host_ != nullptr) cudaFreeHost(host_);
    if (dev_ != nullptr) cudaFree(dev_);
  }
  // Copies `bytes` from `src` into pinned memory and enqueues the upload.
  // The caller synchronizes the stream before the next Upload.
  absl::StatusOr<void*> Upload(const void* src, size_t bytes, cudaStream_t stream) {
    if (bytes > capacity_) {
      const size_t want = std::max(bytes, capacity_ * 2);
      if (host_ != nullptr) OSCARKV_CUDA_RETURN_IF_ERROR(cudaFreeHost(host_));
      if (dev_ != nullptr) OSCARKV_CUDA_RETURN_IF_ERROR(cudaFree(dev_));
      host_ = dev_ = nullptr;
      capacity_ = 0;
      OSCARKV_CUDA_ALLOC_OR_RETURN(host_, cudaHostAlloc(&host_, want, cudaHostAllocDefault),
                                   "cudaHostAlloc (job staging)");
      OSCARKV_CUDA_ALLOC_OR_RETURN(dev_, cudaMalloc(&dev_, want), "cudaMalloc (job array)");
      capacity_ = want;
    }
    std::memcpy(host_, src, bytes);
    OSCARKV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dev_, host_, bytes, cudaMemcpyHostToDevice, stream));
    return dev_;
  }

 private:
  void* host_ = nullptr;
  void* dev_ = nullptr;
  size_t capacity_ = 0;
};

// Small host-to-device copies (a decode step's K and V rows, a few KB) are
// staged through a pinned ring: the DMA then reads pinned memory, and the
// call needs neither a pointer-type query nor the driver's pageable staging.
// The ring restarts from its beginning after the stream has finished every
// copy of the previous lap.
class PinnedRing {
 public:
  static constexpr size_t kBytes = size_t{1} << 20;
  static constexpr size_t kMaxCopy = size_t{64} << 10;

  ~PinnedRing() {
    if (host_ != nullptr) cudaFreeHost(host_);
  }
  // Stages src and enqueues dst <- src on `stream` (`defer`: at the next
  // Flush) and returns true (src may be reused then), or returns false for a
  // copy larger than kMaxCopy or when the ring cannot be allocated: the
  // caller copies directly.
  absl::StatusOr<bool> Copy(void* dst, const void* src, size_t bytes, cudaStream_t stream,
                            bool defer) {
    if (bytes > kMaxCopy) return false;
    std::lock_guard<std::mutex> lock(mu_);
    if (host_ == nullptr) {
      if (cudaHostAlloc(&host_, kBytes, cudaHostAllocDefault) != cudaSuccess) {
        cudaGetLastError();  // not sticky: the direct path still works
        host_ = nullptr;
        return false;
      }
    }
    if (pos_ + bytes > kBytes) {
      // The previous lap's copies must have read their bytes first.
      OSCARKV_RETURN_IF_ERROR(FlushLocked(stream));
      OSCARKV_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
      pos_ = 0;
    }
    uint8_t* slot = static_cast<uint8_t*>(host_) + pos_;
    std::memcpy(slot, src, bytes);
    pos_ = (pos_ + bytes + 255) & ~size_t{255};
    dsts_.push_back(dst);
    srcs_.push_back(slot);
    sizes_.push_back(bytes);
    // Enqueued under the lock: a later lap cannot reuse the slot before it.
    if (!defer) OSCARKV_RETURN_IF_ERROR(FlushLocked(stream));
    return true;
  }

  // Enqueues the deferred copies, in one driver call. A flush takes every
  // thread's deferred copies: they go together as one unordered batch, which
  // is safe because no destination is written twice between flushes (a
  // recent block's rows are written once, and the block is reused only after
  // the demotion that reads it, whose encode flushes first).
  absl::Status Flush(cudaStream_t stream) {
    std::lock_guard<std::mutex> lock(mu_);
    return FlushLocked(stream);
  }

  // Flushes that failed so far; FailureSince(count) is the last one's error
  // if any failed after the count was `count`, else OK: a batch's owner
  // learns of a failure even when another call's flush issued its copies.
  uint64_t failures() {
    std::lock_guard<std::mutex> lock(mu_);
    return failures_;
  }
  absl::Status FailureSince(uint64_t count) {
    std::lock_guard<std::mutex> lock(mu_);
    return failures_ != count ? last_failure_ : absl::OkStatus();
  }

 private:
  absl::Status FlushLocked(cudaStream_t stream) {
    if (dsts_.empty()) return absl::OkStatus();
    const absl::Status s =
        CopyBatchToDevice(dsts_.data(), srcs_.data(), sizes_.data(), dsts_.size(), stream);
    dsts_.clear();
    srcs_.clear();
    sizes_.clear();
    if (!s.ok()) {
      ++failures_;
      last_failure_ = s;
    }
    return s;
  }

  std::mutex mu_;
  uint64_t failures_ = 0;
  absl::Status last_failure_;
  void* host_ = nullptr;
  size_t pos_ = 0;
  std::vector<void*> dsts_;  // staged, not yet enqueued
  std::vector<const void*> srcs_;
  std::vector<size_t> sizes_;
};

// The backend whose copy batch this thread has open (BeginCopyBatch), and
// its ring's failed-flush count then.
thread_local const void* tl_copy_batch = nullptr;
thread_local uint64_t tl_copy_batch_failures = 0;

absl::Status CheckRotation(const RotationRef& r, const char* what, int i) {
  if (r.r_k == nullptr || r.r_v == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(what, " ", i, " has no rotation"));
  }
  return absl::OkStatus();
}

class CudaBackend final : public Backend {
 public:
  CudaBackend(int device, std::string description, std::unique_ptr<AttendLauncher> launcher,
              cudaStream_t stream)
      : device_(device),
        description_(std::move(description)),
        launcher_(std::move(launcher)),
        stream_(stream) {}
  ~CudaBackend() override {
    cudaSetDevice(device_);
    (void)ring_.Flush(stream_);
    cudaStreamSynchronize(stream_);
    launcher_.reset();
    cudaStreamDestroy(stream_);
  }

  std::string name() const override { return "cuda"; }
  bool ComputesOnHost() const override { return false; }
  std::string description() const override { return description_; }

  // Free memory of this device (cudaMemGetInfo), not of the host.
  absl::StatusOr<size_t> AvailableBytes() const override {
    OSCARKV_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    size_t free_bytes = 0, total_bytes = 0;
    OSCARKV_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
    return free_bytes;
  }

  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override {
    OSCARKV_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, std::max<size_t>(bytes, 1));
    if (err != cudaSuccess) {
      return CudaAllocationStatus(err, absl::StrCat("cudaMalloc(", bytes, " bytes)").c_str());
    }
    const int dev = device_;
    return DeviceBuffer(p, bytes, [dev](void* q) {
      cudaSetDevice(dev);
      cudaFree(q);
    });
  }

  absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) override {
    return Copy(dst, src, bytes, cudaMemcpyHostToDevice);
  }
  void BeginCopyBatch() override {
    tl_copy_batch = this;
    tl_copy_batch_failures = ring_.failures();
  }
  // Fails if any flush failed since BeginCopyBatch, whichever call issued it
  // (the batch's copies may have gone with it).
  absl::Status EndCopyBatch() override {
    if (tl_copy_batch != this) return absl::OkStatus();
    tl_copy_batch = nullptr;
    OSCARKV_RETURN_IF_ERROR(ReadyToEnqueue());
    return ring_.FailureSince(tl_copy_batch_failures);
  }
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes) override {
    return Copy(dst, src, bytes, cudaMemcpyDeviceToHost);
  }
  absl::Status CopyOnDevice(void* dst, const void* src, size_t bytes) override {
    return Copy(dst, src, bytes, cudaMemcpyDeviceToDevice);
  }

  absl::Status EncodePages(const PageGeometry& geom, const EncodeJob* jobs, int num_jobs) override {
    OSCARKV_RETURN_IF_ERROR(ValidateGeometry(geom));
    if (num_jobs < 0 || (num_jobs > 0 && jobs == nullptr)) {
      return absl::InvalidArgumentError("EncodePages: no job array");
    }
    for (int i = 0; i < num_jobs; ++i) {
      const EncodeJob& j = jobs[i];
      if (j.src_block == nullptr || j.dst_page == nullptr || !Aligned8(j.src_block) ||
          !Aligned8(j.dst_page)) {
        return absl::InvalidArgumentError(
            absl::StrCat("encode job ", i, " has a null or unaligned block or page"));
      }
      OSCARKV_RETURN_IF_ERROR(CheckRotation(j.rotation, "encode job", i));
      if (!(j.clip_k > 0.0f && j.clip_k <= 1.0f) || !(j.clip_v > 0.0f && j.clip_v <= 1.0f)) {
        return absl::InvalidArgumentError(
            absl::StrCat("encode job ", i, " has clip ratios outside (0, 1]"));
      }
    }
    if (num_jobs == 0) return absl::OkStatus();
    std::lock_guard<std::mutex> lock(mu_);
    OSCARKV_RETURN_IF_ERROR(ReadyToEnqueue());
    OSCARKV_ASSIGN_OR_RETURN(void* dev_jobs,
                             jobs_.Upload(jobs, sizeof(EncodeJob) * num_jobs, stream_));
    OSCARKV_RETURN_IF_ERROR(
        LaunchEncodePages(geom, static_cast<const EncodeJob*>(dev_jobs), num_jobs, stream_));
    return CudaStatus(cudaStreamSynchronize(stream_), "EncodePages");
  }

  absl::Status DecodePages(const PageGeometry& geom, const DecodeJob* jobs, int num_jobs) override {
    OSCARKV_RETURN_IF_ERROR(ValidateGeometry(geom));
    if (num_jobs < 0 || (num_jobs > 0 && jobs == nullptr)) {
      return absl::InvalidArgumentError("DecodePages: no job array");
    }
    for (int i = 0; i < num_jobs; ++i) {
      const DecodeJob& j = jobs[i];
      if (j.src_page == nullptr || j.dst_block == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat("decode job ", i, " has a null pointer"));
      }
      OSCARKV_RETURN_IF_ERROR(CheckRotation(j.rotation, "decode job", i));
    }
    if (num_jobs == 0) return absl::OkStatus();
    std::lock_guard<std::mutex> lock(mu_);
    OSCARKV_RETURN_IF_ERROR(ReadyToEnqueue());
    OSCARKV_ASSIGN_OR_RETURN(void* dev_jobs,
                             jobs_.Upload(jobs, sizeof(DecodeJob) * num_jobs, stream_));
    OSCARKV_RETURN_IF_ERROR(
        LaunchDecodePages(geom, static_cast<const DecodeJob*>(dev_jobs), num_jobs, stream_));
    return CudaStatus(cudaStreamSynchronize(stream_), "DecodePages");
  }

  absl::Status Attend(const AttendBatch& batch) override {
    std::lock_guard<std::mutex> lock(mu_);
    OSCARKV_RETURN_IF_ERROR(ReadyToEnqueue());
    // One upload (queries, tables), the kernels (which write the outputs to
    // pinned host memory), one wait.
    OSCARKV_RETURN_IF_ERROR(launcher_->Prepare(batch, stream_));
    OSCARKV_RETURN_IF_ERROR(launcher_->Launch(stream_));
    OSCARKV_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream_), "Attend"));
    return launcher_->CopyResults(batch);
  }

 private:
  // Before anything is enqueued on stream_: this device current, and the
  // copies the ring deferred issued first, so that stream order is call order
  // (an encode reads the rows its demotion's appends copied).
  absl::Status ReadyToEnqueue() {
    OSCARKV_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    return ring_.Flush(stream_);
  }

  // Small host-to-device copies go through the pinned ring (no wait). Others
  // wait only where the caller needs it: copies to the host, and copies from
  // pinned host memory (which the DMA reads after the call). A copy from
  // pageable memory has been staged when cudaMemcpyAsync returns, and
  // device-to-device copies are ordered with everything later on the stream,
  // so neither needs a round trip.
  absl::Status Copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
    if (bytes == 0) return absl::OkStatus();
    if (dst == nullptr || src == nullptr) return absl::InvalidArgumentError("copy with a null pointer");
    OSCARKV_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    if (kind == cudaMemcpyHostToDevice) {
      OSCARKV_ASSIGN_OR_RETURN(const bool staged,
                               ring_.Copy(dst, src, bytes, stream_, tl_copy_batch == this));
      if (staged) return absl::OkStatus();
    }
    OSCARKV_RETURN_IF_ERROR(ring_.Flush(stream_));  // as in ReadyToEnqueue (device already set)
    OSCARKV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, kind, stream_));
    bool wait = kind == cudaMemcpyDeviceToHost;
    if (kind == cudaMemcpyHostToDevice) {
      cudaPointerAttributes attr{};
      if (cudaPointerGetAttributes(&attr, src) != cudaSuccess) {
        cudaGetLastError();
        wait = true;
      } else {
        wait = attr.type != cudaMemoryTypeUnregistered;
      }
    }
    if (!wait) return absl::OkStatus();
    return CudaStatus(cudaStreamSynchronize(stream_), "copy");
  }

  const int device_;
  const std::string description_;
  std::mutex mu_;  // guards launcher_, jobs_ (and their staging buffers)
  std::unique_ptr<AttendLauncher> launcher_;
  JobUpload jobs_;
  PinnedRing ring_;  // small host-to-device copies (its own lock)
  cudaStream_t stream_;
};

}  // namespace

int CudaDeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device) {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess || n == 0) {
    cudaGetLastError();
    return absl::UnavailableError(absl::StrCat(
        "no CUDA device: ", err != cudaSuccess ? cudaGetErrorString(err) : "device count is 0"));
  }
  if (device < 0 || device >= n) {
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA device ", device, " out of range (", n, " devices)"));
  }
  OSCARKV_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  cudaDeviceProp prop;
  OSCARKV_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device));
  if (prop.major < 8) {
    return absl::FailedPreconditionError(absl::StrCat(
        "CUDA device ", device, " (", prop.name, ") has compute capability ", prop.major, ".",
        prop.minor, "; oscarkv needs 8.0 or newer"));
  }
  OSCARKV_ASSIGN_OR_RETURN(auto launcher, AttendLauncher::Create(device));
  // Which encode kernel this device runs, asked now so that no encode waits
  // for the probe.
  OSCARKV_ASSIGN_OR_RETURN(const bool wgmma_encode, EncodeWarpgroupAvailable());
  cudaStream_t stream = nullptr;
  OSCARKV_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const std::string desc = absl::StrFormat(
      "cuda:%d %s (sm_%d%d, %d SMs, %.1f GiB, %s encode)", device, prop.name, prop.major,
      prop.minor, prop.multiProcessorCount, prop.totalGlobalMem / double(1ull << 30),
      wgmma_encode ? "wgmma" : "mma.sync");
  return std::unique_ptr<Backend>(
      new CudaBackend(device, desc, std::move(launcher), stream));
}

}  // namespace oscarkv
