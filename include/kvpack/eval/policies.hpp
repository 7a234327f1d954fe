#pragma once
/// \file policies.hpp
/// \brief Policies chosen at run time: a type-erased KVCache (`AnyCache`) and the registry of
///        built-in policy names, so one binary (compare_policies, the llama2c engine, a user's
///        sweep) can run every combination from a command line.
///
/// Engines that know their policy at compile time should use KVCache directly; the virtual
/// calls here cost nothing next to attention but hide the concrete type.

#include <algorithm>
#include <cstdint>
#include <functional>
#include <iterator>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvpack/eval/synthetic.hpp"
#include "kvpack/kvpack.hpp"

namespace kvpack::inline v0::eval {

/// The KVCache API with the policy types erased. Every call forwards to KVCache and keeps its
/// errors and guarantees.
class AnyCache {
 public:
  virtual ~AnyCache() = default;
  [[nodiscard]] virtual const ModelShape& shape() const noexcept = 0;
  [[nodiscard]] virtual const CacheConfig& config() const noexcept = 0;
  [[nodiscard]] virtual SeqId add_sequence() = 0;
  virtual void prefill(SeqId seq, index_t layer, std::span<const float> keys, std::span<const float> values,
                       std::span<const float> observation_queries = {}) = 0;
  virtual void append(SeqId seq, index_t layer, std::span<const float> key, std::span<const float> value,
                      std::int64_t position) = 0;
  virtual void attend(SeqId seq, index_t layer, std::span<const float> query, std::span<float> out,
                      float scale) const = 0;
  /// Whether attend_reported can certify what the cache did not read: every cache that keeps
  /// all tokens, and evicting ones that keep select::Quest's page summaries.
  [[nodiscard]] virtual bool certifies_unread() const noexcept { return false; }
  /// attend with KVCache's AttendReport (its epsilon set by the caller).
  /// \throws kvpack::Error (kUnsupported) when !certifies_unread()
  virtual void attend_reported(SeqId /*seq*/, index_t /*layer*/, std::span<const float> /*query*/,
                               std::span<float> /*out*/, float /*scale*/, AttendReport& /*report*/) const {
    throw Error(ErrorCode::kUnsupported, "attend_reported: this cache cannot bound what it did not read");
  }
  [[nodiscard]] virtual SeqId fork(SeqId seq) = 0;
  virtual void release(SeqId seq) = 0;
  /// Positions [first, last] of `seq` that no evictor drops (a no-op for caches that keep all).
  virtual void pin(SeqId seq, std::int64_t first, std::int64_t last) = 0;
  /// KVCache::set_demotion_sink; false (and nothing set) for caches that drop nothing.
  virtual bool set_demotion_sink(DemotionSink /*sink*/) { return false; }
  /// KVCache::writing_layer.
  [[nodiscard]] virtual index_t writing_layer(index_t layer) const { return layer; }
  [[nodiscard]] virtual index_t length(SeqId seq, index_t layer) const = 0;
  /// Tokens of one KV stream not evicted; length() for caches that keep all.
  [[nodiscard]] virtual index_t live_tokens(SeqId seq, index_t layer, index_t stream) const = 0;
  [[nodiscard]] virtual MemoryUsage memory() const noexcept = 0;
  [[nodiscard]] virtual StoredTokens read_back(SeqId seq, index_t layer, index_t stream) const = 0;
  /// The quantizer's documented rate (key and value planes averaged), metadata included.
  [[nodiscard]] virtual double nominal_bits_per_element() const noexcept = 0;
};

/// AnyCache over one concrete KVCache type. Evaluation data (synthetic workloads, K/V dumps, the
/// llama2c engine) comes with keys after RoPE; when the cache stores keys before RoPE
/// (CacheConfig::key_rope), the adapter rotates each incoming key back by its position first, so
/// every harness can drive every policy. (An engine feeds such a cache its pre-RoPE keys
/// directly; the round trip here costs float rounding only.)
template <class Cache>
class CacheAdapter final : public AnyCache {
 public:
  template <class... Args>
  explicit CacheAdapter(Args&&... args) : cache_(std::forward<Args>(args)...) {}

