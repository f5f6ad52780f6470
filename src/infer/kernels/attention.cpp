// infer::attention: softmax(q k^T / sqrt(D)) v over the KV cache, for every CPU step: the few query rows of a decode
// or verify step, and a prefill's (a causal mask; ~1/3 of ATen's flash attention's time at 46 tokens, ~2/3 at 330).
//
//   q [B, H, T, D], k and v [B, Hkv, L, D] (any strides, unit stride along D; H a multiple of Hkv: grouped-query
//   heads, query head h reads KV head h / (H / Hkv)), mask [B, 1, T, L] bool (True = attend) or None
//   -> o [B, H, T, D], stored as [B, T, H, D] so that the caller's transpose + reshape to [B, T, H * D] is free.
//   With rows [B, L] (int64): k and v are a paged pool's storage [R, Hkv, D] and row b's key j is storage row
//   rows[b, j] (infer.cache.paged): the blocks are read where they lie instead of gathered into [B, Hkv, L, D] first,
//   with the same arithmetic in the same order (the same bits).
//
// ATen's flash-attention kernel costs ~70 us a call on a decode step's few thousand scores (blocking and thread
// set-up sized for long prefills); this one splits the step's queries over the threads in groups of one KV head's
// queries (up to QB: the G query heads of a token, the K+1 tokens of a verify), which share every K and V load, and
// keeps the weighted sums of values in registers.
//
// Batch invariance: a query attends to the keys before the last one its mask allows, in order; scores, the
// softmax sums and the weighted sum of values are accumulated in the same order whatever L, T or B are. A token's
// attention output is therefore the same alone (decode, L = its position + 1), among K+1 (verify, larger L,
// later keys masked) and as a node of a tree (its siblings' keys masked between its ancestors'). With lens ([B]), a
// row's queries from lens[b] on are pads (rows.h) and get zeros without being computed.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "bf16x16.h"
#include "ops.h"
#include "vec8.h"

namespace {

using namespace infer_kernels;

// Up to QB queries of one KV head go through its keys together: each K and V row is loaded (and widened from
// bfloat16) once for all of them, which is most of the work at head_dim 64. A query's own arithmetic is unchanged by
// its company: its score for a key is an 8-lane fma chain over D in order, a horizontal sum, then the D % 8 tail in
// scalar (on AVX-512 with D a multiple of 16: 16 lanes and hsum16's tree, scores_wide); its output lane d sums
// p_j v_j[d] over the keys it sees in key order.
// 8 where the build targets AVX-512 (32 vector registers hold 8 queries' 2 accumulators each); 4 with AVX2's 16.
#if defined(__AVX512F__)
#define INFER_ATTENTION_QB 8
#else
#define INFER_ATTENTION_QB 4
#endif
constexpr int QB = INFER_ATTENTION_QB;
// K and V rows are fetched PF keys ahead of their use (every cache line of the row): in a step they come cold
// from memory, the ~100 MB of weights streamed since their layer last ran having evicted them. SmolLM2 decode,
// in-process A/B: 12.4 -> 10.9 ms a step at 512 keys, 10.5 -> 9.6 at 256 (AMD EPYC, 2 cores); 16 keys ahead does
// about as well, 8 less
constexpr int64_t PF = 32;

template <typename T>
inline void prefetch_row(const T* p, int64_t D) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < D * int64_t(sizeof(T)); off += 64) prefetch(c + off);
}

// Where key (or value) j of one (batch row, KV head) lies: base + j * stride, or base + idx[j] * stride when the rows
// are a paged pool's (idx: that batch row's storage rows).
template <typename T>
struct Rows {
  const T* base;
  int64_t stride;
  const int64_t* idx;
  inline const T* operator()(int64_t j) const { return base + (idx ? idx[j] : j) * stride; }
};

struct Query {
  const float* q;    // [D] scaled
  float* sc;         // [len] scores, then probabilities
  const bool* mrow;  // nullptr: every key visible
  int64_t len;       // keys 0..len-1 may be visible
  bool dense;        // every key before len visible
};

