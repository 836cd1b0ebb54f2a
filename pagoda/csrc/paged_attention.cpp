// Paged attention for decode steps (one query token per sequence, or a few: speculative verification), reading K/V
// in place from the paged cache through each sequence's block table: no gather, no padding. One task per
// (sequence, KV head), parallel with at::parallel_for: every key and value vector of that head is loaded (and
// dequantized) once for all the query rows that share it (GQA group x query tokens), and an online softmax
// (fp32 running max, denominator and accumulator per row) walks the context block by block. Sliding window,
// logit soft-capping and attention sinks are parameters. Cache entries are float32 / bfloat16 / float16, or the
// quantized formats of pagoda.quant.kv_cache_dtype: int8, fp8 e4m3 or e5m2 values followed by a float32 scale per
// (token, head), or fp8 e4m3 with one scale for the tensor; quantized vectors are widened in registers and their
// scale applied to the score or to the softmax weight, never to a dequantized copy of the cache.
#include <ATen/core/Tensor.h>
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>
#include <immintrin.h>
#include <cstdint>
#include "simd.h"

namespace {

using namespace pagoda_native;

enum class Element { f32, bf16, f16, i8, e4m3, e5m2 };

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kTile = 16;  // keys scored and accumulated together (within one cache block)

// fp8 formats as (mantissa bits, exponent bias); values are never NaN or infinite (the cache clamps them).
constexpr int mantissa_bits(Element e) { return e == Element::e4m3 ? 3 : 2; }
constexpr int exponent_bias(Element e) { return e == Element::e4m3 ? 7 : 15; }
// The value of the smallest subnormal step, 2^(1 - bias - mantissa bits).
constexpr float subnormal_step(Element e) { return e == Element::e4m3 ? 0x1p-9f : 0x1p-16f; }

inline float fp8_to_float(uint8_t byte, Element e) {
  const int mbits = mantissa_bits(e), bias = exponent_bias(e);
  const uint32_t magnitude = byte & 0x7F;
  float value;
  if ((magnitude >> mbits) == 0) {  // subnormal (or zero): m * 2^(1 - bias - mbits)
    value = static_cast<float>(magnitude) * subnormal_step(e);
  } else {
    const uint32_t bits = (magnitude << (23 - mbits)) + (static_cast<uint32_t>(127 - bias) << 23);
    std::memcpy(&value, &bits, sizeof(value));
  }
  return (byte & 0x80) ? -value : value;
}

inline float element_to_float(const uint8_t* p, int64_t i, Element e) {
  switch (e) {
    case Element::f32: return reinterpret_cast<const float*>(p)[i];
    case Element::bf16: return static_cast<float>(reinterpret_cast<const c10::BFloat16*>(p)[i]);
    case Element::f16: return static_cast<float>(reinterpret_cast<const c10::Half*>(p)[i]);
    case Element::i8: return static_cast<float>(reinterpret_cast<const int8_t*>(p)[i]);
    default: return fp8_to_float(p[i], e);
  }
}

// ---- AVX-512 ----

__attribute__((target("avx512f"))) inline __m512 fp8x16(const uint8_t* p, Element e) {
  const int mbits = mantissa_bits(e), bias = exponent_bias(e);
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i magnitude = _mm512_and_si512(bytes, _mm512_set1_epi32(0x7F));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(bytes, _mm512_set1_epi32(0x80)), 24);
  const __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(magnitude, 23 - mbits),
                                          _mm512_set1_epi32((127 - bias) << 23));
  const __m512 subnormal = _mm512_mul_ps(_mm512_cvtepi32_ps(magnitude), _mm512_set1_ps(subnormal_step(e)));
  const __mmask16 is_sub = _mm512_cmplt_epi32_mask(magnitude, _mm512_set1_epi32(1 << mbits));
  const __m512i value = _mm512_mask_blend_epi32(is_sub, normal, _mm512_castps_si512(subnormal));
  return _mm512_castsi512_ps(_mm512_or_si512(value, sign));
}