  [[nodiscard]] Cache& cache() noexcept { return cache_; }
  [[nodiscard]] const ModelShape& shape() const noexcept override { return cache_.shape(); }
  [[nodiscard]] const CacheConfig& config() const noexcept override { return cache_.config(); }
  [[nodiscard]] SeqId add_sequence() override { return cache_.add_sequence(); }
  void prefill(SeqId seq, index_t layer, std::span<const float> keys, std::span<const float> values,
               std::span<const float> observation_queries) override {
    cache_.prefill(seq, layer, unrotated(keys, cache_.last_position(seq, layer) + 1), values, observation_queries);
  }
  void append(SeqId seq, index_t layer, std::span<const float> key, std::span<const float> value,
              std::int64_t position) override {
    cache_.append(seq, layer, unrotated(key, position), value, position);
  }
  void attend(SeqId seq, index_t layer, std::span<const float> query, std::span<float> out,
              float scale) const override {
    cache_.attend(seq, layer, query, out, scale);
  }
  [[nodiscard]] bool certifies_unread() const noexcept override {
    return !Cache::evictor_type::kDropsTokens || !Cache::selector_type::kReadsAllPages;
  }
  void attend_reported(SeqId seq, index_t layer, std::span<const float> query, std::span<float> out, float scale,
                       AttendReport& report) const override {
    cache_.attend(seq, layer, query, out, scale, &report);
  }
  [[nodiscard]] SeqId fork(SeqId seq) override { return cache_.fork(seq); }
  void release(SeqId seq) override { cache_.release(seq); }
  void pin(SeqId seq, std::int64_t first, std::int64_t last) override { cache_.pin(seq, first, last); }
  [[nodiscard]] index_t writing_layer(index_t layer) const override { return cache_.writing_layer(layer); }
  bool set_demotion_sink(DemotionSink sink) override {
    if constexpr (Cache::evictor_type::kDropsTokens) {
      cache_.set_demotion_sink(std::move(sink));
      return true;
    }
    return false;
  }
  [[nodiscard]] index_t length(SeqId seq, index_t layer) const override { return cache_.length(seq, layer); }
  [[nodiscard]] index_t live_tokens(SeqId seq, index_t layer, index_t stream) const override {
    return cache_.live_tokens(seq, layer, stream);
  }
  [[nodiscard]] MemoryUsage memory() const noexcept override { return cache_.memory(); }
  [[nodiscard]] StoredTokens read_back(SeqId seq, index_t layer, index_t stream) const override {
    return cache_.read_back(seq, layer, stream);
  }
  [[nodiscard]] double nominal_bits_per_element() const noexcept override {
    const index_t d = cache_.shape().head_dim;
    return 0.5 * (cache_.quantizer().key.nominal_bits_per_element(d) +
                  cache_.quantizer().value.nominal_bits_per_element(d));
  }

 private:
  /// Post-RoPE rows [T][kv_heads][head_dim] at positions first, first + 1, … rotated back, or
  /// the input itself when the cache stores keys as given.
  std::span<const float> unrotated(std::span<const float> keys, std::int64_t first) {
    const std::optional<RopeSpec>& rope = cache_.config().key_rope;
    if (!rope) return keys;
    const index_t d = cache_.shape().head_dim;
    if (!tables_) tables_ = RopeTables::shared(*rope, d);
    const std::size_t row = static_cast<std::size_t>(cache_.streams_per_layer()) * d;
    scratch_.resize(keys.size());
    for (std::size_t i = 0; i * d < keys.size(); ++i) {
      rotate_with_tables(tables_->view(), first + static_cast<std::int64_t>(i * d / row), keys.data() + i * d,
                         scratch_.data() + i * d, /*inverse=*/true);
    }
    return scratch_;
  }

