// A whole mixture-of-experts block's experts for decode-sized inputs, in one op:
//   out[t] = sum over the token's top-k (expert e, weight w) of w * down_e(act(gate_e(x_t)) * up_e(x_t))
// with the experts' stacked weights as the model holds them: gate_up [E, 2I, H'] (the I gate rows, then the I up
// rows) and down [E, H, I'], float32 or int8 with float32 scales per output row, optional biases [E, 2I] / [E, H].
// The (token, expert) pairs are grouped by expert here (a counting sort, stable in token order), then two parallel
// regions: (1) over (hit expert, block of intermediate rows): the block's gate and up rows are read once for all
// the expert's tokens, and the activation is written per pair; (2) over blocks of output rows: for each hit expert
// in order, the block's down rows are read once for all its pairs and each token's output accumulates w * y in
// expert order (as transformers' index_add_ does), with no write shared between threads.
// Activation: SiLU, or gpt-oss's clamped SwiGLU when a limit is given. Experts outside [first_expert,
// first_expert + E) belong to other ranks (expert parallelism) and are skipped.
#include <ATen/core/Tensor.h>
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>
#include <vector>
#include <immintrin.h>
#include <cstdint>
#include "simd.h"

namespace {

using namespace pagoda_native;

constexpr int kBlockRows = 4;  // gate and up rows per tile (4 of each)
constexpr int kDownRows = 8;   // down rows per tile
constexpr int kMaxCols = 3;    // input rows (tokens) sharing one pass over the tile's weight rows

// out[i] = the sum of v[i]'s lanes for 16 vectors, in 45 instructions instead of 16 full reductions.
__attribute__((target("avx512f"))) inline __m512 sum16(const __m512* v) {
  __m512 quads[4];  // quads[g] lane block q: the sums over block q of v[4g .. 4g + 3]
  for (int g = 0; g < 4; ++g) {
    const __m512* u = v + 4 * g;
    const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(u[0], u[1]), _mm512_unpackhi_ps(u[0], u[1]));
    const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(u[2], u[3]), _mm512_unpackhi_ps(u[2], u[3]));
    const __m512d a = _mm512_castps_pd(s01), b = _mm512_castps_pd(s23);
    quads[g] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 h01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 h23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(h01, h23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(h01, h23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// acc[r * C + c] = dot(w[r][0:k], x[c][0:k]) for R weight rows and C input rows given by pointers. `next`: the
// rows the following tile reads (or null), fetched into the cache meanwhile: a tile's rows span a few pages, where
// the hardware prefetcher stops.
template <typename W, int R, int C>
__attribute__((target("avx512f"))) void dots_avx512(const W* const* w, const float* const* x, int64_t k,
                                                    float* acc, const W* const* next) {
  __m512 sum[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) sum[r][c] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    __m512 xv[C];
    _Pragma("GCC unroll 4") for (int c = 0; c < C; ++c) xv[c] = _mm512_loadu_ps(x[c] + i);
    if (next && (i * sizeof(W)) % 64 == 0)
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(next[r] + i), _MM_HINT_T0);
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
      const __m512 wv = load16(w[r] + i);
      _Pragma("GCC unroll 4") for (int c = 0; c < C; ++c) sum[r][c] = _mm512_fmadd_ps(wv, xv[c], sum[r][c]);
    }
  }
  constexpr int n = R * C, padded = (n + 15) / 16 * 16;
  __m512 flat[padded];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) flat[r * C + c] = sum[r][c];
  for (int j = n; j < padded; ++j) flat[j] = _mm512_setzero_ps();
  float sums[padded];
  for (int j = 0; j < padded; j += 16) _mm512_storeu_ps(sums + j, sum16(flat + j));
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float s = sums[r * C + c];
      for (int64_t j = i; j < k; ++j) s += static_cast<float>(w[r][j]) * x[c][j];
      acc[r * C + c] = s;
    }
}

