// y = x W^T in float32 for products of few rows (a decode step, a speculative verification, a small batch),
// read straight from Linear's column shards: w is (S, K, Ns), shard s holding W^T[:, s Ns .. (s + 1) Ns - 1]
// row-major, so rows k0 .. k0 + KB of a shard are one contiguous run of memory.
//
// With up to a few dozen rows the product is bound by W's bytes, and how close it gets to the memory's
// bandwidth is the memory access order: a GEMM library blocks W for large products and reads it at about
// two thirds of the bandwidth here (docs/decode.md). Three orders, each measured best somewhere:
//   blocks: each worker walks its part of a shard in blocks of rows of W^T (block_rows: 48 for a few rows of
//     x, longer for more), inside a block the chunks of columns in order, each chunk's sums for up to MR rows
//     of x in registers for the block and back in y between blocks (Intel's AVX-512);
//   panels: the sums of a panel of columns stay in an L1 buffer while W^T is read a few rows at a time across
//     the whole panel: few long runs of memory, which AMD's prefetchers follow (AMD, a few rows of x);
//   tiles: one tile of columns at a time, its sums in registers for all K rows, each row's read asking for
//     the next tile's row into L2, so that W streams in while the arithmetic runs (AMD, from 4 rows of x).
//
// Every output adds its K products in ascending k, one fused multiply-add each, whatever M, order and
// instruction set: a row's result does not depend on the rows that share the call (batch invariance), so a
// row's products are the same alone, in a batch, or among drafts being verified.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include "simd.h"
#include <algorithm>
#include <vector>

// The sums of a panel of columns for every row of x, in a buffer that stays in L1 (about 24 KB, as
// measured best), and how many columns that leaves for M rows (whole chunks of C).
static constexpr int64_t PANEL_BYTES = 24 * 1024;
static inline int64_t panel_columns(int64_t M, int64_t C) { return std::max<int64_t>(C, PANEL_BYTES / (4 * M) / C * C); }

// Columns c0 .. c1 of one shard (w at its first row, y at its first column), in blocks of block_rows(M) rows of
// W^T, each block chunk by chunk of C columns; the sums go to y between blocks.
static void by_blocks(const float* x, int64_t M, int64_t K, const float* w, int64_t Ns, int64_t c0, int64_t c1,
                      float* y, int64_t N, bool wide) {
  const int64_t C = wide ? 32 : 16, KB = block_rows(M);
  for (int64_t k0 = 0; k0 < K; k0 += KB)
    for (int64_t c = c0; c < c1; c += C)
      block_all_rows(x, M, K, k0, std::min(KB, K - k0), w + k0 * Ns + c, Ns, y + c, N, wide);
}

// Columns c0 .. c1 of one shard in panels of P columns: a panel's sums stay in an L1 buffer while W^T is read
// `block` rows at a time across the whole panel, then go to y once.
static void by_panels(const float* x, int64_t M, int64_t K, const float* w, int64_t Ns, int64_t c0, int64_t c1,
                      int64_t P, int64_t block, float* y, int64_t N, bool wide) {
  const int64_t C = wide ? 32 : 16;
  std::vector<float> sums(M * P);
  for (int64_t p0 = c0; p0 < c1; p0 += P) {
    const int64_t width = std::min(P, c1 - p0);
    for (int64_t k0 = 0; k0 < K; k0 += block)
      for (int64_t c = 0; c < width; c += C)
        block_all_rows(x, M, K, k0, std::min(block, K - k0), w + k0 * Ns + p0 + c, Ns, sums.data() + c, width, wide);
    for (int64_t m = 0; m < M; ++m) std::copy_n(sums.data() + m * width, width, y + m * N + p0);
  }
}

// Columns c0 .. c1 of one shard a tile of C columns at a time, all K rows of W^T with the sums in registers;
// each tile asks for the next one's rows into L2 as it reads its own.
static void by_tiles(const float* x, int64_t M, int64_t K, const float* w, int64_t Ns, int64_t c0, int64_t c1,
                     float* y, int64_t N, bool wide) {
  const int64_t C = wide ? 32 : 16;
  for (int64_t c = c0; c < c1; c += C)
    tile_all_rows(x, M, K, w + c, Ns, y + c, N, wide, c + C < c1 ? w + c + C : nullptr);
}

// x (M, K) float32, w (S, K, Ns) float32 with Ns % 32 == 0 -> y (M, S Ns). lanes: 16 (AVX-512), 8 (AVX2) or 0
// (the widest this CPU has); both give the same floats. block: 0 reads W^T in blocks of block_rows(M) rows, each
// block chunk by chunk of columns, the sums going to y between blocks; block > 0 reads it in panels of columns
// whose sums stay in an L1 buffer, `block` rows of W^T at a time across the whole panel, so that only `block`
// runs of memory are read at once (AMD's prefetchers follow a few long runs, not 48 short ones:
// docs/decode.md); tiles (block 0) reads one tile of columns at a time, all of W^T's rows, the sums in registers.
// Every order adds each output's products in ascending k: the same floats.
torch::Tensor f32_linear(torch::Tensor x, torch::Tensor w, int64_t lanes, int64_t block, bool tiles) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && w.size(1) == x.size(1), "f32_linear: x (M, K) and shards (S, K, Ns), got ",
              x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat && x.device().is_cpu()
              && w.device().is_cpu() && w.is_contiguous(), "f32_linear: float32 CPU tensors, contiguous shards");
  TORCH_CHECK(w.size(2) % 32 == 0, "f32_linear: shard width must be a multiple of 32, got ", w.size(2));
  TORCH_CHECK(lanes == 0 || lanes == 8 || lanes == 16, "f32_linear: lanes must be 0, 8 or 16, got ", lanes);
  TORCH_CHECK(lanes != 16 || cpu_has_avx512(), "f32_linear: lanes=16 needs a CPU with AVX-512 and no ATEN_CPU_CAPABILITY=avx2 cap");
  TORCH_CHECK(block >= 0, "f32_linear: block must be 0 (by the rows) or a count of rows of W^T, got ", block);
  TORCH_CHECK(!(tiles && block), "f32_linear: tiles read all rows of W^T per tile; give block 0 with tiles, got ", block);
  const bool wide = lanes == 16 || (lanes == 0 && cpu_has_avx512());
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), S = w.size(0), Ns = w.size(2), N = S * Ns;
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return y.zero_();
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t C = wide ? 32 : 16;
  // each worker takes a run of one shard's chunks (whole panels, whole tiles); a shard per thread when there are as many
  // (Linear's design). Fewer shards than threads: each shard is cut into at least as many panels as it has
  // workers, or a shard narrower than one panel would keep the other threads idle.
  const int64_t wanted = std::max<int64_t>(1, (at::get_num_threads() + S - 1) / S);
  const int64_t P = std::min({Ns, panel_columns(M, C), std::max(C, (Ns / wanted + C - 1) / C * C)});
  const int64_t unit = block ? P : C, units = (Ns + unit - 1) / unit, parts = std::min(units, wanted);
  at::parallel_for(0, S * parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = i / parts, p = i % parts;
      const int64_t c0 = units * p / parts * unit, c1 = std::min(Ns, units * (p + 1) / parts * unit);
      const float* ws = wp + s * K * Ns;
      if (tiles) by_tiles(xp, M, K, ws, Ns, c0, c1, yp + s * Ns, N, wide);
      else if (block) by_panels(xp, M, K, ws, Ns, c0, c1, P, block, yp + s * Ns, N, wide);
      else by_blocks(xp, M, K, ws, Ns, c0, c1, yp + s * Ns, N, wide);
    }
  });
  return y;
}