__attribute__((target("avx512f"))) inline __m512 load_element16(const uint8_t* p, int64_t i, Element e) {
  switch (e) {
    case Element::f32: return _mm512_loadu_ps(reinterpret_cast<const float*>(p) + i);
    case Element::bf16:
      return _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2 * i))), 16));
    case Element::f16: return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2 * i)));
    case Element::i8: return load16(reinterpret_cast<const int8_t*>(p) + i);
    default: return fp8x16(p + i, e);
  }
}

// exp(x) for x <= 0 (Cephes' polynomial after the range reduction); below -87 (and -inf) gives 0.
__attribute__((target("avx512f"))) inline __m512 exp16(__m512 x) {
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_LT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  const __m512i exponent = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~underflow), y, _mm512_castsi512_ps(exponent));
}

// Lane t of the result is the sum of a[t]'s 16 lanes: four levels of pairwise shuffles and adds, not 16 reductions.
__attribute__((target("avx512f"))) inline __m512 transpose_sum16(const __m512* a) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44), _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88), _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  // 128-bit lane k of c[j] now holds partial sums of a[4j + k].
  const __m512 d0 = _mm512_add_ps(_mm512_unpacklo_ps(c[0], c[1]), _mm512_unpackhi_ps(c[0], c[1]));
  const __m512 d1 = _mm512_add_ps(_mm512_unpacklo_ps(c[2], c[3]), _mm512_unpackhi_ps(c[2], c[3]));
  const __m512 e = _mm512_add_ps(
      _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(d0), _mm512_castps_pd(d1))),
      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(d0), _mm512_castps_pd(d1))));
  // Element 4k + m of e is the sum of a[4m + k].
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, e);
}

struct Avx512 {
  static constexpr int64_t width = 16;

  // out[t] = q . keys[t] for t < n <= 16.
  __attribute__((target("avx512f"))) static void tile_scores(const float* q, const float* const* keys, int64_t n,
                                                             int64_t d, float* out) {
    __m512 acc[16];
    for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 16) {
      const __mmask16 lanes = d - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (d - i)) - 1);
      const __m512 qv = _mm512_maskz_loadu_ps(lanes, q + i);
      for (int64_t t = 0; t < n; ++t) acc[t] = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(lanes, keys[t] + i), acc[t]);
    }
    _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << n) - 1), transpose_sum16(acc));
  }

  // acc[d] += sum over t < n of weights[t] * values[t].
  __attribute__((target("avx512f"))) static void tile_accumulate(float* acc, const float* weights,
                                                                 const float* const* values, int64_t n, int64_t d) {
    for (int64_t i = 0; i < d; i += 16) {
      const __mmask16 lanes = d - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (d - i)) - 1);
      __m512 a = _mm512_maskz_loadu_ps(lanes, acc + i);
      for (int64_t t = 0; t < n; ++t)
        a = _mm512_fmadd_ps(_mm512_set1_ps(weights[t]), _mm512_maskz_loadu_ps(lanes, values[t] + i), a);
      _mm512_mask_storeu_ps(acc + i, lanes, a);
    }
  }

  __attribute__((target("avx512f"))) static void to_float(const uint8_t* p, int64_t d, Element e, float* out) {
    int64_t i = 0;
    for (; i + 16 <= d; i += 16) _mm512_storeu_ps(out + i, load_element16(p, i, e));
    for (; i < d; ++i) out[i] = element_to_float(p, i, e);
  }

  __attribute__((target("avx512f"))) static float dot(const float* a, const float* b, int64_t d) {
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= d; i += 32) {
      s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
      s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), s1);
    }
    for (; i + 16 <= d; i += 16) s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
    float s = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
    for (; i < d; ++i) s += a[i] * b[i];
    return s;
  }

  // acc = acc * keep + weight * v
  __attribute__((target("avx512f"))) static void axpy(float* acc, float weight, const float* v, int64_t d) {
    const __m512 w = _mm512_set1_ps(weight);
    int64_t i = 0;
    for (; i + 16 <= d; i += 16) _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(w, _mm512_loadu_ps(v + i), _mm512_loadu_ps(acc + i)));
    for (; i < d; ++i) acc[i] += weight * v[i];
  }

  __attribute__((target("avx512f"))) static void scale(float* acc, float factor, int64_t d) {
    const __m512 f = _mm512_set1_ps(factor);
    int64_t i = 0;
    for (; i + 16 <= d; i += 16) _mm512_storeu_ps(acc + i, _mm512_mul_ps(f, _mm512_loadu_ps(acc + i)));
    for (; i < d; ++i) acc[i] *= factor;
  }

  // x = exp(x - shift) in place; returns the sum.
  __attribute__((target("avx512f"))) static float exp_sum(float* x, float shift, int64_t n) {
    const __m512 m = _mm512_set1_ps(shift);
    __m512 sum = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), m));
      _mm512_storeu_ps(x + i, e);
      sum = _mm512_add_ps(sum, e);
    }
    if (i < n) {
      const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_mask_loadu_ps(_mm512_set1_ps(kNegInf), tail, x + i), m));
      _mm512_mask_storeu_ps(x + i, tail, e);
      sum = _mm512_add_ps(sum, e);
    }
    return _mm512_reduce_add_ps(sum);
  }
};

