// Decode attention on the CPU (the twin of the CUDA kernels): over the tiered
// compressed cache of one sequence-layer, and over a plain BF16 cache (the
// baseline the benchmarks compare against). fp32 accumulation.
#ifndef OSCARKV_KERNELS_CPU_ATTENTION_CPU_H_
#define OSCARKV_KERNELS_CPU_ATTENTION_CPU_H_

#include "kernels/backend.h"

namespace oscarkv {

// Attention of one item restricted to kv head `kv_head` (its GQA group of
// query heads): writes out/lse rows [kv_head*g, (kv_head+1)*g).
void AttendCompressedKvHead(const PageGeometry& geom, int num_q_heads, float scale,
                            const AttendItem& item, int kv_head);

// Plain attention over an uncompressed BF16 cache K, V [T][H][D] for one kv
// head's query group. q [Hq][D] fp32; out [Hq][D]; lse [Hq] or null.
void AttendBf16KvHead(const bf16_bits* k, const bf16_bits* v, int tokens, int kv_heads,
                      int head_dim, int num_q_heads, float scale, const float* q, float* out,
                      float* lse, int kv_head);

// Merges two partial attention results over disjoint token sets, each given as
// (output normalized over its own tokens, its LSE), into (out, lse): the
// online-softmax rule. Either side may be empty (lse = -inf).
void MergeAttention(const float* o_a, float lse_a, const float* o_b, float lse_b, int dim,
                    float* out, float* lse);

}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_CPU_ATTENTION_CPU_H_
