// Products with pagoda's group-wise int4 weights, dequantized in registers (no float copy of the weight is ever
// made): out[M, N] = x[M, K] @ W[N, K]^T (+ bias), W codes two per byte in GGUF Q4_0's nibble order, [N, K / 2], with
// float32 scales (and zero points) per group of 32/64/128 inputs, w = (q - 8) * scale + zero. (GGUF files' own
// blocks: gguf_blocks.cpp.)
// x is float32 or bfloat16 (computed in float32, the output in x's dtype); any M, in blocks of 16 rows. Parallel over
// output rows with at::parallel_for; each ISA body carries its own target attribute, picked at run time.
#include <ATen/core/Tensor.h>
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <algorithm>
#include <optional>
#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include "simd.h"

namespace {

using namespace pagoda_native;

constexpr int64_t kBlock = 32;        // values per quantization block
constexpr int64_t kRowsPerTile = 4;   // output rows sharing one pass over x
constexpr int64_t kMaxRows = 16;      // rows of x per block of x

// The 16 values a block's codes stand for, code - 8 for code 0..15 (times its scale, plus its zero): one
// permute per 16 weights then dequantizes them, instead of a convert, a subtract and a multiply.
__attribute__((target("avx512f"))) inline __m512 centered_codes512() {
  return _mm512_setr_ps(-8.f, -7.f, -6.f, -5.f, -4.f, -3.f, -2.f, -1.f, 0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
}

// 16 bytes of nibbles -> table[code]: low nibbles are values 0..15, high nibbles 16..31. One widening serves
// both halves: the permute reads only an index's low 4 bits, so the low nibble needs no mask.
__attribute__((target("avx512f"))) inline void nibbles512(const uint8_t* p, __m512 table, __m512& lo, __m512& hi) {
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = _mm512_permutexvar_ps(bytes, table);
  hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
}

__attribute__((target("avx2,fma"))) inline void nibbles256(const uint8_t* p, __m256 (&v)[4]) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i low = _mm_and_si128(packed, mask), high = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
  const __m256 eight = _mm256_set1_ps(8.f);
  v[0] = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(low)), eight);
  v[1] = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(low, 8))), eight);
  v[2] = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(high)), eight);
  v[3] = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(high, 8))), eight);
}

inline void nibbles_scalar(const uint8_t* p, float* v) {
  for (int j = 0; j < 16; ++j) {
    v[j] = static_cast<float>(p[j] & 0x0F) - 8.f;
    v[j + 16] = static_cast<float>(p[j] >> 4) - 8.f;
  }
}

// pagoda's int4: nibbles [N, K / 2], float32 scales and zeros [N, groups], `blocks_per_group` blocks per group.
struct Int4Rows {
  const uint8_t* w;
  int64_t ldw;
  const float* scales;
  const float* zeros;  // nullptr: symmetric
  int64_t groups;
  int group_shift;  // log2(blocks per group): a shift, not a division, per block

  float scale(int64_t row, int64_t block) const { return scales[row * groups + (block >> group_shift)]; }
  float zero(int64_t row, int64_t block) const { return zeros ? zeros[row * groups + (block >> group_shift)] : 0.f; }

  __attribute__((target("avx512f"))) void decode512(int64_t row, int64_t block, __m512& lo, __m512& hi) const {
    const __m512 s = _mm512_set1_ps(scale(row, block)), z = _mm512_set1_ps(zero(row, block));
    nibbles512(w + row * ldw + block * 16, _mm512_add_ps(_mm512_mul_ps(centered_codes512(), s), z), lo, hi);
  }

  __attribute__((target("avx2,fma"))) void decode256(int64_t row, int64_t block, __m256 (&v)[4]) const {
    nibbles256(w + row * ldw + block * 16, v);
    const __m256 s = _mm256_set1_ps(scale(row, block)), z = _mm256_set1_ps(zero(row, block));
    for (int q = 0; q < 4; ++q) v[q] = _mm256_add_ps(_mm256_mul_ps(v[q], s), z);
  }

  void decode_scalar(int64_t row, int64_t block, float* v) const {
    nibbles_scalar(w + row * ldw + block * 16, v);
    const float s = scale(row, block), z = zero(row, block);
    for (int j = 0; j < kBlock; ++j) v[j] = v[j] * s + z;
  }
};

