// The decoder's memory-bound elementwise work, fused: residual add + RMSNorm (Llama's and Gemma's (1 + w) form,
// with Gemma's norm of the attention output before the add), and rotate-half rotary embedding applied in place to
// the q and k heads of the fused qkv output. float32, any row count; rows of a step are split over torch's intra-op
// threads only when there are enough of them to pay for it.
//
// Arithmetic follows pagoda's PyTorch path: the norm scales x by 1 / sqrt(mean(x^2) + eps), then by the weight
// ((1 + w) computed first for Gemma); the rotation is x * cos + roll(x, D/2) * sin_rolled with the two products
// rounded before the add (no fused multiply-add), so it is bit-exact; only the norm's sum of squares is added in
// another order.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <immintrin.h>
#include <cstdint>
#include "simd.h"

namespace {

using namespace pagoda_native;

constexpr int64_t kGrainElements = 1 << 15;  // per task: below this a step's rows stay on one thread

// ---- sum of squares of one row ----

__attribute__((target("avx512f"))) float sum_squares_avx512(const float* x, int64_t d) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= d; i += 32) {
    const __m512 a = _mm512_loadu_ps(x + i), b = _mm512_loadu_ps(x + i + 16);
    acc0 = _mm512_fmadd_ps(a, a, acc0);
    acc1 = _mm512_fmadd_ps(b, b, acc1);
  }
  for (; i + 16 <= d; i += 16) {
    const __m512 a = _mm512_loadu_ps(x + i);
    acc0 = _mm512_fmadd_ps(a, a, acc0);
  }
  float s = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
  for (; i < d; ++i) s += x[i] * x[i];
  return s;
}

__attribute__((target("avx2,fma"))) float sum_squares_avx2(const float* x, int64_t d) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
    acc0 = _mm256_fmadd_ps(a, a, acc0);
    acc1 = _mm256_fmadd_ps(b, b, acc1);
  }
  for (; i + 8 <= d; i += 8) {
    const __m256 a = _mm256_loadu_ps(x + i);
    acc0 = _mm256_fmadd_ps(a, a, acc0);
  }
  float s = hsum8(_mm256_add_ps(acc0, acc1));
  for (; i < d; ++i) s += x[i] * x[i];
  return s;
}

float sum_squares_scalar(const float* x, int64_t d) {
  float s = 0.f;
  for (int64_t i = 0; i < d; ++i) s += x[i] * x[i];
  return s;
}

float sum_squares(Isa isa, const float* x, int64_t d) {
  switch (isa) {
    case Isa::avx512: return sum_squares_avx512(x, d);
    case Isa::avx2: return sum_squares_avx2(x, d);
    default: return sum_squares_scalar(x, d);
  }
}

float inverse_rms(Isa isa, const float* x, int64_t d, float eps) {
  return 1.f / std::sqrt(sum_squares(isa, x, d) / static_cast<float>(d) + eps);
}

// ---- out = (x * r) * w (w + 1 with unit_offset), optionally first s = x + add, written to x ----

__attribute__((target("avx512f"))) void scale_avx512(const float* x, float r, const float* w, bool offset,
                                                     int64_t d, float* out) {
  const __m512 rv = _mm512_set1_ps(r), one = _mm512_set1_ps(offset ? 1.f : 0.f);
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    const __m512 weight = _mm512_add_ps(one, _mm512_loadu_ps(w + i));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), rv), weight));
  }
  for (; i < d; ++i) out[i] = (x[i] * r) * ((offset ? 1.f : 0.f) + w[i]);
}

__attribute__((target("avx2,fma"))) void scale_avx2(const float* x, float r, const float* w, bool offset,
                                                    int64_t d, float* out) {
  const __m256 rv = _mm256_set1_ps(r), one = _mm256_set1_ps(offset ? 1.f : 0.f);
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    const __m256 weight = _mm256_add_ps(one, _mm256_loadu_ps(w + i));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), rv), weight));
  }
  for (; i < d; ++i) out[i] = (x[i] * r) * ((offset ? 1.f : 0.f) + w[i]);
}

void scale_scalar(const float* x, float r, const float* w, bool offset, int64_t d, float* out) {
  const float one = offset ? 1.f : 0.f;
  for (int64_t i = 0; i < d; ++i) out[i] = (x[i] * r) * (one + w[i]);
}

void scale(Isa isa, const float* x, float r, const float* w, bool offset, int64_t d, float* out) {
  switch (isa) {
    case Isa::avx512: return scale_avx512(x, r, w, offset, d, out);
    case Isa::avx2: return scale_avx2(x, r, w, offset, d, out);
    default: return scale_scalar(x, r, w, offset, d, out);
  }
}

