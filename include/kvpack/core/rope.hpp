#pragma once
/// \file rope.hpp
/// \brief Rotary position embedding for keys stored *before* RoPE (KVQuant's pre-RoPE keys,
///        StreamingLLM's in-cache positions): the spec, a double-precision reference, and the
///        tables the kernels rotate with.
///
/// Pair j (j < d/2) of a head is rotated by the angle position · θ^(−2j/d). Engines disagree on
/// which channels form pair j: Meta's Llama and llama.cpp's "normal" mode rotate adjacent
/// channels (2j, 2j+1); Hugging Face's `rotate_half` and llama.cpp's NeoX mode rotate (j, j + d/2).
/// Only the pairing changes; the frequencies are the same.
///
/// Kernels need cos and sin of position · θ_j for every slot they read. Computing them per slot
/// costs more than the attention itself, and a float angle loses ~0.01 rad at position 10^5, so
/// the tables split a position p = hi · 2^kFineBits + lo and combine two exact rows with the
/// angle-addition formulas: cos(a + b) = cos a cos b − sin a sin b, sin(a + b) = sin a cos b +
/// cos a sin b. Both rows are rounded from double, so the result is within a few float ulps of
/// the exact rotation at any position the tables cover.
///
/// A page written in order holds positions p0 + t. Since R(p0 + t) = R(p0)·R(t), its scores are
/// (R(p0)ᵀq)·(R(t)k): the query turns back once per page and every slot turns by its offset t in
/// the page, read from small channel-major tables (the slot tables) that stay in cache.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "kvpack/config.hpp"
#include "kvpack/core/types.hpp"
#include "kvpack/error.hpp"

namespace kvpack::inline v0 {

/// Which channels RoPE rotates together.
enum class RopePairing : std::uint8_t {
  kAdjacent,   ///< (2j, 2j+1): Meta's Llama, llama.cpp's normal mode, llama2.c
  kHalfSplit,  ///< (j, j + d/2): Hugging Face rotate_half, llama.cpp's NeoX mode
};

/// How the model rotates keys; see CacheConfig::key_rope.
struct RopeSpec {
  double theta = 10000.0;  ///< the base (Llama 2: 10^4, Llama 3: 5·10^5)
  RopePairing pairing = RopePairing::kAdjacent;
  /// The largest position the cache's tables cover (cost: head_dim · max_position / 128 bytes,
  /// 1 MiB for head_dim 128 at the default 2^20, plus 1.25 MiB at head_dim 128 for the fine and
  /// slot tables); larger positions are rejected on write.
  std::int64_t max_position = std::int64_t{1} << 20;

