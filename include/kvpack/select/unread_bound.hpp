#pragma once
/// \file unread_bound.hpp
/// \brief A certified upper bound on the attention mass of the tokens a decode step did not read
///        (pages Quest skipped, slots an evictor dropped), from the pages' Quest summaries and
///        the online softmax of what was read (issue 6, "certified bound"): the detector for
///        "I skipped or dropped something this query may need".
///
/// Why it is an upper bound. Let S = Σ_unread e^{s_i − m} and Z = Z_read, so the unread mass is
/// S / (Z + S). (1) An unread token i of page p has s_i ≤ U_p, because its key lies in the
/// page's summary box and U_p is the maximum of q·k over that box; so S ≤ B = Σ_p n_p·e^{U_p − m}.
/// (2) S / (Z + S) is increasing in S (its derivative is Z / (Z + S)² ≥ 0), so mass ≤ B / (Z + B).
/// Output error: out_all = (1 − mass)·o_read + mass·o_unread, both convex combinations of value
/// rows, so ‖out_all − o_read‖ = mass·‖o_unread − o_read‖ ≤ 2·mass·max‖v‖.
///
/// What "certified" covers: exact arithmetic on the decoded keys (the summaries are of decoded
/// keys; quest.hpp's bounds include their own float rounding), and the m and Z_read the caller
/// passes. Z_read comes from a kernel with its own rounding; it is taken 2^-20 (relative) lower
/// here, which covers a few ulps of fp32 rounding in Z, not the worst case of a long fp32 sum
/// (n·2^-24 relative for n tokens) nor a kernel's approximate scores (an int8-quantized query
/// moves Z by its score error, which the kernel tests bound); a caller that needs those covered
/// passes Z_read lowered by its kernel's error bound.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <span>

#include "kvpack/core/types.hpp"
#include "kvpack/error.hpp"

namespace kvpack::inline v0::select {

/// The bound for one query head.
struct UnreadBound {
  double mass = 0.0;          ///< ≥ the softmax mass of the unread tokens, in [0, 1]
  double output_error = 0.0;  ///< ≥ ‖out over all tokens − out over the read ones‖₂
  /// Whether the unread tokens may hold more than `epsilon` of the attention.
  [[nodiscard]] bool fired(double epsilon) const noexcept { return mass > epsilon; }
};

/// Upper bound on the attention mass of the unread tokens of one query head.
/// \param page_bounds   [pages] U_p of every page with unread tokens (scaled scores, as
///                      group_page_bounds gives them); entries with a count of 0 are ignored
/// \param unread_counts [pages] n_p: tokens that lived in the page and were not read
/// \param running_max   m, the online softmax's maximum over the read scores (-inf: none read)
/// \param running_sum   Z_read = Σ_read e^{s_i − m}
/// \returns 0 when nothing is unread; 1 when nothing was read or a page with unread tokens has
///          no finite bound (NaN, ±inf): then nothing can be certified
/// \throws kvpack::Error (kInvalidArgument) when the spans differ in size or a count is negative
[[nodiscard]] inline double unread_mass_bound(std::span<const float> page_bounds,
                                              std::span<const index_t> unread_counts, float running_max,
                                              float running_sum) {
  KVPACK_CHECK(page_bounds.size() == unread_counts.size(), kInvalidArgument,
               kvpack::detail::message("unread_mass_bound: ", page_bounds.size(), " page bounds for ",
                               unread_counts.size(), " unread counts"));
  // log B = log Σ_p n_p·e^{U_p}, relative to its largest term so nothing overflows.
  double top = -std::numeric_limits<double>::infinity();
  bool any_unread = false;
  for (std::size_t p = 0; p < page_bounds.size(); ++p) {
    const index_t n = unread_counts[p];
    KVPACK_CHECK(n >= 0, kInvalidArgument,
                 kvpack::detail::message("unread_mass_bound: page ", p, " has a negative unread count (", n, ")"));
    if (n == 0) continue;
    any_unread = true;
    const float u = page_bounds[p];
    // No finite bound for a page that holds tokens (NaN, +inf, or the empty summary's -inf
    // contradicting n > 0): nothing can be certified.
    if (!std::isfinite(u)) return 1.0;
    top = std::max(top, static_cast<double>(u) + std::log(static_cast<double>(n)));
  }
  if (!any_unread) return 0.0;
  if (!(running_sum > 0.0f) || !std::isfinite(running_max)) return 1.0;  // nothing read
  double terms = 0.0;
  for (std::size_t p = 0; p < page_bounds.size(); ++p) {
    if (unread_counts[p] == 0) continue;
    terms += std::exp(static_cast<double>(page_bounds[p]) + std::log(static_cast<double>(unread_counts[p])) - top);
  }
  const double log_b = top + std::log(terms);
  const double z = static_cast<double>(running_sum) * (1.0 - 0x1p-20);
  const double log_z = static_cast<double>(running_max) + std::log(z);
  // B / (Z + B) = 1 / (1 + e^{log Z − log B}); the margin covers the rounding of exp and log
  // (a few ulps of the operands' magnitude).
  const double margin = 0x1p-40 * (1.0 + std::fabs(log_b) + std::fabs(log_z));
  const double x = log_z - log_b - margin;
  double mass = 1.0 / (1.0 + std::exp(x));
  // A positive mass too small for a double must not read as "nothing unread".
  if (mass == 0.0) mass = std::numeric_limits<double>::denorm_min();
  return std::min(mass, 1.0);
}

/// The bounds of the g query heads of one KV stream.
/// \param head_page_bounds [group][pages] U per head and page (group_page_bounds' head_bounds)
/// \param unread_counts    [pages]
/// \param running_max      [group], running_sum [group]: the online softmax of the read tokens
/// \param max_value_norm   an upper bound of ‖v‖₂ over every token, read or not
/// \param out              [group]
/// \throws kvpack::Error (kInvalidArgument) when a span's size does not match the shapes
inline void unread_bounds(std::span<const float> head_page_bounds, std::span<const index_t> unread_counts,
                          std::span<const float> running_max, std::span<const float> running_sum,
                          float max_value_norm, std::span<UnreadBound> out) {
  const std::size_t group = out.size();
  const std::size_t pages = unread_counts.size();
  KVPACK_CHECK(running_max.size() == group && running_sum.size() == group && head_page_bounds.size() == group * pages,
               kInvalidArgument,
               kvpack::detail::message("unread_bounds: for ", group, " heads and ", pages,
                               " pages, running_max and running_sum need ", group, " floats and head_page_bounds ",
                               group * pages, "; got ", running_max.size(), ", ", running_sum.size(), " and ",
                               head_page_bounds.size()));
  KVPACK_CHECK(max_value_norm >= 0.0f, kInvalidArgument,
               kvpack::detail::message("unread_bounds: max_value_norm ", max_value_norm, " must be >= 0"));
  for (std::size_t h = 0; h < group; ++h) {
    const double mass = unread_mass_bound(head_page_bounds.subspan(h * pages, pages), unread_counts,
                                          running_max[h], running_sum[h]);
    out[h] = {mass, 2.0 * mass * static_cast<double>(max_value_norm)};
  }
}

}  // namespace kvpack::inline v0::select
