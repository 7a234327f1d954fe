#pragma once
/// \file kvquant.hpp
/// \brief quant::KVQuant<Bits>: KVQuant's non-uniform codes (ALGORITHMS.md §2) — keys per channel
///        with ranges calibrated offline, values per token, a nuqX codebook per layer and plane,
///        and dense-and-sparse outliers kept exactly.
///
/// Every vector is normalised to [−1, 1] by an offset z = (hi + lo)/2 and a half-range
/// r = (hi − lo)/2 and each element rounded to the nearest codebook level ℓ; decode gives
/// ℓ·r + z. Keys use per-channel (lo, hi) from a calibration pass (KVQuantCalibrator: the
/// f/2 and 1 − f/2 quantiles of sample keys, f the outlier fraction); values use each token's
/// own (lo, hi) after its outliers are removed. The codebooks (one per layer for K, one for V)
/// are the normal-float levels or calibrated by weighted k-means (quant/nuq.hpp).
///
/// Outliers: each page keeps C = round(f · page_size · head_dim) elements exactly, as fp16 with
/// their index (t · head_dim + c). Key candidates are the elements outside their channel's
/// calibrated range; value candidates the ⌈f/2 · head_dim⌉ largest and smallest elements of each
/// token. When a page has more candidates than C, those furthest outside (relative to the
/// vector's half-range) are kept and the rest are rounded like any other element — the fixed
/// capacity of KVQuant's "capped" outliers, so pages keep one size.
///
/// Key plane (P = page_size, d = head_dim, b = Bits): `codes[d][P·b/8]` (a channel's P codes
/// packed along tokens, code j at bit b·j), then the outlier section. Value plane:
/// `codes[P][d·b/8]`, `fp16 offset[P]`, `fp16 half_range[P]`, then the outlier section.
/// Outlier section: `u16 count`, `u16 index[C]` (ascending), `fp16 value[C]`.
/// Bits per element: keys b + (32·C + 16)/(P·d) (≈ b + 32f; the calibrated ranges are per layer,
/// ≈ 0 per token at long contexts); values b + 32/d + (32·C + 16)/(P·d).
///
/// Deviations from the reference, and why: outliers are capped per page rather than per token
/// (fixed page sizes), and the per-token V statistics are per KV head (d elements) rather than per
/// token of the whole k_proj output (n_kv·d), because pages are per KV head (DESIGN.md §2); at
/// d = 128 that costs 0.25 bits per V element more than the paper's accounting. Q-Norm (§2.5) is
/// a calibration option (KVQuantCalibrator::Options::q_norm, off by default). The sink token is kept exact by the cache (CacheConfig::exact_prefix_tokens), not
/// by the codec.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kvpack/config.hpp"
#include "kvpack/core/half.hpp"
#include "kvpack/core/types.hpp"
#include "kvpack/error.hpp"
#include "kvpack/quant/nuq.hpp"
#include "kvpack/quant/packed_codes.hpp"
#include "kvpack/quant/quant_concepts.hpp"

namespace kvpack::inline v0::quant {

/// What KVQuant calibrates offline, for every (layer, KV head): per-channel key offsets and
/// half-ranges, and one key and one value codebook per layer. Immutable once built.
struct KVQuantTables {
  index_t layers = 0;
  index_t kv_heads = 0;
  index_t head_dim = 0;
  int bits = 0;
  std::vector<float> key_offset;      ///< [layers][kv_heads][head_dim]
  std::vector<float> key_half_range;  ///< [layers][kv_heads][head_dim], > 0
  std::vector<nuq::Codebook> key_codebook;    ///< [layers] the levels codes decode to
  std::vector<nuq::Codebook> value_codebook;  ///< [layers]
  /// Q-Norm (ALGORITHMS.md §2.5): elements are rounded to these levels, then decoded with the
  /// affinely corrected `*_codebook` ones. [layers], or empty: rounded to `*_codebook` itself.
  std::vector<nuq::Codebook> key_encode_codebook;
  std::vector<nuq::Codebook> value_encode_codebook;
  /// The share of elements the calibration left out of the ranges as outliers (set by
  /// KVQuantCalibrator; empty for tables built by hand or read from a page file). A KVQuant that
  /// keeps another share exactly would clamp elements the ranges were not fitted to: refused.
  std::optional<double> outlier_fraction;

