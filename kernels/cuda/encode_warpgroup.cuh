// The encode kernel on the warpgroup tensor cores (wgmma, sm_90a), D = 128
// (included by codec_kernels.cu only, after encode_strips.cuh, whose row
// metadata and quantizing warps' clip-quantize-pack (TileSteps) it shares).
//
// Same work and roles as the roles kernel: one block per SM walking a
// contiguous range of (kind, head, 64-row tile) items; 16 quantizing warps
// clip, quantize and pack tile n - 1 from one of two y buffers while the
// multiplying warps make tile n's y in the other. Here the multiplying warps
// are one warpgroup (warps 0-3), and y = x · R is one chain of 24 wgmma
// m64n128k16 per tile, in one fp32 accumulator: x as it arrives (bf16, exact)
// against R's three bf16 terms (hi = bf16(R), mid = bf16(R - hi), lo =
// bf16(R - hi - mid): R to ~2^-24, as the tiled kernel). So no conversion
// pass: the x rows are copied (cp.async, 16 bytes at a time) straight into the
// operand layout, three tiles deep, and the warpgroup's own work per tile is
// the copies, 24 wgmma and the y stores. (The roles kernel: 1024 mma.sync
// m16n8k16 over 8 warps, the rows scaled into fp16 first, the chains'
// latency setting the pace.) Measured for the 2048-page benchmark: 476–483 µs
// against the roles kernel's 544 (567–569 with the leaner quantize of the
// same run), the quantizing warps now setting the pace. A first wgmma version
// with the roles kernel's fp16 conversion took 525 µs: its conversion and
// one-tile-deep fetch, in the same 4 warps, were the critical path. H200,
// 2026-12-02, RESULTS run 29.
//
// Operands in shared memory in the 128-byte swizzled K-major layout: K in
// blocks of 64 elements; a block holds its rows' 128 bytes one after the
// other (1024-byte aligned), 16-byte chunk c of row r stored at chunk
// c ^ (r % 8). A = x (64 rows), B = one term of R with R's columns as its
// rows (128 rows; wgmma's untransposed B).
#ifndef OSCARKV_KERNELS_CUDA_ENCODE_WARPGROUP_CUH_
#define OSCARKV_KERNELS_CUDA_ENCODE_WARPGROUP_CUH_

namespace oscarkv {
namespace encode_warpgroup {

using encode_strips::Row;
using encode_strips::TileSteps;

constexpr int D = 128;
constexpr int kTerms = 3;            // bf16 terms of R
constexpr int kQuantWarps = 16;
constexpr int kRowsPerPass = 4;      // one pass per tile and quantizing warp
constexpr int kMmaThreads = 128;     // warps 0-3: the warpgroup
constexpr int kThreads = kMmaThreads + kQuantWarps * 32;
constexpr int kMmaBarrier = 1;       // named barrier of the warpgroup
constexpr int kXBuffers = 3;         // x tiles in flight: n, n + 1, n + 2
// Tile n's rows: filled at tile n - 2, read by the quantizers until tile n's
// y buffer is freed, which the warpgroup waits for at tile n + 2.
constexpr int kRowSlots = 5;

using S = encode_strips::Shape<D>;
constexpr size_t kXBytes = size_t(S::M) * D * 2;    // 16 KB, swizzled, no padding
constexpr size_t kTermBytes = size_t(D) * D * 2;    // 32 KB
constexpr size_t kBOffset = 0;
constexpr size_t kXOffset = kBOffset + kTerms * kTermBytes;
constexpr size_t kYOffset = kXOffset + kXBuffers * kXBytes;  // two y buffers
constexpr size_t kSmemBytes = kYOffset + 2 * S::kYBytes + 1024;  // + alignment slack
static_assert(kSmemBytes <= 216 * 1024, "fits an sm_90 block with the static part");

// Byte offset of element (row, k) of a swizzled operand of kRows rows.
template <int kRows>
__device__ __forceinline__ uint32_t OperandOffset(int row, int k) {
  return static_cast<uint32_t>((k >> 6) * (kRows * 128) + row * 128 +
                               ((((k >> 3) & 7) ^ (row & 7)) << 4) + ((k & 7) << 1));
}

// The descriptor of k step ks (k 16 ks .. 16 ks + 15) of a swizzled operand
// of kRows rows at shared address `base`: leading offset unused (1), stride
// 1024 bytes (8 rows), 128-byte swizzle; a step within a 64-element block
// advances the start by 32 bytes.
template <int kRows>
__device__ __forceinline__ uint64_t StepDescriptor(uint32_t base, int ks) {
  const uint32_t addr = base + (ks >> 2) * (kRows * 128) + (ks & 3) * 32;
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) |
         (1ull << 62);
}

__device__ __forceinline__ void WgmmaFence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void WgmmaCommitAndWait() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#endif
}
// Ordinary (and cp.async) shared-memory writes before a barrier that the
// tensor cores read after it.
__device__ __forceinline__ void FenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Keeps the compiler from moving accesses of the accumulators across the
// wgmma fences and waits.
__device__ __forceinline__ void PinAccumulators(float (&d)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// One wgmma: d (64 x 128 fp32, the warpgroup's accumulator fragments) += or
// = A (64 x 16 bf16) · B (16 x 128 bf16), both read from shared memory
// through their descriptors.
__device__ __forceinline__ void WgmmaBf16M64N128K16(float (&d)[64], uint64_t a_desc,
                                                    uint64_t b_desc, int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]),
        "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
        "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
        "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
        "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),
        "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]),
        "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),
        "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(a_desc), "l"(b_desc), "r"(accumulate));