  void validate(index_t head_dim) const {
    KVPACK_CHECK(std::isfinite(theta) && theta > 1.0, kInvalidConfig,
                 detail::message("RopeSpec.theta must be a finite base > 1, got ", theta));
    KVPACK_CHECK(head_dim % 2 == 0, kInvalidConfig,
                 detail::message("RoPE rotates channel pairs: head_dim ", head_dim, " must be even"));
    KVPACK_CHECK(max_position >= 0 && max_position <= std::numeric_limits<std::int32_t>::max(), kInvalidConfig,
                 detail::message("RopeSpec.max_position must be in [0, 2^31 - 1], got ", max_position));
  }
};

/// The channel rotated together with channel c.
[[nodiscard]] constexpr index_t rope_partner(index_t c, index_t head_dim, RopePairing pairing) noexcept {
  if (pairing == RopePairing::kAdjacent) return c ^ 1;
  return c < head_dim / 2 ? c + head_dim / 2 : c - head_dim / 2;
}

/// The pair channel c belongs to (its frequency index).
[[nodiscard]] constexpr index_t rope_pair(index_t c, index_t head_dim, RopePairing pairing) noexcept {
  return pairing == RopePairing::kAdjacent ? c / 2 : c % (head_dim / 2);
}

/// Rotates `row` (head_dim floats) to `position` in double precision: the reference.
inline void apply_rope_reference(const RopeSpec& spec, index_t head_dim, std::int64_t position, float* row) {
  std::vector<float> in(row, row + head_dim);
  for (index_t c = 0; c < head_dim; ++c) {
    const index_t j = rope_pair(c, head_dim, spec.pairing);
    const double angle = static_cast<double>(position) * std::pow(spec.theta, -2.0 * j / head_dim);
    const double first = (spec.pairing == RopePairing::kAdjacent ? c % 2 == 0 : c < head_dim / 2) ? 1.0 : -1.0;
    // First of a pair: x·cos − y·sin; second: y·cos + x·sin.
    row[c] = static_cast<float>(in[c] * std::cos(angle) - first * in[rope_partner(c, head_dim, spec.pairing)] *
                                                              std::sin(angle));
  }
}

/// A view the kernels take by value: per-channel cos/sin rows (head_dim floats, channel order,
/// each channel carrying its pair's angle) for the low and the high part of a position, and the
/// sign that makes a rotation `out[c] = x[c]·cos[c] + sign[c]·sin[c]·x[partner(c)]` (−1 for the
/// first channel of a pair, +1 for the second).
struct RopeView {
  const float* fine_cos = nullptr;    ///< [kFine][head_dim], angle lo · θ_j
  const float* fine_sin = nullptr;    ///< [kFine][head_dim]
  const float* coarse_cos = nullptr;  ///< [coarse_rows][head_dim], angle hi · 2^kFineBits · θ_j
  const float* coarse_sin = nullptr;  ///< [coarse_rows][head_dim]
  const float* sign = nullptr;        ///< [head_dim]
  /// Channel-major rotation by an offset t < kSlots: slot_cos[c·kSlots + t] = cos(t·θ_c) and
  /// slot_sin[c·kSlots + t] = sign[c]·sin(t·θ_c).
  const float* slot_cos = nullptr;  ///< [head_dim][kSlots]
  const float* slot_sin = nullptr;  ///< [head_dim][kSlots]
  std::int64_t max_position = -1;     ///< positions beyond are clamped (the cache rejects them)
  index_t head_dim = 0;
  RopePairing pairing = RopePairing::kAdjacent;

