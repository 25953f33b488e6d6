#include "kernels/cpu/cpu_backend.h"

#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/attention_cpu.h"
#include "kernels/quantize.h"
#include "kernels/status_macros.h"

namespace oscarkv {

absl::Status ValidateGeometry(const PageGeometry& g) {
  if (g.head_dim != 64 && g.head_dim != 128 && g.head_dim != 256) {
    return absl::InvalidArgumentError(absl::StrCat("unsupported head_dim ", g.head_dim));
  }
  if (g.group_size < 4 || g.head_dim % g.group_size != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("group_size ", g.group_size, " must divide head_dim ", g.head_dim));
  }
  if (g.kv_heads <= 0 || g.page_tokens <= 0) {
    return absl::InvalidArgumentError("kv_heads and page_tokens must be positive");
  }
  return absl::OkStatus();
}

namespace {
// Per-thread tile of rotated rows, sized on first use (no allocation afterwards).
std::vector<float>& RotatedTile() {
  static thread_local std::vector<float> tile;
  return tile;
}
}  // namespace

absl::Status ValidateQuery(const float* q, size_t n) {
  if (q == nullptr) return absl::InvalidArgumentError("query is missing");
  // A branch-free scan of the exponent bits (it vectorizes: this runs on
  // every attention call), then the index only when something is wrong.
  auto non_finite = [q](size_t i) {
    uint32_t bits;
    std::memcpy(&bits, q + i, sizeof(bits));
    return uint32_t((bits & 0x7f800000u) == 0x7f800000u);  // exponent all ones
  };
  uint32_t any = 0;
  for (size_t i = 0; i < n; ++i) any |= non_finite(i);
  if (any == 0) return absl::OkStatus();
  size_t i = 0;
  while (i + 1 < n && non_finite(i) == 0) ++i;
  return absl::InvalidArgumentError(absl::StrCat("query contains a non-finite value at index ", i));
}

CpuBackend::CpuBackend(int threads) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  pool_ = std::make_unique<ParallelFor>(threads);
}

std::string CpuBackend::description() const {
  return absl::StrCat("cpu (", pool_->threads(), " threads)");
}

absl::StatusOr<size_t> CpuBackend::AvailableBytes() const {
  const long pages = sysconf(_SC_AVPHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) {
    return absl::FailedPreconditionError("cannot read the available host memory (sysconf)");
  }
  return size_t(pages) * size_t(page);
}

absl::StatusOr<DeviceBuffer> CpuBackend::Allocate(size_t bytes) {
  const size_t rounded = (std::max<size_t>(bytes, 1) + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, rounded);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes, " host bytes"));
  }
  return DeviceBuffer(p, bytes, [](void* q) { std::free(q); });
}

absl::Status CpuBackend::CopyToDevice(void* dst, const void* src, size_t bytes) {
  if (bytes) std::memcpy(dst, src, bytes);
  return absl::OkStatus();
}
absl::Status CpuBackend::CopyToHost(void* dst, const void* src, size_t bytes) {
  if (bytes) std::memcpy(dst, src, bytes);
  return absl::OkStatus();
}
absl::Status CpuBackend::CopyOnDevice(void* dst, const void* src, size_t bytes) {
  if (bytes) std::memmove(dst, src, bytes);
  return absl::OkStatus();
}

absl::Status CpuBackend::EncodePages(const PageGeometry& geom, const EncodeJob* jobs,
                                     int num_jobs) {
  OSCARKV_RETURN_IF_ERROR(ValidateGeometry(geom));
  const int H = geom.kv_heads, d = geom.head_dim, P = geom.page_tokens;
  const size_t row = geom.exact_row_elems();
  pool_->Run(num_jobs * H, [&](int task) {
    const EncodeJob& job = jobs[task / H];
    const int h = task % H;
    float scratch[256];
    std::vector<float>& y = RotatedTile();
    y.resize(size_t(P) * d);
    for (int kind = 0; kind < 2; ++kind) {
      const bf16_bits* src = job.src_block + kind * size_t(P) * row + size_t(h) * d;
      const float* r = (kind == 0 ? job.rotation.r_k : job.rotation.r_v) + job.rotation.stride * h;
      const float clip = kind == 0 ? job.clip_k : job.clip_v;
      uint8_t* codes = job.dst_page + geom.codes_offset(h, kind);
      auto* params = reinterpret_cast<QuantParams*>(job.dst_page + geom.params_offset(h, kind));
      RotateRows(src, row, P, r, d, y.data());
      for (int t = 0; t < P; ++t) {
        float* yt = y.data() + size_t(t) * d;
        ClipRow(yt, d, clip, scratch);
        QuantizeRow(yt, d, geom.group_size, codes + size_t(t) * geom.code_row_bytes(),
                    params + size_t(t) * geom.groups());
      }
    }
  });
  return absl::OkStatus();
}

absl::Status CpuBackend::DecodePages(const PageGeometry& geom, const DecodeJob* jobs,
                                     int num_jobs) {
  OSCARKV_RETURN_IF_ERROR(ValidateGeometry(geom));
  const int H = geom.kv_heads, d = geom.head_dim, P = geom.page_tokens;
  const size_t row = geom.exact_row_elems();
  pool_->Run(num_jobs * H, [&](int task) {
    const DecodeJob& job = jobs[task / H];
    const int h = task % H;
    float y[256];
    for (int kind = 0; kind < 2; ++kind) {
      const float* r = (kind == 0 ? job.rotation.r_k : job.rotation.r_v) + job.rotation.stride * h;
      const uint8_t* codes = job.src_page + geom.codes_offset(h, kind);
      const auto* params =
          reinterpret_cast<const QuantParams*>(job.src_page + geom.params_offset(h, kind));
      bf16_bits* dst = job.dst_block + kind * size_t(P) * row + size_t(h) * d;
      for (int t = 0; t < P; ++t) {
        DequantizeRow(codes + size_t(t) * geom.code_row_bytes(), params + size_t(t) * geom.groups(),
                      d, geom.group_size, y);
        // x = y · Rᵀ: x_i = Σ_j y_j R[i][j].
        for (int i = 0; i < d; ++i) {
          const float* ri = r + size_t(i) * d;
          float s = 0.0f;
          for (int j = 0; j < d; ++j) s += y[j] * ri[j];
          dst[t * row + i] = FloatToBf16(s);
        }
      }
    }
  });
  return absl::OkStatus();
}

absl::Status CpuBackend::Attend(const AttendBatch& batch) {
  OSCARKV_RETURN_IF_ERROR(ValidateGeometry(batch.geom));
  const int H = batch.geom.kv_heads;
  if (batch.num_q_heads <= 0 || batch.num_q_heads % H != 0 || batch.num_q_heads / H > 64) {
    return absl::InvalidArgumentError(absl::StrCat("num_q_heads ", batch.num_q_heads,
                                                   " must be a multiple of kv_heads ", H,
                                                   " with at most 64 per group"));
  }
  const size_t q_elems = size_t(batch.num_q_heads) * batch.geom.head_dim;
  for (int i = 0; i < batch.num_items; ++i) {
    OSCARKV_RETURN_IF_ERROR(ValidateQuery(batch.items[i].q, q_elems));
  }
  pool_->Run(batch.num_items * H, [&](int task) {
    AttendCompressedKvHead(batch.geom, batch.num_q_heads, batch.scale, batch.items[task / H],
                           task % H);
  });
  return absl::OkStatus();
}

}  // namespace oscarkv
