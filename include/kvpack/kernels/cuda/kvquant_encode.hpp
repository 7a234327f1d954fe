#pragma once
/// \file kvquant_encode.hpp
/// \brief KVQuant's page encoders for the device, in stages. A page keeps the C outlier
///        candidates furthest outside their vectors' ranges over the whole page, so no part of a
///        page can be encoded on its own: each stage runs independent units (one CUDA thread
///        each), a barrier separates the stages, and the stages run in order give the bytes of
///        the scalar `encode` (quant/kvquant.hpp). The host test suite runs them so, with the
///        units of each stage in a shuffled order.
///
/// The outlier set is the one the scalar encoder's heap keeps, chosen without sorting: a radix
/// select of the C-th largest excess over the page (OutlierSelection), then the ties at it by
/// index. Each element's excess is evaluated five times; a few stages run on one thread (256
/// counts each). Block memory: two bitmaps of P·d bits, 256 counts, and for values 20 bytes per
/// token; at most 22 KiB (256-token pages at head_dim 256).

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kvpack/config.hpp"
#include "kvpack/core/half.hpp"
#include "kvpack/core/types.hpp"
#include "kvpack/kernels/cuda/element_decode.hpp"
#include "kvpack/quant/kvquant.hpp"
#include "kvpack/quant/packed_codes.hpp"

namespace kvpack::inline v0::kernels::cuda {

namespace kvquant_encode_detail {

/// A set of a page's elements, one bit per index t·d + c (block memory on the device).
class ElementBits {
 public:
  KVPACK_HOST_DEVICE explicit ElementBits(std::uint32_t* words) noexcept : words_(words) {}
  KVPACK_HOST_DEVICE static std::size_t words(quant::PageGeometry g) noexcept {
    return (static_cast<std::size_t>(g.page_size) * g.head_dim + 31) / 32;
  }
  KVPACK_HOST_DEVICE void clear(std::size_t word) noexcept { words_[word] = 0; }
  KVPACK_HOST_DEVICE void set(std::uint32_t i) noexcept {
#if defined(__CUDA_ARCH__)
    atomicOr(words_ + i / 32, 1u << (i % 32));
#else
    words_[i / 32] |= 1u << (i % 32);
#endif
  }
  [[nodiscard]] KVPACK_HOST_DEVICE bool test(std::uint32_t i) const noexcept {
    return (words_[i / 32] >> (i % 32)) & 1u;
  }
  /// How many members lie below i: i's slot among them.
  [[nodiscard]] KVPACK_HOST_DEVICE std::uint32_t rank(std::uint32_t i) const noexcept {
    std::uint32_t below = 0;
    for (std::uint32_t w = 0; w < i / 32; ++w) below += popcount(words_[w]);
    return below + popcount(words_[i / 32] & ((1u << (i % 32)) - 1u));
  }

 private:
  KVPACK_HOST_DEVICE static std::uint32_t popcount(std::uint32_t x) noexcept {
#if defined(__CUDA_ARCH__)
    return static_cast<std::uint32_t>(__popc(x));
#else
    return static_cast<std::uint32_t>(__builtin_popcount(x));
#endif
  }
  std::uint32_t* words_;
};

KVPACK_HOST_DEVICE void add_one(std::uint32_t* counter) noexcept {
#if defined(__CUDA_ARCH__)
  atomicAdd(counter, 1u);
#else
  ++*counter;
#endif
}

/// A non-negative excess as an integer of the same order (+inf above every finite one; −0 as 0,
/// which compares equal to it).
KVPACK_HOST_DEVICE std::uint32_t order_bits(float excess) noexcept {
  if (excess == 0.0f) return 0;
  std::uint32_t bits;
#if defined(__CUDA_ARCH__)
  bits = __float_as_uint(excess);
#else
  std::memcpy(&bits, &excess, sizeof(bits));
#endif
  return bits;
}

/// Chooses a page's exact elements as the scalar encoder's FurthestCandidates does: the C
/// candidates that rank first (further outside their range, ties to the earlier index). A radix
/// select finds the C-th largest excess in four passes of 8 bits, each a stage that counts the
/// candidates still in play by digit and a one-unit stage that picks the digit; then one stage
/// keeps every candidate above that threshold and marks those at it, and the last keeps the
/// earliest of those, as many as C leaves. Five evaluations of each element's excess in all.
/// `excess(i)` gives element i's excess as offered (≥ 0), or a negative number when i is not a
/// candidate.
class OutlierSelection {
 public:
  static constexpr int kStages = 10;

