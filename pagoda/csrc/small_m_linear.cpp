// Matrix-vector and small-M products (any M, in blocks of 16 rows) for decode: out[M, N] = x[M, K] @ W[N, K]^T (+ bias),
// W dense row-major (fp32, or bf16 widened to fp32 in registers) or int8 with one scale per output row; and its
// grouped form for mixture-of-experts projections (each group of rows of x times its own W, only the groups that have
// rows). Parallel over output rows with
// at::parallel_for (torch's intra-op threads, so the engine's thread policy holds). Each ISA
// body is compiled with its own target attribute and picked at run time, so one build serves
// any x86-64 CPU and the build cache can be shared between machines.
// ATen and the op registry only (no pybind11, no torch/extension.h): a few seconds less to compile.
#include <ATen/core/Tensor.h>
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <algorithm>
#include <optional>
#include <string>
#include <vector>
#include <immintrin.h>
#include <cstdint>
#include "simd.h"

namespace {

using namespace pagoda_native;

using pagoda_native::load16;  // overloaded below for bf16
using pagoda_native::load8;

// bf16 weights widen to fp32 exactly: the bf16 bits are the top half of the fp32 ones.
__attribute__((target("avx512f"))) inline __m512 load16(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
__attribute__((target("avx2,fma"))) inline __m256 load8(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

constexpr int64_t kRowsPerTile = 4;   // output rows sharing one pass over x
constexpr int64_t kMaxRows = 16;      // rows of x per block (larger inputs loop over blocks)

// Up to 4 weight rows x up to 4 input rows per pass; the tail of K goes through scalar code.
template <typename W, int R, int C>
__attribute__((target("avx512f"))) void tile_avx512(const W* w, int64_t ldw, const float* x, int64_t ldx,
                                                    int64_t k, float* acc /* [R][C] */) {
  __m512 sum[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) sum[r][c] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    __m512 xv[C];
    _Pragma("GCC unroll 4") for (int c = 0; c < C; ++c) xv[c] = _mm512_loadu_ps(x + c * ldx + i);
    _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) {
      __m512 wv = load16(w + r * ldw + i);
      _Pragma("GCC unroll 4") for (int c = 0; c < C; ++c) sum[r][c] = _mm512_fmadd_ps(wv, xv[c], sum[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float s = _mm512_reduce_add_ps(sum[r][c]);
      for (int64_t j = i; j < k; ++j) s += static_cast<float>(w[r * ldw + j]) * x[c * ldx + j];
      acc[r * C + c] = s;
    }
}

template <typename W, int R, int C>
__attribute__((target("avx2,fma"))) void tile_avx2(const W* w, int64_t ldw, const float* x, int64_t ldx,
                                                   int64_t k, float* acc) {
  __m256 sum[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) sum[r][c] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    __m256 xv[C];
    _Pragma("GCC unroll 4") for (int c = 0; c < C; ++c) xv[c] = _mm256_loadu_ps(x + c * ldx + i);
    _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) {
      __m256 wv = load8(w + r * ldw + i);
      _Pragma("GCC unroll 4") for (int c = 0; c < C; ++c) sum[r][c] = _mm256_fmadd_ps(wv, xv[c], sum[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float s = hsum8(sum[r][c]);
      for (int64_t j = i; j < k; ++j) s += static_cast<float>(w[r * ldw + j]) * x[c * ldx + j];
      acc[r * C + c] = s;
    }
}

template <typename W, int R, int C>
void tile_scalar(const W* w, int64_t ldw, const float* x, int64_t ldx, int64_t k, float* acc) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float s = 0.f;
      for (int64_t j = 0; j < k; ++j) s += static_cast<float>(w[r * ldw + j]) * x[c * ldx + j];
      acc[r * C + c] = s;
    }
}

template <typename W, int R, int C>
void tile(Isa isa, const W* w, int64_t ldw, const float* x, int64_t ldx, int64_t k, float* acc) {
  switch (isa) {
    case Isa::avx512: return tile_avx512<W, R, C>(w, ldw, x, ldx, k, acc);
    case Isa::avx2: return tile_avx2<W, R, C>(w, ldw, x, ldx, k, acc);
    default: return tile_scalar<W, R, C>(w, ldw, x, ldx, k, acc);
  }
}

// Columns of x in chunks of 4 (the last 1..4), for R weight rows.
template <typename W, int R>
void rows_tile(Isa isa, const W* w, int64_t ldw, const float* x, int64_t m, int64_t k, float* acc) {
  float part[R * 4];
  for (int64_t c0 = 0; c0 < m; c0 += 4) {
    const int64_t cols = std::min<int64_t>(4, m - c0);
    const float* xc = x + c0 * k;
    switch (cols) {
      case 4: tile<W, R, 4>(isa, w, ldw, xc, k, k, part); break;
      case 3: tile<W, R, 3>(isa, w, ldw, xc, k, k, part); break;
      case 2: tile<W, R, 2>(isa, w, ldw, xc, k, k, part); break;
      default: tile<W, R, 1>(isa, w, ldw, xc, k, k, part); break;
    }
    for (int r = 0; r < R; ++r)
      for (int64_t c = 0; c < cols; ++c) acc[r * kMaxRows + c0 + c] = part[r * cols + c];
  }
}

// Output rows [n0, n0 + rows) (rows <= kRowsPerTile) of out[M, ldo] = x[M, K] @ W^T for every row of x,
// W's rows starting at w (row stride ldw); optional per-row scale and bias, indexed from n0.
template <typename W>
void output_rows(Isa isa, const W* w, int64_t ldw, int64_t n0, int64_t rows, const float* xp, int64_t m, int64_t k,
                 const float* row_scale, const float* bias_ptr, float* op, int64_t ldo) {
  float acc[kRowsPerTile * kMaxRows];
  const W* wt = w + n0 * ldw;
  // The tile's weight rows stay in cache while every block of x passes over them.
  for (int64_t m0 = 0; m0 < m; m0 += kMaxRows) {
    const int64_t mb = std::min<int64_t>(kMaxRows, m - m0);
    const float* xb = xp + m0 * k;
    if (rows == kRowsPerTile) {
      rows_tile<W, kRowsPerTile>(isa, wt, ldw, xb, mb, k, acc);
    } else {
      for (int64_t r = 0; r < rows; ++r) rows_tile<W, 1>(isa, wt + r * ldw, ldw, xb, mb, k, acc + r * kMaxRows);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const float scale = row_scale ? row_scale[n0 + r] : 1.f;
      const float b = bias_ptr ? bias_ptr[n0 + r] : 0.f;
      for (int64_t c = 0; c < mb; ++c) op[(m0 + c) * ldo + n0 + r] = acc[r * kMaxRows + c] * scale + b;
    }
  }
}

// Enough rows per task that a thread streams a few hundred KiB of weight before syncing.
int64_t tile_grain(int64_t k) {
  const int64_t grain = std::max<int64_t>(kRowsPerTile, (int64_t{1} << 16) / std::max<int64_t>(k, 1));
  return (grain + kRowsPerTile - 1) / kRowsPerTile;
}

template <typename W>
at::Tensor small_m_linear(const at::Tensor& x, const at::Tensor& weight, const float* row_scale,
                             const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "small_m_linear: x [M, K] and weight [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "small_m_linear: x must be float32");
  TORCH_CHECK(x.size(1) <= weight.size(1), "small_m_linear: x has more inputs than the weight");
  TORCH_CHECK(weight.stride(1) == 1, "small_m_linear: weight rows must be contiguous");
  const at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1), n = weight.size(0), ldw = weight.stride(0);
  at::Tensor out = at::empty({m, n}, xc.options());
  const float* bias_ptr = nullptr;
  at::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    bias_c = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bias_c.numel() == n, "small_m_linear: bias has ", bias_c.numel(), " entries, not ", n);
    bias_ptr = bias_c.data_ptr<float>();
  }
  if (m == 0 || n == 0) return out;
  const W* w = weight.data_ptr<W>();
  const float* xp = xc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const Isa isa = kernel_isa();
  at::parallel_for(0, (n + kRowsPerTile - 1) / kRowsPerTile, tile_grain(k), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kRowsPerTile;
      output_rows<W>(isa, w, ldw, n0, std::min<int64_t>(kRowsPerTile, n - n0), xp, m, k, row_scale, bias_ptr, op, n);
    }
  });
  return out;
}

