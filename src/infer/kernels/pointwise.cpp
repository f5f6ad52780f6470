// infer::rope and infer::silu_mul: the elementwise chains of every bfloat16 CPU step (decode, verify, draft, and a
// prefill's many rows, shared out over the threads), one implementation for eager and compiled steps.
//
// Why kernels for a few thousand multiplies: inductor fuses a bfloat16 chain (x*cos + rotate(x)*sin; silu(g) * u)
// into one float32 loop and rounds once at its end, where eager rounds after every op. Compiling with
// emulate_precision_casts made the graphs round like eager, at ~10% of a SmolLM2 step, so only speculating engines
// paid it and plain and speculating engines differed at near-ties. With these chains as opaque ops every few-token
// step is made of infer's kernels (products, attention, norm, these) and single-rounding ops (residual adds,
// copies), so eager, compiled decode and compiled verify give the same bits with inductor's fast defaults.
//
// Math: float32 inside, one rounding to the output dtype at the end:
//   rope:     y[d] = x[d] cos[d] - x[d + D/2] sin[d],  y[d + D/2] = x[d + D/2] cos[d + D/2] + x[d] sin[d + D/2]
//   silu_mul: y = g / (1 + exp(-g)) * u,  exp from exp_f32 below (plain float arithmetic, no libm)
// Every element is computed alone, with FP contraction off (kernels._flags): the AVX2 and AVX-512 builds, a
// vectorised body and a scalar tail all give the same bits, so the result does not depend on the rows beside it.

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "bf16x16.h"
#include "ops.h"
#include "rows.h"

namespace {

// bfloat16 <-> float32 without branches, so the loops vectorise (bf16x16.h: c10::BFloat16's constructor tests for
// NaN with a branch); the same rounding: to nearest, ties to even, NaN kept quiet.
inline float widen(float v) { return v; }
inline float widen(at::BFloat16 v) { return infer_kernels::bf16_widen(v); }
template <typename T>
inline T narrow(float f);
template <>
inline float narrow<float>(float f) { return f; }
template <>
inline at::BFloat16 narrow<at::BFloat16>(float f) { return infer_kernels::bf16_round(f); }

// exp(x) for float32: x = n ln2 + r (ln2 split in two so n ln2 is exact), a degree-6 polynomial for exp(r) on
// |r| <= ln2 / 2 (Cephes' expf coefficients, ~1 ulp), times 2^n built from the exponent bits.
inline float exp_f32(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * (r * r) + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

#if defined(__AVX2__)
// The same arithmetic 8 lanes at a time: every operation below is an IEEE operation of the scalar code's (no FMA,
// floor, truncation of an integral value, the same bit tricks), so a vector lane and the scalar tail agree bit for
// bit.
using V = __m256;
inline V load(const float* p) { return _mm256_loadu_ps(p); }
inline V load(const at::BFloat16* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline void store(float* p, V v) { _mm256_storeu_ps(p, v); }
inline void store(at::BFloat16* p, V v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)),
                                        _mm256_set1_epi32(0x7FFF));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0b1000);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline V exp_v(V x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
  const V n = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                            _mm256_set1_ps(0.5f)));
  V r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
  V p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
  const V y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}
constexpr int64_t kVec = 8;
#if defined(INFER_BF16X16)
// exp_v 16 lanes at a time: the same operations in the same order (the 8-lane body stays for the 8-lane remainder)
using V16 = __m512;
inline V16 load16(const float* p) { return _mm512_loadu_ps(p); }
inline V16 load16(const at::BFloat16* p) { return infer_kernels::bf16x16_load(p); }
inline void store16(float* p, V16 v) { _mm512_storeu_ps(p, v); }
inline void store16(at::BFloat16* p, V16 v) { infer_kernels::bf16x16_store(p, v); }
inline V16 exp_v16(V16 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
  const V16 n = _mm512_floor_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                              _mm512_set1_ps(0.5f)));
  V16 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
  r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
  V16 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
  const V16 y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), r), _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
}
#endif
#else
constexpr int64_t kVec = 0;  // no vector body: the scalar loops do everything
#endif

template <typename T>
void rope_rows(const T* x, int64_t x_stride, const T* cos, const T* sin, T* y, int64_t rows, int64_t heads,
               int64_t D) {
  const int64_t half = D / 2;
  for (int64_t m = 0; m < rows; ++m) {
    const T* c = cos + m * D;
    const T* s = sin + m * D;
    for (int64_t h = 0; h < heads; ++h) {
      const T* xr = x + m * x_stride + h * D;
      T* yr = y + (m * heads + h) * D;
      int64_t d = 0;
#if defined(__AVX2__)
      for (; d + kVec <= half; d += kVec) {
        const V x1 = load(xr + d), x2 = load(xr + d + half);
        store(yr + d, _mm256_sub_ps(_mm256_mul_ps(x1, load(c + d)), _mm256_mul_ps(x2, load(s + d))));
        store(yr + d + half,
              _mm256_add_ps(_mm256_mul_ps(x2, load(c + d + half)), _mm256_mul_ps(x1, load(s + d + half))));
      }
#endif
      for (; d < half; ++d) {
        const float x1 = widen(xr[d]), x2 = widen(xr[d + half]);
        const float a = x1 * widen(c[d]), b = x2 * widen(s[d]);
        const float e = x2 * widen(c[d + half]), f = x1 * widen(s[d + half]);
        yr[d] = narrow<T>(a - b);
        yr[d + half] = narrow<T>(e + f);
      }
    }
  }
}

