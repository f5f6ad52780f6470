// 8-lane float32 arithmetic for infer's CPU kernels: AVX2+FMA intrinsics where the build targets them, the same
// arithmetic in plain C++ elsewhere. Loads widen float32, bfloat16 and int8 to float32.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace infer_kernels {

#if defined(__AVX2__) && defined(__FMA__)
using V8 = __m256;
inline V8 zero8() { return _mm256_setzero_ps(); }
inline V8 fma8(V8 a, V8 b, V8 c) { return _mm256_fmadd_ps(a, b, c); }
inline V8 add8(V8 a, V8 b) { return _mm256_add_ps(a, b); }
inline V8 set8(float a) { return _mm256_set1_ps(a); }
inline V8 load8(const float* p) { return _mm256_loadu_ps(p); }
inline V8 load8(const c10::BFloat16* p) {  // bfloat16 is the top half of a float32
  __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
inline V8 load8(const int8_t* p) {
  __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
}
inline float hsum8(V8 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline void store8(float* p, V8 v) { _mm256_storeu_ps(p, v); }
inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }

// 16 weights as two 8-lane vectors. bfloat16 is the top half of a float32, so one 32-byte load gives the odd
// elements by masking off the low halves and the even ones by shifting them up: lanes [0, 2, .., 14] and
// [1, 3, .., 15]; the activations are permuted to match once per call (permute16).
inline V8 lo16(const float* p) { return load8(p); }
inline V8 hi16(const float* p) { return load8(p + 8); }
inline V8 lo16(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), 16));
}
inline V8 hi16(const c10::BFloat16* p) {
  return _mm256_and_ps(_mm256_loadu_ps(reinterpret_cast<const float*>(p)),
                       _mm256_castsi256_ps(_mm256_set1_epi32(int32_t(0xFFFF0000u))));
}
inline V8 lo16(const int8_t* p) { return load8(p); }
inline V8 hi16(const int8_t* p) { return load8(p + 8); }
template <typename W>
constexpr bool kPermutedLanes = std::is_same<W, c10::BFloat16>::value;
#else  // portable: the same 8-lane arithmetic in plain C++ (the compiler vectorises what it can)
struct V8 { float v[8]; };
inline V8 zero8() { return V8{}; }
inline V8 fma8(V8 a, V8 b, V8 c) { for (int i = 0; i < 8; ++i) c.v[i] += a.v[i] * b.v[i]; return c; }
inline V8 add8(V8 a, V8 b) { for (int i = 0; i < 8; ++i) a.v[i] += b.v[i]; return a; }
inline V8 set8(float a) { V8 r; for (int i = 0; i < 8; ++i) r.v[i] = a; return r; }
template <typename T>
inline V8 load8(const T* p) { V8 r; for (int i = 0; i < 8; ++i) r.v[i] = static_cast<float>(p[i]); return r; }
inline float hsum8(V8 a) {
  float s[4];
  for (int i = 0; i < 4; ++i) s[i] = a.v[i] + a.v[i + 4];
  return (s[0] + s[2]) + (s[1] + s[3]);
}
inline void store8(float* p, V8 a) { for (int i = 0; i < 8; ++i) p[i] = a.v[i]; }
inline void prefetch(const void*) {}
template <typename T>
inline V8 lo16(const T* p) { return load8(p); }
template <typename T>
inline V8 hi16(const T* p) { return load8(p + 8); }
template <typename W>
constexpr bool kPermutedLanes = false;
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
// 16-lane float32 arithmetic for infer::linear where the build targets AVX-512 (kernels/__init__.py's flags).
using V16 = __m512;
inline V16 zero16() { return _mm512_setzero_ps(); }
inline V16 fma16(V16 a, V16 b, V16 c) { return _mm512_fmadd_ps(a, b, c); }
inline V16 load16(const float* p) { return _mm512_loadu_ps(p); }
inline V16 load16(const c10::BFloat16* p) {  // bfloat16 is the top half of a float32
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
inline V16 load16(const int8_t* p) {
  __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v));
}
inline float hsum16(V16 v) {  // a fixed order: the two halves added, then hsum8's
  return hsum8(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}
#endif

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }
inline float to_float(int8_t v) { return static_cast<float>(v); }


// x[0:K16] into lo16/hi16's lane order, per 16-column block: the even columns, then the odd; the tail stays.
inline void permute16(float* x, int64_t K) {
  float block[16];
  for (int64_t k = 0; k + 16 <= K; k += 16) {
    for (int i = 0; i < 8; ++i) block[i] = x[k + 2 * i], block[8 + i] = x[k + 2 * i + 1];
    for (int i = 0; i < 16; ++i) x[k + i] = block[i];
  }
}

}  // namespace infer_kernels
