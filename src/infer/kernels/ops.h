// The ops' kernels as C++ functions over pointers (each defined beside its op, infer::<name>, in its own file), for
// kernels that chain them without the dispatcher: eagle_round.cpp runs an EAGLE-3 draft round through them.
#pragma once

#include <ATen/ATen.h>

namespace infer_kernels {

// Over bfloat16 rows the caller holds: no tensor made, nothing allocated after a thread's first call (a round that
// starts cold after every verify paid ~4 us for each tensor its steps made). The caller checks its shapes; each
// writes the bits its op would.
// y [M, N] (float_out: float32 holding the bfloat16 values) = x [M, K] @ W.T, W in `packed` (checked against N, K)
void qlinear_into(const c10::BFloat16* x, int64_t M, int64_t K, const at::Tensor& packed, int64_t format, int64_t N,
                  void* y, bool float_out);
// rows of n: x [rows, n] contiguous -> y's rows, y_stride apart
void rms_norm_into(const at::BFloat16* x, const at::BFloat16* w, at::BFloat16* y, int64_t rows, int64_t n,
                   int64_t y_stride, double eps);
void rope_into(const at::BFloat16* x, int64_t x_stride, const at::BFloat16* cos, const at::BFloat16* sin,
               at::BFloat16* y, int64_t rows, int64_t heads, int64_t head_dim);
void silu_mul_into(const at::BFloat16* x, at::BFloat16* y, int64_t rows, int64_t n);
// one query token's heads q [heads, D] over the keys at storage rows rows[0 .. L-1] of a paged pool's k, v
// [R, kv_heads, D] (contiguous) -> out [heads, D]
void attention_paged_row(const c10::BFloat16* q, int64_t heads, int64_t head_dim, const c10::BFloat16* k,
                         const c10::BFloat16* v, int64_t kv_heads, const int64_t* rows, int64_t L,
                         c10::BFloat16* out);

}  // namespace infer_kernels
