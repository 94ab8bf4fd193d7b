// Helpers shared by the kernels: AVX2 math (paged_attention.cpp, layer.cpp), the CPU's AVX-512 question, the
// dispatch of a row count to register-blocked loops and the float32 block product they run (cpu.cpp, dense.cpp).
#pragma once
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
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

// Whether to use AVX-512F, asked once: the CPU has it and torch's ATEN_CPU_CAPABILITY does not cap the process
// below it (=avx2 runs torch, inductor and these kernels as on an AVX2-only CPU). A static initializer may run
// before libgcc's own, so the builtin's initialisation is called first.
static inline bool cpu_has_avx512() {
  static const bool yes = [] {
    const char* cap = std::getenv("ATEN_CPU_CAPABILITY");
    const bool capped = cap && (std::strcmp(cap, "avx2") == 0 || std::strcmp(cap, "default") == 0);
    return !capped && (__builtin_cpu_init(), __builtin_cpu_supports("avx512f"));
  }();
  return yes;
}

// run(R, first row) with R = r as a compile-time count (1 <= r <= MR): each count a loop compiled for it.
template <int R, typename F>
static void with_rows(int64_t r, int64_t m, F&& run) {
  if constexpr (R > 1)
    if (r < R) return with_rows<R - 1>(r, m, run);
  run(std::integral_constant<int, R>{}, m);
}

// Every row of x in chunks of at most MR rows (the registers hold MR rows' sums): MR at a time and the rest, or
// with `even` in equal chunks (13 rows as 7 + 6, not 12 + 1: each chunk's arithmetic hides the same reads).
template <int MR, typename F>
static void by_rows(int64_t M, F&& run, bool even = false) {
  const int64_t chunks = (M + MR - 1) / MR;
  for (int64_t c = 0, m = 0; c < chunks; ++c) {
    const int64_t r = even ? M * (c + 1) / chunks - m : std::min<int64_t>(MR, M - m);
    with_rows<MR>(r, m, run);
    m += r;
  }
}

// Rows of W^T ahead of the one being read that a tile asks for (on a Zen 4 at one row, 16 was slower than 32
// and 64 no faster).
static constexpr int64_t TILE_AHEAD = 32;

// Rows of W^T per block for a product of M rows. A block's sums go back to y between blocks, so more rows take
// longer blocks (fewer round trips); a few rows are bound by W's bytes, and short blocks keep its stream in
// order (measured over SmolLM2's layers: docs/decode.md).
static inline int64_t block_rows(int64_t M) { return M <= 24 ? 48 : M <= 32 ? 96 : 192; }

// y[m, 0..31] (+)= sum over k < kb of x[m, k] w[k, 0..31] for MR rows, w's rows at stride ld: the sums stay in
// registers for the block (from zero when first, else from y), one fused multiply-add per product in ascending
// k. So a result does not depend on MR, the block length or the rows beside it, and the 8- and 16-lane
// versions give the same floats. The prefetch asks for the row's columns two chunks ahead into L1 (a block
// reads them next), or in a `tile` (the block is all K rows) for the tile's row TILE_AHEAD rows on and the same
// row of the `next` tile (its first row, or null) into L2: a tile's rows lie apart, so the CPU's prefetchers do
// not follow them, and L1 could not hold the next tile until it is read.
template <int MR>
static void block8(const float* x, int64_t K, int64_t kb, const float* w, int64_t ld, float* y, int64_t ldy,
                   bool first, bool tile = false, const float* next = nullptr) {
  __m256 acc[MR][2];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 2; ++v) acc[m][v] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + m * ldy + 8 * v);
  for (int64_t k = 0; k < kb; ++k) {
    const float* wk = w + k * ld;
    if (tile) {
      if (k + TILE_AHEAD < kb) _mm_prefetch(reinterpret_cast<const char*>(wk + TILE_AHEAD * ld), _MM_HINT_T1);
      if (next) _mm_prefetch(reinterpret_cast<const char*>(next + k * ld), _MM_HINT_T1);
    } else {
      _mm_prefetch(reinterpret_cast<const char*>(wk + 64), _MM_HINT_T0);
    }
    const __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8);
    for (int m = 0; m < MR; ++m) {
      const __m256 b = _mm256_broadcast_ss(x + m * K + k);
      acc[m][0] = _mm256_fmadd_ps(b, w0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(b, w1, acc[m][1]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 2; ++v) _mm256_storeu_ps(y + m * ldy + 8 * v, acc[m][v]);
}

template <int MR>
__attribute__((target("avx512f"))) static void block16(const float* x, int64_t K, int64_t kb, const float* w, int64_t ld,
                                                       float* y, int64_t ldy, bool first, bool tile = false,
                                                       const float* next = nullptr) {
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 2; ++v) acc[m][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + m * ldy + 16 * v);
  for (int64_t k = 0; k < kb; ++k) {
    const float* wk = w + k * ld;
    if (tile) {
      if (k + TILE_AHEAD < kb) {
        _mm_prefetch(reinterpret_cast<const char*>(wk + TILE_AHEAD * ld), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(wk + TILE_AHEAD * ld + 16), _MM_HINT_T1);
      }
      if (next) {
        _mm_prefetch(reinterpret_cast<const char*>(next + k * ld), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(next + k * ld + 16), _MM_HINT_T1);
      }
    } else {
      _mm_prefetch(reinterpret_cast<const char*>(wk + 64), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wk + 80), _MM_HINT_T0);
    }
    const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16);
    for (int m = 0; m < MR; ++m) {
      const __m512 b = _mm512_set1_ps(x[m * K + k]);
      acc[m][0] = _mm512_fmadd_ps(b, w0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(b, w1, acc[m][1]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 2; ++v) _mm512_storeu_ps(y + m * ldy + 16 * v, acc[m][v]);
}

// Every row of x (M, K) times one block of W^T: 32 columns (wide) or 16, kb rows from k0, at stride ld.
static inline void block_all_rows(const float* x, int64_t M, int64_t K, int64_t k0, int64_t kb, const float* w,
                                  int64_t ld, float* y, int64_t ldy, bool wide) {
  if (wide)
    by_rows<8>(M, [&](auto mr, int64_t m) { block16<decltype(mr)::value>(x + m * K + k0, K, kb, w, ld, y + m * ldy, ldy, k0 == 0); });
  else
    by_rows<6>(M, [&](auto mr, int64_t m) { block8<decltype(mr)::value>(x + m * K + k0, K, kb, w, ld, y + m * ldy, ldy, k0 == 0); });
}

// Every row of x (M, K) times one tile of W^T: 32 columns (wide) or 16, all K rows at stride ld, the sums in
// registers from the first row to the last (12 rows of 32 columns, or 6 of 16), in equal chunks of rows; `next`:
// the next tile's first row (asked for into L2), or null.
static inline void tile_all_rows(const float* x, int64_t M, int64_t K, const float* w, int64_t ld, float* y,
                                 int64_t ldy, bool wide, const float* next) {
  const bool even = true, first = true, tile = true;
  if (wide)
    by_rows<12>(M, [&](auto mr, int64_t m) {
      block16<decltype(mr)::value>(x + m * K, K, K, w, ld, y + m * ldy, ldy, first, tile, next);
    }, even);
  else
    by_rows<6>(M, [&](auto mr, int64_t m) {
      block8<decltype(mr)::value>(x + m * K, K, K, w, ld, y + m * ldy, ldy, first, tile, next);
    }, even);
}
