// The int4 product with 8-bit activations (llama.cpp's recipe for its 4-bit formats on x86: Q4 weights times Q8
// activations): each row of x is quantized to int8 in blocks of 32 (d = max |x| / 127, x_q = round(x / d)), and
// the codes meet it in integer dot products, 32 multiply-adds per vpmaddubsw instead of one float FMA per
// weight after a shift, a mask and a conversion. On an AVX2-only CPU that conversion, not the memory, bounds a
// one-row product; the price is x's rounding (a relative error of about 1e-2 per block, docs/decode.md).
//
//   y[m, n] = sum_g s[g, n] * ( sum_{b in g} d[m, b] * (x_q . q)_b  -  z[g, n] * sum_{b in g} d[m, b] * sum(x_q)_b )
//
// The integer sums are exact; the float ones run in one order for every row (block, then group), so a row's result
// does not depend on the rows beside it.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t QB = 32;  // activations per int8 block

// x (M, K) float32 -> codes (M, K) int8, d (M, K / 32) and, per kernel group, xs[m, g] = sum_b d_b * sum(codes)_b.
void quantize_rows(const float* x, int64_t M, int64_t K, int64_t gs, int8_t* xq, float* d, float* xs) {
  const int64_t B = K / QB, G = K / gs;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) xs[m * G + g] = 0.0f;
    for (int64_t b = 0; b < B; ++b) {
      const float* xb = x + m * K + b * QB;
      float amax = 0.0f;
      for (int64_t i = 0; i < QB; ++i) {
        const float a = std::fabs(xb[i]);
        if (a > amax || a != a) amax = a;  // a NaN stays (std::max would skip it), so that it reaches the output
      }
      const float db = amax / 127.0f;
      // a block of zeros has codes 0; one with a NaN or an infinity gets codes 0 and d = NaN or inf, so its
      // products come out NaN, as the float product's would, rather than a finite number
      const bool plain = db != 0.0f && std::isfinite(db);
      int32_t sum = 0;
      for (int64_t i = 0; i < QB; ++i) {
        const int8_t q = plain ? static_cast<int8_t>(std::nearbyint(xb[i] / db)) : 0;  // ties to even, as torch.round
        xq[m * K + b * QB + i] = q;
        sum += q;
      }
      d[m * B + b] = db;
      xs[m * G + b * QB / gs] += plain ? db * static_cast<float>(sum) : db;
    }
  }
}

// MR rows by NT groups of 8 columns of one 32-column tile, every k. packed: for each block b of 32 k, for each group
// j of 8 columns, 4 loads of 32 bytes: byte 4c + i of load l holds column c's code for k = 32b + 4l + i in its low
// nibble and for k = 32b + 16 + 4l + i in its high one. The sums of a block stay int16 (8 vpmaddubsw of at most
// 2 * 15 * 127 each: below 32767), then go int32, then float with the block's scale d.
template <int MR, int NT>
void tile_a8(const int8_t* xq, const float* d, const float* xs, int64_t K, int64_t gs, const uint8_t* w, int j0,
             const float* s, const float* sz, int64_t N, int64_t n0, float* y, int64_t ldy) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t B = K / QB, G = K / gs, bpg = gs / QB;
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NT; ++j) _mm256_storeu_ps(y + m * ldy + n0 + (j0 + j) * 8, _mm256_setzero_ps());
  for (int64_t g = 0; g < G; ++g) {
    __m256 accf[MR][NT];
    for (int m = 0; m < MR; ++m) for (int j = 0; j < NT; ++j) accf[m][j] = _mm256_setzero_ps();
    for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) {
      const uint8_t* wb = w + b * 512;
      if (j0 == 0)  // the block's 8 cache lines, 4 KB ahead (see cpu.cpp's prefetch_ahead)
        for (int line = 0; line < 512; line += 64) _mm_prefetch(reinterpret_cast<const char*>(wb) + 4096 + line, _MM_HINT_T0);
      __m256i acc[MR][NT];
      for (int m = 0; m < MR; ++m) for (int j = 0; j < NT; ++j) acc[m][j] = _mm256_setzero_si256();
      for (int l = 0; l < 4; ++l) {
        __m256i xlo[MR], xhi[MR];
        for (int m = 0; m < MR; ++m) {
          const int8_t* xb = xq + m * K + b * QB;
          int32_t lo4, hi4;
          std::memcpy(&lo4, xb + 4 * l, 4);
          std::memcpy(&hi4, xb + 16 + 4 * l, 4);
          xlo[m] = _mm256_set1_epi32(lo4);
          xhi[m] = _mm256_set1_epi32(hi4);
        }
        for (int j = 0; j < NT; ++j) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + ((j0 + j) * 4 + l) * 32));
          const __m256i qlo = _mm256_and_si256(v, low), qhi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
          for (int m = 0; m < MR; ++m)
            acc[m][j] = _mm256_add_epi16(acc[m][j], _mm256_add_epi16(_mm256_maddubs_epi16(qlo, xlo[m]),
                                                                     _mm256_maddubs_epi16(qhi, xhi[m])));
        }
      }
      for (int m = 0; m < MR; ++m) {
        const __m256 db = _mm256_set1_ps(d[m * B + b]);
        for (int j = 0; j < NT; ++j)
          accf[m][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(acc[m][j], ones)), db, accf[m][j]);
      }
    }
    for (int j = 0; j < NT; ++j) {
      const int64_t n = n0 + (j0 + j) * 8;
      const __m256 sg = _mm256_loadu_ps(s + g * N + n);
      const __m256 szg = sz ? _mm256_loadu_ps(sz + g * N + n) : _mm256_setzero_ps();
      for (int m = 0; m < MR; ++m) {
        float* ym = y + m * ldy + n;
        __m256 acc = _mm256_fmadd_ps(sg, accf[m][j], _mm256_loadu_ps(ym));
        _mm256_storeu_ps(ym, _mm256_fnmadd_ps(szg, _mm256_set1_ps(xs[m * G + g]), acc));
      }
    }
  }
}

