#pragma once
/// \file prefetch.hpp
/// \brief Software prefetch of pages ahead of the ones being scored, spread over the inner loop.
///
/// A compute-heavy page loop starves the hardware prefetcher, so the key kernels request the
/// payload of pages ~32 KiB ahead themselves (DESIGN.md §4). They issue those requests a few
/// cache lines per inner-loop step: a burst of hundreds of prefetches stalls once the miss queue
/// is full, while the same requests spread over the loop overlap with its arithmetic.

#include <cstddef>

#include "kvpack/config.hpp"
#include "kvpack/kernels/kernel_args.hpp"

namespace kvpack::inline v0::kernels::cpu {

class PagePrefetcher {
 public:
  /// Pages ahead of the current batch of `batch` pages whose bytes are requested: ~32 KiB in
  /// flight, and at least one batch beyond the one being computed.
  static index_t distance(std::size_t payload_bytes, index_t batch) noexcept {
    const std::size_t pages = (std::size_t{32} << 10) / (payload_bytes == 0 ? 1 : payload_bytes);
    const index_t d = static_cast<index_t>(pages < 1 ? 1 : (pages > 16 ? 16 : pages));
    return d > 2 * batch ? d : 2 * batch;
  }

  /// Prepares requests for the `count` pages that come `distance` after page `first` of `run`
  /// (fewer when the run ends first), to be issued over `steps` calls of step(). Consecutive
  /// batches of `count` pages request consecutive ranges, so every page is requested once.
  PagePrefetcher(const PageRun& run, index_t first, index_t count, index_t steps) noexcept
      : pages_(run.pages), bytes_(run.payload_bytes) {
    page_ = first + distance(run.payload_bytes, count);
    end_page_ = page_ + count;
    const index_t available = run.count + run.prefetch;
    if (end_page_ > available) end_page_ = available;
    if (page_ >= end_page_) return;
    const std::size_t lines = static_cast<std::size_t>(end_page_ - page_) * ((bytes_ + 63) / 64);
    const std::size_t divisor = static_cast<std::size_t>(steps < 1 ? 1 : steps);
    lines_per_step_ = static_cast<int>((lines + divisor - 1) / divisor);
    stride_ = static_cast<std::size_t>(lines_per_step_) * 64;
    start_page();
  }

  /// Requests the next few lines; a no-op once every page is requested. A step may run a few
  /// lines past the end of a page: prefetches never fault, and the next page starts afresh.
  KVPACK_ALWAYS_INLINE void step() noexcept {
    if (next_ == nullptr) return;
    for (int i = 0; i < lines_per_step_; ++i) __builtin_prefetch(next_ + 64 * i, 0, 3);
    next_ += stride_;
    if (next_ >= page_end_) next_page();
  }

 private:
  void start_page() noexcept {
    next_ = pages_[page_];
    page_end_ = next_ + bytes_;
  }
  void next_page() noexcept {
    if (++page_ < end_page_) {
      start_page();
    } else {
      next_ = nullptr;
    }
  }

  const std::byte* const* pages_;
  std::size_t bytes_;
  index_t page_ = 0;
  index_t end_page_ = 0;
  const std::byte* next_ = nullptr;
  const std::byte* page_end_ = nullptr;
  std::size_t stride_ = 0;
  int lines_per_step_ = 0;
};

}  // namespace kvpack::inline v0::kernels::cpu
