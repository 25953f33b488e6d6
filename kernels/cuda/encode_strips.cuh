// The encode kernels for head dims 64 and 128 (included by codec_kernels.cu
// only, after the row helpers ClipThresholdsWarp / QuantizeRowsWarp): the strip
// kernel and the roles kernel, which run the same steps (TileSteps).
//
// Work: for each (kind, kv head), the rows (job, token) in tiles of M = 64.
// A block walks a contiguous range of tiles (one wave), so its rotation
// rarely changes. Per tile:
//   1. the next tile's x rows are fetched with cp.async while this one runs;
//   2. the tile's rows are scaled by a power of two (max |x| into [2^14, 2^15))
//      and turned into fp16 in place: exact, since bf16's 8 significant bits
//      fit fp16's 11 once the row is in fp16's range;
//   3. y = x · R on the tensor cores (mma.m16n8k16, fp16 in, fp32 out): warp w
//      of 8 owns the output columns [w·D/8, (w+1)·D/8) and keeps that strip of
//      R as two fp16 terms, hi = fp16(R) and lo = fp16((R - hi)·2^12), each
//      with its own accumulator: R to ~2^-22, so x · R keeps fp32-level
//      accuracy, and R is read from memory only when a tile's rotation
//      changes (blocks walk contiguous tiles). y (the row scale undone) goes to
//      shared memory;
//   4. the rows are clipped, quantized and packed by one warp each (two at a
//      time in the strip kernel, four in the roles kernel, their reductions
//      interleaved).
// Strip kernel: blocks of 8 warps (two per SM), each warp doing 3 and 4, its
// strip in registers. Roles kernel (the default at D = 128 where the wgmma
// kernel of encode_warpgroup.cuh is not in the loaded code): one block of 24
// warps per SM, 8 multiplying (step 3, strips in shared memory) and 16
// quantizing (step 4) at once, on two y buffers.
// The tiled kernel (R staged in shared memory per tile) stays for D = 256,
// whose strips would fit neither in registers nor in the roles kernel's
// shared memory (~256 KB).
#ifndef OSCARKV_KERNELS_CUDA_ENCODE_STRIPS_CUH_
#define OSCARKV_KERNELS_CUDA_ENCODE_STRIPS_CUH_

#include "kernels/cuda/mbarrier.cuh"