  Cache cache_;
  std::shared_ptr<const RopeTables> tables_;  ///< for rotating post-RoPE input back
  std::vector<float> scratch_;
};

/// What a policy may need beyond the model's shape: how the model rotates keys (policies that
/// store them before RoPE) and sample K/V per layer, after RoPE (policies calibrated offline).
struct PolicyInputs {
  std::optional<RopeSpec> model_rope{};
  std::shared_ptr<const std::vector<LayerKV>> calibration{};
};

/// Inputs for the synthetic workload `spec`: its RoPE, and calibration K/V from another text of
/// the same model (same seed, other token draws, `tokens` tokens), never the evaluated data.
inline PolicyInputs synthetic_policy_inputs(const SyntheticSpec& spec, index_t tokens = 2048) {
  SyntheticSpec sample = spec;
  sample.token_seed = spec.seed + 0x51ED;
  sample.tokens = tokens;
  RopeSpec rope;
  rope.theta = spec.rope_theta;
  rope.pairing = RopePairing::kAdjacent;  // as make_layer rotates
  return {rope, std::make_shared<const std::vector<LayerKV>>(std::vector<LayerKV>{make_layer(sample)})};
}

/// A named policy and how to build a cache with it.
struct Policy {
  using Factory = std::function<std::unique_ptr<AnyCache>(const ModelShape&, CacheConfig, const PolicyInputs&)>;
  std::string name;         ///< what command lines take, e.g. "q4_0"
  std::string description;  ///< the C++ type, e.g. "KVCache<GQA, Q4_0>"
  Factory factory;
  /// needs_inputs: the policy cannot be built without PolicyInputs (KVQuant's calibration).
  bool needs_inputs = false;
  /// Tokens one KV stream keeps once its evictor has run (the mean over layers for a sloped
  /// budget); 0 for policies that keep every token. Reports state it in tokens and as a share
  /// of each context (EVAL.md §3).
  index_t budget_tokens = 0;
  /// Evictor policies: the same policy keeping `tokens` per KV stream instead (a model with a
  /// shorter context needs a smaller budget to evict anything); empty for the others.
  std::function<Policy(index_t tokens)> with_budget{};

