// infer::qlinear: y = x @ W.T with W in llama.cpp's blocks (Q8_0, Q4_0, Q4_1) and the activations quantized to int8
// blocks at each call, multiplied with integer dot products (llama.cpp's "vec_dot" of a weight type with Q8_0).
//
// Why: infer::linear widens every weight to float32 and multiplies in float32, so past ~3 activation rows a product
// is compute-bound on 2 cores and a speculative verify of K+1 rows costs ~1.6 decode steps. An integer dot product
// does 32 byte multiply-adds per instruction (AVX512-VNNI vpdpbusd on 256-bit registers, 64 on 512-bit ones where a
// call has several rows; AVX2 vpmaddubsw+vpmaddwd), 4x float32 FMA's 8, and a 4-bit weight is half an int8's bytes.
//
// Numerics, per block of 32 columns (K padded with zero weights to a multiple of 32 where it is not one):
//   Q8_0: w = d * q, q int8      Q4_0: w = d * (q - 8), q in [0, 15]      Q4_1: w = d * q + m, q in [0, 15]
//   Q4_K: super-blocks of 256, w = (d * sc) * q - dmin * mn with 6-bit sc, mn per sub-block of 32, q in [0, 15]
//   (d, m, dmin float16, as the GGUF stores them), and the activations per row and block (Q8_0's scheme):
//   dx = max|x| / 127, qx = round-to-nearest-even(x * (127 / max|x|)) in [-127, 127], sx = sum(qx).
//   y[m, n] = sum over blocks, in order, of (dw * dx) * S  [+ mw * (dx * sx) for Q4_1]
// with S = sum_k w_int * qx exact in int32 (w_int = q, q - 8, q). The rounding is the activations' quantization and
// the float32 sum over blocks, as in llama.cpp.
//
// Layout (quant.py's pack_blocks: the file's values, rows interleaved by 8): for each group of 8 weight rows and each
// block a chunk of [d of the 8 rows: 8 float16][Q4_1: m, 8 float16][quants], the quants so that a 32-byte load holds
// 4 consecutive columns of each of the 8 rows (row r in bytes 4r..4r+3):
//   Q8_0: 8 loads of q + 128 (unsigned) for columns 4j..4j+3, j = 0..7                      (16 + 256 bytes)
//   Q4_0/Q4_1: 4 loads of nibbles, the low halves columns 8j..8j+3, the high 8j+4..8j+7  (16 [+ 16] + 128 bytes)
//   Q4_K: a chunk per super-block of 256: d, dmin, the sub-blocks' scales and minimums as bytes, 8 x Q4_0's nibbles
// so that one vpdpbusd of the weights (unsigned) with 4 activation bytes broadcast (signed) adds 4 products to each of
// 8 rows' sums: the 8 lanes ARE the 8 rows, and the scales apply to 8 rows in one multiply. (The usual layout, a row's
// block in one vector, pays a conversion, a scale and a horizontal sum per row and block; llama.cpp repacks the same
// way for its CPU GEMMs.) The unsigned side's offset comes back as -128 * sx (Q8_0) or -8 * sx (Q4_0) from the start.
// Without VNNI (AVX2): 4-bit weights times qx with vpmaddubsw (2 * 15 * 127 fits int16); Q8_0 with llama.cpp's sign
// trick, |qx| times sign(qx) * q.
//
// Batch invariance: a row's activations are quantized alone; S is exact; the float work for one (row, activation)
// pair is one lane's fma chain over the blocks in order, the same in every tile shape and whatever other rows share
// the call. A row's result is bit-identical alone (decode) or among 16 (verify): decode and verify share one numerics.
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "rows.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// GGML's type ids: the op's format argument
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12;
template <int64_t F>
constexpr int64_t kScaleBytes = F == kQ4_1 ? 32 : 16;  // d (and m) of 8 rows
template <int64_t F>
constexpr int64_t kChunkBytes = kScaleBytes<F> + (F == kQ8_0 ? 256 : 128);  // 8 rows x one block of 32 columns
// Q4_K: a chunk per super-block of 256 columns: d, dmin (8 float16 each), the 8 sub-blocks' 6-bit scales and minimums
// as bytes ([sub-block][row], 64 each), then each sub-block's nibbles as Q4_0's (128 bytes)
constexpr int64_t kQ4KChunk = 32 + 128 + 8 * 128;
template <int64_t F>
inline const uint8_t* chunk_of(const uint8_t* w, int64_t b) {  // the chunk holding block b (of 32 columns)
  return F == kQ4_K ? w + (b >> 3) * kQ4KChunk : w + b * kChunkBytes<F>;
}
template <int64_t F>
inline const uint8_t* quants_of(const uint8_t* chunk, int64_t b) {
  return F == kQ4_K ? chunk + 160 + (b & 7) * 128 : chunk + kScaleBytes<F>;
}
template <int64_t F>
inline int64_t group_bytes_of(int64_t nb) { return F == kQ4_K ? nb / 8 * kQ4KChunk : nb * kChunkBytes<F>; }

inline float f16(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }

// The activations of one call, quantized: per row Kp int8 (zero-padded) and their magnitudes (the AVX2 sign trick),
// per block the scale, the sum of the quants and the two multiplied.
struct QuantX {
  std::vector<int8_t> q;   // [M, Kp]
  std::vector<uint8_t> a;  // [M, Kp] |q|
  std::vector<float> d;    // [M, nb]
  std::vector<int32_t> s;  // [M, nb]
  std::vector<float> ds;   // [M, nb] d * s
};

