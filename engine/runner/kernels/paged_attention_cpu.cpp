// Paged attention on CPU: each query token attends to the first ctx[t] positions of its row,
// read in place from the block pool (no gather into a contiguous copy).
//
// q (T, H, D) float32; k_pool, v_pool (num_blocks, Hkv, block_size, D) float32;
// block_tables (R, max_blocks) int32; token_row (T,) int32; ctx (T,) int32.
// Work is split over (token, kv head): the G = H / Hkv query heads of a kv head read its keys
// and values once (GQA without repeating K/V).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                              torch::Tensor block_tables, torch::Tensor token_row, torch::Tensor ctx,
                              double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_pool.dtype() == torch::kFloat32, "float32 only");
  q = q.contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_pool.size(1), BS = k_pool.size(2), MB = block_tables.size(1);
  const int64_t G = H / Hkv;
  auto out = torch::empty_like(q);
  const float* Q = q.data_ptr<float>();
  const float* K = k_pool.data_ptr<float>();
  const float* V = v_pool.data_ptr<float>();
  const int32_t* BT = block_tables.data_ptr<int32_t>();
  const int32_t* ROW = token_row.data_ptr<int32_t>();
  const int32_t* CTX = ctx.data_ptr<int32_t>();
  float* O = out.data_ptr<float>();
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
  at::parallel_for(0, T * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s, acc;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / Hkv, h = task % Hkv;
      const int64_t len = CTX[t];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - lo;
      const int32_t* table = BT + static_cast<int64_t>(ROW[t]) * MB;
      const float* qh = Q + (t * H + h * G) * D;
      s.assign(G * n, 0.f);
      for (int64_t p = lo; p < len; ++p) {
        const float* k = K + ((static_cast<int64_t>(table[p / BS]) * Hkv + h) * BS + p % BS) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qh + g * D;
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) dot += qg[d] * k[d];
          dot *= sc;
          if (cap > 0.f) dot = cap * std::tanh(dot / cap);
          s[g * n + (p - lo)] = dot;
        }
      }
      acc.assign(G * D, 0.f);
      std::vector<float> total(G, 0.f);
      for (int64_t g = 0; g < G; ++g) {
        float* sg = s.data() + g * n;
        const float m = *std::max_element(sg, sg + n);
        float sum = 0.f;
        for (int64_t i = 0; i < n; ++i) { sg[i] = std::exp(sg[i] - m); sum += sg[i]; }
        total[g] = sum;
      }
      for (int64_t p = lo; p < len; ++p) {
        const float* v = V + ((static_cast<int64_t>(table[p / BS]) * Hkv + h) * BS + p % BS) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float w = s[g * n + (p - lo)];
          float* a = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) a[d] += w * v[d];
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* o = O + (t * H + h * G + g) * D;
        const float inv = 1.f / total[g];
        for (int64_t d = 0; d < D; ++d) o[d] = acc[g * D + d] * inv;
      }
    }
  });
  return out;
}
