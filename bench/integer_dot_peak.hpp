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
  __m512i acc[12];
  for (int k = 0; k < 12; ++k) acc[k] = _mm512_set1_epi32(k);
  for (std::int64_t i = 0; i < steps; ++i) {
#pragma GCC unroll 12  // all twelve (KVPACK_UNROLL stops at 8): the accumulators stay in registers
    for (int k = 0; k < 12; ++k) acc[k] = vnni_dot<Words>(acc[k], x, y);
  }
  for (const __m512i a : acc) _mm512_storeu_si512(lanes, _mm512_add_epi32(_mm512_loadu_si512(lanes), a));
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
