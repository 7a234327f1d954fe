#pragma once
/// \file transformer.hpp
/// \brief The llama forward pass for one token, with attention through a KvStore.

#include <fmt/core.h>

#include <cmath>
#include <cstddef>
#include <span>
#include <utility>
#include <vector>

#include "checkpoint.hpp"
#include "kv_store.hpp"
#include "kvpack/core/types.hpp"
#include "kvpack/error.hpp"
#include "tensor_ops.hpp"

namespace llama2c {

class Transformer {
 public:
  explicit Transformer(Checkpoint checkpoint) : weights_(std::move(checkpoint)) {}

  [[nodiscard]] const Config& config() const noexcept { return weights_.config; }

  /// The attention shape a KV cache for this model needs.
  [[nodiscard]] kvpack::ModelShape kv_shape() const noexcept {
    const Config& c = config();
    return {c.layers, c.heads, c.kv_heads, c.head_dim()};
  }

  /// Runs `token` at `position` through every layer: its keys and values go into `kv` (which
  /// must hold positions 0 .. position - 1 of the same text), and `logits` [vocab] receives the
  /// scores of the next token.
  /// \throws kvpack::Error (kInvalidArgument) for a token outside the vocabulary or a position
  ///         outside the model's context [0, seq_len).
  void forward(int token, int position, KvStore& kv, std::span<float> logits) const {
    const Config& c = config();
    KVPACK_CHECK(token >= 0 && token < c.vocab_size, kInvalidArgument,
                 fmt::format("token {} is outside the vocabulary [0, {})", token, c.vocab_size));
    KVPACK_CHECK(position >= 0 && position < c.seq_len, kInvalidArgument,
                 fmt::format("position {} is outside the model's context [0, {}): a text this long needs a "
                             "model trained for a longer context",
                             position, c.seq_len));
    KVPACK_CHECK(logits.size() == static_cast<std::size_t>(c.vocab_size), kInvalidArgument,
                 fmt::format("logits has {} entries, the vocabulary {}", logits.size(), c.vocab_size));

    const auto dim = static_cast<std::size_t>(c.dim), kv_dim = static_cast<std::size_t>(c.kv_dim());
    const auto hidden = static_cast<std::size_t>(c.hidden_dim), head_dim = static_cast<std::size_t>(c.head_dim());
    const float attention_scale = 1.0f / std::sqrt(static_cast<float>(head_dim));

    std::vector<float> x(weights_.token_embedding.begin() + static_cast<std::ptrdiff_t>(token * dim),
                         weights_.token_embedding.begin() + static_cast<std::ptrdiff_t>((token + 1) * dim));
    std::vector<float> normed(dim), q(dim), k(kv_dim), v(kv_dim), attention(dim), projected(dim);
    std::vector<float> gate(hidden), up(hidden);
    for (int layer = 0; layer < c.layers; ++layer) {
      const LayerWeights& w = weights_.layers[static_cast<std::size_t>(layer)];
      ops::rms_norm(normed, x, w.attention_norm);
      ops::matvec(q, w.wq, normed);
      ops::matvec(k, w.wk, normed);
      ops::matvec(v, w.wv, normed);
      ops::rotate_pairs(q, head_dim, position);
      ops::rotate_pairs(k, head_dim, position);
      kv.append(layer, k, v, position);
      kv.attend(layer, q, attention, attention_scale);
      ops::matvec(projected, w.wo, attention);
      ops::add(x, projected);

      ops::rms_norm(normed, x, w.ffn_norm);
      ops::matvec(gate, w.w1, normed);
      ops::matvec(up, w.w3, normed);
      ops::swiglu(gate, up);
      ops::matvec(projected, w.w2, gate);
      ops::add(x, projected);
    }
    ops::rms_norm(x, x, weights_.final_norm);
    ops::matvec(logits, weights_.classifier, x);
  }

 private:
  Checkpoint weights_;
};

}  // namespace llama2c
