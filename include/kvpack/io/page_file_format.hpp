#pragma once
/// \file page_file_format.hpp
/// \brief The constants of the KV page file format (version 1) and PageFileHeader, everything
///        needed to interpret its page bytes. The README's "KV page files" section gives the
///        format byte by byte.
///
/// A file is a 64-byte preamble and five sections, in this order: META (this header), PARM
/// (codec parameters per cache layer and stream), TOKN (token ids, possibly none), SLOT (each
/// page's slot positions and live mask), PAGE (each page's payload, exactly as the kernels read
/// it). Each section is a 64-byte section header (tag, body length, CRC32C of the body, CRC32C of
/// the section header) followed by its body, and starts at a multiple of 64, so that page payloads
/// in a memory-mapped file keep the 64-byte alignment the pool gives them.

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kvpack/core/types.hpp"

namespace kvpack::inline v0::io {

inline constexpr std::array<char, 8> kPageFileMagic = {'K', 'V', 'P', 'K', 'P', 'A', 'G', 'E'};
inline constexpr std::uint32_t kPageFileVersion = 1;
/// Preamble, section headers and section starts are all aligned to this.
inline constexpr std::size_t kPageFileAlignment = 64;
inline constexpr std::size_t kPreambleBytes = 64;
inline constexpr std::size_t kSectionHeaderBytes = 64;

/// Section tags: four ASCII letters, read as a little-endian u32.
enum class SectionTag : std::uint32_t {
  kMeta = 0x4154454Du,   ///< "META"
  kParams = 0x4D524150u,  ///< "PARM"
  kTokens = 0x4E4B4F54u,  ///< "TOKN"
  kSlots = 0x544F4C53u,   ///< "SLOT"
  kPages = 0x45474150u,   ///< "PAGE"
};
inline constexpr std::array<SectionTag, 5> kSectionOrder = {SectionTag::kMeta, SectionTag::kParams, SectionTag::kTokens,
                                                            SectionTag::kSlots, SectionTag::kPages};

/// How a plane's per-(layer, stream) parameters are stored in PARM.
enum class ParamsKind : std::uint32_t {
  kNone = 0,      ///< the codec has none (0 bytes)
  kFP8Scale = 1,  ///< one f32: FP8Params::scale
  kKVQuantKey = 2,    ///< outlier fraction, codebooks, the stream's key ranges (params_format.hpp)
  kKVQuantValue = 3,  ///< outlier fraction, codebooks
  kTurbo = 4,         ///< TurboQuant's rate, rotation and seeds
  kQjl = 5,           ///< QJL's sketch rows and seeds
};

/// Limits the reader applies to header fields before it sizes anything from them: generous for
/// any model kvpack serves, small enough that no product of them overflows 64 bits.
struct PageFileLimits {
  static constexpr std::size_t kMaxString = 256;
  static constexpr std::int64_t kMaxLayers = 4096;
  static constexpr std::int64_t kMaxHeads = 4096;
  static constexpr std::int64_t kMaxHeadDim = 16384;
  static constexpr std::uint64_t kMaxPageBytes = std::uint64_t{1} << 26;  // 64 MiB per page
  static constexpr std::uint64_t kMaxTokens = std::uint64_t{1} << 31;
};

/// Everything a reader needs to interpret the page bytes (section META).
struct PageFileHeader {
  std::string model_id;        ///< the caller's name for the model (free text, may be empty)
  std::string layout;          ///< Layout::kName: "gqa" or "cross_layer"
  index_t layers_per_cache = 1;  ///< CrossLayer's K; 1 for GQA
  ModelShape shape{};
  index_t cache_layers = 0;  ///< layers that keep a cache: ⌈layers / layers_per_cache⌉
  index_t streams = 0;       ///< KV streams per cache layer (KV heads)
  index_t key_dim = 0;
  index_t value_dim = 0;
  index_t page_size = 0;
  /// Keys stored before RoPE (CacheConfig::key_rope): kernels rotate them by position when read.
  bool keys_before_rope = false;
  std::uint32_t rope_pairing = 0;  ///< RopePairing, when keys_before_rope
  double rope_theta = 0.0;
  std::int64_t rope_max_position = 0;
  std::string quantizer;    ///< Quantizer::name(), e.g. "q8_0", "kivi2_g32", "q8_0/q4_0"
  std::string key_codec;    ///< key_codec::kName
  std::uint32_t key_group = 0;    ///< the codec's group size where it has one (KIVI), else 0
  std::string value_codec;  ///< value_codec::kName
  std::uint32_t value_group = 0;
  std::uint64_t key_plane_bytes = 0;     ///< K plane at offset 0 of a payload
  std::uint64_t value_plane_offset = 0;  ///< V plane's offset in a payload (a multiple of 64)
  std::uint64_t value_plane_bytes = 0;
  std::uint64_t payload_bytes = 0;  ///< payload stride: a multiple of 64
  std::uint64_t slot_bytes = 0;     ///< SLOT record per page: int32 positions[page_size], u64 live mask words
  std::uint64_t sequence_tokens = 0;  ///< tokens the sequence held in its first cache layer
  std::vector<std::uint32_t> page_counts;  ///< [cache_layers][streams] pages, in token order per stream

  [[nodiscard]] std::uint64_t total_pages() const noexcept {
    std::uint64_t total = 0;
    for (const std::uint32_t n : page_counts) total += n;
    return total;
  }
  [[nodiscard]] std::size_t live_mask_words() const noexcept {
    return static_cast<std::size_t>(page_size + 63) / 64;
  }
};

}  // namespace kvpack::inline v0::io
