#pragma once
/// \file page_pool.hpp
/// \brief A thread-safe pool of fixed-size KV pages with O(1) allocate/free, reference counts and
///        exact byte accounting.

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <span>
#include <vector>

#include "kvpack/core/types.hpp"
#include "kvpack/error.hpp"
#include "kvpack/paging/huge_pages.hpp"

namespace kvpack::inline v0::paging {

/// Byte sizes of one page. Every page has two regions: the payload (encoded K and V planes, read
/// by the attention kernels, 64-byte aligned so vector loads never split a cache line) and the slot
/// metadata (positions, live mask, selector summary), kept apart so the kernels' streaming read is
/// not diluted by bytes it does not need.
struct PageFormat {
  std::size_t payload_bytes = 0;   ///< stride of the payload region, a multiple of 64
  std::size_t metadata_bytes = 0;  ///< stride of the metadata region, a multiple of 8
};

/// Pages live in slabs that double in size (slab k holds base << k pages), so a pool can grow to
/// any capacity with at most 32 slab allocations, page addresses never move, and a page id maps to
/// its slab with two bit operations.
class PagePool {
 public:
  /// Pages a pool may hold when no capacity is configured: the whole PageId range.
  static constexpr std::size_t kUnlimited = std::numeric_limits<PageId>::max();

  /// \param format bytes per page (payload and metadata)
  /// \param capacity_pages the most pages this pool hands out at once; allocation beyond it throws
  ///        kvpack::OutOfPages
  PagePool(PageFormat format, std::size_t capacity_pages)
      : format_(format), capacity_(std::min(capacity_pages, kUnlimited)) {
    KVPACK_CHECK(format.payload_bytes > 0 && format.payload_bytes % kPayloadAlignment == 0,
                 kInvalidConfig,
                 detail::message("page payload size must be a positive multiple of 64, got ",
                                 format.payload_bytes));
    KVPACK_CHECK(format.metadata_bytes % 8 == 0, kInvalidConfig,
                 detail::message("page metadata size must be a multiple of 8, got ",
                                 format.metadata_bytes));
    KVPACK_CHECK(capacity_ > 0, kInvalidConfig, "page pool capacity must be at least one page");
    // First slab of about 256 KiB of payload, rounded down to a power of two of pages.
    const std::size_t wanted = std::max<std::size_t>(1, (256u << 10) / format.payload_bytes);
    base_log2_ = static_cast<unsigned>(std::bit_width(wanted) - 1);
  }

  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;

  [[nodiscard]] const PageFormat& format() const noexcept { return format_; }
  [[nodiscard]] std::size_t capacity() const noexcept { return capacity_; }

  /// Allocates `out.size()` pages, all or none: on failure no page is taken and kvpack::OutOfPages
  /// is thrown. New pages have reference count 1 and unspecified contents.
  void allocate(std::span<PageId> out) {
    std::lock_guard lock(mutex_);
    const std::size_t creatable = capacity_ - std::min(created_, capacity_);
    KVPACK_CHECK(out.size() <= free_list_.size() + creatable, kOutOfPages,
                 detail::message("page pool exhausted: ", out.size(), " pages requested, ",
                                 free_list_.size() + creatable, " available of ", capacity_,
                                 " (raise CacheConfig.max_pages or release sequences)"));
    while (free_list_.size() < out.size()) grow();  // may throw std::bad_alloc before any change
    for (PageId& id : out) {
      id = free_list_.back();
      free_list_.pop_back();
      ref_count_slot(id).store(1, std::memory_order_relaxed);
    }
    in_use_.fetch_add(out.size(), std::memory_order_relaxed);
  }

  /// Allocates one page; throws kvpack::OutOfPages when none is left.
  [[nodiscard]] PageId allocate_one() {
    PageId id = 0;
    allocate(std::span<PageId>(&id, 1));
    return id;
  }

  /// Adds a reference (a fork sharing the page).
  void retain(PageId id) noexcept { ref_count_slot(id).fetch_add(1, std::memory_order_relaxed); }