// One block of 32 (zero-padded by the caller). The vector path and the scalar one give the same bytes: the same float
// product x * (127 / max), rounded to nearest even (vcvtps2dq in the default rounding mode, nearbyintf).
inline void quantize32(const float* x, int8_t* q, uint8_t* a, float* d, int32_t* s) {
#if defined(__AVX2__)
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + 8 * i);
  __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                            _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(mx, 1), _mm256_castps256_ps128(mx));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
  *d = amax / 127.f;
  const __m256 id = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v[0], id)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v[1], id));
  __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v[2], id)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v[3], id));
  // the packs interleave 128-bit lanes: 32-bit groups come out in the order 0 4 1 5 2 6 3 7
  __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
  p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), p);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(a), _mm256_abs_epi8(p));
  const __m256i s32 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), p), _mm256_set1_epi16(1));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
  *s = _mm_cvtsi128_si32(t);
#else
  float amax = 0.f;
  for (int k = 0; k < 32; ++k) amax = std::max(amax, std::fabs(x[k]));
  *d = amax / 127.f;
  const float id = amax > 0.f ? 127.f / amax : 0.f;
  int32_t sum = 0;
  for (int k = 0; k < 32; ++k) {
    const int v = static_cast<int>(std::nearbyintf(x[k] * id));
    q[k] = static_cast<int8_t>(v);
    a[k] = static_cast<uint8_t>(v < 0 ? -v : v);
    sum += v;
  }
  *s = sum;
#endif
}

// x [M, K] float32 or bfloat16 (widened exactly into a block's float32 buffer)
// rows: x's rows to take, in order (nullptr: rows 0..M-1)
template <typename X>
void quantize_rows(const X* x, int64_t M, int64_t K, int64_t nb, QuantX& q, const int64_t* rows = nullptr) {
  const int64_t Kp = nb * 32;
  q.q.resize(M * Kp);
  q.a.resize(M * Kp);
  q.d.resize(M * nb);
  q.s.resize(M * nb);
  q.ds.resize(M * nb);
  // a row at a time, alone: a prefill's many rows are shared out over the threads (rows.h), a step's few stay here
  infer_kernels::rows_in_parallel(0, M, [&](int64_t m0, int64_t count) {
    for (int64_t m = m0; m < m0 + count; ++m)
      for (int64_t b = 0; b < nb; ++b) {
        const X* xb = x + (rows ? rows[m] : m) * K + b * 32;
        const int64_t n = std::min<int64_t>(32, K - b * 32);
        alignas(32) float buf[32];
        const float* src = reinterpret_cast<const float*>(xb);
        if (!std::is_same<X, float>::value || n < 32) {  // zeros beyond K
          for (int64_t k = 0; k < n; ++k) buf[k] = static_cast<float>(xb[k]);
          std::fill(buf + n, buf + 32, 0.f);
          src = buf;
        }
        const int64_t i = m * nb + b;
        quantize32(src, q.q.data() + m * Kp + b * 32, q.a.data() + m * Kp + b * 32, &q.d[i], &q.s[i]);
        q.ds[i] = q.d[i] * static_cast<float>(q.s[i]);
      }
  });
}

// The output: [M, N] float32 or bfloat16 (rounded to nearest even, as torch casts). bf16_in_f32: float32 holding the
// bfloat16 values (the bits of a bfloat16 output's .float(), without its second [M, N] pass: a model's logits)
struct Out {
  void* p;
  bool bf16;
  int64_t N;
  const int64_t* map = nullptr;  // the tiles' row m is the output's row map[m] (pads skipped: rows.h); nullptr: m
  bool bf16_in_f32 = false;
  void store(int64_t m, int64_t n, const float* v, int64_t rows) const {
    if (map) m = map[m];
    if (bf16) {
      c10::BFloat16* y = static_cast<c10::BFloat16*>(p) + m * N + n;
      for (int64_t r = 0; r < rows; ++r) y[r] = c10::BFloat16(v[r]);
    } else if (bf16_in_f32) {
      float* y = static_cast<float*>(p) + m * N + n;
      for (int64_t r = 0; r < rows; ++r) y[r] = static_cast<float>(c10::BFloat16(v[r]));
    } else {
      std::copy(v, v + rows, static_cast<float*>(p) + m * N + n);
    }
  }
};

