// Helpers shared by the kernels: AVX2 math (paged_attention.cpp, layer.cpp), the CPU's AVX-512 question and the
// dispatch of a row count to register-blocked loops (cpu.cpp, dense.cpp).
#pragma once
#include <immintrin.h>
#include <cstdint>
#include <type_traits>

// exp of 8 floats: x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor series to r^7 (relative error
// below 2e-7 there), 2^n written into the exponent bits. Below -87 (e^x under float32's normal range) it
// gives 0, which is also what a score of -inf (a padding lane) must contribute. A NaN stays NaN: min and max
// return their second operand when one is NaN, so x goes second.
static inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f), hi = _mm256_set1_ps(88.0f);
  const __m256 zero_out = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(hi, _mm256_max_ps(lo, x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // ln2 in two parts, so that n * ln2 is subtracted without rounding away r's low bits (Cody & Waite)
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  for (float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(zero_out, _mm256_mul_ps(p, _mm256_castsi256_ps(pow2n)));
}

static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Whether the CPU has AVX-512F, asked once. A static initializer may run before libgcc's own, so the builtin's
// initialisation is called first.
static inline bool cpu_has_avx512() {
  static const bool yes = (__builtin_cpu_init(), __builtin_cpu_supports("avx512f"));
  return yes;
}

// Every row of x: run(rows, first row) for MR rows at a time (the registers hold MR rows' sums), the rest (up to
// 7) by a switch, each count a loop of its own compiled for it.
template <int MR, typename F>
static void by_rows(int64_t M, F&& run) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR) run(std::integral_constant<int, MR>{}, m);
  switch (M - m) {
    case 1: run(std::integral_constant<int, 1>{}, m); break;
    case 2: run(std::integral_constant<int, 2>{}, m); break;
    case 3: run(std::integral_constant<int, 3>{}, m); break;
    case 4: run(std::integral_constant<int, 4>{}, m); break;
    case 5: run(std::integral_constant<int, 5>{}, m); break;
    case 6: run(std::integral_constant<int, 6>{}, m); break;
    case 7: run(std::integral_constant<int, 7>{}, m); break;
  }
}