// R weight rows from `row0` times C rows of x (row stride ldx) over `blocks` blocks: acc[R][C].
template <class Rows, int R, int C>
__attribute__((target("avx512f,f16c"))) void tile_avx512(const Rows& rows, int64_t row0, const float* x, int64_t ldx,
                                                         int64_t blocks, float* acc) {
  __m512 sum[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) sum[r][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 x0[C], x1[C];
    _Pragma("GCC unroll 4") for (int c = 0; c < C; ++c) {
      x0[c] = _mm512_loadu_ps(x + c * ldx + b * kBlock);
      x1[c] = _mm512_loadu_ps(x + c * ldx + b * kBlock + 16);
    }
    _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) {
      __m512 lo, hi;
      rows.decode512(row0 + r, b, lo, hi);
      _Pragma("GCC unroll 4") for (int c = 0; c < C; ++c) {
        sum[r][c] = _mm512_fmadd_ps(lo, x0[c], sum[r][c]);
        sum[r][c] = _mm512_fmadd_ps(hi, x1[c], sum[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r * C + c] = _mm512_reduce_add_ps(sum[r][c]);
}

template <class Rows, int R, int C>
__attribute__((target("avx2,fma,f16c"))) void tile_avx2(const Rows& rows, int64_t row0, const float* x, int64_t ldx,
                                                        int64_t blocks, float* acc) {
  __m256 sum[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) sum[r][c] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) {
      __m256 v[4];
      rows.decode256(row0 + r, b, v);
      _Pragma("GCC unroll 4") for (int c = 0; c < C; ++c) {
        const float* xb = x + c * ldx + b * kBlock;
        for (int q = 0; q < 4; ++q) sum[r][c] = _mm256_fmadd_ps(v[q], _mm256_loadu_ps(xb + 8 * q), sum[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r * C + c] = hsum8(sum[r][c]);
}

template <class Rows, int R, int C>
void tile_scalar(const Rows& rows, int64_t row0, const float* x, int64_t ldx, int64_t blocks, float* acc) {
  for (int i = 0; i < R * C; ++i) acc[i] = 0.f;
  float v[kBlock];
  for (int64_t b = 0; b < blocks; ++b)
    for (int r = 0; r < R; ++r) {
      rows.decode_scalar(row0 + r, b, v);
      for (int c = 0; c < C; ++c) {
        const float* xb = x + c * ldx + b * kBlock;
        float s = 0.f;
        for (int j = 0; j < kBlock; ++j) s += v[j] * xb[j];
        acc[r * C + c] += s;
      }
    }
}

template <class Rows, int R, int C>
void tile(Isa isa, const Rows& rows, int64_t row0, const float* x, int64_t ldx, int64_t blocks, float* acc) {
  switch (isa) {
    case Isa::avx512: return tile_avx512<Rows, R, C>(rows, row0, x, ldx, blocks, acc);
    case Isa::avx2: return tile_avx2<Rows, R, C>(rows, row0, x, ldx, blocks, acc);
    default: return tile_scalar<Rows, R, C>(rows, row0, x, ldx, blocks, acc);
  }
}

// Rows of x in chunks of 4 (the last 1..4) against R weight rows: acc[r * kMaxRows + row of x].
template <class Rows, int R>
void rows_tile(Isa isa, const Rows& rows, int64_t row0, const float* x, int64_t m, int64_t k, float* acc) {
  float part[R * 4];
  for (int64_t c0 = 0; c0 < m; c0 += 4) {
    const int64_t cols = std::min<int64_t>(4, m - c0);
    const float* xc = x + c0 * k;
    switch (cols) {
      case 4: tile<Rows, R, 4>(isa, rows, row0, xc, k, k / kBlock, part); break;
      case 3: tile<Rows, R, 3>(isa, rows, row0, xc, k, k / kBlock, part); break;
      case 2: tile<Rows, R, 2>(isa, rows, row0, xc, k, k / kBlock, part); break;
      default: tile<Rows, R, 1>(isa, rows, row0, xc, k, k / kBlock, part); break;
    }
    for (int r = 0; r < R; ++r)
      for (int64_t c = 0; c < cols; ++c) acc[r * kMaxRows + c0 + c] = part[r * cols + c];
  }
}

template <class Rows>
at::Tensor block_linear(const char* op, const Rows& rows, const at::Tensor& x, int64_t n, int64_t k,
                        const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2, op, ": x must be [M, K]");
  TORCH_CHECK(x.size(1) == k, op, ": x has ", x.size(1), " inputs, the weight ", k);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16");
  const at::Tensor xc = x.to(at::kFloat).contiguous();
  const int64_t m = xc.size(0);
  at::Tensor out = at::empty({m, n}, xc.options());
  const float* bias_ptr = nullptr;
  at::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    bias_c = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bias_c.numel() == n, op, ": bias has ", bias_c.numel(), " entries, not ", n);
    bias_ptr = bias_c.data_ptr<float>();
  }
  if (m > 0 && n > 0) {
    const float* xp = xc.data_ptr<float>();
    float* outp = out.data_ptr<float>();
    const Isa isa = kernel_isa();
    // Enough rows per task that a thread streams a few tens of KiB of weight before syncing.
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(k, 1) / kRowsPerTile);
    at::parallel_for(0, (n + kRowsPerTile - 1) / kRowsPerTile, grain, [&](int64_t begin, int64_t end) {
      float acc[kRowsPerTile * kMaxRows];
      for (int64_t t = begin; t < end; ++t) {
        const int64_t n0 = t * kRowsPerTile, count = std::min<int64_t>(kRowsPerTile, n - n0);
        // The tile's weight rows stay in cache while every block of x passes over them.
        for (int64_t m0 = 0; m0 < m; m0 += kMaxRows) {
          const int64_t mb = std::min<int64_t>(kMaxRows, m - m0);
          if (count == kRowsPerTile) {
            rows_tile<Rows, kRowsPerTile>(isa, rows, n0, xp + m0 * k, mb, k, acc);
          } else {
            for (int64_t r = 0; r < count; ++r)
              rows_tile<Rows, 1>(isa, rows, n0 + r, xp + m0 * k, mb, k, acc + r * kMaxRows);
          }
          for (int64_t r = 0; r < count; ++r) {
            const float b = bias_ptr ? bias_ptr[n0 + r] : 0.f;
            for (int64_t c = 0; c < mb; ++c) outp[(m0 + c) * n + n0 + r] = acc[r * kMaxRows + c] + b;
          }
        }
      }
    });
  }
  return out.to(x.scalar_type());
}

void check_blocks(const char* op, const at::Tensor& blocks, int64_t bytes_per_block) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(), op,
              ": blocks must be uint8 [N, bytes], contiguous");
  TORCH_CHECK(blocks.size(1) % bytes_per_block == 0, op, ": a row of ", blocks.size(1),
              " bytes is not whole blocks of ", bytes_per_block);
}

