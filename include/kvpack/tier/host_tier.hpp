#pragma once
/// \file host_tier.hpp
/// \brief HostTier: entries in this process's memory under a byte budget, the least recently
///        used dropped first when a put needs room. Entries are kept unsealed: nothing outside
///        the process can damage them. Thread-safe.

#include <cstddef>
#include <list>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kvpack/error.hpp"
#include "kvpack/tier/tier.hpp"

namespace kvpack::inline v0::tier {

class HostTier final : public Tier {
 public:
  /// \param capacity_bytes the most payload bytes held at once (> 0)
  explicit HostTier(std::size_t capacity_bytes) : capacity_(capacity_bytes) {
    KVPACK_CHECK(capacity_bytes > 0, kInvalidArgument, "HostTier: capacity_bytes must be > 0");
  }

  [[nodiscard]] std::string describe() const override { return detail::message("host (", capacity_, " bytes)"); }

  void put(std::string_view key, std::span<const std::byte> bytes) override {
    check_tier_key(key, "HostTier::put");
    KVPACK_CHECK(bytes.size() <= capacity_, kOutOfRange,
                 detail::message("HostTier::put: an entry of ", bytes.size(), " bytes exceeds the capacity of ",
                                 capacity_, " bytes"));
    // Every allocation happens before the first change: the copy, the map node (built in a
    // scratch map and extracted), the list node, and room in the table (reserve). What follows
    // cannot throw, so a failed put changes nothing.
    const std::size_t size = bytes.size();
    Entries scratch;
    scratch.emplace(std::string(key), Entry{std::vector<std::byte>(bytes.begin(), bytes.end()), {}});
    Entries::node_type node = scratch.extract(scratch.begin());
    std::list<std::string> recency_node{node.key()};
    std::lock_guard lock(mutex_);
    entries_.reserve(entries_.size() + 1);
    if (const auto found = entries_.find(node.key()); found != entries_.end()) remove(found);
    while (used_ + size > capacity_) {
      remove(entries_.find(recency_.back()));
      ++stats_.evictions;
    }
    const auto entry = entries_.insert(std::move(node)).position;
    recency_.splice(recency_.begin(), recency_node);
    entry->second.recency = recency_.begin();
    used_ += size;
    stats_.bytes_written += size;
    ++stats_.puts;
  }

  [[nodiscard]] std::optional<std::vector<std::byte>> get(std::string_view key) override {
    check_tier_key(key, "HostTier::get");
    std::lock_guard lock(mutex_);
    ++stats_.gets;
    const auto found = entries_.find(std::string(key));
    if (found == entries_.end()) return std::nullopt;
    std::optional<std::vector<std::byte>> copy(found->second.bytes);  // may throw: before any change
    recency_.splice(recency_.begin(), recency_, found->second.recency);  // now the most recent
    ++stats_.hits;
    stats_.bytes_read += copy->size();
    return copy;
  }

  bool erase(std::string_view key) override {
    check_tier_key(key, "HostTier::erase");
    std::lock_guard lock(mutex_);
    const auto found = entries_.find(std::string(key));
    if (found == entries_.end()) return false;
    remove(found);
    return true;
  }

  [[nodiscard]] TierStats stats() const override {
    std::lock_guard lock(mutex_);
    return stats_;
  }

  /// Payload bytes held now (≤ the capacity).
  [[nodiscard]] std::size_t used_bytes() const {
    std::lock_guard lock(mutex_);
    return used_;
  }

 private:
  struct Entry {
    std::vector<std::byte> bytes;
    std::list<std::string>::iterator recency;
  };
  using Entries = std::unordered_map<std::string, Entry>;

  void remove(Entries::iterator entry) noexcept {
    used_ -= entry->second.bytes.size();
    recency_.erase(entry->second.recency);
    entries_.erase(entry);
  }

  std::size_t capacity_;
  mutable std::mutex mutex_;
  std::size_t used_ = 0;
  std::list<std::string> recency_;  ///< most recently used first
  Entries entries_;
  TierStats stats_;
};

}  // namespace kvpack::inline v0::tier
