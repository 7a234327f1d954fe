#pragma once
/// \file page_references.hpp
/// \brief What a PrefixIndex needs of the pool its pages live in: a reference more or fewer on a
///        page, how many a page has, and how many bytes a page takes. Type-erased, so that one
///        index serves the host PagePool and the device's pool (kernels/cuda/device_memory.cuh)
///        alike; the index calls it on insert and eviction only, never on a decode step.

#include <concepts>
#include <cstddef>
#include <cstdint>

#include "kvpack/core/types.hpp"

namespace kvpack::inline v0::paging {

/// A pool whose pages carry reference counts: PagePool, kernels::cuda::DevicePagePool. The counts
/// never throw: PrefixIndex changes them only after everything that can fail (a pool may end the
/// program on misuse, a page taken or counted while free).
template <class Pool>
concept ReferenceCountedPool = requires(Pool& pool, const Pool& constant, PageId id) {
  { pool.retain(id) } noexcept;
  { pool.release(id) } noexcept;
  { constant.ref_count(id) } noexcept -> std::convertible_to<std::uint32_t>;
  { constant.format().payload_bytes } -> std::convertible_to<std::size_t>;
  { constant.format().metadata_bytes } -> std::convertible_to<std::size_t>;
};

/// A reference to such a pool. The pool must outlive it.
class PageReferences {
 public:
  template <ReferenceCountedPool Pool>
  explicit PageReferences(Pool& pool) noexcept
      : pool_(&pool),
        retain_([](void* p, PageId id) noexcept { static_cast<Pool*>(p)->retain(id); }),
        release_([](void* p, PageId id) noexcept { static_cast<Pool*>(p)->release(id); }),
        ref_count_([](const void* p, PageId id) noexcept -> std::uint32_t {
          return static_cast<const Pool*>(p)->ref_count(id);
        }),
        page_bytes_(pool.format().payload_bytes + pool.format().metadata_bytes) {}

  void retain(PageId id) const noexcept { retain_(pool_, id); }
  void release(PageId id) const noexcept { release_(pool_, id); }
  [[nodiscard]] std::uint32_t ref_count(PageId id) const noexcept { return ref_count_(pool_, id); }
  /// Payload and metadata bytes of one page.
  [[nodiscard]] std::size_t page_bytes() const noexcept { return page_bytes_; }

 private:
  void* pool_;
  void (*retain_)(void*, PageId) noexcept;
  void (*release_)(void*, PageId) noexcept;
  std::uint32_t (*ref_count_)(const void*, PageId) noexcept;
  std::size_t page_bytes_;
};

}  // namespace kvpack::inline v0::paging
