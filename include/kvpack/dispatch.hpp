#pragma once
/// \file dispatch.hpp
/// \brief The one place that decides which compiled kernel runs.
///
/// Header-only (the default), every kernel is compiled inline for the including file's target
/// (`kernels::cpu::default_arch`, i.e. whatever -m flags it was built with). Linked with
/// kvpack::cpu_dispatch (which defines KVPACK_HAS_CPU_DISPATCH=1), the shipped kernels come
/// precompiled for AVX-512, AVX2 and SSE2, and the best one this CPU runs is chosen once per
/// kernel at first use (KVPACK_ISA overrides it).

#include <string_view>

#include "kvpack/kernels/cpu/isa.hpp"
#include "kvpack/kernels/cpu/kernels_impl.hpp"
#include "kvpack/kernels/cpu/precompiled.hpp"

#ifndef KVPACK_HAS_CPU_DISPATCH
#define KVPACK_HAS_CPU_DISPATCH 0
#endif

#if KVPACK_HAS_CPU_DISPATCH
// The bodies for these archs live in the dispatch library; never instantiate them here, where
// the compiler flags may not allow their instructions.
namespace kvpack::inline v0::kernels::cpu {
#define KVPACK_EXTERN_AVX512(Kernel) KVPACK_EXTERN_KERNEL_FOR(xsimd::avx512bw, Kernel)
#define KVPACK_EXTERN_AVX2(Kernel) KVPACK_EXTERN_KERNEL_FOR(xsimd::fma3<xsimd::avx2>, Kernel)
#define KVPACK_EXTERN_SSE2(Kernel) KVPACK_EXTERN_KERNEL_FOR(xsimd::sse2, Kernel)
KVPACK_FOR_EACH_PRECOMPILED_KERNEL(KVPACK_EXTERN_AVX512)
KVPACK_FOR_EACH_PRECOMPILED_KERNEL(KVPACK_EXTERN_AVX2)
KVPACK_FOR_EACH_PRECOMPILED_KERNEL(KVPACK_EXTERN_SSE2)
#undef KVPACK_EXTERN_AVX512
#undef KVPACK_EXTERN_AVX2
#undef KVPACK_EXTERN_SSE2
}  // namespace kvpack::inline v0::kernels::cpu
#endif

namespace kvpack::inline v0::dispatch {

/// A kernel bound to one instruction set.
template <class Kernel>
using CpuFunction = void (*)(const typename Kernel::args_type&) noexcept;

/// The kernel compiled for `Arch`. Only call it when kernels::cpu::cpu_supports<Arch>().
template <class Kernel, class Arch>
[[nodiscard]] CpuFunction<Kernel> cpu_kernel_for() noexcept {
  return [](const typename Kernel::args_type& args) noexcept { Kernel{}(Arch{}, args); };
}

/// Calls `visit(isa_name, function)` for every instruction set this build has the kernel for
/// and this CPU can run, best first (tests use it to check each one against the reference).
template <class Kernel, class Visitor>
void for_each_runnable_isa(Visitor&& visit) {
#if KVPACK_HAS_CPU_DISPATCH
  if constexpr (kernels::cpu::is_precompiled<Kernel>::value) {
    kernels::cpu::cpu_archs::for_each([&](auto arch) {
      using Arch = decltype(arch);
      if (kernels::cpu::cpu_supports<Arch>()) {
        visit(kernels::cpu::isa_name<Arch>(), cpu_kernel_for<Kernel, Arch>());
      }
    });
    return;
  }
#endif
  using Arch = kernels::cpu::default_arch;
  visit(kernels::cpu::isa_name<Arch>(), cpu_kernel_for<Kernel, Arch>());
}

/// The kernel attention runs: chosen once per kernel (KVPACK_ISA or the CPU's best).
template <class Kernel>
[[nodiscard]] CpuFunction<Kernel> cpu_kernel() {
#if KVPACK_HAS_CPU_DISPATCH
  if constexpr (kernels::cpu::is_precompiled<Kernel>::value) {
    static const CpuFunction<Kernel> chosen = [] {
      const std::string_view wanted = kernels::cpu::selected_isa();
      CpuFunction<Kernel> found = nullptr;
      for_each_runnable_isa<Kernel>([&](std::string_view name, CpuFunction<Kernel> function) {
        if (found == nullptr && name == wanted) found = function;
      });
      return found;
    }();
    return chosen;
  }
#endif
  return cpu_kernel_for<Kernel, kernels::cpu::default_arch>();
}

/// The instruction set cpu_kernel() runs for shipped kernels.
[[nodiscard]] inline std::string_view active_cpu_isa() {
#if KVPACK_HAS_CPU_DISPATCH
  return kernels::cpu::selected_isa();
#else
  return kernels::cpu::isa_name<kernels::cpu::default_arch>();
#endif
}

}  // namespace kvpack::inline v0::dispatch
