#include "kernels/cuda/codec_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/encode_rows.cuh"
#include "kernels/quantize.h"
#include "kernels/status_macros.h"

namespace oscarkv {
namespace {

using namespace cuda_encode;  // NOLINT: the row helpers
using bf16 = __nv_bfloat16;

constexpr int kEncodeWarps = 16;
constexpr int kEncodeThreads = kEncodeWarps * 32;
constexpr int kEncodeTilesPerBlock = 8;

// Tile shapes of the encode kernel for head dim D: M rows per tile, the
// rotation staged in shared memory CW columns at a time as three bf16 terms
// (hi + mid + lo = R to ~2^-24 relative, so x·R keeps fp32 accuracy: x is
// exact in bf16).
template <int D>
struct EncodeShape {
  static constexpr int M = D == 256 ? 32 : 64;
  static constexpr int CW = D < 128 ? D : (D == 128 ? 128 : 64);
  static constexpr int NC = D / CW;
  static constexpr int LDX = D + 8;   // bf16 elements
  static constexpr int LDR = CW + 8;  // bf16 elements
  static constexpr int LDY = D + 4;   // floats
  static constexpr size_t kXBytes = size_t(M) * LDX * 2;
  static constexpr size_t kRBytes = size_t(D) * LDR * 2;
  static constexpr size_t kYBytes = size_t(M) * LDY * 4;
  static constexpr size_t kSmem = kXBytes + 3 * kRBytes + kYBytes + 2 * M * 4;
};

// A rotation element's three bf16 terms, hi + mid + lo = v to ~2^-24
// relative (the tiled and wgmma kernels multiply x, exact in bf16, by each).
struct Bf16Terms {
  bf16 hi, mid, lo;
};
__device__ __forceinline__ Bf16Terms SplitBf16Terms(float v) {
  const bf16 hi = __float2bfloat16_rn(v);
  const float r1 = v - __bfloat162float(hi);
  const bf16 mid = __float2bfloat16_rn(r1);
  return {hi, mid, __float2bfloat16_rn(r1 - __bfloat162float(mid))};
}

__device__ __forceinline__ const float* RowRotation(const RotationRef& r, int kind, int h) {
  return (kind == 0 ? r.r_k : r.r_v) + r.stride * h;
}

// Warp index the compiler can prove warp-uniform (a shuffle from lane 0), so
// warp-collective code inside per-warp loops compiles without the divergence
// fallback (WARPSYNC / ENDCOLLECTIVE around every shuffle).
__device__ __forceinline__ int WarpIndex() {
  return __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) >> 5, 0);
}

}  // namespace
}  // namespace oscarkv

#include "kernels/cuda/encode_strips.cuh"
#include "kernels/cuda/encode_warpgroup.cuh"