// fn(std::integral_constant<int, n>) for n in 1..Max (QB by default; any other n: 1): a group's size as a
// compile-time constant, so that its accumulators (arrays indexed by query) live in registers. With the count known
// only at run time they lived on the stack, a store after every fma of the weighted values. AVX2 (AMD EPYC, SmolLM2's
// layer, bfloat16, 2 threads, best of 400 interleaved): at 300 keys a decode's 9 queries 39 -> 31 us, a 9-token
// verify 174 -> 133 us; the same bits.
template <int Max = QB, typename Fn>
inline void with_count(int n, Fn&& fn) {
  if constexpr (Max > 1) {
    if (n == Max) return fn(std::integral_constant<int, Max>{});
    return with_count<Max - 1>(n, fn);
  } else {
    fn(std::integral_constant<int, 1>{});
  }
}

template <int nq, typename T>
inline void scores_n(Query* qs, const Rows<T>& K, int64_t maxlen, int64_t D, int64_t D8) {
  int64_t j = 0;
  for (; j + 2 <= maxlen; j += 2) {  // two keys x nq queries: independent fma chains hide the latency
    const T* k0 = K(j);
    const T* k1 = K(j + 1);
    if (j + PF + 1 < maxlen) {
      prefetch_row(K(j + PF), D);
      prefetch_row(K(j + PF + 1), D);
    }
    V8 a0[nq], a1[nq];
#pragma GCC unroll 8
    for (int i = 0; i < nq; ++i) a0[i] = a1[i] = zero8();
    for (int64_t d = 0; d < D8; d += 8) {
      const V8 x0 = load8(k0 + d), x1 = load8(k1 + d);
#pragma GCC unroll 8
      for (int i = 0; i < nq; ++i) {
        const V8 qd = load8(qs[i].q + d);
        a0[i] = fma8(x0, qd, a0[i]);
        a1[i] = fma8(x1, qd, a1[i]);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < nq; ++i) {
      float s0 = hsum8(a0[i]), s1 = hsum8(a1[i]);
      for (int64_t d = D8; d < D; ++d) {
        s0 += to_float(k0[d]) * qs[i].q[d];
        s1 += to_float(k1[d]) * qs[i].q[d];
      }
      qs[i].sc[j] = s0;
      qs[i].sc[j + 1] = s1;
    }
  }
  for (; j < maxlen; ++j) {
    const T* k0 = K(j);
    V8 a0[nq];
#pragma GCC unroll 8
    for (int i = 0; i < nq; ++i) a0[i] = zero8();
    for (int64_t d = 0; d < D8; d += 8) {
      const V8 x0 = load8(k0 + d);
#pragma GCC unroll 8
      for (int i = 0; i < nq; ++i) a0[i] = fma8(x0, load8(qs[i].q + d), a0[i]);
    }
#pragma GCC unroll 8
    for (int i = 0; i < nq; ++i) {
      float s0 = hsum8(a0[i]);
      for (int64_t d = D8; d < D; ++d) s0 += to_float(k0[d]) * qs[i].q[d];
      qs[i].sc[j] = s0;
    }
  }
}

template <typename T>
inline void scores(Query* qs, int nq, const Rows<T>& K, int64_t maxlen, int64_t D, int64_t D8) {
  with_count(nq, [&](auto n) { scores_n<decltype(n)::value>(qs, K, maxlen, D, D8); });
}

// sum of x[0..n) in Vec::size() lanes (lane l: elements i = l mod lanes, in order), then across the lanes
inline float lane_sum(const float* x, int64_t n) {
  using Vec = at::vec::Vectorized<float>;
  Vec vsum(0.0f);
  for (int64_t j = 0; j < n; j += Vec::size()) {
    const int64_t m = std::min<int64_t>(Vec::size(), n - j);
    vsum = vsum + Vec::set(Vec(0.0f), Vec::loadu(x + j, m), m);  // lanes past the tail add 0
  }
  float lanes[Vec::size()];
  vsum.store(lanes);
  float sum = 0.0f;
  for (int l = 0; l < Vec::size(); ++l) sum += lanes[l];
  return sum;
}

// a query's scores -> probabilities over its own keys (masked ones 0), as softmax in float32. The sum runs over the
// visible keys' values compacted (in `scratch`, >= len floats, when some are masked), so its order is fixed by the
// visible keys alone: a tree node's probabilities equal its path's as a chain, where the same keys are contiguous.
inline void softmax(Query& qy, int64_t mstride, float* scratch) {
  float* sc = qy.sc;
  const int64_t len = qy.len;
  qy.dense = true;
  // a verify's rows see every key up to their own: one memchr finds no masked key (a bool is a byte, false 0)
  // where the scalar scan below cost ~30% of a 9-token verify's attention at 600 keys
  const bool all_visible = qy.mrow && mstride == 1 && std::memchr(qy.mrow, 0, len) == nullptr;
  if (qy.mrow && !all_visible)
    for (int64_t j = 0; j < len; ++j)
      if (!qy.mrow[j * mstride]) {
        sc[j] = -std::numeric_limits<float>::infinity();
        qy.dense = false;
      }
  // max is exact in any order
  using Vec = at::vec::Vectorized<float>;
  Vec vmx(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + Vec::size() <= len; j += Vec::size()) vmx = at::vec::maximum(vmx, Vec::loadu(sc + j));
  float lanes[Vec::size()];
  vmx.store(lanes);
  float mx = *std::max_element(lanes, lanes + Vec::size());
  for (; j < len; ++j) mx = std::max(mx, sc[j]);
  for (j = 0; j < len; j += Vec::size()) {  // elementwise: a value does not depend on its lane or on len
    const int64_t n = std::min<int64_t>(Vec::size(), len - j);
    (Vec::loadu(sc + j, n) - Vec(mx)).exp_u20().store(sc + j, n);
  }
  float sum;
  if (qy.dense) {
    sum = lane_sum(sc, len);
  } else {
    int64_t n = 0;
    for (j = 0; j < len; ++j)
      if (qy.mrow[j * mstride]) scratch[n++] = sc[j];
    sum = lane_sum(scratch, n);
  }
  const Vec inv(1.0f / sum);
  for (j = 0; j < len; j += Vec::size()) {
    const int64_t n = std::min<int64_t>(Vec::size(), len - j);
    (Vec::loadu(sc + j, n) * inv).store(sc + j, n);
  }
}

// keys every query of the group sees (0 unless all are dense) / keys any query of it may see
inline void key_span(const Query* qs, int nq, int64_t& common, int64_t& maxlen) {
  common = qs[0].len, maxlen = 0;
  bool dense = true;
  for (int i = 0; i < nq; ++i) {
    common = std::min(common, qs[i].len);
    maxlen = std::max(maxlen, qs[i].len);
    dense = dense && qs[i].dense;
  }
  if (!dense) common = 0;
}

// o_i = sum_j p_ij v_j for the group, 16 output lanes at a time (2 x nq accumulators in registers)
template <int nq, typename T>
inline void values_n(const Query* qs, const Rows<T>& V, int64_t mstride, int64_t D, int64_t D8,
                     T* const* o) {
  int64_t common, maxlen;
  key_span(qs, nq, common, maxlen);
  for (int64_t d0 = 0; d0 < D8; d0 += 16) {
    const bool two = d0 + 16 <= D8;
    V8 a0[nq], a1[nq];
#pragma GCC unroll 8
    for (int i = 0; i < nq; ++i) a0[i] = a1[i] = zero8();
    int64_t j = 0;
    for (; j < common; ++j) {
      const T* vr = V(j) + d0;
      if (d0 == 0 && j + PF < maxlen) prefetch_row(V(j + PF), D);
      const V8 x0 = load8(vr), x1 = two ? load8(vr + 8) : zero8();
#pragma GCC unroll 8
      for (int i = 0; i < nq; ++i) {
        const V8 p = set8(qs[i].sc[j]);
        a0[i] = fma8(p, x0, a0[i]);
        a1[i] = fma8(p, x1, a1[i]);
      }
    }
    for (; j < maxlen; ++j) {
      const T* vr = V(j) + d0;
      if (d0 == 0 && j + PF < maxlen) prefetch_row(V(j + PF), D);
      const V8 x0 = load8(vr), x1 = two ? load8(vr + 8) : zero8();
#pragma GCC unroll 8
      for (int i = 0; i < nq; ++i) {
        if (j >= qs[i].len || (qs[i].mrow && !qs[i].mrow[j * mstride])) continue;
        const V8 p = set8(qs[i].sc[j]);
        a0[i] = fma8(p, x0, a0[i]);
        a1[i] = fma8(p, x1, a1[i]);
      }
    }
    float tmp[16];
#pragma GCC unroll 8
    for (int i = 0; i < nq; ++i) {
      store8(tmp, a0[i]);
      store8(tmp + 8, a1[i]);
      for (int l = 0; l < (two ? 16 : 8); ++l) o[i][d0 + l] = static_cast<T>(tmp[l]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < nq; ++i)
    for (int64_t d = D8; d < D; ++d) {
      float acc = 0.0f;
      for (int64_t j = 0; j < qs[i].len; ++j)
        if (!qs[i].mrow || qs[i].mrow[j * mstride]) acc += qs[i].sc[j] * to_float(V(j)[d]);
      o[i][d] = static_cast<T>(acc);
    }
}

template <typename T>
inline void weighted_values(const Query* qs, int nq, const Rows<T>& V, int64_t mstride, int64_t D, int64_t D8,
                            T* const* o) {
  with_count(nq, [&](auto n) { values_n<decltype(n)::value>(qs, V, mstride, D, D8, o); });
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
// 16 lanes where the build targets AVX-512 and D is a multiple of 16 (SmolLM2's 64). A score is 16 lane partials (lane
// l: the fma chain over d = l, l + 16, .. in order) summed by hsum16's tree; four keys' trees run as one (reduce4:
// the same additions in the same order, lanes of four keys side by side), so a score does not depend on which keys
// share its block. The weighted values keep weighted_values' arithmetic (values64 only holds more of it in
// registers), so the outputs' bits differ from the 8-lane build's by the scores alone.
constexpr bool kWide = true;

// hsum16's tree for four vectors at once -> lanes 0, 4, 8, 12 of the result are the four sums
inline __m512 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  // lanes l + l+8: 128-bit blocks [x0 + x2, x1 + x3] of each, two vectors a result
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(3, 2, 3, 2)));
  // lanes l + l+4: one 128-bit block a vector
  const __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 w = _mm512_add_ps(s, _mm512_shuffle_ps(s, s, _MM_SHUFFLE(3, 2, 3, 2)));  // l + l+2 (movehl)
  return _mm512_add_ps(w, _mm512_movehdup_ps(w));                                     // l + l+1 (movehdup)
}


// a key row as float32: the row itself, or widened into tmp (once for all the queries of a group)
inline const float* key_row(const float* k, float*, int64_t) { return k; }
inline const float* key_row(const c10::BFloat16* k, float* tmp, int64_t D) {
  for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(tmp + d, load16(k + d));
  return tmp;
}

// scores of NI queries for four keys (rows k[0..3]; bfloat16 ones widened as they are loaded)
template <int NI, typename T>
inline void scores4(Query* qs, const T* const* k, int64_t j, int64_t D) {
  __m512 a[NI][4];
  for (int i = 0; i < NI; ++i)
    for (int u = 0; u < 4; ++u) a[i][u] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 k0 = load16(k[0] + d), k1 = load16(k[1] + d), k2 = load16(k[2] + d), k3 = load16(k[3] + d);
    for (int i = 0; i < NI; ++i) {
      const __m512 qd = _mm512_loadu_ps(qs[i].q + d);
      a[i][0] = _mm512_fmadd_ps(k0, qd, a[i][0]);
      a[i][1] = _mm512_fmadd_ps(k1, qd, a[i][1]);
      a[i][2] = _mm512_fmadd_ps(k2, qd, a[i][2]);
      a[i][3] = _mm512_fmadd_ps(k3, qd, a[i][3]);
    }
  }
  const __m512i lanes = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int i = 0; i < NI; ++i) {
    const __m512 r = reduce4(a[i][0], a[i][1], a[i][2], a[i][3]);
    _mm_storeu_ps(qs[i].sc + j, _mm512_castps512_ps128(_mm512_permutexvar_ps(lanes, r)));
  }
}

