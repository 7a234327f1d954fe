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
    // Allocate before the lock and before any change, so a failed allocation changes nothing
    // and the list node below can be spliced in without allocating.
    std::vector<std::byte> copy(bytes.begin(), bytes.end());
    std::list<std::string> node{std::string(key)};
    const std::size_t size = copy.size();
    std::lock_guard lock(mutex_);
    if (const auto found = entries_.find(node.front()); found != entries_.end()) remove(found);
    while (used_ + size > capacity_) {
      remove(entries_.find(recency_.back()));
      ++stats_.evictions;
    }
    const auto entry = entries_.emplace(node.front(), Entry{std::move(copy), {}}).first;
    recency_.splice(recency_.begin(), node);
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
    recency_.splice(recency_.begin(), recency_, found->second.recency);  // now the most recent
    ++stats_.hits;
    stats_.bytes_read += found->second.bytes.size();
    return found->second.bytes;
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
