// The one register the kernels compute in, for the ISA this build targets: AVX-512 (16 float
// lanes) or AVX2 with FMA (8 lanes).  cacheblend/native/__init__.py picks the ISA from what
// PyTorch reports for the CPU and passes ATen's matching CPU_CAPABILITY macro, so
// at::vec::Vectorized<float> (Vec) has this register's width too.
//
// Why a thin layer of our own over the intrinsics rather than Vec alone: the kernels keep
// register tiles (8 rows x 32 keys of scores) whose shapes depend on how many registers the
// ISA has (32 on AVX-512, 16 on AVX2), and a few steps have no Vec counterpart (a
// transposing reduction of W registers, a gather).  On AVX-512 every function here is the
// intrinsic the kernels called before AVX2 was added, so that build's code is unchanged.
#pragma once
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

namespace simd {

#if defined(CPU_CAPABILITY_AVX512)
using R = __m512;
constexpr int W = 16;      // float lanes
constexpr bool kWide = true;  // 32 registers: tiles of 8 rows
inline R load(const float* p) { return _mm512_loadu_ps(p); }
inline R load(const at::BFloat16* p) {  // W bfloat16 values widened to float32 (exact)
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline void store(float* p, R v) { _mm512_storeu_ps(p, v); }
inline R set1(float x) { return _mm512_set1_ps(x); }
inline R zero() { return _mm512_setzero_ps(); }
inline R mul(R a, R b) { return _mm512_mul_ps(a, b); }
inline R fmadd(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
inline R max(R a, R b) { return _mm512_max_ps(a, b); }
inline float reduce_add(R v) { return _mm512_reduce_add_ps(v); }
inline float reduce_max(R v) { return _mm512_reduce_max_ps(v); }

// r[j] = the sum of the lanes of a[j], j < W: pairs, then 64-bit halves, then 128-bit quarters
inline R reduce_rows(const R* a) {
  __m512 b[8];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  __m512 c[4];
  for (int i = 0; i < 4; ++i) {
    __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xDD));
}

// gather(src, strided(s)): the W floats at src, src + s, ..., src + (W - 1) * s
using I = __m512i;
inline I strided(int64_t stride) {
  return _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                            _mm512_set1_epi32((int)stride));
}
inline R gather(const float* src, I rows) { return _mm512_i32gather_ps(rows, src, 4); }

#elif defined(CPU_CAPABILITY_AVX2)
using R = __m256;
constexpr int W = 8;
constexpr bool kWide = false;  // 16 registers: tiles of 4 rows, or fewer
inline R load(const float* p) { return _mm256_loadu_ps(p); }
inline R load(const at::BFloat16* p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline void store(float* p, R v) { _mm256_storeu_ps(p, v); }
inline R set1(float x) { return _mm256_set1_ps(x); }
inline R zero() { return _mm256_setzero_ps(); }
inline R mul(R a, R b) { return _mm256_mul_ps(a, b); }
inline R fmadd(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
inline R max(R a, R b) { return _mm256_max_ps(a, b); }
inline float reduce_add(R v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
inline float reduce_max(R v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

// r[j] = the sum of the lanes of a[j], j < W: two rounds of pairwise sums within each
// 128-bit half, then the halves added
inline R reduce_rows(const R* a) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

using I = __m256i;
inline I strided(int64_t stride) {
  return _mm256_mullo_epi32(_mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0), _mm256_set1_epi32((int)stride));
}
inline R gather(const float* src, I rows) { return _mm256_i32gather_ps(src, rows, 4); }

#else
#error "cacheblend's kernels need CPU_CAPABILITY_AVX512 or CPU_CAPABILITY_AVX2"
#endif

}  // namespace simd
