// Shared helpers: 16-float vectors as GCC vector extensions. With -march=native they become one
// AVX-512 register, two AVX2 ones elsewhere; the kernels are written once for both.
#pragma once
#include <immintrin.h>
#include <omp.h>

#include <algorithm>

#include <cstdint>
#include <cstring>
#include <type_traits>

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));

static inline v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof v);  // unaligned load
  return v;
}

static inline void store16(float* p, v16f v) { std::memcpy(p, &v, sizeof v); }

// A broadcast (`v16f{} + x` would add 0.0, and GCC turns a loop of lane stores into 16 of them).
static inline v16f splat16(float x) { return v16f{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

// 16 bytes widened to 16 int32 lanes, sign-extended for int8_t and zero-extended for uint8_t
// (GCC scalarizes __builtin_convertvector of bytes).
template <typename Byte>
static inline v16i widen16(const Byte* p) {
  static_assert(sizeof(Byte) == 1, "bytes only");
  constexpr bool is_signed = std::is_signed_v<Byte>;
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
#if defined(__AVX512F__)
  return (v16i)(is_signed ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes));
#elif defined(__AVX2__)
  const __m128i upper = _mm_srli_si128(bytes, 8);
  const __m256i lo = is_signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
  const __m256i hi = is_signed ? _mm256_cvtepi8_epi32(upper) : _mm256_cvtepu8_epi32(upper);
  v16i out;
  std::memcpy(&out, &lo, sizeof lo);
  std::memcpy(reinterpret_cast<char*>(&out) + sizeof lo, &hi, sizeof hi);
  return out;
#else
  v16i out;
  for (int i = 0; i < 16; i++) out[i] = p[i];
  return out;
#endif
}

// A float16's bits (GGUF's scales and zeros are float16), read as float32 where the CPU converts
// them (F16C); kHalfScales says whether this build can.
struct Half {
  uint16_t bits;
};
static inline float to_float(float s) { return s; }
static inline __m128 load4(const float* p) { return _mm_loadu_ps(p); }
#if defined(__F16C__)
constexpr int kHalfScales = 1;
static inline float to_float(Half h) { return _cvtsh_ss(h.bits); }
static inline __m128 load4(const Half* p) {
  return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
#else
constexpr int kHalfScales = 0;
#endif

// One int4 group's 16 code values, dequantized: lookups then cost one permute per 16 weights
// (AVX-512's vpermps reads only the low 4 bits of each index, so no mask either); without
// AVX-512, a convert and a multiply-add.
struct Int4Group {
  v16f table, scale, zero;
  Int4Group() = default;
  Int4Group(float s, float z) : scale(splat16(s)), zero(splat16(z)) {
    const v16f iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    table = iota * scale + zero;
  }
  // Lanes' low 4 bits are codes; higher bits are ignored.
  v16f operator()(v16i codes) const {
#if defined(__AVX512F__)
    return (v16f)_mm512_permutexvar_ps((__m512i)codes, (__m512)table);
#else
    return __builtin_convertvector(codes & 15, v16f) * scale + zero;
#endif
  }
};

#if defined(__AVX2__)
static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

static inline float hsum16(v16f v) {
  v8f lo, hi;
  std::memcpy(&lo, &v, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
  const v8f s = lo + hi;
#if defined(__AVX2__)
  return hsum8((__m256)s);  // shuffles, not eight dependent scalar adds: attention takes one per key
#else
  float total = 0.f;
  for (int i = 0; i < 8; i++) total += s[i];
  return total;
#endif
}

// One register of floats: 16 lanes with AVX-512, else 8. A 16-lane vector without AVX-512 is a
// register pair that GCC keeps in memory in loops holding a few of them live (decode attention's
// per-key dot went through the stack, every key); loops written in vreg avoid that.
#if defined(__AVX512F__)
typedef v16f vreg;
static inline vreg splat_reg(float x) { return splat16(x); }
static inline float hsum_reg(vreg v) { return hsum16(v); }
#else
typedef v8f vreg;
static inline vreg splat_reg(float x) { return v8f{x, x, x, x, x, x, x, x}; }
#if defined(__AVX2__)
static inline float hsum_reg(vreg v) { return hsum8((__m256)v); }
#else
static inline float hsum_reg(vreg v) {
  float total = 0.f;
  for (int i = 0; i < 8; i++) total += v[i];
  return total;
}
#endif
#endif
constexpr int kRegLanes = sizeof(vreg) / sizeof(float);
static inline vreg load_reg(const float* p) {
  vreg v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
static inline void store_reg(float* p, vreg v) { std::memcpy(p, &v, sizeof v); }

// e^x to ~2 float32 ulp (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial in r,
// then 2^n into the exponent bits); inputs below -87 flush to 0, as softmax and SiLU want.
static inline v16f exp16(v16f x) {
  x = x < splat16(88.3f) ? x : splat16(88.3f);
  const v16i underflow = x < splat16(-87.3f);
  const v16f n = __builtin_convertvector(__builtin_convertvector(x * splat16(1.44269504f) +
      (x < splat16(0.f) ? splat16(-0.5f) : splat16(0.5f)), v16i), v16f);
  const v16f r = x - n * splat16(0.693359375f) + n * splat16(2.12194440e-4f);
  v16f p = splat16(1.9875691500e-4f);
  p = p * r + splat16(1.3981999507e-3f);
  p = p * r + splat16(8.3334519073e-3f);
  p = p * r + splat16(4.1665795894e-2f);
  p = p * r + splat16(1.6666665459e-1f);
  p = p * r + splat16(5.0000001201e-1f);
  p = p * r * r + r + splat16(1.f);
  v16i bits = (__builtin_convertvector(n, v16i) + 127) << 23;
  v16f scale;
  std::memcpy(&scale, &bits, sizeof scale);
  const v16f out = p * scale;
  return underflow ? splat16(0.f) : out;
}

// Threads for `work` units of roughly `unit_cost` ns each: fork/join costs a few microseconds,
// so small calls stay on the calling thread.
static inline int threads_for(int64_t work, int64_t unit_cost, int max_threads) {
  const int64_t min_ns_per_thread = 5000;
  int64_t useful = work * unit_cost / min_ns_per_thread;
  if (useful < 1) return 1;
  return useful < max_threads ? static_cast<int>(useful) : max_threads;
}

// [begin, end) of `count` units, split evenly over the team, each share a multiple of `align`.
static inline void thread_range(int64_t count, int64_t align, int64_t* begin, int64_t* end) {
  const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
  const int64_t units = (count + align - 1) / align;
  *begin = std::min(count, units * t / threads * align);
  *end = std::min(count, units * (t + 1) / threads * align);
}

// Weight tiles [0, tiles) split over a team of `threads`, each tile against all m_rows activation
// rows in passes of up to kMaxRowPass: run(t, m0, std::integral_constant<int, rows in the pass>).
constexpr int kMaxRowPass = 4;
template <typename Run>
static inline void for_tiles(int64_t tiles, int64_t m_rows, int threads, Run run) {
#pragma omp parallel num_threads(threads)
  {
    int64_t begin, end;
    thread_range(tiles, 1, &begin, &end);
    for (int64_t t = begin; t < end; t++) {
      int64_t m0 = 0;
      for (; m0 + kMaxRowPass <= m_rows; m0 += kMaxRowPass) run(t, m0, std::integral_constant<int, kMaxRowPass>{});
      switch (m_rows - m0) {
        case 3: run(t, m0, std::integral_constant<int, 3>{}); break;
        case 2: run(t, m0, std::integral_constant<int, 2>{}); break;
        case 1: run(t, m0, std::integral_constant<int, 1>{}); break;
      }
    }
  }
}
