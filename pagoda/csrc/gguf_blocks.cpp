// GGUF tensors served from their own bytes, with products as llama.cpp computes them: the activation rows are
// quantized once to 8-bit blocks (Q8_0-style blocks of 32 for the legacy types, Q8_K-style blocks of 256 for the
// K-quants and IQ4_XS), and each weight block's integer codes are multiplied with them in integers (AVX512-VNNI
// `vpdpbusd`, AVX2 `vpmaddubsw`, or scalar code), the block scales applied per block in float32.
//
// Every supported type decodes a block into the same shape: unsigned codes u (0..255, one per value) and, per group of
// 16 values, a scale ds and an offset dm, so that w = ds * u + dm (Q4_0: u = q, ds = d, dm = -8d; Q4_K: ds = d * sc,
// dm = -dmin * m; Q8_0: u = q + 128, dm = -128d; ...). With an activation block of scale da, codes a and per-group
// sums S, a group contributes da * (ds * sum(u * a) + dm * S) - llama.cpp's formulas, the mins of the K-quants and
// Q4_1/Q5_1 through the activation's block sums. The integer dot product is then one kernel for every type: a tile of
// weight rows is decoded once into a small scratch (codes, scales and offsets per group of 16 values) and
// reused against every row of x (the tiled path of a prefill; a decode step of a few rows takes the same path, its
// cost then the decode and one pass of dot products). Parallel over tiles of output rows with at::parallel_for.
//
// Each ISA body carries its own target attribute and is picked at run time (`isa`: "" for the CPU's best).
#include <ATen/core/Tensor.h>
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <vector>
#include <immintrin.h>
#include "simd.h"

namespace {

using namespace pagoda_native;

// ggml's type ids (gguf.GGMLQuantizationType).
enum : int64_t {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
  kIQ4_NL = 20, kIQ4_XS = 23,
};

struct TypeInfo {
  int64_t values;  // per block
  int64_t bytes;   // per block
  bool k_blocks;   // activation in blocks of 256 (Q8_K); else blocks of 32 (Q8_0)
  bool wide;       // codes reach 128..255 (Q8_0, IQ4): AVX2's saturating vpmaddubsw needs the sign trick
};

TypeInfo type_info(int64_t type) {
  switch (type) {
    case kQ4_0: return {32, 18, false, false};
    case kQ4_1: return {32, 20, false, false};
    case kQ5_0: return {32, 22, false, false};
    case kQ5_1: return {32, 24, false, false};
    case kQ8_0: return {32, 34, false, true};
    case kIQ4_NL: return {32, 18, false, true};
    case kQ2_K: return {256, 84, true, false};
    case kQ3_K: return {256, 110, true, false};
    case kQ4_K: return {256, 144, true, false};
    case kQ5_K: return {256, 176, true, false};
    case kQ6_K: return {256, 210, true, false};
    case kIQ4_XS: return {256, 136, true, true};
    default: TORCH_CHECK(false, "gguf blocks: type ", type, " has no native product");
  }
  return {0, 0, false, false};
}

#define PAGODA_INLINE inline __attribute__((always_inline))

constexpr int64_t kGroup = 16;  // values per (ds, dm) group
constexpr int64_t kLane = 4;    // values per int32 lane of a dot product
constexpr int64_t kTileRows = 4;  // weight rows decoded together
constexpr int64_t kXRows = 4;     // rows of x per pass over a decoded tile

// GCC's _Float16: one vcvtph2ps where the caller's target has F16C (the AVX2 and AVX-512 decoders), a libgcc
// call elsewhere.
PAGODA_INLINE float fp16(const uint8_t* p) {
  _Float16 half;
  std::memcpy(&half, p, 2);
  return static_cast<float>(half);
}

inline uint32_t u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// ---- block decoders: u[values], ds[values / 16], dm[values / 16] --------------------------------------------------

// SSE2 (every x86-64 CPU has it): compilers leave these byte loops scalar.
PAGODA_INLINE void nibbles_at(const uint8_t* q, uint8_t* __restrict__ low, uint8_t* __restrict__ high) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)), mask = _mm_set1_epi8(0x0F);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(low), _mm_and_si128(v, mask));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(high), _mm_and_si128(_mm_srli_epi16(v, 4), mask));
}

PAGODA_INLINE void nibbles(const uint8_t* q, uint8_t* __restrict__ u) { nibbles_at(q, u, u + 16); }