template <typename T>
inline void score_group(Query* qs, int n, const T* const* k, int64_t j, int64_t D) {  // up to 6 queries (24 zmm)
  with_count<6>(n, [&](auto c) { scores4<decltype(c)::value>(qs, k, j, D); });
}

template <typename T>
inline void scores_wide(Query* qs, int nq, const Rows<T>& K, int64_t maxlen, int64_t D, float* kbuf) {
  int64_t j = 0;
  for (; j + 4 <= maxlen; j += 4) {
    if (j + PF + 3 < maxlen)
      for (int u = 0; u < 4; ++u) prefetch_row(K(j + PF + u), D);
    if (nq <= 6) {  // one group of queries reads the keys (24 accumulators): widened in registers
      const T* k[4] = {K(j), K(j + 1), K(j + 2), K(j + 3)};
      score_group(qs, nq, k, j, D);
      continue;
    }
    const float* k[4];  // several groups: widened once, into kbuf
    for (int u = 0; u < 4; ++u) k[u] = key_row(K(j + u), kbuf + u * D, D);
    for (int i = 0; i < nq; i += 4) score_group(qs + i, std::min(4, nq - i), k, j, D);  // 16 accumulators
  }
  for (; j < maxlen; ++j) {  // the last keys one at a time: hsum16, the same tree
    const float* k0 = key_row(K(j), kbuf, D);
    for (int i = 0; i < nq; ++i) {
      __m512 a = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(k0 + d), _mm512_loadu_ps(qs[i].q + d), a);
      qs[i].sc[j] = hsum16(a);
    }
  }
}

