// PagedAttention on the CPU (Kwon et al. 2023, Sec. 4.1): each query attends over its sequence's keys and
// values where they lie in the pool of blocks, block by block with an online softmax (Milakov & Gimelshein
// 2018), so nothing is gathered into a contiguous copy first. float32, AVX2 + FMA.
//
// The queries come in segments, one per sequence, as in vLLM's attention metadata: segment r is queries
// query_start[r] .. query_start[r] + query_len[r] - 1 of q (N, H, D), the last query_len[r] positions of a
// sequence that holds seq_lens[r] tokens (their keys and values already written), whose blocks are row r of
// block_tables (R, W). Query t of the segment sits at position seq_lens[r] - query_len[r] + t and sees keys
// 0 .. that position (causal). k_pool, v_pool: (num_blocks, block_size, Hkv, D), one layer. Returns (N, H, D):
// queries outside every segment are 0.
// Threads: at::parallel_for over (segment, KV head) pairs. Every key and value block a pair reads serves all
// of its segment's queries and the G = H / Hkv query heads that share the KV head (grouped-query attention).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include "simd.h"
#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

// The dot products of q with 8 keys at stride apart: 8 sums in registers, then reduced together (two rounds
// of pairwise adds and one swap of halves) rather than one horizontal sum per key.
static inline __m256 dot8(const float* q, const float* k, int64_t stride, int64_t D) {
  __m256 a[8];
  for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
  for (int64_t e = 0; e < D; e += 8) {
    const __m256 qv = _mm256_loadu_ps(q + e);
    for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + i * stride + e), a[i]);
  }
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Segment r's queries, KV head h: Q = query_len * G rows (query t, head g at row t * G + g), over keys
// 0 .. pos0 + t. qs: the rows, already scaled by 1 / sqrt(D); scores: Q rows of ld floats (block_size rounded
// up to 8); acc: Q * D floats; m, l, rescale: Q floats each.
static void attend_segment(const float* qs, int64_t T, int64_t G, int64_t pos0, const float* k_pool,
                           const float* v_pool, const int64_t* table, int64_t bs, int64_t Hkv, int64_t h, int64_t D,
                           float* scores, int64_t ld, float* acc, float* m, float* l, float* rescale) {
  const int64_t Q = T * G, key_stride = Hkv * D;  // key_stride: from one slot of a block to the next
  std::fill(acc, acc + Q * D, 0.0f); std::fill(m, m + Q, -INFINITY); std::fill(l, l + Q, 0.0f);
  for (int64_t j0 = 0; j0 <= pos0 + T - 1; j0 += bs) {
    const int64_t slot0 = table[j0 / bs] * bs;
    const float* kb = k_pool + slot0 * key_stride + h * D;
    const float* vb = v_pool + slot0 * key_stride + h * D;
    const int64_t t0 = std::max<int64_t>(0, j0 - pos0);  // queries before t0 see no key of this block
    const int64_t nk = std::min(bs, pos0 + T - j0);  // keys of the block that the last query sees
    for (int64_t r = t0 * G; r < Q; ++r) {  // scores, then the online softmax's rescaling of each row
      float* s = scores + r * ld;
      const int64_t seen = std::min(nk, pos0 + r / G + 1 - j0);  // this row's visible keys in the block
      int64_t i = 0;
      for (; i < seen && i + 8 <= bs; i += 8)  // 8 slots of the block at once (past seen: masked below)
        _mm256_storeu_ps(s + i, dot8(qs + r * D, kb + i * key_stride, key_stride, D));
      for (; i < seen; ++i) {
        __m256 d = _mm256_setzero_ps();
        for (int64_t e = 0; e < D; e += 8)
          d = _mm256_fmadd_ps(_mm256_loadu_ps(qs + r * D + e), _mm256_loadu_ps(kb + i * key_stride + e), d);
        s[i] = hsum8(d);
      }
      for (i = seen; i < ld; ++i) s[i] = -INFINITY;  // lanes it does not see give exp = 0
      const float m_new = std::max(m[r], *std::max_element(s, s + seen));
      rescale[r] = std::exp(m[r] - m_new);  // m = -inf before the first block: 0
      const __m256 mv = _mm256_set1_ps(m_new);
      __m256 lsum = _mm256_setzero_ps();
      for (i = 0; i < ld; i += 8) {
        const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv));
        _mm256_storeu_ps(s + i, p);
        lsum = _mm256_add_ps(lsum, p);
      }
      l[r] = l[r] * rescale[r] + hsum8(lsum);
      m[r] = m_new;
    }
    for (int64_t e = 0; e < D; e += 8) {  // acc += p v: each value read once for 4 rows at a time
      for (int64_t r0 = t0 * G; r0 < Q; r0 += 4) {
        const int64_t nr = std::min<int64_t>(4, Q - r0);
        __m256 av[4];
        for (int64_t r = 0; r < nr; ++r)
          av[r] = _mm256_mul_ps(_mm256_loadu_ps(acc + (r0 + r) * D + e), _mm256_set1_ps(rescale[r0 + r]));
        for (int64_t i = 0; i < nk; ++i) {
          const __m256 vv = _mm256_loadu_ps(vb + i * key_stride + e);
          for (int64_t r = 0; r < nr; ++r) av[r] = _mm256_fmadd_ps(_mm256_set1_ps(scores[(r0 + r) * ld + i]), vv, av[r]);
        }
        for (int64_t r = 0; r < nr; ++r) _mm256_storeu_ps(acc + (r0 + r) * D + e, av[r]);
      }
    }
  }
}

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor block_tables,
                              torch::Tensor query_start, torch::Tensor query_len, torch::Tensor seq_lens) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 4 && v_pool.sizes() == k_pool.sizes() && block_tables.dim() == 2,
              "paged_attention: q (N, H, D), pools (blocks, block_size, Hkv, D), block_tables (R, W)");
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2), NB = k_pool.size(0), bs = k_pool.size(1),
                Hkv = k_pool.size(2), R = block_tables.size(0), W = block_tables.size(1);
  TORCH_CHECK(k_pool.size(3) == D && D % 8 == 0 && Hkv > 0 && H % Hkv == 0, "paged_attention: head_dim a multiple "
              "of 8, equal in q and the pools, and H a multiple of Hkv; got q ", q.sizes(), ", pool ", k_pool.sizes());
  for (const auto& t : {query_start, query_len, seq_lens})
    TORCH_CHECK(t.dim() == 1 && t.size(0) == R && t.scalar_type() == torch::kLong,
                "paged_attention: query_start, query_len and seq_lens are (R,) int64, one per row of block_tables");
  for (const auto& t : {q, k_pool, v_pool, block_tables, query_start, query_len, seq_lens})
    TORCH_CHECK(t.device().is_cpu(), "paged_attention: every tensor on the CPU (the loops read host memory)");
  TORCH_CHECK(q.scalar_type() == torch::kFloat && k_pool.scalar_type() == torch::kFloat && v_pool.scalar_type() == torch::kFloat
              && k_pool.is_contiguous() && v_pool.is_contiguous(), "paged_attention: float32 q and contiguous float32 pools");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong, "paged_attention: int64 block_tables");
  q = q.contiguous(); block_tables = block_tables.contiguous();
  auto qs_ = query_start.contiguous(), ql_ = query_len.contiguous(), sl_ = seq_lens.contiguous();
  const int64_t *tables = block_tables.data_ptr<int64_t>(), *starts = qs_.data_ptr<int64_t>(),
                *lens = ql_.data_ptr<int64_t>(), *held = sl_.data_ptr<int64_t>();
  // every index is checked before any thread reads memory with it (written so that no sum can overflow)
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(lens[r] >= 1 && lens[r] <= N && starts[r] >= 0 && starts[r] <= N - lens[r], "paged_attention: segment ",
                r, " (queries ", starts[r], " + ", lens[r], ") outside the ", N, " queries");
    spans.emplace_back(starts[r], lens[r]);
    TORCH_CHECK(held[r] >= lens[r] && held[r] <= W * bs, "paged_attention: segment ", r, " holds ", held[r],
                " tokens: at least its ", lens[r], " queries and at most its table's ", W * bs, " slots");
    for (int64_t j = 0; j < held[r]; j += bs) {
      const int64_t b = tables[r * W + j / bs];
      TORCH_CHECK(b >= 0 && b < NB, "paged_attention: block ", b, " in row ", r, "'s table, of ", NB, " blocks");
    }
  }
  // two segments writing one query's output from two threads would race: segments must not overlap
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i)
    TORCH_CHECK(spans[i].first >= spans[i - 1].first + spans[i - 1].second, "paged_attention: segments overlap at query ",
                spans[i].first, "; give each query to one segment");
  auto out = torch::zeros_like(q);
  const float *qp = q.data_ptr<float>(), *kp = k_pool.data_ptr<float>(), *vp = v_pool.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t G = H / Hkv, ld = (bs + 7) / 8 * 8;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  at::parallel_for(0, R * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs, scores, acc, m, l, rescale;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / Hkv, h = item % Hkv, T = lens[r], Q = T * G;
      qs.resize(Q * D); scores.resize(Q * ld); acc.resize(Q * D); m.resize(Q); l.resize(Q); rescale.resize(Q);
      for (int64_t t = 0; t < T; ++t)  // query t's heads h G .. h G + G - 1, side by side
        for (int64_t i = 0; i < G * D; ++i) qs[t * G * D + i] = qp[((starts[r] + t) * H + h * G) * D + i] * scale;
      attend_segment(qs.data(), T, G, held[r] - T, kp, vp, tables + r * W, bs, Hkv, h, D, scores.data(), ld,
                     acc.data(), m.data(), l.data(), rescale.data());
      for (int64_t t = 0; t < T; ++t)
        for (int64_t g = 0; g < G; ++g) {
          float* o = op + ((starts[r] + t) * H + h * G + g) * D;
          const float* a = acc.data() + (t * G + g) * D;
          for (int64_t e = 0; e < D; ++e) o[e] = a[e] / l[t * G + g];
        }
    }
  });
  return out;
}