// 0x10 in byte j where bit j of `bits` is set, for j < 32 (Q5's fifth bit).
PAGODA_INLINE void fifth_bits(uint32_t bits, uint8_t* __restrict__ u) {
  __m128i v = _mm_cvtsi32_si128(static_cast<int>(bits));
  v = _mm_unpacklo_epi8(v, v);
  v = _mm_unpacklo_epi16(v, v);  // byte b of bits four times, b = 0..3
  const __m128i select = _mm_set_epi8(-128, 64, 32, 16, 8, 4, 2, 1, -128, 64, 32, 16, 8, 4, 2, 1);
  const __m128i sixteen = _mm_set1_epi8(0x10);
  const __m128i halves[2] = {_mm_unpacklo_epi32(v, v), _mm_unpackhi_epi32(v, v)};  // bytes 0, 1 / 2, 3 eight times
  for (int h = 0; h < 2; ++h) {
    const __m128i set = _mm_cmpeq_epi8(_mm_and_si128(halves[h], select), select);
    __m128i* out = reinterpret_cast<__m128i*>(u + 16 * h);
    _mm_storeu_si128(out, _mm_or_si128(_mm_loadu_si128(out), _mm_and_si128(set, sixteen)));
  }
}

PAGODA_INLINE void set2(float* ds, float* dm, float d, float m) {
  ds[0] = ds[1] = d;
  dm[0] = dm[1] = m;
}

PAGODA_INLINE void decode_q4_0(const uint8_t* b, uint8_t* u, float* ds, float* dm) {
  const float d = fp16(b);
  nibbles(b + 2, u);
  set2(ds, dm, d, -8.f * d);
}

PAGODA_INLINE void decode_q4_1(const uint8_t* b, uint8_t* u, float* ds, float* dm) {
  nibbles(b + 4, u);
  set2(ds, dm, fp16(b), fp16(b + 2));
}

PAGODA_INLINE void fives(const uint8_t* q, uint32_t qh, uint8_t* __restrict__ u) {
  nibbles(q, u);
  fifth_bits(qh, u);
}

PAGODA_INLINE void decode_q5_0(const uint8_t* b, uint8_t* u, float* ds, float* dm) {
  const float d = fp16(b);
  fives(b + 6, u32(b + 2), u);
  set2(ds, dm, d, -16.f * d);
}

PAGODA_INLINE void decode_q5_1(const uint8_t* b, uint8_t* u, float* ds, float* dm) {
  fives(b + 8, u32(b + 4), u);
  set2(ds, dm, fp16(b), fp16(b + 2));
}

PAGODA_INLINE void decode_q8_0(const uint8_t* b, uint8_t* u, float* ds, float* dm) {
  const float d = fp16(b);
  const __m128i flip = _mm_set1_epi8(-128);
  for (int h = 0; h < 2; ++h)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(u + 16 * h),
                     _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 + 16 * h)), flip));
  set2(ds, dm, d, -128.f * d);
}

PAGODA_INLINE void iq4_nibbles(const uint8_t* q, uint8_t* u) {
  for (int j = 0; j < 16; ++j) {
    u[j] = static_cast<uint8_t>(kIQ4Values[q[j] & 0x0F] + 128);
    u[j + 16] = static_cast<uint8_t>(kIQ4Values[q[j] >> 4] + 128);
  }
}

PAGODA_INLINE void decode_iq4_nl(const uint8_t* b, uint8_t* u, float* ds, float* dm) {
  const float d = fp16(b);
  iq4_nibbles(b + 2, u);
  set2(ds, dm, d, -128.f * d);
}

PAGODA_INLINE void decode_q2_k(const uint8_t* b, uint8_t* __restrict__ u, float* ds, float* dm) {
  const uint8_t* scales = b;
  const uint8_t* q = b + 16;
  const float d = fp16(b + 80), dmin = fp16(b + 82);
  int g = 0;
  for (int n = 0; n < 2; ++n, q += 32) {
    for (int shift = 0; shift < 8; shift += 2) {
      for (int half = 0; half < 2; ++half, ++g) {
        const uint8_t sc = scales[g];
        ds[g] = d * static_cast<float>(sc & 0x0F);
        dm[g] = -dmin * static_cast<float>(sc >> 4);
        for (int l = 0; l < 16; ++l) u[g * 16 + l] = (q[l + 16 * half] >> shift) & 3;
      }
    }
  }
}