// weighted_values at D = 64 for up to 6 queries: the four 16-lane blocks of every query in registers, so each V row
// is loaded and widened once and each probability broadcast once. A lane's fma chain over the keys is
// weighted_values' own, so the bits are the same; other shapes go to weighted_values. The group's size is a
// compile-time constant (values64 below dispatches): with it known only at run time, every key tested the count
// before each query's four fmas (perf's hottest lines of the loop, Intel Xeon). With that and the 16-lane rounding
// of the outputs: SmolLM2's attention at 150 keys, 242 -> 222 us a forward at 1 token, 591 -> 532 at 5 (one run
// each, the same bits).
template <int NQ, typename T>
inline void values64_n(const Query* qs, const Rows<T>& V, int64_t mstride, T* const* o) {
  int64_t common, maxlen;
  key_span(qs, NQ, common, maxlen);
  __m512 a[NQ][4];
  for (int i = 0; i < NQ; ++i)
    for (int c = 0; c < 4; ++c) a[i][c] = _mm512_setzero_ps();
  auto key = [&](int64_t j, auto masked) {
    const T* vr = V(j);
    if (j + PF < maxlen) prefetch_row(V(j + PF), 64);
    const __m512 x0 = load16(vr), x1 = load16(vr + 16), x2 = load16(vr + 32), x3 = load16(vr + 48);
#pragma GCC unroll 6
    for (int i = 0; i < NQ; ++i) {
      if constexpr (decltype(masked)::value)
        if (j >= qs[i].len || (qs[i].mrow && !qs[i].mrow[j * mstride])) continue;
      const __m512 p = _mm512_set1_ps(qs[i].sc[j]);
      a[i][0] = _mm512_fmadd_ps(p, x0, a[i][0]);
      a[i][1] = _mm512_fmadd_ps(p, x1, a[i][1]);
      a[i][2] = _mm512_fmadd_ps(p, x2, a[i][2]);
      a[i][3] = _mm512_fmadd_ps(p, x3, a[i][3]);
    }
  };
  int64_t j = 0;
  for (; j < common; ++j) key(j, std::false_type{});  // keys every query of the group sees
  for (; j < maxlen; ++j) key(j, std::true_type{});
  for (int i = 0; i < NQ; ++i) {
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      for (int c = 0; c < 4; ++c) bf16x16_store(o[i] + 16 * c, a[i][c]);  // static_cast's rounding, 16 lanes
    } else {
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(o[i] + 16 * c, a[i][c]);
    }
  }
}

