// minillm's CPU kernels: weight-only int4 and int8 products in float32, for AVX2 + FMA (the int4 product of a
// few rows also 16 lanes wide where the CPU has AVX-512).
//
// Both read each weight once per call and keep up to 6 rows' sums in registers, so that a decode step
// (1 row) or a speculative verification (k + 1 rows) costs about one pass over the codes. Codes become
// float32 in registers and every sum is float32: the result is the dequantized weight's product within
// float32 rounding (torch's weight-only CPU kernels take bfloat16 activations).
// Threads: at::parallel_for over 32-column tiles, on torch's own OpenMP pool (torch.set_num_threads).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include "simd.h"
#include <algorithm>
#include <vector>

// Every loop streams its codes from DRAM in order; the hardware prefetcher alone leaves a one-row product
// waiting on memory (12.9 ms for SmolLM2's int4 layers against 6.0 ms with this, docs/decode.md), so each
// loop asks for the codes 4 KB ahead of the ones it reads.
constexpr int64_t PREFETCH_BYTES = 4096;
static inline void prefetch_ahead(const void* p) {
  _mm_prefetch(static_cast<const char*>(p) + PREFETCH_BYTES, _MM_HINT_T0);
}

// y = x W_hat^T for 4-bit codes: W_hat[n, k] = s[g, n] * (q[n, k] - z[g, n]), g = k / group_size.
// panels: (N / 32, K, 4) int32; word j of (t, k) holds the codes of columns t*32 + j*8 + i at bits 4i.
// Sum_k x (q - z) is taken per group in registers, then scaled once: y += s * (x . (q - z))_g. The zero point
// leaves each code exactly (small integers), so no term of the sum cancels against another.
template <int MR, int NT>
static void tile(const float* x, int64_t M_ld, int64_t K, const int32_t* w, int j0, const float* s,
                 const float* zp, int64_t G, int64_t gs, int64_t N, int64_t n0,
                 float* y, int64_t ldy) {
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i mask = _mm256_set1_epi32(0xF);
  __m256 out[MR][NT];
  for (int m = 0; m < MR; ++m) for (int j = 0; j < NT; ++j) out[m][j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256 acc[MR][NT], zj[NT];
    for (int m = 0; m < MR; ++m) for (int j = 0; j < NT; ++j) acc[m][j] = _mm256_setzero_ps();
    for (int j = 0; j < NT; ++j) zj[j] = zp ? _mm256_loadu_ps(zp + g * N + n0 + (j0 + j) * 8) : _mm256_setzero_ps();
    for (int64_t k = g * gs; k < (g + 1) * gs; ++k) {
      const int32_t* wk = w + k * 4 + j0;
      if (j0 == 0) prefetch_ahead(wk);
      __m256 q[NT];
      for (int j = 0; j < NT; ++j)
        q[j] = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(wk[j]), shifts),
                                                                 mask)), zj[j]);
      for (int m = 0; m < MR; ++m) {
        __m256 b = _mm256_broadcast_ss(x + m * M_ld + k);
        for (int j = 0; j < NT; ++j) acc[m][j] = _mm256_fmadd_ps(b, q[j], acc[m][j]);
      }
    }
    for (int j = 0; j < NT; ++j) {
      const int64_t n = n0 + (j0 + j) * 8;
      __m256 sj = _mm256_loadu_ps(s + g * N + n);
      for (int m = 0; m < MR; ++m) out[m][j] = _mm256_fmadd_ps(acc[m][j], sj, out[m][j]);
    }
  }
  for (int m = 0; m < MR; ++m) for (int j = 0; j < NT; ++j)
    _mm256_storeu_ps(y + m * ldy + n0 + (j0 + j) * 8, out[m][j]);
}


