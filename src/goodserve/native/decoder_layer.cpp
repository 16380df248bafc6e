// A decode step's decoder layers in one call, for models whose linears are int4: the same kernels
// the per-op path calls one by one (layer_ops.cpp, int4_gemv.cpp, decode_attention.cpp), chained
// here so a CPU decode step of a small model pays one Python call instead of a dozen per layer
// (each ~10-20 us around a kernel of similar size). Its reference is model/llama.py
// LlamaDecoderLayer.forward, layer after layer.
#include <cstring>
#include <vector>

#include "vec.h"

extern "C" {
int gs_int4_gemv(const float* x, int64_t ldx, const uint8_t* tiles, float* y, int64_t ldy, int64_t m_rows,
                 int64_t n, int64_t k, int64_t group_size, int max_threads, int int8_activations,
                 int half_scales);
void gs_add_rms_norm(const float* x, const float* residual, const float* weight, float* out, float* residual_out,
                     int64_t tokens, int64_t hidden, float eps);
void gs_silu_and_mul(const float* gate_up, float* out, int64_t tokens, int64_t inter);
void gs_rope_write_kv(float* q, int64_t q_stride, const float* k, int64_t k_stride, const float* v,
                      int64_t v_stride, const int32_t* positions, const float* table, const int32_t* slots,
                      float* k_cache, float* v_cache, int64_t tokens, int64_t q_heads, int64_t kv_heads,
                      int64_t head_dim);
void gs_decode_attention(const float* q, int64_t q_stride, const float* k_cache, const float* v_cache,
                         const int32_t* block_tables, int64_t bt_row, int64_t bt_col, const int32_t* seq_lens,
                         float* out, int64_t batch, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                         int64_t block_size, float scale, int64_t window, int max_threads);

// What stays fixed for a layer; native/decoder_layer.py mirrors it as a ctypes Structure.
struct LayerOperands {
  const float* input_norm;
  const float* post_norm;
  const uint8_t* qkv;  // int4 tiles (int4_gemv.cpp's layout), each linear with its group size
  const float* qkv_bias;  // null without one
  const uint8_t* o;
  const uint8_t* gate_up;
  const uint8_t* down;
  int64_t qkv_group, o_group, gate_up_group, down_group;
  int64_t hidden, inter, q_heads, kv_heads, head_dim;
  float eps, scale;
  int32_t int8_activations, half_scales;  // all four linears (gs_int4_gemv's flags)
};

namespace {

// x, residual (null in the first layer: then x is the residual), out, residual_out: [T, hidden];
// out may be x and residual_out residual (each is read before the other is written).
// One query token per sequence; the cache arguments as gs_decode_attention takes them.
void decoder_layer(const LayerOperands* w, const float* x, const float* residual, float* out,
                   float* residual_out, int64_t tokens, const int32_t* positions, const float* rotary,
                   const int32_t* slots, float* k_cache, float* v_cache, int64_t block_size,
                   const int32_t* block_tables, int64_t bt_row, int64_t bt_col, const int32_t* seq_lens,
                   int max_threads) {
  const int64_t hidden = w->hidden, inter = w->inter, q_size = w->q_heads * w->head_dim;
  const int64_t kv_size = w->kv_heads * w->head_dim, qkv_size = q_size + 2 * kv_size;
  thread_local std::vector<float> scratch;
  scratch.resize(tokens * (2 * hidden + qkv_size + q_size + 3 * inter));
  float* normed = scratch.data();
  float* qkv = normed + tokens * hidden;
  float* attn = qkv + tokens * qkv_size;
  float* o = attn + tokens * q_size;
  float* gate_up = o + tokens * hidden;
  float* act = gate_up + tokens * 2 * inter;

  if (residual) {
    gs_add_rms_norm(x, residual, w->input_norm, normed, residual_out, tokens, hidden, w->eps);
  } else {
    gs_add_rms_norm(x, nullptr, w->input_norm, normed, nullptr, tokens, hidden, w->eps);
    std::memcpy(residual_out, x, tokens * hidden * sizeof(float));
  }
  gs_int4_gemv(normed, hidden, w->qkv, qkv, qkv_size, tokens, qkv_size, hidden, w->qkv_group, max_threads,
               w->int8_activations, w->half_scales);
  if (w->qkv_bias)
    for (int64_t t = 0; t < tokens; t++)
      for (int64_t i = 0; i < qkv_size; i++) qkv[t * qkv_size + i] += w->qkv_bias[i];
  float* q = qkv;
  gs_rope_write_kv(q, qkv_size, q + q_size, qkv_size, q + q_size + kv_size, qkv_size, positions, rotary, slots,
                   k_cache, v_cache, tokens, w->q_heads, w->kv_heads, w->head_dim);
  gs_decode_attention(q, qkv_size, k_cache, v_cache, block_tables, bt_row, bt_col, seq_lens, attn, tokens,
                      w->q_heads, w->kv_heads, w->head_dim, block_size, w->scale, 0, max_threads);
  gs_int4_gemv(attn, q_size, w->o, o, hidden, tokens, hidden, q_size, w->o_group, max_threads, w->int8_activations,
               w->half_scales);
  gs_add_rms_norm(o, residual_out, w->post_norm, normed, residual_out, tokens, hidden, w->eps);  // in place
  gs_int4_gemv(normed, hidden, w->gate_up, gate_up, 2 * inter, tokens, 2 * inter, hidden, w->gate_up_group,
               max_threads, w->int8_activations, w->half_scales);
  gs_silu_and_mul(gate_up, act, tokens, inter);
  gs_int4_gemv(act, inter, w->down, out, hidden, tokens, hidden, inter, w->down_group, max_threads,
               w->int8_activations, w->half_scales);
}

}  // namespace

// Layers [0, n_layers) in order, layer i with its own K/V pools k_caches[i], v_caches[i]; x: the
// embeddings [T, hidden]; out, residual_out: the last layer's, as decoder_layer leaves them.
void gs_decoder_stack(const LayerOperands* layers, int64_t n_layers, float* const* k_caches,
                      float* const* v_caches, const float* x, float* out, float* residual_out, int64_t tokens,
                      const int32_t* positions, const float* rotary, const int32_t* slots, int64_t block_size,
                      const int32_t* block_tables, int64_t bt_row, int64_t bt_col, const int32_t* seq_lens,
                      int max_threads) {
  std::memcpy(out, x, tokens * layers[0].hidden * sizeof(float));
  for (int64_t i = 0; i < n_layers; i++)
    decoder_layer(&layers[i], out, i ? residual_out : nullptr, out, residual_out, tokens, positions, rotary, slots,
                  k_caches[i], v_caches[i], block_size, block_tables, bt_row, bt_col, seq_lens, max_threads);
}

}  // extern "C"
