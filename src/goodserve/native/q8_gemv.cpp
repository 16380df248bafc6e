// Q8_0 GEMV / small GEMM with float32 activations: y[M, N] = x[M, K] W^T, W = d q per block of 32
// inputs (llama.cpp's Q8_0: int8 codes q, a float16 scale d per block). The tied lm_head of the
// GGUF models is Q8_0, the largest matrix a decode step of a small model reads: as int8 it is 1.125
// bytes a weight where two int4 halves (quant/gguf_native.py) are 1.5, and each weight costs a
// widening convert, a multiply by its block's scale (exact in float32: an 11-bit by 8-bit product)
// and a multiply-add, so the product is the dequantized weight's.
//
// Layout (built once by native/q8_gemv.py), rows in tiles of 4 (N padded with zero rows):
//   tile t, block b: 4 float32 scales (rows 4t..4t+3), then 4 x 32 codes, one row after another.
#include "vec.h"

namespace {

constexpr int kBlock = 32;    // inputs per scale
constexpr int kRows = 4;      // weight rows per tile: independent accumulator chains
constexpr int kPrefetchBytes = 1024;
constexpr int64_t kBlockBytes = kRows * (sizeof(float) + kBlock);

struct Q8Gemv {
  const float* x;
  int64_t ldx;
  const uint8_t* tiles;
  float* y;
  int64_t ldy, n, blocks;
};

// Tile t's blocks in order: run(block, its 4 rows' scales, their codes).
template <typename Run>
inline void for_blocks(const Q8Gemv& p, int64_t t, Run run) {
  const uint8_t* at = p.tiles + t * p.blocks * kBlockBytes;
  for (int64_t b = 0; b < p.blocks; b++, at += kBlockBytes) {
    __builtin_prefetch(at + kPrefetchBytes);
    run(b, reinterpret_cast<const float*>(at), reinterpret_cast<const int8_t*>(at + kRows * sizeof(float)));
  }
}

// Tile t of W against activation rows [m0, m0 + MT).
template <int MT>
void tile(const Q8Gemv& p, int64_t t, int64_t m0) {
  v16f acc[kRows][MT] = {};
  const float* x = p.x + m0 * p.ldx;
  for_blocks(p, t, [&](int64_t b, const float* scales, const int8_t* codes) {
    v16f xl[MT], xh[MT];
    for (int m = 0; m < MT; m++) {
      xl[m] = load16(x + m * p.ldx + b * kBlock);
      xh[m] = load16(x + m * p.ldx + b * kBlock + 16);
    }
    for (int r = 0; r < kRows; r++) {
      const v16f d = splat16(scales[r]);
      const v16f lo = __builtin_convertvector(widen16(codes + r * kBlock), v16f) * d;
      const v16f hi = __builtin_convertvector(widen16(codes + r * kBlock + 16), v16f) * d;
      for (int m = 0; m < MT; m++) {
        acc[r][m] += lo * xl[m];
        acc[r][m] += hi * xh[m];
      }
    }
  });
  for (int r = 0; r < kRows && t * kRows + r < p.n; r++)
    for (int m = 0; m < MT; m++) p.y[(m0 + m) * p.ldy + t * kRows + r] = hsum16(acc[r][m]);
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define GS_AVX2_TILE 1
// Without AVX-512 the 16-lane tile above spills its 2-register vectors every block (as int4_gemv.cpp's
// does): 8 lanes here, and a block's scale applied once to its dot, d (q . x), not to every code.
template <int MT>
void tile_avx2(const Q8Gemv& p, int64_t t, int64_t m0) {
  __m256 acc[kRows][MT];
  for (int r = 0; r < kRows; r++)
    for (int m = 0; m < MT; m++) acc[r][m] = _mm256_setzero_ps();
  const float* x = p.x + m0 * p.ldx;
  for_blocks(p, t, [&](int64_t b, const float* scales, const int8_t* codes) {
    for (int r = 0; r < kRows; r++) {
      __m256 q[4];
      for (int j = 0; j < 4; j++)
        q[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + r * kBlock + 8 * j))));
      const __m256 d = _mm256_set1_ps(scales[r]);
      for (int m = 0; m < MT; m++) {
        const float* xm = x + m * p.ldx + b * kBlock;
        __m256 dot = _mm256_mul_ps(q[0], _mm256_loadu_ps(xm));
        for (int j = 1; j < 4; j++) dot = _mm256_fmadd_ps(q[j], _mm256_loadu_ps(xm + 8 * j), dot);
        acc[r][m] = _mm256_fmadd_ps(dot, d, acc[r][m]);
      }
    }
  });
  for (int r = 0; r < kRows && t * kRows + r < p.n; r++)
    for (int m = 0; m < MT; m++) p.y[(m0 + m) * p.ldy + t * kRows + r] = hsum8(acc[r][m]);
}
#endif

}  // namespace

extern "C" {

// x rows `ldx` floats apart, y rows `ldy` apart; k a multiple of 32.
void gs_q8_gemv(const float* x, int64_t ldx, const uint8_t* tiles, float* y, int64_t ldy, int64_t m_rows,
                int64_t n, int64_t k, int max_threads) {
  // ~0.1 ns per weight and activation row on one core, as the int4 kernel.
  const int threads = threads_for(n * k * m_rows / 16, 1, max_threads);
  const Q8Gemv p{x, ldx, tiles, y, ldy, n, k / kBlock};
  for_tiles((n + kRows - 1) / kRows, m_rows, threads, [&](int64_t t, int64_t m0, auto rows) {
#if defined(GS_AVX2_TILE)
    tile_avx2<decltype(rows)::value>(p, t, m0);
#else
    tile<decltype(rows)::value>(p, t, m0);
#endif
  });
}

}  // extern "C"
