// Paged decode attention, one query token per sequence, float32 K/V: each (sequence, KV head)
// reads its keys and values through the block table where they lie (no gather copy) and serves
// its G = Hq / Hk query heads (GQA) from that one read. The torch reference is
// ops/attention.py paged_attention_reference; this replaces the CPU's gather + bmm for decode.
#include <cmath>
#include <vector>

#include "vec.h"

extern "C" {

// q: [B, Hq, D] with token stride q_stride; k_cache, v_cache: [blocks, block_size, Hk, D];
// block_tables[b * bt_row + i * bt_col] is sequence b's i-th block; out: [B, Hq, D] contiguous.
// D must be a multiple of 16. window > 0: a query sees only its last `window` keys (sliding window).
void gs_decode_attention(const float* q, int64_t q_stride, const float* k_cache, const float* v_cache,
                         const int32_t* block_tables, int64_t bt_row, int64_t bt_col, const int32_t* seq_lens,
                         float* out, int64_t batch, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                         int64_t block_size, float scale, int64_t window, int max_threads) {
  auto first_key = [&](int64_t len) { return window > 0 && len > window ? len - window : 0; };
  const int64_t group = q_heads / kv_heads, tasks = batch * kv_heads, vecs = head_dim / kRegLanes;
  int64_t work = 0;
  for (int64_t b = 0; b < batch; b++) work += seq_lens[b] - first_key(seq_lens[b]);
  // ~0.02 ns per multiply-add (two per key and query head per element: scores, then values).
  const int threads = threads_for(work * q_heads * head_dim * 2 / 50, 1, max_threads);
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scores;
    int64_t begin, end;
    thread_range(tasks, 1, &begin, &end);
    for (int64_t task = begin; task < end; task++) {
      const int64_t b = task / kv_heads, h = task % kv_heads, first = first_key(seq_lens[b]);
      const int64_t len = seq_lens[b] - first;
      const float* qb = q + b * q_stride + h * group * head_dim;
      auto row = [&](const float* pool, int64_t key) {  // key: counted from the first visible one
        const int64_t j = first + key;
        const int64_t block = block_tables[b * bt_row + (j / block_size) * bt_col];
        return pool + ((block * block_size + j % block_size) * kv_heads + h) * head_dim;
      };
      scores.resize(group * len);
      for (int64_t j = 0; j < len; j++) {
        const float* kj = row(k_cache, j);
        for (int64_t g = 0; g < group; g++) {
          vreg dot = {};
          for (int64_t c = 0; c < vecs; c++)
            dot += load_reg(qb + g * head_dim + kRegLanes * c) * load_reg(kj + kRegLanes * c);
          scores[g * len + j] = hsum_reg(dot) * scale;
        }
      }
      float* ob = out + (b * q_heads + h * group) * head_dim;
      for (int64_t g = 0; g < group; g++) {  // softmax over the scores, in place
        float* s = scores.data() + g * len;
        float top = s[0], total = 0.f;
        for (int64_t j = 1; j < len; j++) top = std::max(top, s[j]);
        for (int64_t j = 0; j < len; j++) total += (s[j] = std::exp(s[j] - top));
        for (int64_t j = 0; j < len; j++) s[j] /= total;
        std::memset(ob + g * head_dim, 0, head_dim * sizeof(float));
      }
      for (int64_t j = 0; j < len; j++) {
        const float* vj = row(v_cache, j);
        for (int64_t g = 0; g < group; g++) {
          const vreg p = splat_reg(scores[g * len + j]);
          for (int64_t c = 0; c < vecs; c++) {
            float* o = ob + g * head_dim + kRegLanes * c;
            store_reg(o, load_reg(o) + p * load_reg(vj + kRegLanes * c));
          }
        }
      }
    }
  }
}

}  // extern "C"
