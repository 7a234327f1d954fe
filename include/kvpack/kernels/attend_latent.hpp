#pragma once
/// \file attend_latent.hpp
/// \brief Absorbed MLA decode attention over one latent stream (layout::MLA): every query head
///        scores [latent ; RoPE key] and sums the latents, reading the stream once.
///
/// With 128 query heads on one stream, each token costs 128·(latent + rope + latent) FMAs for
/// its latent + rope bytes: on a CPU this is arithmetic-bound, not bandwidth-bound, at every
/// format. So the key side decodes one page at a time (cpu/channel_major.hpp: vector converts
/// for element formats, the codec's own decoder otherwise) into a channel-major fp32 tile
/// [latent + rope][page_size] in L1/L2 and scores it with the fp32 channel-major kernel, whose
/// register blocks reuse each loaded key vector across heads. The values are the same latent, summed straight from the
/// page bytes by the value codec's accumulate kernel.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <span>
#include <vector>

#include "kvpack/dispatch.hpp"
#include "kvpack/kernels/attend_stream.hpp"
#include "kvpack/kernels/kernel_args.hpp"
#include "kvpack/quant/float.hpp"
#include "kvpack/quant/quant_concepts.hpp"

namespace kvpack::inline v0::kernels {

/// The kernels latent attention calls, bound to one instruction set.
template <quant::Codec KeyCodec, quant::Codec ValueCodec>
struct LatentKernelSet {
  using TileScores = cpu::ScoreKeys<quant::FloatCodec<float, Plane::kKey>>;
  using RowValues = cpu::AccumulateValues<quant::FloatCodec<float, Plane::kValue>>;
  dispatch::CpuFunction<cpu::DecodeChannelMajor<ValueCodec>> decode_latent;
  dispatch::CpuFunction<cpu::DecodeChannelMajor<KeyCodec>> decode_rope;
  dispatch::CpuFunction<TileScores> score_tile;
  dispatch::CpuFunction<cpu::AccumulateValues<ValueCodec>> accumulate;
  dispatch::CpuFunction<cpu::SoftmaxUpdate> softmax;
  dispatch::CpuFunction<cpu::ScoreRows> score_rows;
  dispatch::CpuFunction<RowValues> accumulate_rows;