  KVPACK_HOST_DEVICE static std::size_t scratch_words(quant::PageGeometry g) noexcept {
    return 2 * ElementBits::words(g) + kDigits + kStateWords;
  }
  KVPACK_HOST_DEVICE OutlierSelection(std::uint32_t* scratch, quant::PageGeometry g) noexcept
      : exact_(scratch),
        ties_(scratch + ElementBits::words(g)),
        histogram_(scratch + 2 * ElementBits::words(g)),
        state_(histogram_ + kDigits) {}

  /// Units that clear the bitmaps and the histogram and set the state (run before stage 0).
  KVPACK_HOST_DEVICE static index_t init_units(quant::PageGeometry g) noexcept {
    return static_cast<index_t>(2 * ElementBits::words(g) + kDigits + 1);
  }
  KVPACK_HOST_DEVICE void init(std::size_t u, std::size_t words, std::uint32_t capacity) noexcept {
    if (u < words) {
      exact_.clear(u);
    } else if (u < 2 * words) {
      ties_.clear(u - words);
    } else if (u < 2 * words + kDigits) {
      histogram_[u - 2 * words] = 0;
    } else {
      state_[kThreshold] = 0;
      state_[kStill] = capacity;
      state_[kMode] = capacity == 0 ? kKeepNone : kSelecting;
    }
  }

  KVPACK_HOST_DEVICE static index_t units(int stage, quant::PageGeometry g) noexcept {
    return stage < 8 && stage % 2 == 1 ? 1 : g.page_size * g.head_dim;
  }
  template <class Excess>
  KVPACK_HOST_DEVICE void run(int stage, std::uint32_t u, Excess excess) noexcept {
    if (stage < 8) {
      const int shift = 24 - 8 * (stage / 2);
      if (stage % 2 == 0) {
        count(u, shift, excess);
      } else {
        pick_digit(shift, stage == 1);
      }
    } else if (stage == 8) {
      mark(u, excess);
    } else if (ties_.test(u) && ties_.rank(u) < state_[kStill]) {
      exact_.set(u);
    }
  }

  [[nodiscard]] KVPACK_HOST_DEVICE const ElementBits& exact() const noexcept { return exact_; }

 private:
  static constexpr std::size_t kDigits = 256;
  static constexpr std::size_t kStateWords = 3;
  static constexpr int kThreshold = 0, kStill = 1, kMode = 2;  ///< state words
  static constexpr std::uint32_t kSelecting = 0, kKeepAll = 1, kKeepNone = 2;

  /// Counts the candidates whose digits above `shift` are the threshold's so far, by their next digit.
  template <class Excess>
  KVPACK_HOST_DEVICE void count(std::uint32_t u, int shift, Excess excess) noexcept {
    if (state_[kMode] != kSelecting) return;
    const float e = excess(u);
    if (!(e >= 0.0f)) return;
    const std::uint32_t bits = order_bits(e);
    if (shift < 24 && (bits >> (shift + 8)) != (state_[kThreshold] >> (shift + 8))) return;
    add_one(histogram_ + ((bits >> shift) & 0xFFu));
  }