template <typename W, int R, int C>
__attribute__((target("avx2,fma"))) void dots_avx2(const W* const* w, const float* const* x, int64_t k, float* acc) {
  __m256 sum[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) sum[r][c] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    __m256 xv[C];
    _Pragma("GCC unroll 4") for (int c = 0; c < C; ++c) xv[c] = _mm256_loadu_ps(x[c] + i);
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
      const __m256 wv = load8(w[r] + i);
      _Pragma("GCC unroll 4") for (int c = 0; c < C; ++c) sum[r][c] = _mm256_fmadd_ps(wv, xv[c], sum[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float s = hsum8(sum[r][c]);
      for (int64_t j = i; j < k; ++j) s += static_cast<float>(w[r][j]) * x[c][j];
      acc[r * C + c] = s;
    }
}

template <typename W, int R, int C>
void dots_scalar(const W* const* w, const float* const* x, int64_t k, float* acc) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float s = 0.f;
      for (int64_t j = 0; j < k; ++j) s += static_cast<float>(w[r][j]) * x[c][j];
      acc[r * C + c] = s;
    }
}

template <typename W, int R, int C>
void dots(Isa isa, const W* const* w, const float* const* x, int64_t k, float* acc, const W* const* next) {
  switch (isa) {
    case Isa::avx512: return dots_avx512<W, R, C>(w, x, k, acc, next);
    case Isa::avx2: return dots_avx2<W, R, C>(w, x, k, acc);
    default: return dots_scalar<W, R, C>(w, x, k, acc);
  }
}

// acc [R][kMaxCols] for `cols` (1..kMaxCols) input rows; AVX2 has half the registers: one input row per pass.
template <typename W, int R>
void dots_cols(Isa isa, const W* const* w, const float* const* x, int64_t cols, int64_t k, float* acc,
               const W* const* next) {
  float part[R * kMaxCols];
  int64_t done = 0;
  while (done < cols) {
    int64_t c = isa == Isa::avx512 ? std::min<int64_t>(kMaxCols, cols - done) : 1;
    switch (c) {
      case 3: dots<W, R, 3>(isa, w, x + done, k, part, done ? nullptr : next); break;
      case 2: dots<W, R, 2>(isa, w, x + done, k, part, done ? nullptr : next); break;
      default: dots<W, R, 1>(isa, w, x + done, k, part, done ? nullptr : next); break;
    }
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < c; ++j) acc[r * kMaxCols + done + j] = part[r * c + j];
    done += c;
  }
}

struct Activation {
  bool clamped;  // gpt-oss's SwiGLU
  float limit, alpha;
  float operator()(float gate, float up) const {
    if (!clamped) return gate / (1.f + std::exp(-gate)) * up;
    gate = std::min(gate, limit);
    up = std::max(-limit, std::min(up, limit));
    return (up + 1.f) * (gate / (1.f + std::exp(-gate * alpha)));
  }
};

struct Projection {
  at::Tensor weight;      // [E, N, K' >= K] float32 or int8, rows contiguous
  const float* scales;    // [E, N] (int8) or null
  const float* bias;      // [E, N] or null
  int64_t n, ldw, lde;    // output rows, row stride, expert stride
};

Projection projection(const char* what, const at::Tensor& weight, const std::optional<at::Tensor>& scales,
                      const std::optional<at::Tensor>& bias, int64_t experts, int64_t k,
                      std::vector<at::Tensor>& keep) {
  TORCH_CHECK(weight.dim() == 3 && weight.size(0) == experts, "fused_moe: ", what, " must be [E, N, K] with E = ",
              experts);
  TORCH_CHECK(weight.stride(2) == 1, "fused_moe: ", what, " rows must be contiguous");
  TORCH_CHECK(weight.size(2) >= k, "fused_moe: ", what, " has ", weight.size(2), " inputs, needs ", k);
  Projection p{weight, nullptr, nullptr, weight.size(1), weight.stride(1), weight.stride(0)};
  if (weight.scalar_type() == at::kChar) {
    TORCH_CHECK(scales.has_value() && scales->defined(), "fused_moe: int8 ", what, " needs its scales");
    TORCH_CHECK(scales->scalar_type() == at::kFloat && scales->is_contiguous() && scales->numel() == experts * p.n,
                "fused_moe: ", what, " scales must be float32 [E, N], contiguous");
    p.scales = scales->data_ptr<float>();
  } else {
    TORCH_CHECK(weight.scalar_type() == at::kFloat, "fused_moe: ", what, " must be float32 or int8");
  }
  if (bias.has_value() && bias->defined()) {
    keep.push_back(bias->to(at::kFloat).contiguous());
    TORCH_CHECK(keep.back().numel() == experts * p.n, "fused_moe: ", what, " bias must be [E, N]");
    p.bias = keep.back().data_ptr<float>();
  }
  return p;
}

