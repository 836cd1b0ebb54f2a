// What every native kernel shares: the instruction set picked at run time, and vector loads of fp32 / int8 weights.
// Each ISA body carries its own target attribute (no -march flags), so one build serves any x86-64 CPU.
#pragma once
#include <immintrin.h>
#include <cstdint>

namespace pagoda_native {

enum class Isa { scalar, avx2, avx512 };

inline Isa detect_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return Isa::avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::avx2;
  return Isa::scalar;
}

inline Isa active_isa() {
  static const Isa isa = detect_isa();
  return isa;
}

// Loads 16 (AVX-512) or 8 (AVX2) weights as floats: fp32 as is, int8 widened.
__attribute__((target("avx512f"))) inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f"))) inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
__attribute__((target("avx2,fma"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,fma"))) inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

__attribute__((target("avx2,fma"))) inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace pagoda_native

#include <cstdlib>
#include <string>

namespace pagoda_native {

// active_isa(), or a narrower one named by PAGODA_NATIVE_ISA (avx2 or scalar), read once: lets tests and benchmarks
// run every path on one machine. A name wider than the CPU supports is ignored.
inline Isa kernel_isa() {
  static const Isa isa = [] {
    const char* name = std::getenv("PAGODA_NATIVE_ISA");
    const Isa best = active_isa();
    if (name == nullptr) return best;
    const std::string wanted(name);
    if (wanted == "scalar") return Isa::scalar;
    if (wanted == "avx2" && best != Isa::scalar) return Isa::avx2;
    return best;
  }();
  return isa;
}

}  // namespace pagoda_native