  /// The kernels dispatch selects for this CPU (or KVPACK_ISA).
  static LatentKernelSet selected() {
    return {dispatch::cpu_kernel<cpu::DecodeChannelMajor<ValueCodec>>(),
            dispatch::cpu_kernel<cpu::DecodeChannelMajor<KeyCodec>>(),
            dispatch::cpu_kernel<TileScores>(),
            dispatch::cpu_kernel<cpu::AccumulateValues<ValueCodec>>(),
            dispatch::cpu_kernel<cpu::SoftmaxUpdate>(),
            dispatch::cpu_kernel<cpu::ScoreRows>(),
            dispatch::cpu_kernel<RowValues>()};
  }
  /// The kernels compiled for `Arch` (see dispatch::cpu_kernel_for).
  template <class Arch>
  static LatentKernelSet for_arch() noexcept {
    return {dispatch::cpu_kernel_for<cpu::DecodeChannelMajor<ValueCodec>, Arch>(),
            dispatch::cpu_kernel_for<cpu::DecodeChannelMajor<KeyCodec>, Arch>(),
            dispatch::cpu_kernel_for<TileScores, Arch>(),
            dispatch::cpu_kernel_for<cpu::AccumulateValues<ValueCodec>, Arch>(),
            dispatch::cpu_kernel_for<cpu::SoftmaxUpdate, Arch>(),
            dispatch::cpu_kernel_for<cpu::ScoreRows, Arch>(),
            dispatch::cpu_kernel_for<RowValues, Arch>()};
  }
};

/// The codecs of one latent stream and their parameters: the key plane holds the RoPE keys
/// (rope_dim), the value plane the latents (latent_dim).
template <quant::Codec KeyCodec, quant::Codec ValueCodec>
struct LatentCodecs {
  const KeyCodec* rope = nullptr;
  typename KeyCodec::params_type rope_params{};
  const ValueCodec* latent = nullptr;
  typename ValueCodec::params_type latent_params{};
};

/// Floats of `tile` latent attention needs besides the Workspace: one page decoded, token-major
/// and channel-major, and the tail's rows joined.
[[nodiscard]] constexpr std::size_t latent_tile_floats(index_t page_size, index_t latent_dim, index_t rope_dim,
                                                       index_t tail_tokens) noexcept {
  const std::size_t width = static_cast<std::size_t>(latent_dim) + rope_dim;
  const std::size_t rows = std::max<std::size_t>(page_size, tail_tokens);
  return 2 * rows * width;
}

/// Folds every live slot of `pages` and every row of `tail` into the workspace's online-softmax
/// state (running maximum, sum and unnormalised [group][latent_dim] accumulator), starting from
/// an empty state, for `group` query heads of width latent_dim + rope_dim (softmax scale
/// applied). `pages.head_dim` is latent_dim and `pages.value_offset` points at the latent plane;
/// `tail.keys` are [count][rope_dim] and `tail.values` [count][latent_dim]. The workspace must
/// have been prepared for (group, latent_dim + rope_dim, page_size, tail.count) and `tile` must
/// hold latent_tile_floats(...) floats.
template <quant::Codec KeyCodec, quant::Codec ValueCodec>
void latent_pass(const PageRun& pages, index_t rope_dim, const LatentCodecs<KeyCodec, ValueCodec>& codecs,
                 const TailView& tail, const float* queries, index_t group, const Workspace& ws, float* tile,
                 const LatentKernelSet<KeyCodec, ValueCodec>& kernels) noexcept {
  const index_t latent_dim = pages.head_dim;
  const index_t width = latent_dim + rope_dim;
  const index_t page_size = pages.page_size;
  std::fill_n(ws.running_max(), group, -std::numeric_limits<float>::infinity());
  std::fill_n(ws.running_sum(), group, 0.0f);
  std::fill_n(ws.acc(), static_cast<std::size_t>(group) * latent_dim, 0.0f);
  const SoftmaxArgs softmax_base{ws.scores(), 0, ws.score_stride(), group, ws.running_max(),
                                 ws.running_sum(), ws.acc(), latent_dim};
  float* rows = tile + static_cast<std::size_t>(page_size) * width;  // token-major staging

  const index_t chunk_pages = std::max<index_t>(1, Workspace::kChunkTokens / page_size);
  for (index_t first = 0; first < pages.count; first += chunk_pages) {
    const index_t count = std::min(chunk_pages, pages.count - first);
    for (index_t i = 0; i < count; ++i) {
      const std::byte* payload = pages.pages[first + i];
      // Channel-major, as the fp32 key plane stores it: latent channels, then the RoPE key's.
      kernels.decode_latent({codecs.latent, codecs.latent_params, payload + pages.value_offset, page_size, latent_dim,
                             tile, rows});
      kernels.decode_rope({codecs.rope, codecs.rope_params, payload, page_size, rope_dim,
                           tile + static_cast<std::size_t>(latent_dim) * page_size, rows});
      const std::byte* tile_bytes = reinterpret_cast<const std::byte*>(tile);
      const std::uint64_t* const* live = pages.live != nullptr ? pages.live + first + i : nullptr;
      const PageRun one{&tile_bytes, live, 1, 0, page_size, width, 0, 0};
      kernels.score_tile({one, quant::NoParams{}, queries, group, ws.scores() + i * page_size, ws.score_stride(),
                          ws.scratch()});
    }
    SoftmaxArgs step = softmax_base;
    step.count = count * page_size;
    kernels.softmax(step);
    PageRun run = pages;
    run.pages = pages.pages + first;
    run.live = pages.live != nullptr ? pages.live + first : nullptr;
    run.count = count;
    run.prefetch = pages.count - first - count;
    kernels.accumulate({run, codecs.latent_params, ws.scores(), ws.score_stride(), group, ws.acc(), ws.scratch()});
  }

  if (tail.count > 0) {
    // Tail rows joined as [latent ; rope] so one dot product per head scores each.
    for (index_t r = 0; r < tail.count; ++r) {
      std::copy_n(tail.values + static_cast<std::size_t>(r) * latent_dim, latent_dim, tile + r * width);
      std::copy_n(tail.keys + static_cast<std::size_t>(r) * rope_dim, rope_dim, tile + r * width + latent_dim);
    }
    kernels.score_rows({tile, tail.count, width, width, queries, group, ws.scores(), ws.score_stride()});
    mask_dead_rows(tail, group, ws);
    SoftmaxArgs step = softmax_base;
    step.count = tail.count;
    kernels.softmax(step);
    const std::byte* values = reinterpret_cast<const std::byte*>(tail.values);
    const PageRun run{&values, nullptr, 1, 0, tail.count, latent_dim, 0, 0};
    kernels.accumulate_rows({run, quant::NoParams{}, ws.scores(), ws.score_stride(), group, ws.acc(), ws.scratch()});
  }
}

/// One pass's online-softmax state, copied out of its workspace so passes over different pages
/// can run on different threads and be merged (flash-decoding's split-K).
struct LatentPartial {
  std::vector<float> max, sum, acc;  ///< [group], [group], [group][latent_dim]