template <int MR, int NT>
void run_a8(const int8_t* xq, const float* d, const float* xs, int64_t K, int64_t gs, const uint8_t* w,
            const float* s, const float* sz, int64_t N, int64_t n0, float* y) {
  for (int j0 = 0; j0 < 4; j0 += NT) tile_a8<MR, NT>(xq, d, xs, K, gs, w, j0, s, sz, N, n0, y, N);
}

}  // namespace

// y = Q8(x) W_hat^T: x (M, K) float32, packed (N / 32, K / 32, 512) uint8 (``int4_a8_panels``), s (G, N) float32
// scales, sz (G, N) float32 = s * z or None (symmetric codes), group_size a multiple of 32.
torch::Tensor int4_a8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor s, c10::optional<torch::Tensor> sz_opt,
                             int64_t group_size) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.size(2) == 512, "int4_a8_linear: x (M, K), packed (N/32, K/32, 512)");
  TORCH_CHECK(group_size > 0 && group_size % QB == 0, "int4_a8_linear: group_size must be a positive multiple of 32, got ",
              group_size);
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && s.device().is_cpu()
              && (!sz_opt.has_value() || sz_opt->device().is_cpu()), "int4_a8_linear: tensors on the CPU");
  const int64_t M = x.size(0), K = x.size(1), T = packed.size(0), N = T * 32;
  TORCH_CHECK(K % group_size == 0 && packed.size(1) == K / QB && s.size(0) == K / group_size && s.size(1) == N,
              "int4_a8_linear: shapes (K a multiple of group_size; packed (N/32, K/32, 512); scales (K/group_size, N))");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && packed.scalar_type() == torch::kByte && s.scalar_type() == torch::kFloat
              && packed.is_contiguous() && s.is_contiguous(), "int4_a8_linear: float32 x, uint8 packed, contiguous float32 scales");
  TORCH_CHECK(!sz_opt.has_value() || (sz_opt->scalar_type() == torch::kFloat && sz_opt->is_contiguous()
              && sz_opt->sizes() == s.sizes()), "int4_a8_linear: s * z like scales");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return y.zero_();
  x = x.contiguous();
  const int64_t G = K / group_size;
  std::vector<int8_t> xq(M * K);
  std::vector<float> d(M * (K / QB)), xs(M * G);
  quantize_rows(x.data_ptr<float>(), M, K, group_size, xq.data(), d.data(), xs.data());
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = s.data_ptr<float>();
  const float* szp = sz_opt.has_value() ? sz_opt->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t B = K / QB;
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* w = wp + t * B * 512;
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) run_a8<4, 1>(xq.data() + m * K, d.data() + m * B, xs.data() + m * G, K, group_size, w, sp, szp, N, t * 32, yp + m * N);
      const int8_t* xm = xq.data() + m * K; const float* dm = d.data() + m * B; const float* xsm = xs.data() + m * G;
      float* ym = yp + m * N;
      switch (M - m) {
        case 1: run_a8<1, 4>(xm, dm, xsm, K, group_size, w, sp, szp, N, t * 32, ym); break;
        case 2: run_a8<2, 2>(xm, dm, xsm, K, group_size, w, sp, szp, N, t * 32, ym); break;
        case 3: run_a8<3, 1>(xm, dm, xsm, K, group_size, w, sp, szp, N, t * 32, ym); break;
      }
    }
  });
  return y;
}