__attribute__((target("avx512f"))) void add_avx512(float* x, const float* y, int64_t d) {
  int64_t i = 0;
  for (; i + 16 <= d; i += 16)
    _mm512_storeu_ps(x + i, _mm512_add_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
  for (; i < d; ++i) x[i] += y[i];
}

__attribute__((target("avx2,fma"))) void add_avx2(float* x, const float* y, int64_t d) {
  int64_t i = 0;
  for (; i + 8 <= d; i += 8)
    _mm256_storeu_ps(x + i, _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < d; ++i) x[i] += y[i];
}

void add(Isa isa, float* x, const float* y, int64_t d) {
  switch (isa) {
    case Isa::avx512: return add_avx512(x, y, d);
    case Isa::avx2: return add_avx2(x, y, d);
    default:
      for (int64_t i = 0; i < d; ++i) x[i] += y[i];
  }
}

// ---- rotate-half rotary of one head: x[i] = x[i] * cos[i] + x[i +- D/2] * sin_rolled[i] ----
// GCC contracts a * b + c into a fused multiply-add in C++ (intrinsics included) unless told not to: rounding both
// products first is what keeps the rotation bit-exact against PyTorch's.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

__attribute__((target("avx512f"))) void rotate_avx512(float* x, const float* c, const float* s, int64_t half) {
  int64_t i = 0;
  for (; i + 16 <= half; i += 16) {
    const __m512 a = _mm512_loadu_ps(x + i), b = _mm512_loadu_ps(x + half + i);
    _mm512_storeu_ps(x + i, _mm512_add_ps(_mm512_mul_ps(a, _mm512_loadu_ps(c + i)),
                                          _mm512_mul_ps(b, _mm512_loadu_ps(s + i))));
    _mm512_storeu_ps(x + half + i, _mm512_add_ps(_mm512_mul_ps(b, _mm512_loadu_ps(c + half + i)),
                                                 _mm512_mul_ps(a, _mm512_loadu_ps(s + half + i))));
  }
  for (; i < half; ++i) {
    const float a = x[i], b = x[half + i];
    x[i] = a * c[i] + b * s[i];
    x[half + i] = b * c[half + i] + a * s[half + i];
  }
}

__attribute__((target("avx2,fma"))) void rotate_avx2(float* x, const float* c, const float* s, int64_t half) {
  int64_t i = 0;
  for (; i + 8 <= half; i += 8) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + half + i);
    _mm256_storeu_ps(x + i, _mm256_add_ps(_mm256_mul_ps(a, _mm256_loadu_ps(c + i)),
                                          _mm256_mul_ps(b, _mm256_loadu_ps(s + i))));
    _mm256_storeu_ps(x + half + i, _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(c + half + i)),
                                                 _mm256_mul_ps(a, _mm256_loadu_ps(s + half + i))));
  }
  for (; i < half; ++i) {
    const float a = x[i], b = x[half + i];
    x[i] = a * c[i] + b * s[i];
    x[half + i] = b * c[half + i] + a * s[half + i];
  }
}

void rotate_scalar(float* x, const float* c, const float* s, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[half + i];
    x[i] = a * c[i] + b * s[i];
    x[half + i] = b * c[half + i] + a * s[half + i];
  }
}

#pragma GCC pop_options

void rotate(Isa isa, float* x, const float* c, const float* s, int64_t half) {
  switch (isa) {
    case Isa::avx512: return rotate_avx512(x, c, s, half);
    case Isa::avx2: return rotate_avx2(x, c, s, half);
    default: return rotate_scalar(x, c, s, half);
  }
}

// ---- shapes: rows of D contiguous floats, as [T, D] or [T, H, D] with any row and head strides ----

struct Rows {
  float* base;
  int64_t tokens, heads, dim, token_stride, head_stride;

  float* row(int64_t index) const { return base + (index / heads) * token_stride + (index % heads) * head_stride; }
  int64_t count() const { return tokens * heads; }
};

Rows rows_of(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu(), op, ": x must be a float32 CPU tensor");
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3, op, ": x must be [T, D] or [T, H, D]");
  TORCH_CHECK(x.stride(-1) == 1, op, ": the last dimension of x must be contiguous");
  if (x.dim() == 2) return {x.data_ptr<float>(), x.size(0), 1, x.size(1), x.stride(0), 0};
  return {x.data_ptr<float>(), x.size(0), x.size(1), x.size(2), x.stride(0), x.stride(1)};
}

int64_t grain(int64_t dim) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(dim, 1)); }

const float* weight_of(const at::Tensor& weight, int64_t dim, const char* op) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.dim() == 1 &&
              weight.size(0) == dim, op, ": weight must be float32 [", dim, "], contiguous");
  return weight.data_ptr<float>();
}

