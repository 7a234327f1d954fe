#pragma once
// One KV stream's pages built with the codecs' own scalar encoders, exactly as the cache lays
// them out, and the error bound of support/error_bound.hpp over a group of query heads: shared
// by the CPU kernel tests and the CUDA kernel tests (which read the same page bytes).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <new>
#include <random>
#include <string_view>
#include <type_traits>
#include <vector>

#include "kvpack/kvpack.hpp"
#include "support/error_bound.hpp"
#include "support/random_kv.hpp"

namespace kvpack::test {

template <class Quantizer>
struct IsKVQuant : std::false_type {};
template <int Bits>
struct IsKVQuant<quant::KVQuant<Bits>> : std::true_type {};

/// A quantizer for one head_dim: KVQuant calibrated on random rows with outlier channels (like
/// the tests' keys, from other seeds), every other one as default-constructed. With
/// `byte_grid_levels`, KVQuant's codebook levels are moved to the grid of their AVX-512 byte
/// copies (kernels/cpu/kvquant.hpp's NuqByteLevels), so that copy is exact and the bound on the
/// integer key path tightens to the query's rounding alone (error_bound.hpp).
template <class Quantizer>
Quantizer make_quantizer(index_t head_dim, [[maybe_unused]] bool byte_grid_levels = false) {
  if constexpr (IsKVQuant<Quantizer>::value) {
    quant::KVQuantCalibrator calibrator(ModelShape{1, 1, 1, head_dim},
                                        {Quantizer::key_codec::kBits, 0.01, true, 50, 1});
    calibrator.add(0, test::random_rows(256, head_dim, 901, 4, 10.0f), test::random_rows(256, head_dim, 902));
    std::shared_ptr<const quant::KVQuantTables> tables = calibrator.finish();
    if (byte_grid_levels) {
      auto snapped = std::make_shared<quant::KVQuantTables>(*tables);
      for (auto* codebooks : {&snapped->key_codebook, &snapped->value_codebook}) {
        for (quant::nuq::Codebook& codebook : *codebooks) {
          float largest = 0.0f;
          for (float level : codebook.levels) largest = std::max(largest, std::fabs(level));
          const float step = largest / 127.0f;
          for (float& level : codebook.levels) level = step * static_cast<float>(std::lrint(level / step));
        }
      }
      tables = std::move(snapped);
    }
    return Quantizer(std::move(tables), 0.01);
  } else {
    return Quantizer{};
  }
}

/// KVQuant<Bits>'s tables for one head_dim: make_quantizer's, or with Q-Norm (elements rounded to
/// other levels than they decode to) calibrated on rows drawn from `seed`.
template <int Bits>
std::shared_ptr<const quant::KVQuantTables> kvquant_tables(index_t head_dim, bool q_norm, std::uint32_t seed) {
  if (!q_norm) return make_quantizer<quant::KVQuant<Bits>>(head_dim).key.tables;
  quant::KVQuantCalibrator::Options options{Bits, 0.01, true, 50, 1};
  options.q_norm = quant::KVQuantCalibrator::Options::QNorm::kAlways;
  quant::KVQuantCalibrator calibrator(ModelShape{1, 1, 1, head_dim}, options);
  calibrator.add(0, random_rows(256, head_dim, seed, 4, 10.0f), random_rows(256, head_dim, seed + 1));
  return calibrator.finish();
}

/// Pages of one stream built with the codecs' own scalar encoders, exactly as the cache lays
/// them out (K plane at 0, V plane 64-byte aligned after it).
template <class Quantizer>
struct StreamFixture {
  using KeyCodec = typename Quantizer::key_codec;
  using ValueCodec = typename Quantizer::value_codec;

  Quantizer quantizer{};
  quant::PageGeometry geometry;
  std::size_t value_offset = 0;
  std::size_t payload_bytes = 0;
  struct Free {
    void operator()(std::byte* p) const { ::operator delete[](p, std::align_val_t{64}); }
  };
  std::unique_ptr<std::byte[], Free> arena;
  std::vector<const std::byte*> pages;
  std::vector<std::vector<std::uint64_t>> masks;
  std::vector<const std::uint64_t*> mask_pointers;
  std::vector<float> tail_keys, tail_values;
  std::vector<std::vector<std::int32_t>> positions;  // [pages][page_size] then the tail's, for pre-RoPE keys
  std::vector<const std::int32_t*> position_pointers;
  typename KeyCodec::params_type key_params{};
  typename ValueCodec::params_type value_params{};