PAGODA_INLINE void decode_q3_k(const uint8_t* b, uint8_t* __restrict__ u, float* ds, float* dm) {
  const uint8_t* hm = b;
  const uint8_t* q = b + 32;
  const float d = fp16(b + 108);
  uint32_t aux[4];
  std::memcpy(aux, b + 96, 12);
  const uint32_t kmask1 = 0x03030303, kmask2 = 0x0f0f0f0f, tmp = aux[2];
  aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
  aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
  aux[0] = (aux[0] & kmask2) | (((tmp >> 0) & kmask1) << 4);
  aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
  int8_t sc[16];
  std::memcpy(sc, aux, 16);
  int g = 0;
  uint8_t m = 1;
  for (int n = 0; n < 2; ++n, q += 32) {
    for (int shift = 0; shift < 8; shift += 2, m <<= 1) {
      for (int half = 0; half < 2; ++half, ++g) {
        const float dl = d * static_cast<float>(sc[g] - 32);
        ds[g] = dl;
        dm[g] = -4.f * dl;
        for (int l = 0; l < 16; ++l) {
          const int i = l + 16 * half;
          u[g * 16 + l] = static_cast<uint8_t>(((q[i] >> shift) & 3) + ((hm[i] & m) ? 4 : 0));
        }
      }
    }
  }
}