// ---- AVX2 ----

__attribute__((target("avx2,fma"))) inline __m256 fp8x8(const uint8_t* p, Element e) {
  const int mbits = mantissa_bits(e), bias = exponent_bias(e);
  const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i magnitude = _mm256_and_si256(bytes, _mm256_set1_epi32(0x7F));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(bytes, _mm256_set1_epi32(0x80)), 24);
  const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(magnitude, 23 - mbits),
                                          _mm256_set1_epi32((127 - bias) << 23));
  const __m256 subnormal = _mm256_mul_ps(_mm256_cvtepi32_ps(magnitude), _mm256_set1_ps(subnormal_step(e)));
  const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(1 << mbits), magnitude);
  const __m256i value = _mm256_blendv_epi8(normal, _mm256_castps_si256(subnormal), is_sub);
  return _mm256_castsi256_ps(_mm256_or_si256(value, sign));
}

__attribute__((target("avx2,fma,f16c"))) inline __m256 load_element8(const uint8_t* p, int64_t i, Element e) {
  switch (e) {
    case Element::f32: return _mm256_loadu_ps(reinterpret_cast<const float*>(p) + i);
    case Element::bf16:
      return _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * i))), 16));
    case Element::f16: return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * i)));
    case Element::i8: return load8(reinterpret_cast<const int8_t*>(p) + i);
    default: return fp8x8(p + i, e);
  }
}

__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 x) {
  const __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(y, _mm256_castsi256_ps(exponent)));
}

// Tiles as one dot product or one update per key, for the ISAs without a transposed reduction.
template <typename Ops>
struct TileByKey {
  static void tile_scores(const float* q, const float* const* keys, int64_t n, int64_t d, float* out) {
    for (int64_t t = 0; t < n; ++t) out[t] = Ops::dot(q, keys[t], d);
  }
  static void tile_accumulate(float* acc, const float* weights, const float* const* values, int64_t n, int64_t d) {
    for (int64_t t = 0; t < n; ++t)
      if (weights[t] != 0.f) Ops::axpy(acc, weights[t], values[t], d);
  }
};

struct Avx2 : TileByKey<Avx2> {
  static constexpr int64_t width = 8;

  __attribute__((target("avx2,fma,f16c"))) static void to_float(const uint8_t* p, int64_t d, Element e, float* out) {
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) _mm256_storeu_ps(out + i, load_element8(p, i, e));
    for (; i < d; ++i) out[i] = element_to_float(p, i, e);
  }

  __attribute__((target("avx2,fma"))) static float dot(const float* a, const float* b, int64_t d) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= d; i += 16) {
      s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
      s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    for (; i + 8 <= d; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    float s = hsum8(_mm256_add_ps(s0, s1));
    for (; i < d; ++i) s += a[i] * b[i];
    return s;
  }

  __attribute__((target("avx2,fma"))) static void axpy(float* acc, float weight, const float* v, int64_t d) {
    const __m256 w = _mm256_set1_ps(weight);
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(w, _mm256_loadu_ps(v + i), _mm256_loadu_ps(acc + i)));
    for (; i < d; ++i) acc[i] += weight * v[i];
  }

  __attribute__((target("avx2,fma"))) static void scale(float* acc, float factor, int64_t d) {
    const __m256 f = _mm256_set1_ps(factor);
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) _mm256_storeu_ps(acc + i, _mm256_mul_ps(f, _mm256_loadu_ps(acc + i)));
    for (; i < d; ++i) acc[i] *= factor;
  }

  __attribute__((target("avx2,fma"))) static float exp_sum(float* x, float shift, int64_t n) {
    const __m256 m = _mm256_set1_ps(shift);
    __m256 sum = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), m));
      _mm256_storeu_ps(x + i, e);
      sum = _mm256_add_ps(sum, e);
    }
    float total = hsum8(sum);
    for (; i < n; ++i) {
      x[i] = std::exp(x[i] - shift);
      total += x[i];
    }
    return total;
  }
};