  [[nodiscard]] std::size_t bytes() const noexcept {
    return (key_offset.size() + key_half_range.size()) * sizeof(float) +
           (key_codebook.size() + value_codebook.size() + key_encode_codebook.size() + value_encode_codebook.size()) *
               sizeof(nuq::Codebook);
  }
};

/// A key page's parameters: pointers into the quantizer's KVQuantTables, and the outlier
/// fraction (it sizes the page's outlier section), so a page decodes from its params alone.
struct KVQuantKeyParams {
  const float* offset = nullptr;      ///< [head_dim]
  const float* half_range = nullptr;  ///< [head_dim]
  const nuq::Codebook* codebook = nullptr;         ///< decoded levels
  const nuq::Codebook* encode_codebook = nullptr;  ///< levels elements are rounded to; nullptr: codebook
  double outlier_fraction = 0.0;

  [[nodiscard]] const nuq::Codebook& rounding() const noexcept { return encode_codebook ? *encode_codebook : *codebook; }
  /// Equal when they point into the same tables (page files compare the values they reach).
  friend bool operator==(const KVQuantKeyParams&, const KVQuantKeyParams&) = default;
};

/// A value page's parameters: the layer's value codebooks and the outlier fraction.
struct KVQuantValueParams {
  const nuq::Codebook* codebook = nullptr;
  const nuq::Codebook* encode_codebook = nullptr;
  double outlier_fraction = 0.0;

  [[nodiscard]] const nuq::Codebook& rounding() const noexcept { return encode_codebook ? *encode_codebook : *codebook; }
  friend bool operator==(const KVQuantValueParams&, const KVQuantValueParams&) = default;
};

namespace kvquant_detail {

/// Reads a 16-bit window when the code crosses a byte; the planes keep the byte after every
/// row readable (the next row or the outlier section follows). The CUDA decoders call it too.
template <int Bits>
KVPACK_HOST_DEVICE unsigned get_code(const std::byte* row, index_t j) noexcept {
  const std::size_t bit = static_cast<std::size_t>(j) * Bits;
  unsigned window = static_cast<unsigned>(row[bit / 8]);
  if (bit % 8 + Bits > 8) window |= static_cast<unsigned>(row[bit / 8 + 1]) << 8;
  return (window >> (bit % 8)) & ((1u << Bits) - 1);
}

inline void put_u16(std::byte* at, std::uint16_t x) noexcept { std::memcpy(at, &x, sizeof(x)); }
inline std::uint16_t get_u16(const std::byte* at) noexcept {
  std::uint16_t x;
  std::memcpy(&x, at, sizeof(x));
  return x;
}

/// An element that may be stored exactly: its index t·d + c and how far outside its vector's
/// range it lies, in half-ranges.
struct Candidate {
  std::uint32_t index;
  float excess;
};

/// The most outliers one page keeps: outlier_fraction ≤ 0.05 of page_size · head_dim ≤ 65536.
inline constexpr std::size_t kMaxOutliers = 3277;

/// The `capacity` candidates furthest outside (ties: lower index) of those offered, in fixed
/// storage so encoding never allocates (the cache encodes after its last possible throw).
class FurthestCandidates {
 public:
  explicit FurthestCandidates(std::size_t capacity) noexcept : capacity_(std::min(capacity, kMaxOutliers)) {}
  void offer(Candidate c) noexcept {
    if (capacity_ == 0) return;
    if (!(c.excess >= 0.0f)) c.excess = INFINITY;  // a NaN value (unchecked input): keep it exactly
    if (size_ < capacity_) {
      heap_[size_++] = c;
      std::push_heap(heap_, heap_ + size_, closer);
    } else if (closer(c, heap_[0])) {
      std::pop_heap(heap_, heap_ + size_, closer);
      heap_[size_ - 1] = c;
      std::push_heap(heap_, heap_ + size_, closer);
    }
  }
  /// The kept candidates by ascending index.
  std::span<const Candidate> sorted() noexcept {
    std::sort(heap_, heap_ + size_, [](const Candidate& a, const Candidate& b) { return a.index < b.index; });
    return {heap_, size_};
  }

