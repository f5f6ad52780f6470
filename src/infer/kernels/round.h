// What the one-call draft rounds share (eagle_round.cpp, lm_round.cpp): ATen's bfloat16 add, the draw over a draft
// vocabulary's logits, a paged row's storage rows and the temperature's read. Inline: each round's file compiles its
// own copy.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "bf16x16.h"

namespace infer_kernels {
namespace draft_round {

using BF = at::BFloat16;

// a[i] = bf16(float(a[i]) + float(b[i])): ATen's bfloat16 add (bf16x16.h: 16 lanes where the build has AVX-512)
inline void add_into(BF* a, const BF* b, int64_t n) { bf16_add_into(a, b, n); }

// The draw over logits l [N] (float32): q [N] = softmax(l / t) (t = 1 for greedy); -> the column drawn.
// Where the build has AVX-512, the division, the maxima and the sum of q run 16 lanes wide (a draw over SmolLM2's 8,192
// draft columns spent ~30 us a step in scalar loops, the sum a chain of dependent adds). The division and the maxima
// are exact in any order, so x, the first maximum and mx are the scalar loop's; the sum is 16 lanes' partial sums
// added left to right, so q's last bits differ from the scalar order's (as both do from torch.softmax's). The draw
// reads the q returned, so the draft is drawn from exactly the law the call returns, whatever its bits.
inline int64_t draw(const float* l, int64_t N, float t, bool sampled, double u, float* q) {
  using Vec = at::vec::Vectorized<float>;
  const int64_t V = Vec::size();
  // logits / T: a division, as the module's (l / where(sampled, T, 1))
  thread_local std::vector<float> x;
  x.resize(N);
  int64_t best = 0;
  float mx = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#if defined(INFER_BF16X16)
  if (N >= 16 && l[0] == l[0]) {  // (a NaN first logit stays the scalar loop's: it is never displaced there)
    const __m512 vt = _mm512_set1_ps(t);
    __m512 vx = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), vl = vx;
    for (; i + 16 <= N; i += 16) {
      const __m512 lv = _mm512_loadu_ps(l + i), xv = _mm512_div_ps(lv, vt);
      _mm512_storeu_ps(x.data() + i, xv);
      vx = _mm512_max_ps(xv, vx);  // a NaN lane keeps the running maximum, as std::max(mx, NaN) keeps mx
      vl = _mm512_max_ps(lv, vl);
    }
    mx = _mm512_reduce_max_ps(vx);
    float lmax = _mm512_reduce_max_ps(vl);
    for (int64_t j = i; j < N; ++j) {
      x[j] = l[j] / t;
      mx = std::max(mx, x[j]);
      lmax = l[j] > lmax ? l[j] : lmax;
    }
    best = 0;  // the first maximum: the first column equal to the largest logit
    const __m512 target = _mm512_set1_ps(lmax);
    int64_t j = 0;
    for (; j + 16 <= N; j += 16) {
      const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(l + j), target, _CMP_EQ_OQ);
      if (hit) break;
    }
    for (; j < N; ++j)
      if (l[j] == lmax) break;
    best = j < N ? j : 0;
  } else
#endif
  {
    for (; i < N; ++i) {
      x[i] = l[i] / t;
      if (l[i] > l[best]) best = i;  // the first maximum of the logits (greedy's draft)
      mx = std::max(mx, x[i]);
    }
  }
  i = 0;
  float sum = 0.0f;
  for (; i + V <= N; i += V) (Vec::loadu(x.data() + i) - Vec(mx)).exp().store(q + i);
  for (; i < N; ++i) q[i] = std::exp(x[i] - mx);
  i = 0;
#if defined(INFER_BF16X16)
  if (N >= 16) {
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= N; i += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(q + i));
    alignas(64) float part[16];
    _mm512_store_ps(part, acc);
    for (int k = 0; k < 16; ++k) sum += part[k];
  }
#endif
  for (; i < N; ++i) sum += q[i];
  const float inv = 1.0f / sum;
  for (i = 0; i < N; ++i) q[i] *= inv;
  if (!sampled) return best;
  double total = 0.0;
  for (i = 0; i < N; ++i) total += static_cast<double>(q[i]);
  const double target = u * total;
  double c = 0.0;
  for (i = 0; i < N; ++i) {
    c += static_cast<double>(q[i]);
    if (c > target) return i;
  }
  return N - 1;
}

// rows[p] = the storage row of position p = 0 .. last_pos of a paged pool's row: table[p / bs] * bs + p % bs, each
// checked against the storage's `storage` rows
inline void storage_rows(const int64_t* table, int64_t block_size, int64_t last_pos, int64_t storage,
                         std::vector<int64_t>& rows, const char* op) {
  rows.resize(last_pos + 1);
  for (int64_t p = 0; p <= last_pos; ++p) {
    rows[p] = table[p / block_size] * block_size + p % block_size;
    TORCH_CHECK(rows[p] >= 0 && rows[p] < storage, op, ": block table outside the cache");
  }
}

// the temperature read where it lies (a 0-d or 1-element CPU tensor): .item() is a dispatcher call
inline float temperature_of(const at::Tensor& t) {
  const bool direct = t.device().is_cpu() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble);
  return !direct ? t.item<float>()
         : t.scalar_type() == at::kFloat ? *t.data_ptr<float>() : static_cast<float>(*t.data_ptr<double>());
}

}  // namespace draft_round
}  // namespace infer_kernels