// A mixture-of-experts projection: x [R, K] holds the rows of group 0, then group 1, ... (counts [G], int64 on
// the CPU); out[R, N] = each group's rows @ weight[g]^T (* scales[g]) (+ bias[g]), weight [G, N, K' >= K] with
// contiguous rows (float32, or int8 with float32 scales [G, N]). One parallel region over the (group, tile of
// output rows) pairs of the groups that have rows, so the cost follows the experts hit, not the experts held.
template <typename W>
at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& weight, const float* scales,
                          const at::Tensor& counts, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 3, "grouped_linear: x [R, K] and weight [G, N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "grouped_linear: x must be float32");
  TORCH_CHECK(x.size(1) <= weight.size(2), "grouped_linear: x has ", x.size(1), " inputs, weight ", weight.size(2));
  TORCH_CHECK(weight.stride(2) == 1, "grouped_linear: weight rows must be contiguous");
  TORCH_CHECK(counts.dim() == 1 && counts.size(0) == weight.size(0) && counts.scalar_type() == at::kLong &&
              counts.device().is_cpu(), "grouped_linear: counts must be int64 [G] on the CPU");
  const at::Tensor xc = x.contiguous();
  const at::Tensor cc = counts.contiguous();
  const int64_t groups = weight.size(0), n = weight.size(1), k = xc.size(1), ldw = weight.stride(1);
  at::Tensor out = at::empty({xc.size(0), n}, xc.options());
  const float* bias_ptr = nullptr;
  at::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    bias_c = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bias_c.dim() == 2 && bias_c.size(0) == groups && bias_c.size(1) == n,
                "grouped_linear: bias must be [G, N]");
    bias_ptr = bias_c.data_ptr<float>();
  }
  const int64_t* count = cc.data_ptr<int64_t>();
  std::vector<int64_t> hit, first_row;  // the groups with rows and where their rows start
  int64_t row = 0;
  for (int64_t g = 0; g < groups; ++g) {
    TORCH_CHECK(count[g] >= 0, "grouped_linear: negative count");
    if (count[g] > 0) {
      hit.push_back(g);
      first_row.push_back(row);
    }
    row += count[g];
  }
  TORCH_CHECK(row == xc.size(0), "grouped_linear: counts sum to ", row, ", x has ", xc.size(0), " rows");
  if (hit.empty() || n == 0) return out;
  const int64_t tiles = (n + kRowsPerTile - 1) / kRowsPerTile;
  const W* w = weight.data_ptr<W>();
  const float* xp = xc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const Isa isa = kernel_isa();
  at::parallel_for(0, static_cast<int64_t>(hit.size()) * tiles, tile_grain(k), [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / tiles, n0 = (task % tiles) * kRowsPerTile, g = hit[h];
      output_rows<W>(isa, w + g * weight.stride(0), ldw, n0, std::min<int64_t>(kRowsPerTile, n - n0),
                     xp + first_row[h] * k, count[g], k, scales ? scales + g * n : nullptr,
                     bias_ptr ? bias_ptr + g * n : nullptr, op + first_row[h] * n, n);
    }
  });
  return out;
}

