#pragma once
/// \file config.hpp
/// \brief Portability macros shared by host, SIMD and CUDA code.

#include "kvpack/version.hpp"

#if defined(__CUDACC__)
#define KVPACK_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define KVPACK_HOST_DEVICE inline
#endif

#if defined(__clang__) || defined(__CUDACC__)
#define KVPACK_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define KVPACK_UNROLL _Pragma("GCC unroll 8")
#else
#define KVPACK_UNROLL
#endif

// Kernels are hot inner loops; inlining them into the page loop is what lets the compiler keep
// accumulators in registers across the per-channel and per-token loops.
#if defined(__GNUC__) || defined(__clang__)
#define KVPACK_ALWAYS_INLINE inline __attribute__((always_inline))
#define KVPACK_ALWAYS_INLINE_LAMBDA __attribute__((always_inline))
#else
#define KVPACK_ALWAYS_INLINE inline
#define KVPACK_ALWAYS_INLINE_LAMBDA
#endif
