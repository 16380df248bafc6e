// int4 GEMV / small GEMM with float32 activations: y[M, N] = x[M, K] W^T, W = codes * scale + zero
// per group of `group_size` inputs. Decode multiplies a few rows by every weight, so this streams
// the weights once and does everything else in registers. On the 2-core EPYC it is bound by
// instructions per code byte about as much as by memory, hence the table lookups (vec.h
// Int4Group), unrolled groups, and one sequential stream per tile for the prefetcher.
//
// Layout (built once by native/int4_gemv.py), rows in tiles of 4 (N padded with zero rows):
//   tile t, group g: 4 scales, 4 zeros (rows 4t..4t+3; float16 where all are, as GGUF's: at group
//   32 that is 80 bytes a group-tile instead of 96), then for each 32-input
//   chunk of the group 4 x 16 code bytes, one row after another.
// Byte j of a row's chunk holds input j in its low nibble and input j + 16 in its high one
// (llama.cpp's order), so one 16-byte load widens into two 16-lane vectors without shuffles.
//
// With int8_activations (the GGUF layers, as llama.cpp computes them), each activation row is first
// quantized per 32-input block to int8 with one float scale (llama.cpp's Q8 blocks), and each
// chunk's dot product is 64 integer multiply-adds of codes (u8) by activations (s8): one AVX-512
// VNNI vpdpbusd per 16 x 4 of them (two maddubs / madd without VNNI), several times fewer
// instructions than dequantizing to float. w = q s + z makes a group's dot s * (q . x) + z * sum(x),
// both over the quantized row (x = d q), so the result is the dequantized weight times that row:
// what the many-row (prefill) calls compute with a dense matmul, so a row's result does not
// depend on which path its batch took. AVX-512BW takes a tile's 4 rows in one register, AVX2 in
// two (maddubs / madd, or AVX-VNNI's dpbusd); machines with neither keep the float path
// (gs_int8_dot_available() says which).
#include <cmath>
#include <vector>

#include "vec.h"

