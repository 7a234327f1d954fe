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
#include "kvpack/kernels/cpu/isa.hpp"
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

  /// Per-channel min and max as fp32 (2·head_dim floats: exact for every decoded key, so the
  /// bound needs no rounding allowance for the summary itself), then two floats for the
  /// certified bound: the largest value norm in the page and the tokens that lived in it.
  /// Every step scans every page's box: at page 32 and head_dim 128 that is 1 KiB against a
  /// 16 KiB fp16 page (1/16) but a 4.5 KiB q4_0 page (~1/4.5), which caps Quest's byte saving on
  /// small codecs. NOTE(quest): fp16 boxes rounded outward (min down, max up) would halve it and
  /// stay a valid bound.
  [[nodiscard]] std::size_t summary_bytes(index_t /*page_size*/, index_t head_dim) const noexcept {
    return (2 * static_cast<std::size_t>(head_dim > 0 ? head_dim : 0) + 2) * sizeof(float);
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

// The bound's loops are written once (always inlined) and compiled three times: for AVX-512,
// for AVX2+FMA (function-level target attributes, so nothing else in the including file changes
// ISA), and for the including file's own flags. Scoring reads 2·head_dim floats per page for g
// heads; without 8- or 16-wide FMAs it runs under the memory speed and would eat the time Quest
// saves. NOTE(quest): the same choice as the attention kernels (kernels::cpu::selected_isa, so
// KVPACK_ISA applies) when the dispatch library is linked; the proper home is a precompiled
// kernel in kernels/cpu once the cache wires Quest in.
#if defined(__GNUC__) && defined(__x86_64__)
#define KVPACK_QUEST_INLINE [[gnu::always_inline]] inline
#else
#define KVPACK_QUEST_INLINE inline
#endif

/// The bound's loops use GCC/clang vector extensions, so each variant below keeps its
/// accumulators in registers whatever the including file's flags. A logical accumulator is 16
/// float lanes (one zmm, two ymm, ...); the variants differ only in how many accumulators a
/// head's blocks are spread over (kAcc), and every order stays within bound_rounding.
using Vec16 = float __attribute__((vector_size(64)));
using Int16 = std::int32_t __attribute__((vector_size(64)));
using Vec8 = float __attribute__((vector_size(32)));
using Int8 = std::int32_t __attribute__((vector_size(32)));
using Vec4 = float __attribute__((vector_size(16)));
using Vec2 = float __attribute__((vector_size(8)));
inline constexpr index_t kLanes = 16;

template <class V>
struct VecTraits;
template <>
struct VecTraits<Vec16> {
  using Int = Int16;
};
template <>
struct VecTraits<Vec8> {
  using Int = Int8;
};

/// Σ of 16 lanes held in `parts` vectors, in a fixed pairwise order. (Vectors go by reference:
/// a 64-byte vector by value has a different ABI with and without AVX-512, which GCC warns about.)
template <class V, index_t kParts>
KVPACK_QUEST_INLINE float sum16(const V (&parts)[kParts]) noexcept {
  static_assert(sizeof(V) * kParts == kLanes * sizeof(float));
  // Level 1 (lanes j and j + 8) as one 8-wide add, then 4, 2, 1 with shuffles: the same order
  // as a scalar tree, without spilling the lanes to memory.
  Vec8 w;
  if constexpr (kParts == 1) {
    w = __builtin_shufflevector(parts[0], parts[0], 0, 1, 2, 3, 4, 5, 6, 7) +
        __builtin_shufflevector(parts[0], parts[0], 8, 9, 10, 11, 12, 13, 14, 15);
  } else {
    static_assert(kParts == 2);
    w = parts[0] + parts[1];
  }
  const Vec4 x = __builtin_shufflevector(w, w, 0, 1, 2, 3) + __builtin_shufflevector(w, w, 4, 5, 6, 7);
  const Vec2 y = __builtin_shufflevector(x, x, 0, 1) + __builtin_shufflevector(x, x, 2, 3);
  return y[0] + y[1];
}

/// Relative float rounding of the bound. With the query split as q⁻ = min(q, 0) against the min
/// row and q⁺ = max(q, 0) against the max row, one of each channel's two products is an exact
/// zero, so U = Σ_c t_c with t_c = max(q_c·min_c, q_c·max_c) is a dot product of 2·head_dim
/// terms in 16-lane accumulators: each lane adds at most ceil(head_dim / 8) terms (one
/// accumulator), then the accumulators (1), the lane tree (4) and the allowance (1); one more for
/// products rounded apart from their sums without FMA. The error is at most γ_n·Σ_c |t_c| with
/// γ_n ≤ n·2^-24·1.01, and Σ_c |t_c| ≤ max_c |q_c| · Σ_c (|min_c| + |max_c|). Doubled for margin
/// (that also covers the rounding of that Σ and of the allowance's own products).
KVPACK_QUEST_INLINE float bound_rounding(index_t head_dim) noexcept {
  const index_t n = 1 + (head_dim + 7) / 8 + 1 + 4 + 1;
  return 2.0f * static_cast<float>(n) * 1.01f * 0x1p-24f;
}

/// Query heads scored together: their split query blocks are loaded once per summary block.
inline constexpr index_t kHeadTile = 4;
/// Floats of the split queries kept on the stack; larger groups are scored in several passes.
inline constexpr index_t kPreparedFloats = 4096;
/// Query heads group_page_bounds takes at most (GQA groups are 1–16).
inline constexpr index_t kMaxGroup = 64;
/// Channels the split query of one head may have on the stack.
inline constexpr index_t kMaxHeadDim = kPreparedFloats / 2;

/// Adds block `block` of a summary (its 16 floats at src) times the same block of each head's
/// split query into acc[h], and their absolute values into abs_acc with kAbs. (A function, not a
/// lambda, so always_inline puts it in each target variant.)
template <class V, index_t kHeads, bool kAbs, index_t kParts>
KVPACK_QUEST_INLINE void add_summary_block(V (&acc)[kHeads][kParts], V (&abs_acc)[kParts], const float* src,
                                           const float* prepared, index_t stride, index_t block) noexcept {
  using Int = typename VecTraits<V>::Int;
  constexpr index_t kWidth = static_cast<index_t>(sizeof(V) / sizeof(float));
  const Int no_sign = Int{} + 0x7fffffff;
#pragma GCC unroll 4
  for (index_t part = 0; part < kParts; ++part) {
    V s;
    __builtin_memcpy(&s, src + part * kWidth, sizeof(V));
    if constexpr (kAbs) abs_acc[part] += reinterpret_cast<V>(reinterpret_cast<Int>(s) & no_sign);
#pragma GCC unroll 16
    for (index_t h = 0; h < kHeads; ++h) {
      V q;
      __builtin_memcpy(&q, prepared + h * stride + block * kLanes + part * kWidth, sizeof(V));
      acc[h][part] += q * s;
    }
  }
}

/// Scores one page's summary for kHeads heads of `prepared` ([kHeads][stride]: q⁻ row then q⁺
/// row, zero-padded to whole 16-float blocks): bounds[h·bound_stride] receives head h's bound,
/// and *abs_out Σ|summary| with kAbs.
///
/// Each head has kAcc logical accumulators of 16 lanes (kParts vectors V each); block b goes to
/// accumulator b % kAcc, which are then added in order, so every caller of one variant
/// (page_upper_bound included) gets the same bits for a page. Why it is written this way,
/// measured on one Llama-3.1-8B layer's 8 MiB of summaries:
/// - the accumulators are named by constants only, so they stay in registers (a runtime index
///   into them sent them to the stack: 43 ns a page with the boxes in L2, now 33 ns);
/// - kAcc chains per head, not one: with one 16-deep FMA chain per head the scheduler fills
///   with waiting FMAs while a summary comes from DRAM, and the scan took 1.0–1.3 ms against
///   0.6–0.7 ms with two (a plain read of the same bytes: 0.5 ms);
/// - one page at a time: scoring 2 or 4 pages together (one query load per block for all)
///   was no faster in L2 and 2× slower from DRAM;
/// - every line of the box kBoxesAhead pages on is requested (score_tile): see there.
template <class V, index_t kHeads, index_t kAcc, bool kAbs>
KVPACK_QUEST_INLINE void score_page(const float* prepared, index_t stride, index_t head_dim, const float* summary,
                                    float* bounds, std::size_t bound_stride, float* abs_out) noexcept {
  constexpr index_t kParts = kLanes / static_cast<index_t>(sizeof(V) / sizeof(float));
  const index_t full = (2 * head_dim) / kLanes;  // whole blocks in the summary
  const index_t left = 2 * head_dim - full * kLanes;
  V acc[kAcc][kHeads][kParts] = {};
  V abs_acc[kAcc][kParts] = {};
  index_t b = 0;
  for (; b + kAcc <= full; b += kAcc) {
#pragma GCC unroll 8
    for (index_t a = 0; a < kAcc; ++a) {
      add_summary_block<V, kHeads, kAbs>(acc[a], abs_acc[a], summary + (b + a) * kLanes, prepared, stride, b + a);
    }
  }
  // The blocks left (fewer than kAcc), then the partial one, copied into a zero-padded block
  // (the query rows are padded with zeros too). They go to accumulators a = block % kAcc.
  float tail[kLanes] = {};
  if (left > 0) __builtin_memcpy(tail, summary + full * kLanes, static_cast<std::size_t>(left) * sizeof(float));
#pragma GCC unroll 8
  for (index_t a = 0; a < kAcc; ++a) {
    if (b + a < full) {
      add_summary_block<V, kHeads, kAbs>(acc[a], abs_acc[a], summary + (b + a) * kLanes, prepared, stride, b + a);
    } else if (b + a == full && left > 0) {
      add_summary_block<V, kHeads, kAbs>(acc[a], abs_acc[a], tail, prepared, stride, full);
    }
  }
#pragma GCC unroll 8
  for (index_t a = 1; a < kAcc; ++a) {
#pragma GCC unroll 4
    for (index_t part = 0; part < kParts; ++part) {
#pragma GCC unroll 16
      for (index_t h = 0; h < kHeads; ++h) acc[0][h][part] += acc[a][h][part];
      if constexpr (kAbs) abs_acc[0][part] += abs_acc[a][part];
    }
  }
#pragma GCC unroll 16
  for (index_t h = 0; h < kHeads; ++h) {
    bounds[static_cast<std::size_t>(h) * bound_stride] = sum16<V, kParts>(acc[0][h]);
  }
  if constexpr (kAbs) *abs_out = sum16<V, kParts>(abs_acc[0]);
}

/// Boxes requested ahead of the one being scored (all of their lines).
///
/// A stream's boxes lie in the pool's metadata, one per page (1.1 KiB apart at page 32 and
/// head_dim 128, further where streams' pages interleave), and the ~200 instructions that score
/// one leave the core too few loads in flight to keep memory busy: without the requests the scan ran at 0.69–0.71
/// of a plain read of the same boxes (BM_PageBounds against BM_ReadSummaries), with them at
/// 0.83–0.86, and fp16 Quest steps at 1/64 of 32K 17–20 % faster (2026-12-04, a 2-core Intel
/// Xeon VM; 2 and 8 boxes ahead measured alike, 4 and 16 less well). An earlier attempt on the
/// AMD Zen 5 VM, at 2–32 boxes ahead, changed nothing there.
inline constexpr std::size_t kBoxesAhead = 2;

/// Requests every cache line of a box of `floats` floats.
KVPACK_QUEST_INLINE void request_box(const float* box, std::size_t floats) noexcept {
  const char* bytes = reinterpret_cast<const char*>(box);
  for (std::size_t offset = 0; offset < floats * sizeof(float); offset += 64) __builtin_prefetch(bytes + offset, 0, 3);
}

/// Bounds of `pages` pages for heads [0, kHeads): see score_page. When abs_out is non-null,
/// abs_out[p] receives Σ|summary| and empty_out[p] whether the box is empty (no key was
/// summarised). That test reads the box right after it was scored: run first in a loop of its
/// own, it took the DRAM misses of every box one after another (a fifth of the scan).
template <class V, index_t kHeads, index_t kAcc>
KVPACK_QUEST_INLINE void score_tile(const float* prepared, index_t stride, index_t head_dim,
                                    const float* const* summaries, std::size_t pages, float* bounds /*[kHeads][pages]*/,
                                    float* abs_out, bool* empty_out) noexcept {
  const std::size_t box_floats = 2 * static_cast<std::size_t>(head_dim);
  for (std::size_t p = 0; p < std::min(kBoxesAhead, pages); ++p) request_box(summaries[p], box_floats);
  for (std::size_t p = 0; p < pages; ++p) {
    if (p + kBoxesAhead < pages) request_box(summaries[p + kBoxesAhead], box_floats);
    const float* summary = summaries[p];
    if (abs_out != nullptr) {
      score_page<V, kHeads, kAcc, true>(prepared, stride, head_dim, summary, bounds + p, pages, abs_out + p);
      empty_out[p] = summary[0] > summary[head_dim];  // a NaN box is not empty: its bound is NaN, read
    } else {
      score_page<V, kHeads, kAcc, false>(prepared, stride, head_dim, summary, bounds + p, pages, nullptr);
    }
  }
}

/// The bounds of `pages` pages for `group` heads (group <= kMaxGroup, head_dim <= kMaxHeadDim):
/// see group_page_bounds. head_bounds may be null.
template <class V, index_t kAcc>
KVPACK_QUEST_INLINE void page_bounds_body(const float* queries, index_t group, index_t head_dim,
                                          const float* const* summaries, std::size_t pages, float* head_bounds,
                                          float* page_bounds, GroupBound how) noexcept {
  const index_t blocks = (2 * head_dim + kLanes - 1) / kLanes;
  const index_t stride = blocks * kLanes;
  const index_t heads_per_pass = std::max<index_t>(1, std::min<index_t>(group, kPreparedFloats / stride));
  constexpr std::size_t kChunk = 256;  // pages per pass over the tiles: their summaries stay in L2
  float prepared[kPreparedFloats];     // [heads_per_pass][stride] split queries, 16 KiB
  float bounds[kHeadTile * kChunk];    // [kHeadTile][chunk] per-head bounds of a chunk of pages
  float summary_abs[kChunk];           // [chunk] Σ|summary|
  bool empty[kChunk];                  // [chunk] pages whose box is empty (no key was summarised)
  float query_max[kMaxGroup];          // max_c |q_c| per head
  const float allowance = bound_rounding(head_dim);
  for (index_t h = 0; h < group; ++h) {
    float m = 0.0f;
    for (index_t c = 0; c < head_dim; ++c) m = std::max(m, std::fabs(queries[static_cast<std::size_t>(h) * head_dim + c]));
    query_max[h] = m;
  }
  for (std::size_t first = 0; first < pages; first += kChunk) {
    const std::size_t count = std::min(kChunk, pages - first);
    for (std::size_t p = 0; p < count; ++p) {
      page_bounds[first + p] = how == GroupBound::kMax ? -std::numeric_limits<float>::infinity() : 0.0f;
    }
    for (index_t pass = 0; pass < group; pass += heads_per_pass) {
      const index_t pass_heads = std::min(heads_per_pass, group - pass);
      // With one pass (every head fits), the split queries of the first chunk serve them all.
      const bool prepared_already = first > 0 && heads_per_pass >= group;
      for (index_t h = 0; h < pass_heads && !prepared_already; ++h) {
        const float* q = queries + static_cast<std::size_t>(pass + h) * head_dim;
        float* row = prepared + static_cast<std::size_t>(h) * stride;
        for (index_t c = 0; c < head_dim; ++c) {
          row[c] = std::min(q[c], 0.0f);
          row[head_dim + c] = std::max(q[c], 0.0f);
        }
        for (index_t c = 2 * head_dim; c < stride; ++c) row[c] = 0.0f;
      }
      for (index_t tile = 0; tile < pass_heads; tile += kHeadTile) {
        const index_t tile_heads = std::min(kHeadTile, pass_heads - tile);
        const float* tile_queries = prepared + static_cast<std::size_t>(tile) * stride;
        float* abs_out = pass == 0 && tile == 0 ? summary_abs : nullptr;
        const float* const* chunk = summaries + first;
        switch (tile_heads) {
          case 4: score_tile<V, 4, kAcc>(tile_queries, stride, head_dim, chunk, count, bounds, abs_out, empty); break;
          case 3: score_tile<V, 3, kAcc>(tile_queries, stride, head_dim, chunk, count, bounds, abs_out, empty); break;
          case 2: score_tile<V, 2, kAcc>(tile_queries, stride, head_dim, chunk, count, bounds, abs_out, empty); break;
          default: score_tile<V, 1, kAcc>(tile_queries, stride, head_dim, chunk, count, bounds, abs_out, empty); break;
        }
        for (index_t h = 0; h < tile_heads; ++h) {
          const index_t head = pass + tile + h;
          for (std::size_t p = 0; p < count; ++p) {
            float u = bounds[static_cast<std::size_t>(h) * count + p] + allowance * query_max[head] * summary_abs[p];
            if (empty[p]) u = -std::numeric_limits<float>::infinity();
            if (head_bounds != nullptr) head_bounds[static_cast<std::size_t>(head) * pages + first + p] = u;
            float& out = page_bounds[first + p];
            // std::max would drop a NaN bound; NaN ranks as +inf (ranks_before): the page is read.
            if (how == GroupBound::kMean) {
              out += u;
            } else if (std::isnan(u) || u > out) {
              out = u;
            }
          }
        }
      }
    }
    if (how == GroupBound::kMean) {
      for (std::size_t p = 0; p < count; ++p) page_bounds[first + p] /= static_cast<float>(group);
    }
  }
}

using PageBoundsFunction = void (*)(const float*, index_t, index_t, const float* const*, std::size_t, float*,
                                    float*, GroupBound) noexcept;

inline void page_bounds_default(const float* queries, index_t group, index_t head_dim, const float* const* summaries,
                                std::size_t pages, float* head_bounds, float* page_bounds, GroupBound how) noexcept {
  page_bounds_body<Vec8, 1>(queries, group, head_dim, summaries, pages, head_bounds, page_bounds, how);
}

#if defined(__GNUC__) && defined(__x86_64__) && defined(KVPACK_HAS_CPU_DISPATCH) && KVPACK_HAS_CPU_DISPATCH
#define KVPACK_QUEST_TARGETS 1
[[gnu::target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")]] inline void page_bounds_avx512(
    const float* queries, index_t group, index_t head_dim, const float* const* summaries, std::size_t pages,
    float* head_bounds, float* page_bounds, GroupBound how) noexcept {
  page_bounds_body<Vec16, 2>(queries, group, head_dim, summaries, pages, head_bounds, page_bounds, how);
}
[[gnu::target("avx2,fma")]] inline void page_bounds_avx2(const float* queries, index_t group, index_t head_dim,
                                                         const float* const* summaries, std::size_t pages,
                                                         float* head_bounds, float* page_bounds,
                                                         GroupBound how) noexcept {
  page_bounds_body<Vec8, 1>(queries, group, head_dim, summaries, pages, head_bounds, page_bounds, how);
}
#else
#define KVPACK_QUEST_TARGETS 0
#endif

/// The variant this process runs, chosen once: the attention kernels' ISA with the dispatch
/// library, the including file's flags without it.
inline PageBoundsFunction page_bounds_function() {
  static const PageBoundsFunction chosen = []() -> PageBoundsFunction {
#if KVPACK_QUEST_TARGETS
    const std::string_view isa = kernels::cpu::selected_isa();
    if (isa == "avx512") return &page_bounds_avx512;
    if (isa == "avx2") return &page_bounds_avx2;
#endif
    return &page_bounds_default;
  }();
  return chosen;
}

/// Calls visit(name, function) for every variant this CPU runs (tests check each one).
template <class Visitor>
void for_each_page_bounds_variant(Visitor&& visit) {
#if KVPACK_QUEST_TARGETS
  if (kernels::cpu::cpu_supports<xsimd::avx512bw>()) visit("avx512", &page_bounds_avx512);
  if (kernels::cpu::cpu_supports<xsimd::fma3<xsimd::avx2>>()) visit("avx2", &page_bounds_avx2);
#endif
  visit("default", &page_bounds_default);
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

#undef KVPACK_QUEST_INLINE
#undef KVPACK_QUEST_TARGETS

/// The upper bound of q·k over every key k of the page's summary box:
/// U = Σ_c max(q_c·min_c, q_c·max_c), plus an allowance for the float rounding of computing it
/// (about 2^-19·max_c|q_c|·Σ_c(|min_c| + |max_c|) for head_dim 128), so U >= q·k holds in exact
/// arithmetic for every key that was summarised. -inf for an empty summary. The same code as
/// group_page_bounds, so both give the same bits on one machine (FMA or not: the last bits may
/// differ between instruction sets; every one is certified).
/// \param query [head_dim], the softmax scale already applied (then U bounds the scaled score)
/// \throws kvpack::Error (kUnsupported) when head_dim exceeds 2048 (1024 with min and max apart),
///         or on the first call when KVPACK_ISA names a target this CPU lacks
[[nodiscard]] inline float page_upper_bound(const float* query, const float* min /*[head_dim]*/,
                                            const float* max /*[head_dim]*/, index_t head_dim) {
  if (head_dim <= 0) return 0.0f;
  KVPACK_CHECK(head_dim <= detail::kMaxHeadDim, kUnsupported,
               kvpack::detail::message("page_upper_bound: head_dim ", head_dim, " exceeds ", detail::kMaxHeadDim));
  const float* summary[1] = {min};
  float bound = 0.0f;
  if (max == min + head_dim) {
    detail::page_bounds_function()(query, 1, head_dim, summary, 1, nullptr, &bound, GroupBound::kMax);
    return bound;
  }
  // Rows apart: the [2][head_dim] layout group_page_bounds reads, on the stack when small.
  constexpr index_t kStackDim = 1024;
  KVPACK_CHECK(head_dim <= kStackDim, kUnsupported,
               kvpack::detail::message("page_upper_bound: head_dim ", head_dim, " with separate min and max rows "
                                       "exceeds ", kStackDim, "; pass a [2][head_dim] summary"));
  float joined[2 * kStackDim];
  std::copy_n(min, head_dim, joined);
  std::copy_n(max, head_dim, joined + head_dim);
  summary[0] = joined;
  detail::page_bounds_function()(query, 1, head_dim, summary, 1, nullptr, &bound, GroupBound::kMax);
  return bound;
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
  KVPACK_CHECK(group <= detail::kMaxGroup && head_dim <= detail::kMaxHeadDim, kUnsupported,
               kvpack::detail::message("group_page_bounds: group ", group, " or head_dim ", head_dim, " exceeds ",
                                       detail::kMaxGroup, " or ", detail::kMaxHeadDim));
  detail::page_bounds_function()(queries.data(), group, head_dim, summaries.data(), pages,
                                 head_bounds.empty() ? nullptr : head_bounds.data(), page_bounds.data(), how);
}

/// The k pages with the largest bounds (ties: lower page index first; NaN counts as +inf),
/// written to out[0, min(k, n)) in increasing page order so attention reads them in token order.
/// Deterministic and allocation-free. With room for all n indices in `out` (the cache's case) it
/// selects in O(n) on average (nth_element, then a sort of the k kept); with less, a heap of k in
/// O(n log k). Returns min(k, n).
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
  // ranks_before is a strict total order (ties broken by index), so both paths keep the same set.
  const auto ranks_before = [&](index_t a, index_t b) { return detail::ranks_before(bounds, a, b); };
  const auto first = out.begin();
  const auto last = out.begin() + count;
  if (out.size() >= static_cast<std::size_t>(n)) {
    for (index_t i = count; i < n; ++i) out[i] = i;
    std::nth_element(first, last, out.begin() + n, ranks_before);
  } else {
    // A heap of the best `count` so far with the worst on top: a page replaces it when it ranks before it.
    std::make_heap(first, last, ranks_before);
    for (index_t i = count; i < n; ++i) {
      if (ranks_before(i, out[0])) {
        std::pop_heap(first, last, ranks_before);
        *(last - 1) = i;
        std::push_heap(first, last, ranks_before);
      }
    }
  }
  std::sort(first, last);
  return count;
}

}  // namespace kvpack::inline v0::select