  /// The digit at `shift` of the still-th largest candidate among those counted; clears the counts.
  KVPACK_HOST_DEVICE void pick_digit(int shift, bool first) noexcept {
    if (state_[kMode] == kSelecting) {
      std::uint32_t total = 0;
      for (std::size_t d = 0; d < kDigits; ++d) total += histogram_[d];
      if (first && total <= state_[kStill]) {
        state_[kMode] = kKeepAll;  // no more candidates than room
      } else {
        std::uint32_t above = 0;
        for (std::size_t d = kDigits; d-- > 0;) {
          if (above + histogram_[d] >= state_[kStill]) {
            state_[kThreshold] |= static_cast<std::uint32_t>(d) << shift;
            state_[kStill] -= above;
            break;
          }
          above += histogram_[d];
        }
      }
    }
    for (std::size_t d = 0; d < kDigits; ++d) histogram_[d] = 0;
  }

  /// Keeps the candidates above the threshold and marks those at it.
  template <class Excess>
  KVPACK_HOST_DEVICE void mark(std::uint32_t u, Excess excess) noexcept {
    if (state_[kMode] == kKeepNone) return;
    const float e = excess(u);
    if (!(e >= 0.0f)) return;
    const std::uint32_t bits = order_bits(e);
    if (state_[kMode] == kKeepAll || bits > state_[kThreshold]) {
      exact_.set(u);
    } else if (bits == state_[kThreshold]) {
      ties_.set(u);
    }
  }

  ElementBits exact_;
  ElementBits ties_;
  std::uint32_t* histogram_;
  std::uint32_t* state_;
};

/// An excess as FurthestCandidates::offer stores it: NaN (unchecked input) as +inf.
KVPACK_HOST_DEVICE float offered(float excess) noexcept { return excess >= 0.0f ? excess : INFINITY; }

/// std::clamp(v, lo, hi), std::min and std::max with the standard's comparisons (NaN falls through).
KVPACK_HOST_DEVICE float clamp(float v, float lo, float hi) noexcept { return v < lo ? lo : (hi < v ? hi : v); }
KVPACK_HOST_DEVICE float min_of(float a, float b) noexcept { return b < a ? b : a; }
KVPACK_HOST_DEVICE float max_of(float a, float b) noexcept { return a < b ? b : a; }

KVPACK_HOST_DEVICE void store_u16(std::byte* at, std::uint16_t value) noexcept {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<std::uint16_t*>(at) = value;  // every u16 of a plane is 2-byte aligned
#else
  std::memcpy(at, &value, sizeof(value));
#endif
}

/// Where a plane ends: its outlier section (count, indices, values) at `section` holds `capacity`.
KVPACK_HOST_DEVICE std::size_t section_end(std::size_t section, std::uint32_t capacity) noexcept {
  return section + 2 + 4 * static_cast<std::size_t>(capacity);
}

/// Writes exact element i (if it is one) into its slot of the outlier section; unit 0 also
/// writes the count. The section's unused slots stay as the zeroing stage left them.
KVPACK_HOST_DEVICE void write_outlier(std::byte* section, std::uint32_t capacity, const ElementBits& exact,
                                      std::uint32_t elements, const float* src, std::ptrdiff_t row_stride,
                                      index_t head_dim, std::uint32_t i) noexcept {
  if (i == 0) {
    const std::uint32_t count = exact.rank(elements - 1) + (exact.test(elements - 1) ? 1u : 0u);
    store_u16(section, static_cast<std::uint16_t>(count));
  }
  if (!exact.test(i)) return;
  const std::uint32_t slot = exact.rank(i);
  const auto d = static_cast<std::uint32_t>(head_dim);
  const float x = src[static_cast<std::ptrdiff_t>(i / d) * row_stride + i % d];
  store_u16(section + 2 + 2 * static_cast<std::size_t>(slot), static_cast<std::uint16_t>(i));
  store_u16(section + 2 + 2 * static_cast<std::size_t>(capacity) + 2 * slot, half(x).bits);
}

}  // namespace kvquant_encode_detail

/// KVQuant's key plane: (0) zero the plane, set up the selection; (1–10) choose the exact
/// elements among those outside their channel's calibrated range (OutlierSelection); (11) per
/// exact element, its outlier slot, and per channel, its codes (every element is coded, exact
/// or not).
template <int Bits>
struct KVQuantKeyPageEncoder {
  using Codec = quant::KVQuantKeyCodec<Bits>;
  using Params = KVQuantDeviceKeyParams;
  static constexpr int kStages = 2 + kvquant_encode_detail::OutlierSelection::kStages;