 private:
  /// "a ranks before b": further outside, or as far and earlier. The heap's top is the last kept.
  static bool closer(const Candidate& a, const Candidate& b) noexcept {
    return a.excess != b.excess ? a.excess > b.excess : a.index < b.index;
  }
  Candidate heap_[kMaxOutliers];
  std::size_t size_ = 0;
  std::size_t capacity_;
};

/// The outlier section: count, indices, fp16 values.
struct OutlierSection {
  std::size_t capacity = 0;
  [[nodiscard]] std::size_t bytes() const noexcept { return 2 + 4 * capacity; }
  void write(std::byte* at, std::span<const Candidate> kept, const float* src, std::ptrdiff_t row_stride,
             index_t head_dim) const noexcept {
    put_u16(at, static_cast<std::uint16_t>(kept.size()));
    for (std::size_t i = 0; i < kept.size(); ++i) {
      const index_t t = static_cast<index_t>(kept[i].index / head_dim), c = static_cast<index_t>(kept[i].index % head_dim);
      put_u16(at + 2 + 2 * i, static_cast<std::uint16_t>(kept[i].index));
      put_u16(at + 2 + 2 * capacity + 2 * i, half(src[t * row_stride + c]).bits);
    }
  }
  /// Whether decoders and kernels can apply the section: at most `capacity` entries, each
  /// indexing an element of the page (they write and index rows by it).
  [[nodiscard]] bool valid(const std::byte* at, PageGeometry g) const noexcept {
    const std::size_t count = get_u16(at);
    const std::size_t elements = static_cast<std::size_t>(g.page_size) * static_cast<std::size_t>(g.head_dim);
    if (count > capacity) return false;
    for (std::size_t i = 0; i < count; ++i) {
      if (get_u16(at + 2 + 2 * i) >= elements) return false;
    }
    return true;
  }
  /// Overwrites the outliers' decoded values in a token-major [P][d] page.
  void apply(const std::byte* at, float* rows) const noexcept {
    const std::size_t count = std::min<std::size_t>(get_u16(at), capacity);
    for (std::size_t i = 0; i < count; ++i) {
      rows[get_u16(at + 2 + 2 * i)] = half::from_bits(get_u16(at + 2 + 2 * capacity + 2 * i));
    }
  }
};

[[nodiscard]] inline std::size_t outlier_capacity(double fraction, PageGeometry g) noexcept {
  return static_cast<std::size_t>(std::llround(fraction * g.page_size * g.head_dim));
}

/// ⌈f/2 · d⌉: the largest and the smallest elements of each token that are value candidates.
[[nodiscard]] inline index_t candidates_per_side(double fraction, index_t head_dim) noexcept {
  return fraction > 0.0 ? static_cast<index_t>(std::ceil(fraction / 2.0 * head_dim - 1e-9)) : 0;
}

/// The key codec's outlier choice for `tokens` rows of `d` elements: every element outside its
/// channel's calibrated range is offered to `kept`, ranked by how far outside, in half-ranges.
/// KVQuantCalibrator makes the same choice, so that the key codebook sees what pages clamp.
inline void offer_key_candidates(const float* src, std::ptrdiff_t row_stride, index_t tokens, index_t d,
                                 const float* offset, const float* half_range, FurthestCandidates& kept) noexcept {
  for (index_t t = 0; t < tokens; ++t) {
    for (index_t c = 0; c < d; ++c) {
      const float excess = std::fabs(src[t * row_stride + c] - offset[c]) / half_range[c] - 1.0f;
      // A NaN key (unchecked input) is no candidate: it encodes as a code, as in other codecs.
      if (excess > 0.0f) kept.offer({static_cast<std::uint32_t>(t * d + c), excess});
    }
  }
}

/// The value codec's outlier choice for `tokens` rows of `d` ≤ 4096 elements: each row's `side`
/// smallest and `side` largest elements are offered to `kept`, ranked by how far they stretch the
/// range of the row's other elements, in half-ranges. KVQuantCalibrator makes the same choice, so
/// that the value codebook is fitted to the ranges pages store.
inline void offer_value_candidates(const float* src, std::ptrdiff_t row_stride, index_t tokens, index_t d,
                                   index_t side, FurthestCandidates& kept) noexcept {
  // side ≤ ⌈0.025 · head_dim⌉ < head_dim / 2.
  std::uint16_t lowest[4096], highest[4096];
  bool candidate[4096];
  for (index_t t = 0; t < tokens && side > 0; ++t) {
    const float* x = src + t * row_stride;
    // A total order even for unchecked NaN input (NaN sorts as +inf), as the heaps need.
    auto key = [&](std::uint16_t i) { return x[i] != x[i] ? INFINITY : x[i]; };
    auto below = [&](std::uint16_t a, std::uint16_t b) { return key(a) != key(b) ? key(a) < key(b) : a < b; };
    auto above = [&](std::uint16_t a, std::uint16_t b) { return below(b, a); };
    // The `side` smallest and the `side` largest in one pass, each in a heap whose top is its
    // least extreme member. `side` is 1 at head_dim 128: two std::nth_element partitions of
    // every token took a fifth of an append. Only the sets matter (`kept` orders its offers).
    for (index_t c = 0; c < d; ++c) {
      const auto i = static_cast<std::uint16_t>(c);
      candidate[c] = false;
      if (c < side) {
        lowest[c] = highest[c] = i;
        std::push_heap(lowest, lowest + c + 1, below);
        std::push_heap(highest, highest + c + 1, above);
        continue;
      }
      if (below(i, lowest[0])) {
        std::pop_heap(lowest, lowest + side, below);
        lowest[side - 1] = i;
        std::push_heap(lowest, lowest + side, below);
      }
      if (above(i, highest[0])) {
        std::pop_heap(highest, highest + side, above);
        highest[side - 1] = i;
        std::push_heap(highest, highest + side, above);
      }
    }
    for (index_t i = 0; i < side; ++i) candidate[lowest[i]] = candidate[highest[i]] = true;
    // How far each candidate stretches the range of the elements that are not candidates.
    float lo_inner = INFINITY, hi_inner = -INFINITY;
    for (index_t c = 0; c < d; ++c) {
      if (candidate[c]) continue;
      lo_inner = std::min(lo_inner, x[c]);
      hi_inner = std::max(hi_inner, x[c]);
    }
    const float inner_half = std::max(0.5f * (hi_inner - lo_inner), 1e-30f);
    for (index_t i = 0; i < side; ++i) {
      kept.offer({static_cast<std::uint32_t>(t * d + lowest[i]), (lo_inner - x[lowest[i]]) / inner_half});
      kept.offer({static_cast<std::uint32_t>(t * d + highest[i]), (x[highest[i]] - hi_inner) / inner_half});
    }
  }
}

/// Row t's smallest and largest elements that are not kept exactly: `exact` is sorted by index
/// t·d + c and `next` is its first entry of row t or later (advanced past row t's). {0, 0} when
/// every element of the row is exact.
[[nodiscard]] inline std::pair<float, float> range_without_exact(const float* x, index_t t, index_t d,
                                                                 std::span<const Candidate> exact,
                                                                 std::size_t& next) noexcept {
  float lo = INFINITY, hi = -INFINITY;
  for (index_t c = 0; c < d; ++c) {
    if (next < exact.size() && exact[next].index == static_cast<std::uint32_t>(t * d + c)) {
      ++next;
      continue;
    }
    lo = std::min(lo, x[c]);
    hi = std::max(hi, x[c]);
  }
  return lo <= hi ? std::pair{lo, hi} : std::pair{0.0f, 0.0f};
}

}  // namespace kvquant_detail

/// Limits shared by both planes.
template <int Bits>
struct KVQuantTraits {
  static_assert(Bits >= 2 && Bits <= 4, "KVQuant stores 2-, 3- or 4-bit codes");
  static constexpr int kBits = Bits;
  /// Decoding then encoding a page need not give its bytes back (the per-token ranges and the
  /// outliers are chosen again from rounded values), so loaders cannot check pages that way.
  static constexpr bool kReencodeStable = false;
  std::shared_ptr<const KVQuantTables> tables;
  double outlier_fraction = 0.01;