  /// Drops a reference; the page returns to the free list when the last one goes. Never throws:
  /// the free list's capacity always covers every page ever created.
  void release(PageId id) noexcept {
    if (ref_count_slot(id).fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    std::lock_guard lock(mutex_);
    free_list_.push_back(id);
    in_use_.fetch_sub(1, std::memory_order_relaxed);
  }

  /// Acquire: a holder that sees 1 may change the page in place, after the reads of every
  /// holder that released it.
  [[nodiscard]] std::uint32_t ref_count(PageId id) const noexcept {
    return ref_count_slot(id).load(std::memory_order_acquire);
  }

  /// Encoded K/V bytes of a page: `format().payload_bytes` bytes, 64-byte aligned.
  [[nodiscard]] std::byte* payload(PageId id) noexcept {
    const auto [slab, offset] = locate(id);
    return slabs_[slab].payload.get() + offset * format_.payload_bytes;
  }
  [[nodiscard]] const std::byte* payload(PageId id) const noexcept {
    return const_cast<PagePool*>(this)->payload(id);
  }

  /// Slot metadata of a page: `format().metadata_bytes` bytes, 8-byte aligned.
  [[nodiscard]] std::byte* metadata(PageId id) noexcept {
    const auto [slab, offset] = locate(id);
    return slabs_[slab].metadata.get() + offset * format_.metadata_bytes;
  }
  [[nodiscard]] const std::byte* metadata(PageId id) const noexcept {
    return const_cast<PagePool*>(this)->metadata(id);
  }

  /// Pages currently handed out (a shared page counts once).
  [[nodiscard]] std::size_t pages_in_use() const noexcept {
    return in_use_.load(std::memory_order_relaxed);
  }
  /// Pages the pool can still hand out before throwing OutOfPages.
  [[nodiscard]] std::size_t pages_available() const {
    std::lock_guard lock(mutex_);
    return free_list_.size() + (capacity_ - std::min(created_, capacity_));
  }
  /// Bytes of pages in use: payload and metadata regions.
  [[nodiscard]] std::size_t bytes_in_use() const noexcept {
    return pages_in_use() * (format_.payload_bytes + format_.metadata_bytes);
  }
  /// Bytes the pool has obtained from the allocator (slabs, reference counts and free list).
  [[nodiscard]] std::size_t bytes_reserved() const {
    std::lock_guard lock(mutex_);
    return created_ * (format_.payload_bytes + format_.metadata_bytes +
                       sizeof(std::atomic<std::uint32_t>)) +
           free_list_.capacity() * sizeof(PageId);
  }

 private:
  static constexpr std::size_t kPayloadAlignment = 64;

  struct AlignedDelete {
    void operator()(std::byte* p) const noexcept {
      ::operator delete[](p, std::align_val_t{kPayloadAlignment});
    }
  };
  struct Slab {
    std::unique_ptr<std::byte[], AlignedDelete> payload;
    std::unique_ptr<std::byte[]> metadata;
    std::unique_ptr<std::atomic<std::uint32_t>[]> ref_counts;
  };
  struct Location {
    std::size_t slab;
    std::size_t offset;
  };

  // Slab k starts at page (base << k) - base and holds base << k pages.
  [[nodiscard]] Location locate(PageId id) const noexcept {
    const std::size_t j = (static_cast<std::size_t>(id) >> base_log2_) + 1;
    const std::size_t slab = static_cast<std::size_t>(std::bit_width(j)) - 1;
    const std::size_t first = ((std::size_t{1} << slab) - 1) << base_log2_;
    return {slab, id - first};
  }

  [[nodiscard]] std::atomic<std::uint32_t>& ref_count_slot(PageId id) const noexcept {
    const auto [slab, offset] = locate(id);
    return slabs_[slab].ref_counts[offset];
  }

  // Adds the next slab (clipped to capacity) and pushes its pages on the free list, lowest id on
  // top. Called with the mutex held; all-or-nothing if an allocation throws.
  void grow() {
    const std::size_t k = slab_count_;
    const std::size_t pages = std::min(std::size_t{1} << (k + base_log2_), capacity_ - created_);
    Slab slab;
    slab.payload.reset(static_cast<std::byte*>(::operator new[](
        pages * format_.payload_bytes, std::align_val_t{kPayloadAlignment})));
    const std::size_t metadata_bytes = std::max<std::size_t>(1, pages * format_.metadata_bytes);
    slab.metadata.reset(new std::byte[metadata_bytes]);
    // Before the first touch, so that the memory faults in as huge pages where it can.
    advise_huge_pages(slab.payload.get(), pages * format_.payload_bytes);
    advise_huge_pages(slab.metadata.get(), metadata_bytes);
    std::fill_n(slab.metadata.get(), metadata_bytes, std::byte{0});
    slab.ref_counts = std::make_unique<std::atomic<std::uint32_t>[]>(pages);
    free_list_.reserve(created_ + pages);  // release() must never allocate
    slabs_[k] = std::move(slab);
    ++slab_count_;
    for (std::size_t i = pages; i-- > 0;) free_list_.push_back(static_cast<PageId>(created_ + i));
    created_ += pages;
  }

  PageFormat format_;
  std::size_t capacity_;
  unsigned base_log2_ = 0;

  mutable std::mutex mutex_;
  std::array<Slab, 33> slabs_{};  // fixed: readers never see the table move
  std::size_t slab_count_ = 0;
  std::size_t created_ = 0;       // pages in all slabs
  std::vector<PageId> free_list_;  // a stack of free page ids
  std::atomic<std::size_t> in_use_{0};
};

}  // namespace kvpack::inline v0::paging
