#pragma once
/// \file prefetch.hpp
/// \brief Software prefetch of pages ahead of the one being scored, spread over the inner loop.
///
/// A compute-heavy page loop starves the hardware prefetcher, so the key kernels request the
/// payload of a page ~32 KiB ahead themselves (DESIGN.md §4). They issue those requests a few
/// cache lines per inner-loop step: a burst of hundreds of prefetches stalls once the miss queue
/// is full, while the same requests spread over the loop overlap with its arithmetic.

#include <cstddef>

#include "kvpack/config.hpp"
#include "kvpack/kernels/kernel_args.hpp"

namespace kvpack::inline v0::kernels::cpu {

class PagePrefetcher {
 public:
  /// Pages ahead of the current one whose bytes are requested: ~32 KiB in flight.
  static index_t distance(std::size_t payload_bytes) noexcept {
    const std::size_t pages = (std::size_t{32} << 10) / (payload_bytes == 0 ? 1 : payload_bytes);
    return static_cast<index_t>(pages < 1 ? 1 : (pages > 16 ? 16 : pages));
  }

  /// Prepares the requests for the page `distance` after page `page` of `run` (none when the run
  /// ends before it), to be issued over `steps` calls of step().
  PagePrefetcher(const PageRun& run, index_t page, index_t steps) noexcept {
    const index_t ahead = page + distance(run.payload_bytes);
    if (ahead >= run.count + run.prefetch) return;
    next_ = run.pages[ahead];
    end_ = next_ + run.payload_bytes;
    const std::size_t lines = (run.payload_bytes + 63) / 64;
    const std::size_t per_step = (lines + static_cast<std::size_t>(steps) - 1) / static_cast<std::size_t>(steps < 1 ? 1 : steps);
    stride_ = per_step * 64;
    lines_per_step_ = static_cast<int>(per_step);
  }

  /// Requests the next few lines; a no-op once the page is fully requested.
  KVPACK_ALWAYS_INLINE void step() noexcept {
    if (next_ >= end_) return;
    for (int i = 0; i < lines_per_step_; ++i) __builtin_prefetch(next_ + 64 * i, 0, 3);
    next_ += stride_;
  }

 private:
  const std::byte* next_ = nullptr;
  const std::byte* end_ = nullptr;
  std::size_t stride_ = 0;
  int lines_per_step_ = 0;
};

}  // namespace kvpack::inline v0::kernels::cpu
