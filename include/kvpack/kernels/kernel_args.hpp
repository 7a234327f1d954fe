#pragma once
/// \file kernel_args.hpp
/// \brief The plain structs decode-attention kernels take: a run of pages and the buffers of one
///        step. Trivially copyable, owning nothing, shaped in comments (FlashInfer's paged_kv_t).

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kvpack/core/rope.hpp"
#include "kvpack/core/types.hpp"

namespace kvpack::inline v0::kernels {

/// Consecutive pages of one KV stream.
struct PageRun {
  const std::byte* const* pages = nullptr;  ///< [count + prefetch] payload pointers; K plane first
  const std::uint64_t* const* live = nullptr;  ///< [count] live-slot bitmasks, or nullptr when every
                                               ///< slot of every page is live; a nullptr entry
                                               ///< means that page is fully live
  index_t count = 0;           ///< pages to process
  index_t prefetch = 0;        ///< further entries of `pages` the kernel may prefetch
  index_t page_size = 0;       ///< token slots per page
  index_t head_dim = 0;        ///< channels per token
  std::size_t value_offset = 0;  ///< bytes from a payload's start to its V plane
  std::size_t payload_bytes = 0;  ///< bytes per payload (K and V planes), for prefetching
  /// Whether the value kernel requests the value planes ahead itself, so that the key kernel
  /// requests only the key planes (cpu::kValueKernelPrefetches); otherwise the key kernel
  /// requests whole payloads.
  bool planes_apart = false;
};

/// Arguments of a key kernel: scores for every slot of `run`.
template <class Params>
struct ScoreArgs {
  PageRun run;
  Params params;
  const float* queries = nullptr;  ///< [group][head_dim], softmax scale already applied
  index_t group = 0;               ///< query heads reading this stream
  float* scores = nullptr;         ///< [group][score_stride]; slot t of page i at i*page_size + t
  index_t score_stride = 0;
  float* scratch = nullptr;        ///< scratch_floats(group, page_size, head_dim) floats
};

/// Arguments of a value kernel: acc[h] += Σ_t weights[h][t] · v_t over every slot of `run`.
template <class Params>
struct AccumulateArgs {
  PageRun run;
  Params params;
  const float* weights = nullptr;  ///< [group][weight_stride]; 0 for dead slots
  index_t weight_stride = 0;
  index_t group = 0;
  float* acc = nullptr;            ///< [group][head_dim]
  float* scratch = nullptr;        ///< scratch_floats(group, page_size, head_dim) floats
};

/// Arguments of the online-softmax step (Milakov & Gimelshein): folds `count` new scores per
/// head into the running maximum and sum, rescales the accumulator when the maximum grows, and
/// turns the scores into weights exp(s - max) in place.
struct SoftmaxArgs {
  float* scores = nullptr;   ///< [group][stride], in: scores, out: unnormalised weights
  index_t count = 0;
  index_t stride = 0;
  index_t group = 0;
  float* running_max = nullptr;  ///< [group], -inf before the first token
  float* running_sum = nullptr;  ///< [group]
  float* acc = nullptr;          ///< [group][head_dim]
  index_t head_dim = 0;
};

/// Arguments of the key kernel for full-precision rows (the stream's tail window).
struct RowScoreArgs {
  const float* rows = nullptr;  ///< [count][row_stride]
  index_t count = 0;
  std::ptrdiff_t row_stride = 0;
  index_t head_dim = 0;
  const float* queries = nullptr;  ///< [group][head_dim]
  index_t group = 0;
  float* scores = nullptr;  ///< [group][score_stride]
  index_t score_stride = 0;
};

/// Arguments of a key kernel for keys stored before RoPE: each slot is rotated to its stored
/// position before it is scored.
template <class Params>
struct RotatedScoreArgs {
  ScoreArgs<Params> score;
  const std::int32_t* const* positions = nullptr;  ///< [count] per page: page_size slot positions
  RopeView rope;
};

/// Arguments of the row kernel for pre-RoPE tail rows.
struct RotatedRowScoreArgs {
  RowScoreArgs rows;
  const std::int32_t* positions = nullptr;  ///< [count]
  RopeView rope;
  float* scratch = nullptr;                 ///< [count][head_dim]
};

/// Arguments of a page decoder (layout::MLA's latent attention): one plane of one page as fp32,
/// channel-major, the layout the fp32 key kernel scores.
template <class Codec>
struct DecodePlaneArgs {
  const Codec* codec = nullptr;
  typename Codec::params_type params{};
  const std::byte* plane = nullptr;
  index_t page_size = 0;
  index_t head_dim = 0;
  float* out = nullptr;   ///< [head_dim][page_size]
  float* rows = nullptr;  ///< [page_size][head_dim] scratch
};

/// Arguments of WidenToFloat: `count` inputs of type T (fp16 or bfloat16) to fp32.
template <class T>
struct WidenArgs {
  const T* in = nullptr;
  float* out = nullptr;
  std::size_t count = 0;
};

/// Arguments of EncodePlane: page_size rows of head_dim floats, row t at rows + t·row_stride,
/// encoded into one plane.
struct EncodeRowsArgs {
  const float* rows = nullptr;
  std::ptrdiff_t row_stride = 0;
  index_t page_size = 0;
  index_t head_dim = 0;
  std::byte* plane = nullptr;
  /// Set to true by an encoder that leaves the plane to the codec's scalar `encode` (no vector
  /// path on this ISA, or input it does not handle). The caller runs `encode` then: calling it
  /// from a per-ISA object would compile it, out of line, with that object's instructions
  /// (STYLE.md §5.2). Float planes are never declined.
  bool* declined = nullptr;
};

/// Scratch floats every key and value kernel may use for one call (per-page staging of scales,
/// weights and the prepared query, or one page decoded to fp32), generously bounded so callers
/// size one buffer for all codecs.
[[nodiscard]] constexpr std::size_t scratch_floats(index_t group, index_t page_size,
                                                   index_t head_dim) noexcept {
  const std::size_t blocks = static_cast<std::size_t>(head_dim) / 32 + 1;
  const std::size_t staging = 4 * static_cast<std::size_t>(group) * (head_dim + page_size * blocks + blocks) +
                              4 * static_cast<std::size_t>(page_size) * blocks + 256;
  // Two pages decoded to fp32 (a pre-RoPE key page and its rotation), plus
  // [group][page_size + 2·head_dim] for their reordering or for per-head vectors (the queries
  // turned back for a pre-RoPE page, TurboQuant's rotated and sketched queries, or its rotated
  // sums).
  const std::size_t page_tile = 2 * static_cast<std::size_t>(page_size) * static_cast<std::size_t>(head_dim) +
                                static_cast<std::size_t>(group) * static_cast<std::size_t>(page_size + 2 * head_dim);
  return staging > page_tile ? staging : page_tile;
}

static_assert(std::is_trivially_copyable_v<PageRun>);
static_assert(std::is_trivially_copyable_v<SoftmaxArgs>);

}  // namespace kvpack::inline v0::kernels