  /// A page's outlier section at `fraction` (decoding reads it from the params).
  [[nodiscard]] static kvquant_detail::OutlierSection outliers(PageGeometry g, double fraction) noexcept {
    return {kvquant_detail::outlier_capacity(fraction, g)};
  }
  [[nodiscard]] kvquant_detail::OutlierSection outliers(PageGeometry g) const noexcept {
    return outliers(g, outlier_fraction);
  }

  /// fp16 outliers and per-token ranges must stay finite.
  [[nodiscard]] float max_abs_input() const noexcept { return 32752.0f; }

  void validate_common(PageGeometry g, const char* plane) const {
    KVPACK_CHECK(tables != nullptr, kInvalidConfig,
                 ::kvpack::detail::message("KVQuant ", plane, " codec has no calibration: build one with "
                                           "quant::KVQuantCalibrator and construct quant::KVQuant<b>(tables)"));
    KVPACK_CHECK(tables->bits == Bits && tables->head_dim == g.head_dim, kInvalidConfig,
                 ::kvpack::detail::message("KVQuant<", Bits, "> got a calibration for ", tables->bits,
                                           " bits and head_dim ", tables->head_dim, "; the cache has head_dim ",
                                           g.head_dim));
    KVPACK_CHECK((tables->key_encode_codebook.empty() || tables->key_encode_codebook.size() == tables->key_codebook.size()) &&
                     (tables->value_encode_codebook.empty() ||
                      tables->value_encode_codebook.size() == tables->value_codebook.size()),
                 kInvalidConfig, "KVQuant's Q-Norm rounding codebooks must be absent or one per layer, like the codebooks");
    validate_tables(*tables, std::string_view(plane) == "key");
    KVPACK_CHECK(!tables->outlier_fraction || *tables->outlier_fraction == outlier_fraction, kInvalidConfig,
                 ::kvpack::detail::message("KVQuant's ", plane, " codec keeps ", outlier_fraction,
                                           " of elements as outliers, but its tables were calibrated leaving out ",
                                           tables->outlier_fraction.value_or(0.0)));
    validate_geometry(g, outlier_fraction);
  }