namespace {

constexpr int kChunk = 32;    // inputs per 16-byte chunk
constexpr int kRows = 4;      // weight rows per tile: independent accumulator chains
constexpr int kPrefetchBytes = 1024;

struct Gemv {
  const float* x;
  int64_t ldx;
  const uint8_t* tiles;
  float* y;
  int64_t ldy, n, k, groups;
};

// Scale: float, or Half (float16 bits) where every scale and zero is a float16 (GGUF's are).
template <typename Scale, int CPG>
constexpr int64_t group_bytes() { return 2 * kRows * sizeof(Scale) + CPG * kRows * 16; }

// Tile t of W against activation rows [m0, m0 + MT); CPG chunks per group.
template <typename Scale, int CPG, int MT>
void tile(const Gemv& p, int64_t t, int64_t m0) {
  v16f acc[kRows][MT] = {};
  const float* x = p.x + m0 * p.ldx;
  const uint8_t* at = p.tiles + t * p.groups * group_bytes<Scale, CPG>();
  for (int64_t g = 0; g < p.groups; g++, at += group_bytes<Scale, CPG>()) {
    __builtin_prefetch(at + kPrefetchBytes);
    const Scale* scales = reinterpret_cast<const Scale*>(at);
    Int4Group dequant[kRows];
    for (int r = 0; r < kRows; r++) dequant[r] = Int4Group(to_float(scales[r]), to_float(scales[kRows + r]));
    const uint8_t* codes = at + 2 * kRows * sizeof(Scale);
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

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define GS_AVX2_TILE 1

// Each activation row's sum over each group: the zero term of every weight row's dot with it.
struct GroupSums {
  std::vector<float> sum;
  void compute(const float* x, int64_t ldx, int64_t m_rows, int64_t k, int64_t group_size) {
    const int64_t groups = k / group_size;
    sum.resize(m_rows * groups);
    for (int64_t m = 0; m < m_rows; m++)
      for (int64_t g = 0; g < groups; g++) {
        __m256 s = _mm256_setzero_ps();
        for (int64_t j = 0; j < group_size; j += 8) s += _mm256_loadu_ps(x + m * ldx + g * group_size + j);
        sum[m * groups + g] = hsum8(s);
      }
  }
};

// Without AVX-512, GCC splits vec.h's 16-lane vectors into pairs of AVX2 registers and, with a
// tile's scales, zeros and accumulators live, spills them to the stack every chunk (the generic
// tile measured 2x slower than llama.cpp on a Zen 3). Here everything is 8 lanes wide and a group's
// dot is taken as w = q s + z makes it: s (q . x) + z sum(x), so a code costs a convert and a
// multiply-add instead of a dequantization as well; sum(x) comes once per call (GroupSums).
template <typename Scale, int CPG, int MT>
void tile_avx2(const Gemv& p, const GroupSums& sums, int64_t t, int64_t m0) {
  __m256 acc[kRows][MT];
  __m128 zacc[MT];
  for (int m = 0; m < MT; m++) {
    zacc[m] = _mm_setzero_ps();
    for (int r = 0; r < kRows; r++) acc[r][m] = _mm256_setzero_ps();
  }
  const __m256i low_nibble = _mm256_set1_epi32(0x0F);
  const float* x = p.x + m0 * p.ldx;
  const uint8_t* at = p.tiles + t * p.groups * group_bytes<Scale, CPG>();
  for (int64_t g = 0; g < p.groups; g++, at += group_bytes<Scale, CPG>()) {
    __builtin_prefetch(at + kPrefetchBytes);
    const Scale* scales = reinterpret_cast<const Scale*>(at);
    const __m128 zeros = load4(scales + kRows);
    for (int m = 0; m < MT; m++)
      zacc[m] = _mm_fmadd_ps(zeros, _mm_set1_ps(sums.sum[(m0 + m) * p.groups + g]), zacc[m]);
    const uint8_t* codes = at + 2 * kRows * sizeof(Scale);
    __m256 dots[kRows][MT];
    for (int r = 0; r < kRows; r++)
      for (int m = 0; m < MT; m++) dots[r][m] = _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int c = 0; c < CPG; c++) {
      const float* xc = x + (g * CPG + c) * kChunk;
      for (int r = 0; r < kRows; r++) {
        // Bytes 0-7 and 8-15 of the row's chunk: inputs 0-7 / 8-15 in the low nibbles, 16-23 / 24-31 high.
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + (c * kRows + r) * 16));
        const __m256i first = _mm256_cvtepu8_epi32(bytes), second = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));
        const __m256 q0 = _mm256_cvtepi32_ps(_mm256_and_si256(first, low_nibble));
        const __m256 q1 = _mm256_cvtepi32_ps(_mm256_and_si256(second, low_nibble));
        const __m256 q2 = _mm256_cvtepi32_ps(_mm256_srli_epi32(first, 4));
        const __m256 q3 = _mm256_cvtepi32_ps(_mm256_srli_epi32(second, 4));
        for (int m = 0; m < MT; m++) {
          const float* xm = xc + m * p.ldx;
          __m256 d = _mm256_fmadd_ps(q0, _mm256_loadu_ps(xm), dots[r][m]);
          d = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xm + 8), d);
          d = _mm256_fmadd_ps(q2, _mm256_loadu_ps(xm + 16), d);
          dots[r][m] = _mm256_fmadd_ps(q3, _mm256_loadu_ps(xm + 24), d);
        }
      }
    }
    for (int r = 0; r < kRows; r++) {
      const __m256 s = _mm256_set1_ps(to_float(scales[r]));
      for (int m = 0; m < MT; m++) acc[r][m] = _mm256_fmadd_ps(dots[r][m], s, acc[r][m]);
    }
  }
  for (int m = 0; m < MT; m++) {
    float zero_terms[kRows];
    _mm_storeu_ps(zero_terms, zacc[m]);
    for (int r = 0; r < kRows && t * kRows + r < p.n; r++) {
      p.y[(m0 + m) * p.ldy + t * kRows + r] = hsum8(acc[r][m]) + zero_terms[r];
    }
  }
}
#endif

