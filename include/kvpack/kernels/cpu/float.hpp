#pragma once
/// \file float.hpp
/// \brief SIMD decode-attention kernels for element-wise formats: quant::Float<float|half|bf16>
///        and quant::FP8<E4M3FN|E5M2>.
///
/// Keys are channel-major in the page, so for a tile of W tokens (W = vector width) the score of
/// every query head is W-wide FMAs with the query element broadcast: no horizontal sums. One key
/// vector is converted once and reused by all heads of the GQA group. Values are token-major:
/// acc[h][c0:c0+W] += w[h][t] · v[t][c0:c0+W]. The FP8 scale multiplies the finished sums, so
/// the inner loops see only the codes.

#include <cstddef>
#include <cstdint>
#include <limits>

#include "kvpack/kernels/cpu/group_blocks.hpp"
#include "kvpack/kernels/cpu/simd_compat.hpp"
#include "kvpack/kernels/kernel_args.hpp"
#include "kvpack/quant/float.hpp"
#include "kvpack/quant/fp8.hpp"

namespace kvpack::inline v0::kernels::cpu {

/// W elements of a plane, starting at element `index`, as fp32 lanes.
template <class Storage, class A>
KVPACK_ALWAYS_INLINE simd::f32<A> load_elements(const std::byte* plane, std::size_t index) noexcept {
  if constexpr (std::is_same_v<Storage, float>) {
    return simd::f32<A>::load_unaligned(reinterpret_cast<const float*>(plane) + index);
  } else if constexpr (std::is_same_v<Storage, half>) {
    return simd::load_f16<A>(reinterpret_cast<const std::uint16_t*>(plane) + index);
  } else if constexpr (std::is_same_v<Storage, bfloat16>) {
    return simd::load_bf16<A>(reinterpret_cast<const std::uint16_t*>(plane) + index);
  } else if constexpr (std::is_same_v<Storage, quant::E4M3FN>) {
    return simd::load_e4m3fn<A>(reinterpret_cast<const std::uint8_t*>(plane) + index);
  } else {
    static_assert(std::is_same_v<Storage, quant::E5M2>, "no SIMD load for this storage type");
    return simd::load_e5m2<A>(reinterpret_cast<const std::uint8_t*>(plane) + index);
  }
}

/// One element, for the channels left over when head_dim is not a multiple of the vector width.
template <class Storage>
KVPACK_ALWAYS_INLINE float load_element(const std::byte* plane, std::size_t index) noexcept {
  Storage value;
  std::memcpy(&value, plane + index * sizeof(Storage), sizeof(Storage));
  return static_cast<float>(value);
}

/// The multiplier a plane's decoded sums need: the FP8 scale, or 1.
template <class Params>
KVPACK_ALWAYS_INLINE float plane_scale(const Params& params) noexcept {
  if constexpr (std::is_same_v<Params, quant::FP8Params>) {
    return params.scale;
  } else {
    return 1.0f;
  }
}

/// Sets the scores of dead slots to -inf so the softmax gives them weight 0.
KVPACK_ALWAYS_INLINE void mask_dead_slots(const std::uint64_t* live, index_t page_size, index_t group,
                                          float* scores, index_t stride) noexcept {
  if (live == nullptr) return;
  for (index_t t = 0; t < page_size; ++t) {
    if ((live[t / 64] >> (t % 64)) & 1u) continue;
    for (index_t h = 0; h < group; ++h) scores[h * stride + t] = -std::numeric_limits<float>::infinity();
  }
}

/// Issues prefetches for a whole payload (both planes), one per cache line.
KVPACK_ALWAYS_INLINE void prefetch_payload(const std::byte* payload, std::size_t bytes) noexcept {
  for (std::size_t offset = 0; offset < bytes; offset += 64) {
    __builtin_prefetch(payload + offset, 0, 3);
  }
}

/// Pages ahead of the one being scored whose bytes are requested early; ~32 KiB in flight keeps
/// the memory system busy while a compute-heavy page loop runs (see DESIGN.md §4).
KVPACK_ALWAYS_INLINE index_t prefetch_distance(std::size_t payload_bytes) noexcept {
  const std::size_t pages = (std::size_t{32} << 10) / (payload_bytes == 0 ? 1 : payload_bytes);
  return static_cast<index_t>(pages < 1 ? 1 : (pages > 16 ? 16 : pages));
}

/// Scores of kG heads for W tokens starting at t0 of a channel-major key plane.
template <class Storage, int kG, class A>
KVPACK_ALWAYS_INLINE void score_channel_major_tile(const std::byte* plane, index_t page_size,
                                                   index_t head_dim, index_t t0, const float* q,
                                                   float scale, float* scores, index_t stride) noexcept {
  using batch = simd::f32<A>;
  batch acc[kG];
  for (int h = 0; h < kG; ++h) acc[h] = batch(0.0f);
  for (index_t c = 0; c < head_dim; ++c) {
    const batch k = load_elements<Storage, A>(plane, static_cast<std::size_t>(c) * page_size + t0);
    KVPACK_UNROLL
    for (int h = 0; h < kG; ++h) acc[h] = xsimd::fma(batch(q[h * head_dim + c]), k, acc[h]);
  }
  for (int h = 0; h < kG; ++h) (acc[h] * batch(scale)).store_unaligned(scores + h * stride + t0);
}

/// Key kernel for element-wise formats (page_size must be a multiple of the vector width).
template <class Storage, class Params, class A>
void score_element_keys(A, const ScoreArgs<Params>& args) noexcept {
  constexpr index_t kWidth = static_cast<index_t>(simd::f32<A>::size);
  const PageRun& run = args.run;
  const index_t distance = prefetch_distance(run.payload_bytes);
  const float scale = plane_scale(args.params);
  for (index_t i = 0; i < run.count; ++i) {
    if (i + distance < run.count + run.prefetch) {
      prefetch_payload(run.pages[i + distance], run.payload_bytes);
    }
    const std::byte* plane = run.pages[i];
    float* scores = args.scores + i * run.page_size;
    for (index_t t0 = 0; t0 < run.page_size; t0 += kWidth) {
      for_each_head_block(args.group, [&](auto block, index_t h0) {
        score_channel_major_tile<Storage, decltype(block)::value, A>(
            plane, run.page_size, run.head_dim, t0, args.queries + h0 * run.head_dim, scale,
            scores + h0 * args.score_stride, args.score_stride);
      });
    }
    if (run.live != nullptr) {
      mask_dead_slots(run.live[i], run.page_size, args.group, scores, args.score_stride);
    }
  }
}

/// acc[h][c0:c0+W] += scale · Σ_t w[h][t] · v[t][c0:c0+W] for kG heads of a token-major plane.
template <class Storage, int kG, class A>
KVPACK_ALWAYS_INLINE void accumulate_token_major_tile(const std::byte* plane, index_t rows,
                                                      index_t head_dim, index_t c0, const float* w,
                                                      index_t w_stride, float scale, float* acc) noexcept {
  using batch = simd::f32<A>;
  batch sum[kG];
  for (int h = 0; h < kG; ++h) sum[h] = batch(0.0f);
  for (index_t t = 0; t < rows; ++t) {
    const batch v = load_elements<Storage, A>(plane, static_cast<std::size_t>(t) * head_dim + c0);
    KVPACK_UNROLL
    for (int h = 0; h < kG; ++h) sum[h] = xsimd::fma(batch(w[h * w_stride + t]), v, sum[h]);
  }
  for (int h = 0; h < kG; ++h) {
    float* out = acc + h * head_dim + c0;
    xsimd::fma(sum[h], batch(scale), batch::load_unaligned(out)).store_unaligned(out);
  }
}

/// Value kernel for element-wise formats; any page_size, any head_dim.
template <class Storage, class Params, class A>
void accumulate_element_values(A, const AccumulateArgs<Params>& args) noexcept {
  constexpr index_t kWidth = static_cast<index_t>(simd::f32<A>::size);
  const PageRun& run = args.run;
  const float scale = plane_scale(args.params);
  const index_t vector_end = run.head_dim - run.head_dim % kWidth;
  for (index_t i = 0; i < run.count; ++i) {
    const std::byte* plane = run.pages[i] + run.value_offset;
    const float* w = args.weights + i * run.page_size;
    for (index_t c0 = 0; c0 < vector_end; c0 += kWidth) {
      for_each_head_block(args.group, [&](auto block, index_t h0) {
        accumulate_token_major_tile<Storage, decltype(block)::value, A>(
            plane, run.page_size, run.head_dim, c0, w + h0 * args.weight_stride, args.weight_stride,
            scale, args.acc + h0 * run.head_dim);
      });
    }
    for (index_t c = vector_end; c < run.head_dim; ++c) {
      for (index_t h = 0; h < args.group; ++h) {
        float sum = 0.0f;
        for (index_t t = 0; t < run.page_size; ++t) {
          sum += w[h * args.weight_stride + t] *
                 load_element<Storage>(plane, static_cast<std::size_t>(t) * run.head_dim + c);
        }
        args.acc[h * run.head_dim + c] += scale * sum;
      }
    }
  }
}

template <class T, class A>
void score_keys(A arch, std::type_identity<quant::FloatCodec<T, Plane::kKey>>,
                const ScoreArgs<quant::NoParams>& args) noexcept {
  score_element_keys<T>(arch, args);
}
template <class T, class A>
void accumulate_values(A arch, std::type_identity<quant::FloatCodec<T, Plane::kValue>>,
                       const AccumulateArgs<quant::NoParams>& args) noexcept {
  accumulate_element_values<T>(arch, args);
}
template <class Format, class A>
void score_keys(A arch, std::type_identity<quant::FP8Codec<Format, Plane::kKey>>,
                const ScoreArgs<quant::FP8Params>& args) noexcept {
  score_element_keys<Format>(arch, args);
}
template <class Format, class A>
void accumulate_values(A arch, std::type_identity<quant::FP8Codec<Format, Plane::kValue>>,
                       const AccumulateArgs<quant::FP8Params>& args) noexcept {
  accumulate_element_values<Format>(arch, args);
}

}  // namespace kvpack::inline v0::kernels::cpu