  void take(const Workspace& ws, index_t group, index_t latent_dim) {
    max.assign(ws.running_max(), ws.running_max() + group);
    sum.assign(ws.running_sum(), ws.running_sum() + group);
    acc.assign(ws.acc(), ws.acc() + static_cast<std::size_t>(group) * latent_dim);
  }
};

/// out[h] = Σ_i e^{m_i − M} acc_i[h] / Σ_i e^{m_i − M} sum_i[h], M = max_i m_i: the softmax over
/// all passes' tokens. A head no pass saw a live token for comes out 0, as from one pass; a head
/// whose scores were all NaN in some pass (its maximum stays −inf, its sum turns NaN) comes out
/// NaN, as from one pass.
inline void merge_latent_partials(std::span<const LatentPartial> parts, index_t group, index_t latent_dim,
                                  float* out) noexcept {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (index_t h = 0; h < group; ++h) {
    float top = kNegInf;
    bool nan_scores = false;
    for (const LatentPartial& part : parts) {
      top = std::max(top, part.max[h]);
      nan_scores = nan_scores || (part.max[h] == kNegInf && part.sum[h] != 0.0f);
    }
    float* o = out + static_cast<std::size_t>(h) * latent_dim;
    std::fill_n(o, latent_dim, nan_scores ? std::numeric_limits<float>::quiet_NaN() : 0.0f);
    if (nan_scores || top == kNegInf) continue;
    float sum = 0.0f;
    for (const LatentPartial& part : parts) {
      if (part.max[h] == kNegInf) continue;
      const float weight = std::exp(part.max[h] - top);
      sum += weight * part.sum[h];
      const float* acc = part.acc.data() + static_cast<std::size_t>(h) * latent_dim;
      for (index_t c = 0; c < latent_dim; ++c) o[c] += weight * acc[c];
    }
    const float inverse = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (index_t c = 0; c < latent_dim; ++c) o[c] *= inverse;
  }
}

/// out[h] = softmax(q[h] · [c ; k^R]) · c over every live slot of `pages` and every row of
/// `tail` in one pass (see latent_pass); `out` is [group][latent_dim].
template <quant::Codec KeyCodec, quant::Codec ValueCodec>
void attend_latent_stream(const PageRun& pages, index_t rope_dim, const LatentCodecs<KeyCodec, ValueCodec>& codecs,
                          const TailView& tail, const float* queries, index_t group, float* out,
                          const Workspace& ws, float* tile, const LatentKernelSet<KeyCodec, ValueCodec>& kernels) noexcept {
  latent_pass(pages, rope_dim, codecs, tail, queries, group, ws, tile, kernels);
  const index_t latent_dim = pages.head_dim;
  for (index_t h = 0; h < group; ++h) {
    const float sum = ws.running_sum()[h];
    const float inverse = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (index_t c = 0; c < latent_dim; ++c) out[h * latent_dim + c] = ws.acc()[h * latent_dim + c] * inverse;
  }
}

}  // namespace kvpack::inline v0::kernels