template <typename T>
inline void values64(const Query* qs, int nq, const Rows<T>& V, int64_t mstride, T* const* o) {  // up to 6 queries
  with_count<6>(nq, [&](auto c) { values64_n<decltype(c)::value>(qs, V, mstride, o); });
}

#else
constexpr bool kWide = false;
#endif

// A call's operands as pointers: q [B, H, Tq, D] at strides qst; k, v [B, Hkv, L, D] at strides ks, vs, or with rows
// [B, L] a paged pool's storage [R, Hkv, D] (strides: a storage row, a KV head); out [B, Tq, H, D] contiguous
template <typename T>
struct Operands {
  const T* q;
  std::array<int64_t, 3> qst;
  int64_t B, H, Tq, D;
  const T* k;
  const T* v;
  std::array<int64_t, 3> ks, vs;
  int64_t Hkv;
  T* out;
};

template <typename T>
void attend(const Operands<T>& a, const bool* mask, std::array<int64_t, 3> mstride, const int64_t* rows,
            const int64_t* lens, int64_t L) {
  const int64_t B = a.B, H = a.H, Tq = a.Tq, D = a.D, D8 = D & ~int64_t(7);
  const int64_t Hkv = a.Hkv, G = H / Hkv;
  const T* qp = a.q;
  const T* kp = a.k;
  const T* vp = a.v;
  T* op = a.out;  // [B, T, H, D] contiguous
  const auto &qst = a.qst, &ks = a.ks, &vs = a.vs;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  [[maybe_unused]] const bool wide_d = kWide && D % 16 == 0;
  // groups of at most 6 at D = 64 on the wide path: values64 keeps all of a group's outputs in registers
  const int64_t qb = wide_d && D == 64 ? 6 : QB;
  // The step's queries, (batch row, KV head, query index t * G + g) in that order, split into one contiguous range
  // per thread: a thread walks its range in groups of <= qb that never cross a KV head (a group shares every K and V
  // load), near-equal in size. A query's arithmetic does not depend on its group, so the split changes no bits. Whole
  // KV heads per thread left a thread idle: a decode's 3 heads (SmolLM2's 9 query heads over 3) ran as 2 + 1.
  const int64_t per_head = G * Tq, total = B * Hkv * per_head;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, L * D));
  at::parallel_for(0, total, grain, [&](int64_t x0, int64_t x1) {
    thread_local std::vector<float> buf;
    buf.resize(QB * (D + L) + L + 4 * D);  // + L: the softmax's scratch; + 4 D: four keys widened
    while (x0 < x1) {
      const int64_t head = x0 / per_head, hk = head % Hkv, b = head / Hkv;
      const int64_t end = std::min(x1, (head + 1) * per_head);  // this thread's queries of this KV head
      const int64_t n_groups = (end - x0 + qb - 1) / qb;
      const int64_t first = x0, last = x0 + (end - x0 + n_groups - 1) / n_groups;  // 15 queries -> 5 + 5 + 5
      x0 = last;
      Query qs[QB];
      T* outs[QB];
      int nq = 0;
      int64_t maxlen = 0;
      for (int64_t x = first - head * per_head; x < last - head * per_head; ++x) {
        const int64_t t = x / G, h = hk * G + x % G;
        const bool* mrow = mask ? mask + b * mstride[0] + t * mstride[1] : nullptr;
        T* o = op + ((b * Tq + t) * H + h) * D;
        int64_t len = L;  // keys 0..len-1 are the ones this query may see
        if (lens && t >= lens[b]) len = 0;  // a pad of a shorter row (rows.h): its output is never read
        else if (mrow)
          while (len > 0 && !mrow[(len - 1) * mstride[2]]) --len;
        if (len == 0) {  // a pad, or a query that may see nothing (never built by infer's pools): zeros, not NaN
          std::fill_n(o, D, static_cast<T>(0.0f));
          continue;
        }
        float* qf = buf.data() + nq * (D + L);
        const T* qr = qp + b * qst[0] + h * qst[1] + t * qst[2];
        for (int64_t d = 0; d < D; ++d) qf[d] = static_cast<float>(qr[d]) * scale;
        qs[nq] = Query{qf, qf + D, mrow, len, true};
        outs[nq++] = o;
        maxlen = std::max(maxlen, len);
      }
      if (nq == 0) continue;
      const Rows<T> K = rows ? Rows<T>{kp + hk * ks[1], ks[0], rows + b * L} : Rows<T>{kp + b * ks[0] + hk * ks[1], ks[2], nullptr};
      const Rows<T> V = rows ? Rows<T>{vp + hk * vs[1], vs[0], rows + b * L} : Rows<T>{vp + b * vs[0] + hk * vs[1], vs[2], nullptr};
      for (int64_t j = 0; j < std::min(PF, maxlen); ++j) {  // the loops fetch from key PF on
        prefetch_row(K(j), D);
        prefetch_row(V(j), D);
      }
      // the wide path is chosen by D alone: every call of a model takes the same arithmetic
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
      if (wide_d) scores_wide<T>(qs, nq, K, maxlen, D, buf.data() + QB * (D + L) + L);
      else
#endif
        scores<T>(qs, nq, K, maxlen, D, D8);
      for (int i = 0; i < nq; ++i) softmax(qs[i], mstride[2], buf.data() + QB * (D + L));
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
      if (wide_d && D == 64 && nq <= 6) values64<T>(qs, nq, V, mstride[2], outs);
      else
#endif
        weighted_values<T>(qs, nq, V, mstride[2], D, D8, outs);
    }
  });
}

}  // namespace

