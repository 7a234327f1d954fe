#pragma once
/// \file convert.hpp
/// \brief The cache's write path in SIMD: fp16/bf16 inputs widened to fp32, and fp32 rows
///        narrowed into quant::Float<T> page planes.
///
/// Both used to run element by element through half.hpp's portable conversions, which were most
/// of an fp16 append. The results are bit-identical to those conversions on every target, ±Inf
/// and NaN included, with one exception: F16C's widening sets a signaling NaN's quiet bit.
/// F16C's vcvtps2ph rounds to nearest even and, for NaN, sets the quiet bit and keeps the top
/// payload bits, exactly as float_to_half_bits does; bfloat16 rounding is the same integer formula
/// in vector lanes. SSE2 has no fp16 conversion and narrows lane by lane.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvpack/kernels/cpu/simd_compat.hpp"
#include "kvpack/kernels/kernel_args.hpp"
#include "kvpack/quant/float.hpp"

namespace kvpack::inline v0::kernels::cpu {

namespace narrow {

#if XSIMD_WITH_AVX512BW
/// 16 floats -> bfloat16 bits in 32-bit lanes: round to nearest even, NaN kept quiet (half.hpp's
/// rule). Templated on the arch like everything a per-ISA object compiles (STYLE.md §5.2).
template <class A>
KVPACK_ALWAYS_INLINE __m512i bfloat16_lanes(__m512 x) noexcept {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x0040));
  return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), quiet);
}
#endif

/// W = batch::size floats from `src` stored as T's bits at `dst`.
template <class T, class A>
KVPACK_ALWAYS_INLINE void store_batch(const float* src, std::uint16_t* dst) noexcept {
#if XSIMD_WITH_AVX512BW
  if constexpr (std::is_base_of_v<xsimd::avx512bw, A>) {
    const __m512 x = _mm512_loadu_ps(src);
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    if constexpr (std::is_same_v<T, half>) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtps_ph(x, kRound));
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(bfloat16_lanes<A>(x)));
    }
    return;
  }
#endif
#if XSIMD_WITH_AVX2 && defined(__F16C__)
  if constexpr (std::is_base_of_v<xsimd::avx2, A> && std::is_same_v<T, half>) {
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_cvtps_ph(_mm256_loadu_ps(src), kRound));
    return;
  }
#endif
  // SSE2 (and bfloat16 on AVX2): lane by lane.
  for (std::size_t i = 0; i < simd::f32<A>::size; ++i) dst[i] = T(src[i]).bits;
}

}  // namespace narrow

/// `count` floats from `src` as T at `dst` (T = float copies).
template <class T, class A>
KVPACK_ALWAYS_INLINE void narrow_floats(const float* src, T* dst, std::size_t count) noexcept {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, count * sizeof(float));
  } else {
    constexpr std::size_t kW = simd::f32<A>::size;
    // T is a standard-layout struct whose first member is its std::uint16_t bits.
    std::uint16_t* bits = reinterpret_cast<std::uint16_t*>(dst);
    std::size_t i = 0;
    for (; i + kW <= count; i += kW) narrow::store_batch<T, A>(src + i, bits + i);
    for (; i < count; ++i) dst[i] = T(src[i]);
  }
}

/// fp16 or bfloat16 input widened to fp32: exact, but that F16C sets a signaling NaN's quiet bit
/// (the page encoders set it anyway, so stored fp16 and bf16 bytes do not change).
template <class A, class T>
void widen_to_float(A, const WidenArgs<T>& args) noexcept {
  static_assert(std::is_same_v<T, half> || std::is_same_v<T, bfloat16>, "fp16 or bfloat16 input only");
  constexpr std::size_t kW = simd::f32<A>::size;
  const std::uint16_t* in = reinterpret_cast<const std::uint16_t*>(args.in);
  std::size_t i = 0;
  for (; i + kW <= args.count; i += kW) {
    const simd::f32<A> x = std::is_same_v<T, half> ? simd::load_f16<A>(in + i) : simd::load_bf16<A>(in + i);
    x.store_unaligned(args.out + i);
  }
  for (; i < args.count; ++i) args.out[i] = static_cast<float>(args.in[i]);
}

/// One quant::Float<T> plane from fp32 rows: the bytes FloatCodec::encode writes. Values are
/// token-major, so each row narrows in place; keys are channel-major, so each row narrows a
/// vector of channels at a time and the elements go down their columns (the page's 8 KB of
/// fp16 columns stay in L1 while a page is written).
template <class A, class T, Plane kPlane>
void encode_plane(A, std::type_identity<quant::FloatCodec<T, kPlane>>, const EncodeRowsArgs& args) noexcept {
  constexpr index_t kW = static_cast<index_t>(simd::f32<A>::size);
  T* out = reinterpret_cast<T*>(args.plane);
  const index_t page = args.page_size, dim = args.head_dim;
  for (index_t t = 0; t < page; ++t) {
    const float* row = args.rows + static_cast<std::ptrdiff_t>(t) * args.row_stride;
    if constexpr (kPlane == Plane::kValue) {
      narrow_floats<T, A>(row, out + static_cast<std::size_t>(t) * dim, static_cast<std::size_t>(dim));
    } else {
      for (index_t c0 = 0; c0 < dim; c0 += kW) {
        const index_t n = dim - c0 < kW ? dim - c0 : kW;
        T narrowed[kW];
        narrow_floats<T, A>(row + c0, narrowed, static_cast<std::size_t>(n));
        for (index_t k = 0; k < n; ++k) out[static_cast<std::size_t>(c0 + k) * page + t] = narrowed[k];
      }
    }
  }
}

}  // namespace kvpack::inline v0::kernels::cpu