// The 6-bit scale and min of sub-block j (of 8) of a Q4_K/Q5_K block (ggml's get_scale_min_k4).
PAGODA_INLINE void scale_min_k4(int j, const uint8_t* q, uint8_t& sc, uint8_t& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

PAGODA_INLINE void k4_scales(const uint8_t* b, float* ds, float* dm) {
  const float d = fp16(b), dmin = fp16(b + 2);
  for (int j = 0; j < 8; ++j) {
    uint8_t sc, m;
    scale_min_k4(j, b + 4, sc, m);
    set2(ds + 2 * j, dm + 2 * j, d * static_cast<float>(sc), -dmin * static_cast<float>(m));
  }
}

PAGODA_INLINE void decode_q4_k(const uint8_t* b, uint8_t* __restrict__ u, float* ds, float* dm) {
  k4_scales(b, ds, dm);
  const uint8_t* q = b + 16;
  for (int g = 0; g < 4; ++g, q += 32)
    for (int h = 0; h < 2; ++h) nibbles_at(q + 16 * h, u + 64 * g + 16 * h, u + 64 * g + 32 + 16 * h);
}

PAGODA_INLINE void decode_q5_k(const uint8_t* b, uint8_t* __restrict__ u, float* ds, float* dm) {
  k4_scales(b, ds, dm);
  const uint8_t* qh = b + 16;
  const uint8_t* q = b + 48;
  for (int g = 0; g < 4; ++g, q += 32) {
    const uint8_t lo = static_cast<uint8_t>(1u << (2 * g)), hi = static_cast<uint8_t>(2u << (2 * g));
    for (int l = 0; l < 32; ++l) {
      u[64 * g + l] = static_cast<uint8_t>((q[l] & 0x0F) + ((qh[l] & lo) ? 16 : 0));
      u[64 * g + 32 + l] = static_cast<uint8_t>((q[l] >> 4) + ((qh[l] & hi) ? 16 : 0));
    }
  }
}

PAGODA_INLINE void decode_q6_k(const uint8_t* b, uint8_t* __restrict__ u, float* ds, float* dm) {
  const float d = fp16(b + 208);
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  for (int g = 0; g < 16; ++g) {
    ds[g] = d * static_cast<float>(sc[g]);
    dm[g] = -32.f * ds[g];
  }
  for (int n = 0; n < 2; ++n) {
    const uint8_t* ql = b + 64 * n;
    const uint8_t* qh = b + 128 + 32 * n;
    uint8_t* y = u + 128 * n;
    for (int l = 0; l < 32; ++l) {
      y[l] = static_cast<uint8_t>((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4));
      y[l + 32] = static_cast<uint8_t>((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4));
      y[l + 64] = static_cast<uint8_t>((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
      y[l + 96] = static_cast<uint8_t>((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
    }
  }
}

PAGODA_INLINE void decode_iq4_xs(const uint8_t* b, uint8_t* u, float* ds, float* dm) {
  const float d = fp16(b);
  uint16_t scales_h;
  std::memcpy(&scales_h, b + 2, 2);
  const uint8_t* scales_l = b + 4;
  const uint8_t* q = b + 8;
  for (int ib = 0; ib < 8; ++ib, q += 16) {
    const int ls = ((scales_l[ib / 2] >> (4 * (ib % 2))) & 0x0F) | (((scales_h >> (2 * ib)) & 3) << 4);
    const float dl = d * static_cast<float>(ls - 32);
    set2(ds + 2 * ib, dm + 2 * ib, dl, -128.f * dl);
    iq4_nibbles(q, u + 32 * ib);
  }
}

// A tile's decoded rows: codes [rows][K], group scales and offsets [rows][K / 16].
struct Scratch {
  std::vector<uint8_t> u;
  std::vector<float> ds, dm;
  Scratch(int64_t rows, int64_t k) : u(rows * k), ds(rows * k / kGroup), dm(rows * k / kGroup) {}
};

template <void (*Decode)(const uint8_t*, uint8_t*, float*, float*), int64_t QK, int64_t Bytes>
PAGODA_INLINE void decode_row_body(const uint8_t* __restrict__ row, int64_t k, uint8_t* __restrict__ u,
                                   float* __restrict__ ds, float* __restrict__ dm) {
  for (int64_t b = 0; b < k / QK; ++b) Decode(row + b * Bytes, u + b * QK, ds + b * (QK / kGroup), dm + b * (QK / kGroup));
}

#define PAGODA_DECODE_ROW(isa_attr, suffix)                                                                       \
  template <void (*Decode)(const uint8_t*, uint8_t*, float*, float*), int64_t QK, int64_t Bytes>                  \
  isa_attr void decode_row_##suffix(const uint8_t* row, int64_t k, uint8_t* u, float* ds, float* dm) {            \
    decode_row_body<Decode, QK, Bytes>(row, k, u, ds, dm);                                                        \
  }
PAGODA_DECODE_ROW(__attribute__((target("avx512f,avx512bw,avx512vl,f16c"))), avx512)
PAGODA_DECODE_ROW(__attribute__((target("avx2,fma,f16c"))), avx2)
PAGODA_DECODE_ROW(, scalar)
#undef PAGODA_DECODE_ROW

using RowDecoder = void (*)(const uint8_t*, int64_t, uint8_t*, float*, float*);

template <void (*Decode)(const uint8_t*, uint8_t*, float*, float*), int64_t QK, int64_t Bytes>
RowDecoder row_decoder_for(Isa isa) {
  switch (isa) {
    case Isa::avx512: return &decode_row_avx512<Decode, QK, Bytes>;
    case Isa::avx2: return &decode_row_avx2<Decode, QK, Bytes>;
    default: return &decode_row_scalar<Decode, QK, Bytes>;
  }
}

RowDecoder row_decoder(int64_t type, Isa isa) {
  switch (type) {
    case kQ4_0: return row_decoder_for<decode_q4_0, 32, 18>(isa);
    case kQ4_1: return row_decoder_for<decode_q4_1, 32, 20>(isa);
    case kQ5_0: return row_decoder_for<decode_q5_0, 32, 22>(isa);
    case kQ5_1: return row_decoder_for<decode_q5_1, 32, 24>(isa);
    case kQ8_0: return row_decoder_for<decode_q8_0, 32, 34>(isa);
    case kIQ4_NL: return row_decoder_for<decode_iq4_nl, 32, 18>(isa);
    case kQ2_K: return row_decoder_for<decode_q2_k, 256, 84>(isa);
    case kQ3_K: return row_decoder_for<decode_q3_k, 256, 110>(isa);
    case kQ4_K: return row_decoder_for<decode_q4_k, 256, 144>(isa);
    case kQ5_K: return row_decoder_for<decode_q5_k, 256, 176>(isa);
    case kQ6_K: return row_decoder_for<decode_q6_k, 256, 210>(isa);
    case kIQ4_XS: return row_decoder_for<decode_iq4_xs, 256, 136>(isa);
    default: TORCH_CHECK(false, "gguf blocks: type ", type, " has no native product");
  }
  return nullptr;
}

// ---- the activation: int8 codes [M][K], block scale per group [M][K / 16], group sums times it [M][K / 16] ----

struct Activation {
  const int8_t* a;
  const float* ag;
  const float* as;
  int64_t k;
};

void quantize_row(const float* x, int64_t k, bool k_blocks, int8_t* a, float* ag, float* as) {
  const int64_t qk = k_blocks ? 256 : 32;
  for (int64_t b = 0; b < k / qk; ++b) {
    const float* xb = x + b * qk;
    int8_t* ab = a + b * qk;
    float d;
    if (k_blocks) {  // ggml's quantize_row_q8_K_ref
      float max = 0.f, amax = 0.f;
      for (int64_t j = 0; j < qk; ++j) {
        const float ax = std::fabs(xb[j]);
        if (ax > amax) {
          amax = ax;
          max = xb[j];
        }
      }
      if (amax == 0.f) {
        d = 0.f;
        std::memset(ab, 0, qk);
      } else {
        const float iscale = -127.f / max;
        for (int64_t j = 0; j < qk; ++j)
          ab[j] = static_cast<int8_t>(std::min(127, static_cast<int>(std::nearbyint(iscale * xb[j]))));
        d = 1.f / iscale;
      }
    } else {  // ggml's quantize_row_q8_0_ref: the scale stored (and used) as float16
      float amax = 0.f;
      for (int64_t j = 0; j < qk; ++j) amax = std::max(amax, std::fabs(xb[j]));
      const float dq = amax / 127.f, id = dq != 0.f ? 1.f / dq : 0.f;
      for (int64_t j = 0; j < qk; ++j) ab[j] = static_cast<int8_t>(std::round(xb[j] * id));
      d = static_cast<float>(c10::Half(dq));
    }
    for (int64_t g = 0; g < qk / kGroup; ++g) {
      int sum = 0;
      for (int64_t j = 0; j < kGroup; ++j) sum += ab[g * kGroup + j];
      ag[b * (qk / kGroup) + g] = d;
      as[b * (qk / kGroup) + g] = d * static_cast<float>(sum);
    }
  }
}

// ---- dot products of R decoded rows with C rows of x: acc[r * C + c] ---------------------------------------------

// One 64-value step: the codes' dot products per lane of 4 (vpdpbusd), times the weight's and the activation's
// scale of each lane's group (4 groups per step, each spread over its 4 lanes by one permute).
template <int R, int C>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) inline void vnni_step(
    const uint8_t* u, const float* ds, const Activation& x, int64_t x0, int64_t k, int64_t groups, int64_t i,
    __mmask64 bytes, __mmask8 quads, __m512 (&s)[R][C]) {
  const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  __m512i av[C];
  __m128 agv[C];
  _Pragma("GCC unroll 4") for (int c = 0; c < C; ++c) {
    av[c] = _mm512_maskz_loadu_epi8(bytes, x.a + (x0 + c) * k + i);
    agv[c] = _mm_maskz_loadu_ps(quads, x.ag + (x0 + c) * groups + i / kGroup);
  }
  _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) {
    const __m512i uv = _mm512_maskz_loadu_epi8(bytes, u + r * k + i);
    const __m128 dsv = _mm_maskz_loadu_ps(quads, ds + r * groups + i / kGroup);
    _Pragma("GCC unroll 4") for (int c = 0; c < C; ++c) {
      const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), uv, av[c]);
      const __m512 scale = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_mul_ps(dsv, agv[c])));
      s[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), scale, s[r][c]);
    }
  }
}