// The op's entry, and its kernel over pointers for the other kernels (ops.h: eagle_round.cpp chains those)
namespace infer_kernels {

at::Tensor attention(const at::Tensor& q, const at::Tensor& k_in, const at::Tensor& v_in,
                     const c10::optional<at::Tensor>& mask_in, const c10::optional<at::Tensor>& rows_in,
                     const c10::optional<at::Tensor>& lens_in) {
  const bool paged = rows_in.has_value();
  TORCH_CHECK(q.dim() == 4 && k_in.dim() == (paged ? 3 : 4) && v_in.dim() == k_in.dim(),
              paged ? "infer::attention: 4-d q and 3-d k, v storage [R, Hkv, D] expected with rows"
                    : "infer::attention: 4-d q, k, v expected");
  TORCH_CHECK(q.device().is_cpu(), "infer::attention runs on the CPU");
  TORCH_CHECK(q.scalar_type() == k_in.scalar_type() && q.scalar_type() == v_in.scalar_type(),
              "infer::attention: q, k and v must share a dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "infer::attention: float32 or bfloat16 expected, got ", q.scalar_type());
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), D = q.size(3);
  const int64_t hd = 1, dd = paged ? 2 : 3;  // the KV-head and head-dim dimensions of k and v
  TORCH_CHECK((paged || (k_in.size(0) == B && v_in.size(0) == B && k_in.size(2) == v_in.size(2))) &&
              k_in.size(dd) == D && v_in.size(dd) == D && k_in.size(hd) == v_in.size(hd) && k_in.size(hd) > 0 &&
              H % k_in.size(hd) == 0 && (!paged || k_in.size(0) == v_in.size(0)),
              "infer::attention: shapes do not match: q ", q.sizes(), ", k ", k_in.sizes(), ", v ", v_in.sizes());
  // the kernel reads rows of D along the last dimension
  auto unit = [](const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); };
  auto qq = unit(q), k = unit(k_in), v = unit(v_in);
  at::Tensor rows;
  int64_t L = paged ? 0 : k.size(2);
  if (paged) {
    rows = rows_in->contiguous();
    TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 2 && rows.size(0) == B,
                "infer::attention: rows must be int64 [B, L], got ", rows.sizes(), " ", rows.scalar_type());
    L = rows.size(1);
    const int64_t* r = rows.data_ptr<int64_t>();
    bool inside = true;
    for (int64_t i = 0; i < rows.numel(); ++i) inside &= r[i] >= 0 && r[i] < k.size(0);
    TORCH_CHECK(inside, "infer::attention: rows must index the storage's ", k.size(0), " rows");
  }
  const bool* mask = nullptr;
  std::array<int64_t, 3> ms{0, 0, 0};
  at::Tensor m;
  if (mask_in.has_value()) {
    m = *mask_in;
    TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() == 4 && m.size(1) == 1 &&
                (m.size(0) == B || m.size(0) == 1) && m.size(2) == Tq && m.size(3) == L,
                "infer::attention: mask must be bool [B, 1, T, L], got ", m.sizes(), " ", m.scalar_type());
    mask = m.data_ptr<bool>();
    ms = {m.size(0) == 1 ? 0 : m.stride(0), m.stride(2), m.stride(3)};
  }
  const int64_t* rp = paged ? rows.data_ptr<int64_t>() : nullptr;
  at::Tensor lens;  // [B] real queries a row (the rest pads: zeros), or None
  if (lens_in.has_value() && lens_in->defined()) {
    lens = lens_in->contiguous();
    TORCH_CHECK(lens.scalar_type() == at::kLong && lens.dim() == 1 && lens.size(0) == B && lens.device().is_cpu(),
                "infer::attention: lens must be int64 [B] on the CPU, got ", lens.sizes(), " ", lens.scalar_type());
  }
  const int64_t* lp = lens.defined() ? lens.data_ptr<int64_t>() : nullptr;
  auto out = empty({B, Tq, H, D}, q.options());
  auto strides3 = [](const at::Tensor& t) { return std::array<int64_t, 3>{t.stride(0), t.stride(1), t.stride(2)}; };
  if (q.scalar_type() == at::kFloat)
    attend(Operands<float>{qq.data_ptr<float>(), strides3(qq), B, H, Tq, D, k.data_ptr<float>(), v.data_ptr<float>(),
                           strides3(k), strides3(v), k.size(1), out.data_ptr<float>()}, mask, ms, rp, lp, L);
  else
    attend(Operands<c10::BFloat16>{qq.data_ptr<c10::BFloat16>(), strides3(qq), B, H, Tq, D,
                                   k.data_ptr<c10::BFloat16>(), v.data_ptr<c10::BFloat16>(), strides3(k), strides3(v),
                                   k.size(1), out.data_ptr<c10::BFloat16>()}, mask, ms, rp, lp, L);
  return out.transpose(1, 2);
}

