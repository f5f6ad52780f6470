// infer::rms_norm: RMSNorm of every CPU step (decode, verify, prefill), one implementation for eager and compiled steps.
//
// Why a kernel for 576 multiply-adds: inductor fuses the residual add into the norm's reduction and sums the squares
// in another order than ATen does, so a compiled step and the same step run eagerly differed in the last bits (every
// other op of a Llama step agrees bit for bit, products and attention being infer's kernels already). As an opaque op
// the norm is the same code in both, so the engine may run a step eagerly while its graph still compiles in the
// background and emit exactly the tokens the graph would (engine.warmup).
//
// Math (Hugging Face's order of rounding): r = 1 / sqrt(mean(x^2) + eps) in float32;
//   float32 x: y = (x * r) * w;   bfloat16 x: y = bf16(w * bf16(x * r)).
// Batch invariant: each row is reduced alone, in a fixed order (16 partial sums, then added left to right), so a
// row's result does not depend on the rows beside it; with FP contraction off (kernels._flags) the compiler may
// vectorise but not reorder, so the AVX2 and AVX-512 builds agree too.


#include <cmath>
#include <type_traits>

#include "bf16x16.h"
#include "ops.h"
#include "rows.h"

namespace {

using namespace infer_kernels;  // bf16x16.h

constexpr int kLanes = 16;

template <typename T>
void norm_row(const T* x, const T* w, T* y, int64_t n, float eps) {
  float part[kLanes] = {0.f};
  int64_t i = 0;
#if defined(INFER_BF16X16)
  if constexpr (std::is_same_v<T, at::BFloat16>) {  // the same lanes' sums (a multiply, then an add), 16 at a time
    __m512 acc = _mm512_setzero_ps();
    for (; i + kLanes <= n; i += kLanes) {
      const __m512 v = bf16x16_load(x + i);
      acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
    }
    _mm512_storeu_ps(part, acc);
  }
#endif
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      const float v = static_cast<float>(x[i + l]);
      part[l] += v * v;
    }
  for (int l = 0; i < n; ++i, ++l) {
    const float v = static_cast<float>(x[i]);
    part[l] += v * v;
  }
  float sum = 0.f;
  for (int l = 0; l < kLanes; ++l) sum += part[l];
  const float r = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  int64_t j = 0;
#if defined(INFER_BF16X16)
  if constexpr (std::is_same_v<T, at::BFloat16>) {  // the scalar loop's two roundings, lane by lane
    const __m512 rv = _mm512_set1_ps(r);
    for (; j + kLanes <= n; j += kLanes) {
      const __m512 normed = bf16x16_rounded(_mm512_mul_ps(bf16x16_load(x + j), rv));
      bf16x16_store(y + j, _mm512_mul_ps(bf16x16_load(w + j), normed));
    }
  }
#endif
  for (; j < n; ++j) {
    if constexpr (std::is_same_v<T, float>) {
      y[j] = (x[j] * r) * w[j];
    } else {  // two roundings, as eager bfloat16: the normalised value, then the product with the weight
      const T normed = static_cast<T>(static_cast<float>(x[j]) * r);
      y[j] = static_cast<T>(static_cast<float>(w[j]) * static_cast<float>(normed));
    }
  }
}

}  // namespace

// The op's entry, and its kernel over pointers for the other kernels (ops.h: eagle_round.cpp chains those)
namespace infer_kernels {

// lens: [B] real rows of a padded [B, T] forward (rows.h): the pads are skipped, their outputs left unwritten
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, const c10::optional<at::Tensor>& lens) {
  TORCH_CHECK(x.dim() == 2, "infer::rms_norm: x must be [rows, hidden], got ", x.sizes());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1), "infer::rms_norm: weight must be [", x.size(1),
              "], got ", weight.sizes());
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "infer::rms_norm: x and weight dtypes differ (",
              x.scalar_type(), " vs ", weight.scalar_type(), ")");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "infer::rms_norm: float32 or bfloat16 only, got ", x.scalar_type());
  const auto xc = x.contiguous();
  const auto wc = weight.contiguous();
  auto y = empty(xc.sizes(), xc.options());
  const int64_t rows = xc.size(0), n = xc.size(1);
  const float e = static_cast<float>(eps);
  infer_kernels::for_row_runs(lens, rows, [&](int64_t first, int64_t count) {
    infer_kernels::rows_in_parallel(first, count, [&](int64_t first, int64_t count) {  // a prefill's rows: threads
      if (xc.scalar_type() == at::kFloat) {
        for (int64_t m = first; m < first + count; ++m)
          norm_row(xc.data_ptr<float>() + m * n, wc.data_ptr<float>(), y.data_ptr<float>() + m * n, n, e);
      } else {
        using B = at::BFloat16;
        for (int64_t m = first; m < first + count; ++m)
          norm_row(xc.data_ptr<B>() + m * n, wc.data_ptr<B>(), y.data_ptr<B>() + m * n, n, e);
      }
    });
  }, [](int64_t, int64_t) {});
  return y;
}

void rms_norm_into(const at::BFloat16* x, const at::BFloat16* w, at::BFloat16* y, int64_t rows, int64_t n,
                   int64_t y_stride, double eps) {
  for (int64_t m = 0; m < rows; ++m) norm_row(x + m * n, w, y + m * y_stride, n, static_cast<float>(eps));
}

}  // namespace infer_kernels
