#pragma once
/// \file replacing_file.hpp
/// \brief ReplacingFile: a regular file written under a temporary name in its directory and
///        renamed onto its path by commit(), so a reader sees the old file or the new one, never
///        half of one, and a writer that fails leaves the old file as it was. A process that has
///        the old file mapped (io::PageFile) keeps reading the old bytes.
///
/// Temporaries are named ".<name>.<pid>.<n>.<random>.tmp" and created with O_EXCL: two writers
/// of one path never share one, whether they are threads of one process, processes, or
/// processes of containers that share a volume and a pid. A writer that dies mid-write leaves
/// its temporary behind (the name starts with '.', and nothing reads it).

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <random>
#include <span>
#include <string>
#include <string_view>

#include "kvpack/error.hpp"

namespace kvpack::inline v0::io {

class ReplacingFile {
 public:
  /// Opens a new temporary next to `target` (created with mode 0644 less the umask).
  /// \throws kvpack::Error with `code`, its message starting with `who`, when it cannot be created.
  ReplacingFile(std::filesystem::path target, ErrorCode code, std::string who = {})
      : target_(std::move(target)), code_(code), who_(std::move(who)) {
    const std::filesystem::path directory = target_.parent_path();
    for (int attempt = 0;; ++attempt) {
      // At most 64 bytes of the name: a long one still leaves room for the suffix.
      temporary_ = directory / detail::message(".", target_.filename().string().substr(0, 64), ".", ::getpid(), ".",
                                               next_number().fetch_add(1), ".", process_salt(), ".tmp");
      fd_ = ::open(temporary_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
      if (fd_ >= 0) return;
      if (errno != EEXIST || attempt == 16) fail("create", temporary_, errno);
    }
  }
  ReplacingFile(const ReplacingFile&) = delete;
  ReplacingFile& operator=(const ReplacingFile&) = delete;

  /// Not committed: the temporary is closed and removed, the target untouched.
  ~ReplacingFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(temporary_.c_str());
  }

  [[nodiscard]] int fd() const noexcept { return fd_; }

  /// Writes all of `bytes`, retrying short writes and EINTR. \throws as the constructor.
  void write(std::span<const std::byte> bytes) {
    while (!bytes.empty()) {
      const ssize_t n = ::write(fd_, bytes.data(), bytes.size());
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) fail("write", temporary_, n < 0 ? errno : EIO);
      bytes = bytes.subspan(static_cast<std::size_t>(n));
    }
  }

  /// Gives the file `mode`'s permission bits (a file it replaces keeps its own that way).
  void set_mode(mode_t mode) {
    if (::fchmod(fd_, mode & 07777) != 0) fail("set the mode of", temporary_, errno);
  }

  /// How far commit() takes the new file towards the disk.
  enum class Sync : std::uint8_t {
    kNone,       ///< rename only: after a power loss the target may be old, new or (some file
                 ///< systems) empty
    kData,       ///< fsync the temporary before the rename: after a power loss, old or new
    kDurable,    ///< kData and fsync the directory after it: the new file survives a power loss
  };

  /// Closes the temporary (after fsync, per `sync`) and renames it onto the target.
  void commit(Sync sync = Sync::kNone) {
    const bool synced = sync == Sync::kNone || ::fsync(fd_) == 0;
    const int sync_error = errno;
    const int closed = ::close(fd_);
    const int close_error = errno;
    fd_ = -1;
    if (!synced) fail("write", temporary_, sync_error);
    if (closed != 0) fail("write", temporary_, close_error);
    if (::rename(temporary_.c_str(), target_.c_str()) != 0) fail("rename onto", target_, errno);
    committed_ = true;
    if (sync == Sync::kDurable) sync_directory();
  }

 private:
  /// Numbers temporaries across every ReplacingFile of the process.
  static std::atomic<std::uint64_t>& next_number() noexcept {
    static std::atomic<std::uint64_t> number{0};
    return number;
  }
  /// Tells this process's temporaries from those of another with the same pid (containers).
  static std::uint64_t process_salt() {
    static const std::uint64_t salt = [] {
      try {
        std::random_device device;
        return (std::uint64_t{device()} << 32) ^ device();
      } catch (const std::exception&) {  // no entropy source: the clock and an address still differ
        static const int here = 0;
        return static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) ^
               reinterpret_cast<std::uintptr_t>(&here);
      }
    }();
    return salt;
  }

  /// The rename is an entry of the directory: fsync'ing the directory makes it durable.
  void sync_directory() const {
    const std::filesystem::path parent = target_.parent_path();
    const std::filesystem::path directory = parent.empty() ? std::filesystem::path(".") : parent;
    const int fd = ::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) fail("open", directory, errno);
    const bool synced = ::fsync(fd) == 0;
    const int error = errno;
    ::close(fd);
    if (!synced) fail("sync", directory, error);
  }

  [[noreturn]] void fail(std::string_view action, const std::filesystem::path& path, int error) const {
    detail::throw_error(code_,
                        detail::message(who_, "cannot ", action, " '", path.string(), "': ", std::strerror(error)));
  }

  std::filesystem::path target_;
  std::filesystem::path temporary_;
  ErrorCode code_;
  std::string who_;
  int fd_ = -1;
  bool committed_ = false;
};

}  // namespace kvpack::inline v0::io