template <int R, int C>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void dot_vnni(const uint8_t* u, const float* ds,
                                                                            const float* dm, const Activation& x,
                                                                            int64_t x0, float* acc) {
  const int64_t k = x.k, groups = k / kGroup;
  __m512 s[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) s[r][c] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 64 <= k; i += 64) vnni_step<R, C>(u, ds, x, x0, k, groups, i, ~__mmask64{0}, 0x0F, s);
  if (i < k) vnni_step<R, C>(u, ds, x, x0, k, groups, i, __mmask64{0xFFFFFFFFu}, 0x03, s);  // K: 32 more
  for (int64_t g = 0; g < groups; g += 16) {
    const __mmask16 mask = g + 16 <= groups ? __mmask16{0xFFFF} : static_cast<__mmask16>((1u << (groups - g)) - 1);
    _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) {
      const __m512 dmv = _mm512_maskz_loadu_ps(mask, dm + r * groups + g);
      _Pragma("GCC unroll 4") for (int c = 0; c < C; ++c) s[r][c] = _mm512_fmadd_ps(
          dmv, _mm512_maskz_loadu_ps(mask, x.as + (x0 + c) * groups + g), s[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r * C + c] = _mm512_reduce_add_ps(s[r][c]);
}

template <int R, int C, bool Wide>
__attribute__((target("avx2,fma"))) void dot_avx2(const uint8_t* u, const float* ds, const float* dm,
                                                  const Activation& x, int64_t x0, float* acc) {
  const int64_t k = x.k, groups = k / kGroup;
  const __m256i ones = _mm256_set1_epi16(1), high = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);  // a 32-value step's 2 groups over 8 lanes
  __m256 s[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) s[r][c] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; i += 32) {
    __m256i av[C];
    __m128 agv[C];
    __m256i high_sums[C];  // 128 * (sum of each lane's activations), for codes shifted to signed
    _Pragma("GCC unroll 4") for (int c = 0; c < C; ++c) {
      av[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.a + (x0 + c) * k + i));
      agv[c] = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(x.ag + (x0 + c) * groups + i / kGroup)));
      if (Wide) high_sums[c] = _mm256_madd_epi16(_mm256_maddubs_epi16(high, av[c]), ones);
    }
    _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) {
      const __m256i uv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + r * k + i));
      const __m128 dsv = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(ds + r * groups + i / kGroup)));
      // Wide codes (to 255) would saturate vpmaddubsw's int16 pairs: take v = u - 128 signed, |v| against a with
      // v's sign (llama.cpp's trick), and add 128 * sum(a) back.
      const __m256i sv = Wide ? _mm256_xor_si256(uv, high) : uv;
      const __m256i mag = Wide ? _mm256_abs_epi8(sv) : uv;
      _Pragma("GCC unroll 4") for (int c = 0; c < C; ++c) {
        const __m256i signed_a = Wide ? _mm256_sign_epi8(av[c], sv) : av[c];
        __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(mag, signed_a), ones);
        if (Wide) p = _mm256_add_epi32(p, high_sums[c]);
        const __m256 scale = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_mul_ps(dsv, agv[c])), spread);
        s[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, s[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float total = hsum8(s[r][c]);
      for (int64_t g = 0; g < groups; ++g) total += dm[r * groups + g] * x.as[(x0 + c) * groups + g];
      acc[r * C + c] = total;
    }
}