template <typename W>
void run(const at::Tensor& x, const int64_t* ids, const float* route_weights, int64_t top_k, const Projection& gate_up,
         const Projection& down, int64_t first_expert, const Activation& act, at::Tensor& out) {
  const int64_t tokens = x.size(0), hidden = x.size(1), experts = gate_up.weight.size(0);
  const int64_t inter = gate_up.n / 2;
  // The pairs grouped by expert, in token order within each expert.
  std::vector<int64_t> start(experts + 1, 0);
  for (int64_t p = 0; p < tokens * top_k; ++p) {
    const int64_t e = ids[p] - first_expert;
    if (e >= 0 && e < experts) ++start[e + 1];
  }
  for (int64_t e = 0; e < experts; ++e) start[e + 1] += start[e];
  const int64_t pairs = start[experts];
  if (pairs == 0) return;
  std::vector<int64_t> pair_token(pairs), fill(start.begin(), start.end() - 1);
  std::vector<float> pair_weight(pairs);
  for (int64_t p = 0; p < tokens * top_k; ++p) {
    const int64_t e = ids[p] - first_expert;
    if (e >= 0 && e < experts) {
      pair_token[fill[e]] = p / top_k;
      pair_weight[fill[e]++] = route_weights[p];
    }
  }
  std::vector<int64_t> hit;
  for (int64_t e = 0; e < experts; ++e)
    if (start[e + 1] > start[e]) hit.push_back(e);
  const float* xp = x.data_ptr<float>();
  const W* gw = gate_up.weight.data_ptr<W>();
  const W* dw = down.weight.data_ptr<W>();
  std::vector<float> activated(pairs * inter);
  const Isa isa = active_isa();

  // (1) gate and up: one task per (hit expert, block of intermediate rows).
  const int64_t blocks = (inter + kBlockRows - 1) / kBlockRows;
  at::parallel_for(0, static_cast<int64_t>(hit.size()) * blocks, 1, [&](int64_t begin, int64_t end) {
    float acc[2 * kBlockRows * kMaxCols];
    const W* rows[2 * kBlockRows];
    const W* next[2 * kBlockRows];
    const float* cols[kMaxCols];
    // A short block repeats its last row (computed, never stored).
    auto tile_rows = [&](int64_t task, const W** out) {
      const int64_t j0 = (task % blocks) * kBlockRows, nrows = std::min<int64_t>(kBlockRows, inter - j0);
      const W* base = gw + hit[task / blocks] * gate_up.lde;
      for (int r = 0; r < kBlockRows; ++r) {
        const int64_t j = j0 + std::min<int64_t>(r, nrows - 1);
        out[r] = base + j * gate_up.ldw;
        out[kBlockRows + r] = base + (inter + j) * gate_up.ldw;
      }
    };
    for (int64_t task = begin; task < end; ++task) {
      const int64_t e = hit[task / blocks], j0 = (task % blocks) * kBlockRows;
      const int64_t nrows = std::min<int64_t>(kBlockRows, inter - j0);
      tile_rows(task, rows);
      if (task + 1 < end) tile_rows(task + 1, next);
      const float* scale = gate_up.scales ? gate_up.scales + e * gate_up.n : nullptr;
      const float* bias = gate_up.bias ? gate_up.bias + e * gate_up.n : nullptr;
      for (int64_t p0 = start[e]; p0 < start[e + 1]; p0 += kMaxCols) {
        const int64_t ncols = std::min<int64_t>(kMaxCols, start[e + 1] - p0);
        for (int64_t c = 0; c < ncols; ++c) cols[c] = xp + pair_token[p0 + c] * hidden;
        dots_cols<W, 2 * kBlockRows>(isa, rows, cols, ncols, hidden, acc, task + 1 < end ? next : nullptr);
        for (int64_t r = 0; r < nrows; ++r) {
          const int64_t g = j0 + r, u = inter + j0 + r;
          for (int64_t c = 0; c < ncols; ++c) {
            float gv = acc[r * kMaxCols + c], uv = acc[(kBlockRows + r) * kMaxCols + c];
            if (scale) gv *= scale[g], uv *= scale[u];
            if (bias) gv += bias[g], uv += bias[u];
            activated[(p0 + c) * inter + g] = act(gv, uv);
          }
        }
      }
    }
  });

  // (2) down and the weighted sum: one task per block of output rows, over every hit expert in order.
  float* op = out.data_ptr<float>();
  const float* ap = activated.data();
  const int64_t out_blocks = (hidden + kDownRows - 1) / kDownRows;
  at::parallel_for(0, out_blocks, 1, [&](int64_t begin, int64_t end) {
    float acc[kDownRows * kMaxCols];
    const W* rows[kDownRows];
    const W* next[kDownRows];
    const float* cols[kMaxCols];
    auto tile_rows = [&](int64_t e, int64_t block, const W** out) {
      const int64_t h0 = block * kDownRows, nrows = std::min<int64_t>(kDownRows, hidden - h0);
      for (int r = 0; r < kDownRows; ++r)
        out[r] = dw + e * down.lde + (h0 + std::min<int64_t>(r, nrows - 1)) * down.ldw;
    };
    for (size_t h = 0; h < hit.size(); ++h) {
      const int64_t e = hit[h];
      const float* scale = down.scales ? down.scales + e * down.n : nullptr;
      const float* bias = down.bias ? down.bias + e * down.n : nullptr;
      for (int64_t block = begin; block < end; ++block) {
        const int64_t h0 = block * kDownRows, nrows = std::min<int64_t>(kDownRows, hidden - h0);
        tile_rows(e, block, rows);
        const bool more = block + 1 < end || h + 1 < hit.size();
        if (more) block + 1 < end ? tile_rows(e, block + 1, next) : tile_rows(hit[h + 1], begin, next);
        for (int64_t p0 = start[e]; p0 < start[e + 1]; p0 += kMaxCols) {
          const int64_t ncols = std::min<int64_t>(kMaxCols, start[e + 1] - p0);
          for (int64_t c = 0; c < ncols; ++c) cols[c] = ap + (p0 + c) * inter;
          dots_cols<W, kDownRows>(isa, rows, cols, ncols, inter, acc, more ? next : nullptr);
          for (int64_t r = 0; r < nrows; ++r) {
            const int64_t h = h0 + r;
            for (int64_t c = 0; c < ncols; ++c) {
              float y = acc[r * kMaxCols + c];
              if (scale) y *= scale[h];
              if (bias) y += bias[h];
              op[pair_token[p0 + c] * hidden + h] += y * pair_weight[p0 + c];
            }
          }
        }
      }
    }
  });
}