#endif
}

// B's three terms of rotation r (D x D fp32, row-major R[k][n]) into shared
// memory: thread t of the warpgroup makes column n = t, 8 k at a time.
__device__ __forceinline__ void LoadRotation(unsigned char* b, const float* r, int tid) {
  const int n = tid;
#pragma unroll 2
  for (int kc = 0; kc < D / 8; ++kc) {
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = __ldg(r + size_t(8 * kc + j) * D + n);
    uint32_t w[kTerms][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t packed[kTerms] = {0, 0, 0};
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const Bf16Terms t = SplitBf16Terms(v[2 * j + e]);
        packed[0] |= uint32_t(__bfloat16_as_ushort(t.hi)) << (16 * e);
        packed[1] |= uint32_t(__bfloat16_as_ushort(t.mid)) << (16 * e);
        packed[2] |= uint32_t(__bfloat16_as_ushort(t.lo)) << (16 * e);
      }
#pragma unroll
      for (int t = 0; t < kTerms; ++t) w[t][j] = packed[t];
    }
#pragma unroll
    for (int t = 0; t < kTerms; ++t) {
      *reinterpret_cast<uint4*>(b + t * kTermBytes + OperandOffset<D>(n, 8 * kc)) =
          make_uint4(w[t][0], w[t][1], w[t][2], w[t][3]);
    }
  }
}

// x rows of `rows` into the swizzled tile xb, by the warpgroup.
__device__ __forceinline__ void FetchX(unsigned char* xb, const Row* rows, int tid) {
  TileSteps<D>::FetchRows<kMmaThreads>(
      rows, tid, [xb](int i, int c) { return xb + OperandOffset<S::M>(i, 8 * c); });
}

// y = x · (hi + mid + lo) for the tile: 24 wgmma (the smallest term first
// at each k step), then the wait.
__device__ __forceinline__ void MultiplyTile(float (&d)[64], uint32_t x_addr, uint32_t b_addr) {
  WgmmaFence();
  PinAccumulators(d);
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    const uint64_t a = StepDescriptor<S::M>(x_addr, ks);
#pragma unroll
    for (int t = kTerms - 1; t >= 0; --t) {
      WgmmaBf16M64N128K16(d, a, StepDescriptor<D>(b_addr + t * kTermBytes, ks),
                          ks > 0 || t < kTerms - 1);
    }
  }
  WgmmaCommitAndWait();
  PinAccumulators(d);
}

// The accumulators into y: warp w of the warpgroup holds rows 16w + g and
// 16w + g + 8 (g = lane / 4), columns 8j + 2(lane % 4) (+1) in d[4j..4j+3].
// Rows whose bit in `match` is clear are not stored.
__device__ __forceinline__ void StoreY(const float (&d)[64], float* ys, int warp, int lane,
                                       uint64_t match) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = 16 * warp + g + 8 * half;
    if (((match >> row) & 1u) == 0) continue;
    float* yrow = ys + row * S::LDY + 2 * t;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      *reinterpret_cast<float2*>(yrow + 8 * j) =
          make_float2(d[4 * j + 2 * half], d[4 * j + 2 * half + 1]);
    }
  }
}

// Whether every real row of a filled tile has the rotation of row 0 (always a
// real row), by warps 0 and 1 (32 rows each) into flags[0..1].
__device__ __forceinline__ void CheckOneRotation(const Row* trows, int* flags, int tid) {
  if (tid >= S::M) return;
  const Row& r = trows[tid];
  const bool same = __all_sync(0xffffffffu, r.src == nullptr || r.rot == trows[0].rot);
  if ((tid & 31) == 0) flags[tid >> 5] = same ? 1 : 0;
}