// ---- scalar ----

struct Scalar : TileByKey<Scalar> {
  static constexpr int64_t width = 1;

  static void to_float(const uint8_t* p, int64_t d, Element e, float* out) {
    for (int64_t i = 0; i < d; ++i) out[i] = element_to_float(p, i, e);
  }
  static float dot(const float* a, const float* b, int64_t d) {
    float s = 0.f;
    for (int64_t i = 0; i < d; ++i) s += a[i] * b[i];
    return s;
  }
  static void axpy(float* acc, float weight, const float* v, int64_t d) {
    for (int64_t i = 0; i < d; ++i) acc[i] += weight * v[i];
  }
  static void scale(float* acc, float factor, int64_t d) {
    for (int64_t i = 0; i < d; ++i) acc[i] *= factor;
  }
  static float exp_sum(float* x, float shift, int64_t n) {
    float total = 0.f;
    for (int64_t i = 0; i < n; ++i) {
      x[i] = std::exp(x[i] - shift);
      total += x[i];
    }
    return total;
  }
};

// ---- the attention ----

// Where one layer's K or V vectors are: byte strides of the cache [blocks, block_size, kv_heads, entry].
struct Cache {
  const uint8_t* base;
  int64_t block_stride, token_stride, head_stride;

  const uint8_t* entry(int32_t block, int64_t slot, int64_t head) const {
    return base + block * block_stride + slot * token_stride + head * head_stride;
  }
};

struct Problem {
  const float* query;  // [T, H, D] contiguous
  float* out;          // [T, H, D]
  Cache keys, values;
  Element element;
  bool per_token_scale;  // a float32 scale after each vector's head_dim values
  float tensor_scale;    // otherwise this one (1 for float caches)
  int64_t value_bytes;   // head_dim * element size: where the per-token scale sits
  int64_t entry_bytes;   // value_bytes and the scale, if any
  const int32_t* block_tables;
  int64_t max_blocks, block_size;
  const int64_t *query_starts, *query_lens, *seq_lens;
  int64_t num_heads, num_kv_heads, head_dim;
  float scale;
  int64_t window;   // 0: none
  float softcap;    // 0: none
  const float* sinks;  // [H] or null
};

inline float vector_scale(const Problem& p, const uint8_t* entry) {
  if (!p.per_token_scale) return p.tensor_scale;
  float s;
  std::memcpy(&s, entry + p.value_bytes, sizeof(s));
  return s;
}

// Per task scratch, reused across a thread's tasks.
struct Work {
  std::vector<float> buffer;
  std::vector<const float*> queries;
  std::vector<int64_t> first_visible, last_visible;
};

