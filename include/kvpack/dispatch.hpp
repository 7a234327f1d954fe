#pragma once
/// \file dispatch.hpp
/// \brief The one place that decides which compiled kernel runs.
///
/// Header-only (the default), every kernel is compiled inline for the including file's target
/// (`kernels::cpu::default_arch`, i.e. whatever -m flags it was built with). Linked with
/// kvpack::cpu_dispatch (which defines KVPACK_HAS_CPU_DISPATCH=1), the shipped kernels come
/// precompiled for AVX-512, AVX2 and SSE2, and the best one this CPU runs is chosen once per
/// kernel at first use (KVPACK_ISA overrides it).
///
/// Between backends: a launch runs where its buffers live (backend_of). Linked with kvpack::cuda
/// (which defines KVPACK_HAS_CUDA=1), launches over device memory go to the CUDA backend's
/// precompiled entry points (kvpack/backend/cuda_api.hpp); without it every address is host
/// memory to kvpack. This header is the only place that tests KVPACK_HAS_CUDA.

#include <string_view>

#include "kvpack/kernels/cpu/isa.hpp"
#include "kvpack/kernels/cpu/kernels_impl.hpp"
#include "kvpack/kernels/cpu/precompiled.hpp"

#ifndef KVPACK_HAS_CPU_DISPATCH
#define KVPACK_HAS_CPU_DISPATCH 0
#endif
#ifndef KVPACK_HAS_CUDA
#define KVPACK_HAS_CUDA 0
#endif
#if KVPACK_HAS_CUDA
#include "kvpack/backend/cuda_api.hpp"
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

/// Where a launch runs: the CPU kernels read host memory, the CUDA backend device memory.
enum class Backend { kCpu, kCuda };

/// Whether this program can run launches on the CUDA backend (it links kvpack::cuda).
inline constexpr bool kHasCudaBackend = KVPACK_HAS_CUDA != 0;

/// The backend whose memory holds `address`: kCuda for device (or managed) memory when this
/// program links kvpack::cuda, kCpu for everything else.
[[nodiscard]] inline Backend backend_of([[maybe_unused]] const void* address) noexcept {
#if KVPACK_HAS_CUDA
  return cuda_api::is_device_pointer(address) ? Backend::kCuda : Backend::kCpu;
#else
  return Backend::kCpu;
#endif
}

/// Device scratch that CUDA launches reuse across calls (empty without kvpack::cuda).
struct DeviceScratch {
#if KVPACK_HAS_CUDA
  cuda_api::AttentionWorkspace attention;
#endif
};

/// A paged-attention launch (kernels/paged_attention_args.hpp) on the CUDA backend,
/// asynchronous on `stream`; kUnsupported when kvpack::cuda is not linked or does not
/// precompile this codec pair (code compiled by nvcc can call kernels::cuda::attend_paged for
/// any pair instead).
template <quant::Codec KeyCodec, quant::Codec ValueCodec, class Args>
void attend_paged_on_cuda([[maybe_unused]] const Args& args, [[maybe_unused]] index_t max_pages,
                          [[maybe_unused]] DeviceScratch& scratch, [[maybe_unused]] void* stream) {
#if KVPACK_HAS_CUDA
  if constexpr (cuda_api::CudaAttended<KeyCodec, ValueCodec>) {
    cuda_api::attend_paged<KeyCodec, ValueCodec>(args, max_pages, scratch.attention, stream);
  } else {
    throw Error(ErrorCode::kUnsupported,
                ::kvpack::detail::message("kvpack::cuda does not precompile attention over ", KeyCodec::kName, " / ",
                                          ValueCodec::kName, " pages (kvpack/backend/cuda_api.hpp lists the pairs)"));
  }
#else
  throw Error(ErrorCode::kUnsupported, "the buffers are in device memory, but this program does not link kvpack::cuda");
#endif
}

}  // namespace kvpack::inline v0::dispatch
