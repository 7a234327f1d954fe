#pragma once
/// \file page_file_writer.hpp
/// \brief write_page_file: one sequence of a KVCache to page file bytes, a file descriptor or a
///        path, through the cache's public read API only (pages, pool, codec_params, shape,
///        config). To a descriptor or path the file is streamed: only its small sections are held.
///
/// Version 1 carries whole pages: a sequence with tokens outside pages (the full-precision tail
/// or exact prefix, or pages an evictor freed) is rejected with kUnsupported rather than written
/// short. A chunk (PageFileOptions::first_page, page_count) needs only its own pages to hold
/// the tokens at positions 0, 1, … (no exact prefix, nothing evicted, no gap): the tokens
/// after them may still be in the tail. Quest's page summaries are not written (a reader can
/// recompute them from the pages).

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "kvpack/error.hpp"
#include "kvpack/io/byte_cursor.hpp"
#include "kvpack/io/codec_registry.hpp"
#include "kvpack/io/crc32c.hpp"
#include "kvpack/io/page_file_container.hpp"
#include "kvpack/io/page_file_header_io.hpp"
#include "kvpack/io/replacing_file.hpp"
#include "kvpack/layout/layout_concepts.hpp"

namespace kvpack::inline v0::io {

/// What the cache does not know about a sequence.
struct PageFileOptions {
  std::string model_id;                  ///< free text, at most 256 bytes
  /// Token ids, optional: the sequence's; for a chunk, whatever the caller needs to recognise it
  /// (tier::store_chunks stores every token up to the chunk's end).
  std::span<const std::int32_t> tokens;
  /// A chunk of the sequence: pages [first_page, first_page + page_count) of every stream
  /// (page_count 0: to the last page; tokens in the tail are not in pages and not written).
  /// io::append_page_file puts such a chunk after the pages before it.
  std::size_t first_page = 0;
  std::size_t page_count = 0;
  /// Writing to a path: fsync the file (and, where it was renamed into place, its directory)
  /// before returning, so it survives a power loss. Without it, a file that replaces an old one
  /// is still fsynced before the rename, so a power loss leaves the old file or the new one.
  bool durable = false;
};

namespace writer_detail {

template <class Cache>
PageFileHeader header_of(const Cache& cache, SeqId seq, const PageFileOptions& options) {
  using Layout = typename Cache::layout_type;
  using Quantizer = typename Cache::quantizer_type;
  using KeyCodec = typename Quantizer::key_codec;
  using ValueCodec = typename Quantizer::value_codec;
  const Layout& layout = cache.layout();
  const ModelShape& shape = cache.shape();
  PageFileHeader h;
  h.model_id = options.model_id;
  h.layout = std::string(Layout::kName);
  // A K of at least the layer count is one cache for every layer (YOCO), whatever K is.
  if constexpr (requires { Layout::kLayersPerCache; }) {
    h.layers_per_cache = std::min<index_t>(Layout::kLayersPerCache, shape.layers);
  }
  h.shape = shape;
  h.cache_layers = layout::cache_layers(layout, shape);
  h.streams = layout.streams(shape);
  h.key_dim = layout.key_dim(shape);
  h.value_dim = layout.value_dim(shape);
  h.page_size = cache.config().page_size;
  using Limits = PageFileLimits;
  KVPACK_CHECK(shape.layers <= Limits::kMaxLayers && shape.q_heads <= Limits::kMaxHeads &&
                   shape.head_dim <= Limits::kMaxHeadDim && h.key_dim <= Limits::kMaxHeadDim &&
                   h.value_dim <= Limits::kMaxHeadDim,
               kUnsupported,
               detail::message("write_page_file: page files hold at most ", Limits::kMaxLayers, " layers, ",
                               Limits::kMaxHeads, " heads and rows of ", Limits::kMaxHeadDim,
                               " floats (a reader refuses more); this cache has ", shape.layers, " layers, ",
                               shape.q_heads, " query heads, head_dim ", shape.head_dim, ", rows of ", h.key_dim,
                               " and ", h.value_dim));
  if (const auto& rope = cache.config().key_rope) {
    h.keys_before_rope = true;
    h.rope_pairing = static_cast<std::uint32_t>(rope->pairing);
    h.rope_theta = rope->theta;
    h.rope_max_position = rope->max_position;
  }
  h.quantizer = Quantizer::name();
  h.key_codec = std::string(KeyCodec::kName);
  h.value_codec = std::string(ValueCodec::kName);
  h.key_group = codec_group<KeyCodec>();
  h.value_group = codec_group<ValueCodec>();
  // A codec whose parameters serialise but that the registry lacks would make files this build
  // cannot read back: refuse to write them.
  KVPACK_CHECK(find_codec(h.key_codec, Plane::kKey, h.key_group) != nullptr &&
                   find_codec(h.value_codec, Plane::kValue, h.value_group) != nullptr,
               kUnsupported,
               detail::message("write_page_file: codecs ", h.key_codec, "/", h.value_codec,
                               " are not in io/codec_registry.hpp"));
  const quant::PageGeometry geometry{h.page_size, h.key_dim};
  h.key_plane_bytes = cache.quantizer().key.plane_bytes(geometry);
  h.value_plane_offset = cache.value_plane_offset();
  h.value_plane_bytes = cache.quantizer().value.plane_bytes({h.page_size, h.value_dim});
  h.payload_bytes = cache.page_format_info().payload_bytes;
  h.slot_bytes = static_cast<std::uint64_t>(h.page_size) * 4 + h.live_mask_words() * 8;
  KVPACK_CHECK(cache.page_format_info().metadata_bytes >= h.slot_bytes, kInvalidArgument,
               "write_page_file: the pool's metadata is smaller than positions and live mask");
  const bool chunk = options.first_page > 0 || options.page_count > 0;
  std::size_t chunk_pages = 0;  // pages per stream written: the same in every stream
  for (index_t c = 0; c < h.cache_layers; ++c) {
    const index_t writer = layout::writer_of(layout, shape, c);
    const std::int64_t tokens = cache.length(seq, writer);
    for (index_t s = 0; s < h.streams; ++s) {
      const std::size_t pages = cache.pages(seq, writer, s).size();
      const std::int64_t in_pages = static_cast<std::int64_t>(pages) * h.page_size;
      if (chunk) {
        // Page i holds the tokens at positions [i·page_size, (i + 1)·page_size) unless an exact
        // prefix sits before the pages, an evictor dropped tokens or positions skip (positions
        // increase from 0, so the last is tokens − 1 only without a gap); the tokens after the
        // last page are in the tail.
        KVPACK_CHECK(cache.config().exact_prefix_tokens == 0 && cache.live_tokens(seq, writer, s) == tokens &&
                         cache.last_position(seq, writer) + 1 == tokens && in_pages <= tokens,
                     kUnsupported,
                     detail::message("write_page_file: layer ", writer, " stream ", s, " of sequence ", seq,
                                     " has an exact prefix, evicted tokens or positions that skip, so its pages do "
                                     "not hold the tokens at positions 0, 1, ...; a chunk of pages cannot be written"));
      } else {
        KVPACK_CHECK(in_pages == tokens, kUnsupported,
                     detail::message("write_page_file: layer ", writer, " stream ", s, " of sequence ", seq,
                                     " holds ", tokens, " tokens, ", in_pages,
                                     " of them in pages; page files carry whole pages only (no tail, exact prefix "
                                     "or evicted pages: use tail_tokens = 0, exact_prefix_tokens = 0, a length "
                                     "that is a multiple of page_size and no evictor, or write chunks of pages)"));
      }
      KVPACK_CHECK(options.first_page <= pages && options.page_count <= pages - options.first_page, kInvalidArgument,
                   detail::message("write_page_file: pages [", options.first_page, ", ",
                                   options.first_page + options.page_count, ") asked of layer ", writer, " stream ", s,
                                   ", which holds ", pages));
      chunk_pages = options.page_count > 0 ? options.page_count : pages - options.first_page;
      h.page_counts.push_back(static_cast<std::uint32_t>(chunk_pages));
    }
  }
  h.sequence_tokens = static_cast<std::uint64_t>(chunk_pages) * static_cast<std::uint64_t>(h.page_size);
  return h;
}

/// The file size a preamble declares (emit_page_file's first run is the preamble).
inline std::uint64_t declared_size(std::span<const std::byte> preamble) noexcept {
  std::uint64_t bytes = 0;
  std::memcpy(&bytes, preamble.data() + 16, sizeof(bytes));
  return bytes;
}

/// Produces the page file of `seq` as byte runs handed to `emit(span)` in file order, without
/// building the file: the small sections (META, PARM, TOKN) are built in memory, the page
/// sections (SLOT, PAGE) are read from the pool twice, first for their CRC32C (a section's
/// header precedes its body), then for the bytes. Returns the file's size.
template <class Cache, class Emit>
std::uint64_t emit_page_file(const Cache& cache, SeqId seq, const PageFileOptions& options, Emit&& emit) {
  using Quantizer = typename Cache::quantizer_type;
  using KeyFormat = ParamsFormat<typename Quantizer::key_codec>;
  using ValueFormat = ParamsFormat<typename Quantizer::value_codec>;
  if constexpr (!KeyFormat::kSupported || !ValueFormat::kSupported) {
    detail::throw_error(ErrorCode::kUnsupported,
                        detail::message("write_page_file: quantizer ", Quantizer::name(),
                                        " has parameters page files do not carry"));
  } else {
    KVPACK_CHECK(options.model_id.size() <= PageFileLimits::kMaxString, kInvalidArgument,
                 detail::message("write_page_file: model_id is ", options.model_id.size(), " bytes, at most ",
                                 PageFileLimits::kMaxString));
    KVPACK_CHECK(options.tokens.size() <= PageFileLimits::kMaxTokens, kInvalidArgument,
                 "write_page_file: too many token ids");
    const PageFileHeader h = header_of(cache, seq, options);
    const auto writer_of = [&](index_t c) { return layout::writer_of(cache.layout(), h.shape, c); };

    std::vector<std::byte> meta, params, tokens;
    {
      ByteSink out(meta);
      write_meta(out, h);
    }
    {
      ByteSink out(params);
      const quant::PageGeometry key_geometry{h.page_size, h.key_dim}, value_geometry{h.page_size, h.value_dim};
      const std::size_t key_bytes = KeyFormat::bytes(key_geometry), value_bytes = ValueFormat::bytes(value_geometry);
      out.put(static_cast<std::uint32_t>(KeyFormat::kKind));
      out.put(static_cast<std::uint32_t>(key_bytes));
      out.put(static_cast<std::uint32_t>(ValueFormat::kKind));
      out.put(static_cast<std::uint32_t>(value_bytes));
      std::vector<std::byte> record(key_bytes + value_bytes);
      for (index_t c = 0; c < h.cache_layers; ++c) {
        for (index_t s = 0; s < h.streams; ++s) {
          const auto [key, value] = cache.codec_params(writer_of(c), s);
          KeyFormat::write(cache.quantizer().key, key, key_geometry, record.data());
          ValueFormat::write(cache.quantizer().value, value, value_geometry, record.data() + key_bytes);
          out.put_bytes(record);
        }
      }
    }
    {
      ByteSink out(tokens);
      out.put(static_cast<std::uint64_t>(options.tokens.size()));
      out.put_bytes(std::as_bytes(options.tokens));
    }

    // SLOT and PAGE in the same (layer, stream, page) order as META's page counts.
    const auto for_each_page = [&](auto&& visit) {
      for (index_t c = 0; c < h.cache_layers; ++c) {
        for (index_t s = 0; s < h.streams; ++s) {
          const std::size_t count = h.page_counts[static_cast<std::size_t>(c) * h.streams + s];
          for (const PageId id : cache.pages(seq, writer_of(c), s).subspan(options.first_page, count)) visit(id);
        }
      }
    };
    // A page's SLOT record is the start of the pool's metadata (slot positions, then the live
    // mask). Its PAGE bytes are the planes only: the gaps around them are padding the codecs
    // never write, which holds whatever a recycled slab held before (zeros in the file, so equal
    // pages give equal files).
    const std::vector<std::byte> zeros(std::max<std::size_t>(h.payload_bytes, kPageFileAlignment));
    const auto slot_runs = [&](PageId id, auto&& run) { run(std::span(cache.pool().metadata(id), h.slot_bytes)); };
    const auto page_runs = [&](PageId id, auto&& run) {
      const std::byte* payload = cache.pool().payload(id);
      run(std::span(payload, h.key_plane_bytes));
      run(std::span(zeros).first(h.value_plane_offset - h.key_plane_bytes));
      run(std::span(payload + h.value_plane_offset, h.value_plane_bytes));
      run(std::span(zeros).first(h.payload_bytes - h.value_plane_offset - h.value_plane_bytes));
    };
    std::uint32_t slots_crc = 0, pages_crc = 0;
    for_each_page([&](PageId id) {
      slot_runs(id, [&](std::span<const std::byte> bytes) { slots_crc = crc32c_extend(slots_crc, bytes); });
      page_runs(id, [&](std::span<const std::byte> bytes) { pages_crc = crc32c_extend(pages_crc, bytes); });
    });

    const std::uint64_t pages = h.total_pages();
    const std::uint64_t lengths[] = {meta.size(), params.size(), tokens.size(), pages * h.slot_bytes,
                                     pages * h.payload_bytes};
    const std::uint32_t crcs[] = {crc32c(meta), crc32c(params), crc32c(tokens), slots_crc, pages_crc};
    std::uint64_t file_bytes = kPreambleBytes;
    for (const std::uint64_t length : lengths) file_bytes += framed_section_bytes(length);
    const auto emit_run = [&](std::span<const std::byte> bytes) {
      if (!bytes.empty()) emit(bytes);
    };
    const auto preamble = preamble_bytes(file_bytes, static_cast<std::uint32_t>(kSectionOrder.size()));
    emit_run(preamble);
    for (std::size_t i = 0; i < kSectionOrder.size(); ++i) {
      const auto header = section_header_bytes(kSectionOrder[i], lengths[i], crcs[i]);
      emit_run(header);
      switch (kSectionOrder[i]) {
        case SectionTag::kMeta: emit_run(meta); break;
        case SectionTag::kParams: emit_run(params); break;
        case SectionTag::kTokens: emit_run(tokens); break;
        case SectionTag::kSlots: for_each_page([&](PageId id) { slot_runs(id, emit_run); }); break;
        case SectionTag::kPages: for_each_page([&](PageId id) { page_runs(id, emit_run); }); break;
      }
      emit_run(std::span(zeros).first(framed_section_bytes(lengths[i]) - kSectionHeaderBytes - lengths[i]));
    }
    return file_bytes;
  }
}

}  // namespace writer_detail

/// The page file of sequence `seq`, as bytes.
/// \throws kvpack::Error kUnsupported for a quantizer whose parameters page files cannot hold
///         (KVQuant, TurboQuant, QJL) or a sequence with tokens outside pages; kInvalidArgument
///         for an unknown sequence or options that do not fit (model_id over 256 bytes).
template <class Cache>
[[nodiscard]] std::vector<std::byte> write_page_file(const Cache& cache, SeqId seq, const PageFileOptions& options = {}) {
  std::vector<std::byte> file;
  writer_detail::emit_page_file(cache, seq, options, [&](std::span<const std::byte> bytes) {
    // The first run is the preamble, which declares the size: one allocation, no regrowth.
    if (file.empty()) file.reserve(static_cast<std::size_t>(writer_detail::declared_size(bytes)));
    file.insert(file.end(), bytes.begin(), bytes.end());
  });
  return file;
}

/// Streams the page file of `seq` to file descriptor `fd` (a file, a pipe, a socket): the same
/// bytes write_page_file returns, holding only the small sections in memory. Returns the bytes
/// written.
/// \throws kvpack::Error as write_page_file, before anything is written; kUnavailable when a
///         write fails (errno's text), with what was written before left in place.
template <class Cache>
std::uint64_t write_page_file(int fd, const Cache& cache, SeqId seq, const PageFileOptions& options = {}) {
  // Runs are small (a page's planes, its slot record): gathered into 1 MiB writes.
  constexpr std::size_t kBufferBytes = std::size_t{1} << 20;
  std::vector<std::byte> buffer;
  const auto flush = [&] {
    std::span<const std::byte> left(buffer);
    while (!left.empty()) {
      const ssize_t n = ::write(fd, left.data(), left.size());
      if (n < 0 && errno == EINTR) continue;
      KVPACK_CHECK(n > 0, kUnavailable,
                   detail::message("write_page_file: writing to file descriptor ", fd, " failed: ",
                                   n < 0 ? std::strerror(errno) : "no progress"));
      left = left.subspan(static_cast<std::size_t>(n));
    }
    buffer.clear();
  };
  const std::uint64_t bytes = writer_detail::emit_page_file(cache, seq, options, [&](std::span<const std::byte> run) {
    if (buffer.capacity() == 0) buffer.reserve(kBufferBytes);
    if (buffer.size() + run.size() > kBufferBytes) flush();
    buffer.insert(buffer.end(), run.begin(), run.end());
  });
  flush();
  return bytes;
}

namespace writer_detail {

/// Whether write_page_file(path) may replace `path` by renaming a temporary onto it: a new file
/// in a directory this process can write, or a regular file named directly (not through a
/// link: /dev/stdout redirected to a file is written where the shell has it open) that this
/// process owns and that has no other hard link. Replacing keeps the mode, not extended
/// attributes.
inline bool replaceable(const std::string& path, const struct stat* existing) {
  if (existing != nullptr &&
      (!S_ISREG(existing->st_mode) || existing->st_nlink != 1 || existing->st_uid != ::geteuid())) {
    return false;
  }
  const std::filesystem::path directory = std::filesystem::path(path).parent_path();
  return ::access(directory.empty() ? "." : directory.c_str(), W_OK) == 0;
}

}  // namespace writer_detail

/// Writes the page file of `seq` to `path`, streamed as above. Where it can (see
/// writer_detail::replaceable: a new file, or a regular file of its own) it writes a temporary
/// next to it and renames it into place (io::ReplacingFile): a failed or refused write leaves the
/// old file as it was, and a reader that has it mapped keeps the old bytes. Anything else (a
/// symbolic link, a pipe, a device, a file with other links or owner, or one in a directory it
/// cannot write) is truncated and written in place, as open(O_TRUNC) does. A replaced file is
/// fsynced before the rename (so a power loss cannot leave it empty); `options.durable` fsyncs
/// every file and the directory entry too.
/// \throws kvpack::Error as write_page_file; kInvalidArgument when the file cannot be created or
///         written.
template <class Cache>
void write_page_file(const std::string& path, const Cache& cache, SeqId seq, const PageFileOptions& options = {}) {
  const auto relabel = [&](const Error& error) {
    if (error.code() != ErrorCode::kUnavailable && error.code() != ErrorCode::kInvalidArgument) throw;
    detail::throw_error(ErrorCode::kInvalidArgument, detail::message("page file '", path, "': ", error.what()));
  };
  struct stat existing {};
  const bool exists = ::lstat(path.c_str(), &existing) == 0;
  if (writer_detail::replaceable(path, exists ? &existing : nullptr)) {
    try {
      ReplacingFile file(path, ErrorCode::kInvalidArgument);
      if (exists) file.set_mode(existing.st_mode);
      (void)write_page_file(file.fd(), cache, seq, options);
      using Sync = ReplacingFile::Sync;
      file.commit(options.durable ? Sync::kDurable : (exists ? Sync::kData : Sync::kNone));
    } catch (const Error& error) {
      relabel(error);
    }
    return;
  }
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  KVPACK_CHECK(fd >= 0, kInvalidArgument,
               detail::message("page file '", path, "' cannot be created: ", std::strerror(errno)));
  try {
    (void)write_page_file(fd, cache, seq, options);
    KVPACK_CHECK(!options.durable || ::fsync(fd) == 0 || errno == EINVAL, kInvalidArgument,
                 detail::message("fsync failed: ", std::strerror(errno)));  // EINVAL: a pipe, nothing to sync
  } catch (const Error& error) {
    ::close(fd);
    relabel(error);
  } catch (...) {
    ::close(fd);
    throw;
  }
  KVPACK_CHECK(::close(fd) == 0, kInvalidArgument,
               detail::message("page file '", path, "': write failed: ", std::strerror(errno)));
}

}  // namespace kvpack::inline v0::io