#if defined(__AVX2__)
using IAcc = __m256i;  // 8 rows' integer sums of one block
using FAcc = __m256;   // 8 rows' float sums
inline FAcc facc_zero() { return _mm256_setzero_ps(); }
// The weights' stream is prefetched into L2 (T1), not L1 (T0): a tile reads its lines once, and T0's requests most
// likely compete with the tile's own loads for L1's few miss slots (no PMU here to count them). With T0 the products
// of a whole SmolLM2 forward took 1.04-1.09x (1 row) and 1.15-1.27x (3-5 rows) the time they take with T1 (AMD EPYC
// Zen 4, in-process alternation, 2026-12-02); both engines decode ~5% faster. The same sums: only when the bytes
// arrive changes.
inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }
inline IAcc start_of(int32_t v) { return _mm256_set1_epi32(v); }
inline __m256i bcast4(const void* p) {  // 4 bytes to every 32-bit lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// u8 (weights, 8 rows x 4 columns) x s8 (4 activation bytes in every lane), summed in fours into the rows' lanes
inline IAcc dot_u8s8(IAcc acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// acc[g][m] += one block's products for G groups of 8 weight rows and MT activation rows. w: group 0's chunk
// quants (group g's gb bytes further); x[m]: each activation row's 32 quants, a[m]: their magnitudes (the AVX2 sign
// trick). The G x MT sums are independent chains, interleaved here so that the integer units' latency is hidden; an
// activation broadcast serves every group.
template <int64_t F, int G, int MT>
inline void block_dots(const uint8_t* w, int64_t gb, const int8_t* const* x, const uint8_t* const* a,
                       IAcc (&acc)[G][MT]) {
  if constexpr (F == kQ8_0) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    (void)a;
    // few chains (decode): a second accumulator for the odd column groups, so that 2 x G x MT chains hide vpdpbusd's
    // latency (integer sums: exact in any order)
    constexpr int S = G * MT <= 4 ? 2 : 1;
    IAcc part[S][G][MT];
    for (int g = 0; g < G; ++g)
      for (int m = 0; m < MT; ++m) {
        part[0][g][m] = acc[g][m];
        if constexpr (S == 2) part[S - 1][g][m] = _mm256_setzero_si256();
      }
    for (int j = 0; j < 8; ++j) {
      __m256i xb[MT];
      for (int m = 0; m < MT; ++m) xb[m] = bcast4(x[m] + 4 * j);
      for (int g = 0; g < G; ++g) {
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * gb + 32 * j));
        for (int m = 0; m < MT; ++m) part[j % S][g][m] = _mm256_dpbusd_epi32(part[j % S][g][m], wv, xb[m]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int m = 0; m < MT; ++m)
        acc[g][m] = S == 2 ? _mm256_add_epi32(part[0][g][m], part[S - 1][g][m]) : part[0][g][m];
#else
    auto step = [&](int j) {
      __m256i xb[MT];
      for (int m = 0; m < MT; ++m) xb[m] = bcast4(x[m] + 4 * j);
      __m256i ab[MT];
      for (int m = 0; m < MT; ++m) ab[m] = bcast4(a[m] + 4 * j);
      for (int g = 0; g < G; ++g) {
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * gb + 32 * j));
        const __m256i ws = _mm256_xor_si256(wv, _mm256_set1_epi8(char(0x80)));  // q + 128 -> q
        for (int m = 0; m < MT; ++m) acc[g][m] = dot_u8s8(acc[g][m], ab[m], _mm256_sign_epi8(ws, xb[m]));
      }
    };
    if constexpr (MT > 1) {
      // several rows (verify, prompt): unrolled by 2, not 8. Fully unrolled, GCC computed all 8 x G x MT products
      // first and spilled them to the stack before summing (integer sums: it may reorder them); the head over
      // 49,152 rows ran 1.04-1.12x faster at 5-64 rows this way (AMD EPYC, 2026-11-29; the same sums, the same bits)
#pragma GCC unroll 2
      for (int j = 0; j < 8; ++j) step(j);
    } else {
      for (int j = 0; j < 8; ++j) step(j);
    }
#endif
  } else {
    (void)a;
    const __m256i low = _mm256_set1_epi8(0x0F);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    for (int j = 0; j < 4; ++j) {
      __m256i xl[MT], xh[MT];
      for (int m = 0; m < MT; ++m) {
        xl[m] = bcast4(x[m] + 8 * j);
        xh[m] = bcast4(x[m] + 8 * j + 4);
      }
      for (int g = 0; g < G; ++g) {
        const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * gb + 32 * j));
        const __m256i lo = _mm256_and_si256(t, low), hi = _mm256_and_si256(_mm256_srli_epi16(t, 4), low);
        for (int m = 0; m < MT; ++m) acc[g][m] = dot_u8s8(dot_u8s8(acc[g][m], lo, xl[m]), hi, xh[m]);
      }
    }
#else
    // AVX2: vpmaddubsw's pair sums (|2 * 15 * 127| = 3810) are added in int16 over the whole block (8 of them:
    // |sum| <= 30480 < 2^15, no overflow, exact), and widened to the rows' int32 lanes once a block: 4 integer ops a
    // 64 weights and activation row instead of 6 (the arithmetic bounds a verify of several rows here)
    __m256i s16[G][MT];
    for (int g = 0; g < G; ++g)
      for (int m = 0; m < MT; ++m) s16[g][m] = _mm256_setzero_si256();
    // the G groups' nibbles unpacked first, then each row's two broadcasts in turn: 2 x G + 2 registers beside the
    // sums, not 2 x MT + 3, so a tile takes 5 rows (2 x 5 sums); unpacking every row's broadcasts first, it took 3
    auto step = [&](int j) {
      __m256i lo[G], hi[G];
      for (int g = 0; g < G; ++g) {
        const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * gb + 32 * j));
        lo[g] = _mm256_and_si256(t, low);
        hi[g] = _mm256_and_si256(_mm256_srli_epi16(t, 4), low);
      }
      for (int m = 0; m < MT; ++m) {
        const __m256i xl = bcast4(x[m] + 8 * j), xh = bcast4(x[m] + 8 * j + 4);
        for (int g = 0; g < G; ++g)
          s16[g][m] = _mm256_add_epi16(s16[g][m], _mm256_add_epi16(_mm256_maddubs_epi16(lo[g], xl),
                                                                   _mm256_maddubs_epi16(hi[g], xh)));
      }
    };
    if constexpr (MT > 1) {
      // several rows (verify): not unrolled. Unrolled, GCC issued all 4 x G x MT x 2 products first and spilled them
      // to the stack (SmolLM2's products at 5 and 9 rows: 1.1-1.2x faster rolled; the same sums)
#pragma GCC unroll 1
      for (int j = 0; j < 4; ++j) step(j);
    } else {
      for (int j = 0; j < 4; ++j) step(j);
    }
    for (int g = 0; g < G; ++g)
      for (int m = 0; m < MT; ++m)
        acc[g][m] = _mm256_add_epi32(acc[g][m], _mm256_madd_epi16(s16[g][m], _mm256_set1_epi16(1)));