// One (sequence, KV head): every query row of that head's group (query tokens x heads sharing the KV head) over the
// visible context. Always inlined into each ISA's entry point, so the Ops calls inline there with its target.
template <typename Ops>
__attribute__((always_inline)) inline void attend_one(const Problem& p, int64_t seq, int64_t kv_head, Work& work) {
  const int64_t d = p.head_dim, group = p.num_heads / p.num_kv_heads;
  const int64_t qlen = p.query_lens[seq], seq_len = p.seq_lens[seq], start = p.query_starts[seq];
  const int64_t rows = qlen * group, bs = p.block_size;
  if (rows == 0) return;
  // buffer: acc [rows, d] | scores [rows, kTile] | max [rows] | denominator [rows] | widened k, v [2, kTile, d]
  work.buffer.assign(static_cast<size_t>(rows * d + rows * kTile + 2 * rows + 2 * kTile * d), 0.f);
  float* acc = work.buffer.data();
  float* scores = acc + rows * d;
  float* row_max = scores + rows * kTile;
  float* denom = row_max + rows;
  float* widened_keys = denom + rows;
  float* widened_values = widened_keys + kTile * d;
  std::fill(row_max, row_max + rows, kNegInf);
  // Row r = (query token j, head h of the group), r = j * group + h: its query at position seq_len - qlen + j sees
  // keys [first_visible[r], last_visible[r]].
  work.queries.resize(rows);
  work.first_visible.resize(rows);
  work.last_visible.resize(rows);
  for (int64_t j = 0, r = 0; j < qlen; ++j) {
    const int64_t position = seq_len - qlen + j;
    for (int64_t h = 0; h < group; ++h, ++r) {
      work.queries[r] = p.query + ((start + j) * p.num_heads + kv_head * group + h) * d;
      work.first_visible[r] = p.window > 0 ? std::max<int64_t>(0, position - p.window + 1) : 0;
      work.last_visible[r] = position;
    }
  }
  const float* const* queries = work.queries.data();
  const int64_t* first_visible = work.first_visible.data();
  const int64_t* last_visible = work.last_visible.data();
  const int32_t* table = p.block_tables + seq * p.max_blocks;
  const bool is_float32 = p.element == Element::f32;
  const bool softcap = p.softcap > 0.f;
  const float* keys[kTile];
  const float* values[kTile];
  float key_factor[kTile], value_factor[kTile], weights[kTile];
  // Tiles of up to kTile keys, none across a block boundary, from the first key any row sees.
  for (int64_t t0 = first_visible[0]; t0 < seq_len;) {
    const int64_t b = t0 / bs;
    const int64_t t1 = std::min({seq_len, (b + 1) * bs, t0 + kTile}), n = t1 - t0;
    const int32_t block = table[b];
    // The next tile's keys and values start coming from memory while this one computes (blocks are scattered
    // over the pool and a head's vectors strided, so the hardware prefetchers see no stream to follow).
    const int64_t next = std::min({seq_len, (t1 / bs + 1) * bs, t1 + kTile});
    for (int64_t t = t1; t < next; ++t) {
      const int32_t next_block = table[t / bs];
      const char* key = reinterpret_cast<const char*>(p.keys.entry(next_block, t % bs, kv_head));
      const char* value = reinterpret_cast<const char*>(p.values.entry(next_block, t % bs, kv_head));
      for (int64_t byte = 0; byte < p.entry_bytes; byte += 64) {
        _mm_prefetch(key + byte, _MM_HINT_T0);
        _mm_prefetch(value + byte, _MM_HINT_T0);
      }
    }
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* key = p.keys.entry(block, t - b * bs, kv_head);
      const uint8_t* value = p.values.entry(block, t - b * bs, kv_head);
      key_factor[t - t0] = vector_scale(p, key) * p.scale;
      value_factor[t - t0] = vector_scale(p, value);
      if (is_float32) {
        keys[t - t0] = reinterpret_cast<const float*>(key);
        values[t - t0] = reinterpret_cast<const float*>(value);
      } else {
        Ops::to_float(key, d, p.element, widened_keys + (t - t0) * d);
        Ops::to_float(value, d, p.element, widened_values + (t - t0) * d);
        keys[t - t0] = widened_keys + (t - t0) * d;
        values[t - t0] = widened_values + (t - t0) * d;
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* s = scores + r * kTile;
      Ops::tile_scores(queries[r], keys, n, d, s);
      float tile_max = kNegInf;
      for (int64_t i = 0; i < n; ++i) {
        float score = s[i] * key_factor[i];
        if (softcap) score = p.softcap * std::tanh(score / p.softcap);
        const int64_t t = t0 + i;
        s[i] = (t >= first_visible[r] && t <= last_visible[r]) ? score : kNegInf;
        tile_max = std::max(tile_max, s[i]);
      }
      const float new_max = std::max(row_max[r], tile_max);
      if (new_max == kNegInf) continue;  // nothing visible yet for this row
      if (new_max > row_max[r]) {
        const float correction = row_max[r] == kNegInf ? 0.f : std::exp(row_max[r] - new_max);
        denom[r] *= correction;
        Ops::scale(acc + r * d, correction, d);
        row_max[r] = new_max;
      }
      denom[r] += Ops::exp_sum(s, new_max, n);
      for (int64_t i = 0; i < n; ++i) weights[i] = s[i] * value_factor[i];
      Ops::tile_accumulate(acc + r * d, weights, values, n, d);
    }
    t0 = t1;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t head = kv_head * group + r % group;
    float total = denom[r], keep = 1.f;
    if (p.sinks != nullptr) {  // the sink joins the denominator and attends to nothing
      const float sink = p.sinks[head], m = std::max(row_max[r], sink);
      keep = row_max[r] == kNegInf ? 0.f : std::exp(row_max[r] - m);
      total = denom[r] * keep + std::exp(sink - m);
    }
    const float factor = total > 0.f ? keep / total : 0.f;
    float* o = p.out + ((start + r / group) * p.num_heads + head) * d;
    const float* a = acc + r * d;
    for (int64_t i = 0; i < d; ++i) o[i] = a[i] * factor;
  }
}