at::Tensor grouped_linear_f32(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& counts,
                              const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat, "grouped_linear_f32: weight must be float32");
  TORCH_CHECK(x.size(1) == weight.size(2), "grouped_linear_f32: x has ", x.size(1), " inputs, weight ",
              weight.size(2));
  return grouped_linear<float>(x, weight, nullptr, counts, bias);
}

at::Tensor grouped_linear_int8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                               const at::Tensor& counts, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(qweight.scalar_type() == at::kChar, "grouped_linear_int8: weight must be int8");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
              scales.size(0) == qweight.size(0) && scales.size(1) == qweight.size(1),
              "grouped_linear_int8: scales must be float32 [G, N], contiguous");
  return grouped_linear<int8_t>(x, qweight, scales.data_ptr<float>(), counts, bias);
}

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat, "linear_f32: weight must be float32");
  TORCH_CHECK(x.size(1) == weight.size(1), "linear_f32: x has ", x.size(1), " inputs, weight ", weight.size(1));
  return small_m_linear<float>(x, weight, nullptr, bias);
}

// int8 weight [N, K'] (K' >= K: padded columns are never read), out = (x @ q^T) * scales + bias.
at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                          const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(qweight.scalar_type() == at::kChar, "linear_int8: weight must be int8");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == qweight.size(0),
              "linear_int8: scales must be float32 [N], contiguous");
  return small_m_linear<int8_t>(x, qweight, scales.data_ptr<float>(), bias);
}

// bf16 weight [N, K] with x in fp32 or bf16: products and sums in fp32, the output in x's dtype.
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16, "linear_bf16: weight must be bfloat16");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == weight.size(1), "linear_bf16: x has ", x.size(-1), " inputs, weight ",
              weight.size(1));
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "linear_bf16: x must be float32 or bfloat16");
  const at::Tensor out = small_m_linear<c10::BFloat16>(x.to(at::kFloat), weight, nullptr, bias);
  return out.to(x.scalar_type());
}

std::string isa_name() {
  switch (kernel_isa()) {
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    default: return "scalar";
  }
}

std::string family_products() { return "float32, bfloat16 and int8 products"; }
std::string family_grouped_moe() { return "grouped MoE products"; }

}  // namespace

// The namespace comes from the build (-DPAGODA_NATIVE_NAMESPACE=...): one per source version.
TORCH_LIBRARY(PAGODA_NATIVE_NAMESPACE, m) {
  m.def("linear_f32(Tensor x, Tensor weight, Tensor? bias) -> Tensor", &linear_f32);
  m.def("linear_int8(Tensor x, Tensor qweight, Tensor scales, Tensor? bias) -> Tensor", &linear_int8);
  m.def("grouped_linear_f32(Tensor x, Tensor weight, Tensor counts, Tensor? bias) -> Tensor", &grouped_linear_f32);
  m.def("grouped_linear_int8(Tensor x, Tensor qweight, Tensor scales, Tensor counts, Tensor? bias) -> Tensor",
        &grouped_linear_int8);
  m.def("isa() -> str", &isa_name);
  m.def("linear_bf16(Tensor x, Tensor weight, Tensor? bias) -> Tensor", &linear_bf16);
  m.def("family_products() -> str", &family_products);
  m.def("family_grouped_moe() -> str", &family_grouped_moe);
}
