#pragma once
// BM_IntegerDotPeak: the integer multiply-add rate of one core, in the instructions the integer
// kernels (KIVI, KVQuant, q4_0, int8, q8_0) spend their products in. MACs divided by this rate is
// the least time their products can take, whatever else a kernel does. Twelve independent
// accumulators cover the instructions' latency (4 cycles for VNNI on the Zen 5 host, where one
// chain alone ran at a quarter of an instruction a cycle; at two a cycle eight must be in flight).
// - AVX-512 VNNI: `vpdpwssd` (two int16 products per 32-bit lane: 32 MACs an instruction) and
//   `vpdpbusd` (four u8·s8 products: 64 MACs).
// - AVX2 (the kernels' avx2 target: a CPU without VNNI, or KVPACK_ISA=avx2; integer_avx2.hpp):
//   no accumulating form, so each product instruction comes with an add, as in the kernels'
//   loops: `vpmaddwd` + `vpaddd` (16 MACs) for the int16 rows, `vpmaddubsw` + `vpaddw` (32 MACs
//   into int16 sums, as KIVI's values and q4_0 take them) for the int8 ones.

#include <benchmark/benchmark.h>

#include <cstdint>
#include <string_view>

#include "kvpack/dispatch.hpp"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KVPACK_BENCH_INTEGER_PEAK 1
#endif

namespace kvpack::bench {

#if KVPACK_BENCH_INTEGER_PEAK
template <bool Words>
__attribute__((target("avx512f,avx512bw,avx512vnni")))  //
inline __m512i vnni_dot(__m512i acc, __m512i x, __m512i y) {
  return Words ? _mm512_dpwssd_epi32(acc, x, y) : _mm512_dpbusd_epi32(acc, x, y);
}

/// `steps` rounds of twelve independent `vpdpwssd` (Words) or `vpdpbusd`, summed into `lanes`.
template <bool Words>
__attribute__((target("avx512f,avx512bw,avx512vnni")))  //
inline void vnni_chains(std::int64_t steps, std::int32_t* lanes) {
  __m512i x = _mm512_set1_epi16(3), y = _mm512_set1_epi16(5);
  __asm__ volatile("" : "+v"(x), "+v"(y));  // opaque operands: nothing folds at compile time
  // Distinct starting values: equal chains would be merged into one by the compiler.
  __m512i acc[12];
  for (int k = 0; k < 12; ++k) acc[k] = _mm512_set1_epi32(k);
  for (std::int64_t i = 0; i < steps; ++i) {
#pragma GCC unroll 12  // all twelve (KVPACK_UNROLL stops at 8): the accumulators stay in registers
    for (int k = 0; k < 12; ++k) acc[k] = vnni_dot<Words>(acc[k], x, y);
  }
  for (const __m512i a : acc) _mm512_storeu_si512(lanes, _mm512_add_epi32(_mm512_loadu_si512(lanes), a));
}

/// The same on AVX2: twelve independent chains of a product and an add.
template <bool Words>
__attribute__((target("avx2")))  //
inline __m256i avx2_dot(__m256i acc, __m256i x, __m256i y) {
  return Words ? _mm256_add_epi32(acc, _mm256_madd_epi16(x, y)) : _mm256_add_epi16(acc, _mm256_maddubs_epi16(x, y));
}

template <bool Words>
__attribute__((target("avx2")))  //
inline void avx2_chains(std::int64_t steps, std::int32_t* lanes) {
  __m256i x = _mm256_set1_epi16(3), y = _mm256_set1_epi16(5);
  __asm__ volatile("" : "+x"(x), "+x"(y));
  __m256i acc[12];
  for (int k = 0; k < 12; ++k) acc[k] = _mm256_set1_epi32(k);
  for (std::int64_t i = 0; i < steps; ++i) {
#pragma GCC unroll 12
    for (int k = 0; k < 12; ++k) acc[k] = avx2_dot<Words>(acc[k], x, y);
  }
  for (const __m256i a : acc) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes),
                        _mm256_add_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lanes)), a));
  }
}
#endif

/// Counters: GMACps (multiply-adds per second) and Ginstr_per_s (product instructions per
/// second); the label names the instructions. VNNI or AVX2, as the kernels run.
template <bool Words>
void integer_dot_peak(benchmark::State& state) {
#if KVPACK_BENCH_INTEGER_PEAK
  // The kernels' own choice (the CPU, or KVPACK_ISA): their avx512 target includes VNNI.
  const std::string_view isa = dispatch::active_cpu_isa();
  const bool vnni = isa == "avx512";
  if (!vnni && isa != "avx2") {
    state.SkipWithError("the kernels run for sse2 here, where KIVI, KVQuant, int8, q8_0 and q4_0 take fp32 paths");
    return;
  }
  constexpr std::int64_t kSteps = 1 << 16;
  std::int32_t lanes[16] = {};
  for (auto _ : state) {
    if (vnni) {
      vnni_chains<Words>(kSteps, lanes);
    } else {
      avx2_chains<Words>(kSteps, lanes);
    }
    benchmark::DoNotOptimize(lanes);
  }
  const double instructions = 12.0 * kSteps * static_cast<double>(state.iterations());
  state.counters["Ginstr_per_s"] = benchmark::Counter(instructions / 1e9, benchmark::Counter::kIsRate);
  const int macs_per_instruction = (vnni ? 2 : 1) * (Words ? 16 : 32);
  state.counters["GMACps"] = benchmark::Counter(instructions * macs_per_instruction / 1e9, benchmark::Counter::kIsRate);
  state.SetLabel(vnni ? (Words ? "vpdpwssd" : "vpdpbusd") : (Words ? "vpmaddwd+vpaddd" : "vpmaddubsw+vpaddw"));
#else
  state.SkipWithError("the integer kernels are x86-64 only");
#endif
}

}  // namespace kvpack::bench