template <typename Ops>
void attend_range(const Problem& p, int64_t begin, int64_t end) {
  Work work;
  for (int64_t task = begin; task < end; ++task) attend_one<Ops>(p, task / p.num_kv_heads, task % p.num_kv_heads, work);
}

__attribute__((target("avx512f"))) void attend_avx512(const Problem& p, int64_t begin, int64_t end) {
  Work work;
  for (int64_t task = begin; task < end; ++task)
    attend_one<Avx512>(p, task / p.num_kv_heads, task % p.num_kv_heads, work);
}

__attribute__((target("avx2,fma,f16c"))) void attend_avx2(const Problem& p, int64_t begin, int64_t end) {
  Work work;
  for (int64_t task = begin; task < end; ++task)
    attend_one<Avx2>(p, task / p.num_kv_heads, task % p.num_kv_heads, work);
}

Isa requested_isa(const std::string& name) {
  const Isa active = active_isa();
  if (name.empty()) return active;
  Isa isa;
  if (name == "avx512") isa = Isa::avx512;
  else if (name == "avx2") isa = Isa::avx2;
  else if (name == "scalar") isa = Isa::scalar;
  else TORCH_CHECK(false, "paged_attention: isa must be avx512, avx2, scalar or empty, got ", name);
  TORCH_CHECK(static_cast<int>(isa) <= static_cast<int>(active), "paged_attention: this CPU does not run ", name);
  return isa;
}

Element element_of(const std::string& kv_element, const at::Tensor& cache) {
  if (kv_element.empty()) {
    switch (cache.scalar_type()) {
      case at::kFloat: return Element::f32;
      case at::kBFloat16: return Element::bf16;
      case at::kHalf: return Element::f16;
      default: TORCH_CHECK(false, "paged_attention: a float cache must be float32, bfloat16 or float16");
    }
  }
  TORCH_CHECK(cache.scalar_type() == at::kByte, "paged_attention: a quantized cache holds uint8 entries");
  if (kv_element == "int8") return Element::i8;
  if (kv_element == "fp8_e4m3") return Element::e4m3;
  if (kv_element == "fp8_e5m2") return Element::e5m2;
  TORCH_CHECK(false, "paged_attention: kv_element must be int8, fp8_e4m3, fp8_e5m2 or empty, got ", kv_element);
}

int64_t element_size(Element e) {
  switch (e) {
    case Element::f32: return 4;
    case Element::bf16:
    case Element::f16: return 2;
    default: return 1;
  }
}

