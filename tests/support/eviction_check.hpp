#pragma once
// What an evicting cache's attend must equal: exact attention (double precision) over the live
// tokens of each KV stream that it read — read_back's tokens, less those on pages select::Quest
// skipped (AttendReport::read_pages) — within the kernels' error bound over those tokens
// (support/error_bound.hpp). Shared by the eviction property test and the eviction fuzzer.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <set>
#include <vector>

#include "kvpack/cache_config.hpp"
#include "kvpack/eval/exact_attention.hpp"
#include "support/error_bound.hpp"

namespace kvpack::test {

/// The live tokens of stream `stream` on the pages `read` (indices into its block table) and in
/// its full-precision rows, decoded as read_back decodes them, in read_back's order, with what
/// attention_error_bound needs of their pages.
template <class Cache>
DecodedTokens tokens_read(const Cache& cache, SeqId seq, index_t layer, index_t stream,
                          const std::vector<index_t>& read) {
  const index_t d = cache.shape().head_dim, page = cache.config().page_size;
  const quant::PageGeometry geometry{page, d};
  const auto [key_params, value_params] = cache.codec_params(layer, stream);
  const auto& quantizer = cache.quantizer();
  const auto pages = cache.pages(seq, layer, stream);
  DecodedTokens tokens;
  tokens.page_size = page;
  // Live slots of the read pages by position (unique within a stream): the page's index among
  // the read pages (DecodedTokens::page_of), its page, the slot.
  struct Slot {
    int read_index;
    PageId page;
    index_t slot;
  };
  std::map<std::int32_t, Slot> slot_of;
  std::set<std::int32_t> skipped;
  std::vector<float> values(static_cast<std::size_t>(page) * d);
  for (index_t i = 0; i < static_cast<index_t>(pages.size()); ++i) {
    const PageId id = pages[static_cast<std::size_t>(i)];
    const bool was_read = std::find(read.begin(), read.end(), i) != read.end();
    const std::byte* metadata = cache.pool().metadata(id);
    const std::byte* live = metadata + static_cast<std::size_t>(page) * sizeof(std::int32_t);
    for (index_t t = 0; t < page; ++t) {
      std::uint64_t word = 0;
      std::memcpy(&word, live + static_cast<std::size_t>(t / 64) * sizeof(word), sizeof(word));
      if (((word >> (t % 64)) & 1u) == 0) continue;
      std::int32_t position = 0;
      std::memcpy(&position, metadata + static_cast<std::size_t>(t) * sizeof(position), sizeof(position));
      if (was_read) {
        slot_of[position] = {static_cast<int>(tokens.page_max_value.size()), id, t};
      } else {
        skipped.insert(position);
      }
    }
    if (!was_read) continue;
    // The weights' quantization is bounded by the page's largest value over every slot, dead ones too.
    const std::byte* value_plane = cache.pool().payload(id) + cache.value_plane_offset();
    quantizer.value.decode(geometry, value_plane, value_params, values.data());
    double largest = 0.0;
    for (float x : values) largest = std::max(largest, static_cast<double>(std::fabs(x)));
    tokens.page_max_value.push_back(largest);
    add_value_code_mass(quantizer.value, value_params, geometry, value_plane, tokens);
  }
  const StoredTokens kept = cache.read_back(seq, layer, stream);
  for (index_t i = 0; i < kept.size(); ++i) {
    if (skipped.count(kept.positions[i]) != 0) continue;
    tokens.keys.emplace_back(kept.keys.begin() + i * d, kept.keys.begin() + (i + 1) * d);
    tokens.values.emplace_back(kept.values.begin() + i * d, kept.values.begin() + (i + 1) * d);
    const auto slot = slot_of.find(kept.positions[i]);
    if (slot == slot_of.end()) {  // the exact prefix or the tail
      tokens.page_of.push_back(-1);
      tokens.key_scales.emplace_back();
      tokens.key_codes.emplace_back();
      tokens.turbo_keys.emplace_back();
      continue;
    }
    tokens.page_of.push_back(slot->second.read_index);
    add_key_codes(quantizer.key, key_params, geometry, cache.pool().payload(slot->second.page),
                  static_cast<int>(slot->second.slot), tokens);
  }
  return tokens;
}

/// The largest relative L2 error over query heads of `out` (attend's output for `q` on `layer`),
/// after taking off the kernels' error bound (√d times attention_error_bound's per-element one,
/// for the operands the kernels use on this CPU). The fp32 scores' rounding (large scores) and
/// the integer paths' quantized query can both move nearly tied scores apart, an error that is
/// large relative to the output where the tied tokens' values cancel.
template <class Cache>
double error_against_read_back(const Cache& cache, SeqId seq, index_t layer, const std::vector<float>& q,
                               const std::vector<float>& out, float scale, const AttendReport& report) {
  using Quantizer = typename Cache::quantizer_type;
  // Keys stored before RoPE are decoded to fp32 and rotated (kernels/cpu/rope.hpp) on every ISA.
  const Operands key_operands =
      cache.config().key_rope ? Operands::kFloat : active_operands<typename Quantizer::key_codec>();
  const Operands value_operands = active_operands<typename Quantizer::value_codec>();
  double worst = 0.0;
  const ModelShape& shape = cache.shape();
  const index_t d = shape.head_dim, group = shape.group_size();
  for (index_t s = 0; s < shape.kv_heads; ++s) {
    const DecodedTokens tokens = tokens_read(cache, seq, layer, s, report.read_pages[static_cast<std::size_t>(s)]);
    std::vector<float> k, v;
    for (std::size_t t = 0; t < tokens.keys.size(); ++t) {
      k.insert(k.end(), tokens.keys[t].begin(), tokens.keys[t].end());
      v.insert(v.end(), tokens.values[t].begin(), tokens.values[t].end());
    }
    const index_t n = static_cast<index_t>(tokens.keys.size());
    for (index_t h = s * group; h < (s + 1) * group; ++h) {
      std::vector<double> want(d);
      eval::exact_attention_head({k.data(), d, n, d}, {v.data(), d, n, d}, q.data() + h * d, scale, want.data());
      const double allowed = std::sqrt(static_cast<double>(d)) *
                             attention_error_bound(tokens, q.data() + h * d, d, scale, key_operands, value_operands);
      double diff = 0.0, norm = 0.0;
      for (index_t c = 0; c < d; ++c) {
        diff += std::pow(out[h * d + c] - want[c], 2);
        norm += want[c] * want[c];
      }
      worst = std::max(worst, std::max(0.0, std::sqrt(diff) - allowed) / std::sqrt(std::max(norm, 1e-30)));
    }
  }
  return worst;
}
/// AttendReport::read_pages as a cache that reads every page would fill it.
template <class Cache>
void every_page_read(const Cache& cache, SeqId seq, index_t layer, AttendReport& report) {
  report.read_pages.assign(static_cast<std::size_t>(cache.shape().kv_heads), {});
  for (index_t s = 0; s < cache.shape().kv_heads; ++s) {
    for (index_t i = 0; i < static_cast<index_t>(cache.pages(seq, layer, s).size()); ++i) {
      report.read_pages[static_cast<std::size_t>(s)].push_back(i);
    }
  }
}

}  // namespace kvpack::test
