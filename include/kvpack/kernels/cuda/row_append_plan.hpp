#pragma once
/// \file row_append_plan.hpp
/// \brief How a device layer takes new tokens without the host touching their rows: the copies
///        and page encodes that append `count` rows to one stream, following KVCache's rule
///        (`write_tokens`): the layer's first exact_prefix_tokens rows stay fp32 for good; after
///        them the full-precision tail grows, and once it holds tail_tokens + page_size rows its
///        oldest rows are encoded as whole pages. Host-clean: DeviceLayer runs the steps with
///        cudaMemcpy2DAsync and encode_pages; the CI suite runs them on host memory and compares
///        the result with a KVCache's pages and rows.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kvpack/core/types.hpp"
#include "kvpack/error.hpp"

namespace kvpack::inline v0::kernels::cuda {

/// Where a step's rows are: the stream's fp32 rows (exact prefix from row 0, tail after it), the
/// rows being appended, or one page of scratch for the page that straddles the two.
enum class RowBuffer : std::uint8_t { kStored, kInput, kScratch };

/// One step, run in order: copy `count` rows, or encode `count` pages from consecutive rows (the
/// stream's next pages, in token order).
struct RowStep {
  enum class Kind : std::uint8_t { kCopy, kEncode };
  Kind kind = Kind::kCopy;
  RowBuffer from = RowBuffer::kInput;
  index_t from_row = 0;
  RowBuffer to = RowBuffer::kStored;  ///< kCopy only
  index_t to_row = 0;                 ///< kCopy only
  index_t count = 0;
};

/// The rows a stream keeps in fp32 as tokens arrive (CacheConfig's fields of the same names).
struct TailWindow {
  index_t exact_prefix_tokens = 0;
  index_t tail_tokens = 0;
};

/// The cache options the rule reads: the page size and the fp32 window.
struct RowRule {
  index_t page_size = 0;
  TailWindow window;
};

/// A stream's fp32 rows: the exact prefix's, then the tail's.
struct StoredRows {
  index_t prefix = 0;
  index_t tail = 0;
  [[nodiscard]] index_t total() const noexcept { return prefix + tail; }
  friend bool operator==(const StoredRows&, const StoredRows&) = default;
};

struct RowAppendPlan {
  std::vector<RowStep> steps;
  StoredRows after;
  index_t new_pages = 0;
  index_t stored_rows_needed = 0;  ///< rows the stored buffer must hold while the steps run
};

/// The steps that append `count` rows to a stream holding `before`. No two rows of one copy
/// overlap (a shift of the tail is cut into chunks no longer than its distance), so each copy is
/// one cudaMemcpy2DAsync.
/// \throws kvpack::Error(kInvalidArgument) for a negative count, a rule without a page size, or
///         tail rows before the exact prefix is complete
[[nodiscard]] inline RowAppendPlan plan_row_append(StoredRows before, index_t count, const RowRule& rule) {
  const TailWindow& window = rule.window;
  KVPACK_CHECK(count >= 0 && rule.page_size > 0 && window.exact_prefix_tokens >= 0 && window.tail_tokens >= 0,
               kInvalidArgument, "plan_row_append: negative count or rule, or no page size");
  KVPACK_CHECK(before.prefix >= 0 && before.tail >= 0 && before.prefix <= window.exact_prefix_tokens &&
                   (before.tail == 0 || before.prefix == window.exact_prefix_tokens),
               kInvalidArgument, "plan_row_append: tail rows before a complete exact prefix");
  RowAppendPlan plan;
  auto copy = [&](RowBuffer from, index_t from_row, RowBuffer to, index_t to_row, index_t rows) {
    if (rows == 0) return;
    plan.steps.push_back({RowStep::Kind::kCopy, from, from_row, to, to_row, rows});
    if (to == RowBuffer::kStored) plan.stored_rows_needed = std::max(plan.stored_rows_needed, to_row + rows);
  };
  auto encode = [&](RowBuffer from, index_t from_row, index_t pages) {
    if (pages > 0) plan.steps.push_back({RowStep::Kind::kEncode, from, from_row, RowBuffer::kStored, 0, pages});
  };
  plan.stored_rows_needed = before.total();

  // The first rows of a layer fill the exact prefix.
  const index_t pinned = std::min(window.exact_prefix_tokens - before.prefix, count);
  copy(RowBuffer::kInput, 0, RowBuffer::kStored, before.prefix, pinned);
  const index_t prefix = before.prefix + pinned;
  index_t input = pinned;  // the next input row not yet placed
  const index_t tail = before.tail;
  const index_t total = tail + count - pinned;
  const index_t page = rule.page_size;
  plan.new_pages = total >= window.tail_tokens + page ? (total - window.tail_tokens) / page : 0;

  // The oldest new_pages · page rows of [tail..., input...] become pages: those wholly in the
  // tail straight from it, the one across both through scratch, the rest straight from the input.
  const index_t encoded = plan.new_pages * page;
  const index_t from_tail = std::min(tail, encoded);
  const index_t tail_pages = from_tail / page;
  encode(RowBuffer::kStored, prefix, tail_pages);
  const index_t straddling = from_tail % page;
  if (straddling > 0) {
    copy(RowBuffer::kStored, prefix + tail_pages * page, RowBuffer::kScratch, 0, straddling);
    copy(RowBuffer::kInput, input, RowBuffer::kScratch, straddling, page - straddling);
    encode(RowBuffer::kScratch, 0, 1);
    input += page - straddling;
  }
  const index_t input_pages = plan.new_pages - tail_pages - (straddling > 0 ? 1 : 0);
  encode(RowBuffer::kInput, input, input_pages);
  input += input_pages * page;

  // The tail rows left move down to the prefix's end, in chunks that do not overlap.
  const index_t kept = tail - from_tail;
  for (index_t moved = 0; moved < kept && from_tail > 0; moved += from_tail) {
    copy(RowBuffer::kStored, prefix + from_tail + moved, RowBuffer::kStored, prefix + moved,
         std::min(from_tail, kept - moved));
  }
  copy(RowBuffer::kInput, input, RowBuffer::kStored, prefix + kept, count - input);
  plan.after = {prefix, kept + count - input};
  return plan;
}

}  // namespace kvpack::inline v0::kernels::cuda