at::Tensor fused_moe(const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                     const at::Tensor& gate_up, const std::optional<at::Tensor>& gate_up_scales,
                     const std::optional<at::Tensor>& gate_up_bias, const at::Tensor& down,
                     const std::optional<at::Tensor>& down_scales, const std::optional<at::Tensor>& down_bias,
                     int64_t first_expert, std::optional<double> swiglu_limit, double swiglu_alpha) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat, "fused_moe: hidden must be float32 [T, H]");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == hidden.size(0) && topk_ids.scalar_type() == at::kLong,
              "fused_moe: topk_ids must be int64 [T, k]");
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes(), "fused_moe: topk_weights must be [T, k] like topk_ids");
  TORCH_CHECK(gate_up.scalar_type() == down.scalar_type(), "fused_moe: gate_up and down must share a type");
  const at::Tensor x = hidden.contiguous();
  const at::Tensor ids = topk_ids.contiguous();
  const at::Tensor weights = topk_weights.to(at::kFloat).contiguous();
  const int64_t experts = gate_up.size(0), hidden_size = x.size(1);
  std::vector<at::Tensor> keep;
  keep.reserve(2);
  const Projection gu = projection("gate_up", gate_up, gate_up_scales, gate_up_bias, experts, hidden_size, keep);
  TORCH_CHECK(gu.n % 2 == 0, "fused_moe: gate_up must hold 2I rows");
  const Projection dn = projection("down", down, down_scales, down_bias, experts, gu.n / 2, keep);
  TORCH_CHECK(dn.n == hidden_size, "fused_moe: down has ", dn.n, " outputs, hidden has ", hidden_size);
  at::Tensor out = at::zeros_like(x);
  const Activation act{swiglu_limit.has_value(), static_cast<float>(swiglu_limit.value_or(0.0)),
                       static_cast<float>(swiglu_alpha)};
  if (x.size(0) == 0 || ids.size(1) == 0) return out;
  if (gate_up.scalar_type() == at::kChar) {
    run<int8_t>(x, ids.data_ptr<int64_t>(), weights.data_ptr<float>(), ids.size(1), gu, dn, first_expert, act, out);
  } else {
    run<float>(x, ids.data_ptr<int64_t>(), weights.data_ptr<float>(), ids.size(1), gu, dn, first_expert, act, out);
  }
  return out;
}