// pagoda's group-wise int4: nibbles [N, K / 2], scales (and zeros) float32 [N, K / group], group a multiple of 32.
at::Tensor linear_int4(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& scales,
                       const std::optional<at::Tensor>& zeros, const std::optional<at::Tensor>& bias) {
  check_blocks("linear_int4", nibbles, kBlock / 2);
  const int64_t n = nibbles.size(0), k = nibbles.size(1) * 2;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
              scales.size(0) == n && scales.size(1) > 0 && k % (scales.size(1) * kBlock) == 0,
              "linear_int4: scales must be float32 [N, K / group], contiguous, the group a multiple of 32");
  const float* zero_ptr = nullptr;
  if (zeros.has_value() && zeros->defined()) {
    TORCH_CHECK(zeros->scalar_type() == at::kFloat && zeros->is_contiguous() && zeros->sizes() == scales.sizes(),
                "linear_int4: zeros must be float32 shaped like the scales, contiguous");
    zero_ptr = zeros->data_ptr<float>();
  }
  const int64_t groups = scales.size(1), blocks_per_group = k / groups / kBlock;
  TORCH_CHECK((blocks_per_group & (blocks_per_group - 1)) == 0, "linear_int4: the group (", k / groups,
              ") must be 32 times a power of two");
  const Int4Rows rows{nibbles.data_ptr<uint8_t>(), nibbles.size(1), scales.data_ptr<float>(), zero_ptr, groups,
                      __builtin_ctzll(static_cast<unsigned long long>(blocks_per_group))};
  return block_linear("linear_int4", rows, x, n, k, bias);
}

std::string family_quantized() { return "int4 products"; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(PAGODA_NATIVE_NAMESPACE, m) {
  m.def("family_quantized() -> str", &family_quantized);
  m.def("linear_int4(Tensor x, Tensor nibbles, Tensor scales, Tensor? zeros, Tensor? bias) -> Tensor", &linear_int4);
}
