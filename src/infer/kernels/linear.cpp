// infer::linear: y = x @ W.T for a few activation rows (decode: 1 row, verify: K+1 rows), on the CPU.
//
// Decoding streams every weight once per token, so at one activation row this kernel's job is to read W at the
// memory bandwidth; verifying K+1 rows must not read it K+1 times, nor run out of arithmetic:
//   - register tiles of NT weight rows x up to 3 activation rows, one 8-lane accumulator per pair: per 16 weights a
//     tile loads NT weight and MT activation vectors for NT * MT FMAs (4 x 3 in 16 registers);
//   - a tile's rows stay in L1 while every activation row passes over them: W comes from memory once, whatever M;
//   - each thread walks a contiguous run of rows; a tile's rows are one run of memory, prefetched in software two
//     tiles ahead (the hardware prefetchers lose track of several interleaved rows; a single float32 row streams
//     faster on them alone), and decode uses as few rows per tile as keep the FMA latency hidden;
//   - the activations, converted to float32 once (and permuted to the weights' lane order, see vec8.h's lo16), stay
//     in L1; bfloat16 and int8 weights are widened to float32 in registers (int8: y = s[n] * sum_k q[n,k] x[k]).
//
// Batch invariance: the arithmetic for one (row n, activation m) pair is the same whatever M is, whatever the tile
// shape, and whichever other rows share the call (one 8-lane accumulator over k in blocks of 16, lo16 then hi16;
// a fixed horizontal sum; the scalar tail in order; then the scale). A token's logits are therefore bit-identical
// whether the target computes it alone (decode) or among K+1 (speculative verify), which keeps greedy speculation
// exactly equal to greedy decoding.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ops.h"
#include "rows.h"
#include "vec8.h"

