#pragma once
/// \file kv_dump.hpp
/// \brief Real K/V for evaluation: a simple binary dump and its reader and writer.
///
/// Format (little-endian), version 1:
///   offset 0   8 bytes  magic "KVPKDUMP"
///   offset 8   uint32   version (1)
///   offset 12  uint32   layers
///   offset 16  uint32   tokens
///   offset 20  uint32   kv_heads
///   offset 24  uint32   head_dim
///   offset 28  then per layer: K as float32 [tokens][kv_heads][head_dim], then V the same
/// Keys are stored post-RoPE, as a cache holds them. The file size must be exactly
/// 28 + layers · 2 · tokens · kv_heads · head_dim · 4 bytes; anything else is rejected.
/// Layers are read one at a time, so a dump larger than memory can still be evaluated.

#include <array>
#include <bit>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "kvpack/error.hpp"
#include "kvpack/eval/synthetic.hpp"
#include "kvpack/io/replacing_file.hpp"

namespace kvpack::inline v0::eval {

struct KVDumpHeader {
  std::uint32_t layers = 0;
  std::uint32_t tokens = 0;
  std::uint32_t kv_heads = 0;
  std::uint32_t head_dim = 0;

  /// Both saturate at kTooLarge: a product that wrapped around 64 bits could equal a small file's
  /// size and make read_layer allocate exabytes.
  [[nodiscard]] std::uint64_t layer_floats() const noexcept {
    return saturating_product({std::uint64_t{tokens}, kv_heads, head_dim});
  }
  [[nodiscard]] std::uint64_t file_bytes() const noexcept {
    const std::uint64_t payload = saturating_product({layer_floats(), std::uint64_t{layers} * 2 * sizeof(float)});
    return payload > kTooLarge - kHeaderBytes ? kTooLarge : kHeaderBytes + payload;
  }
  static constexpr std::uint64_t kTooLarge = std::numeric_limits<std::uint64_t>::max();
  static constexpr std::array<char, 8> kMagic{'K', 'V', 'P', 'K', 'D', 'U', 'M', 'P'};
  static constexpr std::uint32_t kVersion = 1;
  static constexpr std::uint64_t kHeaderBytes = 28;

 private:
  static constexpr std::uint64_t saturating_product(std::initializer_list<std::uint64_t> factors) noexcept {
    std::uint64_t product = 1;
    for (const std::uint64_t f : factors) {
      if (f != 0 && product > kTooLarge / f) return kTooLarge;
      product *= f;
    }
    return product;
  }
};

static_assert(std::endian::native == std::endian::little, "kv dumps are read and written as little-endian");

/// Reads a dump's header on construction (validating it against the file size) and its layers
/// on demand.
class KVDumpReader {
 public:
  /// \throws kvpack::Error (kInvalidArgument) naming the file and what is wrong with it
  explicit KVDumpReader(std::string path) : path_(std::move(path)), file_(path_, std::ios::binary) {
    KVPACK_CHECK(file_.good(), kInvalidArgument, detail::message("kv dump '", path_, "' cannot be opened"));
    std::array<char, 8> magic{};
    std::uint32_t fields[5]{};
    file_.read(magic.data(), magic.size());
    file_.read(reinterpret_cast<char*>(fields), sizeof(fields));
    KVPACK_CHECK(file_.good() && magic == KVDumpHeader::kMagic, kInvalidArgument,
                 detail::message("kv dump '", path_, "' does not start with the KVPKDUMP header"));
    KVPACK_CHECK(fields[0] == KVDumpHeader::kVersion, kInvalidArgument,
                 detail::message("kv dump '", path_, "' has version ", fields[0], "; this reader reads version ",
                                 KVDumpHeader::kVersion));
    header_ = {fields[1], fields[2], fields[3], fields[4]};
    // LayerKV and read_layer take the dimensions as index_t.
    constexpr std::uint32_t kMaxDim = std::numeric_limits<index_t>::max();
    KVPACK_CHECK(header_.layers > 0 && header_.tokens > 0 && header_.kv_heads > 0 && header_.head_dim > 0 &&
                     header_.layers <= kMaxDim && header_.tokens <= kMaxDim && header_.kv_heads <= kMaxDim &&
                     header_.head_dim <= kMaxDim,
                 kInvalidArgument,
                 detail::message("kv dump '", path_, "' declares a shape that is empty or beyond 2^31 - 1 (layers ",
                                 header_.layers, ", tokens ", header_.tokens, ", kv_heads ", header_.kv_heads,
                                 ", head_dim ", header_.head_dim, ")"));
    file_.seekg(0, std::ios::end);
    const auto size = static_cast<std::uint64_t>(file_.tellg());
    KVPACK_CHECK(size == header_.file_bytes(), kInvalidArgument,
                 detail::message("kv dump '", path_, "' is ", size, " bytes; its header (", header_.layers,
                                 " layers x ", header_.tokens, " tokens x ", header_.kv_heads, " heads x ",
                                 header_.head_dim, ") needs ",
                                 header_.file_bytes() == KVDumpHeader::kTooLarge
                                     ? std::string("more than 2^64")
                                     : detail::message("exactly ", header_.file_bytes())));
  }