// Many rows: the tile's weights are dequantized once into a (K, 32) float32 panel (in L2), then every
// row block runs a float32 micro-kernel over it, so decoding costs once per tile, not once per 6 rows.
// The loop of simd.h's block8 (both 16-column halves per row group, the whole K, no prefetch), kept apart:
// block8 over the same panel (the halves in turn, both per row group, the whole tile or blocks of it) took
// 1.3-1.7x as long for 12-191 rows (an AVX-512 CPU forced onto this path, 2026-12-04).
template <int MR>
static void panel_rows(const float* x, int64_t K, const float* wf, float* y, int64_t ldy) {
  for (int h = 0; h < 32; h += 16) {
    __m256 acc[MR][2];
    for (int m = 0; m < MR; ++m) { acc[m][0] = _mm256_setzero_ps(); acc[m][1] = _mm256_setzero_ps(); }
    for (int64_t k = 0; k < K; ++k) {
      __m256 w0 = _mm256_loadu_ps(wf + k * 32 + h), w1 = _mm256_loadu_ps(wf + k * 32 + h + 8);
      for (int m = 0; m < MR; ++m) {
        __m256 b = _mm256_broadcast_ss(x + m * K + k);
        acc[m][0] = _mm256_fmadd_ps(b, w0, acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(b, w1, acc[m][1]);
      }
    }
    for (int m = 0; m < MR; ++m) { _mm256_storeu_ps(y + m * ldy + h, acc[m][0]); _mm256_storeu_ps(y + m * ldy + h + 8, acc[m][1]); }
  }
}

static const bool HAS_AVX512 = cpu_has_avx512();

static void panel_all_rows(const float* x, int64_t M, int64_t K, const float* wf, float* y, int64_t ldy) {
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) panel_rows<6>(x + m * K, K, wf, y + m * ldy, ldy);
  const float* xm = x + m * K; float* ym = y + m * ldy;
  switch (M - m) {
    case 1: panel_rows<1>(xm, K, wf, ym, ldy); break;
    case 2: panel_rows<2>(xm, K, wf, ym, ldy); break;
    case 3: panel_rows<3>(xm, K, wf, ym, ldy); break;
    case 4: panel_rows<4>(xm, K, wf, ym, ldy); break;
    case 5: panel_rows<5>(xm, K, wf, ym, ldy); break;
  }
}

// A tile's product for many rows: decode(k0, kb, out) writes rows k0 .. k0 + kb - 1 of the tile's dequantized
// W_hat^T as (kb, 32) floats; wf holds K * 32. With AVX-512 the tile goes in blocks of block_rows(M) rows that
// stay in L1 while every row of x passes over them (simd.h's block16; the sums go through y between blocks),
// else whole into L2 for the 8-wide panel. Both sum each column over k in ascending order: the same floats.
template <typename Decode>
static void panel_product(const float* x, int64_t M, int64_t K, Decode decode, float* wf, float* y, int64_t ldy) {
  if (!HAS_AVX512) {
    decode(0, K, wf);
    return panel_all_rows(x, M, K, wf, y, ldy);
  }
  for (int64_t k0 = 0, kb = block_rows(M); k0 < K; k0 += kb) {
    const int64_t n = std::min(kb, K - k0);
    decode(k0, n, wf);
    block_all_rows(x, M, K, k0, n, wf, 32, y, ldy, true);
  }
}

// from this many rows on: dequantize chunks of the layer for torch's float32 GEMM, which blocks the rows of x
// too (the panel re-reads all of x for every tile). With AVX-512's blocked panel the crossover sits higher
// (measured in docs/decode.md); an engine step of at most 256 tokens stays on the panel.
static const int64_t GEMM_ROWS = HAS_AVX512 ? 384 : 192;
constexpr int64_t DECODE_ONCE_ROWS = 12;  // from this many rows on a tile is dequantized once (measured: docs/decode.md)

