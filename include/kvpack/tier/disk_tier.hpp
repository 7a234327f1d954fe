#pragma once
/// \file disk_tier.hpp
/// \brief DiskTier: one file per entry in a directory, written to a temporary name and renamed
///        into place, so a reader sees the old entry or the new one, never half of one. Entries
///        are sealed (sealed_entry.hpp): a file cut short by a crash or damaged on disk is
///        reported on read, never handed on. Thread-safe; several processes may share the
///        directory (the last rename wins).
///
/// Entry `key` lives in `<directory>/<key>.kvtier`; temporaries start with '.', which no key
/// may, and are left behind only by a writer that died mid-write (they are never read).

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "kvpack/error.hpp"
#include "kvpack/io/replacing_file.hpp"
#include "kvpack/tier/sealed_entry.hpp"
#include "kvpack/tier/tier.hpp"

namespace kvpack::inline v0::tier {

struct DiskTierOptions {
  /// fsync each file before it is renamed into place (and the directory after): entries then
  /// survive a power loss, at the cost of a disk flush per put.
  bool durable = false;
};

class DiskTier final : public Tier {
 public:
  /// Creates `directory` if it does not exist.
  /// \throws kvpack::Error kUnavailable when it cannot be created or is not a directory.
  explicit DiskTier(std::filesystem::path directory, DiskTierOptions options = {})
      : directory_(std::move(directory)), options_(options) {
    std::error_code error;
    std::filesystem::create_directories(directory_, error);
    std::error_code ignored;  // a directory that cannot even be examined is not usable either
    KVPACK_CHECK(std::filesystem::is_directory(directory_, ignored), kUnavailable,
                 detail::message("DiskTier: '", directory_.string(), "' is not a usable directory",
                                 error ? ": " + error.message() : std::string()));
  }

  [[nodiscard]] std::string describe() const override { return "disk " + directory_.string(); }

  [[nodiscard]] std::filesystem::path path_of(std::string_view key) const {
    return directory_ / (std::string(key) + ".kvtier");
  }

  void put(std::string_view key, std::span<const std::byte> bytes) override {
    check_tier_key(key, "DiskTier::put");
    const std::vector<std::byte> sealed = seal(key, bytes);
    io::ReplacingFile file(path_of(key), ErrorCode::kUnavailable, "DiskTier: ");
    file.write(sealed);
    file.commit(options_.durable ? io::ReplacingFile::Sync::kDurable : io::ReplacingFile::Sync::kNone);
    std::lock_guard lock(mutex_);
    ++stats_.puts;
    stats_.bytes_written += bytes.size();
  }

  [[nodiscard]] std::optional<std::vector<std::byte>> get(std::string_view key) override {
    check_tier_key(key, "DiskTier::get");
    const std::filesystem::path path = path_of(key);
    std::optional<std::vector<std::byte>> sealed = read_file(path);
    std::optional<std::vector<std::byte>> payload;
    if (sealed) {
      const std::span<const std::byte> view = unseal(key, *sealed, "disk tier entry '" + path.string() + "'");
      payload.emplace(view.begin(), view.end());
    }
    std::lock_guard lock(mutex_);
    ++stats_.gets;
    if (payload) {
      ++stats_.hits;
      stats_.bytes_read += payload->size();
    }
    return payload;
  }

  bool erase(std::string_view key) override {
    check_tier_key(key, "DiskTier::erase");
    const std::filesystem::path path = path_of(key);
    if (::unlink(path.c_str()) == 0) return true;
    if (errno == ENOENT) return false;
    fail("remove", path, errno);
  }

  [[nodiscard]] TierStats stats() const override {
    std::lock_guard lock(mutex_);
    return stats_;
  }

 private:
  [[noreturn]] static void fail(std::string_view action, const std::filesystem::path& path, int error) {
    detail::throw_error(ErrorCode::kUnavailable, detail::message("DiskTier: cannot ", action, " '", path.string(),
                                                                 "': ", std::strerror(error)));
  }

  /// The whole file, or nullopt when it does not exist.
  static std::optional<std::vector<std::byte>> read_file(const std::filesystem::path& path) {
    struct Descriptor {  // closed on every way out, the buffer's allocation failing included
      int fd;
      ~Descriptor() {
        if (fd >= 0) ::close(fd);
      }
    } file{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
    if (file.fd < 0) {
      if (errno == ENOENT) return std::nullopt;
      fail("open", path, errno);
    }
    struct stat info {};
    if (::fstat(file.fd, &info) != 0) fail("stat", path, errno);
    std::vector<std::byte> bytes;
    try {
      bytes.resize(static_cast<std::size_t>(info.st_size));
    } catch (const std::exception&) {  // bad_alloc, length_error: a kvpack::Error, so callers fall back
      detail::throw_error(ErrorCode::kUnavailable, detail::message("DiskTier: cannot read '", path.string(), "': ",
                                                                   info.st_size, " bytes do not fit in memory"));
    }
    std::size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = ::read(file.fd, bytes.data() + done, bytes.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) fail("read", path, errno);
      if (n == 0) break;  // shrank since fstat: unseal reports the short entry
      done += static_cast<std::size_t>(n);
    }
    bytes.resize(done);
    return bytes;
  }

  std::filesystem::path directory_;
  DiskTierOptions options_;
  mutable std::mutex mutex_;
  TierStats stats_;
};

}  // namespace kvpack::inline v0::tier