namespace oscarkv {
namespace encode_strips {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
// Rows one warp of the strip kernel clips and quantizes together, their
// reductions interleaved. (At four, under this kernel's 128-register cap,
// 948-1007 µs against 670 µs for the 2048-page benchmark, and ~45 of its 1 M
// rows came out different from the roles and tiled kernels' in every run, with
// the quantize code of sessions 12 and 13 alike: H200, 2026-11-30, RESULTS
// run 17. Not explained; two rows per pass matches both kernels byte for
// byte.)
constexpr int kRowsPerPass = 2;

template <int D>
struct Shape {
  static constexpr int M = 64;             // rows per tile
  static constexpr int MT = M / 16;        // m16 tiles
  static constexpr int NS = D / kWarps;    // output columns per warp
  static constexpr int NT = NS / 8;        // n8 tiles per warp
  static constexpr int KS = D / 16;        // k16 steps
  static constexpr int LDX = D + 8;        // bf16 per staged x row (ldmatrix without conflicts)
  static constexpr int LDY = D + 8;        // floats per y row (fragment stores without conflicts)
  static constexpr int kChunks = D / 8;    // 16-byte pieces of an x row
  static constexpr size_t kXBytes = size_t(M) * LDX * 2;
  static constexpr size_t kYBytes = size_t(M) * LDY * 4;
  static constexpr size_t kSmem = 2 * kXBytes + kYBytes;
  static_assert(NT >= 1, "a warp owns at least one n8 tile");
};

// Per-row metadata of one tile.
struct Row {
  const bf16_bits* src;  // nullptr: past the end (or not yet filled)
  const float* rot;
  uint8_t* codes;
  QuantParams* params;
  int top;  // clip rank from the top (ClipTopRank)
};

__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem) {
  const uint32_t s = SharedAddr(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void CpAsync8(void* smem, const void* gmem) {
  const uint32_t s = SharedAddr(smem);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most one committed group (the newest) is still in flight.
__device__ __forceinline__ void CpAsyncWaitAllButNewest() {
  asm volatile("cp.async.wait_group 1;\n" ::: "memory");
}

__device__ __forceinline__ void LdMatrixX4(uint32_t (&a)[4], const void* smem) {
  const uint32_t s = SharedAddr(smem);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
               : "r"(s));
}

__device__ __forceinline__ void MmaF16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                       uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t PackHalf2(__half lo_elem, __half hi_elem) {
  return static_cast<uint32_t>(__half_as_ushort(lo_elem)) |
         (static_cast<uint32_t>(__half_as_ushort(hi_elem)) << 16);
}

constexpr float kLoScale = 4096.0f;           // lo term = (R - hi) · 2^12
constexpr float kLoUnscale = 1.0f / 4096.0f;

// The mma B fragments of one warp's strip of R, two fp16 terms: fragment
// (ks, nt) of lane (g = lane/4, t = lane%4) holds R[16 ks + 2t (+1)][n] and
// R[16 ks + 2t + 8 (+9)][n], n = strip column 8 nt + g, as {hi0, hi1, lo0,
// lo1} (hi = fp16(R), lo = fp16((R - hi)·2^12)).
template <int D>
__device__ __forceinline__ uint4 StripFragment(const float* r, int col0, int lane, int ks, int nt) {
  const int g = lane >> 2, t = lane & 3;
  const int n = col0 + 8 * nt + g;
  uint32_t hi[2], lo[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int k = 16 * ks + 2 * t + 8 * half;
    const float v0 = __ldg(r + size_t(k) * D + n), v1 = __ldg(r + size_t(k + 1) * D + n);
    const __half h0 = __float2half_rn(v0), h1 = __float2half_rn(v1);
    hi[half] = PackHalf2(h0, h1);
    lo[half] = PackHalf2(__float2half_rn((v0 - __half2float(h0)) * kLoScale),
                         __float2half_rn((v1 - __half2float(h1)) * kLoScale));
  }
  return make_uint4(hi[0], hi[1], lo[0], lo[1]);
}

// One warp's strip of R in its registers (the strip kernel).
template <int D>
struct RStrip {
  using S = Shape<D>;
  uint4 frag[S::KS][S::NT];
  const float* loaded = nullptr;

  __device__ void Load(const float* r, int col0, int lane) {
#pragma unroll
    for (int ks = 0; ks < S::KS; ++ks)
#pragma unroll
      for (int nt = 0; nt < S::NT; ++nt) frag[ks][nt] = StripFragment<D>(r, col0, lane, ks, nt);
    loaded = r;
  }
  __device__ __forceinline__ uint4 Fragment(int ks, int nt, int) const { return frag[ks][nt]; }
};

// One warp's strip of R in shared memory (the roles kernel, whose register
// cap would spill it): [ks][nt][lane], 16 bytes per lane, so that a lane
// writes and reads only its own fragments (no synchronization to refill) and
// a warp's load of one fragment is 4 conflict-free wavefronts.
template <int D>
struct SharedRStrip {
  using S = Shape<D>;
  static constexpr size_t kBytesPerWarp = size_t(S::KS) * S::NT * 32 * sizeof(uint4);
  uint4* frag;  // this warp's kBytesPerWarp
  const float* loaded = nullptr;

  __device__ void Load(const float* r, int col0, int lane) {
#pragma unroll
    for (int ks = 0; ks < S::KS; ++ks)
#pragma unroll
      for (int nt = 0; nt < S::NT; ++nt)
        frag[(ks * S::NT + nt) * 32 + lane] = StripFragment<D>(r, col0, lane, ks, nt);
    loaded = r;
  }
  __device__ __forceinline__ uint4 Fragment(int ks, int nt, int lane) const {
    return frag[(ks * S::NT + nt) * 32 + lane];
  }
};

// Row scaling exponent: 2^s brings the largest |x| (bf16 bits `amax`, sign
// cleared) into [2^14, 2^15). Rows of zeros or subnormals get the largest
// scale; infinities and NaNs stay what they are.
__device__ __forceinline__ int RowScaleExponent(uint32_t amax) {
  const int e = static_cast<int>(amax >> 7);  // biased exponent
  return e == 0 ? 126 : min(141 - e, 126);
}

// The steps of one tile that both kernels below run: row metadata, the x
// fetch, the fp16 conversion and the multiply take the 256 threads (8 warps)
// of the multiplying warps, the clip-quantize-pack takes any number of warps.
template <int D>
struct TileSteps {
  using S = Shape<D>;
  PageGeometry geom;
  const EncodeJob* jobs;
  int tiles_per_kh;
  int total_rows;  // num_jobs · page_tokens < 2^31: checked by the launcher

  // Row metadata of work item `item` into rows (threads < M, one row each).
  __device__ __forceinline__ void FillRows(long item, Row* rows, int tid) const {
    if (tid >= S::M) return;
    const int P = geom.page_tokens;
    const size_t row_elems = geom.exact_row_elems();
    const int kh = static_cast<int>(item / tiles_per_kh);
    const int tile = static_cast<int>(item % tiles_per_kh);
    const int h = kh >> 1, kind = kh & 1;
    const int row = tile * S::M + tid;
    Row er{};
    if (row < total_rows) {
      const int j = row / P, t = row - j * P;
      const EncodeJob& job = jobs[j];
      er.src = job.src_block + kind * size_t(P) * row_elems + size_t(t) * row_elems + size_t(h) * D;
      er.rot = RowRotation(job.rotation, kind, h);
      er.codes = job.dst_page + geom.codes_offset(h, kind) + size_t(t) * (D / 4);
      er.params = reinterpret_cast<QuantParams*>(job.dst_page + geom.params_offset(h, kind)) +
                  size_t(t) * geom.groups();
      er.top = ClipTopRank(kind == 0 ? job.clip_k : job.clip_v, D);
    }
    rows[tid] = er;
  }

  // x rows of `rows` by kCount threads (cp.async; rows past the end are
  // zeroed), 16-byte piece c of row i to dst(i, c).
  template <int kCount, typename Dst>
  static __device__ __forceinline__ void FetchRows(const Row* rows, int tid, Dst dst_of) {
    for (int idx = tid; idx < S::M * S::kChunks; idx += kCount) {
      const int i = idx / S::kChunks, c = idx % S::kChunks;
      unsigned char* dst = dst_of(i, c);
      const bf16_bits* src = rows[i].src;
      if (src == nullptr) {
        *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
      } else if ((reinterpret_cast<uintptr_t>(src) & 15) == 0) {
        CpAsync16(dst, src + 8 * c);
      } else {  // the job arrays promise 8-byte alignment only
        CpAsync8(dst, src + 8 * c);
        CpAsync8(dst + 8, src + 8 * c + 4);
      }
    }
  }

  // x rows of `rows` into xb, row-major (S::LDX).
  static __device__ __forceinline__ void FetchX(uint16_t* xb, const Row* rows, int tid) {
    FetchRows<kThreads>(rows, tid, [xb](int i, int c) {
      return reinterpret_cast<unsigned char*>(xb + i * S::LDX + 8 * c);
    });
  }

  // Scales each row of xb by 2^s (four threads per row) and converts it to
  // fp16 in place; row_unscale[row] = 2^-s.
  static __device__ __forceinline__ void ToScaledFp16(uint16_t* xb, float* row_unscale, int tid) {
    constexpr int kPieces = D / 32;  // 16-byte pieces per thread
    const int i = tid >> 2, quarter = tid & 3;
    uint4* base = reinterpret_cast<uint4*>(xb + i * S::LDX + quarter * (D / 4));
    uint4 v[kPieces];
    uint32_t amax = 0;
#pragma unroll
    for (int p = 0; p < kPieces; ++p) {
      v[p] = base[p];
      const uint32_t w[4] = {v[p].x, v[p].y, v[p].z, v[p].w};
#pragma unroll
      for (int q = 0; q < 4; ++q) amax = __vmaxu2(amax, w[q] & 0x7fff7fffu);
    }
    amax = max(amax & 0xffffu, amax >> 16);
    amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    const int sexp = RowScaleExponent(amax);
    const float f = __int_as_float((127 + sexp) << 23);
    if (quarter == 0) row_unscale[i] = __int_as_float((127 - sexp) << 23);
#pragma unroll
    for (int p = 0; p < kPieces; ++p) {
      uint32_t w[4] = {v[p].x, v[p].y, v[p].z, v[p].w};
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float lo = __uint_as_float(w[q] << 16) * f;
        const float hi = __uint_as_float(w[q] & 0xffff0000u) * f;
        w[q] = PackHalf2(__float2half_rn(lo), __float2half_rn(hi));
      }
      base[p] = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }

  // y strip of the kTiles m16 tiles from mt0 (warp `warp` of 8: columns
  // [warp·D/8, (warp+1)·D/8)), rows in `match` (bit i: row 16 mt0 + i; a
  // partial mask only with kTiles = 1) stored. Each B fragment serves the
  // kTiles tiles.
  template <int kTiles, typename Strip>
  static __device__ __forceinline__ void MultiplyM16(const uint16_t* xb, const float* row_unscale,
                                                     float* ys, const Strip& strip, int warp,
                                                     int lane, int mt0, unsigned match) {
    const int col0 = warp * S::NS;
    const int g = lane >> 2, t = lane & 3;
    float acc_hi[kTiles][S::NT][4], acc_lo[kTiles][S::NT][4];
#pragma unroll
    for (int m = 0; m < kTiles; ++m)
#pragma unroll
      for (int nt = 0; nt < S::NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_hi[m][nt][e] = acc_lo[m][nt][e] = 0.0f;
    const uint16_t* arow = xb + (16 * mt0 + (lane & 15)) * S::LDX + (lane >> 4) * 8;
#pragma unroll
    for (int ks = 0; ks < S::KS; ++ks) {
      uint32_t a[kTiles][4];
#pragma unroll
      for (int m = 0; m < kTiles; ++m) LdMatrixX4(a[m], arow + 16 * m * S::LDX + 16 * ks);
#pragma unroll
      for (int nt = 0; nt < S::NT; ++nt) {
        const uint4 b = strip.Fragment(ks, nt, lane);
#pragma unroll
        for (int m = 0; m < kTiles; ++m) {
          MmaF16(acc_lo[m][nt], a[m], b.z, b.w);
          MmaF16(acc_hi[m][nt], a[m], b.x, b.y);
        }
      }
    }
    // Rows g (e = 0, 1) and g + 8 (e = 2, 3), columns 2t, 2t + 1 of each n8 tile.
#pragma unroll
    for (int m = 0; m < kTiles; ++m) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int i = g + 8 * half;
        if ((match >> i) & 1u) {
          const int row = 16 * (mt0 + m) + i;
          const float unscale = row_unscale[row];
          float* yrow = ys + row * S::LDY + col0 + 2 * t;
#pragma unroll
          for (int nt = 0; nt < S::NT; ++nt) {
            float2 v;
            v.x = fmaf(acc_lo[m][nt][2 * half], kLoUnscale, acc_hi[m][nt][2 * half]) * unscale;
            v.y = fmaf(acc_lo[m][nt][2 * half + 1], kLoUnscale, acc_hi[m][nt][2 * half + 1]) * unscale;
            *reinterpret_cast<float2*>(yrow + 8 * nt) = v;
          }
        }
      }
    }
  }

  // The tile's y = x · R, warp `warp` of 8 storing its strip of columns;
  // kTiles m16 tiles per pass when the whole tile has one rotation.
  template <int kTiles, typename Strip>
  static __device__ __forceinline__ void Multiply(const uint16_t* xb, const Row* trows,
                                                  const float* row_unscale, float* ys,
                                                  Strip& strip, int warp, int lane) {
    static_assert(S::MT % kTiles == 0, "whole passes");
    const int col0 = warp * S::NS;
    // The usual case: every row of the tile has the rotation of row 0 (always a
    // real row). Rows past the end get y too; nothing reads it.
    const float* r0 = trows[0].rot;
    bool same = true;
    for (int i = lane; i < S::M; i += 32) same = same && (trows[i].src == nullptr || trows[i].rot == r0);
    if (__all_sync(0xffffffffu, same)) {
      if (strip.loaded != r0) strip.Load(r0, col0, lane);
#pragma unroll 1
      for (int mt = 0; mt < S::MT; mt += kTiles) {
        MultiplyM16<kTiles>(xb, row_unscale, ys, strip, warp, lane, mt, 0xffffu);
      }
      return;
    }
    // One pass per distinct rotation among the rows of each m16 tile.
#pragma unroll 1
    for (int mt = 0; mt < S::MT; ++mt) {
      const Row* mrows = trows + 16 * mt;
      const float* my_rot = (lane < 16 && mrows[lane].src != nullptr) ? mrows[lane].rot : nullptr;
      unsigned pending = __ballot_sync(0xffffffffu, my_rot != nullptr);
      while (pending != 0) {
        const int src_lane = __ffs(pending) - 1;
        const float* r = reinterpret_cast<const float*>(
            __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(my_rot), src_lane));
        const unsigned match = __ballot_sync(0xffffffffu, my_rot == r && my_rot != nullptr);
        if (strip.loaded != r) strip.Load(r, col0, lane);
        MultiplyM16<1>(xb, row_unscale, ys, strip, warp, lane, mt, match);
        pending &= ~match;
      }
    }
  }

  // Clip, quantize, pack the tile's rows: warp `qwarp` of `nq` takes rows
  // qwarp, qwarp + nq, ..., R at a time.
  template <int G, int R>
  static __device__ __forceinline__ void Quantize(const Row* trows, const float* ys, int qwarp,
                                                  int nq, int lane) {
#pragma unroll 1
    for (int i0 = qwarp; i0 < S::M; i0 += nq * R) {
      const float* yr[R];
      int top[R];
      float tau[R];
      bool use[R];
#pragma unroll
      for (int k = 0; k < R; ++k) {
        const int i = i0 + k * nq;
        use[k] = i < S::M && trows[i].src != nullptr;
        yr[k] = ys + (i < S::M ? i : 0) * S::LDY;
        top[k] = use[k] ? trows[i].top : 0;
      }
      ClipThresholdsWarp<D, R>(yr, top, tau, lane);
      uint8_t* codes[R];
      QuantParams* params[R];
#pragma unroll
      for (int k = 0; k < R; ++k) {
        const Row* er = use[k] ? &trows[i0 + k * nq] : nullptr;
        codes[k] = er != nullptr ? er->codes : nullptr;
        params[k] = er != nullptr ? er->params : nullptr;
      }
      QuantizeRowsWarp<D, G, R>(yr, tau, codes, params, use, lane);
    }
  }

  // The quantizing warps of a warp-specialized kernel: tile n of `tiles`
  // from y buffer ys(n % 2), its rows in rows[n % kSlots], once its producers
  // filled it (y_full[n % 2]), then the buffer released (y_free[n % 2]). Tile
  // n is buffer n % 2's use number n / 2: the barriers' phase parity.
  template <int G, int R, int kSlots, typename YBuffer>
  static __device__ __forceinline__ void QuantizeTiles(const Row (*rows)[S::M], YBuffer ys,
                                                       uint64_t* y_full, uint64_t* y_free,
                                                       int tiles, int qwarp, int nq, int lane) {
#pragma unroll 1
    for (int n = 0; n < tiles; ++n) {
      BarrierWait(&y_full[n & 1], (n >> 1) & 1);
      Quantize<G, R>(rows[n % kSlots], ys(n & 1), qwarp, nq, lane);
      BarrierArrive(&y_free[n & 1]);
    }
  }
};

// Block blockIdx.x's range [first, last) of a one-wave grid's `total` items.
struct BlockItems {
  long first, last;
};
__device__ __forceinline__ BlockItems BlockItemRange(long total) {
  return {total * blockIdx.x / gridDim.x, total * (blockIdx.x + 1) / gridDim.x};
}

// The y buffers' barriers of a warp-specialized kernel, by one thread:
// y_full[b] counts `producers` arrivals, y_free[b] `consumers`.
__device__ __forceinline__ void InitYBarriers(uint64_t* y_full, uint64_t* y_free, int producers,
                                              int consumers) {
  for (int b = 0; b < 2; ++b) {
    BarrierInit(&y_full[b], producers);
    BarrierInit(&y_free[b], consumers);
  }
}

// Registers capped at 128 so that two blocks share an SM: while one block
// multiplies, the other clips and quantizes (measured on the H200: 817 µs
// against 1155 µs at one block per SM with 255 registers and no spills, for
// the 2048-page benchmark; the cap spills ~190 bytes per thread, mostly around
// the strip reload, which runs only when the rotation changes).
template <int D, int G>
__global__ void __launch_bounds__(kThreads, 2)
    EncodeStripsKernel(PageGeometry geom, const EncodeJob* __restrict__ jobs, int num_jobs,
                       int tiles_per_kh, long total_items) {
  using S = Shape<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  // x tile n at xs(n % 2) (bf16, then fp16 in place); y of the current tile at ys.
  const auto xs = [&](int b) { return reinterpret_cast<uint16_t*>(smem + b * S::kXBytes); };
  float* ys = reinterpret_cast<float*>(smem + 2 * S::kXBytes);
  __shared__ Row rows[3][S::M];  // tile i uses rows[i % 3]: filled while i - 1 runs, after i - 2 is done
  __shared__ float row_unscale[S::M];  // 2^-s of each row of the current tile

  const int tid = threadIdx.x, warp = WarpIndex(), lane = tid & 31;
  const TileSteps<D> steps{geom, jobs, tiles_per_kh, num_jobs * geom.page_tokens};
  const BlockItems range = BlockItemRange(total_items);
  const long first = range.first, last = range.last;
  if (first >= last) return;

  RStrip<D> strip;
  steps.FillRows(first, rows[0], tid);
  __syncthreads();
  steps.FetchX(xs(0), rows[0], tid);
  CpAsyncCommit();

  // Tile n (= item - first) uses xs(n % 2) and rows[n % 3].
  int b = 0, rb = 0;
  for (long item = first; item < last; ++item, b ^= 1, rb = rb == 2 ? 0 : rb + 1) {
    const bool has_next = item + 1 < last;
    const int rn = rb == 2 ? 0 : rb + 1;
    if (has_next) steps.FillRows(item + 1, rows[rn], tid);  // rows[rn] last served tile n - 2
    __syncthreads();  // rows[rn] written; xs(b ^ 1), ys, row_unscale free (tile n - 1 done)
    if (has_next) steps.FetchX(xs(b ^ 1), rows[rn], tid);
    CpAsyncCommit();
    CpAsyncWaitAllButNewest();
    __syncthreads();  // xs(b) complete for every thread
    steps.ToScaledFp16(xs(b), row_unscale, tid);
    __syncthreads();
    steps.template Multiply<1>(xs(b), rows[rb], row_unscale, ys, strip, warp, lane);
    __syncthreads();  // ys complete
    steps.template Quantize<G, kRowsPerPass>(rows[rb], ys, warp, kWarps, lane);
  }
}

// A named barrier among `count` threads (whole warps) of the block.
__device__ __forceinline__ void NamedBarrierSync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// The same work with the warps split by role (warp specialization): warps
// 0-7 fetch, convert and multiply tile n into y buffer n % 2 while 16
// quantizing warps clip, quantize and pack tile n - 1 from the other buffer.
// One block per SM, so a register cap of 80 (65536 / 768 threads, rounded
// down to the allocation step): the multiplying warps keep their strips of R
// in shared memory (in registers they spilled) and load each fragment once
// per two m16 tiles when the tile has one rotation; the quantizing warps hold
// no R. The roles meet on two mbarriers per y buffer b:
// y_full[b] (every multiplying thread arrives once its part of a tile's y is
// stored) and y_free[b] (every quantizing thread arrives once it is done with
// it). Every thread arrives itself, so that each arrive releases that
// thread's own accesses (racecheck clean; one arrive per warp after a
// __syncwarp measured the same speed, but racecheck cannot follow it, nor
// named barriers with bar.arrive).
// Measured (H200, 2026-11-30, tests/bench/RESULTS.md runs 16 and 17): 541 µs
// for the 2048-page benchmark against 670 µs for the strip kernel (610 µs
// before run 17's leaner quantize and four rows per pass: 568 µs at two);
// 8 and 12 quantizing warps took 826 and 716 µs in run 16 (with R in
// registers). Since run 17 the quantizing warps wait for full buffers (~31
// instructions per row of retries): the multiplying warps set the pace.
// The math is the strip kernel's, step for step, so the pages are
// byte-identical.
namespace roles {
constexpr int kQuantWarps = 16;
constexpr int kRowsPerPass = 4;  // one pass per tile and quantizing warp
constexpr int kMultiplyThreads = encode_strips::kThreads;  // warps 0-7
constexpr int kThreads = kMultiplyThreads + kQuantWarps * 32;
constexpr int kMultiplyBarrier = 1;  // named barrier of the multiplying threads
// Tile n's rows: filled during tile n - 1, read by the quantizers until the
// multiply of tile n + 2 starts.
constexpr int kRowSlots = 4;

template <int D>
struct Smem {
  using S = Shape<D>;
  static constexpr size_t kYOffset = 2 * S::kXBytes;
  static constexpr size_t kStripOffset = kYOffset + 2 * S::kYBytes;
  static constexpr size_t kBytes = kStripOffset + kWarps * SharedRStrip<D>::kBytesPerWarp;
  // sm_90's opt-in limit is 227 KB per block, ~11 KB of it static here.
  static_assert(kBytes <= 200 * 1024, "the roles kernel's shared memory fits an sm_90 block");
};
}  // namespace roles

template <int D, int G>
__global__ void __launch_bounds__(roles::kThreads, 1)
    EncodeRolesKernel(PageGeometry geom, const EncodeJob* __restrict__ jobs, int num_jobs,
                      int tiles_per_kh, long total_items) {
  using S = Shape<D>;
  using roles::kRowSlots;
  extern __shared__ __align__(128) unsigned char smem[];
  const auto xs = [&](int b) { return reinterpret_cast<uint16_t*>(smem + b * S::kXBytes); };
  const auto ys = [&](int b) {
    return reinterpret_cast<float*>(smem + roles::Smem<D>::kYOffset + b * S::kYBytes);
  };
  __shared__ Row rows[kRowSlots][S::M];
  __shared__ float row_unscale[S::M];  // written and read by the multiplying warps only
  __shared__ __align__(8) uint64_t y_full[2], y_free[2];

  const int tid = threadIdx.x, warp = WarpIndex(), lane = tid & 31;
  const BlockItems range = BlockItemRange(total_items);
  const long first = range.first, last = range.last;
  if (first >= last) return;
  const int tiles = static_cast<int>(last - first);
  if (tid == 0) InitYBarriers(y_full, y_free, roles::kMultiplyThreads, roles::kQuantWarps * 32);
  __syncthreads();

  if (warp >= kWarps) {  // quantizing warps
    TileSteps<D>::template QuantizeTiles<G, roles::kRowsPerPass, kRowSlots>(
        rows, ys, y_full, y_free, tiles, warp - kWarps, roles::kQuantWarps, lane);
    return;
  }

  // Multiplying warps.
  const TileSteps<D> steps{geom, jobs, tiles_per_kh, num_jobs * geom.page_tokens};
  SharedRStrip<D> strip;
  strip.frag = reinterpret_cast<uint4*>(smem + roles::Smem<D>::kStripOffset +
                                        warp * SharedRStrip<D>::kBytesPerWarp);
  steps.FillRows(first, rows[0], tid);
  NamedBarrierSync(roles::kMultiplyBarrier, roles::kMultiplyThreads);
  steps.FetchX(xs(0), rows[0], tid);
  CpAsyncCommit();
#pragma unroll 1
  for (int n = 0; n < tiles; ++n) {
    const int b = n & 1;
    // rows[(n + 1) % 4] last served tile n - 3, whose buffer the quantizers
    // freed before tile n - 1's multiply.
    if (n + 1 < tiles) steps.FillRows(first + n + 1, rows[(n + 1) % kRowSlots], tid);
    // rows written; xs(b ^ 1), read by tile n - 1's multiply, free
    NamedBarrierSync(roles::kMultiplyBarrier, roles::kMultiplyThreads);
    if (n + 1 < tiles) steps.FetchX(xs(b ^ 1), rows[(n + 1) % kRowSlots], tid);
    CpAsyncCommit();
    CpAsyncWaitAllButNewest();
    NamedBarrierSync(roles::kMultiplyBarrier, roles::kMultiplyThreads);  // xs(b) complete
    steps.ToScaledFp16(xs(b), row_unscale, tid);
    NamedBarrierSync(roles::kMultiplyBarrier, roles::kMultiplyThreads);
    if (n >= 2) BarrierWait(&y_free[b], ((n >> 1) & 1) ^ 1);  // tile n - 2 quantized
    steps.template Multiply<2>(xs(b), rows[n % kRowSlots], row_unscale, ys(b), strip, warp, lane);
    BarrierArrive(&y_full[b]);
  }
}

}  // namespace encode_strips
}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_CUDA_ENCODE_STRIPS_CUH_