// columns [c0, c1) of one row: out = silu(g) * u
template <typename T>
inline void silu_mul_span(const T* g, const T* u, T* out, int64_t c0, int64_t c1) {
  int64_t i = c0;
#if defined(INFER_BF16X16)
  for (; i + 16 <= c1; i += 16) {
    const V16 gv = load16(g + i);
    const V16 e = exp_v16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
    store16(out + i, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), e)), load16(u + i)));
  }
#endif
#if defined(__AVX2__)
  for (; i + kVec <= c1; i += kVec) {
    const V gv = load(g + i);
    const V e = exp_v(_mm256_sub_ps(_mm256_setzero_ps(), gv));
    store(out + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.f), e)), load(u + i)));
  }
#endif
  for (; i < c1; ++i) {
    const float gv = widen(g[i]);
    out[i] = narrow<T>(gv / (1.f + exp_f32(-gv)) * widen(u[i]));
  }
}

// ~1.3 ns an element on one thread (an exp and a division each): a verify's 5 rows of SmolLM2's 1536 took ~10 us, so
// from kParallelMin elements the rows are cut into pieces of kPiece columns shared out over the threads; a decode's
// one row (~3.7 us) stays on the calling thread, where a fork/join would cost about what it saves. Every element is
// computed alone (above), so the pieces give the same bits as one loop.
constexpr int64_t kParallelMin = 4096;
constexpr int64_t kPiece = 512;  // a multiple of kVec

template <typename T>
void silu_mul_rows(const T* x, T* y, int64_t rows, int64_t n) {
  const int64_t per_row = rows * n >= kParallelMin ? (n + kPiece - 1) / kPiece : 1;
  const int64_t piece = (n + per_row - 1) / per_row;
  auto run = [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t m = t / per_row, c0 = (t % per_row) * piece;
      const T* g = x + m * 2 * n;
      silu_mul_span(g, g + n, y + m * n, c0, std::min(n, c0 + piece));
    }
  };
  if (per_row == 1) run(0, rows);
  else at::parallel_for(0, rows * per_row, 1, run);
}

void check_dtype(const char* op, const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, "infer::", op,
              ": float32 or bfloat16 only, got ", t.scalar_type());
}

}  // namespace

// The ops' entries, and their kernels over pointers for the other kernels (ops.h: eagle_round.cpp chains those)
namespace infer_kernels {

// x [M, W] (rows may be strided: a view of the fused qkv product), cos/sin [M, D] -> [M, heads * D]: the first
// `heads` heads of each row rotated.
// lens: [B] real rows of a padded [B, T] forward (rows.h): the pads are skipped, their outputs left unwritten
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t head_dim,
                const c10::optional<at::Tensor>& lens) {
  check_dtype("rope", x);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "infer::rope: x must be [rows, width] with unit column stride, got ",
              x.sizes(), " strides ", x.strides());
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0 && heads > 0 && heads * head_dim <= x.size(1),
              "infer::rope: ", heads, " heads of ", head_dim, " do not fit rows of ", x.size(1));
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == x.size(0) && cos.size(1) == head_dim,
              "infer::rope: cos and sin must be [", x.size(0), ", ", head_dim, "], got ", cos.sizes(), " and ",
              sin.sizes());
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "infer::rope: cos/sin dtype must be x's (", x.scalar_type(), ")");
  const auto c = cos.contiguous(), s = sin.contiguous();
  auto y = empty({x.size(0), heads * head_dim}, x.options());
  const int64_t W = heads * head_dim, xs = x.stride(0);
  infer_kernels::for_row_runs(lens, x.size(0), [&](int64_t r, int64_t n) {
    infer_kernels::rows_in_parallel(r, n, [&](int64_t r, int64_t n) {  // a prefill's rows: over the threads
      if (x.scalar_type() == at::kFloat)
        rope_rows(x.data_ptr<float>() + r * xs, xs, c.data_ptr<float>() + r * head_dim,
                  s.data_ptr<float>() + r * head_dim, y.data_ptr<float>() + r * W, n, heads, head_dim);
      else
        rope_rows(x.data_ptr<at::BFloat16>() + r * xs, xs, c.data_ptr<at::BFloat16>() + r * head_dim,
                  s.data_ptr<at::BFloat16>() + r * head_dim, y.data_ptr<at::BFloat16>() + r * W, n, heads, head_dim);
    });
  }, [](int64_t, int64_t) {});
  return y;
}

// x [M, 2n] (gate | up, as the fused gate_up product writes them) -> [M, n]
at::Tensor silu_mul(const at::Tensor& x, const c10::optional<at::Tensor>& lens) {  // lens: as rope's
  check_dtype("silu_mul", x);
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "infer::silu_mul: x must be [rows, 2 * n], got ", x.sizes());
  const auto xc = x.contiguous();
  const int64_t n = xc.size(1) / 2;
  auto y = empty({xc.size(0), n}, xc.options());
  infer_kernels::for_row_runs(lens, xc.size(0), [&](int64_t r, int64_t m) {
    if (xc.scalar_type() == at::kFloat)
      silu_mul_rows(xc.data_ptr<float>() + r * 2 * n, y.data_ptr<float>() + r * n, m, n);
    else
      silu_mul_rows(xc.data_ptr<at::BFloat16>() + r * 2 * n, y.data_ptr<at::BFloat16>() + r * n, m, n);
  }, [](int64_t, int64_t) {});
  return y;
}

void rope_into(const at::BFloat16* x, int64_t x_stride, const at::BFloat16* cos, const at::BFloat16* sin,
               at::BFloat16* y, int64_t rows, int64_t heads, int64_t head_dim) {
  rope_rows(x, x_stride, cos, sin, y, rows, heads, head_dim);
}

void silu_mul_into(const at::BFloat16* x, at::BFloat16* y, int64_t rows, int64_t n) { silu_mul_rows(x, y, rows, n); }

}  // namespace infer_kernels
