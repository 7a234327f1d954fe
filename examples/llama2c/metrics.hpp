#pragma once
/// \file metrics.hpp
/// \brief Teacher-forced logits of a text and how one run's compare with a reference run's:
///        loss, KL divergence, top-1 agreement, first greedy divergence.

#include <fmt/core.h>

#include <cstddef>
#include <optional>
#include <span>
#include <vector>

#include "generate.hpp"
#include "kvpack/error.hpp"
#include "kvpack/eval/metrics.hpp"
#include "kv_store.hpp"
#include "transformer.hpp"

namespace llama2c {

/// The logits of a text read with teacher forcing: row i scores token i + 1 after the model has
/// read tokens 0 .. i.
struct LogitRows {
  std::size_t vocab = 0;
  std::vector<float> values;  ///< [rows][vocab]

  [[nodiscard]] std::size_t rows() const noexcept { return vocab == 0 ? 0 : values.size() / vocab; }
  [[nodiscard]] std::span<const float> row(std::size_t i) const {
    return std::span<const float>(values).subspan(i * vocab, vocab);
  }
};

/// Reads `tokens` into `kv` (fresh) and keeps the logits after each one but the last. With
/// `prefill_tokens` > 0 the first that many are one prefill (Decoder::prefill) and the rest are
/// decoded one at a time; it must leave at least one token to decode.
inline LogitRows teacher_forced_logits(const Transformer& model, KvStore& kv, std::span<const int> tokens,
                                       std::size_t prefill_tokens = 0) {
  KVPACK_CHECK(prefill_tokens == 0 || prefill_tokens < tokens.size(), kInvalidArgument,
               fmt::format("teacher_forced_logits: a prefill of {} tokens leaves none of the {} to decode",
                           prefill_tokens, tokens.size()));
  LogitRows logits{static_cast<std::size_t>(model.config().vocab_size), {}};
  Decoder decoder(model, kv);
  if (prefill_tokens > 0) logits.values = decoder.prefill(tokens.first(prefill_tokens));
  for (std::size_t i = prefill_tokens; i + 1 < tokens.size(); ++i) {
    const std::span<const float> row = decoder.feed(tokens[i]);
    logits.values.insert(logits.values.end(), row.begin(), row.end());
  }
  return logits;
}

/// One run's logits over a text against a reference run's.
struct TextScore {
  double loss = 0.0;            ///< mean -log p(next token), nats per token
  double kl = 0.0;              ///< mean over positions of KL(reference || run), nats
  double top1_agreement = 0.0;  ///< share of positions whose most likely token is the reference's
  /// The first position (index in the text, BOS = 0) whose most likely token differs from the
  /// reference's; none when all agree. When the text is the reference's own greedy output, this
  /// is where greedy decoding with the run's cache would leave it.
  std::optional<std::size_t> first_divergence;
};

/// \param tokens the text both runs read (rows + 1 tokens)
inline TextScore score_text(const LogitRows& reference, const LogitRows& run, std::span<const int> tokens) {
  kvpack::eval::LogitComparison comparison;
  TextScore score;
  for (std::size_t i = 0; i < run.rows(); ++i) {
    comparison.add(reference.row(i), run.row(i), static_cast<std::size_t>(tokens[i + 1]));
    if (!score.first_divergence && argmax(reference.row(i)) != argmax(run.row(i))) score.first_divergence = i + 1;
  }
  score.loss = comparison.loss();
  score.kl = comparison.mean_kl();
  score.top1_agreement = comparison.top1_agreement();
  return score;
}

}  // namespace llama2c