#endif
  }
}
inline __m256 load_f16x8(const uint8_t* p) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  alignas(32) float v[8];
  for (int r = 0; r < 8; ++r) { uint16_t h; std::memcpy(&h, p + 2 * r, 2); v[r] = f16(h); }
  return _mm256_load_ps(v);
#endif
}
inline FAcc scale_fma(IAcc S, __m256 dw, float dx, FAcc f) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(S), _mm256_mul_ps(dw, _mm256_set1_ps(dx)), f);
}
inline FAcc min_fma(__m256 mw, float dsx, FAcc f) { return _mm256_fmadd_ps(mw, _mm256_set1_ps(dsx), f); }
inline __m256i load_u8x8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline IAcc mul_rows(IAcc S, __m256i sc) { return _mm256_mullo_epi32(S, sc); }
inline __m256 to_float(__m256i v) { return _mm256_cvtepi32_ps(v); }
inline FAcc min_fnma(__m256 mn, __m256 dmin, float dsx, FAcc f) {  // f - mn * (dmin * dsx)
  return _mm256_fnmadd_ps(mn, _mm256_mul_ps(dmin, _mm256_set1_ps(dsx)), f);
}
inline void store_rows(const Out& y, int64_t m, int64_t n, FAcc f, int64_t rows) {
  alignas(32) float v[8];
  _mm256_store_ps(v, f);
  y.store(m, n, v, rows);
}
#if defined(__AVX512VL__)
constexpr int kDecodeGroups = 1, kVerifyGroups = 2, kMaxActRows = 5;  // 32 registers: 2 x 5 x (int + float) accs
#else
constexpr int kDecodeGroups = 2, kVerifyGroups = 2, kMaxActRows = 2;  // 16 registers
// 4-bit weights take 5 activation rows a tile (2 x 5 int16 sums; the broadcasts one row at a time: block_dots). 3
// rows with every broadcast held were 1.1-1.2x faster than 2 at 5 and 9 rows; 5 rows this way are 1.04-1.11x faster
// than those 3 at 5-64 rows (SmolLM2's Q4_1 products, AMD EPYC, 2026-11-29; the same sums, the same bits)
#define INFER_QLINEAR_Q4_ROWS 5
#endif
#else
// Portable: the same exact integer sums and the same per-lane float chain, in plain C++.
struct IAcc { int32_t v[8]; };
struct FAcc { float v[8]; };
inline FAcc facc_zero() { return FAcc{}; }
inline void prefetch(const void*) {}
inline IAcc start_of(int32_t s) { IAcc a; for (auto& v : a.v) v = s; return a; }
template <int64_t F, int G, int MT>
inline void block_dots(const uint8_t* w0, int64_t gb, const int8_t* const* x, const uint8_t* const*,
                       IAcc (&acc)[G][MT]) {
  for (int g = 0; g < G; ++g) {
    const uint8_t* w = w0 + g * gb;
    for (int m = 0; m < MT; ++m)
      for (int r = 0; r < 8; ++r)
        for (int c = 0; c < 32; ++c) {
          int32_t u;
          if constexpr (F == kQ8_0) u = w[32 * (c / 4) + 4 * r + c % 4];
          else {
            const uint8_t byte = w[32 * (c / 8) + 4 * r + c % 4];
            u = c % 8 < 4 ? byte & 0x0F : byte >> 4;
          }
          acc[g][m].v[r] += u * x[m][c];
        }
  }
}
struct F8 { float v[8]; };
inline F8 load_f16x8(const uint8_t* p) {
  F8 f;
  for (int r = 0; r < 8; ++r) { uint16_t h; std::memcpy(&h, p + 2 * r, 2); f.v[r] = f16(h); }
  return f;
}
inline FAcc scale_fma(IAcc S, F8 dw, float dx, FAcc f) {
  for (int r = 0; r < 8; ++r) f.v[r] = std::fma(static_cast<float>(S.v[r]), dw.v[r] * dx, f.v[r]);
  return f;
}
inline FAcc min_fma(F8 mw, float dsx, FAcc f) {
  for (int r = 0; r < 8; ++r) f.v[r] = std::fma(mw.v[r], dsx, f.v[r]);
  return f;
}
inline IAcc load_u8x8(const uint8_t* p) { IAcc a; for (int r = 0; r < 8; ++r) a.v[r] = p[r]; return a; }
inline IAcc mul_rows(IAcc S, IAcc sc) { for (int r = 0; r < 8; ++r) S.v[r] *= sc.v[r]; return S; }
inline F8 to_float(IAcc v) { F8 f; for (int r = 0; r < 8; ++r) f.v[r] = static_cast<float>(v.v[r]); return f; }
inline FAcc min_fnma(F8 mn, F8 dmin, float dsx, FAcc f) {
  for (int r = 0; r < 8; ++r) f.v[r] = std::fma(-mn.v[r], dmin.v[r] * dsx, f.v[r]);
  return f;
}
inline void store_rows(const Out& y, int64_t m, int64_t n, FAcc f, int64_t rows) { y.store(m, n, f.v, rows); }
constexpr int kDecodeGroups = 1, kVerifyGroups = 1, kMaxActRows = 1;
#endif

