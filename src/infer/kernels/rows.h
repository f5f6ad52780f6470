// Padded rows skipped: a forward pads its rows to one length (a verify's rows draft different K: [B, T] with row b's
// tokens 0..lens[b]-1 real), and a product over the pads costs what a real token's does (a verify row is
// compute-bound on a 2-core CPU: ~0.2 of a decode step). With ``lens`` ([B] int64, B dividing M), a kernel works on
// the real rows alone (x's row r = b * T + t is real iff t < lens[b]) and leaves the pads' outputs unwritten: a
// pad's values only ever reach the pad itself (row-wise ops, its key written to a scratch column no query reads),
// and the model's logits set the pads to 0 (LlamaForCausalLM._logits). Writing zeros cost ~0.4 MB a pad a forward
// (SmolLM2: 23 MB for a batch of 8 with one row drafting 8, ~2.5 ms on 2 cores). Batch invariance keeps the real
// rows' bits: a row's result does not depend on which rows share the call.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "ops.h"

namespace infer_kernels {

// x's real rows in order (b * T + t for t < lens[b]), checked against M; empty lens: every row (the list not built)
inline std::vector<int64_t> real_rows(const c10::optional<at::Tensor>& lens, int64_t M, bool& all_real) {
  std::vector<int64_t> keep;
  all_real = true;
  if (!lens.has_value() || !lens->defined()) return keep;
  const int64_t B = lens->numel();
  TORCH_CHECK(lens->scalar_type() == at::kLong && lens->device().is_cpu() && B > 0 && M % B == 0,
              "lens must be int64 [B] on the CPU with B dividing the ", M, " rows, got ", lens->sizes(), " ",
              lens->scalar_type());
  const int64_t T = M / B;
  const auto l = lens->contiguous();
  const int64_t* lp = l.data_ptr<int64_t>();
  keep.reserve(M);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < std::min(lp[b], T); ++t) keep.push_back(b * T + t);
  all_real = static_cast<int64_t>(keep.size()) == M;
  return keep;
}

// real(first, count) for each run of consecutive real rows, pad(first, count) for each run of pads
template <typename Real, typename Pad>
void for_row_runs(const c10::optional<at::Tensor>& lens, int64_t M, Real&& real, Pad&& pad) {
  if (!lens.has_value() || !lens->defined()) {
    real(int64_t(0), M);
    return;
  }
  bool all_real;
  const auto keep = real_rows(lens, M, all_real);
  if (all_real) {
    real(int64_t(0), M);
    return;
  }
  const int64_t B = lens->numel(), T = M / B;
  const auto l = lens->contiguous();
  const int64_t* lp = l.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = std::max<int64_t>(0, std::min(lp[b], T));
    if (n) real(b * T, n);
    if (n < T) pad(b * T + n, T - n);
  }
}

// fn(first, count) over rows [first, first + count), cut into runs of kParallelRows shared out over the threads
// where there are more than that (a prefill's many rows); a few-token step's rows stay on the calling thread, where a
// fork/join would cost about what it saves. For row-wise kernels: a row's bits do not depend on its run.
constexpr int64_t kParallelRows = 32;
template <typename Fn>
void rows_in_parallel(int64_t first, int64_t count, Fn&& fn) {
  if (count <= kParallelRows) {
    fn(first, count);
    return;
  }
  at::parallel_for(first, first + count, kParallelRows, [&](int64_t a, int64_t b) { fn(a, b - a); });
}

// fn(x_rows) -> y_rows [m, N] for x's real rows, scattered into [M, N] (the pads unwritten); fn(x) itself where every
// row is real
template <typename Fn>
at::Tensor on_real_rows(const at::Tensor& x, const c10::optional<at::Tensor>& lens, int64_t N, Fn&& fn) {
  const int64_t M = x.size(0);
  bool all_real;
  auto keep = real_rows(lens, M, all_real);
  if (all_real) return fn(x);
  auto y = empty({M, N}, x.options());
  if (keep.empty()) return y;
  const int64_t n = static_cast<int64_t>(keep.size());
  auto idx = empty({n}, at::TensorOptions().dtype(at::kLong));
  std::memcpy(idx.data_ptr<int64_t>(), keep.data(), n * sizeof(int64_t));
  y.index_copy_(0, idx, fn(x.index_select(0, idx)));
  return y;
}

}  // namespace infer_kernels
