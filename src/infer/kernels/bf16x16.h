// bfloat16 rows 16 lanes at a time where the build targets AVX-512: widen to float32, round back to nearest even.
//
// The elementwise steps of a few-token forward (the residual adds, the norms' outputs, SiLU) were scalar loops or
// 8-lane ones: c10::BFloat16's constructor tests for NaN with a branch, which keeps a loop from vectorising. At a
// verify's 5 rows they cost ~0.25 ms of a SmolLM2 forward (Intel Xeon, 2026-12-04), growing with every row.
// Every operation here is elementwise and rounds as the scalar code does (to nearest, ties to even; a NaN becomes
// the quiet 0x7FC0, as c10's round_to_nearest_even), so a lane, the 8-lane body and the scalar tail agree bit for bit:
// nothing depends on the rows beside a row or on where a vector starts.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define INFER_BF16X16 1
#endif

namespace infer_kernels {

// the scalar rounding, branch-free (the vector bodies' tail)
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t rounded = (u + ((u >> 16) & 1u) + 0x7FFFu) >> 16;
  return static_cast<uint16_t>(f != f ? 0x7FC0u : rounded);
}
inline float bf16_widen(c10::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline c10::BFloat16 bf16_round(float f) {
  c10::BFloat16 out;
  out.x = bf16_bits(f);
  return out;
}

#if defined(INFER_BF16X16)
inline __m512 bf16x16_load(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
// each lane's bfloat16 bits (in the low half of its 32)
inline __m512i bf16x16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7FFF));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}
inline void bf16x16_store(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16x16_bits(v)));
}
// v rounded to bfloat16 and widened back: float(bf16(v))
inline __m512 bf16x16_rounded(__m512 v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16x16_bits(v), 16)); }
#endif

// a[i] = bf16(float(a[i]) + float(b[i])): ATen's bfloat16 add (one rounding of the float32 sum)
inline void bf16_add_into(c10::BFloat16* a, const c10::BFloat16* b, int64_t n) {
  int64_t i = 0;
#if defined(INFER_BF16X16)
  for (; i + 16 <= n; i += 16) bf16x16_store(a + i, _mm512_add_ps(bf16x16_load(a + i), bf16x16_load(b + i)));
#endif
  for (; i < n; ++i) a[i] = bf16_round(bf16_widen(a[i]) + bf16_widen(b[i]));
}

}  // namespace infer_kernels