  StreamFixture(index_t page_size, index_t head_dim, index_t page_count, index_t tail_count,
                const std::vector<float>& keys, const std::vector<float>& values, bool byte_grid_levels = false) {
    geometry = {page_size, head_dim};
    quantizer = make_quantizer<Quantizer>(head_dim, byte_grid_levels);
    value_offset = (quantizer.key.plane_bytes(geometry) + 63) / 64 * 64;
    payload_bytes = (value_offset + quantizer.value.plane_bytes(geometry) + 63) / 64 * 64;
    key_params = quantizer.key.initial_params(0, 0);
    value_params = quantizer.value.initial_params(0, 0);
    // Per-layer tables (TurboQuant) are built up front, as KVCache does: a stream of tail rows
    // only still names them (the CUDA backend copies them).
    if constexpr (requires { quantizer.key.prepare(geometry, key_params); }) {
      quantizer.key.prepare(geometry, key_params);
    }
    if constexpr (requires { quantizer.value.prepare(geometry, value_params); }) {
      quantizer.value.prepare(geometry, value_params);
    }
    arena.reset(static_cast<std::byte*>(
        ::operator new[](payload_bytes * std::max<index_t>(page_count, 1), std::align_val_t{64})));
    for (index_t i = 0; i < page_count; ++i) {
      std::byte* page = arena.get() + i * payload_bytes;
      const std::size_t first = static_cast<std::size_t>(i) * page_size * head_dim;
      quantizer.key.encode(geometry, keys.data() + first, head_dim, key_params, page);
      quantizer.value.encode(geometry, values.data() + first, head_dim, value_params, page + value_offset);
      pages.push_back(page);
    }
    const std::size_t paged = static_cast<std::size_t>(page_count) * page_size * head_dim;
    tail_keys.assign(keys.begin() + paged, keys.begin() + paged + tail_count * head_dim);
    tail_values.assign(values.begin() + paged, values.begin() + paged + tail_count * head_dim);
  }

  /// Marks slots dead with probability ~1/4 on every other page (a fully dead page included).
  void kill_some_slots(std::uint32_t seed) {
    std::mt19937 rng(seed);
    masks.assign(pages.size(), std::vector<std::uint64_t>((geometry.page_size + 63) / 64, ~std::uint64_t{0}));
    for (std::size_t i = 0; i < pages.size(); i += 2) {
      for (index_t t = 0; t < geometry.page_size; ++t) {
        if (i == 2 || rng() % 4 == 0) masks[i][t / 64] &= ~(std::uint64_t{1} << (t % 64));
      }
    }
    mask_pointers.clear();
    for (auto& m : masks) mask_pointers.push_back(m.data());
  }

  /// Increasing positions reaching past `first` + 10^5 (both parts of the RoPE tables). With
  /// `gaps_everywhere`, a gap follows about one slot in four, so no page holds consecutive
  /// positions (the kernels rotate row by row); otherwise the only gap follows slot 5 of page 1
  /// (of the tail when there are fewer pages), and every other page is in order (slot tables).
  void assign_positions(std::int32_t first, std::uint32_t seed, bool gaps_everywhere = true) {
    std::mt19937 rng(seed);
    std::int32_t next = first;
    positions.assign(pages.size() + 1, {});
    const std::size_t gap_page = std::min<std::size_t>(1, pages.size());
    for (std::size_t i = 0; i <= pages.size(); ++i) {
      const std::size_t count = i < pages.size() ? geometry.page_size : tail_keys.size() / geometry.head_dim;
      for (std::size_t t = 0; t < count; ++t) {
        positions[i].push_back(next);
        if (gaps_everywhere) {
          next += 1 + static_cast<std::int32_t>(rng() % 4 == 0 ? rng() % 5000 : 0);
        } else {
          next += i == gap_page && t == 5 ? 100003 : 1;
        }
      }
    }
    position_pointers.clear();
    for (auto& p : positions) position_pointers.push_back(p.data());
  }