  /// The cache's model shape (model layers, KV streams) must be the calibration's: rows of
  /// another shape would be read as this model's heads and layers.
  void check_model(index_t layers, index_t kv_heads) const {
    KVPACK_CHECK(tables != nullptr && tables->layers == layers && tables->kv_heads == kv_heads, kInvalidConfig,
                 ::kvpack::detail::message("KVQuant's calibration covers ", tables ? tables->layers : 0, " layers x ",
                                           tables ? tables->kv_heads : 0, " KV heads; the cache's model has ", layers,
                                           " x ", kv_heads));
  }

  /// Tables built by hand rather than by KVQuantCalibrator, as far as one plane's codec reads
  /// them (quant::Mixed pairs KVQuant with another codec, whose plane's arrays stay empty): every
  /// array of its documented size, codebooks of 2^Bits finite levels (sorted where elements are
  /// rounded to them), ranges finite with positive half-ranges. The codecs index them without
  /// further checks.
  static void validate_tables(const KVQuantTables& t, bool key_plane) {
    const auto fail = [](const char* what) {
      ::kvpack::detail::throw_error(ErrorCode::kInvalidConfig, ::kvpack::detail::message("KVQuantTables: ", what));
    };
    if (t.layers <= 0 || t.kv_heads <= 0) fail("layers and kv_heads must be positive");
    const std::size_t channels = static_cast<std::size_t>(t.layers) * t.kv_heads * t.head_dim;
    if (key_plane && (t.key_offset.size() != channels || t.key_half_range.size() != channels)) {
      fail("key_offset and key_half_range must hold layers x kv_heads x head_dim values");
    }
    for (std::size_t i = 0; key_plane && i < channels; ++i) {
      if (!std::isfinite(t.key_offset[i]) || !(t.key_half_range[i] > 0.0f && std::isfinite(t.key_half_range[i]))) {
        fail("key ranges must be finite, with half-ranges > 0");
      }
    }
    const std::vector<nuq::Codebook>& books = key_plane ? t.key_codebook : t.value_codebook;
    const std::vector<nuq::Codebook>& rounding = key_plane ? t.key_encode_codebook : t.value_encode_codebook;
    if (books.size() != static_cast<std::size_t>(t.layers)) fail("a plane's codebooks must be one per layer");
    const auto check = [&](const nuq::Codebook& book, bool rounded_to) {
      if (book.size != (1 << Bits)) fail("a codebook does not have 2^bits levels");
      for (int i = 0; i < book.size; ++i) {
        if (!std::isfinite(book.levels[i])) fail("a codebook level is not finite");
        if (rounded_to && i > 0 && book.levels[i - 1] > book.levels[i]) fail("a codebook rounded to is not sorted");
      }
    };
    for (std::size_t layer = 0; layer < books.size(); ++layer) {
      check(books[layer], rounding.empty());
      if (!rounding.empty()) check(rounding[layer], true);
    }
  }