// The same product 16 columns a vector, for CPUs with AVX-512: one 128-bit load gives a k's four code words,
// a permute spreads words 0-1 (columns 0-15) and 2-3 (16-31) over 16 lanes each. The per-group sums stay in
// registers for MR <= 8 rows; y holds the scaled sums between groups (the same products and additions per
// column, in the same order, as the 8-lane tile: both give the same floats).
template <int MR>
__attribute__((target("avx512f"))) static void tile16(const float* x, int64_t K, const int32_t* w, const float* s,
                                                      const float* zp, int64_t G, int64_t gs, int64_t N, int64_t n0,
                                                      float* y, int64_t ldy) {
  const __m512i shifts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
  const __m512i mask = _mm512_set1_epi32(0xF);
  const __m512i lo = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m512i hi = _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  __m512 out[MR][2];
  for (int m = 0; m < MR; ++m) { out[m][0] = _mm512_setzero_ps(); out[m][1] = _mm512_setzero_ps(); }
  for (int64_t g = 0; g < G; ++g) {
    __m512 acc[MR][2];
    for (int m = 0; m < MR; ++m) { acc[m][0] = _mm512_setzero_ps(); acc[m][1] = _mm512_setzero_ps(); }
    const __m512 z0 = zp ? _mm512_loadu_ps(zp + g * N + n0) : _mm512_setzero_ps();
    const __m512 z1 = zp ? _mm512_loadu_ps(zp + g * N + n0 + 16) : _mm512_setzero_ps();
    for (int64_t k = g * gs; k < (g + 1) * gs; ++k) {
      const int32_t* wk = w + k * 4;
      prefetch_ahead(wk);
      const __m512i words = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wk)));
      const __m512 q0 = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_and_si512(
          _mm512_srlv_epi32(_mm512_permutexvar_epi32(lo, words), shifts), mask)), z0);
      const __m512 q1 = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_and_si512(
          _mm512_srlv_epi32(_mm512_permutexvar_epi32(hi, words), shifts), mask)), z1);
      for (int m = 0; m < MR; ++m) {
        const __m512 b = _mm512_set1_ps(x[m * K + k]);
        acc[m][0] = _mm512_fmadd_ps(b, q0, acc[m][0]);
        acc[m][1] = _mm512_fmadd_ps(b, q1, acc[m][1]);
      }
    }
    const __m512 s0 = _mm512_loadu_ps(s + g * N + n0), s1 = _mm512_loadu_ps(s + g * N + n0 + 16);
    for (int m = 0; m < MR; ++m) {
      out[m][0] = _mm512_fmadd_ps(acc[m][0], s0, out[m][0]);
      out[m][1] = _mm512_fmadd_ps(acc[m][1], s1, out[m][1]);
    }
  }
  for (int m = 0; m < MR; ++m) { _mm512_storeu_ps(y + m * ldy + n0, out[m][0]); _mm512_storeu_ps(y + m * ldy + n0 + 16, out[m][1]); }
}

__attribute__((target("avx512f"))) static void rows_tile16(const float* x, int64_t M, int64_t K, const int32_t* w,
    const float* s, const float* zp, int64_t G, int64_t gs, int64_t N, int64_t n0, float* y) {
  by_rows<6>(M, [&](auto mr, int64_t m) { tile16<decltype(mr)::value>(x + m * K, K, w, s, zp, G, gs, N, n0, y + m * N, N); });
}


template <int MR, int NT>
static void run_rows(const float* x, int64_t K, const int32_t* w, const float* s, const float* zp,
                     int64_t G, int64_t gs, int64_t N, int64_t n0, float* y) {
  for (int j0 = 0; j0 < 4; j0 += NT) tile<MR, NT>(x, K, K, w, j0, s, zp, G, gs, N, n0, y, N);
}

static void rows_tile(const float* x, int64_t M, int64_t K, const int32_t* w, const float* s, const float* zp,
                      int64_t G, int64_t gs, int64_t N, int64_t n0, float* y, bool wide) {
  if (wide) return rows_tile16(x, M, K, w, s, zp, G, gs, N, n0, y);
  if (M == 1) return run_rows<1, 4>(x, K, w, s, zp, G, gs, N, n0, y);
  if (M == 2) return run_rows<2, 4>(x, K, w, s, zp, G, gs, N, n0, y);
  if (M == 3) return run_rows<3, 4>(x, K, w, s, zp, G, gs, N, n0, y);
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) run_rows<6, 2>(x + m * K, K, w, s, zp, G, gs, N, n0, y + m * N);
  const float* xm = x + m * K; float* ym = y + m * N;
  switch (M - m) {
    case 1: run_rows<1, 4>(xm, K, w, s, zp, G, gs, N, n0, ym); break;
    case 2: run_rows<2, 4>(xm, K, w, s, zp, G, gs, N, n0, ym); break;
    case 3: run_rows<3, 4>(xm, K, w, s, zp, G, gs, N, n0, ym); break;
    case 4: run_rows<4, 2>(xm, K, w, s, zp, G, gs, N, n0, ym); break;
    case 5: run_rows<5, 2>(xm, K, w, s, zp, G, gs, N, n0, ym); break;
  }
}