constexpr int64_t kPrefetchTiles = 2;  // how many tiles ahead of the current one each thread prefetches
#if defined(__AVX2__) && !(defined(__AVX512VNNI__) && defined(__AVX512VL__))
constexpr bool kSignTrick = true;  // Q8_0 on AVX2: the signed quants themselves, no offset
#else
constexpr bool kSignTrick = false;
#endif
// the unsigned weights' offset (q + 128 for Q8_0, q - 8 read as q for Q4_0): its products, offset * sum(qx), are
// taken off through the start of each block's integer sum
template <int64_t F>
constexpr int32_t kOffset = F == kQ4_0 ? 8 : F == kQ8_0 && !kSignTrick ? 128 : 0;

// y[m0 + m, 8 (g0 + g) + r] for G groups of 8 weight rows (their chunks from w) and MT activation rows.
template <int64_t F, int G, int MT>
inline void tile(const uint8_t* w, int64_t nb, const QuantX& q, int64_t m0, const Out& y, int64_t N, int64_t g0,
                 bool prefetch_ahead) {
  const int64_t group_bytes = group_bytes_of<F>(nb), Kp = nb * 32;
  FAcc f[G][MT];
  for (int g = 0; g < G; ++g)
    for (int m = 0; m < MT; ++m) f[g][m] = facc_zero();
  // the tile's G groups are one contiguous run of memory: prefetch the run kPrefetchTiles tiles ahead, spread evenly
  // over the block loop (first pass over the tile only; prefetches never fault past the end of W)
  const int64_t lines_per_block = (G * group_bytes / 64 + nb - 1) / nb;
  const uint8_t* ahead = w + kPrefetchTiles * G * group_bytes;
  for (int64_t b = 0; b < nb; ++b) {
    if (prefetch_ahead)
      for (int64_t l = 0; l < lines_per_block; ++l) prefetch(ahead + (b * lines_per_block + l) * 64);
    const int8_t* xq[MT];
    const uint8_t* xa[MT];
    for (int m = 0; m < MT; ++m) {
      xq[m] = q.q.data() + (m0 + m) * Kp + b * 32;
      xa[m] = q.a.data() + (m0 + m) * Kp + b * 32;
    }
    IAcc acc[G][MT];
    for (int m = 0; m < MT; ++m) {
      const IAcc start = start_of(-kOffset<F> * q.s[(m0 + m) * nb + b]);
      for (int g = 0; g < G; ++g) acc[g][m] = start;
    }
    const uint8_t* chunk0 = chunk_of<F>(w, b);
    block_dots<F, G, MT>(quants_of<F>(chunk0, b), group_bytes, xq, xa, acc);
    for (int g = 0; g < G; ++g) {
      const uint8_t* chunk = chunk0 + g * group_bytes;
      const auto dw = load_f16x8(chunk);
      if constexpr (F == kQ4_K) {
        // w = d * sc * q - dmin * mn: S * sc exact in int32 (< 32 * 15 * 127 * 63), then as the others; the minimum
        // term -dmin * mn * (dx * sum qx) per sub-block
        const int64_t j = b & 7;
        const auto sc = load_u8x8(chunk + 32 + 8 * j), mn = load_u8x8(chunk + 96 + 8 * j);
        const auto dmin = load_f16x8(chunk + 16);
        for (int m = 0; m < MT; ++m) {
          f[g][m] = scale_fma(mul_rows(acc[g][m], sc), dw, q.d[(m0 + m) * nb + b], f[g][m]);
          f[g][m] = min_fnma(to_float(mn), dmin, q.ds[(m0 + m) * nb + b], f[g][m]);
        }
        continue;
      }
      for (int m = 0; m < MT; ++m) f[g][m] = scale_fma(acc[g][m], dw, q.d[(m0 + m) * nb + b], f[g][m]);
      if constexpr (F == kQ4_1) {
        const auto mw = load_f16x8(chunk + 16);
        for (int m = 0; m < MT; ++m) f[g][m] = min_fma(mw, q.ds[(m0 + m) * nb + b], f[g][m]);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const int64_t n = 8 * (g0 + g), rows = std::min<int64_t>(8, N - n);
    for (int m = 0; m < MT; ++m) store_rows(y, m0 + m, n, f[g][m], rows);
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define INFER_QLINEAR_PAIRS 1
// Two groups of 8 weight rows in one 512-bit register (lanes 0-7: group g, 8-15: group g + 1; the layout stays
// quant.py's, the halves loaded from the two groups' chunks). Why: vpdpbusd on zmm does 64 multiply-adds where ymm
// does 32, at the same instruction rate on this Xeon (a throughput loop: ~310 against ~170 GMAC/s on 2 cores), so
// a verify's or a prompt's products, which the integer units bound, take fewer instructions. Each lane's integer
// sum is exact and its float chain (scale, fma, the minimum's fma, in block order) is the 8-lane path's: the same
// bits, so decode, verify and whatever other rows share a call still agree (batch invariance above).
inline __m512i load_pair(const uint8_t* p, int64_t gb) {  // 32 bytes of group g and the same 32 of group g + 1
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + gb)), 1);
}
inline __m512 load_f16x16(const uint8_t* p, int64_t gb) {  // 8 float16 of each group, widened
  return _mm512_cvtph_ps(_mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + gb)), 1));
}
inline __m512i bcast4x16(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// acc[m] += one block's products for a pair of groups (w: group g's quants, group g + 1's gb bytes further) and MT
// activation rows; S accumulators a row (integer sums: exact in any order). Two up to 6 rows: a verify's 3-5 rows with
// one chain each left vpdpbusd's latency exposed; with two, SmolLM2's 120 Q4_1 body products took 1.03-1.12x less
// time at 3-5 rows (AMD EPYC Zen 4, 2 cores, paired medians of 60 sweeps, 2026-11-30; the same bits). At 7-8 rows
// the extra accumulators do not fit beside the float ones.
template <int64_t F, int MT>
inline void pair_dots(const uint8_t* w, int64_t gb, const int8_t* const* x, __m512i (&acc)[MT]) {
  constexpr int S = MT <= 6 ? 2 : 1;
  __m512i part[S][MT];
  for (int m = 0; m < MT; ++m) {
    part[0][m] = acc[m];
    if constexpr (S == 2) part[S - 1][m] = _mm512_setzero_si512();
  }
  if constexpr (F == kQ8_0) {
    for (int j = 0; j < 8; ++j) {
      const __m512i wv = load_pair(w + 32 * j, gb);
      for (int m = 0; m < MT; ++m) part[j % S][m] = _mm512_dpbusd_epi32(part[j % S][m], wv, bcast4x16(x[m] + 4 * j));
    }
  } else {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int j = 0; j < 4; ++j) {
      const __m512i t = load_pair(w + 32 * j, gb);
      const __m512i lo = _mm512_and_si512(t, low), hi = _mm512_and_si512(_mm512_srli_epi16(t, 4), low);
      for (int m = 0; m < MT; ++m) {
        part[0][m] = _mm512_dpbusd_epi32(part[0][m], lo, bcast4x16(x[m] + 8 * j));
        part[S - 1][m] = _mm512_dpbusd_epi32(part[S - 1][m], hi, bcast4x16(x[m] + 8 * j + 4));
      }
    }
  }
  for (int m = 0; m < MT; ++m) acc[m] = S == 2 ? _mm512_add_epi32(part[0][m], part[S - 1][m]) : part[0][m];
}

