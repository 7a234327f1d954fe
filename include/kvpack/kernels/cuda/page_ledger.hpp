#pragma once
/// \file page_ledger.hpp
/// \brief The bookkeeping of a device page pool: which of its fixed number of pages are free,
///        and how many holders each page in use has. A fork's layers hold their parent's pages
///        too (pages are immutable once encoded); a page is free again when its last holder lets
///        it go. Host-clean, so the CI suite tests it without a GPU; DevicePagePool keeps one
///        beside its arena.

#include <cstddef>
#include <cstdint>
#include <limits>
#include <mutex>
#include <vector>

#include "kvpack/core/types.hpp"
#include "kvpack/error.hpp"

namespace kvpack::inline v0::kernels::cuda {

/// Thread-safe. A page released more often than it was taken or retained is a bug in the
/// caller: the ledger throws rather than hand that page out twice.
class PageLedger {
 public:
  explicit PageLedger(std::size_t capacity) : holders_(checked(capacity), 0) {
    free_.reserve(capacity);
    for (std::size_t i = capacity; i-- > 0;) free_.push_back(static_cast<PageId>(i));
  }

  [[nodiscard]] std::size_t capacity() const noexcept { return holders_.size(); }
  [[nodiscard]] std::size_t pages_in_use() const {
    std::lock_guard lock(mutex_);
    return holders_.size() - free_.size();
  }

  /// A free page, with one holder (lowest ids first); throws kvpack::OutOfPages when none is left.
  [[nodiscard]] PageId allocate() {
    std::lock_guard lock(mutex_);
    KVPACK_CHECK(!free_.empty(), kOutOfPages,
                 ::kvpack::detail::message("device page pool exhausted: all ", holders_.size(), " pages in use"));
    const PageId id = free_.back();
    free_.pop_back();
    holders_[id] = 1;
    return id;
  }

  /// One more holder of a page in use (a fork sharing it).
  void retain(PageId id) {
    std::lock_guard lock(mutex_);
    held(id, "retain");
    ++holders_[id];
  }

  /// One holder fewer; the page is free again when it was the last. Returns whether it was.
  bool release(PageId id) {
    std::lock_guard lock(mutex_);
    held(id, "release");
    if (--holders_[id] > 0) return false;
    free_.push_back(id);
    return true;
  }

  /// Holders of page `id`: 0 while it is free.
  [[nodiscard]] std::uint32_t holders(PageId id) const {
    std::lock_guard lock(mutex_);
    KVPACK_CHECK(id < holders_.size(), kInvalidArgument,
                 ::kvpack::detail::message("device page ", id, " is outside the pool of ", holders_.size()));
    return holders_[id];
  }

 private:
  static constexpr std::size_t kMaxPages = std::numeric_limits<PageId>::max();

  static std::size_t checked(std::size_t capacity) {
    KVPACK_CHECK(capacity > 0 && capacity <= kMaxPages, kInvalidConfig,
                 ::kvpack::detail::message("device page pool: capacity must be in [1, ", kMaxPages, "], got ",
                                           capacity));
    return capacity;
  }
  /// Throws unless `id` is a page of the pool with a holder.
  void held(PageId id, const char* call) const {
    KVPACK_CHECK(id < holders_.size() && holders_[id] > 0, kInvalidArgument,
                 ::kvpack::detail::message("device page pool ", call, ": page ", id,
                                           id < holders_.size() ? " is free" : " is outside the pool"));
  }

  mutable std::mutex mutex_;
  std::vector<std::uint32_t> holders_;  // per page; 0 when free
  std::vector<PageId> free_;            // free pages, the next one handed out last
};

}  // namespace kvpack::inline v0::kernels::cuda
