// infer::linear: y = x @ W.T for a few activation rows (decode: 1 row, verify: K+1 rows), on the CPU.
//
// Decoding streams every weight once per token, so this kernel's job is to read W at the memory bandwidth while
// doing as little arithmetic per byte as it can:
//   - each thread walks a contiguous run of rows: one sequential stream, prefetched ahead in software for bf16 and
//     int8 (the hardware prefetchers alone fall behind on their rows of a few hundred bytes; float32 rows stream
//     faster without);
//   - the activations, converted to float32 once, stay in L1; a weight row is loaded once for up to 3 of them;
//   - bfloat16 and int8 weights are widened to float32 in registers (int8: y = s[n] * sum_k q[n,k] x[k]).
//
// Batch invariance: the arithmetic for one (row n, activation m) pair is the same whatever M is or which other rows
// share the call (four 8-lane partial sums over k in steps of 32, steps of 8 into the first, a fixed reduction, the
// scalar tail last, then the scale). A token's logits are therefore bit-identical whether the target computes it
// alone (decode) or among K+1 (speculative verify), which keeps greedy speculation exactly equal to greedy decoding.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "vec8.h"

namespace {

using namespace infer_kernels;

constexpr int64_t kPrefetchBytes = 1536;  // how far ahead of the current read each thread prefetches

// out[m * out_stride] = scale * dot(w[0:K], x[m, 0:K]) for m < MT; x rows are K floats apart.
template <typename W, int MT>
inline void row_dot(const W* w, int64_t K, const float* x, float scale, float* out, int64_t out_stride) {
  V8 acc[4][MT];
  for (int u = 0; u < 4; ++u)
    for (int m = 0; m < MT; ++m) acc[u][m] = zero8();
  const int64_t K32 = K & ~int64_t(31), K8 = K & ~int64_t(7);
  int64_t k = 0;
  for (; k < K32; k += 32) {
    if constexpr (sizeof(W) < 4) {  // float32 rows stream faster on the hardware prefetchers alone (~7% here)
      const char* ahead = reinterpret_cast<const char*>(w + k) + kPrefetchBytes;
      for (size_t line = 0; line < 32 * sizeof(W); line += 64) prefetch(ahead + line);
    }
    for (int u = 0; u < 4; ++u) {
      V8 wv = load8(w + k + 8 * u);
      for (int m = 0; m < MT; ++m) acc[u][m] = fma8(wv, load8(x + m * K + k + 8 * u), acc[u][m]);
    }
  }
  for (; k < K8; k += 8) {
    V8 wv = load8(w + k);
    for (int m = 0; m < MT; ++m) acc[0][m] = fma8(wv, load8(x + m * K + k), acc[0][m]);
  }
  for (int m = 0; m < MT; ++m) {
    float s = hsum8(add8(add8(acc[0][m], acc[1][m]), add8(acc[2][m], acc[3][m])));
    for (int64_t j = K8; j < K; ++j) s += to_float(w[j]) * x[m * K + j];
    out[m * out_stride] = s * scale;
  }
}

// y[m, n] for every m < M and n in [n0, n1); rows wider than 3 activations go in tiles of 3.
template <typename W>
void rows(const W* w, const float* scale, int64_t n0, int64_t n1, int64_t K, const float* x, int64_t M, float* y,
          int64_t N, std::vector<float>& widened) {
  for (int64_t n = n0; n < n1; ++n) {
    const W* wr = w + n * K;
    const float s = scale ? scale[n] : 1.0f;
    const float* xr = x;
    float* yr = y + n;
    int64_t m = 0;
    if (M > 3 && !std::is_same<W, float>::value) {
      // several tiles would each widen the row again: widen it once into L1 (the same float values, so the same
      // arithmetic as the direct path), then run the float32 loop over it
      widened.resize(K);
      float* wide = widened.data();
      const int64_t K8 = K & ~int64_t(7);
      for (int64_t j = 0; j < K8; j += 8) {
        if ((j * sizeof(W)) % 64 == 0) prefetch(reinterpret_cast<const char*>(wr + j) + kPrefetchBytes);
        store8(wide + j, load8(wr + j));
      }
      for (int64_t j = K8; j < K; ++j) wide[j] = to_float(wr[j]);
      for (; m + 3 <= M; m += 3) row_dot<float, 3>(wide, K, xr + m * K, s, yr + m * N, N);
      if (M - m == 2) row_dot<float, 2>(wide, K, xr + m * K, s, yr + m * N, N);
      else if (M - m == 1) row_dot<float, 1>(wide, K, xr + m * K, s, yr + m * N, N);
      continue;
    }
    for (; m + 3 <= M; m += 3) row_dot<W, 3>(wr, K, xr + m * K, s, yr + m * N, N);
    if (M - m == 2) row_dot<W, 2>(wr, K, xr + m * K, s, yr + m * N, N);
    else if (M - m == 1) row_dot<W, 1>(wr, K, xr + m * K, s, yr + m * N, N);
  }
}

template <typename W>
void run(const W* w, const float* scale, int64_t N, int64_t K, const float* x, int64_t M, float* y) {
  // at::parallel_for hands each thread one contiguous range of rows (torch's OpenMP pool, torch.set_num_threads)
  const int64_t grain = std::max<int64_t>(16, 32768 / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    thread_local std::vector<float> widened;
    rows(w, scale, n0, n1, K, x, M, y, N, widened);
  });
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& scale) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "infer::linear: x [M, K] and weight [N, K] expected, got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "infer::linear runs on the CPU");
  const auto wt = weight.scalar_type(), xt = x.scalar_type();
  TORCH_CHECK(xt == at::kFloat || xt == at::kBFloat16, "infer::linear: x must be float32 or bfloat16, got ", xt);
  TORCH_CHECK(wt == at::kFloat || wt == at::kBFloat16 || wt == at::kChar,
              "infer::linear: weight must be float32, bfloat16 or int8, got ", wt);
  TORCH_CHECK(scale.has_value() == (wt == at::kChar), "infer::linear: a scale [N] comes with int8 weights only");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  auto w = weight.contiguous();
  auto xf = x.to(at::kFloat).contiguous();  // [M, K], a few KB: read from L1 for every row of W
  at::Tensor s;
  if (scale.has_value()) {
    TORCH_CHECK(scale->numel() == N, "infer::linear: scale must have ", N, " entries, got ", scale->numel());
    s = scale->to(at::kFloat).contiguous();
  }
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const float* sp = scale.has_value() ? s.data_ptr<float>() : nullptr;
  if (wt == at::kFloat) run(w.data_ptr<float>(), sp, N, K, xf.data_ptr<float>(), M, y.data_ptr<float>());
  else if (wt == at::kBFloat16) run(w.data_ptr<c10::BFloat16>(), sp, N, K, xf.data_ptr<float>(), M, y.data_ptr<float>());
  else run(w.data_ptr<int8_t>(), sp, N, K, xf.data_ptr<float>(), M, y.data_ptr<float>());
  return xt == at::kFloat ? y : y.to(xt);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(infer, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? scale=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(infer, CPU, m) {
  m.impl("linear", &linear);
}
