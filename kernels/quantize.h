// Row-level OSCAR codec on the host: rotate, clip, INT2-quantize, pack
// (DESIGN section 2). These are the scalar twins of the CUDA kernels and the
// building blocks of the CPU backend. Pure functions over caller-owned memory.
#ifndef OSCARKV_KERNELS_QUANTIZE_H_
#define OSCARKV_KERNELS_QUANTIZE_H_

#include <cstdint>

#include "kernels/numeric.h"
#include "kernels/page_format.h"

namespace oscarkv {

// Smallest scale the quantizer uses: s = max(max - min, 1e-8) / 3.
inline constexpr float kMinRange = 1e-8f;

// Index (1-based rank) of the clip threshold: ceil(ratio * n), within [1, n].
int ClipRank(float ratio, int n);

// tau = the ClipRank(ratio, n)-th smallest |y_j|. `scratch` holds n floats.
float ClipThreshold(const float* y, int n, float ratio, float* scratch);

// y <- clamp(y, -tau, tau) with tau from ClipThreshold; ratio 1 leaves y as is.
void ClipRow(float* y, int n, float ratio, float* scratch);

// Asymmetric 2-bit quantization of y[0..D) in groups of G: per group,
// lo = min, s = max(max - lo, 1e-8) / 3, both stored as fp16; codes are computed
// against the fp16-rounded (s, lo) so that dequantization is exactly what was
// optimized: q = clamp(rint((y - lo) / s), 0, 3). Writes D/4 packed bytes and D/G params.
void QuantizeRow(const float* y, int dim, int group, uint8_t* codes, QuantParams* params);

// y^ = q * s + lo for one packed row.
void DequantizeRow(const uint8_t* codes, const QuantParams* params, int dim, int group,
                   float* out);

// Unpacked codes of one packed row (tests and debugging).
void UnpackRow(const uint8_t* codes, int dim, uint8_t* q);

// y = x · R for one row (x bf16, R fp32 D×D row-major).
void RotateRow(const bf16_bits* x, const float* r, int dim, float* y);

// Y[t] = X[t] · R for n rows at once (row t of X at x + t * x_stride), so
// that R streams through the cache once per n rows. y is [n][D].
void RotateRows(const bf16_bits* x, size_t x_stride, int n, const float* r, int dim, float* y);

// Full encode of one row: rotate by R, clip with `clip_ratio`, quantize, pack.
// `scratch` holds 2*D floats.
void EncodeRow(const bf16_bits* x, const float* r, int dim, int group, float clip_ratio,
               uint8_t* codes, QuantParams* params, float* scratch);

}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_QUANTIZE_H_
