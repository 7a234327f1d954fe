#pragma once
/// \file prefetch.hpp
/// \brief Software prefetch of pages ahead of the ones being scored, spread over the inner loop.
///
/// A compute-heavy page loop starves the hardware prefetcher, so the key kernels request the
/// payload of pages ~32 KiB ahead themselves (DESIGN.md §4). They issue those requests a few
/// cache lines per inner-loop step: a burst of hundreds of prefetches stalls once the miss queue
/// is full, while the same requests spread over the loop overlap with its arithmetic. Where the
/// value pass is long (cpu::kValueKernelPrefetches), the requests are split by plane: the key
/// kernel requests key planes, the value kernel value planes, so memory works through both.
///
/// Requests go to L2 (`prefetcht1`): an L1 request holds one of the core's few fill buffers until
/// its line arrives, which most likely capped the kernels below the stream rate on the Intel host
/// (fp16 at 32K: 15.6 ms to L1, 13.4 ms to L2; README "Prefetch by plane and to L2").

#include <cstddef>

#include "kvpack/config.hpp"
#include "kvpack/kernels/kernel_args.hpp"

namespace kvpack::inline v0::kernels::cpu {

/// A software prefetch of one cache line into L2 (see above).
struct RequestToL2 {
  KVPACK_ALWAYS_INLINE void operator()(const std::byte* line) const noexcept { __builtin_prefetch(line, 0, 2); }
};

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
  /// For a key kernel (`plane` kKey) the whole payloads, or only their key planes when
  /// run.planes_apart; for a value kernel the value planes when run.planes_apart, else nothing.
  PagePrefetcher(const PageRun& run, index_t first, index_t count, index_t steps, Plane plane = Plane::kKey) noexcept
      : pages_(run.pages) {
    if (plane == Plane::kValue && !run.planes_apart) return;
    offset_ = plane == Plane::kValue ? run.value_offset : 0;
    bytes_ = !run.planes_apart ? run.payload_bytes : plane == Plane::kKey ? run.value_offset
                                                                          : run.payload_bytes - run.value_offset;
    page_ = first + distance(bytes_, count);
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

  /// Requests the next few lines (`request(line)`; tests pass their own to see them); a no-op
  /// once every page is requested. A step may run a few lines past the end of a plane:
  /// prefetches never fault, and the next page starts afresh.
  template <class Request = RequestToL2>
  KVPACK_ALWAYS_INLINE void step(Request request = {}) noexcept {
    if (next_ == nullptr) return;
    for (int i = 0; i < lines_per_step_; ++i) request(next_ + 64 * i);
    next_ += stride_;
    if (next_ >= page_end_) next_page();
  }

  /// Requests every line not requested yet: for a path that leaves the loop the steps were
  /// counted for (a kernel's fp32 fallback).
  template <class Request = RequestToL2>
  void finish(Request request = {}) noexcept {
    while (next_ != nullptr) step(request);
  }

 private:
  void start_page() noexcept {
    next_ = pages_[page_] + offset_;
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
  std::size_t offset_ = 0;
  std::size_t bytes_ = 0;
  index_t page_ = 0;
  index_t end_page_ = 0;
  const std::byte* next_ = nullptr;
  const std::byte* page_end_ = nullptr;
  std::size_t stride_ = 0;
  int lines_per_step_ = 0;
};

}  // namespace kvpack::inline v0::kernels::cpu
