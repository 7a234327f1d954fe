#pragma once
/// \file quest.hpp
/// \brief select::Quest (Tang et al., ICML 2024; ALGORITHMS.md §10): per-page channel min/max
///        summaries, the page upper bound Σ_c max(q_c·min_c, q_c·max_c), and top-k page selection
///        per KV head under a token budget.
///
/// Pieces, in the order a decode step uses them:
/// - at encode time, `summarize_page` over the page's keys *as decoded* (DESIGN.md §2), so the
///   bound holds for what the kernel reads, not for the keys before quantization;
/// - per step and KV head, `group_page_bounds` scores every page for the g query heads of the
///   group and aggregates them (max by default);
/// - `select_top_pages` keeps the `Quest::pages_to_read` best pages, in page (token) order, so
///   attention reads the selected pages like a shorter stream (kernels::PageRun).
/// The full-precision tail is not a page: it is always read.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string_view>

#include "kvpack/error.hpp"
#include "kvpack/select/select_concepts.hpp"

namespace kvpack::inline v0::select {

/// How the g query heads of a GQA group combine their page bounds into one ranking per KV head
/// (pages are per KV head, so the group reads one set of pages).
enum class GroupBound : std::uint8_t {
  kMax,   ///< max over the group: a page any head may need ranks high, and the value stays an
          ///< upper bound of q_h·k for every head h of the group
  kMean,  ///< mean over the group (ranks like the sum; kvpress's choice for eviction scores);
          ///< not an upper bound for any single head
};

/// The Quest page selector: reads the `pages_to_read` pages with the largest upper bound.
struct Quest {
  static constexpr std::string_view kName = "quest";
  static constexpr bool kReadsAllPages = false;

  /// Tokens read per KV head per step (pages × page_size, the tail not counted). The paper's
  /// passkey table (ALGORITHMS.md §10.4) reaches 100 % at 100K context from 2048 tokens per head;
  /// here one page set serves the g heads of a GQA group, whose needs overlap only partly, so the
  /// default doubles that: 4096, the budget of the spec's traffic example (64K → 8× less).
  index_t token_budget = 4096;
  /// Layers [0, dense_layers) read every page (the reference keeps layers 0 and 1 dense).
  index_t dense_layers = 2;
  /// Pages read at least, whatever the budget (the reference's K = max(3, budget / page)).
  index_t min_pages = 3;
  GroupBound group_bound = GroupBound::kMax;

  /// Per-channel min and max as fp32 (2·head_dim floats): exact for every decoded key, so the
  /// bound needs no rounding allowance for the summary itself.
  [[nodiscard]] std::size_t summary_bytes(index_t /*page_size*/, index_t head_dim) const noexcept {
    return 2 * static_cast<std::size_t>(head_dim > 0 ? head_dim : 0) * sizeof(float);
  }

  /// \throws kvpack::Error (kInvalidConfig) on a negative budget, layer count or page minimum.
  void validate() const {
    KVPACK_CHECK(token_budget >= 0 && dense_layers >= 0 && min_pages >= 0, kInvalidConfig,
                 kvpack::detail::message("select::Quest: token_budget (", token_budget, "), dense_layers (",
                                 dense_layers, ") and min_pages (", min_pages, ") must be >= 0"));
  }

  /// Whether `layer` reads every page.
  [[nodiscard]] bool reads_densely(index_t layer) const noexcept { return layer < dense_layers; }

  /// K = min(max(min_pages, token_budget / page_size), page_count): pages read per KV head.
  [[nodiscard]] index_t pages_to_read(index_t page_count, index_t page_size) const noexcept {
    const index_t by_budget = token_budget / std::max<index_t>(page_size, 1);
    return std::clamp<index_t>(std::max(min_pages, by_budget), 0, std::max<index_t>(page_count, 0));
  }

