#pragma once
// What the tier tests share: byte patterns, a directory removed at the end of a test, and a tier
// that always fails (a store that is down).

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unistd.h>
#include <vector>

#include "kvpack/error.hpp"
#include "kvpack/tier/tier.hpp"

namespace kvpack::test {

/// `size` bytes that differ with `seed` and along the buffer.
inline std::vector<std::byte> pattern_bytes(std::size_t size, std::uint32_t seed) {
  std::vector<std::byte> bytes(size);
  std::uint32_t x = seed * 2654435761u + 1;
  for (std::byte& b : bytes) {
    x = x * 1664525u + 1013904223u;
    b = static_cast<std::byte>(x >> 24);
  }
  return bytes;
}

/// A fresh directory under the system's temporary directory, removed with everything in it.
class ScratchDirectory {
 public:
  explicit ScratchDirectory(std::string_view name)
      : path_(std::filesystem::temp_directory_path() /
              (std::string("kvpack-") + std::string(name) + "-" + std::to_string(::getpid()))) {
    std::filesystem::remove_all(path_);
  }
  ~ScratchDirectory() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  ScratchDirectory(const ScratchDirectory&) = delete;
  ScratchDirectory& operator=(const ScratchDirectory&) = delete;
  [[nodiscard]] const std::filesystem::path& path() const noexcept { return path_; }

 private:
  std::filesystem::path path_;
};

/// A tier whose store is down: every call throws kUnavailable.
class DownTier final : public tier::Tier {
 public:
  [[nodiscard]] std::string describe() const override { return "down"; }
  void put(std::string_view, std::span<const std::byte>) override { fail(); }
  [[nodiscard]] std::optional<std::vector<std::byte>> get(std::string_view) override { fail(); }
  bool erase(std::string_view) override { fail(); }
  [[nodiscard]] tier::TierStats stats() const override { return {}; }

 private:
  [[noreturn]] static void fail() { throw Error(ErrorCode::kUnavailable, "down: connection refused"); }
};

}  // namespace kvpack::test