// Tile t's dequantized weights W_hat^T[k, 32 t .. 32 t + 31] for k0 <= k < k0 + kb, as float32 rows of 32 at
// stride ld: W_hat = s (q - z), the reference's float32 values (q - z is exact).
static void decode_tile(const int32_t* wp, const float* sp, const float* zp, int64_t K, int64_t N, int64_t group_size,
                        int64_t t, int64_t k0, int64_t kb, float* out, int64_t ld) {
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), mask = _mm256_set1_epi32(0xF);
  out -= k0 * ld;  // row k of the tile goes to out + (k - k0) ld
  for (int64_t k = k0; k < k0 + kb; ++k) {
    const int64_t g = k / group_size;
    prefetch_ahead(wp + (t * K + k) * 4);
    for (int j = 0; j < 4; ++j) {
      const int64_t n = t * 32 + j * 8;
      __m256 q = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(wp[(t * K + k) * 4 + j]), shifts), mask));
      __m256 z = zp ? _mm256_loadu_ps(zp + g * N + n) : _mm256_setzero_ps();
      _mm256_storeu_ps(out + k * ld + j * 8, _mm256_mul_ps(_mm256_loadu_ps(sp + g * N + n), _mm256_sub_ps(q, z)));
    }
  }
}


// Many rows: dequantize CHUNK_TILES tiles at a time into a float32 buffer that stays in cache, and multiply
// it with torch's blocked float32 GEMM; decode(t, out, ld) writes tile t's (K, 32) weights at stride ld.
// 16 tiles (512 columns): fewer, larger GEMMs than 8 (the 120 block layers at 128 rows 117 -> 102 ms, at 256 rows
// 185 -> 176 ms; 32 tiles no faster), a buffer of 1.2-3 MB.
template <typename Decode>
static torch::Tensor chunked_gemm(const torch::Tensor& x, int64_t T, Decode decode) {
  constexpr int64_t CHUNK_TILES = 16;
  const int64_t K = x.size(1);
  auto y = torch::empty({x.size(0), T * 32}, x.options());
  thread_local std::vector<float> buf;
  buf.resize(K * CHUNK_TILES * 32);
  for (int64_t t0 = 0; t0 < T; t0 += CHUNK_TILES) {
    const int64_t nt = std::min(CHUNK_TILES, T - t0), nc = nt * 32;
    float* b = buf.data();
    at::parallel_for(t0, t0 + nt, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) decode(t, b + (t - t0) * 32, nc);
    });
    y.narrow(1, t0 * 32, nc).copy_(at::mm(x, torch::from_blob(b, {K, nc}, x.options())));
  }
  return y;
}

// lanes: 16 (AVX-512), 8 (AVX2) or 0 (the widest this CPU has) for products of fewer than DECODE_ONCE_ROWS rows;
// both give the same floats.
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor panels, torch::Tensor s, c10::optional<torch::Tensor> z_opt,
                          int64_t group_size, int64_t lanes) {
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 3 && panels.size(2) == 4, "x (M, K), panels (N/32, K, 4)");
  // checked before K / group_size: a zero group size would stop the process (integer division by zero)
  TORCH_CHECK(group_size > 0, "int4_linear: group_size must be positive, got ", group_size);
  TORCH_CHECK(lanes == 0 || lanes == 8 || (lanes == 16 && HAS_AVX512), "int4_linear: lanes must be 0, 8 or 16 (16 needs "
              "AVX-512), got ", lanes);
  const bool wide = lanes == 16 || (lanes == 0 && HAS_AVX512);
  // the loops read the tensors' memory directly: a tensor on another device would be read as host memory
  TORCH_CHECK(x.device().is_cpu() && panels.device().is_cpu() && s.device().is_cpu()
              && (!z_opt.has_value() || z_opt->device().is_cpu()), "int4_linear: tensors on the CPU");
  const int64_t M = x.size(0), K = x.size(1), T = panels.size(0), N = T * 32, G = K / group_size;
  TORCH_CHECK(panels.size(1) == K && K % group_size == 0 && s.size(0) == G && s.size(1) == N, "int4_linear: shapes");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && panels.scalar_type() == torch::kInt && s.scalar_type() == torch::kFloat
              && panels.is_contiguous() && s.is_contiguous(), "int4_linear: float32 x, int32 panels, contiguous float32 scales");
  TORCH_CHECK(!z_opt.has_value() || (z_opt->scalar_type() == torch::kFloat && z_opt->is_contiguous()
              && z_opt->sizes() == s.sizes()), "int4_linear: zero points like scales");
  x = x.contiguous();
  const int32_t* wp = panels.data_ptr<int32_t>();
  const float* sp = s.data_ptr<float>(); const float* zp = z_opt.has_value() ? z_opt->data_ptr<float>() : nullptr;
  if (M >= GEMM_ROWS)
    return chunked_gemm(x, T, [&](int64_t t, float* out, int64_t ld) { decode_tile(wp, sp, zp, K, N, group_size, t, 0, K, out, ld); });
  auto y = torch::empty({M, N}, x.options());
  if (K == 0) return y.zero_();  // no products: the loops below would write nothing
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> wf(M >= DECODE_ONCE_ROWS ? K * 32 : 0);
    for (int64_t t = begin; t < end; ++t) {
      if (M < DECODE_ONCE_ROWS) {
        rows_tile(xp, M, K, wp + t * K * 4, sp, zp, G, group_size, N, t * 32, yp, wide);
        continue;
      }
      panel_product(xp, M, K, [&](int64_t k0, int64_t kb, float* out) { decode_tile(wp, sp, zp, K, N, group_size, t, k0, kb, out, 32); },
                    wf.data(), yp + t * 32, N);
    }
  });
  return y;
}