// y[m0 + m, 8 g0 + r] for the pair of groups g0, g0 + 1 and MT activation rows: tile<F, 2, MT>'s sums, 16 lanes wide.
template <int64_t F, int MT>
inline void pair_tile(const uint8_t* w, int64_t nb, const QuantX& q, int64_t m0, const Out& y, int64_t N,
                      int64_t g0, bool prefetch_ahead) {
  const int64_t gb = group_bytes_of<F>(nb), Kp = nb * 32;
  __m512 f[MT];
  for (int m = 0; m < MT; ++m) f[m] = _mm512_setzero_ps();
  const int64_t lines_per_block = (2 * gb / 64 + nb - 1) / nb;
  const uint8_t* ahead = w + kPrefetchTiles * 2 * gb;
  for (int64_t b = 0; b < nb; ++b) {
    if (prefetch_ahead)
      for (int64_t l = 0; l < lines_per_block; ++l) prefetch(ahead + (b * lines_per_block + l) * 64);
    const int8_t* xq[MT];
    __m512i acc[MT];
    for (int m = 0; m < MT; ++m) {
      xq[m] = q.q.data() + (m0 + m) * Kp + b * 32;
      acc[m] = _mm512_set1_epi32(-kOffset<F> * q.s[(m0 + m) * nb + b]);
    }
    const uint8_t* chunk = chunk_of<F>(w, b);
    pair_dots<F, MT>(quants_of<F>(chunk, b), gb, xq, acc);
    const __m512 dw = load_f16x16(chunk, gb);
    for (int m = 0; m < MT; ++m)
      f[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m]), _mm512_mul_ps(dw, _mm512_set1_ps(q.d[(m0 + m) * nb + b])),
                             f[m]);
    if constexpr (F == kQ4_1) {
      const __m512 mw = load_f16x16(chunk + 16, gb);
      for (int m = 0; m < MT; ++m) f[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(q.ds[(m0 + m) * nb + b]), f[m]);
    }
  }
  const int64_t n = 8 * g0;
  for (int m = 0; m < MT; ++m) {
    alignas(64) float v[16];
    _mm512_store_ps(v, f[m]);
    y.store(m0 + m, n, v, std::min<int64_t>(8, N - n));
    if (n + 8 < N) y.store(m0 + m, n + 8, v + 8, std::min<int64_t>(8, N - n - 8));
  }
}

