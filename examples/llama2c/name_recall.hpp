#pragma once
/// \file name_recall.hpp
/// \brief The real-model needle (EVAL.md §3): a story names its dog in the first sentence, runs
///        on for a few hundred tokens of the model's own text without the name, then says
///        "The dog's name was" — how likely is the name now?
///
/// The continuation is sampled once (seeded, temperature 1) with the f32 cache; every policy then
/// reads the same tokens with teacher forcing, so the log-probability of the name at its later
/// mention measures what the cache kept of the first sentence.

#include <fmt/core.h>

#include <cctype>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "generate.hpp"
#include "kv_store.hpp"
#include "kvpack/error.hpp"
#include "metrics.hpp"
#include "tokenizer.hpp"
#include "transformer.hpp"

namespace llama2c {

/// The sentence that introduces the name and the cue that asks for it again.
inline std::string name_introduction(const std::string& name) {
  return "Once upon a time, there was a little dog named " + name + ".";
}
inline constexpr const char* kNameCue = " The dog's name was";

/// One needle text: introduction, continuation, cue, name.
struct NameProbe {
  std::string name;
  std::uint64_t seed = 0;
  std::vector<int> tokens;      ///< the whole text, BOS first
  std::size_t name_begin = 0;   ///< index in `tokens` of the name's later mention
  std::size_t name_length = 0;  ///< its tokens
  std::size_t cue_begin = 0;    ///< index in `tokens` of the cue's first token
};

namespace detail {

/// Tokens that can begin spelling `name`: each piece that, less one leading space, is a non-empty
/// prefix of it or starts with it (" T", "T", " Ti", " Tim", " Timmy", ... for "Tim"; byte
/// pieces included).
inline std::vector<int> tokens_starting(const Tokenizer& tokenizer, const std::string& name) {
  std::vector<int> tokens;
  for (int id = 0; id < tokenizer.vocab_size(); ++id) {
    const std::string piece = tokenizer.piece(-1, id);
    std::string_view text = piece;
    if (text.starts_with(' ')) text.remove_prefix(1);
    if (!text.empty() && (name.starts_with(text) || text.starts_with(name))) tokens.push_back(id);
  }
  return tokens;
}

/// Whether `text` has a word that begins with `name` (so "Timmy" counts for "Tim").
inline bool mentions(const std::string& text, const std::string& name) {
  for (std::size_t at = text.find(name); at != std::string::npos; at = text.find(name, at + 1)) {
    if (at == 0 || std::isalpha(static_cast<unsigned char>(text[at - 1])) == 0) return true;
  }
  return false;
}

}  // namespace detail

/// Builds the probe for `name`, sampling `continuation_tokens` tokens with `seed` into `kv`
/// (fresh; the reference cache). Every token that could begin spelling the name is banned, so
/// the continuation does not repeat it, and so are BOS and EOS, which would end the story the dog
/// lives in.
/// \throws kvpack::Error when the continuation still spells the name (from inside a token), or
///         the text would pass the model's context.
inline NameProbe make_name_probe(const Transformer& model, const Tokenizer& tokenizer, KvStore& kv,
                                 const std::string& name, std::uint64_t seed, int continuation_tokens) {
  KVPACK_CHECK(!name.empty(), kInvalidArgument, "make_name_probe: the name is empty");
  const std::vector<int> prompt = tokenizer.encode(name_introduction(name));
  const std::vector<int> name_tokens = tokenizer.encode_fragment(" " + name);
  const std::vector<int> cue = tokenizer.encode_fragment(kNameCue);
  const std::size_t total =
      prompt.size() + static_cast<std::size_t>(continuation_tokens) + cue.size() + name_tokens.size();
  KVPACK_CHECK(total <= static_cast<std::size_t>(model.config().seq_len), kInvalidArgument,
               fmt::format("name probe for '{}' needs {} tokens, more than the model's context of {}", name, total,
                           model.config().seq_len));

  Sampling sampling{1.0f, seed, detail::tokens_starting(tokenizer, name)};
  sampling.banned.push_back(Tokenizer::kBos);
  sampling.banned.push_back(Tokenizer::kEos);
  NameProbe probe{name, seed, generate(model, kv, prompt, continuation_tokens, sampling), 0, name_tokens.size()};
  const std::string continuation = tokenizer.decode(std::span<const int>(probe.tokens).subspan(prompt.size()));
  KVPACK_CHECK(!detail::mentions(continuation, name), kInvalidArgument,
               fmt::format("the continuation sampled with seed {} spells '{}' again; pick another seed", seed, name));
  probe.cue_begin = probe.tokens.size();
  probe.tokens.insert(probe.tokens.end(), cue.begin(), cue.end());
  probe.name_begin = probe.tokens.size();
  probe.tokens.insert(probe.tokens.end(), name_tokens.begin(), name_tokens.end());
  return probe;
}

/// How well one run recalls the name.
struct NameScore {
  double log_prob = 0.0;  ///< log p(all name tokens | everything before), nats
  int top1 = 0;           ///< name tokens that were the most likely next token
};

/// Reads the probe into `kv` (fresh) and scores the name at its later mention; with
/// `prefill_tokens` > 0 the text's first tokens are one prefill (teacher_forced_logits), which
/// must end before the name.
inline NameScore score_name(const Transformer& model, KvStore& kv, const NameProbe& probe,
                            std::size_t prefill_tokens = 0) {
  KVPACK_CHECK(prefill_tokens < probe.name_begin, kInvalidArgument,
               fmt::format("score_name: a prefill of {} tokens covers the name at token {}", prefill_tokens,
                           probe.name_begin));
  const LogitRows logits = teacher_forced_logits(model, kv, probe.tokens, prefill_tokens);
  NameScore score;
  for (std::size_t i = probe.name_begin; i < probe.name_begin + probe.name_length; ++i) {
    const int token = probe.tokens[i];
    score.log_prob += kvpack::eval::log_softmax(logits.row(i - 1))[static_cast<std::size_t>(token)];
    score.top1 += argmax(logits.row(i - 1)) == token ? 1 : 0;
  }
  return score;
}

}  // namespace llama2c
