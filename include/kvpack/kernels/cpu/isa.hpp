#pragma once
/// \file isa.hpp
/// \brief The CPU instruction sets kvpack compiles kernels for, and which one this CPU runs.
///
/// Three targets, best first: `avx512` (xsimd::avx512bw; the runtime-dispatch build also enables
/// AVX512-VNNI and F16C in it and only selects it on CPUs that have them), `avx2`
/// (xsimd::fma3<avx2> with F16C), `sse2` (every x86-64). Header-only users get the best target
/// their compiler flags allow (`default_arch`); the kvpack_cpu_dispatch library compiles every
/// target and picks one at run time. `KVPACK_ISA=avx512|avx2|sse2` forces a choice.

#include <cpuid.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include <xsimd/xsimd.hpp>

#include "kvpack/error.hpp"

namespace kvpack::inline v0::kernels::cpu {

/// Every target the dispatch library compiles, best first.
using cpu_archs = xsimd::arch_list<xsimd::avx512bw, xsimd::fma3<xsimd::avx2>, xsimd::sse2>;

/// The target this translation unit's flags select (header-only mode). xsimd's own default can
/// be an arch kvpack has no kernels for (avx, sse4_2, ...): fall back to the nearest one below.
#if XSIMD_WITH_AVX512BW
using default_arch = xsimd::avx512bw;
#elif XSIMD_WITH_FMA3_AVX2
using default_arch = xsimd::fma3<xsimd::avx2>;
#elif XSIMD_WITH_SSE2
using default_arch = xsimd::sse2;
#else
#error "kvpack's CPU kernels need x86-64 (SSE2 at least); other architectures are not yet supported"
#endif

/// The kvpack name of a target, as KVPACK_ISA and benchmark names spell it.
template <class Arch>
[[nodiscard]] constexpr std::string_view isa_name() noexcept {
  if constexpr (std::is_same_v<Arch, xsimd::avx512bw>) return "avx512";
  else if constexpr (std::is_same_v<Arch, xsimd::fma3<xsimd::avx2>>) return "avx2";
  else return "sse2";
}

namespace detail {

/// CPU features that matter to kvpack, read with cpuid and, for the vector state the OS must
/// save, xgetbv: a feature the OS has not enabled in XCR0 counts as absent.
struct CpuFeatures {
  bool sse2 = false, avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512dq = false, avx512vl = false, avx512cd = false;
  bool avx512vnni = false;
};

inline CpuFeatures read_cpu_features() noexcept {
  CpuFeatures f;
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(1, &a, &b, &c, &d) == 0) return f;
  f.sse2 = (d >> 26) & 1u;
  const bool osxsave = (c >> 27) & 1u;
  const bool fma = (c >> 12) & 1u;
  const bool f16c = (c >> 29) & 1u;
  std::uint64_t xcr0 = 0;
  if (osxsave) {
    unsigned lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    xcr0 = (static_cast<std::uint64_t>(hi) << 32) | lo;
  }
  const bool os_avx = (xcr0 & 0x6) == 0x6;          // XMM and YMM state
  const bool os_avx512 = (xcr0 & 0xE6) == 0xE6;     // plus opmask and ZMM state
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return f;
  f.avx2 = os_avx && ((b >> 5) & 1u);
  f.fma = os_avx && fma;
  f.f16c = os_avx && f16c;
  f.avx512f = os_avx512 && ((b >> 16) & 1u);
  f.avx512dq = os_avx512 && ((b >> 17) & 1u);
  f.avx512cd = os_avx512 && ((b >> 28) & 1u);
  f.avx512bw = os_avx512 && ((b >> 30) & 1u);
  f.avx512vl = os_avx512 && ((b >> 31) & 1u);
  f.avx512vnni = os_avx512 && ((c >> 11) & 1u);
  return f;
}

inline const CpuFeatures& cpu_features() noexcept {
  static const CpuFeatures features = read_cpu_features();
  return features;
}

}  // namespace detail

/// True when this CPU and OS can run the kernels compiled for `Arch` by the dispatch library.
template <class Arch>
[[nodiscard]] inline bool cpu_supports() noexcept {
  const detail::CpuFeatures& f = detail::cpu_features();
  if constexpr (std::is_same_v<Arch, xsimd::avx512bw>) {
    return f.avx512f && f.avx512bw && f.avx512dq && f.avx512vl && f.avx512cd && f.avx512vnni &&
           f.avx2 && f.fma && f.f16c;
  } else if constexpr (std::is_same_v<Arch, xsimd::fma3<xsimd::avx2>>) {
    return f.avx2 && f.fma && f.f16c;
  } else {
    return f.sse2;
  }
}

namespace detail {

/// KVPACK_ISA (any case) or, unset or empty, the best target this CPU runs; the name returned
/// is the library's own constant, not a view into the environment.
[[nodiscard]] inline std::string_view resolve_isa() {
  if (const char* forced = std::getenv("KVPACK_ISA"); forced != nullptr && *forced != '\0') {
    std::string name(forced);
    std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
    std::string_view chosen;
    bool runnable = false;
    cpu_archs::for_each([&](auto arch) {
      if (isa_name<decltype(arch)>() == name) {
        chosen = isa_name<decltype(arch)>();
        runnable = cpu_supports<decltype(arch)>();
      }
    });
    KVPACK_CHECK(!chosen.empty(), kInvalidConfig,
                 ::kvpack::detail::message("KVPACK_ISA=", forced, " is not one of avx512, avx2, sse2"));
    KVPACK_CHECK(runnable, kUnsupported,
                 ::kvpack::detail::message("KVPACK_ISA=", forced, " was forced but this CPU cannot run it"));
    return chosen;
  }
  std::string_view best = "sse2";
  bool found = false;
  cpu_archs::for_each([&](auto arch) {
    if (!found && cpu_supports<decltype(arch)>()) {
      best = isa_name<decltype(arch)>();
      found = true;
    }
  });
  return best;
}

}  // namespace detail

/// The target the dispatch library should run: KVPACK_ISA when set (an error if this CPU cannot
/// run it or the name is unknown), otherwise the best one the CPU supports. Read once per
/// process, so every kernel runs the same target whatever the environment does later; a bad
/// setting throws on every call (KVCache's constructor makes the first, before any write).
[[nodiscard]] inline std::string_view selected_isa() {
  static const std::string_view chosen = detail::resolve_isa();
  return chosen;
}

}  // namespace kvpack::inline v0::kernels::cpu
