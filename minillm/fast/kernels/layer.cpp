// The small operations of a decoder layer, each one pass over its rows (float32, AVX2): RMSNorm with the
// residual add before it, SwiGLU's silu(gate) * up, and RoPE with the write of the new keys and values into
// the pool of KV blocks (vLLM's fused_add_rms_norm, silu_and_mul, rotary_embedding + reshape_and_cache).
// In torch each is two to ten operators, and each operator is a dispatch, a parallel region and a pass over
// memory: with a few hundred of them per step, a batch of short rows spends more time there than in its
// products (docs/decode.md).
// Threads: at::parallel_for over rows (tokens), in chunks of about 32K floats, so that a decode step's few
// rows stay on one thread instead of paying for a parallel region.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include "simd.h"
#include <cmath>
#include <tuple>

static int64_t grain(int64_t row_floats) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_floats)); }

// t (..., features) as a contiguous (rows, features) float32 CPU tensor (a view where t already is one).
static torch::Tensor rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() >= 1 && t.scalar_type() == torch::kFloat && t.device().is_cpu(), "layer kernels: ", name,
              " must be a (..., features) float32 CPU tensor, got ", t.sizes(), " of ", t.scalar_type(), " on ", t.device());
  return t.reshape({-1, t.size(-1)}).contiguous();
}

// One row: h = x (+ d), y = h / sqrt(mean(h^2) + eps) * w. The sum of squares is kept in 8 lanes, then
// added across them (torch's rms_norm adds in another order: the results agree within float32 rounding).
static void norm_row(const float* x, const float* d, const float* w, float eps, int64_t C, float* h, float* y) {
  __m256 ss = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= C; i += 8) {
    __m256 v = _mm256_loadu_ps(x + i);
    if (d) { v = _mm256_add_ps(v, _mm256_loadu_ps(d + i)); _mm256_storeu_ps(h + i, v); }
    ss = _mm256_fmadd_ps(v, v, ss);
  }
  float tail = 0.0f;
  for (; i < C; ++i) {
    const float v = d ? (h[i] = x[i] + d[i]) : x[i];
    tail += v * v;
  }
  const float r = 1.0f / std::sqrt((hsum8(ss) + tail) / static_cast<float>(C) + eps);
  const float* src = d ? h : x;
  const __m256 rv = _mm256_set1_ps(r);
  for (i = 0; i + 8 <= C; i += 8)
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(src + i), rv), _mm256_loadu_ps(w + i)));
  for (; i < C; ++i) y[i] = src[i] * r * w[i];
}

static void norm_rows(const torch::Tensor& x, const float* d, const torch::Tensor& w, double eps, float* h, float* y) {
  const int64_t M = x.size(0), C = x.size(1);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  at::parallel_for(0, M, grain(C), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      norm_row(xp + m * C, d ? d + m * C : nullptr, wp, static_cast<float>(eps), C, h ? h + m * C : nullptr, y + m * C);
  });
}

static void check_weight(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.scalar_type() == torch::kFloat && w.is_contiguous()
              && w.device().is_cpu(), "rms_norm: weight must be a contiguous (", x.size(1), ",) float32 CPU tensor, got ",
              w.sizes());
}

// x (..., C) -> rms_norm(x), same shape.
torch::Tensor rms_norm(torch::Tensor x_, torch::Tensor w, double eps) {
  auto x = rows(x_, "x");
  check_weight(x, w);
  auto y = torch::empty_like(x);
  norm_rows(x, nullptr, w, eps, nullptr, y.data_ptr<float>());
  return y.view(x_.sizes());
}

// (x + d, rms_norm(x + d)): the residual stream after a sublayer and the next sublayer's input, in one pass.
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x_, torch::Tensor d_, torch::Tensor w, double eps) {
  TORCH_CHECK(d_.sizes() == x_.sizes(), "add_rms_norm: delta ", d_.sizes(), " must have x's shape ", x_.sizes());
  auto x = rows(x_, "x"), d = rows(d_, "delta");
  check_weight(x, w);
  auto h = torch::empty_like(x), y = torch::empty_like(x);
  norm_rows(x, d.data_ptr<float>(), w, eps, h.data_ptr<float>(), y.data_ptr<float>());
  return {h.view(x_.sizes()), y.view(x_.sizes())};
}

// silu(g) * u for gate_up = [g | u] (rows of 2F): g / (1 + e^-g), rounded, times u, as torch's silu and mul.
// gate_up (..., 2F) -> (..., F).
torch::Tensor silu_mul(torch::Tensor gate_up_) {
  auto gate_up = rows(gate_up_, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul: gate_up needs an even width (gate and up side by side), got ",
              gate_up.size(1));
  const int64_t M = gate_up.size(0), F = gate_up.size(1) / 2;
  auto shape = gate_up_.sizes().vec();
  shape.back() = F;
  auto y = torch::empty(shape, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, M, grain(2 * F), [&](int64_t begin, int64_t end) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (int64_t m = begin; m < end; ++m) {
      const float *g = gp + m * 2 * F, *u = g + F;
      float* o = yp + m * F;
      int64_t i = 0;
      for (; i + 8 <= F; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_xor_ps(gv, sign))));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
      }
      for (; i < F; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    }
  });
  return y;
}