template <typename Scale, int CPG>
void gemv(const Gemv& p, int64_t m_rows, int threads) {
#if defined(GS_AVX2_TILE)
  thread_local GroupSums calling_threads;
  calling_threads.compute(p.x, p.ldx, m_rows, p.k, p.k / p.groups);
  const GroupSums* sums = &calling_threads;  // the team reads the calling thread's, not their own
  for_tiles((p.n + kRows - 1) / kRows, m_rows, threads,
            [&](int64_t t, int64_t m0, auto rows) { tile_avx2<Scale, CPG, decltype(rows)::value>(p, *sums, t, m0); });
#else
  for_tiles((p.n + kRows - 1) / kRows, m_rows, threads,
            [&](int64_t t, int64_t m0, auto rows) { tile<Scale, CPG, decltype(rows)::value>(p, t, m0); });
#endif
}

#if defined(__AVX512BW__) || (defined(__AVX2__) && defined(__FMA__))
#define GS_INT8_DOT 1

// Activation rows as int8 blocks of 32 (scale d = max |x| / 127, q = round(x / d)) and each
// block's d * sum(q), for the zero term; rows `k` codes apart. AVX2 for every build: a row is a
// few hundred floats a call, and its rounding must match quantize_activation_blocks' bit for bit.
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> d, sum;
  void quantize(const float* x, int64_t ldx, int64_t m_rows, int64_t k) {
    const int64_t blocks = k / kChunk;
    q.resize(m_rows * k);
    d.resize(m_rows * blocks);
    sum.resize(m_rows * blocks);
    const __m256 sign_bit = _mm256_set1_ps(-0.f);
    for (int64_t m = 0; m < m_rows; m++)
      for (int64_t b = 0; b < blocks; b++) {
        const float* xb = x + m * ldx + b * kChunk;
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
          v[i] = _mm256_loadu_ps(xb + 8 * i);
          amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, v[i]));
        }
        __m128 top = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        top = _mm_max_ps(top, _mm_movehl_ps(top, top));
        const float block_max = _mm_cvtss_f32(_mm_max_ss(top, _mm_movehdup_ps(top)));
        const __m256 scale = _mm256_set1_ps(block_max > 0.f ? 127.f / block_max : 0.f);
        __m256i qi[4], total = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {  // cvtps rounds to nearest even, as torch.round
          qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], scale));
          total = _mm256_add_epi32(total, qi[i]);
        }
        // |q| <= 127, so the saturating packs are exact; they interleave 128-bit lanes, the permute undoes it.
        const __m256i bytes = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3])),
            _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.data() + m * k + b * kChunk), bytes);
        __m128i s = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
        d[m * blocks + b] = block_max / 127.f;
        sum[m * blocks + b] = block_max / 127.f * static_cast<float>(_mm_cvtsi128_si32(s));
      }
  }
};

// A chunk's codes of the tile's 4 rows (16 bytes each) in as few registers as the width allows;
// in each, lane group j (lanes 4j..4j+3) belongs to one weight row, and lane i of an integer dot is
// the sum over k < 4 of w[4i + k] * x[4i + k] (w unsigned, x signed bytes). A lane thus holds the
// same 8 products on either width, so both give the same floats.
#if defined(__AVX512BW__)
struct Int8Lanes {  // one 512-bit register: the 4 rows
  using I = __m512i;
  using F = __m512;
  static constexpr int kRowsPerReg = 4;
  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I low_nibbles(I w) { return _mm512_and_si512(w, _mm512_set1_epi8(0x0F)); }
  static I high_nibbles(I w) { return _mm512_and_si512(_mm512_srli_epi16(w, 4), _mm512_set1_epi8(0x0F)); }
  static I broadcast16(const int8_t* p) { return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  // lo . xl + hi . xh per lane
  static I dot(I lo, I xl, I hi, I xh) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xl), hi, xh);
#else  // products <= 15 * 127: a pair's sum, and two pairs', fit int16
    return _mm512_madd_epi16(_mm512_add_epi16(_mm512_maddubs_epi16(lo, xl), _mm512_maddubs_epi16(hi, xh)),
                             _mm512_set1_epi16(1));
