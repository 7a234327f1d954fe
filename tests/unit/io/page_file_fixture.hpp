#pragma once
// A small cache with one sequence held entirely in pages (no tail, a length that is a multiple of
// page_size), the input page files are written from in the io tests.

#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "kvpack/io/page_file_format.hpp"
#include "kvpack/kvpack.hpp"
#include "support/random_kv.hpp"

namespace kvpack::test {

/// 3 layers (CrossLayer<GQA, 2> then keeps 2, the second alone in its group), 4 query heads over
/// 2 KV heads, head_dim 64 (q8_0, q4_0 and KIVI's groups all divide it).
inline constexpr ModelShape kPageFileShape{3, 4, 2, 64};
/// Tokens a test sequence holds: 3 whole pages.
inline index_t page_file_tokens(const CacheConfig& config) { return 3 * config.page_size; }

/// Fills every writing layer of a new sequence with 3 pages of random tokens (outlier key channels, so
/// calibrated FP8 scales differ between layers and heads) and returns it.
template <class Cache>
SeqId fill_sequence(Cache& cache, std::uint32_t seed = 7) {
  const SeqId seq = cache.add_sequence();
  const ModelShape& shape = cache.shape();
  const typename Cache::layout_type layout{};
  for (index_t c = 0; c < layout::cache_layers(layout, shape); ++c) {
    const index_t writer = layout::writer_of(layout, shape, c);
    const std::size_t rows = static_cast<std::size_t>(page_file_tokens(cache.config())) * shape.kv_heads;
    const std::vector<float> keys = random_rows(rows, shape.head_dim, seed + 2 * writer, 4, 8.0f + writer);
    const std::vector<float> values = random_rows(rows, shape.head_dim, seed + 2 * writer + 1);
    cache.prefill(seq, writer, std::span<const float>(keys), std::span<const float>(values));
  }
  return seq;
}

/// Whether two payloads of a page file's format hold the same key and value planes (the
/// padding around them is not page data: the pool leaves it as a recycled slab held it).
inline bool same_planes(const io::PageFileHeader& h, const std::byte* a, const std::byte* b) {
  return std::memcmp(a, b, h.key_plane_bytes) == 0 &&
         std::memcmp(a + h.value_plane_offset, b + h.value_plane_offset, h.value_plane_bytes) == 0;
}

/// Attention over `seq` of `a` and `copy` of `b`, every layer, bit for bit.
template <class Cache>
void check_same_attention(const Cache& a, SeqId seq, const Cache& b, SeqId copy) {
  const ModelShape& shape = a.shape();
  const std::vector<float> query = test::random_rows(static_cast<std::size_t>(shape.q_heads), shape.head_dim, 99);
  std::vector<float> expected(query.size()), got(query.size());
  for (index_t layer = 0; layer < shape.layers; ++layer) {
    a.attend(seq, layer, std::span<const float>(query), std::span<float>(expected), 0.125f);
    b.attend(copy, layer, std::span<const float>(query), std::span<float>(got), 0.125f);
    INFO("layer " << layer);
    CHECK(std::memcmp(expected.data(), got.data(), got.size() * sizeof(float)) == 0);
  }
}

/// The token ids a test hands the writer.
inline std::vector<std::int32_t> token_ids(index_t count) {
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(count));
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::int32_t>(1000 + 37 * i);
  return tokens;
}

}  // namespace kvpack::test