Cache cache_of(const at::Tensor& cache) {
  const int64_t item = cache.element_size();
  return Cache{static_cast<const uint8_t*>(cache.data_ptr()), cache.stride(0) * item, cache.stride(1) * item,
               cache.stride(2) * item};
}

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                           const at::Tensor& block_tables, const at::Tensor& query_starts,
                           const at::Tensor& query_lens, const at::Tensor& seq_lens, double scale,
                           std::optional<int64_t> sliding_window, std::optional<double> softcap,
                           const std::optional<at::Tensor>& sinks, const std::string& kv_element,
                           bool kv_scale_per_token, double kv_tensor_scale, const std::string& isa_name) {
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == at::kFloat,
              "paged_attention: query must be float32 [T, H, D]");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes() &&
              value_cache.strides() == key_cache.strides() && value_cache.scalar_type() == key_cache.scalar_type(),
              "paged_attention: key and value caches must be alike [blocks, block_size, kv_heads, entry]");
  TORCH_CHECK(key_cache.stride(3) == 1, "paged_attention: cache entries must be contiguous");
  const Element element = element_of(kv_element, key_cache);
  const int64_t heads = query.size(1), kv_heads = key_cache.size(2), d = query.size(2);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "paged_attention: ", heads, " query heads over ", kv_heads,
              " KV heads");
  const int64_t value_bytes = d * element_size(element);
  const int64_t entry_bytes = key_cache.size(3) * key_cache.element_size();
  TORCH_CHECK(entry_bytes == value_bytes + (kv_scale_per_token ? 4 : 0), "paged_attention: cache entries of ",
              entry_bytes, " bytes do not hold head_dim ", d, kv_scale_per_token ? " values and a scale" : " values");
  TORCH_CHECK(!kv_scale_per_token || element == Element::i8 || element == Element::e4m3 || element == Element::e5m2,
              "paged_attention: per-token scales come with a quantized cache");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt,
              "paged_attention: block_tables must be int32 [R, max_blocks]");
  const int64_t reqs = block_tables.size(0);
  for (const at::Tensor* t : {&query_starts, &query_lens, &seq_lens})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == reqs && t->scalar_type() == at::kLong && t->device().is_cpu(),
                "paged_attention: query_starts, query_lens and seq_lens must be int64 [R] on the CPU");
  const at::Tensor q = query.contiguous(), tables = block_tables.contiguous();
  const at::Tensor starts = query_starts.contiguous(), lens = query_lens.contiguous(), seqs = seq_lens.contiguous();
  const int64_t block_size = key_cache.size(1), max_blocks = tables.size(1), tokens = q.size(0);
  for (int64_t i = 0; i < reqs; ++i) {
    const int64_t s = starts.data_ptr<int64_t>()[i], n = lens.data_ptr<int64_t>()[i], len = seqs.data_ptr<int64_t>()[i];
    TORCH_CHECK(n >= 0 && s >= 0 && s + n <= tokens && n <= len && len <= max_blocks * block_size,
                "paged_attention: request ", i, " has ", n, " query tokens at ", s, " over ", len,
                " keys (", tokens, " query rows, room for ", max_blocks * block_size, " keys)");
  }
  at::Tensor sinks_c;
  const float* sinks_ptr = nullptr;
  if (sinks.has_value() && sinks->defined()) {
    sinks_c = sinks->to(at::kFloat).contiguous();
    TORCH_CHECK(sinks_c.numel() == heads, "paged_attention: ", sinks_c.numel(), " sinks for ", heads, " heads");
    sinks_ptr = sinks_c.data_ptr<float>();
  }
  at::Tensor out = at::empty_like(q);
  Problem p{q.data_ptr<float>(), out.data_ptr<float>(), cache_of(key_cache), cache_of(value_cache), element,
            kv_scale_per_token, static_cast<float>(kv_tensor_scale), value_bytes, entry_bytes,
            tables.data_ptr<int32_t>(),
            max_blocks, block_size, starts.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), seqs.data_ptr<int64_t>(),
            heads, kv_heads, d, static_cast<float>(scale), sliding_window.value_or(0),
            static_cast<float>(softcap.value_or(0.0)), sinks_ptr};
  const Isa isa = requested_isa(isa_name);
  at::parallel_for(0, reqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    switch (isa) {
      case Isa::avx512: return attend_avx512(p, begin, end);
      case Isa::avx2: return attend_avx2(p, begin, end);
      default: return attend_range<Scalar>(p, begin, end);
    }
  });
  return out;
}

std::string family_paged_attention() { return "paged decode attention"; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(PAGODA_NATIVE_NAMESPACE, m) {
  m.def("family_paged_attention() -> str", &family_paged_attention);
  m.def("paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor query_starts, Tensor query_lens, Tensor seq_lens, float scale, int? sliding_window, float? softcap, "
        "Tensor? sinks, str kv_element, bool kv_scale_per_token, float kv_tensor_scale, str isa) -> Tensor",
        &paged_attention);
}