  KVPACK_HOST_DEVICE static std::size_t scratch_bytes(quant::PageGeometry g) noexcept {
    return kvquant_encode_detail::OutlierSelection::scratch_words(g) * sizeof(std::uint32_t);
  }
  KVPACK_HOST_DEVICE static std::size_t plane_bytes(quant::PageGeometry g, const Params& p) noexcept {
    return kvquant_encode_detail::section_end(Codec::outliers_offset(g), p.outlier_capacity);
  }
  KVPACK_HOST_DEVICE static index_t units(int stage, quant::PageGeometry g, const Params& p) noexcept {
    using kvquant_encode_detail::OutlierSelection;
    if (stage == 0) return static_cast<index_t>(plane_bytes(g, p)) + OutlierSelection::init_units(g);
    if (stage <= OutlierSelection::kStages) return OutlierSelection::units(stage - 1, g);
    return g.page_size * g.head_dim + g.head_dim;
  }

  KVPACK_HOST_DEVICE static void encode_unit(int stage, const float* src, std::ptrdiff_t row_stride, const Params& p,
                                             std::byte* plane, quant::PageGeometry g, index_t unit,
                                             void* scratch) noexcept {
    using namespace kvquant_encode_detail;
    OutlierSelection selection(static_cast<std::uint32_t*>(scratch), g);
    const auto elements = static_cast<std::uint32_t>(g.page_size * g.head_dim);
    const auto u = static_cast<std::uint32_t>(unit);
    if (stage == 0) {
      const std::size_t bytes = plane_bytes(g, p);
      if (u < bytes) {
        plane[u] = std::byte{0};
      } else {
        selection.init(u - bytes, ElementBits::words(g), p.outlier_capacity);
      }
    } else if (stage <= OutlierSelection::kStages) {
      selection.run(stage - 1, u, [&](std::uint32_t i) {
        const index_t t = static_cast<index_t>(i) / g.head_dim, c = static_cast<index_t>(i) % g.head_dim;
        const float excess = fabsf(src[t * row_stride + c] - p.offset[c]) / p.half_range[c] - 1.0f;
        return excess > 0.0f ? excess : -1.0f;  // the scalar encoder offers only these (NaN is not)
      });
    } else if (u < elements) {
      write_outlier(plane + Codec::outliers_offset(g), p.outlier_capacity, selection.exact(), elements, src,
                    row_stride, g.head_dim, u);
    } else {
      const index_t c = unit - static_cast<index_t>(elements);
      quant::put_codes<Bits>(plane + Codec::row_bytes(g) * c, 0, g.page_size, [&](index_t t) {
        return p.rounding(clamp((src[t * row_stride + c] - p.offset[c]) / p.half_range[c], -1.0f, 1.0f));
      });
    }
  }
};

/// KVQuant's value plane: (0) zero the plane, set up the selection, and per token the bounds of
/// its `side` smallest and largest elements (its candidates) and the range of the others;
/// (1–10) choose the exact elements among the candidates (OutlierSelection); (11) per exact
/// element, its outlier slot, and per token, its range over the elements not kept exactly and
/// its codes.
template <int Bits>
struct KVQuantValuePageEncoder {
  using Codec = quant::KVQuantValueCodec<Bits>;
  using Params = KVQuantDeviceValueParams;
  static constexpr int kStages = 2 + kvquant_encode_detail::OutlierSelection::kStages;