template <int R, int C>
void dot_scalar(const uint8_t* u, const float* ds, const float* dm, const Activation& x, int64_t x0, float* acc) {
  const int64_t k = x.k, lanes = k / kLane, groups = k / kGroup;
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const int8_t* a = x.a + (x0 + c) * k;
      const float* ag = x.ag + (x0 + c) * groups;
      float total = 0.f;
      for (int64_t l = 0; l < lanes; ++l) {
        int32_t p = 0;
        for (int64_t j = 0; j < kLane; ++j) p += static_cast<int32_t>(u[r * k + l * kLane + j]) * a[l * kLane + j];
        const int64_t g = l * kLane / kGroup;
        total += static_cast<float>(p) * (ds[r * groups + g] * ag[g]);
      }
      for (int64_t g = 0; g < groups; ++g) total += dm[r * groups + g] * x.as[(x0 + c) * groups + g];
      acc[r * C + c] = total;
    }
}

enum class Path { vnni, avx2, scalar };

template <int R, int C>
void dot(Path path, bool wide, const uint8_t* u, const float* ds, const float* dm, const Activation& x, int64_t x0,
         float* acc) {
  switch (path) {
    case Path::vnni: return dot_vnni<R, C>(u, ds, dm, x, x0, acc);
    case Path::avx2:
      return wide ? dot_avx2<R, C, true>(u, ds, dm, x, x0, acc) : dot_avx2<R, C, false>(u, ds, dm, x, x0, acc);
    default: return dot_scalar<R, C>(u, ds, dm, x, x0, acc);
  }
}

template <int R>
void dot_rows(Path path, bool wide, const uint8_t* u, const float* ds, const float* dm, const Activation& x,
              int64_t m, float* acc /* [R][m] */) {
  float part[R * kXRows];
  for (int64_t x0 = 0; x0 < m; x0 += kXRows) {
    const int64_t cols = std::min<int64_t>(kXRows, m - x0);
    switch (cols) {
      case 4: dot<R, 4>(path, wide, u, ds, dm, x, x0, part); break;
      case 3: dot<R, 3>(path, wide, u, ds, dm, x, x0, part); break;
      case 2: dot<R, 2>(path, wide, u, ds, dm, x, x0, part); break;
      default: dot<R, 1>(path, wide, u, ds, dm, x, x0, part); break;
    }
    for (int r = 0; r < R; ++r)
      for (int64_t c = 0; c < cols; ++c) acc[r * m + x0 + c] = part[r * cols + c];
  }
}

