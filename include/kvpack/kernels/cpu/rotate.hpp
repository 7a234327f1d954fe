#pragma once
/// \file rotate.hpp
/// \brief TurboQuant's rotations inside the kernels: quant::rotate and quant::unrotate, with the
///        randomized Hadamard transform on AVX-512 vectors of doubles.
///
/// The kernels rotate each head's query and running sum once per call (and back), and the
/// compiler leaves rotation.hpp's butterfly loops scalar: at head_dim 128 that took about half of
/// TurboQuant-4's time in cache once its products ran on integers (turboquant_vnni.hpp). The
/// vector transform does the same additions in the same order on the same doubles, so its results
/// are bit-identical to quant::rotate's: a butterfly inside a vector is a permute and one fused
/// multiply-add by ±1, which rounds as the addition or subtraction does.

#include <cmath>
#include <type_traits>

#include "kvpack/kernels/cpu/simd_compat.hpp"
#include "kvpack/quant/rotation.hpp"

namespace kvpack::inline v0::kernels::cpu::turbo {

#if XSIMD_WITH_AVX512F
/// In-place unnormalised Walsh–Hadamard transform of `count` vectors of 8 doubles (n = 8·count,
/// a power of two): butterflies inside each vector (distances 1, 2, 4), then across vectors.
KVPACK_ALWAYS_INLINE void fwht_vectors(__m512d* v, index_t count) noexcept {
  const __m512d first_half = _mm512_setr_pd(1, -1, 1, -1, 1, -1, 1, -1);  // distance 1
  const __m512d pairs = _mm512_setr_pd(1, 1, -1, -1, 1, 1, -1, -1);       // distance 2
  const __m512d quads = _mm512_setr_pd(1, 1, 1, 1, -1, -1, -1, -1);       // distance 4
  for (index_t i = 0; i < count; ++i) {
    // Lane j of the permuted vector holds the partner x[j ^ distance]: below the partner x + p,
    // above it p − x.
    __m512d x = v[i];
    x = _mm512_fmadd_pd(x, first_half, _mm512_permute_pd(x, 0x55));
    x = _mm512_fmadd_pd(x, pairs, _mm512_permutex_pd(x, 0x4E));
    x = _mm512_fmadd_pd(x, quads, _mm512_shuffle_f64x2(x, x, 0x4E));
    v[i] = x;
  }
  for (index_t h = 1; h < count; h *= 2) {
    for (index_t i = 0; i < count; i += 2 * h) {
      for (index_t j = i; j < i + h; ++j) {
        const __m512d a = v[j], b = v[j + h];
        v[j] = _mm512_add_pd(a, b);
        v[j + h] = _mm512_sub_pd(a, b);
      }
    }
  }
}
#endif

/// out = R·in (`transpose` false) or Rᵀ·in for a Hadamard rotation of A's vectors, with the
/// signs applied before the transform or after it as quant::rotate and quant::unrotate do. False,
/// with nothing written, where A has no AVX-512 or the rotation is dense.
template <class A>
KVPACK_ALWAYS_INLINE bool hadamard_on_vectors(const quant::RotationView& r, const float* in, bool transpose,
                                              float* out) noexcept {
#if XSIMD_WITH_AVX512F
  if constexpr (std::is_base_of_v<xsimd::avx512f, A>) {
    if (r.kind != quant::RotationKind::kHadamard || r.dim % 8 != 0) return false;
    __m512d v[quant::kMaxRotationDim / 8];
    const index_t count = r.dim / 8;
    for (index_t i = 0; i < count; ++i) {
      const __m512d x = _mm512_cvtps_pd(_mm256_loadu_ps(in + 8 * i));
      v[i] = transpose ? x : _mm512_mul_pd(x, _mm512_cvtps_pd(_mm256_loadu_ps(r.signs + 8 * i)));
    }
    fwht_vectors(v, count);
    const __m512d norm = _mm512_set1_pd(1.0 / std::sqrt(static_cast<double>(r.dim)));
    for (index_t i = 0; i < count; ++i) {
      __m512d y = _mm512_mul_pd(v[i], norm);
      if (transpose) y = _mm512_mul_pd(y, _mm512_cvtps_pd(_mm256_loadu_ps(r.signs + 8 * i)));
      _mm256_storeu_ps(out + 8 * i, _mm512_cvtpd_ps(y));
    }
    return true;
  }
#endif
  return false;
}

/// y = R x, as quant::rotate. `x` and `y` may alias.
template <class A>
KVPACK_ALWAYS_INLINE void rotate(A, const quant::RotationView& r, const float* x, float* y) noexcept {
  if (!hadamard_on_vectors<A>(r, x, false, y)) quant::rotate(r, x, y);
}

/// x = Rᵀ y, as quant::unrotate. `y` and `x` may alias.
template <class A>
KVPACK_ALWAYS_INLINE void unrotate(A, const quant::RotationView& r, const float* y, float* x) noexcept {
  if (!hadamard_on_vectors<A>(r, y, true, x)) quant::unrotate(r, y, x);
}

}  // namespace kvpack::inline v0::kernels::cpu::turbo