  /// The checks that need no calibration: an outlier fraction in range and a geometry the
  /// planes can store (page files check these before they have any tables).
  static void validate_geometry(PageGeometry g, double outlier_fraction) {
    KVPACK_CHECK(outlier_fraction >= 0.0 && outlier_fraction <= 0.05, kInvalidConfig,
                 ::kvpack::detail::message("KVQuant outlier_fraction must be in [0, 0.05], got ", outlier_fraction));
    // Keys pack 8 tokens' codes per Bits bytes; a page of at least 16 tokens keeps head_dim ≤
    // 4096, the value encoder's per-token scratch.
    KVPACK_CHECK(g.head_dim % 8 == 0 && g.page_size >= 16 && g.page_size % 8 == 0 &&
                     static_cast<std::int64_t>(g.page_size) * g.head_dim <= 65536,
                 kUnsupported,
                 ::kvpack::detail::message("KVQuant packs 8 codes per ", Bits, " bytes and indexes outliers in 16 bits: "
                                           "head_dim ", g.head_dim, " must be a multiple of 8, page_size ",
                                           g.page_size, " a multiple of 8 and at least 16, and page_size · head_dim "
                                           "at most 65536"));
  }

  void check_stream(index_t layer, index_t stream) const {
    KVPACK_CHECK(tables != nullptr && layer < tables->layers && stream < tables->kv_heads, kInvalidConfig,
                 ::kvpack::detail::message("KVQuant's calibration covers ", tables ? tables->layers : 0, " layers x ",
                                           tables ? tables->kv_heads : 0, " KV heads; the cache asked for layer ", layer,
                                           ", KV head ", stream));
  }
};

/// KVQuant's key plane: per channel, calibrated ranges.
template <int Bits>
struct KVQuantKeyCodec : KVQuantTraits<Bits> {
  using params_type = KVQuantKeyParams;
  static constexpr std::string_view kName = Bits == 2 ? "nuq2_key" : (Bits == 3 ? "nuq3_key" : "nuq4_key");
  static constexpr Plane kPlane = Plane::kKey;

  void validate(PageGeometry g) const { this->validate_common(g, "key"); }
  [[nodiscard]] static constexpr std::size_t row_bytes(PageGeometry g) noexcept {
    return static_cast<std::size_t>(g.page_size) * Bits / 8;
  }
  [[nodiscard]] static constexpr std::size_t outliers_offset(PageGeometry g) noexcept {
    return row_bytes(g) * static_cast<std::size_t>(g.head_dim);
  }
  [[nodiscard]] std::size_t plane_bytes(PageGeometry g) const noexcept {
    return outliers_offset(g) + this->outliers(g).bytes();
  }
  [[nodiscard]] double nominal_bits_per_element(index_t) const noexcept { return Bits + 32.0 * this->outlier_fraction; }
  /// The plane's structure decoders and kernels rely on (its outlier section).
  [[nodiscard]] bool valid_encoding(PageGeometry g, const std::byte* plane, const params_type& p) const noexcept {
    return this->outliers(g, p.outlier_fraction).valid(plane + outliers_offset(g), g);
  }
  [[nodiscard]] params_type initial_params(index_t layer, index_t stream) const {
    this->check_stream(layer, stream);
    const std::size_t at = (static_cast<std::size_t>(layer) * this->tables->kv_heads + stream) * this->tables->head_dim;
    const bool q_norm = !this->tables->key_encode_codebook.empty();
    return {this->tables->key_offset.data() + at, this->tables->key_half_range.data() + at,
            &this->tables->key_codebook[layer], q_norm ? &this->tables->key_encode_codebook[layer] : nullptr,
            this->outlier_fraction};
  }

