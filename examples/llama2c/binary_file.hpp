#pragma once
/// \file binary_file.hpp
/// \brief Reads the little-endian binary files of llama2.c (checkpoint, tokenizer) with errors
///        that name the file and what is wrong with it.

#include <fmt/core.h>

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "kvpack/error.hpp"

namespace llama2c {

static_assert(std::endian::native == std::endian::little,
              "llama2.c files are little-endian and are read here without byte swapping");

/// Throws kvpack::Error (kInvalidArgument) "<path>: <what>".
[[noreturn]] inline void fail_file(const std::filesystem::path& path, const std::string& what) {
  throw kvpack::Error(kvpack::ErrorCode::kInvalidArgument, fmt::format("{}: {}", path.string(), what));
}

/// A cursor over the bytes of one file; every read past the end fails naming the file.
class BinaryReader {
 public:
  /// Reads the whole file (the model files are a few MiB at most).
  explicit BinaryReader(std::filesystem::path path) : path_(std::move(path)) {
    std::ifstream file(path_, std::ios::binary);
    if (!file) fail_file(path_, "cannot be opened for reading");
    bytes_.assign(std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>());
    if (file.bad()) fail_file(path_, "read error");
  }

  [[nodiscard]] const std::filesystem::path& path() const noexcept { return path_; }
  [[nodiscard]] std::size_t size() const noexcept { return bytes_.size(); }
  [[nodiscard]] std::size_t remaining() const noexcept { return bytes_.size() - offset_; }

  /// `what` names the field in the error when the file ends before it.
  [[nodiscard]] std::int32_t read_i32(const char* what) { return read_scalar<std::int32_t>(what); }
  [[nodiscard]] float read_f32(const char* what) { return read_scalar<float>(what); }

  [[nodiscard]] std::string read_string(std::size_t length, const char* what) {
    require(length, what);
    std::string text(bytes_.data() + offset_, length);
    offset_ += length;
    return text;
  }

  /// `count` floats, all of which must be finite (a NaN in the weights means a corrupt file).
  [[nodiscard]] std::vector<float> read_finite_floats(std::size_t count, const std::string& what) {
    require(count * sizeof(float), what.c_str());
    std::vector<float> values(count);
    std::memcpy(values.data(), bytes_.data() + offset_, count * sizeof(float));
    offset_ += count * sizeof(float);
    for (std::size_t i = 0; i < count; ++i) {
      if (!std::isfinite(values[i])) fail_file(path_, fmt::format("{}[{}] is not finite ({})", what, i, values[i]));
    }
    return values;
  }

  void skip(std::size_t length, const char* what) {
    require(length, what);
    offset_ += length;
  }

 private:
  template <class T>
  T read_scalar(const char* what) {
    require(sizeof(T), what);
    T value;
    std::memcpy(&value, bytes_.data() + offset_, sizeof(T));
    offset_ += sizeof(T);
    return value;
  }

  void require(std::size_t length, const char* what) const {
    if (length > remaining()) {
      fail_file(path_, fmt::format("file ends at byte {} inside {} ({} more bytes needed)", bytes_.size(), what,
                                   length - remaining()));
    }
  }

  std::filesystem::path path_;
  std::vector<char> bytes_;
  std::size_t offset_ = 0;
};

}  // namespace llama2c
