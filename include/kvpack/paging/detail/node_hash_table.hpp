#pragma once
/// \file node_hash_table.hpp
/// \brief An open-addressing set of node ids for the prefix index's child lookup: 4 bytes a
///        slot, linear probing, load at most 1/2, backward-shift deletion (no tombstones, so a
///        long-lived index that inserts and evicts forever keeps short probes).
///
/// The table stores only ids: the caller keeps each entry's 64-bit hash and decides equality
/// (the index compares parent and tokens), which is what lets equal hashes coexist safely.

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

namespace kvpack::inline v0::detail {

class NodeHashTable {
 public:
  static constexpr std::uint32_t kNone = std::numeric_limits<std::uint32_t>::max();

  /// The first entry with this hash for which `matches(id)` holds, or kNone.
  template <class Matches>
  [[nodiscard]] std::uint32_t find(std::uint64_t hash, Matches&& matches) const {
    if (slots_.empty()) return kNone;
    for (std::size_t i = hash & mask_;; i = (i + 1) & mask_) {
      const std::uint32_t id = slots_[i];
      if (id == kNone) return kNone;
      if (matches(id)) return id;
    }
  }

  /// Makes room for `entries` entries in all, so that insert() never allocates. May throw
  /// std::bad_alloc, leaving the table as it was. `hash_of(id)` gives a stored entry's hash.
  template <class HashOf>
  void reserve(std::size_t entries, HashOf&& hash_of) {
    if (entries * 2 <= slots_.size()) return;
    const std::size_t capacity = std::bit_ceil(std::max<std::size_t>(16, entries * 2));
    std::vector<std::uint32_t> old(capacity, kNone);
    old.swap(slots_);
    mask_ = capacity - 1;
    for (std::uint32_t id : old) {
      if (id != kNone) place(id, hash_of(id));
    }
  }

  /// Adds an id; reserve(size() + 1) first.
  void insert(std::uint32_t id, std::uint64_t hash) noexcept {
    place(id, hash);
    ++size_;
  }

  /// Removes an id that is present.
  template <class HashOf>
  void erase(std::uint32_t id, std::uint64_t hash, HashOf&& hash_of) noexcept {
    std::size_t hole = hash & mask_;
    while (slots_[hole] != id) hole = (hole + 1) & mask_;
    // Pull later entries of the probe run back over the hole when their home slot is at or
    // before it, so every entry stays reachable from its home without tombstones.
    for (std::size_t j = (hole + 1) & mask_; slots_[j] != kNone; j = (j + 1) & mask_) {
      const std::size_t home = hash_of(slots_[j]) & mask_;
      if (((j - home) & mask_) >= ((j - hole) & mask_)) {
        slots_[hole] = slots_[j];
        hole = j;
      }
    }
    slots_[hole] = kNone;
    --size_;
  }

  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] std::size_t bytes() const noexcept {
    return slots_.capacity() * sizeof(std::uint32_t);
  }

 private:
  void place(std::uint32_t id, std::uint64_t hash) noexcept {
    std::size_t i = hash & mask_;
    while (slots_[i] != kNone) i = (i + 1) & mask_;
    slots_[i] = id;
  }

  std::vector<std::uint32_t> slots_;
  std::size_t mask_ = 0;
  std::size_t size_ = 0;
};

}  // namespace kvpack::inline v0::detail
