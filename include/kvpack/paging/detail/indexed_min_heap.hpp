#pragma once
/// \file indexed_min_heap.hpp
/// \brief A binary min-heap of small integer ids that knows where each id sits, so any id can be
///        removed in O(log n): the prefix index's LRU order over evictable pages.
///
/// Why not std::set: its nodes are allocated on every insert, and the index inserts when a lease
/// is dropped (from a destructor) and when eviction turns a parent into a leaf, where a
/// std::bad_alloc could not be reported. Here reserve() takes all the memory up front.

#include <cstddef>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace kvpack::inline v0::detail {

class IndexedMinHeap {
 public:
  static constexpr std::uint32_t kAbsent = std::numeric_limits<std::uint32_t>::max();

  /// Room for ids in [0, ids): may throw std::bad_alloc, leaving the heap as it was.
  void reserve(std::size_t ids) {
    if (ids <= position_.size()) return;
    heap_.reserve(ids);
    position_.resize(ids, kAbsent);
  }

  [[nodiscard]] bool contains(std::uint32_t id) const noexcept {
    return id < position_.size() && position_[id] != kAbsent;
  }
  [[nodiscard]] bool empty() const noexcept { return heap_.empty(); }
  [[nodiscard]] std::size_t size() const noexcept { return heap_.size(); }
  /// The least id by `less`; the heap must not be empty.
  [[nodiscard]] std::uint32_t top() const noexcept { return heap_.front(); }

  /// Adds an id (reserved, absent). `less(a, b)` orders ids; it must not change while they are in.
  template <class Less>
  void push(std::uint32_t id, Less&& less) noexcept {
    position_[id] = static_cast<std::uint32_t>(heap_.size());
    heap_.push_back(id);  // never reallocates: reserve() covered every id
    sift_up(heap_.size() - 1, less);
  }

  /// Removes an id that is present.
  template <class Less>
  void erase(std::uint32_t id, Less&& less) noexcept {
    const std::size_t at = position_[id];
    position_[id] = kAbsent;
    const std::uint32_t last = heap_.back();
    heap_.pop_back();
    if (last == id) return;
    heap_[at] = last;
    position_[last] = static_cast<std::uint32_t>(at);
    sift_up(at, less);
    sift_down(position_[last], less);
  }

  [[nodiscard]] std::size_t bytes() const noexcept {
    return (heap_.capacity() + position_.capacity()) * sizeof(std::uint32_t);
  }

 private:
  template <class Less>
  void sift_up(std::size_t at, Less& less) noexcept {
    while (at > 0) {
      const std::size_t parent = (at - 1) / 2;
      if (!less(heap_[at], heap_[parent])) break;
      swap_slots(at, parent);
      at = parent;
    }
  }

  template <class Less>
  void sift_down(std::size_t at, Less& less) noexcept {
    for (;;) {
      std::size_t least = at;
      const std::size_t left = 2 * at + 1;
      if (left < heap_.size() && less(heap_[left], heap_[least])) least = left;
      if (left + 1 < heap_.size() && less(heap_[left + 1], heap_[least])) least = left + 1;
      if (least == at) return;
      swap_slots(at, least);
      at = least;
    }
  }

  void swap_slots(std::size_t a, std::size_t b) noexcept {
    std::swap(heap_[a], heap_[b]);
    position_[heap_[a]] = static_cast<std::uint32_t>(a);
    position_[heap_[b]] = static_cast<std::uint32_t>(b);
  }

  std::vector<std::uint32_t> heap_;
  std::vector<std::uint32_t> position_;  // by id: its slot in heap_, or kAbsent
};

}  // namespace kvpack::inline v0::detail
