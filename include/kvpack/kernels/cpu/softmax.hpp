#pragma once
/// \file softmax.hpp
/// \brief The online-softmax step and the full-precision row scorer shared by every codec.

#include <algorithm>
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

/// Scores of full-precision token-major rows (the tail window, pre-RoPE keys after rotation): one
/// dot product per row and head, up to four heads at a time so their FMA chains overlap.
template <class A>
void score_rows(A, const RowScoreArgs& args) noexcept {
  using batch = simd::f32<A>;
  constexpr index_t kWidth = static_cast<index_t>(batch::size);
  const index_t vector_end = args.head_dim - args.head_dim % kWidth;
  for (index_t t = 0; t < args.count; ++t) {
    const float* k = args.rows + t * args.row_stride;
    for (index_t h0 = 0; h0 < args.group; h0 += 4) {
      const index_t heads = std::min<index_t>(4, args.group - h0);
      batch lanes[4] = {batch(0.0f), batch(0.0f), batch(0.0f), batch(0.0f)};
      for (index_t c = 0; c < vector_end; c += kWidth) {
        const batch key = batch::load_unaligned(k + c);
        KVPACK_UNROLL
        for (index_t i = 0; i < 4; ++i) {
          if (i < heads) lanes[i] = xsimd::fma(batch::load_unaligned(args.queries + (h0 + i) * args.head_dim + c), key, lanes[i]);
        }
      }
      for (index_t i = 0; i < heads; ++i) {
        const float* q = args.queries + (h0 + i) * args.head_dim;
        float sum = simd::reduce_sum<A>(lanes[i]);
        for (index_t c = vector_end; c < args.head_dim; ++c) sum += q[c] * k[c];
        args.scores[(h0 + i) * args.score_stride + t] = sum;
      }
    }
  }
}

}  // namespace kvpack::inline v0::kernels::cpu
