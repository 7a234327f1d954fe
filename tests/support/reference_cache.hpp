#pragma once
// A plain model of a KV cache for tests: every key and value kept in std::vector, attention
// computed naively in double. It knows which tokens the real cache has encoded (all but the exact
// prefix and the tail: after the first `exact_prefix` tokens, floor((n' - tail_tokens) /
// page_size) whole pages of the n' others once n' >= tail_tokens + page_size) and passes those
// through the codec's scalar encode/decode, so the real cache can be held to the tight bound of
// its kernels rather than to the codec's quantization error. Pre-RoPE keys (a RopeSpec) are
// rotated to their positions in double after the round trip.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <vector>

#include "kvpack/core/rope.hpp"
#include "kvpack/core/types.hpp"
#include "kvpack/quant/quant_concepts.hpp"
#include "support/error_bound.hpp"

namespace kvpack::test {

template <class Quantizer>
class ReferenceCache {
 public:
  struct Layer {
    std::vector<float> keys;    // [n][streams][d]
    std::vector<float> values;  // [n][streams][d]
    std::vector<std::int64_t> positions;  // [n]
    std::int64_t last_position = -1;
    [[nodiscard]] index_t tokens(index_t row) const { return static_cast<index_t>(keys.size() / row); }
  };
  using Sequence = std::vector<Layer>;

  ReferenceCache(ModelShape shape, index_t page_size, index_t tail_tokens, index_t exact_prefix = 0,
                 std::optional<RopeSpec> key_rope = {})
      : shape_(shape), page_size_(page_size), tail_tokens_(tail_tokens), exact_prefix_(exact_prefix),
        key_rope_(key_rope) {}

  void add(SeqId id) { sequences_[id] = Sequence(static_cast<std::size_t>(shape_.layers)); }
  void fork(SeqId from, SeqId to) { sequences_[to] = sequences_.at(from); }
  void release(SeqId id) { sequences_.erase(id); }
  [[nodiscard]] bool has(SeqId id) const { return sequences_.count(id) != 0; }
  [[nodiscard]] const std::map<SeqId, Sequence>& sequences() const { return sequences_; }

  /// Tokens at consecutive positions ending at `last_position`.
  void write(SeqId id, index_t layer, const std::vector<float>& keys, const std::vector<float>& values,
             std::int64_t last_position) {
    Layer& l = sequences_.at(id)[layer];
    l.keys.insert(l.keys.end(), keys.begin(), keys.end());
    l.values.insert(l.values.end(), values.begin(), values.end());
    const auto tokens = static_cast<std::int64_t>(keys.size() / row());
    for (std::int64_t t = 0; t < tokens; ++t) l.positions.push_back(last_position - tokens + 1 + t);
    l.last_position = last_position;
  }

  [[nodiscard]] index_t row() const { return shape_.kv_heads * shape_.head_dim; }
  [[nodiscard]] index_t tokens(SeqId id, index_t layer) const { return sequences_.at(id)[layer].tokens(row()); }
  /// Pages the real cache must hold for a stream of n tokens.
  [[nodiscard]] index_t pages_for(index_t n) const {
    n = std::max<index_t>(0, n - exact_prefix_);
    return n >= tail_tokens_ + page_size_ ? (n - tail_tokens_) / page_size_ : 0;
  }

