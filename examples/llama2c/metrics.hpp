#pragma once
/// \file metrics.hpp
/// \brief Teacher-forced logits of a text and how one run's compare with a reference run's:
///        loss, KL divergence, top-1 agreement, first greedy divergence.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <optional>
#include <span>
#include <vector>

#include "generate.hpp"
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

/// Reads `tokens` into `kv` (fresh) and keeps the logits after each one but the last.
inline LogitRows teacher_forced_logits(const Transformer& model, KvStore& kv, std::span<const int> tokens) {
  LogitRows logits{static_cast<std::size_t>(model.config().vocab_size), {}};
  Decoder decoder(model, kv);
  for (std::size_t i = 0; i + 1 < tokens.size(); ++i) {
    const std::span<const float> row = decoder.feed(tokens[i]);
    logits.values.insert(logits.values.end(), row.begin(), row.end());
  }
  return logits;
}

/// log softmax(logits), in double.
inline std::vector<double> log_softmax(std::span<const float> logits) {
  double top = -INFINITY;
  for (float x : logits) top = std::max(top, static_cast<double>(x));
  double sum = 0.0;
  for (float x : logits) sum += std::exp(x - top);
  const double log_sum = top + std::log(sum);
  std::vector<double> out(logits.size());
  for (std::size_t i = 0; i < logits.size(); ++i) out[i] = logits[i] - log_sum;
  return out;
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
  TextScore score;
  const std::size_t rows = run.rows();
  std::size_t agreements = 0;
  for (std::size_t i = 0; i < rows; ++i) {
    const std::vector<double> log_p = log_softmax(reference.row(i));
    const std::vector<double> log_q = log_softmax(run.row(i));
    score.loss -= log_q[static_cast<std::size_t>(tokens[i + 1])];
    for (std::size_t t = 0; t < log_p.size(); ++t) score.kl += std::exp(log_p[t]) * (log_p[t] - log_q[t]);
    if (argmax(reference.row(i)) == argmax(run.row(i))) {
      ++agreements;
    } else if (!score.first_divergence) {
      score.first_divergence = i + 1;
    }
  }
  score.loss /= static_cast<double>(rows);
  score.kl /= static_cast<double>(rows);
  score.top1_agreement = static_cast<double>(agreements) / static_cast<double>(rows);
  return score;
}

}  // namespace llama2c
