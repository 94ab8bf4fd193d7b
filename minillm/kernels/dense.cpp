// y = x W^T in float32 for products of few rows (a decode step, a speculative verification, a small batch),
// read straight from Linear's column shards: w is (S, K, Ns), shard s holding W^T[:, s Ns .. (s + 1) Ns - 1]
// row-major, so rows k0 .. k0 + KB of a shard are one contiguous run of memory.
//
// With up to a few dozen rows the product is bound by W's bytes, and how close it gets to the memory's
// bandwidth is the memory access order: a GEMM library blocks W for large products and reads it at about
// two thirds of the bandwidth here (docs/decode.md). So each worker walks its part of a shard in blocks of KB
// rows of W^T, and inside a block the chunks of columns in order: W streams from memory once and in order
// (a prefetch asks for the chunk two ahead), each chunk's sums for up to MR rows of x stay in registers for
// the block's KB products, and go back to y (in L1) between blocks. More rows than MR re-read the chunk from
// L1, not from memory.
//
// Every output adds its K products in ascending k, one fused multiply-add each, whatever M and whichever
// instruction set: a row's result does not depend on the rows that share the call (batch invariance), so a
// row's products are the same alone, in a batch, or among drafts being verified.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include "simd.h"
#include <algorithm>

constexpr int64_t KB = 48;  // rows of W^T per block (measured: docs/decode.md)

// One chunk (2 vectors of 8 columns) for MR rows of x over the block's kb rows of W^T.
template <int MR>
static void chunk8(const float* x, int64_t K, int64_t kb, const float* w, int64_t ld, float* y, int64_t ldy,
                   bool first) {
  __m256 acc[MR][2];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 2; ++v) acc[m][v] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + m * ldy + 8 * v);
  for (int64_t k = 0; k < kb; ++k) {
    const float* wk = w + k * ld;
    _mm_prefetch(reinterpret_cast<const char*>(wk + 64), _MM_HINT_T0);
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
__attribute__((target("avx512f"))) static void chunk16(const float* x, int64_t K, int64_t kb, const float* w, int64_t ld,
                                                       float* y, int64_t ldy, bool first) {
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 2; ++v) acc[m][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + m * ldy + 16 * v);
  for (int64_t k = 0; k < kb; ++k) {
    const float* wk = w + k * ld;
    _mm_prefetch(reinterpret_cast<const char*>(wk + 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wk + 80), _MM_HINT_T0);
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

// x (M, K) float32, w (S, K, Ns) float32 with Ns % 32 == 0 -> y (M, S Ns). lanes: 16 (AVX-512), 8 (AVX2) or 0
// (the widest this CPU has); both give the same floats.
torch::Tensor f32_linear(torch::Tensor x, torch::Tensor w, int64_t lanes) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && w.size(1) == x.size(1), "f32_linear: x (M, K) and shards (S, K, Ns), got ",
              x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat && x.device().is_cpu()
              && w.device().is_cpu() && w.is_contiguous(), "f32_linear: float32 CPU tensors, contiguous shards");
  TORCH_CHECK(w.size(2) % 32 == 0, "f32_linear: shard width must be a multiple of 32, got ", w.size(2));
  TORCH_CHECK(lanes == 0 || lanes == 8 || lanes == 16, "f32_linear: lanes must be 0, 8 or 16, got ", lanes);
  TORCH_CHECK(lanes != 16 || cpu_has_avx512(), "f32_linear: lanes=16 needs a CPU with AVX-512");
  const bool wide = lanes == 16 || (lanes == 0 && cpu_has_avx512());
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), S = w.size(0), Ns = w.size(2), N = S * Ns;
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return y.zero_();
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t C = wide ? 32 : 16, chunks = Ns / C;
  // each worker takes a run of one shard's chunks; a shard per thread when there are as many (Linear's design)
  const int64_t parts = std::min<int64_t>(chunks, std::max<int64_t>(1, (at::get_num_threads() + S - 1) / S));
  at::parallel_for(0, S * parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = i / parts, p = i % parts, c0 = chunks * p / parts, c1 = chunks * (p + 1) / parts;
      for (int64_t k0 = 0; k0 < K; k0 += KB) {
        const int64_t kb = std::min(KB, K - k0);
        const float* wb = wp + (s * K + k0) * Ns;
        for (int64_t c = c0; c < c1; ++c) {
          const float* wc = wb + c * C;
          float* yc = yp + s * Ns + c * C;
          if (wide)
            by_rows<8>(M, [&](auto mr, int64_t m) { chunk16<decltype(mr)::value>(xp + m * K + k0, K, kb, wc, Ns, yc + m * N, N, k0 == 0); });
          else
            by_rows<6>(M, [&](auto mr, int64_t m) { chunk8<decltype(mr)::value>(xp + m * K + k0, K, kb, wc, Ns, yc + m * N, N, k0 == 0); });
        }
      }
    }
  });
  return y;
}