  void encode(PageGeometry g, const float* src, std::ptrdiff_t row_stride, const params_type& p,
              std::byte* dst) const noexcept {
    std::fill(dst, dst + plane_bytes(g), std::byte{0});
    const kvquant_detail::OutlierSection section = this->outliers(g);
    kvquant_detail::FurthestCandidates kept(section.capacity);
    kvquant_detail::offer_key_candidates(src, row_stride, g.page_size, g.head_dim, p.offset, p.half_range, kept);
    section.write(dst + outliers_offset(g), kept.sorted(), src, row_stride, g.head_dim);
    const nuq::NearestLevel nearest(p.rounding());
    for (index_t c = 0; c < g.head_dim; ++c) {
      put_codes<Bits>(dst + row_bytes(g) * c, 0, g.page_size, [&](index_t t) {
        return nearest(std::clamp((src[t * row_stride + c] - p.offset[c]) / p.half_range[c], -1.0f, 1.0f));
      });
    }
  }

  void decode(PageGeometry g, const std::byte* plane, const params_type& p, float* dst) const noexcept {
    for (index_t c = 0; c < g.head_dim; ++c) {
      const std::byte* row = plane + row_bytes(g) * c;
      for (index_t t = 0; t < g.page_size; ++t) {
        const float level = p.codebook->levels[kvquant_detail::get_code<Bits>(row, t)];
        dst[static_cast<std::size_t>(t) * g.head_dim + c] = level * p.half_range[c] + p.offset[c];
      }
    }
    this->outliers(g, p.outlier_fraction).apply(plane + outliers_offset(g), dst);
  }

  friend bool operator==(const KVQuantKeyCodec& a, const KVQuantKeyCodec& b) noexcept {
    return a.tables == b.tables && a.outlier_fraction == b.outlier_fraction;
  }
};

/// KVQuant's value plane: per token, its own range once its outliers are out.
template <int Bits>
struct KVQuantValueCodec : KVQuantTraits<Bits> {
  using params_type = KVQuantValueParams;
  static constexpr std::string_view kName = Bits == 2 ? "nuq2_value" : (Bits == 3 ? "nuq3_value" : "nuq4_value");
  static constexpr Plane kPlane = Plane::kValue;

  void validate(PageGeometry g) const { this->validate_common(g, "value"); }
  [[nodiscard]] static constexpr std::size_t row_bytes(PageGeometry g) noexcept {
    return static_cast<std::size_t>(g.head_dim) * Bits / 8;
  }
  [[nodiscard]] static constexpr std::size_t offsets_offset(PageGeometry g) noexcept {
    return row_bytes(g) * static_cast<std::size_t>(g.page_size);
  }
  [[nodiscard]] static constexpr std::size_t ranges_offset(PageGeometry g) noexcept {
    return offsets_offset(g) + 2 * static_cast<std::size_t>(g.page_size);
  }
  [[nodiscard]] static constexpr std::size_t outliers_offset(PageGeometry g) noexcept {
    return ranges_offset(g) + 2 * static_cast<std::size_t>(g.page_size);
  }
  [[nodiscard]] std::size_t plane_bytes(PageGeometry g) const noexcept {
    return outliers_offset(g) + this->outliers(g).bytes();
  }
  [[nodiscard]] double nominal_bits_per_element(index_t head_dim) const noexcept {
    return Bits + 32.0 / head_dim + 32.0 * this->outlier_fraction;
  }
  /// As for keys.
  [[nodiscard]] bool valid_encoding(PageGeometry g, const std::byte* plane, const params_type& p) const noexcept {
    return this->outliers(g, p.outlier_fraction).valid(plane + outliers_offset(g), g);
  }
  [[nodiscard]] params_type initial_params(index_t layer, index_t stream) const {
    this->check_stream(layer, stream);
    const bool q_norm = !this->tables->value_encode_codebook.empty();
    return {&this->tables->value_codebook[layer], q_norm ? &this->tables->value_encode_codebook[layer] : nullptr,
            this->outlier_fraction};
  }

