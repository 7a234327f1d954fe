#pragma once
// BM_IntegerDotPeak: the AVX-512 VNNI multiply-add rate of one core. The integer kernels (KIVI,
// KVQuant, q4_0, int8, q8_0) spend their products in `vpdpwssd` (two int16 products per 32-bit
// lane: 32 MACs an instruction) and `vpdpbusd` (four u8·s8 products: 64 MACs); MACs divided by
// this rate is the least time their products can take, whatever else a kernel does. Twelve
// independent accumulators cover the instruction's latency: 4 cycles on the Zen 5 host (one chain
// alone ran at a quarter of an instruction a cycle), so at two a cycle eight must be in flight.

#include <benchmark/benchmark.h>

#include <cstdint>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KVPACK_BENCH_VNNI_PEAK 1
#endif

namespace kvpack::bench {

#if KVPACK_BENCH_VNNI_PEAK
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
  __m512i a0 = _mm512_set1_epi32(0), a1 = _mm512_set1_epi32(1), a2 = _mm512_set1_epi32(2);
  __m512i a3 = _mm512_set1_epi32(3), a4 = _mm512_set1_epi32(4), a5 = _mm512_set1_epi32(5);
  __m512i a6 = _mm512_set1_epi32(6), a7 = _mm512_set1_epi32(7), a8 = _mm512_set1_epi32(8);
  __m512i a9 = _mm512_set1_epi32(9), a10 = _mm512_set1_epi32(10), a11 = _mm512_set1_epi32(11);
  for (std::int64_t i = 0; i < steps; ++i) {
    a0 = vnni_dot<Words>(a0, x, y);
    a1 = vnni_dot<Words>(a1, x, y);
    a2 = vnni_dot<Words>(a2, x, y);
    a3 = vnni_dot<Words>(a3, x, y);
    a4 = vnni_dot<Words>(a4, x, y);
    a5 = vnni_dot<Words>(a5, x, y);
    a6 = vnni_dot<Words>(a6, x, y);
    a7 = vnni_dot<Words>(a7, x, y);
    a8 = vnni_dot<Words>(a8, x, y);
    a9 = vnni_dot<Words>(a9, x, y);
    a10 = vnni_dot<Words>(a10, x, y);
    a11 = vnni_dot<Words>(a11, x, y);
  }
  for (const __m512i a : {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11}) {
    _mm512_storeu_si512(lanes, _mm512_add_epi32(_mm512_loadu_si512(lanes), a));
  }
}
#endif

/// Counters: GMACps (multiply-adds per second) and Ginstr_per_s (instructions per second).
template <bool Words>
void integer_dot_peak(benchmark::State& state) {
#if KVPACK_BENCH_VNNI_PEAK
  if (!__builtin_cpu_supports("avx512vnni")) {
    state.SkipWithError("this CPU has no AVX-512 VNNI: the integer kernels run their fp32 path");
    return;
  }
  constexpr std::int64_t kSteps = 1 << 16;
  std::int32_t lanes[16] = {};
  for (auto _ : state) {
    vnni_chains<Words>(kSteps, lanes);
    benchmark::DoNotOptimize(lanes);
  }
  const double instructions = 12.0 * kSteps * static_cast<double>(state.iterations());
  state.counters["Ginstr_per_s"] = benchmark::Counter(instructions / 1e9, benchmark::Counter::kIsRate);
  const double macs = instructions * (Words ? 32 : 64);
  state.counters["GMACps"] = benchmark::Counter(macs / 1e9, benchmark::Counter::kIsRate);
#else
  state.SkipWithError("AVX-512 VNNI is x86-64 only");
#endif
}

}  // namespace kvpack::bench
