// The ops' kernels as C++ functions over pointers (each defined beside its op, infer::<name>, in its own file), for
// kernels that chain them without the dispatcher: eagle_round.cpp runs an EAGLE-3 draft round through them,
// lm_round.cpp a draft LM's, and a target's few-token forward (llama_forward).
#pragma once

// ATen's tensor type and CPU allocation only: ATen/ATen.h (every operator) and torch/library.h cost ~12 s of parsing a
// file, most of a first start's kernel build; the ops are registered in one file (registry.cpp).
#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace infer_kernels {

// a new CPU tensor (what at::empty does on the CPU, without the dispatcher or its header)
inline at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  return at::Tensor(at::detail::empty_cpu(sizes, options));
}

// The ops' entries, registered as infer::<name> by registry.cpp; each defined in the file named.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& scale,
                  const std::optional<at::Tensor>& lens);  // linear.cpp
at::Tensor qlinear(const at::Tensor& x, const at::Tensor& packed, int64_t format, int64_t out_features,
                   const std::optional<at::Tensor>& lens, bool float_out);  // qlinear.cpp
bool qlinear_pairs(bool on);
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& rows,
                     const std::optional<at::Tensor>& lens);  // attention.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                    const std::optional<at::Tensor>& lens);  // norm.cpp
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t head_dim,
                const std::optional<at::Tensor>& lens);  // pointwise.cpp
at::Tensor silu_mul(const at::Tensor& x, const std::optional<at::Tensor>& lens);
at::Tensor argmax(const at::Tensor& x);  // argmax.cpp
std::tuple<at::Tensor, at::Tensor> rejection_sample(const at::Tensor& p, const at::Tensor& drafts,
                                                    const std::optional<at::Tensor>& q, const at::Tensor& nd,
                                                    const at::Tensor& u, const at::Tensor& u_final);  // sample.cpp
std::tuple<at::Tensor, at::Tensor> rejection_sample_logits(
    const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& drafts,
    const std::optional<at::Tensor>& q, const at::Tensor& nd, const at::Tensor& u, const at::Tensor& u_final,
    const std::optional<at::Tensor>& q_ids);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> eagle3_round(
    const at::Tensor& tokens, const at::Tensor& features, at::TensorList packed, at::IntArrayRef formats,
    at::IntArrayRef outs, at::TensorList norms, double eps, const at::Tensor& embed, const at::Tensor& draft_ids,
    const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& table, int64_t block_size, int64_t start, int64_t heads, int64_t kv_heads, int64_t head_dim,
    const at::Tensor& temperature, const at::Tensor& u, const std::optional<at::Tensor>& screen,
    int64_t screen_top, const std::optional<at::Tensor>& stop_cal,
    const std::optional<at::Tensor>& stop_below);  // eagle_round.cpp
std::tuple<at::Tensor, at::Tensor> draft_lm_round(
    const at::Tensor& tokens, at::TensorList packed, at::IntArrayRef formats, at::IntArrayRef outs,
    at::TensorList norms, double eps, const at::Tensor& embed, const at::Tensor& vocab_packed, int64_t vocab_format,
    const std::optional<at::Tensor>& extra_weight, const at::Tensor& vocab_ids, const at::Tensor& cos,
    const at::Tensor& sin, at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& table,
    int64_t block_size, int64_t start, int64_t heads, int64_t kv_heads, int64_t head_dim,
    const at::Tensor& temperature, const at::Tensor& u);  // lm_round.cpp
at::Tensor llama_forward(const at::Tensor& tokens, at::TensorList packed, at::IntArrayRef formats,
                         at::IntArrayRef outs, at::TensorList norms, double eps, const at::Tensor& embed,
                         const at::Tensor& cos, const at::Tensor& sin, at::TensorList k_caches,
                         at::TensorList v_caches, const at::Tensor& rows, int64_t start, int64_t heads,
                         int64_t kv_heads, int64_t head_dim, at::IntArrayRef aux,
                         at::TensorList lora);  // lm_round.cpp

// Over bfloat16 rows the caller holds: no tensor made, nothing allocated after a thread's first call (a round that
// starts cold after every verify paid ~4 us for each tensor its steps made). The caller checks its shapes; each
// writes the bits its op would.
// y [M, N] (float_out: float32 holding the bfloat16 values) = x [M, K] @ W.T, W in `packed` (checked against N, K)
void qlinear_into(const c10::BFloat16* x, int64_t M, int64_t K, const at::Tensor& packed, int64_t format, int64_t N,
                  void* y, bool float_out);
// y [n * 8] float32 (holding bfloat16 values) = x [1, K] @ the rows of the groups of 8 `groups` [n] of `packed`
// (N rows in all), each row with the bits of the full product's
void qlinear_groups_into(const c10::BFloat16* x, int64_t K, const at::Tensor& packed, int64_t format, int64_t N,
                         const int64_t* groups, int64_t n, float* y);
// y [M, N] = x [M, K] @ w.T, all bfloat16 and contiguous (infer::linear's bits)
void linear_into(const c10::BFloat16* x, int64_t M, int64_t K, const c10::BFloat16* w, int64_t N, c10::BFloat16* y);
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
// n tokens of one chain q (token t at q + t * q_stride, [heads, D]) at positions start .. start + n - 1, token t over
// the keys at storage rows rows[0 .. start + t] -> out [n, heads, D]: each token's attention_paged_row bits, the
// tokens sharing each key's load
void attention_paged_chain(const c10::BFloat16* q, int64_t n, int64_t q_stride, int64_t heads, int64_t head_dim,
                           const c10::BFloat16* k, const c10::BFloat16* v, int64_t kv_heads, const int64_t* rows,
                           int64_t start, c10::BFloat16* out);

}  // namespace infer_kernels