// x's rows are read where they are (a strided view of the fused qkv output for per-head norms); out is contiguous.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool unit_offset) {
  const at::Tensor xs = x.stride(-1) == 1 ? x : x.contiguous();
  const Rows in = rows_of(xs, "rms_norm");
  const float* w = weight_of(weight, in.dim, "rms_norm");
  at::Tensor out = at::empty_like(xs, at::MemoryFormat::Contiguous);
  float* op = out.data_ptr<float>();
  const Isa isa = active_isa();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, in.count(), grain(in.dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = in.row(r);
      scale(isa, row, inverse_rms(isa, row, in.dim, e), w, unit_offset, in.dim, op + r * in.dim);
    }
  });
  return out;
}

void rms_norm_(const at::Tensor& x, const at::Tensor& weight, double eps, bool unit_offset) {
  const Rows in = rows_of(x, "rms_norm_");
  const float* w = weight_of(weight, in.dim, "rms_norm_");
  const Isa isa = active_isa();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, in.count(), grain(in.dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = in.row(r);
      scale(isa, row, inverse_rms(isa, row, in.dim, e), w, unit_offset, in.dim, row);
    }
  });
}

// x <- (pre_weight ? norm(x; pre_weight) : x) + residual, then returns norm(x; weight) as a new tensor.
at::Tensor add_rms_norm_(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
                         bool unit_offset, const std::optional<at::Tensor>& pre_weight) {
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2, "add_rms_norm_: x must be contiguous [T, D]");
  const Rows in = rows_of(x, "add_rms_norm_");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == at::kFloat,
              "add_rms_norm_: residual must be float32 of x's shape");
  const at::Tensor rc = residual.contiguous();
  const float* w = weight_of(weight, in.dim, "add_rms_norm_");
  const float* pre = pre_weight.has_value() && pre_weight->defined() ?
      weight_of(*pre_weight, in.dim, "add_rms_norm_ (pre_weight)") : nullptr;
  at::Tensor out = at::empty_like(x);
  const float* rp = rc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const Isa isa = active_isa();
  const float e = static_cast<float>(eps);
  const int64_t d = in.dim;
  at::parallel_for(0, in.tokens, grain(d), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* row = in.base + t * d;
      if (pre != nullptr) scale(isa, row, inverse_rms(isa, row, d, e), pre, unit_offset, d, row);
      add(isa, row, rp + t * d, d);
      scale(isa, row, inverse_rms(isa, row, d, e), w, unit_offset, d, op + t * d);
    }
  });
  return out;
}

// heads [T, H, D] (any token and head strides) rotated in place with this step's cos and sin_rolled rows [T, D]
// (or [T, 1, D]).
void rotary_(const at::Tensor& heads, const at::Tensor& cos, const at::Tensor& sin_rolled) {
  TORCH_CHECK(heads.dim() == 3, "rotary_: heads must be [T, H, D]");
  const Rows in = rows_of(heads, "rotary_");
  TORCH_CHECK(in.dim % 2 == 0, "rotary_: the head size must be even");
  for (const at::Tensor* table : {&cos, &sin_rolled}) {
    TORCH_CHECK(table->scalar_type() == at::kFloat && table->size(0) == in.tokens &&
                table->size(-1) == in.dim && table->stride(-1) == 1 && table->numel() == in.tokens * in.dim,
                "rotary_: cos and sin_rolled must be float32 [T, D] rows, the last dimension contiguous");
  }
  const float* c = cos.data_ptr<float>();
  const float* s = sin_rolled.data_ptr<float>();
  const int64_t cs = cos.stride(0), ss = sin_rolled.stride(0), half = in.dim / 2;
  const Isa isa = active_isa();
  at::parallel_for(0, in.count(), grain(in.dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t t = r / in.heads;
      rotate(isa, in.row(r), c + t * cs, s + t * ss, half);
    }
  });
}

std::string family_norm_rope() { return "fused residual+RMSNorm and rotary"; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(PAGODA_NATIVE_NAMESPACE, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool unit_offset) -> Tensor", &rms_norm);
  m.def("rms_norm_(Tensor(a!) x, Tensor weight, float eps, bool unit_offset) -> ()", &rms_norm_);
  m.def("add_rms_norm_(Tensor(a!) x, Tensor residual, Tensor weight, float eps, bool unit_offset, "
        "Tensor? pre_weight) -> Tensor", &add_rms_norm_);
  m.def("rotary_(Tensor(a!) heads, Tensor cos, Tensor sin_rolled) -> ()", &rotary_);
  m.def("family_norm_rope() -> str", &family_norm_rope);
}