  /// Exact attention over the tokens as the cache stores them (paged tokens through the codecs'
  /// round trip). `params(s)` gives the (key, value) codec parameters of stream s. `bounds`, when
  /// given, receives per query head the kernels' error bound (support/error_bound.hpp) for the
  /// given operand kinds.
  template <class ParamsOf>
  std::vector<double> attend(const Quantizer& q, SeqId id, index_t layer, const std::vector<float>& query,
                             float scale, ParamsOf params, std::vector<double>* bounds = nullptr,
                             Operands key_operands = Operands::kFloat,
                             Operands value_operands = Operands::kFloat) const {
    const Layer& l = sequences_.at(id)[layer];
    const index_t d = shape_.head_dim;
    const index_t n = l.tokens(row());
    const index_t first_paged = std::min(n, exact_prefix_);
    const index_t paged_end = first_paged + pages_for(n) * page_size_;
    const index_t g = shape_.group_size();
    std::vector<double> out(static_cast<std::size_t>(shape_.q_heads) * d, 0.0);
    const quant::PageGeometry geometry{page_size_, d};
    for (index_t s = 0; s < shape_.kv_heads; ++s) {
      const auto [key_params, value_params] = params(s);
      // Round-trip the paged tokens of this stream through the codecs, page by page.
      std::vector<float> keys(static_cast<std::size_t>(n) * d), values(keys.size());
      for (index_t t = 0; t < n; ++t) {
        for (index_t c = 0; c < d; ++c) {
          keys[t * d + c] = l.keys[(static_cast<std::size_t>(t) * shape_.kv_heads + s) * d + c];
          values[t * d + c] = l.values[(static_cast<std::size_t>(t) * shape_.kv_heads + s) * d + c];
        }
      }
      std::vector<std::byte> key_plane(q.key.plane_bytes(geometry)), value_plane(q.value.plane_bytes(geometry));
      DecodedTokens tokens;
      tokens.page_size = page_size_;
      std::vector<std::vector<std::byte>> key_planes;  // for the bound's per-token codes
      for (index_t first = first_paged; first < paged_end; first += page_size_) {
        q.key.encode(geometry, &keys[first * d], d, key_params, key_plane.data());
        if (bounds != nullptr) key_planes.push_back(key_plane);
        q.key.decode(geometry, key_plane.data(), key_params, &keys[first * d]);
        q.value.encode(geometry, &values[first * d], d, value_params, value_plane.data());
        q.value.decode(geometry, value_plane.data(), value_params, &values[first * d]);
        double page_max = 0.0;
        for (index_t i = first * d; i < (first + page_size_) * d; ++i) page_max = std::max(page_max, static_cast<double>(std::fabs(values[i])));
        tokens.page_max_value.push_back(page_max);
        if (bounds != nullptr) add_value_code_mass(q.value, value_params, geometry, value_plane.data(), tokens);
      }
      if (key_rope_) {
        for (index_t t = 0; t < n; ++t) apply_rope_reference(*key_rope_, d, l.positions[t], &keys[t * d]);
      }
      if (bounds != nullptr) {
        for (index_t t = 0; t < n; ++t) {
          tokens.keys.emplace_back(&keys[t * d], &keys[t * d] + d);
          tokens.values.emplace_back(&values[t * d], &values[t * d] + d);
          const bool paged = t >= first_paged && t < paged_end;
          tokens.page_of.push_back(paged ? (t - first_paged) / page_size_ : -1);
          if (paged) {
            add_key_codes(q.key, key_params, geometry, key_planes[(t - first_paged) / page_size_].data(),
                          static_cast<int>((t - first_paged) % page_size_), tokens);
          } else {
            tokens.key_scales.emplace_back();
            tokens.key_codes.emplace_back();
            tokens.turbo_keys.emplace_back();
          }
        }
        bounds->resize(static_cast<std::size_t>(shape_.q_heads));
        for (index_t h = s * g; h < (s + 1) * g; ++h) {
          (*bounds)[h] = attention_error_bound(tokens, &query[h * d], d, scale, key_operands, value_operands);
        }
      }
      for (index_t h = s * g; h < (s + 1) * g; ++h) {
        std::vector<double> scores(n);
        double top = -INFINITY;
        for (index_t t = 0; t < n; ++t) {
          double dot = 0.0;
          for (index_t c = 0; c < d; ++c) dot += static_cast<double>(query[h * d + c]) * keys[t * d + c];
          scores[t] = dot * scale;
          top = std::max(top, scores[t]);
        }
        double sum = 0.0;
        for (index_t t = 0; t < n; ++t) {
          const double w = std::exp(scores[t] - top);
          sum += w;
          for (index_t c = 0; c < d; ++c) out[h * d + c] += w * values[t * d + c];
        }
        for (index_t c = 0; c < d; ++c) out[h * d + c] /= sum;
      }
    }
    return out;
  }

 private:
  ModelShape shape_;
  index_t page_size_;
  index_t tail_tokens_;
  index_t exact_prefix_;
  std::optional<RopeSpec> key_rope_;
  std::map<SeqId, Sequence> sequences_;
};

}  // namespace kvpack::test