bool cpu_has_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

// The path for `isa` ("" = the kernels' own choice, kernel_isa(); "avx2", "scalar" narrower), never wider than the CPU.
Path pick_path(const std::string& isa) {
  static const bool vnni = cpu_has_vnni();
  const Isa best = kernel_isa();
  if (isa == "scalar" || best == Isa::scalar) return Path::scalar;
  if (isa == "avx2" || best == Isa::avx2 || !vnni) return Path::avx2;
  return Path::vnni;
}

Isa decode_isa(Path path) {
  switch (path) {
    case Path::vnni: return Isa::avx512;
    case Path::avx2: return Isa::avx2;
    default: return Isa::scalar;
  }
}

const char* path_name(Path path) {
  switch (path) {
    case Path::vnni: return "avx512-vnni";
    case Path::avx2: return "avx2";
    default: return "scalar";
  }
}

// ---- ops ----------------------------------------------------------------------------------------------------------

void check_blocks(const at::Tensor& blocks, const TypeInfo& info, int64_t& k) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "gguf blocks must be uint8 [N, bytes], contiguous");
  TORCH_CHECK(blocks.size(1) % info.bytes == 0, "gguf blocks: a row of ", blocks.size(1),
              " bytes is not whole blocks of ", info.bytes);
  k = blocks.size(1) / info.bytes * info.values;
}

// x [M, K] float32 (or bfloat16) -> (codes int8 [M, K], each 16 codes' block scale float32 [M, K / 16], their
// sum times it float32 [M, K / 16]) in blocks of 256 (k_blocks, Q8_K) or 32 (Q8_0).
std::tuple<at::Tensor, at::Tensor, at::Tensor> gguf_quantize_activation(const at::Tensor& x, bool k_blocks) {
  TORCH_CHECK(x.dim() == 2, "gguf_quantize_activation: x must be [M, K]");
  const at::Tensor xc = x.to(at::kFloat).contiguous();
  const int64_t m = xc.size(0), k = xc.size(1), qk = k_blocks ? 256 : 32;
  TORCH_CHECK(k % qk == 0, "gguf_quantize_activation: K = ", k, " is not a multiple of ", qk);
  at::Tensor a = at::empty({m, k}, xc.options().dtype(at::kChar));
  at::Tensor ag = at::empty({m, k / kGroup}, xc.options());
  at::Tensor as = at::empty({m, k / kGroup}, xc.options());
  const float* xp = xc.data_ptr<float>();
  int8_t* ap = a.data_ptr<int8_t>();
  float* agp = ag.data_ptr<float>();
  float* asp = as.data_ptr<float>();
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / std::max<int64_t>(k, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      quantize_row(xp + i * k, k, k_blocks, ap + i * k, agp + i * (k / kGroup), asp + i * (k / kGroup));
  });
  return {a, ag, as};
}

