#pragma once
/// \file generate.hpp
/// \brief Feeding a text through the model one token at a time, and generating a fixed number
///        of tokens from it (greedy, or sampled with a seeded generator).

#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <random>
#include <span>
#include <vector>

#include "kv_store.hpp"
#include "kvpack/error.hpp"
#include "kvpack/eval/metrics.hpp"
#include "transformer.hpp"

namespace llama2c {

/// One text being read: feeds tokens at positions 0, 1, 2, ... into one KvStore.
class Decoder {
 public:
  Decoder(const Transformer& model, KvStore& kv)
      : model_(model), kv_(kv), logits_(static_cast<std::size_t>(model.config().vocab_size)) {}

  /// Reads the next token; returns the logits [vocab] of the token after it (valid until the
  /// next call). Throws kvpack::Error once the text reaches the model's context.
  std::span<const float> feed(int token) {
    model_.forward(token, position_, kv_, logits_);
    ++position_;
    return logits_;
  }

  /// Queries a prefill hands to the cache as its observation window: SnapKV's default window
  /// (ALGORITHMS.md §7).
  static constexpr int kObservationWindow = 32;

  /// Reads the whole `prompt` as one prefill (before any other token): attention within the
  /// prompt is exact, over its fresh keys and values, and the store then receives each layer's
  /// keys, values and last kObservationWindow queries in one `prefill` call, so evictors that
  /// decide at prefill see the window. Returns the logits after every prompt token,
  /// [prompt.size()][vocab]. Throws kvpack::Error when tokens were already read or the prompt is
  /// empty.
  std::vector<float> prefill(std::span<const int> prompt) {
    KVPACK_CHECK(position_ == 0, kInvalidArgument,
                 fmt::format("Decoder::prefill: the prompt must come first, but {} tokens were read", position_));
    KVPACK_CHECK(!prompt.empty(), kInvalidArgument, "Decoder::prefill: the prompt is empty");
    PrefillStaging staging(model_.kv_shape());
    std::vector<float> rows;
    rows.reserve(prompt.size() * logits_.size());
    for (int token : prompt) {
      model_.forward(token, position_, staging, logits_);
      ++position_;
      rows.insert(rows.end(), logits_.begin(), logits_.end());
    }
    staging.hand_over(kv_, kObservationWindow);
    return rows;
  }

  /// Tokens read so far.
  [[nodiscard]] int position() const noexcept { return position_; }

 private:
  const Transformer& model_;
  KvStore& kv_;
  std::vector<float> logits_;
  int position_ = 0;
};

/// The token with the largest logit (the first on ties).
inline int argmax(std::span<const float> logits) { return static_cast<int>(kvpack::eval::argmax(logits)); }

/// How generate() picks each token.
struct Sampling {
  float temperature = 0.0f;  ///< 0: greedy (argmax); otherwise sample softmax(logits / temperature)
  std::uint64_t seed = 1;    ///< of the std::mt19937_64 that draws the samples
  std::vector<int> banned;   ///< tokens never chosen
};

namespace detail {

/// A token drawn from softmax(logits / temperature); the uniform draw uses the generator's top 53
/// bits directly, so a seed gives the same text on every standard library.
inline int sample(std::span<const float> logits, float temperature, std::mt19937_64& rng) {
  const float top = *std::max_element(logits.begin(), logits.end());
  std::vector<double> weights(logits.size());
  double total = 0.0;
  for (std::size_t i = 0; i < logits.size(); ++i) {
    weights[i] = std::exp(static_cast<double>(logits[i] - top) / temperature);
    total += weights[i];
  }
  const double target = static_cast<double>(rng() >> 11) * 0x1.0p-53 * total;
  double cumulative = 0.0;
  for (std::size_t i = 0; i < weights.size(); ++i) {
    cumulative += weights[i];
    if (target < cumulative && weights[i] > 0.0) return static_cast<int>(i);
  }
  return argmax(logits);  // only reached when rounding leaves the target at the very end
}

}  // namespace detail

/// `prompt` (which should start with BOS) followed by exactly `steps` generated tokens; never
/// stops early, whatever it generates. Throws kvpack::Error when the text would pass the
/// model's context.
inline std::vector<int> generate(const Transformer& model, KvStore& kv, std::span<const int> prompt, int steps,
                                 const Sampling& sampling = {}) {
  KVPACK_CHECK(!prompt.empty(), kInvalidArgument, "generate: the prompt needs at least one token (BOS)");
  const auto context = static_cast<std::size_t>(model.config().seq_len);
  // The last generated token is never fed: prompt.size() + steps − 1 positions are used.
  KVPACK_CHECK(steps >= 0 && prompt.size() - 1 + static_cast<std::size_t>(steps) <= context, kInvalidArgument,
               fmt::format("generate: {} prompt tokens + {} steps exceed the model's context of {} tokens",
                           prompt.size(), steps, context));
  std::vector<int> tokens(prompt.begin(), prompt.end());
  Decoder decoder(model, kv);
  for (std::size_t i = 0; i + 1 < prompt.size(); ++i) decoder.feed(prompt[i]);
  std::mt19937_64 rng(sampling.seed);
  std::vector<float> logits;
  for (int step = 0; step < steps; ++step) {
    const std::span<const float> next = decoder.feed(tokens.back());
    logits.assign(next.begin(), next.end());
    for (int token : sampling.banned) {
      logits.at(static_cast<std::size_t>(token)) = -std::numeric_limits<float>::infinity();
    }
    tokens.push_back(sampling.temperature > 0.0f ? detail::sample(logits, sampling.temperature, rng) : argmax(logits));
  }
  return tokens;
}

}  // namespace llama2c
