#pragma once
/// \file attend_stream.hpp
/// \brief Decode attention over one KV stream: pages in chunks (score, online softmax,
///        accumulate), then the full-precision tail, for all query heads of the stream's group.

#include <algorithm>
#include <cstddef>
#include <limits>
#include <vector>

#include "kvpack/dispatch.hpp"
#include "kvpack/kernels/kernel_args.hpp"
#include "kvpack/quant/float.hpp"
#include "kvpack/quant/quant_concepts.hpp"

namespace kvpack::inline v0::kernels {

/// The full-precision tail of a stream: token-major fp32 rows of head_dim, oldest first.
struct TailView {
  const float* keys = nullptr;    ///< [count][head_dim]
  const float* values = nullptr;  ///< [count][head_dim]
  index_t count = 0;
  const std::uint8_t* live = nullptr;  ///< [count] 0 for an evicted row, or nullptr: every row live
};

/// Where attend_stream copies the scaled scores q·k of every slot it reads (-inf for dead ones),
/// for evictors that rank tokens by the attention they receive: slot t of page i at
/// i·page_size + t, then tail row r at pages.count·page_size + r.
struct ScoreRecord {
  float* scores = nullptr;  ///< [group][stride]
  index_t stride = 0;
};

/// Keys stored before RoPE (CacheConfig::key_rope): what attend_stream needs to rotate them.
struct KeyRope {
  RopeView rope;
  const std::int32_t* const* page_positions = nullptr;  ///< [pages.count][page_size]
  const std::int32_t* tail_positions = nullptr;         ///< [tail.count]
};

/// Buffers for attend_stream, reused across calls: grows to the largest shape seen, never
/// shrinks, so steady-state decoding allocates nothing.
class Workspace {
 public:
  /// Tokens scored per chunk of pages: enough to amortise the per-chunk work (query preparation,
  /// one softmax pass), few enough that a chunk's pages are still in L2 when values are read.
  static constexpr index_t kChunkTokens = 512;

  void prepare(index_t group, index_t head_dim, index_t page_size, index_t tail_tokens) {
    score_stride_ = std::max({kChunkTokens, page_size, tail_tokens});
    // The scratch also holds a pre-RoPE tail rotated, [tail_tokens][head_dim].
    const std::size_t scratch = std::max(scratch_floats(group, page_size, head_dim),
                                         static_cast<std::size_t>(tail_tokens) * head_dim);
    const std::size_t need = static_cast<std::size_t>(group) * score_stride_ +
                             static_cast<std::size_t>(group) * (2 + head_dim) + scratch + 64;
    if (storage_.size() < need) storage_.resize(need);
    float* p = storage_.data();
    scores_ = p;
    p += static_cast<std::size_t>(group) * score_stride_;
    max_ = p;
    sum_ = p + group;
    acc_ = p + 2 * group;
    p += static_cast<std::size_t>(group) * (2 + head_dim);
    scratch_ = p;
  }

  [[nodiscard]] float* scores() const noexcept { return scores_; }
  [[nodiscard]] index_t score_stride() const noexcept { return score_stride_; }
  [[nodiscard]] float* running_max() const noexcept { return max_; }
  [[nodiscard]] float* running_sum() const noexcept { return sum_; }
  [[nodiscard]] float* acc() const noexcept { return acc_; }
  [[nodiscard]] float* scratch() const noexcept { return scratch_; }

 private:
  std::vector<float> storage_;
  float* scores_ = nullptr;
  float* max_ = nullptr;
  float* sum_ = nullptr;
  float* acc_ = nullptr;
  float* scratch_ = nullptr;
  index_t score_stride_ = 0;
};

/// The kernels one stream's attention calls, bound to one instruction set.
template <quant::Codec KeyCodec, quant::Codec ValueCodec>
struct KernelSet {
  using RowValues = cpu::AccumulateValues<quant::FloatCodec<float, Plane::kValue>>;
  dispatch::CpuFunction<cpu::ScoreKeys<KeyCodec>> score;
  dispatch::CpuFunction<cpu::AccumulateValues<ValueCodec>> accumulate;
  dispatch::CpuFunction<cpu::SoftmaxUpdate> softmax;
  dispatch::CpuFunction<cpu::ScoreRows> score_rows;
  dispatch::CpuFunction<RowValues> accumulate_rows;
  dispatch::CpuFunction<cpu::ScoreRotatedKeys<KeyCodec>> score_rotated;
  dispatch::CpuFunction<cpu::ScoreRotatedRows> score_rotated_rows;

