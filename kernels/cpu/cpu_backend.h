// The CPU backend: host memory, the scalar codec and the CPU attention,
// spread over a fixed number of threads. The embedded default when no GPU is
// found, and the reference every CUDA kernel is compared against.
#ifndef OSCARKV_KERNELS_CPU_CPU_BACKEND_H_
#define OSCARKV_KERNELS_CPU_CPU_BACKEND_H_

#include <memory>

#include "kernels/backend.h"
#include "kernels/cpu/parallel.h"

namespace oscarkv {

class CpuBackend final : public Backend {
 public:
  // threads <= 0: one per hardware thread.
  explicit CpuBackend(int threads = 0);

  std::string name() const override { return "cpu"; }
  std::string description() const override;

  // Available host memory (sysconf _SC_AVPHYS_PAGES x page size).
  absl::StatusOr<size_t> AvailableBytes() const override;
  std::string AvailableMemoryName() const override { return "available host memory"; }
  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override;
  absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) override;
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes) override;
  absl::Status CopyOnDevice(void* dst, const void* src, size_t bytes) override;

  absl::Status EncodePages(const PageGeometry& geom, const EncodeJob* jobs, int num_jobs) override;
  absl::Status DecodePages(const PageGeometry& geom, const DecodeJob* jobs, int num_jobs) override;
  absl::Status Attend(const AttendBatch& batch) override;

 private:
  std::unique_ptr<ParallelFor> pool_;
};

// Checks a geometry the kernels can run: D in {64,128,256}, G divides D, G >= 4.
absl::Status ValidateGeometry(const PageGeometry& geom);

// InvalidArgument naming the first NaN/Inf in a host query of n floats.
absl::Status ValidateQuery(const float* q, size_t n);

}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_CPU_CPU_BACKEND_H_