namespace oscarkv {
namespace {

// Per-row metadata of one tile, computed once per tile.
struct EncodeRow {
  const bf16_bits* src;  // the row's first element (kind, head)
  const float* rot;      // its rotation
  uint8_t* codes;        // destination code row
  QuantParams* params;   // destination params row
  int top;  // clip rank from the top (ClipTopRank)
  int done;
};

// grid.x: chunks of kEncodeTilesPerBlock*M rows over (job, token); grid.y: head*2 + kind.
template <int D, int G>
__global__ void __launch_bounds__(kEncodeThreads, 1)
    EncodeKernel(PageGeometry geom, const EncodeJob* __restrict__ jobs, int num_jobs) {
  using S = EncodeShape<D>;
  namespace wmma = nvcuda::wmma;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* xs = reinterpret_cast<bf16*>(smem);
  bf16* rhi = reinterpret_cast<bf16*>(smem + S::kXBytes);
  bf16* rmid = reinterpret_cast<bf16*>(smem + S::kXBytes + S::kRBytes);
  bf16* rlo = reinterpret_cast<bf16*>(smem + S::kXBytes + 2 * S::kRBytes);
  float* ys = reinterpret_cast<float*>(smem + S::kXBytes + 3 * S::kRBytes);
  __shared__ EncodeRow rows[S::M];
  __shared__ const float* cur_r;
  __shared__ const float* loaded_r;
  __shared__ int loaded_chunk;

  const int tid = threadIdx.x, warp = WarpIndex(), lane = tid & 31;
  const int h = blockIdx.y >> 1, kind = blockIdx.y & 1;
  const int P = geom.page_tokens;
  const size_t row_elems = geom.exact_row_elems();
  const int total_rows = num_jobs * P;  // < 2^31: checked by the launcher
  const int block_row0 = blockIdx.x * kEncodeTilesPerBlock * S::M;
  if (tid == 0) {
    loaded_r = nullptr;
    loaded_chunk = -1;
  }

  for (int tile = 0; tile < kEncodeTilesPerBlock; ++tile) {
    const int row0 = block_row0 + tile * S::M;
    if (row0 >= total_rows) break;
    const int n = min(S::M, total_rows - row0);
    for (int i = tid; i < S::M; i += kEncodeThreads) {
      EncodeRow er{};
      er.done = 1;
      if (i < n) {
        const int row = row0 + i;
        const int j = row / P, t = row - j * P;
        const EncodeJob& job = jobs[j];
        er.src = job.src_block + kind * size_t(P) * row_elems + size_t(t) * row_elems +
                 size_t(h) * D;
        er.rot = RowRotation(job.rotation, kind, h);
        er.codes = job.dst_page + geom.codes_offset(h, kind) + size_t(t) * (D / 4);
        er.params = reinterpret_cast<QuantParams*>(job.dst_page + geom.params_offset(h, kind)) +
                    size_t(t) * geom.groups();
        er.top = ClipTopRank(kind == 0 ? job.clip_k : job.clip_v, D);
        er.done = 0;
      }
      rows[i] = er;
    }
    __syncthreads();
    // Rows of one tile may belong to jobs with different rotations: one pass per
    // distinct rotation (one pass in the common case).
    while (true) {
      if (tid == 0) {
        cur_r = nullptr;
        for (int i = 0; i < n; ++i) {
          if (!rows[i].done) {
            cur_r = rows[i].rot;
            break;
          }
        }
      }
      __syncthreads();
      const float* r = cur_r;
      if (r == nullptr) break;
      // Stage x rows of this rotation (others zero), 8 bytes per thread-load.
      constexpr int kChunksPerRow = D / 4;
      for (int idx = tid; idx < S::M * kChunksPerRow; idx += kEncodeThreads) {
        const int i = idx / kChunksPerRow, c = idx % kChunksPerRow;
        uint2 v = make_uint2(0, 0);
        if (!rows[i].done && rows[i].rot == r) v = *reinterpret_cast<const uint2*>(rows[i].src + 4 * c);
        *reinterpret_cast<uint2*>(xs + i * S::LDX + 4 * c) = v;
      }
      for (int cc = 0; cc < S::NC; ++cc) {
        if (loaded_r != r || loaded_chunk != cc) {
          __syncthreads();  // previous users of the staged rotation are done
          for (int idx = tid; idx < D * S::CW; idx += kEncodeThreads) {
            const int i = idx / S::CW, j = idx % S::CW;
            const Bf16Terms t = SplitBf16Terms(r[size_t(i) * D + cc * S::CW + j]);
            rhi[i * S::LDR + j] = t.hi;
            rmid[i * S::LDR + j] = t.mid;
            rlo[i * S::LDR + j] = t.lo;
          }
          __syncthreads();
          if (tid == 0) {
            loaded_r = r;
            loaded_chunk = cc;
          }
        }
        __syncthreads();
        constexpr int TN = S::CW / 16;
        constexpr int T = (S::M / 16) * TN;
        for (int t = warp; t < T; t += kEncodeWarps) {
          const int mi = t / TN, nj = t % TN;
          wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
          wmma::fill_fragment(acc, 0.0f);
#pragma unroll 4
          for (int kk = 0; kk < D / 16; ++kk) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> a;
            wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> b;
            wmma::load_matrix_sync(a, xs + mi * 16 * S::LDX + kk * 16, S::LDX);
            wmma::load_matrix_sync(b, rlo + kk * 16 * S::LDR + nj * 16, S::LDR);
            wmma::mma_sync(acc, a, b, acc);
            wmma::load_matrix_sync(b, rmid + kk * 16 * S::LDR + nj * 16, S::LDR);
            wmma::mma_sync(acc, a, b, acc);
            wmma::load_matrix_sync(b, rhi + kk * 16 * S::LDR + nj * 16, S::LDR);
            wmma::mma_sync(acc, a, b, acc);
          }
          wmma::store_matrix_sync(ys + mi * 16 * S::LDY + cc * S::CW + nj * 16, acc, S::LDY,
                                  wmma::mem_row_major);
        }
      }
      __syncthreads();
      // Each warp quantizes rows warp, warp + kEncodeWarps, ...; clip
      // searches of kRows rows at a time.
      constexpr int kRows = 4;
      for (int i0 = warp; i0 < n; i0 += kEncodeWarps * kRows) {
        const float* yr[kRows];
        int top[kRows];
        float tau[kRows];
        bool use[kRows];
#pragma unroll
        for (int k = 0; k < kRows; ++k) {
          const int i = i0 + k * kEncodeWarps;
          use[k] = i < n && !rows[i].done && rows[i].rot == r;
          yr[k] = ys + (i < S::M ? i : 0) * S::LDY;
          top[k] = use[k] ? rows[i].top : 0;
        }
        ClipThresholdsWarp<D, kRows>(yr, top, tau, lane);
        uint8_t* codes[kRows];
        QuantParams* params[kRows];
#pragma unroll
        for (int k = 0; k < kRows; ++k) {
          const EncodeRow* er = use[k] ? &rows[i0 + k * kEncodeWarps] : nullptr;
          codes[k] = er != nullptr ? er->codes : nullptr;
          params[k] = er != nullptr ? er->params : nullptr;
        }
        QuantizeRowsWarp<D, G, kRows>(yr, tau, codes, params, use, lane);
      }
      __syncthreads();
      // Mark the rows of this rotation done (after every warp has compared).
      for (int i = tid; i < n; i += kEncodeThreads) {
        if (!rows[i].done && rows[i].rot == r) rows[i].done = 1;
      }
      __syncthreads();
    }
  }
}

// Decode: one block per (job, head*2+kind), D threads; tokens in batches of 8
// so each rotation element read from L1 serves 8 rows.
constexpr int kDecodeBatch = 8;

template <int D>
__global__ void __launch_bounds__(D)
    DecodeKernel(PageGeometry geom, const DecodeJob* __restrict__ jobs) {
  __shared__ float ys[kDecodeBatch][D];
  const DecodeJob& job = jobs[blockIdx.x];
  const int h = blockIdx.y >> 1, kind = blockIdx.y & 1;
  const int i = threadIdx.x;
  const int P = geom.page_tokens, groups = geom.groups(), G = geom.group_size;
  const size_t row_elems = geom.exact_row_elems();
  const uint8_t* codes = job.src_page + geom.codes_offset(h, kind);
  const auto* params =
      reinterpret_cast<const QuantParams*>(job.src_page + geom.params_offset(h, kind));
  const float* r = RowRotation(job.rotation, kind, h) + size_t(i) * D;
  bf16_bits* dst = job.dst_block + kind * size_t(P) * row_elems + size_t(h) * D + i;
  constexpr int kQuarter = D / 4;
  for (int t0 = 0; t0 < P; t0 += kDecodeBatch) {
    const int nt = min(kDecodeBatch, P - t0);
    for (int tt = 0; tt < nt; ++tt) {
      const int t = t0 + tt;
      const uint8_t byte = codes[size_t(t) * kQuarter + (i % kQuarter)];
      const QuantParams p = params[size_t(t) * groups + i / G];
      ys[tt][i] = static_cast<float>(UnpackCode(byte, i / kQuarter)) * Fp16ToFloat(p.scale) +
                  Fp16ToFloat(p.min);
    }
    __syncthreads();
    float acc[kDecodeBatch];
#pragma unroll
    for (int tt = 0; tt < kDecodeBatch; ++tt) acc[tt] = 0.0f;
    for (int j = 0; j < D; ++j) {
      const float rv = __ldg(r + j);
#pragma unroll
      for (int tt = 0; tt < kDecodeBatch; ++tt) acc[tt] = fmaf(ys[tt][j], rv, acc[tt]);
    }
    for (int tt = 0; tt < nt; ++tt) dst[size_t(t0 + tt) * row_elems] = FloatToBf16(acc[tt]);
    __syncthreads();
  }
}

constexpr int kMaxCachedDevices = 64;
using PerDevice = std::array<std::atomic<int>, kMaxCachedDevices>;

// Resident blocks of `kernel` on the whole current device, after raising its
// dynamic shared-memory limit to `smem`. Both are driver calls that cost more
// than a small launch (a demotion batch of 64 pages encodes in ~45 µs), so the
// answer is kept per device in `cache` (one per kernel instantiation).
template <typename Kernel>
absl::StatusOr<int> ResidentBlocks(Kernel kernel, int threads, size_t smem, PerDevice& cache) {
  int device = 0;
  OSCARKV_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  const bool cached = device >= 0 && device < kMaxCachedDevices;
  if (cached) {
    const int known = cache[device].load(std::memory_order_relaxed);
    if (known > 0) return known;
  }
  OSCARKV_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  int sms = 0, per_sm = 0;
  OSCARKV_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  OSCARKV_CUDA_RETURN_IF_ERROR(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  const int blocks = std::max(sms, 1) * std::max(per_sm, 1);
  if (cached) cache[device].store(blocks, std::memory_order_relaxed);
  return blocks;
}

template <int D, int G>
absl::Status LaunchEncodeTiled(const PageGeometry& geom, const EncodeJob* jobs, int num_jobs,
                               cudaStream_t stream) {
  using S = EncodeShape<D>;
  const auto kernel = EncodeKernel<D, G>;
  static PerDevice setup{};  // the grid is sized by the rows; only the attribute is needed
  OSCARKV_RETURN_IF_ERROR(ResidentBlocks(kernel, kEncodeThreads, S::kSmem, setup).status());
  const long rows = static_cast<long>(num_jobs) * geom.page_tokens;
  if (rows > (1L << 30)) return absl::InvalidArgumentError("too many encode jobs for one launch");
  const long per_block = static_cast<long>(kEncodeTilesPerBlock) * S::M;
  const long blocks = (rows + per_block - 1) / per_block;
  dim3 grid(static_cast<unsigned>(blocks), 2 * geom.kv_heads);
  kernel<<<grid, kEncodeThreads, S::kSmem, stream>>>(geom, jobs, num_jobs);
  return CudaStatus(cudaGetLastError(), "EncodeKernel launch");
}

// The strip kernel (roles = false) or its warp-specialized twin (true): one
// wave of blocks, each walking a contiguous range of (kind, head, tile) items.
template <int D, int G, bool kRoles>
absl::Status LaunchEncodeStrips(const PageGeometry& geom, const EncodeJob* jobs, int num_jobs,
                                cudaStream_t stream) {
  using S = encode_strips::Shape<D>;
  const auto kernel = kRoles ? encode_strips::EncodeRolesKernel<D, G>
                             : encode_strips::EncodeStripsKernel<D, G>;
  const int threads = kRoles ? encode_strips::roles::kThreads : encode_strips::kThreads;
  const size_t smem = kRoles ? encode_strips::roles::Smem<D>::kBytes : S::kSmem;
  static PerDevice wave{};
  OSCARKV_ASSIGN_OR_RETURN(const int resident, ResidentBlocks(kernel, threads, smem, wave));
  const long rows = static_cast<long>(num_jobs) * geom.page_tokens;
  if (rows > (1L << 30)) return absl::InvalidArgumentError("too many encode jobs for one launch");
  const long tiles = (rows + S::M - 1) / S::M;
  const long items = tiles * 2 * geom.kv_heads;
  const long blocks = std::min<long>(items, resident);
  kernel<<<static_cast<unsigned>(blocks), threads, smem, stream>>>(
      geom, jobs, num_jobs, static_cast<int>(tiles), items);
  return CudaStatus(cudaGetLastError(),
                    kRoles ? "EncodeRolesKernel launch" : "EncodeStripsKernel launch");
}

// The wgmma kernel (D 128): one wave of blocks, as the roles kernel.
template <int G>
absl::Status LaunchEncodeWarpgroup(const PageGeometry& geom, const EncodeJob* jobs, int num_jobs,
                                   cudaStream_t stream) {
  namespace wg = encode_warpgroup;
  const auto kernel = wg::EncodeWarpgroupKernel<G>;
  static PerDevice wave{};
  OSCARKV_ASSIGN_OR_RETURN(const int resident,
                           ResidentBlocks(kernel, wg::kThreads, wg::kSmemBytes, wave));
  const long rows = static_cast<long>(num_jobs) * geom.page_tokens;
  if (rows > (1L << 30)) return absl::InvalidArgumentError("too many encode jobs for one launch");
  const long tiles = (rows + wg::S::M - 1) / wg::S::M;
  const long items = tiles * 2 * geom.kv_heads;
  const long blocks = std::min<long>(items, resident);
  kernel<<<static_cast<unsigned>(blocks), wg::kThreads, wg::kSmemBytes, stream>>>(
      geom, jobs, num_jobs, static_cast<int>(tiles), items);
  return CudaStatus(cudaGetLastError(), "EncodeWarpgroupKernel launch");
}

// The encode launch for head dim D and group size G (compile-time both).
template <int D, int G>
absl::Status LaunchEncodeDG(const PageGeometry& geom, const EncodeJob* jobs, int num_jobs,
                            cudaStream_t stream, EncodeKernelChoice choice) {
  if constexpr (D == 128) {
    if (choice == EncodeKernelChoice::kAuto || choice == EncodeKernelChoice::kWarpgroup) {
      OSCARKV_ASSIGN_OR_RETURN(const bool available, EncodeWarpgroupAvailable());
      if (available) return LaunchEncodeWarpgroup<G>(geom, jobs, num_jobs, stream);
      if (choice == EncodeKernelChoice::kWarpgroup) {
        return absl::FailedPreconditionError(
            "the wgmma encode kernel is not in the loaded code (build for sm_90a, run on Hopper)");
      }
    }
  }
  if constexpr (D <= 128) {
    // kAuto without the wgmma kernel: the roles kernel where it was measured
    // faster (D 128, H200).
    const bool roles = choice == EncodeKernelChoice::kRoles ||
                       (choice == EncodeKernelChoice::kAuto && D == 128);
    if (roles) return LaunchEncodeStrips<D, G, true>(geom, jobs, num_jobs, stream);
    if (choice != EncodeKernelChoice::kTiled) {
      return LaunchEncodeStrips<D, G, false>(geom, jobs, num_jobs, stream);
    }
  }
  return LaunchEncodeTiled<D, G>(geom, jobs, num_jobs, stream);
}

template <int D>
absl::Status LaunchEncodeD(const PageGeometry& geom, const EncodeJob* jobs, int num_jobs,
                           cudaStream_t stream, EncodeKernelChoice choice) {
  switch (geom.group_size) {  // a power of two in [4, D] (ValidateGeometry)
    case 4: return LaunchEncodeDG<D, 4>(geom, jobs, num_jobs, stream, choice);
    case 8: return LaunchEncodeDG<D, 8>(geom, jobs, num_jobs, stream, choice);
    case 16: return LaunchEncodeDG<D, 16>(geom, jobs, num_jobs, stream, choice);
    case 32: return LaunchEncodeDG<D, 32>(geom, jobs, num_jobs, stream, choice);
    case 64: return LaunchEncodeDG<D, 64>(geom, jobs, num_jobs, stream, choice);
    default: break;
  }
  if constexpr (D >= 128) {
    if (geom.group_size == 128) return LaunchEncodeDG<D, 128>(geom, jobs, num_jobs, stream, choice);
  }
  if constexpr (D >= 256) {
    if (geom.group_size == 256) return LaunchEncodeDG<D, 256>(geom, jobs, num_jobs, stream, choice);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("group_size ", geom.group_size, " is not a power of two in [4, ", D, "]"));
}

template <int D>
absl::Status LaunchDecodeD(const PageGeometry& geom, const DecodeJob* jobs, int num_jobs,
                           cudaStream_t stream) {
  dim3 grid(num_jobs, 2 * geom.kv_heads);
  DecodeKernel<D><<<grid, D, 0, stream>>>(geom, jobs);
  return CudaStatus(cudaGetLastError(), "DecodeKernel launch");
}

}  // namespace

absl::StatusOr<bool> EncodeWarpgroupAvailable() {
  static PerDevice known{};  // 0: not asked yet, 1: no, 2: yes
  int device = 0;
  OSCARKV_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  const bool cached = device >= 0 && device < kMaxCachedDevices;
  if (cached) {
    const int k = known[device].load(std::memory_order_relaxed);
    if (k > 0) return k == 2;
  }
  int* flag = nullptr;
  OSCARKV_CUDA_RETURN_IF_ERROR(cudaMalloc(&flag, sizeof(int)));
  encode_warpgroup::WarpgroupProbeKernel<<<1, 1>>>(flag);
  int answer = 0;
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) err = cudaMemcpy(&answer, flag, sizeof(int), cudaMemcpyDeviceToHost);
  const cudaError_t freed = cudaFree(flag);
  OSCARKV_RETURN_IF_ERROR(CudaStatus(err, "encode kernel probe"));
  OSCARKV_RETURN_IF_ERROR(CudaStatus(freed, "encode kernel probe"));
  if (cached) known[device].store(answer == 1 ? 2 : 1, std::memory_order_relaxed);
  return answer == 1;
}

