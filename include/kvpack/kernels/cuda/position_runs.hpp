#pragma once
/// \file position_runs.hpp
/// \brief The positions a device cache's layer holds, in token order, kept on the host as runs
///        of consecutive positions: a decode's positions follow each other, so a sequence costs
///        16 bytes per gap in its positions rather than four per token. Host-clean (tested in CI).

#include <cstdint>
#include <vector>

namespace kvpack::inline v0::kernels::cuda {

class PositionRuns {
 public:
  /// Makes room for one more run, so that the next `add` cannot throw (doubling when full).
  void reserve() {
    if (runs_.size() == runs_.capacity()) runs_.reserve(2 * runs_.size() + 1);
  }
  /// Appends positions first, first + 1, ..., first + count - 1 (nothing when count <= 0).
  void add(std::int64_t first, std::int64_t count) {
    if (count <= 0) return;
    if (!runs_.empty() && runs_.back().first + runs_.back().count == first) {
      runs_.back().count += count;
    } else {
      runs_.push_back({first, count});
    }
  }
  /// The last position, -1 while there is none.
  [[nodiscard]] std::int64_t last() const noexcept {
    return runs_.empty() ? -1 : runs_.back().first + runs_.back().count - 1;
  }
  /// How many positions it holds.
  [[nodiscard]] std::int64_t size() const noexcept {
    std::int64_t total = 0;
    for (const Run& run : runs_) total += run.count;
    return total;
  }
  /// Every position, in order.
  [[nodiscard]] std::vector<std::int32_t> expand() const {
    std::vector<std::int32_t> positions;
    positions.reserve(static_cast<std::size_t>(size()));
    for (const Run& run : runs_) {
      for (std::int64_t p = run.first; p < run.first + run.count; ++p) {
        positions.push_back(static_cast<std::int32_t>(p));
      }
    }
    return positions;
  }
  /// How many tokens from the first hold positions 0, 1, 2, …: those a prefix cache may share.
  [[nodiscard]] std::int64_t counted_from_zero() const noexcept {
    return !runs_.empty() && runs_.front().first == 0 ? runs_.front().count : 0;
  }
  /// Runs kept (one per gap, plus one).
  [[nodiscard]] std::size_t runs() const noexcept { return runs_.size(); }

 private:
  struct Run {
    std::int64_t first, count;
  };
  std::vector<Run> runs_;
};

}  // namespace kvpack::inline v0::kernels::cuda