  [[nodiscard]] kernels::PageRun run() const {
    return {pages.data(), mask_pointers.empty() ? nullptr : mask_pointers.data(),
            static_cast<index_t>(pages.size()), 0, geometry.page_size, geometry.head_dim,
            value_offset, payload_bytes};
  }
  [[nodiscard]] kernels::TailView tail() const {
    return {tail_keys.data(), tail_values.data(),
            static_cast<index_t>(tail_keys.size() / geometry.head_dim)};
  }
};


/// Every live slot of the fixture decoded, pages first and the tail last, with what the bounds
/// of support/error_bound.hpp need; keys rotated in double precision when stored pre-RoPE.
template <class Fixture>
test::DecodedTokens decoded_tokens(const Fixture& f, const RopeSpec* rope) {
  const index_t d = f.geometry.head_dim;
  const index_t P = f.geometry.page_size;
  test::DecodedTokens tokens;
  tokens.page_size = P;
  std::vector<float> k(static_cast<std::size_t>(P) * d), v(k.size());
  for (std::size_t i = 0; i < f.pages.size(); ++i) {
    f.quantizer.key.decode(f.geometry, f.pages[i], f.key_params, k.data());
    f.quantizer.value.decode(f.geometry, f.pages[i] + f.value_offset, f.value_params, v.data());
    double page_max = 0.0;
    for (float x : v) page_max = std::max(page_max, static_cast<double>(std::fabs(x)));
    tokens.page_max_value.push_back(page_max);
    test::add_value_code_mass(f.quantizer.value, f.value_params, f.geometry, f.pages[i] + f.value_offset, tokens);
    for (index_t t = 0; t < P; ++t) {
      if (!f.masks.empty() && !((f.masks[i][t / 64] >> (t % 64)) & 1u)) continue;
      tokens.keys.emplace_back(&k[t * d], &k[t * d] + d);
      test::add_key_codes(f.quantizer.key, f.key_params, f.geometry, f.pages[i], t, tokens);
      if (rope != nullptr) apply_rope_reference(*rope, d, f.positions[i][t], tokens.keys.back().data());
      tokens.values.emplace_back(&v[t * d], &v[t * d] + d);
      tokens.page_of.push_back(static_cast<int>(i));
    }
  }
  for (std::size_t t = 0; t < f.tail_keys.size() / d; ++t) {
    tokens.keys.emplace_back(&f.tail_keys[t * d], &f.tail_keys[t * d] + d);
    tokens.key_scales.emplace_back();  // the tail is fp32: no codes
    tokens.key_codes.emplace_back();
    tokens.turbo_keys.emplace_back();
    if (rope != nullptr) apply_rope_reference(*rope, d, f.positions.back()[t], tokens.keys.back().data());
    tokens.values.emplace_back(&f.tail_values[t * d], &f.tail_values[t * d] + d);
    tokens.page_of.push_back(-1);
  }
  return tokens;
}

/// The largest bound of support/error_bound.hpp over the group's heads.
template <class Fixture>
double error_bound(const Fixture& f, const std::vector<float>& queries, index_t group, std::string_view isa,
                   const RopeSpec* rope) {
  const index_t d = f.geometry.head_dim;
  const test::DecodedTokens tokens = decoded_tokens(f, rope);
  double worst = 0.0;
  for (index_t h = 0; h < group; ++h) {
    const float* q = &queries[static_cast<std::size_t>(h) * d];
    double bound = test::attention_error_bound(tokens, q, d, 1.0, test::operands<typename Fixture::KeyCodec>(isa),
                                               test::operands<typename Fixture::ValueCodec>(isa));
    if (rope != nullptr) {
      // The float rotation: cos and sin from two rounded table entries (a few ulps), times the
      // pair, moves each score by at most δ = Σ_c |q_c| · 16 ulp · (|k_c| + |k_partner|);
      // normalised weights then move by a factor within e^{±2δ}.
      double delta = 0.0, max_value = 0.0;
      for (std::size_t t = 0; t < tokens.keys.size(); ++t) {
        double token_delta = 0.0;
        for (index_t c = 0; c < d; ++c) {
          const double pair = std::fabs(tokens.keys[t][c]) + std::fabs(tokens.keys[t][rope_partner(c, d, rope->pairing)]);
          token_delta += std::fabs(q[c]) * 16.0 * std::ldexp(1.0, -24) * pair;
        }
        delta = std::max(delta, token_delta);
        for (float x : tokens.values[t]) max_value = std::max(max_value, static_cast<double>(std::fabs(x)));
      }
      bound += 2.0 * std::expm1(2.0 * delta) * max_value;
    }
    worst = std::max(worst, bound);
  }
  return worst;
}

}  // namespace kvpack::test
