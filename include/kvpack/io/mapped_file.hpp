#pragma once
/// \file mapped_file.hpp
/// \brief MappedFile: a whole file mapped read-only (POSIX mmap), unmapped when destroyed.
///
/// Mapping rather than reading lets a reader hand out views of page payloads without copying
/// them, and lets the OS page in only what is touched after the checksum pass.

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <span>
#include <string>
#include <utility>

#include "kvpack/error.hpp"

namespace kvpack::inline v0::io {

class MappedFile {
 public:
  /// \throws kvpack::Error kInvalidArgument when the file cannot be opened, sized or mapped.
  explicit MappedFile(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    KVPACK_CHECK(fd >= 0, kInvalidArgument,
                 detail::message("page file '", path, "' cannot be opened: ", std::strerror(errno)));
    struct stat info {};
    if (::fstat(fd, &info) != 0 || !S_ISREG(info.st_mode)) {
      ::close(fd);
      detail::throw_error(ErrorCode::kInvalidArgument, detail::message("page file '", path, "' is not a regular file"));
    }
    size_ = static_cast<std::size_t>(info.st_size);
    if (size_ > 0) {  // mmap of length 0 fails; an empty file is still a (malformed) file
      void* base = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
      const int error = errno;
      ::close(fd);
      KVPACK_CHECK(base != MAP_FAILED, kInvalidArgument,
                   detail::message("page file '", path, "' cannot be mapped: ", std::strerror(error)));
      base_ = static_cast<const std::byte*>(base);
    } else {
      ::close(fd);
    }
  }
  MappedFile(MappedFile&& other) noexcept
      : base_(std::exchange(other.base_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  MappedFile& operator=(MappedFile&& other) noexcept {
    if (this != &other) {
      unmap();
      base_ = std::exchange(other.base_, nullptr);
      size_ = std::exchange(other.size_, 0);
    }
    return *this;
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile() { unmap(); }

  [[nodiscard]] std::span<const std::byte> bytes() const noexcept { return {base_, size_}; }

 private:
  const std::byte* base_ = nullptr;
  std::size_t size_ = 0;

  void unmap() noexcept {
    if (base_ != nullptr) ::munmap(const_cast<std::byte*>(base_), size_);
  }
};

}  // namespace kvpack::inline v0::io