  [[nodiscard]] const KVDumpHeader& header() const noexcept { return header_; }

  /// Layer `layer`'s keys and values.
  [[nodiscard]] LayerKV read_layer(index_t layer) {
    KVPACK_CHECK(layer >= 0 && static_cast<std::uint32_t>(layer) < header_.layers, kInvalidArgument,
                 detail::message("kv dump '", path_, "': layer ", layer, " out of range [0, ", header_.layers, ")"));
    const std::uint64_t n = header_.layer_floats();
    LayerKV kv{static_cast<index_t>(header_.tokens), static_cast<index_t>(header_.kv_heads),
               static_cast<index_t>(header_.head_dim), std::vector<float>(n), std::vector<float>(n), {}};
    file_.clear();
    file_.seekg(static_cast<std::streamoff>(KVDumpHeader::kHeaderBytes + std::uint64_t(layer) * 2 * n * sizeof(float)));
    file_.read(reinterpret_cast<char*>(kv.keys.data()), static_cast<std::streamsize>(n * sizeof(float)));
    file_.read(reinterpret_cast<char*>(kv.values.data()), static_cast<std::streamsize>(n * sizeof(float)));
    KVPACK_CHECK(file_.good(), kInvalidArgument, detail::message("kv dump '", path_, "': reading layer ", layer, " failed"));
    return kv;
  }

 private:
  std::string path_;
  std::ifstream file_;
  KVDumpHeader header_;
};

/// Writes a dump layer by layer: construct with the header, then `write_layer` exactly
/// `layers` times in order. The file is written under a temporary name beside `path` and renamed
/// onto it with the last layer (io::ReplacingFile): a producer that stops early leaves no dump
/// and never truncates a good one already at `path`.
class KVDumpWriter {
 public:
  KVDumpWriter(std::string path, KVDumpHeader header)
      : path_(std::move(path)), header_(checked(header, path_)),
        file_(path_, ErrorCode::kInvalidArgument, "kv dump '" + path_ + "': ") {
    const std::uint32_t fields[5]{KVDumpHeader::kVersion, header_.layers, header_.tokens, header_.kv_heads,
                                  header_.head_dim};
    file_.write(std::as_bytes(std::span(KVDumpHeader::kMagic)));
    file_.write(std::as_bytes(std::span(fields)));
  }

  void write_layer(std::span<const float> keys, std::span<const float> values) {
    KVPACK_CHECK(written_ < header_.layers, kInvalidArgument,
                 detail::message("kv dump '", path_, "': all ", header_.layers, " layers are already written"));
    KVPACK_CHECK(keys.size() == header_.layer_floats() && values.size() == header_.layer_floats(), kInvalidArgument,
                 detail::message("kv dump '", path_, "': a layer needs ", header_.layer_floats(),
                                 " keys and values, got ", keys.size(), " and ", values.size()));
    file_.write(std::as_bytes(keys));
    file_.write(std::as_bytes(values));
    if (written_ + 1 == header_.layers) file_.commit();
    ++written_;
  }

 private:
  static KVDumpHeader checked(KVDumpHeader header, const std::string& path) {
    KVPACK_CHECK(header.layers > 0 && header.layer_floats() > 0 && header.file_bytes() != KVDumpHeader::kTooLarge,
                 kInvalidArgument,
                 detail::message("kv dump '", path, "': layers, tokens, kv_heads and head_dim must be positive and ",
                                 "the file's size must fit in 64 bits"));
    return header;
  }

  std::string path_;
  KVDumpHeader header_;
  io::ReplacingFile file_;
  std::uint32_t written_ = 0;
};

}  // namespace kvpack::inline v0::eval
