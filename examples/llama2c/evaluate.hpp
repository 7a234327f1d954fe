#pragma once
/// \file evaluate.hpp
/// \brief A kvpack policy on the real model (EVAL.md §3), against the f32 cache: loss over a
///        fixed text, logit KL, top-1 agreement, first greedy divergence, and name recall.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "generate.hpp"
#include "kv_store.hpp"
#include "kvpack/eval/policies.hpp"
#include "metrics.hpp"
#include "name_recall.hpp"
#include "tokenizer.hpp"
#include "transformer.hpp"

namespace llama2c {

/// The policy every other is measured against: full precision in the same paged cache, so a
/// difference is the codec's, not the paging's.
inline constexpr const char* kReferencePolicy = "f32";

struct BenchmarkOptions {
  /// Tokens of the fixed text after BOS, generated greedily once (EVAL.md asks for ≥ 300).
  int text_tokens = 320;
  /// Sampled tokens between the name's introduction and its later mention (EVAL.md: ≥ 200).
  int continuation_tokens = 200;
  /// Each tokenizes to one to three tokens with a leading space.
  std::vector<std::string> names = {"Spot", "Max", "Ben", "Tim"};
  std::vector<std::uint64_t> seeds = {1, 2, 3};
  kvpack::CacheConfig cache;  ///< paging of every policy's cache, the reference's included
};

/// The model's RoPE (llama2.c: base 10^4, adjacent pairs) and calibration K/V for policies that
/// need them (kvpack::eval::PolicyInputs): every layer of a text sampled at temperature 1 with its
/// own seed, so it is not the text the policies are scored on.
inline kvpack::eval::PolicyInputs calibration_inputs(const Transformer& model, int tokens = 256,
                                                     std::uint64_t seed = 0xCA1B) {
  const kvpack::eval::Policy reference = kvpack::eval::find_policy(kReferencePolicy);
  CacheKvStore kv(reference, model.kv_shape(), {});
  Sampling sampling;
  sampling.temperature = 1.0f;
  sampling.seed = seed;
  (void)generate(model, kv, std::vector<int>{Tokenizer::kBos}, tokens, sampling);  // K/V of all but the last token
  auto layers = std::make_shared<std::vector<kvpack::eval::LayerKV>>();
  const kvpack::ModelShape shape = model.kv_shape();
  for (kvpack::index_t layer = 0; layer < shape.layers; ++layer) {
    kvpack::eval::LayerKV kv_layer{kv.cache().length(kv.sequence(), layer), shape.kv_heads, shape.head_dim, {}, {}, {}};
    kv_layer.keys.resize(kv_layer.offset(kv_layer.tokens, 0));
    kv_layer.values.resize(kv_layer.keys.size());
    for (kvpack::index_t head = 0; head < shape.kv_heads; ++head) {
      const kvpack::StoredTokens stored = kv.cache().read_back(kv.sequence(), layer, head);
      for (kvpack::index_t t = 0; t < stored.size(); ++t) {
        std::copy_n(&stored.keys[static_cast<std::size_t>(t) * shape.head_dim], shape.head_dim, kv_layer.key(t, head));
        std::copy_n(&stored.values[static_cast<std::size_t>(t) * shape.head_dim], shape.head_dim, kv_layer.value(t, head));
      }
    }
    layers->push_back(std::move(kv_layer));
  }
  kvpack::RopeSpec rope;
  rope.theta = 10000.0;
  rope.pairing = kvpack::RopePairing::kAdjacent;
  return {rope, std::move(layers)};
}

/// The texts and the reference cache's results on them, shared by every policy's evaluation.
struct Benchmark {
  kvpack::CacheConfig cache;
  kvpack::eval::PolicyInputs inputs;  ///< for policies calibrated offline (calibration_inputs)
  std::vector<int> text;  ///< BOS, then the reference cache's greedy tokens
  LogitRows text_logits;  ///< the reference cache's, teacher forced
  double text_loss = 0.0;
  std::vector<NameProbe> probes;
  std::vector<NameScore> probe_scores;  ///< the reference cache's, one per probe
  double name_log_prob = 0.0;           ///< the reference's mean over probes
};

/// Generates the texts with the reference cache and scores them with it.
inline Benchmark prepare_benchmark(const Transformer& model, const Tokenizer& tokenizer,
                                   const BenchmarkOptions& options) {
  const kvpack::eval::Policy reference = kvpack::eval::find_policy(kReferencePolicy);
  auto fresh_reference_kv = [&] { return CacheKvStore(reference, model.kv_shape(), options.cache); };
  Benchmark benchmark;
  benchmark.cache = options.cache;
  benchmark.inputs = calibration_inputs(model);
  CacheKvStore generation_kv = fresh_reference_kv();
  benchmark.text = generate(model, generation_kv, std::vector<int>{Tokenizer::kBos}, options.text_tokens);
  CacheKvStore scoring_kv = fresh_reference_kv();
  benchmark.text_logits = teacher_forced_logits(model, scoring_kv, benchmark.text);
  benchmark.text_loss = score_text(benchmark.text_logits, benchmark.text_logits, benchmark.text).loss;
  for (const std::string& name : options.names) {
    for (std::uint64_t seed : options.seeds) {
      CacheKvStore probe_generation_kv = fresh_reference_kv();
      benchmark.probes.push_back(
          make_name_probe(model, tokenizer, probe_generation_kv, name, seed, options.continuation_tokens));
      CacheKvStore probe_scoring_kv = fresh_reference_kv();
      benchmark.probe_scores.push_back(score_name(model, probe_scoring_kv, benchmark.probes.back()));
      benchmark.name_log_prob += benchmark.probe_scores.back().log_prob;
    }
  }
  if (!benchmark.probes.empty()) benchmark.name_log_prob /= static_cast<double>(benchmark.probes.size());
  return benchmark;
}

/// One policy's row of the report.
struct PolicyResult {
  std::string policy;
  std::string description;
  /// Why the policy cannot hold this model (kvpack's error message); empty when it ran.
  std::string not_applicable;
  double bits_per_element = 0.0;  ///< measured from memory() holding the fixed text, all metadata included
  double nominal_bits = 0.0;      ///< the codecs' documented rate
  TextScore text;                 ///< against the reference cache
  double loss_delta = 0.0;        ///< text.loss minus the reference's
  double name_log_prob = 0.0;     ///< mean over probes of log p(name)
  double name_log_prob_delta = 0.0;
  int name_top1 = 0;    ///< name tokens predicted top-1, over all probes
  int name_tokens = 0;  ///< name tokens, over all probes
  /// Share of the fixed text's tokens the cache still holds after it, over layers and KV heads
  /// (1 unless an evictor dropped some).
  double kept_fraction = 1.0;
};

/// Share of the tokens `kv` has read that its cache still holds, over layers and KV heads.
inline double kept_fraction(const CacheKvStore& kv) {
  const kvpack::ModelShape& shape = kv.cache().shape();
  double live = 0.0, held = 0.0;
  for (kvpack::index_t layer = 0; layer < shape.layers; ++layer) {
    for (kvpack::index_t head = 0; head < shape.kv_heads; ++head) {
      live += kv.cache().live_tokens(kv.sequence(), layer, head);
      held += kv.cache().length(kv.sequence(), layer);
    }
  }
  return held > 0.0 ? live / held : 1.0;
}

inline PolicyResult evaluate_policy(const Transformer& model, const Benchmark& benchmark,
                                    const kvpack::eval::Policy& policy) {
  PolicyResult result;
  result.policy = policy.name;
  result.description = policy.description;
  std::optional<CacheKvStore> kv;
  try {
    kv.emplace(policy, model.kv_shape(), benchmark.cache, benchmark.inputs);
  } catch (const kvpack::Error& error) {
    result.not_applicable = error.what();
    return result;
  }
  const LogitRows logits = teacher_forced_logits(model, *kv, benchmark.text);
  result.bits_per_element = kv->cache().memory().bits_per_element();
  result.kept_fraction = kept_fraction(*kv);
  result.nominal_bits = kv->cache().nominal_bits_per_element();
  result.text = score_text(benchmark.text_logits, logits, benchmark.text);
  result.loss_delta = result.text.loss - benchmark.text_loss;

  for (const NameProbe& probe : benchmark.probes) {
    CacheKvStore probe_kv(policy, model.kv_shape(), benchmark.cache, benchmark.inputs);
    const NameScore score = score_name(model, probe_kv, probe);
    result.name_log_prob += score.log_prob;
    result.name_top1 += score.top1;
    result.name_tokens += static_cast<int>(probe.name_length);
  }
  if (!benchmark.probes.empty()) result.name_log_prob /= static_cast<double>(benchmark.probes.size());
  result.name_log_prob_delta = result.name_log_prob - benchmark.name_log_prob;
  return result;
}

/// One policy when the texts arrive as a prompt, prefilled at once, and a decoded rest: how
/// engines serve, and the only way SnapKV and PyramidKV evict (they decide at prefill, from the
/// prompt's last queries). Attention within the prompt is exact (Decoder::prefill), so only
/// what is decoded after the prefill can show the cache's losses.
struct PrefilledResult {
  std::string policy;
  std::string not_applicable;  ///< kvpack's error when the policy cannot hold this model
  /// The fixed text: its first half is the prompt. Share of its tokens held after the text.
  double kept_fraction = 1.0;
  double decode_loss = 0.0;  ///< mean -log p(next token) over the decoded half, nats
  /// Mean over probes of log p(name) when the prompt ends before the cue: the question comes
  /// after the cache was compressed (EVAL.md's failure case).
  double name_question_after = 0.0;
  /// The same when the prompt ends before the cue's last token: most of the question is in the
  /// observation window, and the name is still predicted from the compressed cache.
  double name_question_in_window = 0.0;
};

/// The policy read with a prefill (PrefilledResult); a policy that cannot hold the model gets
/// not_applicable instead.
inline PrefilledResult evaluate_prefilled(const Transformer& model, const Benchmark& benchmark,
                                          const kvpack::eval::Policy& policy) {
  PrefilledResult result;
  result.policy = policy.name;
  const auto fresh_kv = [&] { return CacheKvStore(policy, model.kv_shape(), benchmark.cache, benchmark.inputs); };
  try {
    (void)fresh_kv();  // one cache built up front, so a policy that cannot hold the model says why
  } catch (const kvpack::Error& error) {
    result.not_applicable = error.what();
    return result;
  }
  const std::vector<int>& text = benchmark.text;
  const std::size_t prompt = text.size() / 2;
  CacheKvStore text_kv = fresh_kv();
  const LogitRows logits = teacher_forced_logits(model, text_kv, text, prompt);
  result.kept_fraction = kept_fraction(text_kv);
  for (std::size_t row = prompt; row < logits.rows(); ++row) {
    result.decode_loss -= kvpack::eval::log_softmax(logits.row(row))[static_cast<std::size_t>(text[row + 1])];
  }
  result.decode_loss /= static_cast<double>(logits.rows() - prompt);

  for (const NameProbe& probe : benchmark.probes) {
    CacheKvStore after_kv = fresh_kv(), in_window_kv = fresh_kv();
    result.name_question_after += score_name(model, after_kv, probe, probe.cue_begin).log_prob;
    result.name_question_in_window += score_name(model, in_window_kv, probe, probe.name_begin - 1).log_prob;
  }
  if (!benchmark.probes.empty()) {
    result.name_question_after /= static_cast<double>(benchmark.probes.size());
    result.name_question_in_window /= static_cast<double>(benchmark.probes.size());
  }
  return result;
}

}  // namespace llama2c