// y = x W_hat^T for 8-bit codes per output channel: W_hat[n, k] = s[n] * q[n, k] + off[n].
// panels: (N / 32, K, 32) int8, the 32 columns of tile t side by side for each k.
template <int MR, int NT>
static void tile8(const float* x, int64_t K, const int8_t* w, int j0, float* out_rows, int64_t ldy, int64_t n0) {
  __m256 acc[MR][NT];
  for (int m = 0; m < MR; ++m) for (int j = 0; j < NT; ++j) acc[m][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const int8_t* wk = w + k * 32 + j0 * 8;
    if (j0 == 0) prefetch_ahead(wk);
    __m256 q[NT];
    for (int j = 0; j < NT; ++j)
      q[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wk + j * 8))));
    for (int m = 0; m < MR; ++m) {
      __m256 b = _mm256_broadcast_ss(x + m * K + k);
      for (int j = 0; j < NT; ++j) acc[m][j] = _mm256_fmadd_ps(b, q[j], acc[m][j]);
    }
  }
  for (int m = 0; m < MR; ++m) for (int j = 0; j < NT; ++j)
    _mm256_storeu_ps(out_rows + m * ldy + n0 + (j0 + j) * 8, acc[m][j]);
}

template <int MR, int NT>
static void run8(const float* x, int64_t K, const int8_t* w, float* y, int64_t N, int64_t n0) {
  for (int j0 = 0; j0 < 4; j0 += NT) tile8<MR, NT>(x, K, w, j0, y, N, n0);
}

static void rows_tile8(const float* x, int64_t M, int64_t K, const int8_t* w, float* y, int64_t N, int64_t n0) {
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) run8<6, 2>(x + m * K, K, w, y + m * N, N, n0);
  const float* xm = x + m * K; float* ym = y + m * N;
  switch (M - m) {
    case 1: run8<1, 4>(xm, K, w, ym, N, n0); break;
    case 2: run8<2, 4>(xm, K, w, ym, N, n0); break;
    case 3: run8<3, 4>(xm, K, w, ym, N, n0); break;
    case 4: run8<4, 2>(xm, K, w, ym, N, n0); break;
    case 5: run8<5, 2>(xm, K, w, ym, N, n0); break;
  }
}

