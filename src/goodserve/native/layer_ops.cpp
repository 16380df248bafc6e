// The small per-token ops of a decoder layer, one native call each instead of 3-10 torch ops
// (a CPU decode step of a small model is mostly per-op dispatch): RMSNorm with the residual add,
// SiLU(gate) * up, and RoPE fused with the K/V cache write. float32 throughout; the torch
// references are ops/norm.py, ops/activation.py and ops/attention.py (rotary_write_kv_torch).
#include <cmath>

#include "vec.h"

namespace {

// Elementwise over [0, n): whole 16-lane vectors, then the tail one lane at a time.
template <typename Vec, typename Lane>
inline void for_lanes(int64_t n, Vec vec, Lane lane) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) vec(i);
  for (; i < n; i++) lane(i);
}

}  // namespace

extern "C" {

// residual_out = x + residual (residual may be null: then residual_out is null too and x is
// normed as it is); out = weight * residual_out / rms(residual_out). All [T, H] contiguous.
void gs_add_rms_norm(const float* x, const float* residual, const float* weight, float* out, float* residual_out,
                     int64_t tokens, int64_t hidden, float eps) {
  for (int64_t t = 0; t < tokens; t++) {
    const float* xt = x + t * hidden;
    float* sum = residual ? residual_out + t * hidden : nullptr;
    if (residual) {
      const float* rt = residual + t * hidden;
      for_lanes(hidden, [&](int64_t i) { store16(sum + i, load16(xt + i) + load16(rt + i)); },
                [&](int64_t i) { sum[i] = xt[i] + rt[i]; });
      xt = sum;
    }
    v16f squares = {};
    float tail = 0.f;
    for_lanes(hidden, [&](int64_t i) { const v16f v = load16(xt + i); squares += v * v; },
              [&](int64_t i) { tail += xt[i] * xt[i]; });
    const float inv = 1.f / std::sqrt((hsum16(squares) + tail) / hidden + eps);
    float* o = out + t * hidden;
    for_lanes(hidden, [&](int64_t i) { store16(o + i, load16(weight + i) * (load16(xt + i) * inv)); },
              [&](int64_t i) { o[i] = weight[i] * (xt[i] * inv); });
  }
}

// out [T, I] = silu(gate_up[:, :I]) * gate_up[:, I:]
void gs_silu_and_mul(const float* gate_up, float* out, int64_t tokens, int64_t inter) {
  for (int64_t t = 0; t < tokens; t++) {
    const float* gate = gate_up + t * 2 * inter;
    const float* up = gate + inter;
    float* o = out + t * inter;
    for_lanes(inter, [&](int64_t i) {
      const v16f g = load16(gate + i);
      store16(o + i, g / (splat16(1.f) + exp16(-g)) * load16(up + i));
    }, [&](int64_t i) { o[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i]; });
  }
}

// RoPE (rotate-half layout; table row p = cos | sin, D/2 each) on q in place and on k, then the
// rotated k and v into cache slot slots[t] ([slots, Hk, D] pools; -1: padding, not written).
// q, k, v: [T, heads, D] with token strides in floats (views of one qkv row).
void gs_rope_write_kv(float* q, int64_t q_stride, const float* k, int64_t k_stride, const float* v,
                      int64_t v_stride, const int32_t* positions, const float* table, const int32_t* slots,
                      float* k_cache, float* v_cache, int64_t tokens, int64_t q_heads, int64_t kv_heads,
                      int64_t head_dim) {
  const int64_t half = head_dim / 2;
  auto rotate = [&](const float* src, float* dst, const float* cos, const float* sin) {
    for (int64_t i = 0; i < half; i++) {
      const float x1 = src[i], x2 = src[i + half];
      dst[i] = x1 * cos[i] - x2 * sin[i];
      dst[i + half] = x2 * cos[i] + x1 * sin[i];
    }
  };
  for (int64_t t = 0; t < tokens; t++) {
    const float* cos = table + static_cast<int64_t>(positions[t]) * head_dim;
    const float* sin = cos + half;
    for (int64_t h = 0; h < q_heads; h++) {
      float* qh = q + t * q_stride + h * head_dim;
      rotate(qh, qh, cos, sin);
    }
    if (slots[t] < 0) continue;
    const int64_t slot = static_cast<int64_t>(slots[t]) * kv_heads * head_dim;
    for (int64_t h = 0; h < kv_heads; h++) rotate(k + t * k_stride + h * head_dim, k_cache + slot + h * head_dim, cos, sin);
    std::memcpy(v_cache + slot, v + t * v_stride, kv_heads * head_dim * sizeof(float));
  }
}

}  // extern "C"