  /// A token's candidates: elements up to `low` and from `high` in the order below (its `side`-th
  /// smallest and largest), and the range [lo_inner, hi_inner] of the rest, as the scalar encoder
  /// measures how far each candidate stretches it.
  struct TokenCut {
    std::uint32_t low = 0, high = 0;
    float lo_inner = 0.0f, hi_inner = 0.0f, inner_half = 0.0f;
  };

  KVPACK_HOST_DEVICE static std::size_t scratch_bytes(quant::PageGeometry g) noexcept {
    return kvquant_encode_detail::OutlierSelection::scratch_words(g) * sizeof(std::uint32_t) +
           static_cast<std::size_t>(g.page_size) * sizeof(TokenCut);
  }
  KVPACK_HOST_DEVICE static std::size_t plane_bytes(quant::PageGeometry g, const Params& p) noexcept {
    return kvquant_encode_detail::section_end(Codec::outliers_offset(g), p.outlier_capacity);
  }
  KVPACK_HOST_DEVICE static index_t units(int stage, quant::PageGeometry g, const Params& p) noexcept {
    using kvquant_encode_detail::OutlierSelection;
    if (stage == 0) return static_cast<index_t>(plane_bytes(g, p)) + OutlierSelection::init_units(g) + g.page_size;
    if (stage <= OutlierSelection::kStages) return OutlierSelection::units(stage - 1, g);
    return g.page_size * g.head_dim + g.page_size;
  }

  KVPACK_HOST_DEVICE static void encode_unit(int stage, const float* src, std::ptrdiff_t row_stride, const Params& p,
                                             std::byte* plane, quant::PageGeometry g, index_t unit,
                                             void* scratch) noexcept {
    using namespace kvquant_encode_detail;
    auto* words = static_cast<std::uint32_t*>(scratch);
    OutlierSelection selection(words, g);
    TokenCut* cuts = reinterpret_cast<TokenCut*>(words + OutlierSelection::scratch_words(g));
    const auto elements = static_cast<std::uint32_t>(g.page_size * g.head_dim);
    const auto u = static_cast<std::uint32_t>(unit);
    const index_t d = g.head_dim;
    const bool candidates = p.candidates_per_side > 0;
    if (stage == 0) {
      const std::size_t bytes = plane_bytes(g, p);
      const auto init = static_cast<std::size_t>(OutlierSelection::init_units(g));
      if (u < bytes) {
        plane[u] = std::byte{0};
      } else if (u < bytes + init) {
        // With no candidates per token there is nothing to choose: room for none.
        selection.init(u - bytes, ElementBits::words(g), candidates ? p.outlier_capacity : 0);
      } else if (candidates) {
        const auto t = static_cast<index_t>(u - bytes - init);
        cuts[t] = token_cut(src + t * row_stride, d, p.candidates_per_side);
      }
    } else if (stage <= OutlierSelection::kStages) {
      selection.run(stage - 1, u, [&](std::uint32_t i) { return excess_of(src, row_stride, cuts, d, i); });
    } else if (u < elements) {
      write_outlier(plane + Codec::outliers_offset(g), p.outlier_capacity, selection.exact(), elements, src,
                    row_stride, d, u);
    } else {
      encode_token(src, row_stride, p, plane, g, selection.exact(), static_cast<index_t>(u - elements));
    }
  }

 private:
  /// The order the scalar encoder's heaps use: by value, NaN as +inf, ties by channel.
  KVPACK_HOST_DEVICE static float sort_key(float x) noexcept { return x != x ? INFINITY : x; }
  KVPACK_HOST_DEVICE static bool below(const float* x, std::uint32_t a, std::uint32_t b) noexcept {
    const float ka = sort_key(x[a]), kb = sort_key(x[b]);
    return ka != kb ? ka < kb : a < b;
  }