#endif
  }
  static F fmadd_dot(I dot, F scale, F acc) { return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc); }
  static F zero() { return _mm512_setzero_ps(); }
  static F times(F v, float d) { return _mm512_mul_ps(v, _mm512_set1_ps(d)); }
  static void row_scales(__m128 s, F* out) {
    out[0] = _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                                   _mm512_castps128_ps512(s));
  }
  static __m128 row_sums(const F* acc) {
    const __m128 r01 = _mm_hadd_ps(_mm512_extractf32x4_ps(acc[0], 0), _mm512_extractf32x4_ps(acc[0], 1));
    const __m128 r23 = _mm_hadd_ps(_mm512_extractf32x4_ps(acc[0], 2), _mm512_extractf32x4_ps(acc[0], 3));
    return _mm_hadd_ps(r01, r23);
  }
};
#else
struct Int8Lanes {  // two 256-bit registers: rows 0-1, rows 2-3
  using I = __m256i;
  using F = __m256;
  static constexpr int kRowsPerReg = 2;
  static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I low_nibbles(I w) { return _mm256_and_si256(w, _mm256_set1_epi8(0x0F)); }
  static I high_nibbles(I w) { return _mm256_and_si256(_mm256_srli_epi16(w, 4), _mm256_set1_epi8(0x0F)); }
  static I broadcast16(const int8_t* p) { return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I dot(I lo, I xl, I hi, I xh) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), lo, xl), hi, xh);
#else
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh)),
                             _mm256_set1_epi16(1));
#endif
  }
  static F fmadd_dot(I dot, F scale, F acc) { return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc); }
  static F zero() { return _mm256_setzero_ps(); }
  static F times(F v, float d) { return _mm256_mul_ps(v, _mm256_set1_ps(d)); }
  static void row_scales(__m128 s, F* out) {
    out[0] = _mm256_set_m128(_mm_shuffle_ps(s, s, 0x55), _mm_shuffle_ps(s, s, 0x00));
    out[1] = _mm256_set_m128(_mm_shuffle_ps(s, s, 0xFF), _mm_shuffle_ps(s, s, 0xAA));
  }
  static __m128 row_sums(const F* acc) {
    const __m128 r01 = _mm_hadd_ps(_mm256_castps256_ps128(acc[0]), _mm256_extractf128_ps(acc[0], 1));
    const __m128 r23 = _mm_hadd_ps(_mm256_castps256_ps128(acc[1]), _mm256_extractf128_ps(acc[1], 1));
    return _mm_hadd_ps(r01, r23);
  }
};
#endif

struct QGemv {
  const QuantizedRows* x;
  const uint8_t* tiles;
  float* y;
  int64_t ldy, n, k, groups;
};

// Tile t (4 weight rows) against quantized rows [m0, m0 + MT).
template <typename Scale, int CPG, int MT>
void qtile(const QGemv& p, int64_t t, int64_t m0) {
  using L = Int8Lanes;
  constexpr int kRegs = kRows / L::kRowsPerReg, kRegBytes = 16 * L::kRowsPerReg;
  const int64_t blocks = p.k / kChunk;
  typename L::F acc[MT][kRegs];
  __m128 zacc[MT];
  for (int m = 0; m < MT; m++) {
    zacc[m] = _mm_setzero_ps();
    for (int i = 0; i < kRegs; i++) acc[m][i] = L::zero();
  }
  const uint8_t* at = p.tiles + t * p.groups * group_bytes<Scale, CPG>();
  for (int64_t g = 0; g < p.groups; g++, at += group_bytes<Scale, CPG>()) {
    __builtin_prefetch(at + kPrefetchBytes);
    const Scale* sz = reinterpret_cast<const Scale*>(at);
    typename L::F scales[kRegs];
    L::row_scales(load4(sz), scales);
    const __m128 zeros = load4(sz + kRows);
    const uint8_t* codes = at + 2 * kRows * sizeof(Scale);
    for (int m = 0; m < MT; m++) {
      const float* sums = p.x->sum.data() + (m0 + m) * blocks + g * CPG;
      float group_sum = 0.f;
      for (int c = 0; c < CPG; c++) group_sum += sums[c];
      zacc[m] = _mm_fmadd_ps(zeros, _mm_set1_ps(group_sum), zacc[m]);
    }
#pragma GCC unroll 4
    for (int c = 0; c < CPG; c++) {
      typename L::I lo[kRegs], hi[kRegs];
      for (int i = 0; i < kRegs; i++) {
        const typename L::I w = L::load(codes + c * kRows * 16 + i * kRegBytes);
        lo[i] = L::low_nibbles(w), hi[i] = L::high_nibbles(w);
      }
      const int64_t block = g * CPG + c;
      for (int m = 0; m < MT; m++) {
        const int8_t* xq = p.x->q.data() + (m0 + m) * p.k + block * kChunk;
        const typename L::I xl = L::broadcast16(xq), xh = L::broadcast16(xq + 16);
        const float d = p.x->d[(m0 + m) * blocks + block];
        for (int i = 0; i < kRegs; i++) acc[m][i] = L::fmadd_dot(L::dot(lo[i], xl, hi[i], xh), L::times(scales[i], d), acc[m][i]);
      }
    }
  }
  for (int m = 0; m < MT; m++) {
    float out[kRows];
    _mm_storeu_ps(out, L::row_sums(acc[m]) + zacc[m]);
    for (int r = 0; r < kRows && t * kRows + r < p.n; r++) p.y[(m0 + m) * p.ldy + t * kRows + r] = out[r];
  }
}

