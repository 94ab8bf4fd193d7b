// y = x W^T in float32 for products of few rows (a decode step, a speculative verification, a small batch),
// read straight from Linear's column shards: w is (S, K, Ns), shard s holding W^T[:, s Ns .. (s + 1) Ns - 1]
// row-major, so rows k0 .. k0 + KB of a shard are one contiguous run of memory.
//
// With up to a few dozen rows the product is bound by W's bytes, and how close it gets to the memory's
// bandwidth is the memory access order: a GEMM library blocks W for large products and reads it at about
// two thirds of the bandwidth here (docs/decode.md). Two orders, each measured best on its CPUs:
//   blocks (Intel): each worker walks its part of a shard in blocks of rows of W^T (block_rows: 48 for a few
//     rows of x, longer for more), inside a block the chunks of columns in order, each chunk's sums for up to
//     MR rows of x in registers for the block and back in y between blocks;
//   tiles (AMD): one tile of 32 columns (16 in AVX2) at a time over all K rows of W^T, its sums in registers
//     from the first row to the last, each row's read asking for the tile's rows ahead and the next tile's row
//     into L2, so that W streams in while the arithmetic runs.
//
// Every output adds its K products in ascending k, one fused multiply-add each, whatever M, order and
// instruction set: a row's result does not depend on the rows that share the call (batch invariance), so a
// row's products are the same alone, in a batch, or among drafts being verified.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include "simd.h"
#include <algorithm>

// Columns c0 .. c1 of one shard (w at its first row, y at its first column), in blocks of block_rows(M) rows of
// W^T, each block chunk by chunk of C columns; the sums go to y between blocks.
static void by_blocks(const float* x, int64_t M, int64_t K, const float* w, int64_t Ns, int64_t c0, int64_t c1,
                      float* y, int64_t N, bool wide) {
  const int64_t C = wide ? 32 : 16, KB = block_rows(M);
  for (int64_t k0 = 0; k0 < K; k0 += KB)
    for (int64_t c = c0; c < c1; c += C)
      block_all_rows(x, M, K, k0, std::min(KB, K - k0), w + k0 * Ns + c, Ns, y + c, N, wide);
}

// Columns c0 .. c1 of one shard a tile of C columns at a time, all K rows of W^T with the sums in registers;
// each tile asks for its own rows ahead and for the next tile's rows into L2 as it reads.
static void by_tiles(const float* x, int64_t M, int64_t K, const float* w, int64_t Ns, int64_t c0, int64_t c1,
                     float* y, int64_t N, bool wide) {
  const int64_t C = wide ? 32 : 16;
  for (int64_t c = c0; c < c1; c += C)
    tile_all_rows(x, M, K, w + c, Ns, y + c, N, wide, c + C < c1 ? w + c + C : nullptr);
}

// x (M, K) float32, w (S, K, Ns) float32 with Ns % 32 == 0 -> y (M, S Ns). lanes: 16 (AVX-512), 8 (AVX2) or 0
// (the widest this CPU has); tiles: read W^T in tiles of columns (else in blocks of rows). Every lanes and order
// give the same floats.
torch::Tensor f32_linear(torch::Tensor x, torch::Tensor w, int64_t lanes, bool tiles) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && w.size(1) == x.size(1), "f32_linear: x (M, K) and shards (S, K, Ns), got ",
              x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat && x.device().is_cpu()
              && w.device().is_cpu() && w.is_contiguous(), "f32_linear: float32 CPU tensors, contiguous shards");
  TORCH_CHECK(w.size(2) % 32 == 0, "f32_linear: shard width must be a multiple of 32, got ", w.size(2));
  TORCH_CHECK(lanes == 0 || lanes == 8 || lanes == 16, "f32_linear: lanes must be 0, 8 or 16, got ", lanes);
  TORCH_CHECK(lanes != 16 || cpu_has_avx512(), "f32_linear: lanes=16 needs a CPU with AVX-512 and no ATEN_CPU_CAPABILITY=avx2 cap");
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
  // each worker takes a run of one shard's chunks of C columns: a shard per thread when there are as many
  // (Linear's design); with fewer shards than threads each shard is cut into as many runs as it has workers
  const int64_t wanted = std::max<int64_t>(1, (at::get_num_threads() + S - 1) / S);
  const int64_t units = Ns / C, parts = std::min(units, wanted);  // Ns: a multiple of 32, checked above
  at::parallel_for(0, S * parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = i / parts, p = i % parts;
      const int64_t c0 = units * p / parts * C, c1 = units * (p + 1) / parts * C;
      const float* ws = wp + s * K * Ns;
      if (tiles) by_tiles(xp, M, K, ws, Ns, c0, c1, yp + s * Ns, N, wide);
      else by_blocks(xp, M, K, ws, Ns, c0, c1, yp + s * Ns, N, wide);
    }
  });
  return y;
}
