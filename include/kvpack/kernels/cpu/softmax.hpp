#pragma once
/// \file softmax.hpp
/// \brief The online-softmax step and the full-precision row scorer shared by every codec.

#include <cmath>
#include <limits>

#include "kvpack/kernels/cpu/simd_compat.hpp"
#include "kvpack/kernels/kernel_args.hpp"

namespace kvpack::inline v0::kernels::cpu {

/// See SoftmaxArgs. A chunk whose scores are all -inf (every slot dead) leaves the state as is.
template <class A>
void softmax_update(A, const SoftmaxArgs& args) noexcept {
  using batch = simd::f32<A>;
  constexpr index_t kWidth = static_cast<index_t>(batch::size);
  const index_t vector_end = args.count - args.count % kWidth;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (index_t h = 0; h < args.group; ++h) {
    float* row = args.scores + h * args.stride;
    batch lane_max(kNegInf);
    for (index_t t = 0; t < vector_end; t += kWidth) lane_max = xsimd::max(lane_max, batch::load_unaligned(row + t));
    float chunk_max = simd::reduce_max<A>(lane_max);
    for (index_t t = vector_end; t < args.count; ++t) chunk_max = std::max(chunk_max, row[t]);
    if (chunk_max == kNegInf) {
      for (index_t t = 0; t < args.count; ++t) row[t] = 0.0f;
      continue;
    }
    const float old_max = args.running_max[h];
    const float new_max = std::max(old_max, chunk_max);
    if (new_max > old_max) {
      // exp(-inf) = 0 wipes the empty state on the first chunk.
      const float correction = std::exp(old_max - new_max);
      args.running_sum[h] *= correction;
      float* acc = args.acc + h * args.head_dim;
      const index_t acc_end = args.head_dim - args.head_dim % kWidth;
      for (index_t c = 0; c < acc_end; c += kWidth) {
        (batch::load_unaligned(acc + c) * batch(correction)).store_unaligned(acc + c);
      }
      for (index_t c = acc_end; c < args.head_dim; ++c) acc[c] *= correction;
      args.running_max[h] = new_max;
    }
    batch lane_sum(0.0f);
    for (index_t t = 0; t < vector_end; t += kWidth) {
      const batch weight = xsimd::exp(batch::load_unaligned(row + t) - batch(new_max));
      weight.store_unaligned(row + t);
      lane_sum += weight;
    }
    float sum = simd::reduce_sum<A>(lane_sum);
    for (index_t t = vector_end; t < args.count; ++t) {
      row[t] = std::exp(row[t] - new_max);
      sum += row[t];
    }
    args.running_sum[h] += sum;
  }
}

/// Scores of full-precision token-major rows (the tail window): one dot product per row and head.
template <class A>
void score_rows(A, const RowScoreArgs& args) noexcept {
  using batch = simd::f32<A>;
  constexpr index_t kWidth = static_cast<index_t>(batch::size);
  const index_t vector_end = args.head_dim - args.head_dim % kWidth;
  for (index_t t = 0; t < args.count; ++t) {
    const float* k = args.rows + t * args.row_stride;
    for (index_t h = 0; h < args.group; ++h) {
      const float* q = args.queries + h * args.head_dim;
      batch lanes(0.0f);
      for (index_t c = 0; c < vector_end; c += kWidth) {
        lanes = xsimd::fma(batch::load_unaligned(q + c), batch::load_unaligned(k + c), lanes);
      }
      float sum = simd::reduce_sum<A>(lanes);
      for (index_t c = vector_end; c < args.head_dim; ++c) sum += q[c] * k[c];
      args.scores[h * args.score_stride + t] = sum;
    }
  }
}

}  // namespace kvpack::inline v0::kernels::cpu