  static constexpr int kFineBits = 10;
  static constexpr std::int64_t kFine = std::int64_t{1} << kFineBits;
  /// Offsets the slot tables cover: CacheConfig's largest page.
  static constexpr index_t kSlots = 256;
};

/// `out` = `in` rotated to `position` (or, with `inverse`, back from it) through the tables: the
/// kernels' rotation one channel at a time (their fallback when vectors do not fit), and the
/// cache adapter's. Always inlined: the per-ISA kernel objects must not share a copy.
KVPACK_ALWAYS_INLINE void rotate_with_tables(const RopeView& rope, std::int64_t position, const float* in, float* out,
                               bool inverse = false) noexcept {
  const std::int64_t p = position < 0 ? 0 : (position > rope.max_position ? rope.max_position : position);
  const std::size_t lo = static_cast<std::size_t>(p & (RopeView::kFine - 1)) * rope.head_dim;
  const std::size_t hi = static_cast<std::size_t>(p >> RopeView::kFineBits) * rope.head_dim;
  for (index_t c = 0; c < rope.head_dim; ++c) {
    const float cosine = rope.coarse_cos[hi + c] * rope.fine_cos[lo + c] - rope.coarse_sin[hi + c] * rope.fine_sin[lo + c];
    const float sine = rope.sign[c] * (rope.coarse_sin[hi + c] * rope.fine_cos[lo + c] +
                                       rope.coarse_cos[hi + c] * rope.fine_sin[lo + c]);
    out[c] = in[c] * cosine + in[rope_partner(c, rope.head_dim, rope.pairing)] * (inverse ? -sine : sine);
  }
}

/// Owns the tables of one (spec, head_dim); immutable after construction.
class RopeTables {
 public:
  RopeTables() = default;
  RopeTables(const RopeSpec& spec, index_t head_dim) : head_dim_(head_dim), pairing_(spec.pairing) {
    spec.validate(head_dim);
    const std::int64_t coarse_rows = spec.max_position / RopeView::kFine + 1;
    fine_cos_.resize(static_cast<std::size_t>(RopeView::kFine) * head_dim);
    fine_sin_.resize(fine_cos_.size());
    coarse_cos_.resize(static_cast<std::size_t>(coarse_rows) * head_dim);
    coarse_sin_.resize(coarse_cos_.size());
    std::vector<double> frequency(static_cast<std::size_t>(head_dim));
    for (index_t c = 0; c < head_dim; ++c) {
      frequency[c] = std::pow(spec.theta, -2.0 * rope_pair(c, head_dim, spec.pairing) / head_dim);
    }
    auto fill = [&](std::vector<float>& cos_rows, std::vector<float>& sin_rows, std::int64_t rows, double step) {
      for (std::int64_t r = 0; r < rows; ++r) {
        for (index_t c = 0; c < head_dim; ++c) {
          const double angle = static_cast<double>(r) * step * frequency[c];
          const std::size_t i = static_cast<std::size_t>(r) * head_dim + c;
          cos_rows[i] = static_cast<float>(std::cos(angle));
          sin_rows[i] = static_cast<float>(std::sin(angle));
        }
      }
    };
    fill(fine_cos_, fine_sin_, RopeView::kFine, 1.0);
    fill(coarse_cos_, coarse_sin_, coarse_rows, static_cast<double>(RopeView::kFine));
    sign_.resize(static_cast<std::size_t>(head_dim));
    for (index_t c = 0; c < head_dim; ++c) {
      sign_[c] = (spec.pairing == RopePairing::kAdjacent ? c % 2 == 0 : c < head_dim / 2) ? -1.0f : 1.0f;
    }
    slot_cos_.resize(static_cast<std::size_t>(head_dim) * RopeView::kSlots);
    slot_sin_.resize(slot_cos_.size());
    for (index_t c = 0; c < head_dim; ++c) {
      for (index_t t = 0; t < RopeView::kSlots; ++t) {
        const double angle = static_cast<double>(t) * frequency[c];
        const std::size_t i = static_cast<std::size_t>(c) * RopeView::kSlots + t;
        slot_cos_[i] = static_cast<float>(std::cos(angle));
        slot_sin_[i] = sign_[c] * static_cast<float>(std::sin(angle));
      }
    }
    max_position_ = spec.max_position;
  }

  /// The tables of (spec, head_dim), shared by every cache of this process that asks for them
  /// while one holds them: a model's layers and sequences read one copy.
  static std::shared_ptr<const RopeTables> shared(const RopeSpec& spec, index_t head_dim) {
    spec.validate(head_dim);
    using Key = std::tuple<double, RopePairing, std::int64_t, index_t>;
    static std::mutex mutex;
    static std::map<Key, std::weak_ptr<const RopeTables>> registry;
    const Key key{spec.theta, spec.pairing, spec.max_position, head_dim};
    std::lock_guard lock(mutex);
    if (auto found = registry[key].lock()) return found;
    auto tables = std::make_shared<const RopeTables>(spec, head_dim);
    registry[key] = tables;
    return tables;
  }

  [[nodiscard]] RopeView view() const noexcept {
    return {fine_cos_.data(), fine_sin_.data(), coarse_cos_.data(), coarse_sin_.data(), sign_.data(),
            slot_cos_.data(), slot_sin_.data(), max_position_, head_dim_, pairing_};
  }
  [[nodiscard]] std::int64_t max_position() const noexcept { return max_position_; }
  [[nodiscard]] std::size_t bytes() const noexcept {
    return (fine_cos_.capacity() + fine_sin_.capacity() + coarse_cos_.capacity() + coarse_sin_.capacity() +
            sign_.capacity() + slot_cos_.capacity() + slot_sin_.capacity()) *
           sizeof(float);
  }

 private:
  std::vector<float> fine_cos_, fine_sin_, coarse_cos_, coarse_sin_, sign_, slot_cos_, slot_sin_;
  index_t head_dim_ = 0;
  RopePairing pairing_ = RopePairing::kAdjacent;
  std::int64_t max_position_ = -1;
};

}  // namespace kvpack::inline v0