  [[nodiscard]] std::unique_ptr<AnyCache> make(const ModelShape& shape, CacheConfig config,
                                               const PolicyInputs& inputs = {}) const {
    return factory(shape, std::move(config), inputs);
  }
};

/// A Policy for KVCache<layout::GQA, Quantizer, Evictor, Selector>. `residual_tokens`: the
/// full-precision window the method is defined with (KIVI's R); the cache's tail is raised to
/// it (rounded up to whole pages) when the caller's config asks for less. `evictor`: the
/// instance every cache of the policy is built with (its budget and window); `selector` likewise.
template <class Quantizer, class Evictor = evict::KeepAll, class Selector = select::DenseRead>
Policy make_policy(std::string name, std::string description, Quantizer quantizer = {}, index_t residual_tokens = 0,
                   Evictor evictor = {}, Selector selector = {}) {
  using Cache = KVCache<layout::GQA, Quantizer, Evictor, Selector>;
  Policy policy{std::move(name), std::move(description),
                [quantizer, residual_tokens, evictor, selector](const ModelShape& shape, CacheConfig config,
                                                                const PolicyInputs&) -> std::unique_ptr<AnyCache> {
                  if (config.tail_tokens < residual_tokens && config.page_size > 0) {
                    config.tail_tokens = (residual_tokens + config.page_size - 1) / config.page_size * config.page_size;
                  }
                  return std::make_unique<CacheAdapter<Cache>>(shape, std::move(config), quantizer, layout::GQA{},
                                                               evictor, selector);
                }};
  if constexpr (Evictor::kDropsTokens && requires { evictor.budget.tokens; }) {
    policy.budget_tokens = evictor.budget.tokens;
  }
  return policy;
}

/// KVQuant as published (ALGORITHMS.md §2): nuq`Bits` with 1 % exact outliers, keys stored before
/// RoPE (the model's), the first token exact, codebooks and key ranges calibrated by weighted
/// k-means on `inputs.calibration` (keys rotated back first).
template <int Bits>
Policy make_kvquant_policy() {
  const std::string name = "kvquant-" + std::to_string(Bits);
  // The last calibration, reused while the same inputs come back (one per needle haystack, say):
  // k-means over millions of samples costs more than a trial.
  struct Memo {
    std::mutex mutex;
    std::shared_ptr<const std::vector<LayerKV>> calibration;
    ModelShape shape;
    index_t page_size = 0;
    std::shared_ptr<const quant::KVQuantTables> tables;
  };
  auto memo = std::make_shared<Memo>();
  Policy policy{name, "KVQuant<" + std::to_string(Bits) + ">: nuq" + std::to_string(Bits) +
                          "-1%, pre-RoPE keys, first token exact, calibrated on sample K/V",
                [name, memo](const ModelShape& shape, CacheConfig config,
                             const PolicyInputs& inputs) -> std::unique_ptr<AnyCache> {
                  KVPACK_CHECK(inputs.model_rope && inputs.calibration && !inputs.calibration->empty(), kInvalidArgument,
                               ::kvpack::detail::message(name, " needs PolicyInputs: the model's RoPE and calibration "
                                                               "K/V for each layer"));
                  KVPACK_CHECK(static_cast<index_t>(inputs.calibration->size()) == shape.layers, kInvalidArgument,
                               ::kvpack::detail::message(name, ": calibration has ", inputs.calibration->size(),
                                                         " layers, the model ", shape.layers));
                  std::lock_guard lock(memo->mutex);
                  if (memo->calibration != inputs.calibration || !(memo->shape == shape) ||
                      memo->page_size != config.page_size) {
                    quant::KVQuantCalibrator::Options options{Bits, 0.01, true, 50, 1};
                    options.page_size = config.page_size;
                    quant::KVQuantCalibrator calibrator(shape, options);
                    const auto rope = RopeTables::shared(*inputs.model_rope, shape.head_dim);
                    for (index_t layer = 0; layer < shape.layers; ++layer) {
                      LayerKV kv = (*inputs.calibration)[layer];
                      for (index_t t = 0; t < kv.tokens; ++t) {
                        for (index_t h = 0; h < kv.kv_heads; ++h) {
                          rotate_with_tables(rope->view(), t, (*inputs.calibration)[layer].key(t, h), kv.key(t, h), true);
                        }
                      }
                      calibrator.add(layer, kv.keys, kv.values);
                    }
                    memo->tables = calibrator.finish();
                    memo->calibration = inputs.calibration;
                    memo->shape = shape;
                    memo->page_size = config.page_size;
                  }
                  config.key_rope = inputs.model_rope;
                  config.exact_prefix_tokens = std::max<index_t>(config.exact_prefix_tokens, 1);
                  using Cache = KVCache<layout::GQA, quant::KVQuant<Bits>>;
                  return std::make_unique<CacheAdapter<Cache>>(shape, std::move(config),
                                                               quant::KVQuant<Bits>(memo->tables, 0.01));
                },
                true};
  return policy;
}

/// Tokens per KV stream the built-in evictor policies keep: below the needle's default contexts
/// (25 % of 2K, 12.5 % of 4K), so the failure case shows what eviction drops.
inline constexpr index_t kEvictionBudgetTokens = 512;

/// The selector evictor policies carry: select::Quest's page summaries, kept so that `attend`
/// can certify how much attention the evicted tokens may have had (AttendReport), with every
/// layer dense, so every live page is read and the output is DenseRead's. It costs the
/// summaries' memory (1 bit per element at page 32, head_dim 128, plus up to 16 ghost boxes per
/// stream) and summarising each page when it is encoded.
[[nodiscard]] inline select::Quest summaries_only() {
  select::Quest quest;
  quest.dense_layers = std::numeric_limits<index_t>::max();
  return quest;
}

/// The evictors and codecs of the eviction matrix (issue 6's failure-case table): every pair is
/// a policy named "<evictor>+<codec>" ("<evictor>" alone over f16).
inline constexpr std::string_view kMatrixEvictors[] = {"streaming-llm", "h2o", "snapkv", "pyramidkv"};
inline constexpr std::string_view kMatrixCodecs[] = {"f16", "q8_0", "q4_0", "kivi-4"};

// The registry's functions instantiate every KVCache type of the built-in policies: minutes of
// compile time for each translation unit that includes this header. A project with many such
// units compiles them once, in a file that defines KVPACK_EVAL_DEFINE_BUILTIN_POLICIES before
// including this header, and defines KVPACK_EVAL_PREBUILT_POLICIES everywhere (kvpack's own
// build: kvpack_eval_policies); the others see declarations only.
#if defined(KVPACK_EVAL_PREBUILT_POLICIES)
#define KVPACK_EVAL_REGISTRY_INLINE
#else
#define KVPACK_EVAL_REGISTRY_INLINE inline
#endif

/// The eviction-matrix policy of `evictor` over `codec` (kMatrixEvictors × kMatrixCodecs),
/// keeping `budget` tokens per KV stream; every evictor keeps page summaries (summaries_only), so
/// the needle can ask it what it dropped.
/// \throws kvpack::Error (kInvalidArgument) for an evictor or codec outside the matrix
KVPACK_EVAL_REGISTRY_INLINE Policy evictor_policy(std::string_view evictor, std::string_view codec,
                                                   index_t budget = kEvictionBudgetTokens);

/// Quest (ALGORITHMS.md §10) over fp16 pages, nothing evicted: each step reads the
/// kEvictionBudgetTokens / page_size pages per KV head whose keys may score highest (and the
/// tail), at every layer, and can certify what it skipped.
KVPACK_EVAL_REGISTRY_INLINE Policy quest_policy();

/// Every built-in policy, full precision first. New policies add themselves here.
KVPACK_EVAL_REGISTRY_INLINE std::vector<Policy> builtin_policies();

/// Every policy of the eviction matrix, evictor-major (16: run on request, not by default).
inline std::vector<Policy> eviction_matrix_policies(index_t budget = kEvictionBudgetTokens) {
  std::vector<Policy> policies;
  for (std::string_view evictor : kMatrixEvictors) {
    for (std::string_view codec : kMatrixCodecs) policies.push_back(evictor_policy(evictor, codec, budget));
  }
  return policies;
}

#if !defined(KVPACK_EVAL_PREBUILT_POLICIES) || defined(KVPACK_EVAL_DEFINE_BUILTIN_POLICIES)
/// `evictor` over quantizer Q at `budget` tokens per KV stream, with page summaries.
template <class Q>
Policy evictor_policy_over(std::string_view evictor, std::string name, const std::string& codec, index_t residual,
                    index_t budget) {
  const std::string tokens = std::to_string(budget) + " tokens per KV stream";
  if (evictor == "streaming-llm") {
    return make_policy<Q>(std::move(name), "StreamingLLM: 4 sinks + recent, " + tokens + ", " + codec, {}, residual,
                          evict::StreamingLLM<>{4, evict::Uniform{budget}}, summaries_only());
  }
  if (evictor == "h2o") {
    return make_policy<Q>(std::move(name), "H2O: half recent, half heavy hitters, " + tokens + ", " + codec, {},
                          residual, evict::H2O<>{evict::Uniform{budget}}, summaries_only());
  }
  if (evictor == "snapkv") {
    return make_policy<Q>(std::move(name), "SnapKV: window 32, max-pool 7, " + tokens + ", " + codec, {}, residual,
                          evict::SnapKV<>{.budget = evict::Uniform{budget}}, summaries_only());
  }
  // One layer (the synthetic harnesses) has no slope: there PyramidKV keeps what SnapKV keeps.
  return make_policy<Q>(std::move(name), "SnapKV with Pyramid<beta 20>: " + tokens + " on average over layers, " + codec,
                        {}, residual, evict::SnapKV<evict::Pyramid>{.budget = evict::Pyramid{budget, 20}},
                        summaries_only());
}

KVPACK_EVAL_REGISTRY_INLINE Policy evictor_policy(std::string_view evictor, std::string_view codec, index_t budget) {
  KVPACK_CHECK(std::find(std::begin(kMatrixEvictors), std::end(kMatrixEvictors), evictor) != std::end(kMatrixEvictors) &&
                   std::find(std::begin(kMatrixCodecs), std::end(kMatrixCodecs), codec) != std::end(kMatrixCodecs),
               kInvalidArgument,
               detail::message("evictor_policy: no policy for evictor '", evictor, "' over codec '", codec, "'"));
  std::string name(evictor);
  if (codec != "f16") name += "+" + std::string(codec);
  Policy policy;
  if (codec == "f16") policy = evictor_policy_over<quant::Float<half>>(evictor, name, "Float<half>", 0, budget);
  if (codec == "q8_0") policy = evictor_policy_over<quant::Q8_0>(evictor, name, "Q8_0", 0, budget);
  if (codec == "q4_0") policy = evictor_policy_over<quant::Q4_0>(evictor, name, "Q4_0", 0, budget);
  // KIVI as published keeps its newest 128 tokens in fp32 (inside the budget).
  if (codec == "kivi-4") policy = evictor_policy_over<quant::KIVI<4>>(evictor, name, "KIVI<4, 32>, residual 128", 128, budget);
  policy.with_budget = [e = std::string(evictor), c = std::string(codec)](index_t tokens) {
    return evictor_policy(e, c, tokens);
  };
  return policy;
}


KVPACK_EVAL_REGISTRY_INLINE Policy quest_policy() {
  select::Quest quest;
  quest.token_budget = kEvictionBudgetTokens;
  quest.dense_layers = 0;
  return make_policy<quant::Float<half>>("quest",
                                         "Quest: reads " + std::to_string(kEvictionBudgetTokens) +
                                             " tokens per KV head (+ tail), every layer, Float<half>",
                                         {}, 0, evict::KeepAll{}, quest);
}

KVPACK_EVAL_REGISTRY_INLINE std::vector<Policy> builtin_policies() {
  return {
      make_policy<quant::Float<float>>("f32", "Float<float>"),
      make_policy<quant::Float<half>>("f16", "Float<half>"),
      make_policy<quant::Float<bfloat16>>("bf16", "Float<bfloat16>"),
      make_policy<quant::FP8<quant::E4M3FN>>("fp8-e4m3", "FP8<E4M3FN>, calibrated per tensor"),
      make_policy<quant::FP8<quant::E5M2>>("fp8-e5m2", "FP8<E5M2>, calibrated per tensor"),
      make_policy<quant::Int8>("int8", "Int8, per-token symmetric"),
      make_policy<quant::Q8_0>("q8_0", "Q8_0 (llama.cpp block_q8_0)"),
      make_policy<quant::Q4_0>("q4_0", "Q4_0 (llama.cpp block_q4_0)"),
      make_policy<quant::Mixed<quant::Q8_0, quant::Q4_0>>("q8_0/q4_0", "Mixed<Q8_0 keys, Q4_0 values>"),
      // KIVI as published: group 32, the newest R = 128 tokens kept in full precision.
      make_policy<quant::KIVI<4>>("kivi-4", "KIVI<4, 32>, residual 128: 4-bit keys per channel, values per token", {}, 128),
      make_policy<quant::KIVI<2>>("kivi-2", "KIVI<2, 32>, residual 128: 2-bit keys per channel, values per token", {}, 128),
      make_kvquant_policy<4>(),
      make_kvquant_policy<3>(),
      make_kvquant_policy<2>(),
      // TurboQuant: every token quantized (no residual); X.5 = half the rotated channels at X+1 bits.
      make_policy<quant::TurboQuant<8>>("turbo-4", "TurboQuant<4 bits>, MSE keys and values"),
      make_policy<quant::TurboQuant<7>>("turbo-3.5", "TurboQuant<3.5 bits>, MSE keys and values"),
      make_policy<quant::TurboQuant<6>>("turbo-3", "TurboQuant<3 bits>, MSE keys and values"),
      make_policy<quant::TurboQuant<5>>("turbo-2.5", "TurboQuant<2.5 bits>, MSE keys and values"),
      make_policy<quant::TurboQuant<6, quant::TurboVariant::kProd>>("turbo-3-prod",
                                                                     "TurboQuant<3 bits>, Prod keys, MSE values"),
      make_policy<quant::QJL<>>("qjl", "QJL keys (m = 2·head_dim sign bits), TurboQuant-3 values"),
      quest_policy(),
      // Eviction over fp16 pages, one budget for all: what is dropped is gone, whatever the codec.
      evictor_policy("streaming-llm", "f16"),
      evictor_policy("h2o", "f16"),
      evictor_policy("snapkv", "f16"),
      evictor_policy("pyramidkv", "f16"),
      evictor_policy("snapkv", "q4_0"),
  };
}
#endif
#undef KVPACK_EVAL_REGISTRY_INLINE

/// The built-in or eviction-matrix policy called `name`.
/// \throws kvpack::Error (kInvalidArgument) naming the known policies when there is none.
inline Policy find_policy(std::string_view name) {
  std::string known;
  for (Policy& policy : builtin_policies()) {
    if (policy.name == name) return std::move(policy);
    known += (known.empty() ? "" : ", ") + policy.name;
  }
  for (Policy& policy : eviction_matrix_policies()) {
    if (policy.name == name) return std::move(policy);
  }
  throw Error(ErrorCode::kInvalidArgument,
              detail::message("unknown policy '", name, "'; known: ", known,
                              ", and <evictor>+<codec> for evictors streaming-llm, h2o, snapkv, pyramidkv over "
                              "q8_0, q4_0, kivi-4"));
}

}  // namespace kvpack::inline v0::eval
