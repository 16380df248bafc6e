// int4 GEMV / small GEMM with float32 activations: y[M, N] = x[M, K] W^T, W = codes * scale + zero
// per group of `group_size` inputs. Decode multiplies a few rows by every weight, so this streams
// the weights once and does everything else in registers. On the 2-core EPYC it is bound by
// instructions per code byte about as much as by memory, hence the table lookups (vec.h
// Int4Group), unrolled groups, and one sequential stream per tile for the prefetcher.
//
// Layout (built once by native/int4_gemv.py), rows in tiles of 4 (N padded with zero rows):
//   tile t, group g: 4 float32 scales, 4 float32 zeros (rows 4t..4t+3), then for each 32-input
//   chunk of the group 4 x 16 code bytes, one row after another.
// Byte j of a row's chunk holds input j in its low nibble and input j + 16 in its high one
// (llama.cpp's order), so one 16-byte load widens into two 16-lane vectors without shuffles.
#include "vec.h"

namespace {

constexpr int kChunk = 32;    // inputs per 16-byte chunk
constexpr int kRows = 4;      // weight rows per tile: independent accumulator chains
constexpr int kMaxXTile = 4;  // activation rows per pass: each dequantized chunk is used this often
constexpr int kPrefetchBytes = 1024;

struct Gemv {
  const float* x;
  int64_t ldx;
  const uint8_t* tiles;
  float* y;
  int64_t ldy, n, k, groups;
};

template <int CPG>
constexpr int64_t group_bytes() { return 2 * kRows * sizeof(float) + CPG * kRows * 16; }

// Tile t of W against activation rows [m0, m0 + MT); CPG chunks per group.
template <int CPG, int MT>
void tile(const Gemv& p, int64_t t, int64_t m0) {
  v16f acc[kRows][MT] = {};
  const float* x = p.x + m0 * p.ldx;
  const uint8_t* at = p.tiles + t * p.groups * group_bytes<CPG>();
  for (int64_t g = 0; g < p.groups; g++, at += group_bytes<CPG>()) {
    __builtin_prefetch(at + kPrefetchBytes);
    const float* scales = reinterpret_cast<const float*>(at);
    Int4Group dequant[kRows];
    for (int r = 0; r < kRows; r++) dequant[r] = Int4Group(scales[r], scales[kRows + r]);
    const uint8_t* codes = at + 2 * kRows * sizeof(float);
#pragma GCC unroll 4
    for (int c = 0; c < CPG; c++) {
      const int64_t col = (g * CPG + c) * kChunk;
      v16f xl[MT], xh[MT];
      for (int m = 0; m < MT; m++) {
        xl[m] = load16(x + m * p.ldx + col);
        xh[m] = load16(x + m * p.ldx + col + 16);
      }
      for (int r = 0; r < kRows; r++) {
        const v16i wide = widen16(codes + (c * kRows + r) * 16);
        const v16f lo = dequant[r](wide), hi = dequant[r](wide >> 4);
        for (int m = 0; m < MT; m++) {
          acc[r][m] += lo * xl[m];
          acc[r][m] += hi * xh[m];
        }
      }
    }
  }
  for (int r = 0; r < kRows && t * kRows + r < p.n; r++)
    for (int m = 0; m < MT; m++) p.y[(m0 + m) * p.ldy + t * kRows + r] = hsum16(acc[r][m]);
}

template <int CPG>
void gemv(const Gemv& p, int64_t m_rows, int threads) {
#pragma omp parallel num_threads(threads)
  {
    int64_t begin, end;
    thread_range((p.n + kRows - 1) / kRows, 1, &begin, &end);
    for (int64_t t = begin; t < end; t++) {
      int64_t m0 = 0;
      for (; m0 + kMaxXTile <= m_rows; m0 += kMaxXTile) tile<CPG, kMaxXTile>(p, t, m0);
      switch (m_rows - m0) {
        case 3: tile<CPG, 3>(p, t, m0); break;
        case 2: tile<CPG, 2>(p, t, m0); break;
        case 1: tile<CPG, 1>(p, t, m0); break;
      }
    }
  }
}

}  // namespace

extern "C" {

// x rows `ldx` floats apart, y rows `ldy` apart; k a multiple of group_size. Returns 0, or -1 for
// a group size other than 32, 64, 128.
int gs_int4_gemv(const float* x, int64_t ldx, const uint8_t* tiles, float* y, int64_t ldy, int64_t m_rows,
                 int64_t n, int64_t k, int64_t group_size, int max_threads) {
  const Gemv p{x, ldx, tiles, y, ldy, n, k, k / group_size};
  // ~0.1 ns per weight and activation row on one core (int4 gate_up of smollm2: ~60 us).
  const int threads = threads_for(n * k * m_rows / 16, 1, max_threads);
  switch (group_size) {
    case 32: gemv<1>(p, m_rows, threads); return 0;
    case 64: gemv<2>(p, m_rows, threads); return 0;
    case 128: gemv<4>(p, m_rows, threads); return 0;
  }
  return -1;
}

}  // extern "C"