  /// The kernels dispatch selects for this CPU (or KVPACK_ISA).
  static KernelSet selected() {
    return {dispatch::cpu_kernel<cpu::ScoreKeys<KeyCodec>>(),
            dispatch::cpu_kernel<cpu::AccumulateValues<ValueCodec>>(),
            dispatch::cpu_kernel<cpu::SoftmaxUpdate>(),
            dispatch::cpu_kernel<cpu::ScoreRows>(),
            dispatch::cpu_kernel<RowValues>(),
            dispatch::cpu_kernel<cpu::ScoreRotatedKeys<KeyCodec>>(),
            dispatch::cpu_kernel<cpu::ScoreRotatedRows>()};
  }
  /// The kernels compiled for `Arch` (see dispatch::cpu_kernel_for for when that is allowed);
  /// the pre-RoPE key kernel only where it is precompiled (nullptr otherwise).
  template <class Arch>
  static KernelSet for_arch() noexcept {
    using Rotated = cpu::ScoreRotatedKeys<KeyCodec>;
    dispatch::CpuFunction<Rotated> rotated = nullptr;
    if constexpr (cpu::is_precompiled<Rotated>::value) rotated = dispatch::cpu_kernel_for<Rotated, Arch>();
    return {dispatch::cpu_kernel_for<cpu::ScoreKeys<KeyCodec>, Arch>(),
            dispatch::cpu_kernel_for<cpu::AccumulateValues<ValueCodec>, Arch>(),
            dispatch::cpu_kernel_for<cpu::SoftmaxUpdate, Arch>(),
            dispatch::cpu_kernel_for<cpu::ScoreRows, Arch>(),
            dispatch::cpu_kernel_for<RowValues, Arch>(),
            rotated,
            dispatch::cpu_kernel_for<cpu::ScoreRotatedRows, Arch>()};
  }
};

/// Copies `count` scores per head from the workspace to `record` at slot `offset`.
inline void copy_scores(const Workspace& ws, index_t group, index_t count, const ScoreRecord* record,
                        index_t offset) noexcept {
  for (index_t h = 0; h < group; ++h) {
    std::copy_n(ws.scores() + static_cast<std::size_t>(h) * ws.score_stride(), count,
                record->scores + static_cast<std::size_t>(h) * record->stride + offset);
  }
}

/// Sets the tail's scores of rows an evictor dropped to -inf (weight 0).
inline void mask_dead_rows(const TailView& tail, index_t group, const Workspace& ws) noexcept {
  if (tail.live == nullptr) return;
  for (index_t r = 0; r < tail.count; ++r) {
    if (tail.live[r] != 0) continue;
    for (index_t h = 0; h < group; ++h) ws.scores()[h * ws.score_stride() + r] = -std::numeric_limits<float>::infinity();
  }
}

/// out[h] = softmax(q[h] · K) V over every live slot of `pages` (its `count` is the whole
/// stream) and every row of `tail`. `queries` already carry the softmax scale. The workspace
/// must have been prepared for (group, head_dim, page_size, tail.count). With `key_rope`, keys
/// (pages and tail) were stored before RoPE and are rotated to their positions as they are read.
/// With `record`, the scores are copied out before the softmax; the workspace's running maximum
/// and sum then turn them into probabilities: p = exp(s − max) / sum.
template <quant::Codec KeyCodec, quant::Codec ValueCodec>
void attend_stream(const PageRun& pages, const typename KeyCodec::params_type& key_params,
                   const typename ValueCodec::params_type& value_params, const TailView& tail,
                   const float* queries /*[group][head_dim]*/, index_t group,
                   float* out /*[group][head_dim]*/, const Workspace& ws,
                   const KernelSet<KeyCodec, ValueCodec>& kernels, const KeyRope* key_rope = nullptr,
                   const ScoreRecord* record = nullptr) noexcept {
  const index_t head_dim = pages.head_dim;
  std::fill_n(ws.running_max(), group, -std::numeric_limits<float>::infinity());
  std::fill_n(ws.running_sum(), group, 0.0f);
  std::fill_n(ws.acc(), static_cast<std::size_t>(group) * head_dim, 0.0f);

  const auto score = kernels.score;
  const auto accumulate = kernels.accumulate;
  const auto softmax = kernels.softmax;
  const SoftmaxArgs softmax_base{ws.scores(), 0, ws.score_stride(), group, ws.running_max(),
                                 ws.running_sum(), ws.acc(), head_dim};

  const index_t chunk_pages = std::max<index_t>(1, Workspace::kChunkTokens / std::max<index_t>(1, pages.page_size));
  for (index_t first = 0; first < pages.count; first += chunk_pages) {
    PageRun run = pages;
    run.pages = pages.pages + first;
    run.live = pages.live != nullptr ? pages.live + first : nullptr;
    run.count = std::min(chunk_pages, pages.count - first);
    run.prefetch = pages.count - first - run.count;
    run.planes_apart = cpu::kValueKernelPrefetches<ValueCodec>;
    const ScoreArgs<typename KeyCodec::params_type> score_args{run,         key_params,        queries,    group,
                                                               ws.scores(), ws.score_stride(), ws.scratch()};
    if (key_rope != nullptr) {
      kernels.score_rotated({score_args, key_rope->page_positions + first, key_rope->rope});
    } else {
      score(score_args);
    }
    SoftmaxArgs step = softmax_base;
    step.count = run.count * run.page_size;
    if (record != nullptr) copy_scores(ws, group, step.count, record, first * pages.page_size);
    softmax(step);
    accumulate({run, value_params, ws.scores(), ws.score_stride(), group, ws.acc(), ws.scratch()});
  }

  if (tail.count > 0) {
    const RowScoreArgs tail_rows{tail.keys, tail.count, head_dim, head_dim, queries, group, ws.scores(), ws.score_stride()};
    if (key_rope != nullptr) {
      kernels.score_rotated_rows({tail_rows, key_rope->tail_positions, key_rope->rope, ws.scratch()});
    } else {
      kernels.score_rows(tail_rows);
    }
    mask_dead_rows(tail, group, ws);
    SoftmaxArgs step = softmax_base;
    step.count = tail.count;
    if (record != nullptr) copy_scores(ws, group, tail.count, record, pages.count * pages.page_size);
    softmax(step);
    // The tail is token-major fp32: exactly a Float<float> value plane of `count` rows.
    const std::byte* rows = reinterpret_cast<const std::byte*>(tail.values);
    PageRun run{&rows, nullptr, 1, 0, tail.count, head_dim, 0, 0};
    kernels.accumulate_rows(
        {run, quant::NoParams{}, ws.scores(), ws.score_stride(), group, ws.acc(), ws.scratch()});
  }

  for (index_t h = 0; h < group; ++h) {
    const float sum = ws.running_sum()[h];
    const float inverse = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (index_t c = 0; c < head_dim; ++c) out[h * head_dim + c] = ws.acc()[h * head_dim + c] * inverse;
  }
}

}  // namespace kvpack::inline v0::kernels