void attention_paged_row(const c10::BFloat16* q, int64_t heads, int64_t head_dim, const c10::BFloat16* k,
                         const c10::BFloat16* v, int64_t kv_heads, const int64_t* rows, int64_t L,
                         c10::BFloat16* out) {
  const int64_t row = kv_heads * head_dim;  // a storage row: [Hkv, D] contiguous
  attend(Operands<c10::BFloat16>{q, {heads * head_dim, head_dim, heads * head_dim}, 1, heads, 1, head_dim, k, v,
                                 {row, head_dim, 0}, {row, head_dim, 0}, kv_heads, out},
         nullptr, {0, 0, 0}, rows, nullptr, L);
}

// n query tokens of one chain q [n, heads, D] (token t at q + t * q_stride) at positions start .. start + n - 1 of a
// paged row, token t attending keys 0 .. start + t (storage rows rows[j]): one call, so a verify's tokens share every
// K and V load (groups of one KV head's queries, as infer::attention's), each token's output the bits it gets alone
// (batch invariance, above). n > 1 masks each token's later keys: the mask the module's verify builds.
void attention_paged_chain(const c10::BFloat16* q, int64_t n, int64_t q_stride, int64_t heads, int64_t head_dim,
                           const c10::BFloat16* k, const c10::BFloat16* v, int64_t kv_heads, const int64_t* rows,
                           int64_t start, c10::BFloat16* out) {
  const int64_t row = kv_heads * head_dim, L = start + n;
  const bool* mask = nullptr;
  if (n > 1) {
    thread_local std::vector<uint8_t> m;  // [n, L] bool: token t sees keys j <= start + t
    m.assign(n * L, 0);
    for (int64_t t = 0; t < n; ++t) std::fill_n(m.data() + t * L, start + t + 1, uint8_t{1});
    mask = reinterpret_cast<const bool*>(m.data());
  }
  attend(Operands<c10::BFloat16>{q, {n * q_stride, head_dim, q_stride}, 1, heads, n, head_dim, k, v,
                                 {row, head_dim, 0}, {row, head_dim, 0}, kv_heads, out},
         mask, {0, L, 1}, rows, nullptr, L);
}

}  // namespace infer_kernels