// out [M, N] float32 = x @ W^T (+ bias), x as gguf_quantize_activation gave it (blocks of the kind `type` reads),
// W GGUF blocks of `type` as stored, uint8 [N, K / values * bytes].
at::Tensor gguf_linear(const at::Tensor& a, const at::Tensor& ag, const at::Tensor& as, const at::Tensor& blocks,
                       int64_t type, const std::optional<at::Tensor>& bias, const std::string& isa) {
  const TypeInfo info = type_info(type);
  int64_t k = 0;
  check_blocks(blocks, info, k);
  TORCH_CHECK(a.scalar_type() == at::kChar && a.dim() == 2 && a.is_contiguous() && a.size(1) == k,
              "gguf_linear: the activation codes must be int8 [M, ", k, "], contiguous");
  const int64_t m = a.size(0), n = blocks.size(0);
  TORCH_CHECK(ag.scalar_type() == at::kFloat && ag.is_contiguous() && ag.numel() == m * (k / kGroup) &&
                  as.scalar_type() == at::kFloat && as.is_contiguous() && as.numel() == m * (k / kGroup),
              "gguf_linear: the activation's scales and sums do not match its codes");
  at::Tensor out = at::empty({m, n}, ag.options());
  const float* bias_ptr = nullptr;
  at::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    bias_c = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bias_c.numel() == n, "gguf_linear: bias has ", bias_c.numel(), " entries, not ", n);
    bias_ptr = bias_c.data_ptr<float>();
  }
  if (m == 0 || n == 0) return out;
  const Path path = pick_path(isa);
  const RowDecoder decode = row_decoder(type, decode_isa(path));
  const Activation x{a.data_ptr<int8_t>(), ag.data_ptr<float>(), as.data_ptr<float>(), k};
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  const int64_t row_bytes = blocks.size(1);
  float* outp = out.data_ptr<float>();
  // Enough tiles per task that a thread streams some tens of KiB of weight before it syncs.
  const int64_t tiles = (n + kTileRows - 1) / kTileRows;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(row_bytes * kTileRows, 1));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    Scratch scratch(kTileRows, k);
    std::vector<float> acc(kTileRows * m);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kTileRows, count = std::min<int64_t>(kTileRows, n - n0);
      for (int64_t r = 0; r < count; ++r)
        decode(w + (n0 + r) * row_bytes, k, scratch.u.data() + r * k, scratch.ds.data() + r * (k / kGroup),
               scratch.dm.data() + r * (k / kGroup));
      if (count == kTileRows) {
        dot_rows<kTileRows>(path, info.wide, scratch.u.data(), scratch.ds.data(), scratch.dm.data(), x, m,
                            acc.data());
      } else {
        for (int64_t r = 0; r < count; ++r)
          dot_rows<1>(path, info.wide, scratch.u.data() + r * k, scratch.ds.data() + r * (k / kGroup),
                      scratch.dm.data() + r * (k / kGroup), x, m, acc.data() + r * m);
      }
      for (int64_t r = 0; r < count; ++r) {
        const float b = bias_ptr ? bias_ptr[n0 + r] : 0.f;
        for (int64_t c = 0; c < m; ++c) outp[c * n + n0 + r] = acc[r * m + c] + b;
      }
    }
  });
  return out;
}

// Rows `ids` of GGUF blocks of `type` as float32 [T, K] (an embedding's lookup).
at::Tensor gguf_dequantize_rows(const at::Tensor& blocks, int64_t type, const at::Tensor& ids) {
  const TypeInfo info = type_info(type);
  int64_t k = 0;
  check_blocks(blocks, info, k);
  const at::Tensor idc = ids.to(at::kLong).contiguous();
  const int64_t t = idc.numel(), n = blocks.size(0), row_bytes = blocks.size(1);
  at::Tensor out = at::empty({t, k}, at::TensorOptions().dtype(at::kFloat));
  const int64_t* idp = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) TORCH_CHECK(idp[i] >= 0 && idp[i] < n, "gguf_dequantize_rows: row ", idp[i], " of ", n);
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  float* outp = out.data_ptr<float>();
  const RowDecoder decode = row_decoder(type, Isa::scalar);
  at::parallel_for(0, t, std::max<int64_t>(1, 4096 / std::max<int64_t>(k, 1)), [&](int64_t begin, int64_t end) {
    Scratch scratch(1, k);
    for (int64_t i = begin; i < end; ++i) {
      decode(w + idp[i] * row_bytes, k, scratch.u.data(), scratch.ds.data(), scratch.dm.data());
      float* y = outp + i * k;
      for (int64_t j = 0; j < k; ++j)
        y[j] = scratch.ds[j / kGroup] * static_cast<float>(scratch.u[j]) + scratch.dm[j / kGroup];
    }
  });
  return out;
}

std::string gguf_product_path(const std::string& isa) { return path_name(pick_path(isa)); }

std::string family_gguf_blocks() {
  return std::string("GGUF Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/IQ4_NL/Q2_K..Q6_K/IQ4_XS integer products (") +
         path_name(pick_path("")) + ")";
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(PAGODA_NATIVE_NAMESPACE, m) {
  m.def("family_gguf_blocks() -> str", &family_gguf_blocks);
  m.def("gguf_product_path(str isa) -> str", &gguf_product_path);
  m.def("gguf_quantize_activation(Tensor x, bool k_blocks) -> (Tensor, Tensor, Tensor)", &gguf_quantize_activation);
  m.def("gguf_linear(Tensor a, Tensor ag, Tensor as_, Tensor blocks, int type, Tensor? bias, str isa) -> Tensor",
        &gguf_linear);
  m.def("gguf_dequantize_rows(Tensor blocks, int type, Tensor ids) -> Tensor", &gguf_dequantize_rows);
}