// Each token's top-k experts from router logits [T, E] float32: softmax over all E then the k largest (renormalized
// to sum 1 when asked), or (gpt-oss) the k largest logits then a softmax over them. Ties go to the lower expert.
// Returns (weights [T, k] float32, ids [T, k] int64), largest first, as torch.topk orders them.
std::tuple<at::Tensor, at::Tensor> route_top_k(const at::Tensor& logits, int64_t top_k, bool renormalize,
                                               bool softmax_over_top_k) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "route_top_k: logits must be float32 [T, E]");
  const int64_t tokens = logits.size(0), experts = logits.size(1);
  TORCH_CHECK(top_k >= 1 && top_k <= experts, "route_top_k: top_k ", top_k, " of ", experts, " experts");
  const at::Tensor lc = logits.contiguous();
  at::Tensor weights = at::empty({tokens, top_k}, lc.options());
  at::Tensor ids = at::empty({tokens, top_k}, lc.options().dtype(at::kLong));
  const float* lp = lc.data_ptr<float>();
  float* wp = weights.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  std::vector<int64_t> order(experts);
  std::vector<float> probs(experts);
  for (int64_t t = 0; t < tokens; ++t) {
    const float* row = lp + t * experts;
    float* w = wp + t * top_k;
    int64_t* id = ip + t * top_k;
    for (int64_t e = 0; e < experts; ++e) order[e] = e;
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(), [row](int64_t a, int64_t b) {
      return row[a] > row[b] || (row[a] == row[b] && a < b);
    });
    const float top = row[order[0]];
    float total = 0.f;
    if (softmax_over_top_k) {
      for (int64_t j = 0; j < top_k; ++j) total += (w[j] = std::exp(row[order[j]] - top));
    } else {
      float all = 0.f;
      for (int64_t e = 0; e < experts; ++e) all += (probs[e] = std::exp(row[e] - top));
      for (int64_t j = 0; j < top_k; ++j) total += (w[j] = probs[order[j]] / all);
      if (!renormalize) total = 1.f;
    }
    for (int64_t j = 0; j < top_k; ++j) {
      w[j] /= total;
      id[j] = order[j];
    }
  }
  return {weights, ids};
}

std::string family_fused_moe() { return "fused MoE experts and top-k routing"; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(PAGODA_NATIVE_NAMESPACE, m) {
  m.def("family_fused_moe() -> str", &family_fused_moe);
  m.def("fused_moe(Tensor hidden, Tensor topk_ids, Tensor topk_weights, Tensor gate_up, Tensor? gate_up_scales, "
        "Tensor? gate_up_bias, Tensor down, Tensor? down_scales, Tensor? down_bias, int first_expert, "
        "float? swiglu_limit, float swiglu_alpha) -> Tensor",
        &fused_moe);
  m.def("route_top_k(Tensor logits, int top_k, bool renormalize, bool softmax_over_top_k) -> (Tensor, Tensor)",
        &route_top_k);
}