  void encode(PageGeometry g, const float* src, std::ptrdiff_t row_stride, const params_type& p,
              std::byte* dst) const noexcept {
    using kvquant_detail::Candidate;
    std::fill(dst, dst + plane_bytes(g), std::byte{0});
    const index_t d = g.head_dim;
    const index_t side = kvquant_detail::candidates_per_side(this->outlier_fraction, d);
    const kvquant_detail::OutlierSection section = this->outliers(g);
    kvquant_detail::FurthestCandidates kept(section.capacity);
    kvquant_detail::offer_value_candidates(src, row_stride, g.page_size, d, side, kept);
    const std::span<const Candidate> exact = kept.sorted();
    section.write(dst + outliers_offset(g), exact, src, row_stride, d);
    const nuq::NearestLevel nearest(p.rounding());
    std::size_t next_exact = 0;  // exact is sorted by index = t·d + c
    for (index_t t = 0; t < g.page_size; ++t) {
      const float* x = src + t * row_stride;
      const auto [lo, hi] = kvquant_detail::range_without_exact(x, t, d, exact, next_exact);
      // Stored in fp16; encode with the rounded numbers decode will use.
      const float offset = half(0.5f * (hi + lo));
      const float half_range = half(0.5f * (hi - lo));
      kvquant_detail::put_u16(dst + offsets_offset(g) + 2 * t, half(offset).bits);
      kvquant_detail::put_u16(dst + ranges_offset(g) + 2 * t, half(half_range).bits);
      put_codes<Bits>(dst + row_bytes(g) * t, 0, d, [&](index_t c) {
        return nearest(half_range > 0.0f ? std::clamp((x[c] - offset) / half_range, -1.0f, 1.0f) : 0.0f);
      });
    }
  }

  void decode(PageGeometry g, const std::byte* plane, const params_type& p, float* dst) const noexcept {
    for (index_t t = 0; t < g.page_size; ++t) {
      const std::byte* row = plane + row_bytes(g) * t;
      const float offset = half::from_bits(kvquant_detail::get_u16(plane + offsets_offset(g) + 2 * t));
      const float half_range = half::from_bits(kvquant_detail::get_u16(plane + ranges_offset(g) + 2 * t));
      for (index_t c = 0; c < g.head_dim; ++c) {
        const float level = p.codebook->levels[kvquant_detail::get_code<Bits>(row, c)];
        dst[static_cast<std::size_t>(t) * g.head_dim + c] = level * half_range + offset;
      }
    }
    this->outliers(g, p.outlier_fraction).apply(plane + outliers_offset(g), dst);
  }

  friend bool operator==(const KVQuantValueCodec& a, const KVQuantValueCodec& b) noexcept {
    return a.tables == b.tables && a.outlier_fraction == b.outlier_fraction;
  }
};

/// KVQuant: nuq`Bits` keys per channel (calibrated ranges) and values per token, with a fraction
/// of outliers kept exactly. Needs a calibration (KVQuantCalibrator); pair it with
/// CacheConfig::key_rope (pre-RoPE keys) and exact_prefix_tokens = 1 (the sink) as published.
template <int Bits>
struct KVQuant {
  using key_codec = KVQuantKeyCodec<Bits>;
  using value_codec = KVQuantValueCodec<Bits>;
  key_codec key{};
  value_codec value{};

  KVQuant() = default;
  explicit KVQuant(std::shared_ptr<const KVQuantTables> tables, double outlier_fraction = 0.01) {
    key.tables = value.tables = std::move(tables);
    key.outlier_fraction = value.outlier_fraction = outlier_fraction;
  }
  static std::string name() { return "kvquant_nuq" + std::to_string(Bits); }
  /// The calibration's bytes (per-channel key ranges, codebooks), counted by KVCache::memory().
  [[nodiscard]] std::size_t table_bytes() const noexcept { return key.tables ? key.tables->bytes() : 0; }
  friend bool operator==(const KVQuant&, const KVQuant&) = default;
};

}  // namespace kvpack::inline v0::quant