// Rotate-half RoPE of one head: out = x cos + rotate_half(x) sin, rotate_half(x) = [-x2, x1]. Two products and
// a sum, each rounded as torch's elementwise operators round them, so the result is apply_rope's bit for bit.
static inline void rope_head(const float* x, const float* c, const float* s, int64_t D, float* out) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; i += 8) {
    const __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + half + i);
    _mm256_storeu_ps(out + i, _mm256_sub_ps(_mm256_mul_ps(x1, _mm256_loadu_ps(c + i)), _mm256_mul_ps(x2, _mm256_loadu_ps(s + i))));
    _mm256_storeu_ps(out + half + i, _mm256_add_ps(_mm256_mul_ps(x2, _mm256_loadu_ps(c + half + i)),
                                                   _mm256_mul_ps(x1, _mm256_loadu_ps(s + half + i))));
  }
}

// qkv: (N, (H + 2 Hkv) D), one token per row as the fused QKV product gives it; cos, sin: (N, D) at each token's
// position. Writes RoPE(k) and v at slots[n] of the pools (num_blocks, block_size, Hkv, D) and returns RoPE(q)
// (N, H, D), the layout paged attention reads its queries in.
torch::Tensor rope_write(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_pool,
                         torch::Tensor v_pool, torch::Tensor slots) {
  TORCH_CHECK(qkv.dim() == 2 && cos.dim() == 2 && sin.dim() == 2, "rope_write: qkv, cos and sin are (N, width)");
  qkv = rows(qkv, "qkv"); cos = rows(cos, "cos"); sin = rows(sin, "sin");
  TORCH_CHECK(k_pool.dim() == 4 && v_pool.sizes() == k_pool.sizes() && k_pool.is_contiguous() && v_pool.is_contiguous()
              && k_pool.scalar_type() == torch::kFloat && v_pool.scalar_type() == torch::kFloat
              && k_pool.device().is_cpu() && v_pool.device().is_cpu(),
              "rope_write: pools must be contiguous (blocks, block_size, Hkv, D) float32 CPU tensors, got ", k_pool.sizes());
  const int64_t N = qkv.size(0), Hkv = k_pool.size(2), D = k_pool.size(3), S = k_pool.size(0) * k_pool.size(1);
  TORCH_CHECK(Hkv > 0 && D > 0 && D % 16 == 0, "rope_write: at least one KV head and a head_dim that is a multiple of "
              "16 (each half in 8-float lanes), got ", Hkv, " heads of ", D);
  TORCH_CHECK(qkv.size(1) % D == 0 && qkv.size(1) / D > 2 * Hkv && (qkv.size(1) / D - 2 * Hkv) % Hkv == 0,
              "rope_write: qkv's width ", qkv.size(1), " must be (H + 2 Hkv) * D with H a multiple of Hkv = ", Hkv,
              " and D = ", D);
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == N && cos.size(1) == D,
              "rope_write: cos and sin must be (", N, ", ", D, "), one row per token, got ", cos.sizes(), " and ", sin.sizes());
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == N && slots.scalar_type() == torch::kLong && slots.device().is_cpu(),
              "rope_write: slots must be (", N, ",) int64 on the CPU, got ", slots.sizes());
  TORCH_CHECK(!k_pool.requires_grad() && !v_pool.requires_grad(), "rope_write: the pools are written in place, so "
              "they must not require grad");
  slots = slots.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n)  // every slot checked before any thread writes through one
    TORCH_CHECK(sp[n] >= 0 && sp[n] < S, "rope_write: slot ", sp[n], " of token ", n, " is outside the pool's ", S, " slots");
  // an in-place write, as index_copy_'s: the pools' versions move (and an inference tensor outside inference
  // mode is refused here, before anything is written)
  k_pool.unsafeGetTensorImpl()->bump_version();
  v_pool.unsafeGetTensorImpl()->bump_version();
  const int64_t H = qkv.size(1) / D - 2 * Hkv, W = qkv.size(1);
  auto q = torch::empty({N, H, D}, qkv.options());
  const float *xp = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *snp = sin.data_ptr<float>();
  float *qp = q.data_ptr<float>(), *kp = k_pool.data_ptr<float>(), *vp = v_pool.data_ptr<float>();
  at::parallel_for(0, N, grain(W), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float *x = xp + n * W, *c = cp + n * D, *s = snp + n * D;
      for (int64_t h = 0; h < H; ++h) rope_head(x + h * D, c, s, D, qp + (n * H + h) * D);
      for (int64_t h = 0; h < Hkv; ++h) {
        rope_head(x + (H + h) * D, c, s, D, kp + (sp[n] * Hkv + h) * D);
        std::copy(x + (H + Hkv + h) * D, x + (H + Hkv + h + 1) * D, vp + (sp[n] * Hkv + h) * D);
      }
    }
  });
  return q;
}