constexpr int kPairActRows = 8;  // 8 int + 8 float accumulators, the broadcasts from memory
template <int64_t F, int MT = kPairActRows>
inline void pair_rows(const uint8_t* w, int64_t nb, const QuantX& q, int64_t M, const Out& y, int64_t N, int64_t g0,
                      int64_t m0 = 0) {
  for (; m0 + MT <= M; m0 += MT) pair_tile<F, MT>(w, nb, q, m0, y, N, g0, m0 == 0);
  if constexpr (MT > 1) {
    if (M > m0) pair_rows<F, MT - 1>(w, nb, q, M, y, N, g0, m0);
  }
}
#endif

// G groups from g0 against every activation row: tiles of MT rows, then the rest one tile shape smaller.
#if defined(INFER_QLINEAR_Q4_ROWS)
template <int64_t F>
constexpr int kActRows = F == kQ4_0 || F == kQ4_1 ? INFER_QLINEAR_Q4_ROWS : kMaxActRows;
#else
template <int64_t F>
constexpr int kActRows = kMaxActRows;
#endif

template <int64_t F, int G, int MT = kActRows<F>>
inline void rows_block(const uint8_t* w, int64_t nb, const QuantX& q, int64_t M, const Out& y, int64_t N, int64_t g0,
                       int64_t m0 = 0) {
  for (; m0 + MT <= M; m0 += MT) tile<F, G, MT>(w, nb, q, m0, y, N, g0, m0 == 0);
  if constexpr (MT > 1) {
    if (M > m0) rows_block<F, G, MT - 1>(w, nb, q, M, y, N, g0, m0);
  }
}

#if defined(INFER_QLINEAR_PAIRS)
std::atomic<bool> pairs_on{true};  // infer::qlinear_pairs: off for an A/B in one process (benchmarks/kernel_rows.py)
// groups g0 .. g1 in pairs -> the first group left (out of line, so that run's decode loop compiles as it did
// without the pairs: one row measured the same with them, benchmarks/kernel_rows.py)
template <int64_t F>
__attribute__((noinline)) int64_t pair_groups(const uint8_t* w, int64_t nb, const QuantX& q, int64_t M, const Out& y,
                                              int64_t N, int64_t g0, int64_t g1) {
  const int64_t group_bytes = group_bytes_of<F>(nb);
  int64_t g = g0;
  for (; g + 2 <= g1; g += 2) pair_rows<F>(w + g * group_bytes, nb, q, M, y, N, g);
  return g;
}
#endif

template <int64_t F>
void run(const uint8_t* w, int64_t N, int64_t nb, const QuantX& q, int64_t M, const Out& y) {
  const int64_t groups = (N + 7) / 8, group_bytes = group_bytes_of<F>(nb);
  const int64_t grain = std::max<int64_t>(2, 16384 / std::max<int64_t>(group_bytes, 1));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    int64_t g = g0;
#if defined(INFER_QLINEAR_PAIRS)
    if constexpr (F != kQ4_K) {  // several rows (verify, prompt): pairs of groups; decode's few chains stay 8 wide
      if (M > 1 && pairs_on.load(std::memory_order_relaxed)) g = pair_groups<F>(w, nb, q, M, y, N, g0, g1);
    }
#endif
    if (M == 1) {  // decode: as many groups per tile as keep the memory streams busy
      for (; g + kDecodeGroups <= g1; g += kDecodeGroups)
        rows_block<F, kDecodeGroups>(w + g * group_bytes, nb, q, M, y, N, g);
    } else {
      for (; g + kVerifyGroups <= g1; g += kVerifyGroups)
        rows_block<F, kVerifyGroups>(w + g * group_bytes, nb, q, M, y, N, g);
    }
    for (; g + 2 <= g1; g += 2) rows_block<F, 2>(w + g * group_bytes, nb, q, M, y, N, g);
    for (; g < g1; ++g) rows_block<F, 1>(w + g * group_bytes, nb, q, M, y, N, g);
  });
}

const char* format_name(int64_t f) {
  return f == kQ8_0 ? "Q8_0" : f == kQ4_0 ? "Q4_0" : f == kQ4_1 ? "Q4_1" : f == kQ4_K ? "Q4_K" : nullptr;
}

// Checks that packed holds N rows of K columns in `format`'s blocks -> the blocks (of 32 columns) a row has
int64_t blocks_of(const at::Tensor& packed, int64_t format, int64_t N, int64_t K) {
  TORCH_CHECK(format_name(format) != nullptr, "infer::qlinear: unsupported block type ", format,
              " (GGML type id); supported: Q8_0 (8), Q4_0 (2), Q4_1 (3), Q4_K (12)");
  TORCH_CHECK(packed.device().is_cpu() && packed.dim() == 2 && packed.scalar_type() == at::kByte &&
              packed.is_contiguous(), "infer::qlinear: packed blocks must be contiguous uint8 [N / 8, bytes] on the "
              "CPU, got ", packed.sizes(), " ", packed.scalar_type());
  // bytes per chunk and the columns it covers
  const int64_t cb = format == kQ8_0 ? kChunkBytes<kQ8_0> : format == kQ4_0 ? kChunkBytes<kQ4_0>
                     : format == kQ4_1 ? kChunkBytes<kQ4_1> : kQ4KChunk;
  const int64_t cols = format == kQ4_K ? 256 : 32;
  const int64_t nb = packed.size(1) / cb * (cols / 32);
  TORCH_CHECK(packed.size(1) % cb == 0 && nb * 32 >= K && nb * 32 - K < cols && packed.size(0) == (N + 7) / 8,
              "infer::qlinear: ", format_name(format), " blocks packed as ", packed.sizes(), " do not hold ", N,
              " rows of x's ", K, " columns (", (N + 7) / 8, " groups of 8 rows, ", cb, " bytes per block of ", cols,
              ")");
  return nb;
}