template <typename Scale, int CPG>
void qgemv(const QGemv& p, int64_t m_rows, int threads) {
  for_tiles((p.n + kRows - 1) / kRows, m_rows, threads,
            [&](int64_t t, int64_t m0, auto rows) { qtile<Scale, CPG, decltype(rows)::value>(p, t, m0); });
}

template <typename Scale>
int int8_gemv(const float* x, int64_t ldx, const uint8_t* tiles, float* y, int64_t ldy, int64_t m_rows, int64_t n,
              int64_t k, int64_t group_size, int threads) {
  thread_local QuantizedRows rows;
  rows.quantize(x, ldx, m_rows, k);
  const QGemv p{&rows, tiles, y, ldy, n, k, k / group_size};
  switch (group_size) {
    case 32: qgemv<Scale, 1>(p, m_rows, threads); return 0;
    case 64: qgemv<Scale, 2>(p, m_rows, threads); return 0;
    case 128: qgemv<Scale, 4>(p, m_rows, threads); return 0;
  }
  return -1;
}
#endif

template <typename Scale>
int float_gemv(const Gemv& p, int64_t m_rows, int64_t group_size, int threads) {
  switch (group_size) {
    case 32: gemv<Scale, 1>(p, m_rows, threads); return 0;
    case 64: gemv<Scale, 2>(p, m_rows, threads); return 0;
    case 128: gemv<Scale, 4>(p, m_rows, threads); return 0;
  }
  return -1;
}

template <typename Scale>
int int4_gemv(const float* x, int64_t ldx, const uint8_t* tiles, float* y, int64_t ldy, int64_t m_rows,
              int64_t n, int64_t k, int64_t group_size, int threads, int int8_activations) {
  if (int8_activations) {
#if defined(GS_INT8_DOT)
    return int8_gemv<Scale>(x, ldx, tiles, y, ldy, m_rows, n, k, group_size, threads);
#else
    return -2;
#endif
  }
  return float_gemv<Scale>(Gemv{x, ldx, tiles, y, ldy, n, k, k / group_size}, m_rows, group_size, threads);
}

}  // namespace

extern "C" {

int gs_int8_dot_available() {
#if defined(GS_INT8_DOT)
  return 1;
#else
  return 0;
#endif
}

int gs_half_scales_available() { return kHalfScales; }

// x rows `ldx` floats apart, y rows `ldy` apart; k a multiple of group_size; tiles with float32
// scales and zeros, or float16 ones with half_scales. Returns 0, -1 for a group size other than
// 32, 64, 128, -2 for int8_activations where this build has no such path, -3 for half_scales
// where it has no float16 conversion.
int gs_int4_gemv(const float* x, int64_t ldx, const uint8_t* tiles, float* y, int64_t ldy, int64_t m_rows,
                 int64_t n, int64_t k, int64_t group_size, int max_threads, int int8_activations, int half_scales) {
  // ~0.1 ns per weight and activation row on one core (int4 gate_up of smollm2: ~60 us).
  const int threads = threads_for(n * k * m_rows / 16, 1, max_threads);
  if (!half_scales)
    return int4_gemv<float>(x, ldx, tiles, y, ldy, m_rows, n, k, group_size, threads, int8_activations);
#if defined(__F16C__)
  return int4_gemv<Half>(x, ldx, tiles, y, ldy, m_rows, n, k, group_size, threads, int8_activations);
#else
  return -3;
#endif
}

}  // extern "C"