  /// Token x's `side`-th smallest and largest elements (side passes over the row each), and the
  /// range of the elements between them.
  KVPACK_HOST_DEVICE static TokenCut token_cut(const float* x, index_t d, index_t side) noexcept {
    TokenCut cut;
    for (index_t k = 0; k < side; ++k) {
      std::uint32_t low = 0, high = 0;
      bool low_found = false, high_found = false;
      for (std::uint32_t c = 0; c < static_cast<std::uint32_t>(d); ++c) {
        if ((k == 0 || below(x, cut.low, c)) && (!low_found || below(x, c, low))) {
          low = c;
          low_found = true;
        }
        if ((k == 0 || below(x, c, cut.high)) && (!high_found || below(x, high, c))) {
          high = c;
          high_found = true;
        }
      }
      cut.low = low;
      cut.high = high;
    }
    float lo = INFINITY, hi = -INFINITY;
    for (std::uint32_t c = 0; c < static_cast<std::uint32_t>(d); ++c) {
      if (!below(x, cut.low, c) || !below(x, c, cut.high)) continue;  // a candidate
      lo = kvquant_encode_detail::min_of(lo, x[c]);
      hi = kvquant_encode_detail::max_of(hi, x[c]);
    }
    cut.lo_inner = lo;
    cut.hi_inner = hi;
    cut.inner_half = kvquant_encode_detail::max_of(0.5f * (hi - lo), 1e-30f);
    return cut;
  }

  /// How far element i stretches its token's range, in inner half-ranges, as offered; −1 when it
  /// is not a candidate.
  KVPACK_HOST_DEVICE static float excess_of(const float* src, std::ptrdiff_t row_stride, const TokenCut* cuts,
                                            index_t d, std::uint32_t i) noexcept {
    const index_t t = static_cast<index_t>(i) / d;
    const auto c = static_cast<std::uint32_t>(static_cast<index_t>(i) % d);
    const float* x = src + t * row_stride;
    const TokenCut& cut = cuts[t];
    if (!below(x, cut.low, c)) return kvquant_encode_detail::offered((cut.lo_inner - x[c]) / cut.inner_half);
    if (!below(x, c, cut.high)) return kvquant_encode_detail::offered((x[c] - cut.hi_inner) / cut.inner_half);
    return -1.0f;
  }

  /// Token t's fp16 range over its elements not kept exactly, and its codes.
  KVPACK_HOST_DEVICE static void encode_token(const float* src, std::ptrdiff_t row_stride, const Params& p,
                                              std::byte* plane, quant::PageGeometry g,
                                              const kvquant_encode_detail::ElementBits& exact, index_t t) noexcept {
    using namespace kvquant_encode_detail;
    const index_t d = g.head_dim;
    const float* x = src + t * row_stride;
    float lo = INFINITY, hi = -INFINITY;
    for (index_t c = 0; c < d; ++c) {
      if (exact.test(static_cast<std::uint32_t>(t * d + c))) continue;
      lo = min_of(lo, x[c]);
      hi = max_of(hi, x[c]);
    }
    if (!(lo <= hi)) lo = hi = 0.0f;  // every element exact
    const float offset = static_cast<float>(half(0.5f * (hi + lo)));
    const float half_range = static_cast<float>(half(0.5f * (hi - lo)));
    store_u16(plane + Codec::offsets_offset(g) + 2 * static_cast<std::size_t>(t), half(offset).bits);
    store_u16(plane + Codec::ranges_offset(g) + 2 * static_cast<std::size_t>(t), half(half_range).bits);
    quant::put_codes<Bits>(plane + Codec::row_bytes(g) * t, 0, d, [&](index_t c) {
      return p.rounding(half_range > 0.0f ? clamp((x[c] - offset) / half_range, -1.0f, 1.0f) : 0.0f);
    });
  }
};

}  // namespace kvpack::inline v0::kernels::cuda