namespace {

using namespace infer_kernels;

constexpr int64_t kPrefetchTiles = 2;  // how many tiles ahead of the current one each thread prefetches

// The accumulators: one per (weight row, activation row) pair over k in blocks of 16 columns.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
// AVX-512: one 16-lane accumulator per pair and 32 registers: tiles of up to 4 weight rows x 6 activation rows (24
// accumulators, 6 activation vectors, one weight vector), so a verify of 16 rows widens each int8/bfloat16 weight
// vector 3 times instead of 6 and issues half the FMAs. No lane permutation: a bfloat16 block widens in order.
using Acc = V16;
constexpr bool kWide = true;
constexpr int kMaxActRows = 6;
inline Acc acc_zero() { return zero16(); }
inline float acc_sum(Acc v) { return hsum16(v); }

template <typename W, int NT, int MT>
inline void block16(const W* w, int64_t K, const float* xp, int64_t k, Acc (&acc)[NT][MT]) {
  V16 xv[MT];
  for (int m = 0; m < MT; ++m) xv[m] = load16(xp + m * K + k);
  for (int r = 0; r < NT; ++r) {
    const V16 wv = load16(w + r * K + k);
    for (int m = 0; m < MT; ++m) acc[r][m] = fma16(wv, xv[m], acc[r][m]);
  }
}
#else
// AVX2 (or portable): one 8-lane accumulator per pair and 16 registers: tiles of up to 4 x 3. Each 16-column block
// runs in two halves so that only MT activation vectors are live (xp is in the lane order of lo16/hi16).
using Acc = V8;
constexpr bool kWide = false;
constexpr int kMaxActRows = 3;
inline Acc acc_zero() { return zero8(); }
inline float acc_sum(Acc v) { return hsum8(v); }

template <typename W, int NT, int MT>
inline void block16(const W* w, int64_t K, const float* xp, int64_t k, Acc (&acc)[NT][MT]) {
  V8 xv[MT];
  for (int m = 0; m < MT; ++m) xv[m] = load8(xp + m * K + k);
  for (int r = 0; r < NT; ++r) {
    const V8 wv = lo16(w + r * K + k);
    for (int m = 0; m < MT; ++m) acc[r][m] = fma8(wv, xv[m], acc[r][m]);
  }
  for (int m = 0; m < MT; ++m) xv[m] = load8(xp + m * K + k + 8);
  for (int r = 0; r < NT; ++r) {
    const V8 wv = hi16(w + r * K + k);
    for (int m = 0; m < MT; ++m) acc[r][m] = fma8(wv, xv[m], acc[r][m]);
  }
}
#endif

// One register tile: y[m, r] for NT weight rows r and MT activation rows m. w: NT rows K apart; xp: MT activation
// rows K apart (permuted for block16 where the build needs it; x itself for the scalar tail); y[m * N + r]. The
// arithmetic of one pair is the same in every tile shape (the build's accumulator over the 16-column blocks, a fixed
// horizontal sum, the scalar tail in order, the scale): batch invariant.
template <typename W, int NT, int MT, typename Y>
inline void tile(const W* w, int64_t K, const float* xp, const float* x, const float* scale, Y* y, int64_t N,
                 bool prefetch_ahead) {
  Acc acc[NT][MT];
  for (int r = 0; r < NT; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = acc_zero();
  const int64_t K16 = K & ~int64_t(15);
  // the tile's NT rows are one contiguous run of memory: prefetch the run kPrefetchTiles tiles ahead, spread evenly
  // over the k loop (only on the first pass over the tile; prefetches never fault past the end of W)
  const int64_t tile_bytes = NT * K * int64_t(sizeof(W));
  const int64_t lines_per_step = K16 ? (tile_bytes / 64 + K16 / 16 - 1) / (K16 / 16) : 0;
  const char* ahead = reinterpret_cast<const char*>(w) + kPrefetchTiles * tile_bytes;
  prefetch_ahead = prefetch_ahead && (sizeof(W) < 4 || NT > 1);  // one float32 row: the hardware does better alone
  for (int64_t k = 0; k < K16; k += 16) {
    if (prefetch_ahead)
      for (int64_t l = 0; l < lines_per_step; ++l) prefetch(ahead + ((k / 16) * lines_per_step + l) * 64);
    block16<W, NT, MT>(w, K, xp, k, acc);
  }
  for (int r = 0; r < NT; ++r)
    for (int m = 0; m < MT; ++m) {
      float s = acc_sum(acc[r][m]);
      for (int64_t j = K16; j < K; ++j) s += to_float(w[r * K + j]) * x[m * K + j];
      y[m * N + r] = Y(s * (scale ? scale[r] : 1.0f));  // bfloat16: rounded to nearest even, as torch casts
    }
}

// Every activation row against NT weight rows starting at w: tiles of kMaxActRows activation rows, then the rest.
// (The first tile of the block prefetches ahead: the weights' first pass.)
template <typename W, int NT, int MT = kMaxActRows, typename Y>
inline void row_block(const W* w, int64_t K, const float* xp, const float* x, int64_t M, const float* scale,
                      Y* y, int64_t N, bool first = true) {
  int64_t m = 0;
  for (; m + MT <= M; m += MT) tile<W, NT, MT>(w, K, xp + m * K, x + m * K, scale, y + m * N, N, first && m == 0);
  if constexpr (MT > 1) {
    if (M > m) row_block<W, NT, MT - 1>(w, K, xp + m * K, x + m * K, M - m, scale, y + m * N, N, first && m == 0);
  }
}

// Weight rows per tile: as few as keep the FMA latency hidden (every row is one more interleaved memory stream, and
// the hardware prefetchers lose track of many), as many as the registers hold with 3 (AVX2) or 6 (AVX-512)
// activation rows (4).
// Decode (one activation row) reads W at the memory bandwidth with 1 float32, 2 bfloat16 or 8 int8 rows.
template <typename W>
constexpr int kDecodeRows = sizeof(W) == 4 ? 1 : sizeof(W) == 2 ? 2 : 8;
template <typename W>
constexpr int kVerifyRows = sizeof(W) == 4 ? 2 : 4;

// y[:, n0:n1]: weight rows in tiles of NT, the remainder one by one. A tile stays in L1 while every activation row
// passes over it, so W is read from memory once whatever M is. The arithmetic of one (weight row, activation row)
// pair is the same in every tile shape: batch invariance.
template <typename W, typename Y>
void rows(const W* w, const float* scale, int64_t n0, int64_t n1, int64_t K, const float* xp, const float* x,
          int64_t M, Y* y, int64_t N) {
  int64_t n = n0;
  if (M == 1) {
    constexpr int NT = kDecodeRows<W>;
    for (; n + NT <= n1; n += NT) row_block<W, NT>(w + n * K, K, xp, x, M, scale ? scale + n : nullptr, y + n, N);
  } else {
    constexpr int NT = kVerifyRows<W>;
    for (; n + NT <= n1; n += NT) row_block<W, NT>(w + n * K, K, xp, x, M, scale ? scale + n : nullptr, y + n, N);
  }
  for (; n < n1; ++n) row_block<W, 1>(w + n * K, K, xp, x, M, scale ? scale + n : nullptr, y + n, N);
}

template <typename W, typename Y>
void run(const W* w, const float* scale, int64_t N, int64_t K, const float* x, int64_t M, Y* y) {
  // the activations in lo16/hi16's lane order (a copy of a few KB, read from L1 by every weight row; the buffer is
  // the calling thread's own and reused, so a step's ~200 calls allocate nothing)
  thread_local std::vector<float> permuted;
  const float* xp = x;
  if (!kWide && kPermutedLanes<W>) {
    permuted.assign(x, x + M * K);
    for (int64_t m = 0; m < M; ++m) permute16(permuted.data() + m * K, K);
    xp = permuted.data();
  }
  // at::parallel_for hands each thread one contiguous range of rows (torch's OpenMP pool, torch.set_num_threads)
  const int64_t grain = std::max<int64_t>(16, 32768 / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) { rows(w, scale, n0, n1, K, xp, x, M, y, N); });
}

at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& weight,
                          const c10::optional<at::Tensor>& scale) {
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
  // x as float32 [M, K], a few KB read from L1 for every row of W: bfloat16 widened (exactly) into the calling
  // thread's buffer, and y written in x's dtype by the tiles: no ATen cast or temporary around the kernel
  thread_local std::vector<float> widened;
  auto xc = x.contiguous();
  const float* xf;
  if (xt == at::kFloat) {
    xf = xc.data_ptr<float>();
  } else {
    const c10::BFloat16* xb = xc.data_ptr<c10::BFloat16>();
    widened.resize(M * K);
    for (int64_t i = 0; i < M * K; ++i) widened[i] = static_cast<float>(xb[i]);
    xf = widened.data();
  }
  at::Tensor s;
  if (scale.has_value()) {
    TORCH_CHECK(scale->numel() == N, "infer::linear: scale must have ", N, " entries, got ", scale->numel());
    s = scale->to(at::kFloat).contiguous();
  }
  auto y = empty({M, N}, x.options());
  const float* sp = scale.has_value() ? s.data_ptr<float>() : nullptr;
  auto go = [&](auto* yp) {
    if (wt == at::kFloat) run(w.data_ptr<float>(), sp, N, K, xf, M, yp);
    else if (wt == at::kBFloat16) run(w.data_ptr<c10::BFloat16>(), sp, N, K, xf, M, yp);
    else run(w.data_ptr<int8_t>(), sp, N, K, xf, M, yp);
  };
  if (xt == at::kFloat) go(y.data_ptr<float>());
  else go(y.data_ptr<c10::BFloat16>());
  return y;
}

}  // namespace

// lens: [B] real tokens a row of a padded [B, T] forward (rows.h); None: every row
at::Tensor infer_kernels::linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& scale,
                     const c10::optional<at::Tensor>& lens) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "infer::linear: x [M, K] and weight [N, K] expected, got ", x.sizes(),
              " and ", weight.sizes());
  return infer_kernels::on_real_rows(x, lens, weight.size(0),
                                     [&](const at::Tensor& xs) { return linear_rows(xs, weight, scale); });
}

// The op's kernel over pointers (ops.h): bfloat16 x [M, K] and weight [N, K] (contiguous) -> y [M, N] bfloat16, the
// bits infer::linear writes for them
void infer_kernels::linear_into(const c10::BFloat16* x, int64_t M, int64_t K, const c10::BFloat16* w, int64_t N,
                                c10::BFloat16* y) {
  thread_local std::vector<float> widened;
  widened.resize(M * K);
  for (int64_t i = 0; i < M * K; ++i) widened[i] = static_cast<float>(x[i]);
  run(w, nullptr, N, K, widened.data(), M, y);
}
