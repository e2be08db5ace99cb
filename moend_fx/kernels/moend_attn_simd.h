// SIMD helpers of moend_attn.cpp: fp16/bf16 -> fp32 loads, exp, horizontal sums, code unpacking.
//
// Everything here is `inline` in a header so the compiler sees it at every call site (no call per token).
// Built with -mavx2 -mfma -mf16c where the CPU has them (__AVX2__ defined); the portable definitions below
// the #else are used otherwise.

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace moend {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float dot(const float* __restrict a, const float* __restrict b, int n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float a, const float* __restrict x, float* __restrict y, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) y[i] += a * x[i];
}

inline void scale_row(float* x, int n, float a) {
#pragma omp simd
  for (int i = 0; i < n; ++i) x[i] *= a;
}

// 2^f for f in [0, 1): a degree-6 polynomial (relative error ~1e-7, below fp32 accumulation noise here).
template <typename V>
inline V exp2_frac(V f) {
  V p = V{} + 2.1871262e-04f;
  p = p * f + 1.2382416e-03f;
  p = p * f + 9.6861860e-03f;
  p = p * f + 5.5478912e-02f;
  p = p * f + 2.4023110e-01f;
  p = p * f + 6.9314682e-01f;
  p = p * f + 1.0f;
  return p;
}

// exp(x) for x <= 0 (logit minus the running max): 2^t = 2^floor(t) * 2^frac(t).
inline float exp_nonpos(float x) {
  const float t = std::max(x, -87.0f) * 1.44269504088896341f;
  const float fi = std::floor(t);
  const float p = exp2_frac(t - fi);
  return std::bit_cast<float>(std::bit_cast<int32_t>(p) + (static_cast<int32_t>(fi) << 23));
}

// Scalar widening of a stored element (fp32, fp16, bf16).
template <typename T>
inline float to_f(T x) {
  return static_cast<float>(x);
}

// n stored elements -> fp32 (F16C / shift for bf16 under AVX2).
template <typename T>
inline void to_float(const T* __restrict src, float* __restrict dst, int n);

#ifdef __AVX2__

inline __m256 load8f(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8f(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8f(const at::BFloat16* p) {
  const __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
}

template <typename T>
inline void to_float(const T* __restrict src, float* __restrict dst, int n) {
  int i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8f(src + i));
  for (; i < n; ++i) dst[i] = to_f(src[i]);
}

inline float hsum_ps(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// [sum(v[0]), ..., sum(v[7])]: eight 8-lane int32 vectors reduced at once (7 hadds and one lane swap).
inline __m256i hsum8x8_epi32(const int32_t* v) {
  auto ld = [v](int i) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 8 * i)); };
  __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(ld(0), ld(1)), _mm256_hadd_epi32(ld(2), ld(3)));
  __m256i c = _mm256_hadd_epi32(_mm256_hadd_epi32(ld(4), ld(5)), _mm256_hadd_epi32(ld(6), ld(7)));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, c, 0x20), _mm256_permute2x128_si256(a, c, 0x31));
}

inline __m256 hsum8x8_ps(const float* v) {
  auto ld = [v](int i) { return _mm256_loadu_ps(v + 8 * i); };
  __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(ld(0), ld(1)), _mm256_hadd_ps(ld(2), ld(3)));
  __m256 c = _mm256_hadd_ps(_mm256_hadd_ps(ld(4), ld(5)), _mm256_hadd_ps(ld(6), ld(7)));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, c, 0x20), _mm256_permute2f128_ps(a, c, 0x31));
}

// Software prefetch of the code rows the loops will read next: how many tokens ahead, and the call. Measured
// (docs/kernels.md): the hardware prefetchers leave the K and V code streams ~10-30% short of this, and these
// distances beat half of them by 3-5%; a prefetch never faults, so reading past the layer's end is harmless.
constexpr int kPrefetchK = 128, kPrefetchV = 64;
inline void prefetch_ahead(const uint8_t* p, int bytes) {
  for (int i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 3);
}

// 16 code bytes (or fewer: nb valid, the rest read as 0) as one xmm; nb < 16 only for tiny head_dim.
inline __m128i load_codes16(const uint8_t* p, int nb) {
  if (nb >= 16) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  alignas(16) uint8_t buf[16] = {};
  std::memcpy(buf, p, nb);
  return _mm_load_si128(reinterpret_cast<const __m128i*>(buf));
}

// Plane j of 16 code bytes: the j-th BITS-bit field of every byte, as 16 uint8 (codes stay in registers).
template <int BITS>
inline __m128i code_plane(__m128i x, int j) {
  if constexpr (BITS == 8) {
    return x;
  } else {
    return _mm_and_si128(_mm_srl_epi16(x, _mm_cvtsi32_si128(BITS * j)), _mm_set1_epi8((1 << BITS) - 1));
  }
}

// 16 code bytes -> 8 / BITS vectors of 16 int16 codes, plane j in out[j] (lane i = byte i's j-th field).
template <int BITS>
inline void unpack16_epi16(__m128i x, __m256i* out) {
#pragma GCC unroll 4
  for (int j = 0; j < 8 / BITS; ++j) out[j] = _mm256_cvtepu8_epi16(code_plane<BITS>(x, j));
}

// 8 lanes of x (bytes 8h .. 8h+7 of an xmm) as fp32.
inline __m256 bytes8_to_ps(__m128i x) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(x)); }

// fp32 row -> int16 row, rounded to nearest even (n a multiple of 16).
inline void round_to_i16(const float* x, float mul, int16_t* out, int n) {
  const __m256 m = _mm256_set1_ps(mul);
  for (int i = 0; i < n; i += 16) {
    const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), m));
    const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), m));
    // packs works per 128-bit lane: [a0-3 b0-3 | a4-7 b4-7] -> reorder the 64-bit quarters to a, b.
    const __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), p);
  }
}

#else  // portable

template <typename T>
inline void to_float(const T* __restrict src, float* __restrict dst, int n) {
  for (int i = 0; i < n; ++i) dst[i] = to_f(src[i]);
}

inline void round_to_i16(const float* x, float mul, int16_t* out, int n) {
  for (int i = 0; i < n; ++i) out[i] = static_cast<int16_t>(std::nearbyint(x[i] * mul));
}

#endif

}  // namespace moend
