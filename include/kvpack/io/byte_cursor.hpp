#pragma once
/// \file byte_cursor.hpp
/// \brief Little-endian appending (ByteSink) and bounds-checked reading (ByteSource) of the
///        fixed-width fields and short strings a page file's sections are made of.
///
/// Fields are copied byte-wise with memcpy: a file's bytes need not be aligned for the field's
/// type, and the format is little-endian, which is what every machine kvpack builds for is (a
/// static_assert says so rather than swapping bytes nobody would test).

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "kvpack/error.hpp"

namespace kvpack::inline v0::io {

static_assert(std::endian::native == std::endian::little,
              "page files are little-endian and kvpack reads them in place: a big-endian build would "
              "need byte swapping on every field and page");

/// Appends fields to a byte vector.
class ByteSink {
 public:
  explicit ByteSink(std::vector<std::byte>& out) : out_(out) {}

  template <class T>
    requires std::is_arithmetic_v<T>
  void put(T value) {
    const std::size_t at = out_.size();
    out_.resize(at + sizeof(T));
    std::memcpy(out_.data() + at, &value, sizeof(T));
  }
  /// A u32 byte count, then the bytes (no terminator).
  void put_string(std::string_view text) {
    put(static_cast<std::uint32_t>(text.size()));
    put_bytes(std::as_bytes(std::span(text.data(), text.size())));
  }
  void put_bytes(std::span<const std::byte> bytes) { out_.insert(out_.end(), bytes.begin(), bytes.end()); }
  /// Zero bytes up to the next multiple of `alignment`.
  void pad_to(std::size_t alignment) { out_.resize((out_.size() + alignment - 1) / alignment * alignment); }
  [[nodiscard]] std::size_t size() const noexcept { return out_.size(); }

 private:
  std::vector<std::byte>& out_;
};

/// Reads fields in order from a span, throwing kvpack::Error (kInvalidArgument) naming `what`
/// (the file and section) when a field would run past the end: no read ever leaves the span.
class ByteSource {
 public:
  ByteSource(std::span<const std::byte> bytes, std::string_view what) : bytes_(bytes), what_(what) {}

  template <class T>
    requires std::is_arithmetic_v<T>
  [[nodiscard]] T get(const char* field) {
    T value;
    std::memcpy(&value, take(sizeof(T), field).data(), sizeof(T));
    return value;
  }
  /// A string written by ByteSink::put_string, at most `max_bytes` long.
  [[nodiscard]] std::string get_string(const char* field, std::size_t max_bytes) {
    const auto length = get<std::uint32_t>(field);
    KVPACK_CHECK(length <= max_bytes, kInvalidArgument,
                 detail::message(what_, ": ", field, " is ", length, " bytes long, at most ", max_bytes, " allowed"));
    const std::span<const std::byte> text = take(length, field);
    return {reinterpret_cast<const char*>(text.data()), text.size()};
  }
  [[nodiscard]] std::span<const std::byte> take(std::size_t count, const char* field) {
    KVPACK_CHECK(count <= bytes_.size() - at_, kInvalidArgument,
                 detail::message(what_, " is truncated: ", field, " needs ", count, " bytes at offset ", at_,
                                 ", ", bytes_.size() - at_, " left"));
    const std::span<const std::byte> out = bytes_.subspan(at_, count);
    at_ += count;
    return out;
  }
  [[nodiscard]] std::size_t remaining() const noexcept { return bytes_.size() - at_; }

 private:
  std::span<const std::byte> bytes_;
  std::string_view what_;
  std::size_t at_ = 0;
};

}  // namespace kvpack::inline v0::io