absl::Status LaunchEncodePages(const PageGeometry& geom, const EncodeJob* dev_jobs, int num_jobs,
                               cudaStream_t stream, EncodeKernelChoice choice) {
  if (num_jobs <= 0) return absl::OkStatus();
  if (choice == EncodeKernelChoice::kWarpgroup && geom.head_dim != 128) {
    return absl::InvalidArgumentError("the wgmma encode kernel takes head_dim 128 only");
  }
  if (geom.kv_heads > 32767) return absl::InvalidArgumentError("too many kv heads");
  switch (geom.head_dim) {
    case 64: return LaunchEncodeD<64>(geom, dev_jobs, num_jobs, stream, choice);
    case 128: return LaunchEncodeD<128>(geom, dev_jobs, num_jobs, stream, choice);
    case 256: return LaunchEncodeD<256>(geom, dev_jobs, num_jobs, stream, choice);
    default:
      return absl::InvalidArgumentError(absl::StrCat("unsupported head_dim ", geom.head_dim));
  }
}

absl::Status LaunchDecodePages(const PageGeometry& geom, const DecodeJob* dev_jobs, int num_jobs,
                               cudaStream_t stream) {
  if (num_jobs <= 0) return absl::OkStatus();
  if (geom.kv_heads > 32767) return absl::InvalidArgumentError("too many kv heads");
  switch (geom.head_dim) {
    case 64: return LaunchDecodeD<64>(geom, dev_jobs, num_jobs, stream);
    case 128: return LaunchDecodeD<128>(geom, dev_jobs, num_jobs, stream);
    case 256: return LaunchDecodeD<256>(geom, dev_jobs, num_jobs, stream);
    default:
      return absl::InvalidArgumentError(absl::StrCat("unsupported head_dim ", geom.head_dim));
  }
}

}  // namespace oscarkv