// Rows k0 .. k0 + kb - 1 of tile t's int8 codes as float32 rows of 32 at stride ld (the scale and offset are applied to the product).
static void decode_tile8(const int8_t* wp, int64_t t, int64_t K, int64_t k0, int64_t kb, float* out, int64_t ld) {
  out -= k0 * ld;
  for (int64_t k = k0; k < k0 + kb; ++k) {
    prefetch_ahead(wp + (t * K + k) * 32);
    for (int j = 0; j < 32; j += 8)
      _mm256_storeu_ps(out + k * ld + j, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(wp + (t * K + k) * 32 + j)))));
  }
}

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor panels, torch::Tensor s, c10::optional<torch::Tensor> off) {
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 3 && panels.size(2) == 32, "x (M, K), panels (N/32, K, 32)");
  const int64_t M = x.size(0), K = x.size(1), T = panels.size(0), N = T * 32;
  TORCH_CHECK(panels.size(1) == K && x.scalar_type() == torch::kFloat && panels.scalar_type() == torch::kChar
              && panels.is_contiguous(), "int8_linear: float32 x (M, K), contiguous int8 panels (N/32, K, 32)");
  TORCH_CHECK(x.device().is_cpu() && panels.device().is_cpu(), "int8_linear: tensors on the CPU");
  // scales and offset are applied by broadcasting: a wrong length would be broadcast silently, not refused
  TORCH_CHECK(s.dim() == 1 && s.size(0) == N && s.scalar_type() == torch::kFloat, "int8_linear: scales (N,) float32, N = ", N);
  TORCH_CHECK(!off.has_value() || (off->dim() == 1 && off->size(0) == N && off->scalar_type() == torch::kFloat),
              "int8_linear: offset (N,) float32, N = ", N);
  x = x.contiguous();
  const int8_t* wp = panels.data_ptr<int8_t>();
  torch::Tensor y;
  if (M >= GEMM_ROWS) {
    y = chunked_gemm(x, T, [&](int64_t t, float* out, int64_t ld) { decode_tile8(wp, t, K, 0, K, out, ld); });
  } else if (K == 0) {  // no products: the loops below would write nothing
    y = torch::zeros({M, N}, x.options());
  } else {
    y = torch::empty({M, N}, x.options());
    const float* xp = x.data_ptr<float>(); float* yp = y.data_ptr<float>();
    at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> wf(M >= DECODE_ONCE_ROWS ? K * 32 : 0);
      for (int64_t t = begin; t < end; ++t) {
        if (M < DECODE_ONCE_ROWS) {
          rows_tile8(xp, M, K, wp + t * K * 32, yp, N, t * 32);
          continue;
        }
        panel_product(xp, M, K, [&](int64_t k0, int64_t kb, float* out) { decode_tile8(wp, t, K, k0, kb, out, 32); },
                      wf.data(), yp + t * 32, N);
      }
    });
  }
  y.mul_(s);  // W_hat = s q + off: the codes' products, scaled, plus off * sum(x)
  return off.has_value() ? y.add_(x.sum(-1, true) * *off) : y;
}

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor block_tables,
                              torch::Tensor query_start, torch::Tensor query_len, torch::Tensor seq_lens);  // paged_attention.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);  // layer.cpp, and the three below
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor d, torch::Tensor w, double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
torch::Tensor rope_write(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_pool,
                         torch::Tensor v_pool, torch::Tensor slots);
torch::Tensor f32_linear(torch::Tensor x, torch::Tensor w, int64_t lanes, bool tiles);  // dense.cpp
torch::Tensor int4_a8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor s, c10::optional<torch::Tensor> sz,
                             int64_t group_size);  // w4a8.cpp

// The CPU kernels of the ops that compiled graphs call (their schemas and shape functions are defined in Python,
// minillm/kernels/__init__.py): inductor's code calls them through the C++ dispatcher, not through a Python
// function, about 9 us less per call (121 products in a decode step).
TORCH_LIBRARY_IMPL(minillm, CPU, m) {
  m.impl("int4_linear", &int4_linear); m.impl("int8_linear", &int8_linear); m.impl("int4_a8_linear", &int4_a8_linear);
  m.impl("paged_attention", &paged_attention); m.impl("f32_linear", &f32_linear);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_linear", &int4_linear, py::arg("x"), py::arg("panels"), py::arg("s"), py::arg("z"),
        py::arg("group_size"), py::arg("lanes") = 0); m.def("int8_linear", &int8_linear); m.def("paged_attention", &paged_attention);
  m.def("rms_norm", &rms_norm); m.def("add_rms_norm", &add_rms_norm); m.def("silu_mul", &silu_mul);
  m.def("rope_write", &rope_write); m.def("f32_linear", &f32_linear); m.def("int4_a8_linear", &int4_a8_linear);
}