  friend constexpr bool operator==(const Quest&, const Quest&) noexcept = default;
};
static_assert(PageSelector<Quest>);

/// Summarises one page: min_out[c] and max_out[c] over the page's written slots.
///
/// Summarise *every slot written at encode time*, not only the live ones: a slot evicted later
/// keeps its key inside the summary, so the bound stays valid for evicted tokens too (which the
/// certified unread-mass bound, unread_bound.hpp, relies on). A page with no written slot gets
/// the empty box (min = +inf, max = -inf), for which the bound is -inf.
/// Keys are finite (the cache checks inputs; decoders of finite inputs give finite keys); a NaN
/// key makes the summary unspecified.
/// \param keys    [page_size][head_dim] decoded keys
/// \param written [(page_size + 63) / 64] bitmask of slots written, bit t of word t / 64; nullptr
///                when every slot was written
inline void summarize_page(const float* keys, const std::uint64_t* written, index_t page_size,
                           index_t head_dim, float* min_out /*[head_dim]*/,
                           float* max_out /*[head_dim]*/) noexcept {
  std::fill_n(min_out, head_dim, std::numeric_limits<float>::infinity());
  std::fill_n(max_out, head_dim, -std::numeric_limits<float>::infinity());
  for (index_t t = 0; t < page_size; ++t) {
    if (written != nullptr && ((written[t / 64] >> (t % 64)) & 1u) == 0) continue;
    const float* key = keys + static_cast<std::size_t>(t) * head_dim;
    for (index_t c = 0; c < head_dim; ++c) {
      min_out[c] = std::min(min_out[c], key[c]);
      max_out[c] = std::max(max_out[c], key[c]);
    }
  }
}

namespace detail {

/// Lanes of the bound's dot product: independent accumulators so the compiler vectorises the
/// loop at any ISA and the summation order (hence the result) does not depend on it.
inline constexpr index_t kBoundLanes = 16;

/// Relative float rounding of the bound: fl(Σ_c t_c) differs from Σ_c t_c by at most
/// γ_n·Σ_c |t_c| with n = 1 (product) + ceil(head_dim / 16) (lane sums) + 4 (lane tree) + 1
/// (adding the allowance), γ_n ≤ n·2^-24·1.01. Doubled for margin.
[[nodiscard]] inline float bound_rounding(index_t head_dim) noexcept {
  const index_t n = 1 + (head_dim + kBoundLanes - 1) / kBoundLanes + 4 + 1;
  return 2.0f * static_cast<float>(n) * 1.01f * 0x1p-24f;
}

/// max_c max(|min_c|, |max_c|) of a non-empty summary: with Σ_c |q_c| it bounds Σ_c |t_c|.
[[nodiscard]] inline float summary_abs_max(const float* min, const float* max, index_t head_dim) noexcept {
  float lanes[kBoundLanes] = {};
  index_t c = 0;
  for (; c + kBoundLanes <= head_dim; c += kBoundLanes) {
    for (index_t j = 0; j < kBoundLanes; ++j) {
      lanes[j] = std::max(lanes[j], std::max(std::fabs(min[c + j]), std::fabs(max[c + j])));
    }
  }
  for (index_t j = 0; j < kBoundLanes && c + j < head_dim; ++j) {
    lanes[j] = std::max(lanes[j], std::max(std::fabs(min[c + j]), std::fabs(max[c + j])));
  }
  float out = 0.0f;
  for (float lane : lanes) out = std::max(out, lane);
  return out;
}

/// Σ_c max(q_c·min_c, q_c·max_c) in float, 16 lanes, then a fixed pairwise tree.
[[nodiscard]] inline float box_dot(const float* query, const float* min, const float* max, index_t head_dim) noexcept {
  float lanes[kBoundLanes] = {};
  index_t c = 0;
  for (; c + kBoundLanes <= head_dim; c += kBoundLanes) {
    for (index_t j = 0; j < kBoundLanes; ++j) {
      const float q = query[c + j];
      // One product per channel: the larger of q·min and q·max is q·max when q >= 0.
      lanes[j] += q * (q >= 0.0f ? max[c + j] : min[c + j]);
    }
  }
  for (index_t j = 0; j < kBoundLanes && c + j < head_dim; ++j) {
    lanes[j] += query[c + j] * (query[c + j] >= 0.0f ? max[c + j] : min[c + j]);
  }
  for (index_t width = kBoundLanes / 2; width >= 1; width /= 2) {
    for (index_t j = 0; j < width; ++j) lanes[j] += lanes[j + width];
  }
  return lanes[0];
}

[[nodiscard]] inline float abs_sum(const float* x, index_t n) noexcept {
  float lanes[kBoundLanes] = {};
  index_t c = 0;
  for (; c + kBoundLanes <= n; c += kBoundLanes) {
    for (index_t j = 0; j < kBoundLanes; ++j) lanes[j] += std::fabs(x[c + j]);
  }
  for (index_t j = 0; j < kBoundLanes && c + j < n; ++j) lanes[j] += std::fabs(x[c + j]);
  for (index_t width = kBoundLanes / 2; width >= 1; width /= 2) {
    for (index_t j = 0; j < width; ++j) lanes[j] += lanes[j + width];
  }
  // Same summation depth as box_dot: rounded up by the same allowance, it stays >= the exact sum.
  return lanes[0] * (1.0f + bound_rounding(n));
}

/// The certified bound of one head given Σ|q| and the summary's abs max.
[[nodiscard]] inline float page_bound(const float* query, float query_abs_sum, const float* min, const float* max,
                                      float summary_abs, index_t head_dim) noexcept {
  if (head_dim <= 0) return 0.0f;
  if (!(min[0] <= max[0])) return -std::numeric_limits<float>::infinity();  // empty page
  return box_dot(query, min, max, head_dim) + bound_rounding(head_dim) * query_abs_sum * summary_abs;
}

/// Whether page a ranks before page b: larger bound first, then lower index. NaN ranks as +inf
/// (a page whose bound is unknown must be read).
[[nodiscard]] inline bool ranks_before(std::span<const float> bounds, index_t a, index_t b) noexcept {
  const float inf = std::numeric_limits<float>::infinity();
  const float x = std::isnan(bounds[a]) ? inf : bounds[a];
  const float y = std::isnan(bounds[b]) ? inf : bounds[b];
  return x > y || (x == y && a < b);
}

}  // namespace detail

/// The upper bound of q·k over every key k of the page's summary box:
/// U = Σ_c max(q_c·min_c, q_c·max_c), plus the float rounding of computing it (at most
/// ~2^-20·Σ|q_c|·max_c|k_c| for head_dim 128), so U >= q·k holds in exact arithmetic for every
/// key that was summarised. -inf for an empty summary.
/// \param query [head_dim], the softmax scale already applied (then U bounds the scaled score)
[[nodiscard]] inline float page_upper_bound(const float* query, const float* min /*[head_dim]*/,
                                            const float* max /*[head_dim]*/, index_t head_dim) noexcept {
  if (head_dim <= 0) return 0.0f;
  if (!(min[0] <= max[0])) return -std::numeric_limits<float>::infinity();
  return detail::page_bound(query, detail::abs_sum(query, head_dim), min, max,
                            detail::summary_abs_max(min, max, head_dim), head_dim);
}

/// Bounds of every page of one KV stream for the g query heads of its group.
/// Each summary is read once for the g heads (it is the bytes that cost, not the FMAs).
/// \param queries     [group][head_dim], softmax scale applied
/// \param summaries   [pages] pointers to a page's summary, [2][head_dim]: min row, then max row
/// \param head_bounds [group][pages] per-head bounds (what unread_bound.hpp needs), or empty
/// \param page_bounds [pages] the group's bound per page, aggregated by `how`
/// \throws kvpack::Error (kInvalidArgument) when a span's size does not match the shapes
inline void group_page_bounds(std::span<const float> queries, index_t group, index_t head_dim,
                              std::span<const float* const> summaries, std::span<float> head_bounds,
                              std::span<float> page_bounds, GroupBound how = GroupBound::kMax) {
  KVPACK_CHECK(group > 0 && head_dim > 0, kInvalidArgument,
               kvpack::detail::message("group_page_bounds: group (", group, ") and head_dim (", head_dim, ") must be > 0"));
  const std::size_t pages = summaries.size();
  KVPACK_CHECK(queries.size() == static_cast<std::size_t>(group) * head_dim, kInvalidArgument,
               kvpack::detail::message("group_page_bounds: queries must hold group * head_dim = ",
                               static_cast<std::size_t>(group) * head_dim, " floats, got ", queries.size()));
  KVPACK_CHECK(page_bounds.size() == pages, kInvalidArgument,
               kvpack::detail::message("group_page_bounds: page_bounds must hold one float per page (", pages,
                               "), got ", page_bounds.size()));
  KVPACK_CHECK(head_bounds.empty() || head_bounds.size() == pages * group, kInvalidArgument,
               kvpack::detail::message("group_page_bounds: head_bounds must be empty or hold group * pages = ",
                               pages * group, " floats, got ", head_bounds.size()));
  // Σ|q_h| per head, once per step; groups are small (GQA: up to 16), so a fixed array.
  constexpr index_t kMaxGroup = 64;
  KVPACK_CHECK(group <= kMaxGroup, kUnsupported,
               kvpack::detail::message("group_page_bounds: group ", group, " exceeds ", kMaxGroup));
  float query_abs[kMaxGroup];
  for (index_t h = 0; h < group; ++h) {
    query_abs[h] = detail::abs_sum(queries.data() + static_cast<std::size_t>(h) * head_dim, head_dim);
  }
  const float inverse_group = 1.0f / static_cast<float>(group);
  for (std::size_t p = 0; p < pages; ++p) {
    const float* min = summaries[p];
    const float* max = min + head_dim;
    const float summary_abs = detail::summary_abs_max(min, max, head_dim);
    float aggregate = how == GroupBound::kMax ? -std::numeric_limits<float>::infinity() : 0.0f;
    for (index_t h = 0; h < group; ++h) {
      const float u = detail::page_bound(queries.data() + static_cast<std::size_t>(h) * head_dim, query_abs[h],
                                         min, max, summary_abs, head_dim);
      if (!head_bounds.empty()) head_bounds[static_cast<std::size_t>(h) * pages + p] = u;
      aggregate = how == GroupBound::kMax ? std::max(aggregate, u) : aggregate + u;
    }
    page_bounds[p] = how == GroupBound::kMax ? aggregate : aggregate * inverse_group;
  }
}

/// The k pages with the largest bounds (ties: lower page index first; NaN counts as +inf),
/// written to out[0, min(k, n)) in increasing page order so attention reads them in token order.
/// O(n log k), no allocation, deterministic. Returns min(k, n).
/// \throws kvpack::Error (kInvalidArgument) when k < 0 or out holds fewer than min(k, n) entries
inline index_t select_top_pages(std::span<const float> bounds, index_t k, std::span<index_t> out) {
  KVPACK_CHECK(k >= 0, kInvalidArgument, kvpack::detail::message("select_top_pages: k = ", k, " must be >= 0"));
  const index_t n = static_cast<index_t>(bounds.size());
  const index_t count = std::min(k, n);
  KVPACK_CHECK(out.size() >= static_cast<std::size_t>(count), kInvalidArgument,
               kvpack::detail::message("select_top_pages: out holds ", out.size(), " entries, ", count, " needed"));
  for (index_t i = 0; i < count; ++i) out[i] = i;
  if (count == n) return count;  // every page (also k == 0 with n == 0)
  if (count == 0) return 0;
  // A heap of the best `count` so far with the worst on top: a page replaces it when it ranks before it.
  const auto worse_on_top = [&](index_t a, index_t b) { return detail::ranks_before(bounds, a, b); };
  const auto first = out.begin();
  const auto last = out.begin() + count;
  std::make_heap(first, last, worse_on_top);
  for (index_t i = count; i < n; ++i) {
    if (detail::ranks_before(bounds, i, out[0])) {
      std::pop_heap(first, last, worse_on_top);
      *(last - 1) = i;
      std::push_heap(first, last, worse_on_top);
    }
  }
  std::sort(first, last);
  return count;
}

}  // namespace kvpack::inline v0::select
