#pragma once
/// \file channel_major.hpp
/// \brief One page plane decoded to fp32 channel-major ([head_dim][page_size]), the layout the
///        fp32 key kernel scores: layout::MLA decodes its latent (a value plane) and RoPE key so.
///
/// Element formats (Float, FP8) are converted a vector at a time: a key plane is already
/// channel-major, a value plane (token-major) is converted to rows and transposed. Every other
/// codec runs its own decoder into rows, then the rows are transposed by 4 × 4 blocks.

#include <cstddef>
#include <type_traits>

#include "kvpack/kernels/cpu/float.hpp"
#include "kvpack/kernels/cpu/simd_compat.hpp"
#include "kvpack/kernels/kernel_args.hpp"
#include "kvpack/quant/float.hpp"
#include "kvpack/quant/fp8.hpp"

namespace kvpack::inline v0::kernels::cpu {

/// out[j·rows + i] = in[i·cols + j] for a rows × cols matrix (both multiples of 4), by 4 × 4
/// blocks in SSE registers.
inline void transpose_by_4x4(const float* in, index_t rows, index_t cols, float* out) noexcept {
  for (index_t i = 0; i < rows; i += 4) {
    for (index_t j = 0; j < cols; j += 4) {
      const float* block = in + static_cast<std::size_t>(i) * cols + j;
      __m128 r0 = _mm_loadu_ps(block), r1 = _mm_loadu_ps(block + cols), r2 = _mm_loadu_ps(block + 2 * cols),
             r3 = _mm_loadu_ps(block + 3 * cols);
      _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
      float* to = out + static_cast<std::size_t>(j) * rows + i;
      _mm_storeu_ps(to, r0);
      _mm_storeu_ps(to + rows, r1);
      _mm_storeu_ps(to + 2 * rows, r2);
      _mm_storeu_ps(to + 3 * rows, r3);
    }
  }
}

/// The same for any shape: 4 × 4 blocks where they fit, element by element otherwise.
inline void transpose_rows(const float* in, index_t rows, index_t cols, float* out) noexcept {
  if (rows % 4 == 0 && cols % 4 == 0) {
    transpose_by_4x4(in, rows, cols, out);
    return;
  }
  for (index_t i = 0; i < rows; ++i) {
    for (index_t j = 0; j < cols; ++j) out[static_cast<std::size_t>(j) * rows + i] = in[static_cast<std::size_t>(i) * cols + j];
  }
}

/// Element formats: vector loads through the kernels' own converters, times the FP8 scale.
template <class Storage, Plane P, class Codec, class A>
KVPACK_ALWAYS_INLINE void decode_elements_channel_major(const DecodePlaneArgs<Codec>& args) noexcept {
  constexpr index_t kWidth = static_cast<index_t>(simd::f32<A>::size);
  const float scale = plane_scale(args.params);
  const simd::f32<A> vector_scale(scale / kLoadFactor<Storage>);
  const index_t size = args.page_size;
  const index_t d = args.head_dim;
  if constexpr (P == Plane::kKey) {
    // Already [d][P], and P is a multiple of 16.
    for (std::size_t i = 0; i < static_cast<std::size_t>(d) * size; i += kWidth) {
      (load_elements<Storage, A>(args.plane, i) * vector_scale).store_unaligned(args.out + i);
    }
  } else {
    const index_t vector_end = d - d % kWidth;
    for (index_t t = 0; t < size; ++t) {
      const std::size_t row = static_cast<std::size_t>(t) * d;
      for (index_t c = 0; c < vector_end; c += kWidth) {
        (load_elements<Storage, A>(args.plane, row + c) * vector_scale).store_unaligned(args.rows + row + c);
      }
      for (index_t c = vector_end; c < d; ++c) args.rows[row + c] = load_element<Storage>(args.plane, row + c) * scale;
    }
    transpose_rows(args.rows, size, d, args.out);
  }
}

template <class T, Plane P, class A>
void decode_channel_major(A, std::type_identity<quant::FloatCodec<T, P>>,
                          const DecodePlaneArgs<quant::FloatCodec<T, P>>& args) noexcept {
  decode_elements_channel_major<T, P, quant::FloatCodec<T, P>, A>(args);
}

template <class Format, Plane P, class A>
void decode_channel_major(A, std::type_identity<quant::FP8Codec<Format, P>>,
                          const DecodePlaneArgs<quant::FP8Codec<Format, P>>& args) noexcept {
  decode_elements_channel_major<Format, P, quant::FP8Codec<Format, P>, A>(args);
}

/// Any other codec: its own (reference) decoder, then the transpose.
template <class Codec, class A>
void decode_channel_major(A, std::type_identity<Codec>, const DecodePlaneArgs<Codec>& args) noexcept {
  args.codec->decode({args.page_size, args.head_dim}, args.plane, args.params, args.rows);
  transpose_rows(args.rows, args.page_size, args.head_dim, args.out);
}

}  // namespace kvpack::inline v0::kernels::cpu