// The product of x's rows (all of them, or those of `map`) into y's rows: quantize, then multiply
template <typename X>
void product(const X* x, int64_t Mr, int64_t K, int64_t nb, const int64_t* map, const uint8_t* wp, int64_t format,
             const Out& out) {
  thread_local QuantX q;  // the calling thread's, reused: a step's ~200 calls allocate nothing after the first
  quantize_rows(x, Mr, K, nb, q, map);
  if (format == kQ8_0) run<kQ8_0>(wp, out.N, nb, q, Mr, out);
  else if (format == kQ4_0) run<kQ4_0>(wp, out.N, nb, q, Mr, out);
  else if (format == kQ4_1) run<kQ4_1>(wp, out.N, nb, q, Mr, out);
  else run<kQ4_K>(wp, out.N, nb, q, Mr, out);
}

}  // namespace

// The op's entry, and its kernel over pointers for the other kernels (ops.h: eagle_round.cpp chains those)
namespace infer_kernels {

// lens: [B] real tokens a row of a padded [B, T] forward (rows.h: the pads skipped, left unwritten); None: every row.
// float_out: y in float32 whatever x's dtype, holding what x's dtype would have held (a bfloat16 x: y.float()'s bits;
// a verify's 5 x 49,152 logits were a 1 MB copy after the product: 0.01-0.55 ms in a round's profile)
at::Tensor qlinear(const at::Tensor& x, const at::Tensor& packed, int64_t format, int64_t out_features,
                      const c10::optional<at::Tensor>& lens, bool float_out) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "infer::qlinear runs on the CPU");
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 2, "infer::qlinear: x [M, K] and packed blocks [N / 8, bytes] "
              "expected, got ", x.sizes(), " and ", packed.sizes());
  TORCH_CHECK(packed.scalar_type() == at::kByte, "infer::qlinear: packed blocks must be uint8, got ",
              packed.scalar_type());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "infer::qlinear: x must be float32 or bfloat16, got ", x.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  auto w = packed.contiguous();
  const int64_t nb = blocks_of(w, format, N, K);
  auto xc = x.contiguous();
  auto y = empty({M, N}, float_out ? x.options().dtype(at::kFloat) : x.options());  // written by the kernel
  // the real rows alone (rows.h): quantized and multiplied as a call of those rows, written to their places
  bool all_real;
  const auto keep = infer_kernels::real_rows(lens, M, all_real);
  const int64_t* map = all_real ? nullptr : keep.data();
  const int64_t Mr = all_real ? M : static_cast<int64_t>(keep.size());
  if (Mr == 0) return y;  // the pads' outputs are left unwritten (rows.h)
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const Out out{y.data_ptr(), bf16 && !float_out, N, map, bf16 && float_out};
  if (bf16) product(xc.data_ptr<c10::BFloat16>(), Mr, K, nb, map, w.data_ptr<uint8_t>(), format, out);
  else product(xc.data_ptr<float>(), Mr, K, nb, map, w.data_ptr<uint8_t>(), format, out);
  return y;
}

void qlinear_into(const c10::BFloat16* x, int64_t M, int64_t K, const at::Tensor& packed, int64_t format, int64_t N,
                  void* y, bool float_out) {
  const int64_t nb = blocks_of(packed, format, N, K);
  product(x, M, K, nb, nullptr, packed.data_ptr<uint8_t>(), format, Out{y, !float_out, N, nullptr, float_out});
}

// One activation row x [K] against the groups of 8 weight rows `groups` [n] of `packed` -> y [n * 8] float32 (group i's
// row r at y[8 i + r]): a product's rows picked out, to rescore a screen's best candidates (eagle_round.cpp). A row's
// result does not depend on the rows beside it in a call (the numerics above), so each is the full product's bits.
void qlinear_groups_into(const c10::BFloat16* x, int64_t K, const at::Tensor& packed, int64_t format, int64_t N,
                         const int64_t* groups, int64_t n, float* y) {
  const int64_t nb = blocks_of(packed, format, N, K), gb = packed.size(1);  // a packed row: a group of 8 rows
  thread_local std::vector<uint8_t> picked;  // the groups' chunks side by side: a packed weight of n * 8 rows
  picked.resize(n * gb);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(groups[i] >= 0 && groups[i] < packed.size(0), "infer::qlinear_groups_into: group ", groups[i],
                " outside the weight's ", packed.size(0));
    std::memcpy(picked.data() + i * gb, wp + groups[i] * gb, gb);
  }
  product(x, 1, K, nb, nullptr, picked.data(), format, Out{y, false, n * 8, nullptr, true});
}

// Whether calls of several rows run the 16-lane pairs (the same bits either way) -> whether this build has them.
bool qlinear_pairs(bool on) {
#if defined(INFER_QLINEAR_PAIRS)
  pairs_on.store(on);
  return true;
#else
  (void)on;
  return false;
#endif
}

}  // namespace infer_kernels