template <int G>
__global__ void __launch_bounds__(kThreads, 1)
    EncodeWarpgroupKernel(PageGeometry geom, const EncodeJob* __restrict__ jobs, int num_jobs,
                          int tiles_per_kh, long total_items) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // The swizzled layout wants 1024-byte aligned operands (kSmemBytes has the
  // slack).
  unsigned char* smem = smem_raw + ((1024 - (SharedAddr(smem_raw) & 1023)) & 1023);
  unsigned char* bmat = smem + kBOffset;
  const auto xs = [&](int n) { return smem + kXOffset + (n % kXBuffers) * kXBytes; };
  const auto ys = [&](int b) { return reinterpret_cast<float*>(smem + kYOffset + b * S::kYBytes); };
  __shared__ Row rows[kRowSlots][S::M];
  __shared__ int one_rotation[kRowSlots][2];
  __shared__ __align__(8) uint64_t y_full[2], y_free[2];

  const int tid = threadIdx.x, warp = WarpIndex(), lane = tid & 31;
  const encode_strips::BlockItems range = encode_strips::BlockItemRange(total_items);
  const long first = range.first, last = range.last;
  if (first >= last) return;
  const int tiles = static_cast<int>(last - first);
  if (tid == 0) encode_strips::InitYBarriers(y_full, y_free, kMmaThreads, kQuantWarps * 32);
  __syncthreads();

  if (warp >= kMmaThreads / 32) {  // quantizing warps, as in the roles kernel
    TileSteps<D>::template QuantizeTiles<G, kRowsPerPass, kRowSlots>(
        rows, ys, y_full, y_free, tiles, warp - kMmaThreads / 32, kQuantWarps, lane);
    return;
  }

  // The warpgroup. Tile m's rows and x fetch start at tile m - 2 (one
  // cp.async group per tile, every thread committing one per step).
  const TileSteps<D> steps{geom, jobs, tiles_per_kh, num_jobs * geom.page_tokens};
  const uint32_t b_addr = SharedAddr(bmat);
  const float* loaded = nullptr;  // the rotation in B
  float d[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) d[i] = 0.0f;
  const auto start_tile = [&](int m) {  // rows of tile m, then its fetch
    if (m < tiles) steps.FillRows(first + m, rows[m % kRowSlots], tid);
    encode_strips::NamedBarrierSync(kMmaBarrier, kMmaThreads);  // rows written
    if (m < tiles) {
      CheckOneRotation(rows[m % kRowSlots], one_rotation[m % kRowSlots], tid);
      FetchX(xs(m), rows[m % kRowSlots], tid);
    }
    encode_strips::CpAsyncCommit();
  };
  start_tile(0);
  start_tile(1);
#pragma unroll 1
  for (int n = 0; n < tiles; ++n) {
    const int b = n & 1, slot = n % kRowSlots;
    // rows[(n + 2) % 5] last served tile n - 3, whose y buffer the quantizers
    // freed before tile n - 1's y was stored; x buffer (n + 2) % 3 last served
    // tile n - 1, whose wgmma are done.
    start_tile(n + 2);
    asm volatile("cp.async.wait_group 2;\n" ::: "memory");  // tile n's copies landed
    FenceProxyAsync();
    encode_strips::NamedBarrierSync(kMmaBarrier, kMmaThreads);  // x of tile n complete
    const Row* trows = rows[slot];
    const uint32_t x_addr = SharedAddr(xs(n));
    const auto wait_y_free = [&] {
      if (n >= 2) BarrierWait(&y_free[b], ((n >> 1) & 1) ^ 1);  // tile n - 2 quantized
    };
    if (one_rotation[slot][0] && one_rotation[slot][1]) {  // the usual case
      const float* r = trows[0].rot;
      if (loaded != r) {
        LoadRotation(bmat, r, tid);
        FenceProxyAsync();
        encode_strips::NamedBarrierSync(kMmaBarrier, kMmaThreads);
        loaded = r;
      }
      MultiplyTile(d, x_addr, b_addr);
      wait_y_free();
      StoreY(d, ys(b), warp, lane, ~0ull);
    } else {
      wait_y_free();
      // One multiply per distinct rotation among the tile's rows, each storing
      // the rows of its rotation (every thread scans the rows: rare).
      uint64_t pending = 0;
      for (int i = 0; i < S::M; ++i) pending |= uint64_t(trows[i].src != nullptr) << i;
      while (pending != 0) {
        const float* r = trows[__ffsll(static_cast<long long>(pending)) - 1].rot;
        uint64_t match = 0;
        for (int i = 0; i < S::M; ++i) {
          match |= uint64_t(((pending >> i) & 1u) != 0 && trows[i].rot == r) << i;
        }
        if (loaded != r) {
          // every warp's wgmma that read B is done (each waited for its own)
          encode_strips::NamedBarrierSync(kMmaBarrier, kMmaThreads);
          LoadRotation(bmat, r, tid);
          FenceProxyAsync();
          encode_strips::NamedBarrierSync(kMmaBarrier, kMmaThreads);
          loaded = r;
        }
        MultiplyTile(d, x_addr, b_addr);
        StoreY(d, ys(b), warp, lane, match);
        pending &= ~match;
      }
    }
    BarrierArrive(&y_full[b]);
  }
}

// 1 where the loaded code of this module has the wgmma kernel (built for
// sm_90a), else 0.
__global__ void WarpgroupProbeKernel(int* out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  *out = 1;
#else
  *out = 0;
#endif
}

}  // namespace encode_warpgroup
}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_CUDA_ENCODE_WARPGROUP_CUH_
