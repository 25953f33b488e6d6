// The one definition of oscarkv's memory formats, shared by g++ and nvcc.
//
// History page (P tokens of one layer, all KV heads, INT2):
//   for each kv head h (head-major):
//     K codes  [P][D/4]   bytes, 4 codes per byte (packing below)
//     K params [P][D/G]   QuantParams {fp16 scale, fp16 min}
//     V codes  [P][D/4]
//     V params [P][D/G]
// Exact (BF16) block (P tokens of one layer, all KV heads): used for the sink
// and recent tiers, and as the staging area a history page is encoded from:
//   K [P][H][D] bf16, then V [P][H][D] bf16   (token-major, like the wire format)
//
// Packing of one row of D codes (each 0..3) into D/4 bytes, quarter-interleaved:
//   byte j = q[j] | q[j + D/4] << 2 | q[j + D/2] << 4 | q[j + 3D/4] << 6
// so a thread holding byte j owns one element of each quarter of the row.
#ifndef OSCARKV_KERNELS_PAGE_FORMAT_H_
#define OSCARKV_KERNELS_PAGE_FORMAT_H_

#include <cstddef>
#include <cstdint>

#include "kernels/numeric.h"

namespace oscarkv {

// Per token, per group: dequantized y = code * scale + min (both fp16).
struct QuantParams {
  fp16_bits scale;
  fp16_bits min;
};
static_assert(sizeof(QuantParams) == 4, "QuantParams is two fp16 values");

inline constexpr int kCodeBits = 2;
inline constexpr int kCodesPerByte = 4;
inline constexpr int kCodeLevels = 4;  // 2^kCodeBits
static_assert(kCodeBits * kCodesPerByte == 8, "codes fill a byte exactly");

// Byte j of a packed row of D codes.
OSCARKV_HDC uint8_t PackCodes4(uint32_t q0, uint32_t q1, uint32_t q2, uint32_t q3) {
  return static_cast<uint8_t>(q0 | (q1 << 2) | (q2 << 4) | (q3 << 6));
}
// Code of element `quarter * D/4 + j` from byte j.
OSCARKV_HDC uint32_t UnpackCode(uint8_t byte, int quarter) { return (byte >> (2 * quarter)) & 3u; }

// Byte offsets inside one history page and one exact block. Plain ints so the
// struct can be passed by value to kernels.
struct PageGeometry {
  int kv_heads = 0;
  int head_dim = 0;     // D
  int group_size = 0;   // G, divides D
  int page_tokens = 0;  // P

  OSCARKV_HDC int groups() const { return head_dim / group_size; }
  OSCARKV_HDC int code_row_bytes() const { return head_dim / kCodesPerByte; }
  OSCARKV_HDC int param_row_bytes() const { return groups() * static_cast<int>(sizeof(QuantParams)); }
  OSCARKV_HDC size_t codes_bytes() const { return size_t(page_tokens) * code_row_bytes(); }
  OSCARKV_HDC size_t params_bytes() const { return size_t(page_tokens) * param_row_bytes(); }
  OSCARKV_HDC size_t head_stride() const { return 2 * (codes_bytes() + params_bytes()); }
  OSCARKV_HDC size_t page_bytes() const { return head_stride() * kv_heads; }

  // kind 0 = keys, 1 = values.
  OSCARKV_HDC size_t codes_offset(int head, int kind) const {
    return head * head_stride() + kind * (codes_bytes() + params_bytes());
  }
  OSCARKV_HDC size_t params_offset(int head, int kind) const {
    return codes_offset(head, kind) + codes_bytes();
  }

  // Exact BF16 block: K [P][H][D] then V [P][H][D].
  OSCARKV_HDC size_t exact_row_elems() const { return size_t(kv_heads) * head_dim; }
  OSCARKV_HDC size_t exact_half_bytes() const { return size_t(page_tokens) * exact_row_elems() * 2; }
  OSCARKV_HDC size_t exact_block_bytes() const { return 2 * exact_half_bytes(); }
};

// Qwen3-8B, default tiers: 8 kv heads, D 128, G 128, P 32.
static_assert(PageGeometry{8, 128, 128, 32}.page_bytes() == 18432,
              "history page for 8 heads x 32 tokens x D128/G128 is 18 KiB (2.25 bits)");
static_assert(PageGeometry{8, 128, 128, 32}.exact_block_bytes() == 131072,
              "BF16 block for 8 heads x 32 tokens x D128 is 128 KiB");
static_assert(PageGeometry{1, 64, 32, 1}.code_row_bytes() == 16 &&
                  PageGeometry{1, 64, 32, 1}.param_row_bytes() == 8,
              "D64/G32 row: 16 code bytes, two groups");

}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_PAGE_FORMAT_H_
