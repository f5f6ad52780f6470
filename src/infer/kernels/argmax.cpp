// infer::argmax: the index of each row's largest entry over the last dimension (greedy decoding's and greedy
// verification's one reduction over the vocabulary), the first one on ties, as torch.argmax.
//
// Why a kernel: ATen's index-returning reductions (argmax, max(dim), topk) are not vectorised on CPU. Over SmolLM2's
// 49,152 logits they take ~130 us a row (400 us for the 5 rows a verify of 4 drafts judges: ~4% of a decode step),
// where the value alone (amax) takes ~11 us. Here one vectorised pass finds the maximum and the block of 64 that first
// holds it (argmax_row).
//
// Semantics, as torch.argmax: the first maximal entry (-0.0 and +0.0 are equal); a row holding a NaN answers its first
// NaN (NaN propagates through torch's max); a row of -inf answers 0. float32 and bfloat16 (widened exactly).
#include <ATen/Parallel.h>

#include <cstdint>
#include <limits>

#include "ops.h"
#include "vec8.h"

namespace {

using infer_kernels::load8;  // 8 float32 or bfloat16 entries widened to float32 (exact)

inline float widen(float v) { return v; }
inline float widen(at::BFloat16 v) { return static_cast<float>(v); }

// The first index of row x's maximum (module comment for NaN and ties). One pass over blocks of 64: a block's
// maximum (8 vectors, a tree of maxes) is compared with the running one, and only a block that raises it is
// reduced to a scalar and remembered (rare after the first blocks: a random row raises it ~log n times). The block
// remembered is the first holding the row's maximum (a tie does not raise it), so the answer is the first entry
// equal to the maximum there: 64 entries scanned, not the row.
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t at = 0, block = -1;  // the answer from the scalar tail, or the block holding the maximum
  int64_t i = 0;
  bool nan = false;
#if defined(__AVX2__) && defined(__FMA__)  // vec8.h's load8 is AVX2's there
  constexpr int64_t kBlock = 64;
  __m256 running = _mm256_set1_ps(best), unordered = _mm256_setzero_ps();
  for (; i + kBlock <= n; i += kBlock) {
    __m256 v[8];
    for (int k = 0; k < 8; ++k) v[k] = load8(x + i + 8 * k);
    for (int k = 0; k < 8; k += 2)  // UNORD(a, b): a NaN in either (max_ps would pass one over)
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v[k], v[k + 1], _CMP_UNORD_Q));
    const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_max_ps(v[0], v[1]), _mm256_max_ps(v[2], v[3])),
                                   _mm256_max_ps(_mm256_max_ps(v[4], v[5]), _mm256_max_ps(v[6], v[7])));
    if (_mm256_movemask_ps(_mm256_cmp_ps(m, running, _CMP_GT_OQ))) {
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, m);
      for (float l : lanes) best = l > best ? l : best;
      running = _mm256_set1_ps(best);
      block = i;
    }
  }
  nan = _mm256_movemask_ps(unordered) != 0;
#endif
  for (; i < n; ++i) {
    const float v = widen(x[i]);
    nan |= v != v;
    if (v > best) best = v, at = i, block = -1;
  }
  if (nan) {
    for (int64_t j = 0; j < n; ++j) {
      const float v = widen(x[j]);
      if (v != v) return j;
    }
  }
  if (block >= 0)
    for (int64_t j = block;; ++j)
      if (widen(x[j]) == best) return j;
  return at;  // from the tail, or 0 where no entry exceeds -inf (a row of -inf: torch answers 0 too)
}

template <typename T>
void argmax_rows(const T* x, int64_t* out, int64_t rows, int64_t n) {
  // a row is ~5-10 us of streaming, a fork ~3: from two rows on, the rows are shared out (a verify's 3-4 rows, Intel
  // Xeon: 19.9 / 24.3 us on one thread; 4 rows a chunk before, which kept every verify of up to 3 drafts on one)
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out[r] = argmax_row(x + r * n, n);
  });
}

}  // namespace

// x [..., n] -> [...] int64
at::Tensor infer_kernels::argmax(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1, "infer::argmax: x needs a last dimension, got a scalar");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "infer::argmax: float32 or bfloat16 only, got ", x.scalar_type());
  TORCH_CHECK(x.size(-1) > 0, "infer::argmax: the last dimension is empty");
  const auto xc = x.contiguous();
  const int64_t n = xc.size(-1), rows = xc.numel() / n;
  auto sizes = xc.sizes().vec();
  sizes.pop_back();
  auto out = empty(sizes, xc.options().dtype(at::kLong));
  if (xc.scalar_type() == at::kFloat)
    argmax_rows(xc.data_ptr<float>(), out.data_ptr<int64_t>(), rows, n);
  else
    argmax_rows(xc.data_ptr<at::BFloat16>(), out.data_ptr<int64_t>(), rows, n);
  return out;
}
