#pragma once
/// \file tier.hpp
/// \brief Tier: a store for byte blobs outside the cache's page pool (issue 9, part 2). Host
///        memory, local disk and Redis implement it; sequence_store.hpp and prefix_chunks.hpp
///        put page files in them, and fetch_planner.hpp decides whether fetching one beats
///        recomputing it.
///
/// A tier holds whole entries, never parts: `get` returns exactly the bytes of one complete put
/// or reports why it cannot. A put that fails may leave the old entry, nothing, or (a Redis SET
/// that timed out after the server applied it) the new one, never a part. Keys are short ASCII
/// names (tier_key_problem) so they are safe as file names and Redis keys alike.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvpack/error.hpp"

namespace kvpack::inline v0::tier {

/// What a tier object has done since it was created.
struct TierStats {
  std::uint64_t puts = 0;
  std::uint64_t gets = 0;
  std::uint64_t hits = 0;            ///< gets that found their key
  std::uint64_t bytes_written = 0;   ///< payload bytes stored by put
  std::uint64_t bytes_read = 0;      ///< payload bytes returned by get
  std::uint64_t evictions = 0;       ///< entries a bounded tier dropped to make room
};

class Tier {
 public:
  virtual ~Tier() = default;

  /// A short name for messages and reports ("host", "disk /path", "redis 127.0.0.1:6379").
  [[nodiscard]] virtual std::string describe() const = 0;

  /// Stores `bytes` under `key`, replacing any entry there.
  /// \throws kvpack::Error kInvalidArgument for a bad key; kOutOfRange for an entry larger than
  ///         the tier can ever hold; kUnavailable when the store cannot be written (the old entry,
  ///         if any, may then be gone, but no partial entry is ever returned by get).
  virtual void put(std::string_view key, std::span<const std::byte> bytes) = 0;

  /// The entry under `key`, or nullopt when there is none.
  /// \throws kvpack::Error kUnavailable when the store cannot be read; kInvalidArgument when the
  ///         stored entry is damaged (truncated, a checksum mismatch, another key's entry).
  [[nodiscard]] virtual std::optional<std::vector<std::byte>> get(std::string_view key) = 0;

  /// Removes `key`'s entry; false when there was none. \throws as put.
  virtual bool erase(std::string_view key) = 0;

  [[nodiscard]] virtual TierStats stats() const = 0;
};

/// Keys are 1–200 characters from [A-Za-z0-9._:-] and do not start with '.': file names on any
/// file system and Redis keys without quoting. Empty when `key` is fine, else why it is not.
[[nodiscard]] inline std::string tier_key_problem(std::string_view key) {
  if (key.empty() || key.size() > 200) {
    return detail::message("a tier key is 1 to 200 characters, got ", key.size());
  }
  if (key.front() == '.') return "a tier key must not start with '.'";
  for (const char c : key) {
    const bool allowed = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                         c == '_' || c == ':' || c == '-';
    if (!allowed) {
      return detail::message("a tier key may hold only letters, digits and . _ : -; '", std::string(key),
                             "' has character code ", static_cast<int>(static_cast<unsigned char>(c)));
    }
  }
  return {};
}

/// \throws kvpack::Error kInvalidArgument naming `who` and the problem, when `key` is not usable.
inline void check_tier_key(std::string_view key, std::string_view who) {
  const std::string problem = tier_key_problem(key);
  KVPACK_CHECK(problem.empty(), kInvalidArgument, detail::message(who, ": ", problem));
}

}  // namespace kvpack::inline v0::tier
