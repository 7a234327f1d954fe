#pragma once
/// \file needle.hpp
/// \brief The failure case (EVAL.md §2): a needle key/value planted at a chosen depth of a long
///        synthetic context, ignored by every query seen while the prompt is read, then asked
///        for by a question whose answer is the needle's value. Recall is reported per context
///        length and depth, for any policy.
///
/// Construction, per KV head h: a random unit direction u_h and a unit value w_h; every other
/// value is made orthogonal to w_h, so the needle coefficient of an output o is ⟨o, w_h⟩. The
/// needle key is a_h·u_h (a_h: the head's RMS key norm) plus small noise. Prompt queries, the
/// observation window given to prefill and the decode queries have their u_h component removed
/// ("nobody asked yet"). The question is b_h·u_h, with b_h set by bisection so the needle takes
/// `needle_mass` of the exact attention. Recall of one query head: |⟨o, w⟩ − ⟨o_ref, w⟩| ≤
/// tolerance · |⟨o_ref, w⟩|, with o_ref the exact attention over all tokens in fp32.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kvpack/eval/exact_attention.hpp"
#include "kvpack/eval/policies.hpp"
#include "kvpack/eval/synthetic.hpp"
#include "kvpack/tier/host_tier.hpp"
#include "kvpack/tier/recall.hpp"

namespace kvpack::inline v0::eval {

struct NeedleSpec {
  SyntheticSpec workload{.tokens = 4096};  ///< shape and character; `tokens` is set per context
  std::vector<index_t> contexts{4096};
  std::vector<double> depths{0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0};
  int seeds = 1;
  index_t observation_window = 32;  ///< last prompt queries handed to prefill (SnapKV's window)
  index_t decode_steps = 0;         ///< ordinary decode steps between prefill and the question
  double needle_mass = 0.6;         ///< the needle's share of exact attention for the question
  double tolerance = 0.1;           ///< relative error of the needle coefficient that still recalls
  /// Variant (EVAL.md §2): when > 0, the `pinned_span` tokens around the needle are pinned
  /// (AnyCache::pin) before prefill: no evictor may drop it, so it is retrieved at every depth.
  index_t pinned_span = 0;
  /// Variant (issue 9, part 3): every token is also written through to a host-memory tier
  /// (tier::RecallStore), and the question goes through tier::attend_with_recall: when the
  /// certified bound fires (at detector_epsilon), the dropped tokens are fetched back and the
  /// fired streams' heads attend over everything. Only caches that certify what they did not
  /// read can recall; the others run as without it. The detector's output is then used, not
  /// measured: cells count `fired` (recall ran) but no hits, misses or false alarms.
  bool recall_from_tier = false;
  /// With recall_from_tier: write-back instead of write-through. The cache demotes what its
  /// evictor drops when it drops it (KVCache::set_demotion_sink, tier::RecallStore::demote), so
  /// only those tokens are written, as the cache decodes them.
  bool recall_by_demotion = false;

  /// The unread mass above which the detector (KVCache's AttendReport) is said to fire for the
  /// question: tolerance / (1 + tolerance), 1/11 at the default 10 %. Why: every value but the
  /// needle's is orthogonal to w, so reading all tokens but a set of exact mass m gives the
  /// needle coefficient p/(1 − m) when the needle is read (relative error m/(1 − m)) and 0 when
  /// it is not (m ≥ needle_mass). Reading less fails recall exactly when m > tolerance /
  /// (1 + tolerance); the bound is ≥ m, so at this epsilon every such failure must fire. A
  /// failure below it comes from the codec's error on what was read, which the bound does not
  /// cover (a miss), and a fire on a recalled head is the bound's looseness (a false alarm).
  [[nodiscard]] double detector_epsilon() const noexcept { return tolerance / (1.0 + tolerance); }

  void validate() const {
    workload.validate();
    KVPACK_CHECK(!contexts.empty() && !depths.empty() && seeds > 0, kInvalidConfig,
                 "NeedleSpec: needs at least one context, one depth and one seed");
    for (std::size_t i = 0; i < contexts.size(); ++i) {
      const index_t t = contexts[i];
      KVPACK_CHECK(t >= 2, kInvalidConfig, detail::message("NeedleSpec: context ", t, " is below 2 tokens"));
      // A repeated context would put both rows' trials into the first and leave the second empty.
      KVPACK_CHECK(std::find(contexts.begin(), contexts.begin() + static_cast<std::ptrdiff_t>(i), t) ==
                       contexts.begin() + static_cast<std::ptrdiff_t>(i),
                   kInvalidConfig, detail::message("NeedleSpec: context ", t, " is given twice"));
    }
    for (double d : depths) {
      KVPACK_CHECK(d >= 0.0 && d <= 1.0, kInvalidConfig, detail::message("NeedleSpec: depth ", d, " outside [0, 1]"));
    }
    KVPACK_CHECK(needle_mass >= 0.5 && needle_mass < 1.0, kInvalidConfig,
                 detail::message("NeedleSpec: needle_mass ", needle_mass, " must be in [0.5, 1)"));
    KVPACK_CHECK(tolerance > 0.0 && observation_window >= 0 && decode_steps >= 0 && pinned_span >= 0, kInvalidConfig,
                 "NeedleSpec: tolerance must be positive, observation_window, decode_steps and pinned_span "
                 "non-negative");
  }
};

/// Recall at one (context, depth), over query heads and seeds.
///
/// `recalled` is EVAL.md's recall: the needle coefficient within `tolerance` of exact
/// attention's. An evictor that keeps the needle but drops other tokens the question attends to
/// raises the needle's share (60 % of the full softmax becomes ~85 % of a smaller one), which
/// fails that test although the answer is there; `retrieved` counts heads whose coefficient is
/// at least (1 − tolerance) of the reference, so "kept, output shifted" and "lost" can be told
/// apart. retrieved ≥ recalled.
struct NeedleCell {
  index_t context = 0;
  double depth = 0.0;
  int recalled = 0;
  int retrieved = 0;
  int trials = 0;
  double worst_error = 0.0;  ///< largest relative error of the needle coefficient seen
  /// The detector, over the trials of a cache that can certify what it did not read
  /// (AnyCache::certifies_unread; NeedleSpec::detector_epsilon): `fired` heads, of which
  /// `hits` failed recall and `false_alarms` recalled; `misses` failed recall without firing.
  int detector_trials = 0;
  int detector_scored = 0;  ///< of them, scored as hit, miss or false alarm (not recall_from_tier)
  int fired = 0;
  int hits = 0;
  int misses = 0;
  int false_alarms = 0;
  /// With NeedleSpec::recall_from_tier: questions for which some stream was recalled, the tier
  /// bytes fetched for them, and the bytes written through (every token of every question).
  int tier_recalls = 0;
  std::uint64_t bytes_fetched = 0;
  std::uint64_t bytes_written = 0;
  [[nodiscard]] double recall() const noexcept { return trials == 0 ? 0.0 : static_cast<double>(recalled) / trials; }
  [[nodiscard]] double retrieval() const noexcept {
    return trials == 0 ? 0.0 : static_cast<double>(retrieved) / trials;
  }
  [[nodiscard]] double fired_share() const noexcept {
    return detector_trials == 0 ? 0.0 : static_cast<double>(fired) / detector_trials;
  }
};

/// Hit rate and false-alarm rate of the detector over some cells. A rate over no case is NaN
/// (no recall failed: nothing to hit; nothing recalled: nothing to false-alarm on).
struct DetectorRates {
  int failed = 0;    ///< heads that failed recall, where the detector ran
  int recalled = 0;  ///< heads that recalled, where the detector ran
  int hits = 0, misses = 0, false_alarms = 0;
  [[nodiscard]] double hit_rate() const noexcept {
    return failed == 0 ? std::numeric_limits<double>::quiet_NaN() : static_cast<double>(hits) / failed;
  }
  [[nodiscard]] double false_alarm_rate() const noexcept {
    return recalled == 0 ? std::numeric_limits<double>::quiet_NaN() : static_cast<double>(false_alarms) / recalled;
  }
  [[nodiscard]] bool ran() const noexcept { return failed + recalled > 0; }
};

struct NeedleReport {
  std::vector<NeedleCell> cells;  ///< context-major, depths in NeedleSpec order

  /// Shares over every trial; NaN when none ran (not 0: a needle that was not asked did not fail).
  [[nodiscard]] double recall() const noexcept {
    int recalled = 0, trials = 0;
    for (const NeedleCell& c : cells) recalled += c.recalled, trials += c.trials;
    return trials == 0 ? std::numeric_limits<double>::quiet_NaN() : static_cast<double>(recalled) / trials;
  }
  [[nodiscard]] double retrieval() const noexcept {
    int retrieved = 0, trials = 0;
    for (const NeedleCell& c : cells) retrieved += c.retrieved, trials += c.trials;
    return trials == 0 ? std::numeric_limits<double>::quiet_NaN() : static_cast<double>(retrieved) / trials;
  }
  /// The detector's rates over every cell, or those of one context when `context` > 0.
  [[nodiscard]] DetectorRates detector(index_t context = 0) const noexcept {
    DetectorRates rates;
    for (const NeedleCell& c : cells) {
      if (context > 0 && c.context != context) continue;
      rates.hits += c.hits;
      rates.misses += c.misses;
      rates.false_alarms += c.false_alarms;
      rates.failed += c.hits + c.misses;
      rates.recalled += c.detector_scored - c.hits - c.misses;  // with recall from a tier, none
    }
    return rates;
  }
  /// One character per depth for `context`: '#' all recalled, '0'–'9' tenths recalled, '.' none
  /// (of the heads that retrieved it, when `retrieved`).
  [[nodiscard]] std::string compact(index_t context, bool retrieved = false) const {
    std::string s;
    for (const NeedleCell& c : cells) {
      if (c.context != context) continue;
      s += share_character(retrieved ? c.retrieval() : c.recall());
    }
    return s;
  }
  /// The detector's row for `context`, one character per depth as compact(): the share of heads
  /// for which it fired; '-' at depths where the cache could not certify (no report).
  [[nodiscard]] std::string compact_fired(index_t context) const {
    std::string s;
    for (const NeedleCell& c : cells) {
      if (c.context != context) continue;
      s += c.detector_trials == 0 ? '-' : share_character(c.fired_share());
    }
    return s;
  }

 private:
  static char share_character(double r) noexcept {
    return r == 1.0 ? '#' : r == 0.0 ? '.' : static_cast<char>('0' + std::min(9, static_cast<int>(r * 10)));
  }
};

/// The needle contexts of a spec, built once and shared by every policy measured on them.
class NeedleSuite {
 public:
  explicit NeedleSuite(NeedleSpec spec) : spec_(std::move(spec)) {
    spec_.validate();
    for (index_t context : spec_.contexts) {
      for (int seed = 0; seed < spec_.seeds; ++seed) haystacks_.push_back(make_haystack(context, seed));
    }
  }

  [[nodiscard]] const NeedleSpec& spec() const noexcept { return spec_; }

  /// Runs every (context, seed, depth) trial through a fresh cache of each policy; one report
  /// per policy, in order. Each trial is built once and shared by all policies.
  /// `progress(done, total)` is called after each trial when given; `parallel`, when given,
  /// runs a trial's policies concurrently (each has its own cache; results do not change).
  [[nodiscard]] std::vector<NeedleReport> run(std::span<const Policy> policies, const CacheConfig& config = {},
                                              const std::function<void(int, int)>& progress = {},
                                              const Executor& parallel = {}) const {
    std::vector<NeedleReport> reports(policies.size());
    for (NeedleReport& report : reports) {
      for (index_t context : spec_.contexts) {
        for (double depth : spec_.depths) report.cells.push_back({context, depth});
      }
    }
    const int total = static_cast<int>(haystacks_.size() * spec_.depths.size());
    int done = 0;
    const bool calibrated = std::any_of(policies.begin(), policies.end(), [](const Policy& p) { return p.needs_inputs; });
    for (const Haystack& haystack : haystacks_) {
      LayerKV kv = haystack.tokens;  // one working copy per haystack; needles are planted and removed
      // Each haystack is its own synthetic model: calibrate on another text of it.
      SyntheticSpec model = spec_.workload;
      model.seed = haystack.seed;
      const PolicyInputs inputs = calibrated ? synthetic_policy_inputs(model) : PolicyInputs{};
      for (std::size_t d = 0; d < spec_.depths.size(); ++d) {
        const Trial trial = plant(haystack, kv, spec_.depths[d]);
        const std::size_t cell = context_index(haystack.context) * spec_.depths.size() + d;
        const auto one = [&](index_t p) {
          run_trial(policies[p], config, inputs, haystack, kv, trial, reports[p].cells[cell]);
        };
        if (parallel) {
          parallel(static_cast<index_t>(policies.size()), one);
        } else {
          for (std::size_t p = 0; p < policies.size(); ++p) one(static_cast<index_t>(p));
        }
        remove(haystack, kv, trial.needle);
        if (progress) progress(++done, total);
      }
    }
    return reports;
  }

  [[nodiscard]] NeedleReport run(const Policy& policy, const CacheConfig& config = {}) const {
    return run(std::span<const Policy>(&policy, 1), config).front();
  }

  /// Hands `inspect(kv, needle, window, question)` the inputs of the trial at the first seed of
  /// contexts[context_index] and `depth`: for tests and for plotting what the policies see.
  template <class Inspect>
  void inspect_trial(std::size_t context_index, double depth, Inspect inspect) const {
    KVPACK_CHECK(context_index < spec_.contexts.size(), kInvalidArgument, "inspect_trial: context index out of range");
    const Haystack& haystack = haystacks_[context_index * static_cast<std::size_t>(spec_.seeds)];
    LayerKV kv = haystack.tokens;
    const Trial trial = plant(haystack, kv, depth);
    inspect(std::as_const(kv), trial.needle, std::span<const float>(trial.window), std::span<const float>(trial.question));
  }

 private:
  /// One (context, seed): the synthetic layer with values orthogonal to each head's needle
  /// value, the decode tokens that follow it, and the per-head needle geometry.
  struct Haystack {
    index_t context = 0;
    std::uint32_t seed = 0;
    LayerKV tokens;                 ///< the prompt's `context` tokens, then decode_steps more
    std::vector<float> directions;  ///< u, [kv_heads][d]
    std::vector<float> answers;     ///< w, [kv_heads][d]
    std::vector<double> key_norms;  ///< a, [kv_heads]
  };

  [[nodiscard]] std::size_t context_index(index_t context) const {
    for (std::size_t i = 0; i < spec_.contexts.size(); ++i) {
      if (spec_.contexts[i] == context) return i;
    }
    return 0;
  }

  static void random_unit(std::mt19937& rng, float* out, index_t d) {
    std::normal_distribution<double> normal;
    double norm2 = 0.0;
    std::vector<double> x(static_cast<std::size_t>(d));
    for (double& v : x) {
      v = normal(rng);
      norm2 += v * v;
    }
    for (index_t c = 0; c < d; ++c) out[c] = static_cast<float>(x[c] / std::sqrt(norm2));
  }

  /// Removes from `x` its component along the unit vector `u`.
  static void project_out(float* x, const float* u, index_t d) {
    double dot = 0.0;
    for (index_t c = 0; c < d; ++c) dot += static_cast<double>(x[c]) * u[c];
    for (index_t c = 0; c < d; ++c) x[c] -= static_cast<float>(dot * u[c]);
  }

  [[nodiscard]] Haystack make_haystack(index_t context, int seed) const {
    SyntheticSpec w = spec_.workload;
    w.tokens = context + spec_.decode_steps;
    w.seed = spec_.workload.seed + static_cast<std::uint32_t>(seed) * 7919u;
    const index_t d = w.head_dim, heads = w.kv_heads;
    Haystack h;
    h.context = context;
    h.seed = w.seed;
    h.tokens = make_layer(w);
    std::mt19937 rng(w.seed ^ 0x5EEDu);
    h.directions.resize(static_cast<std::size_t>(heads) * d);
    h.answers.resize(h.directions.size());
    h.key_norms.resize(static_cast<std::size_t>(heads));
    for (index_t head = 0; head < heads; ++head) {
      random_unit(rng, &h.directions[head * d], d);
      random_unit(rng, &h.answers[head * d], d);
      double norm2 = 0.0;
      for (index_t t = 0; t < h.tokens.tokens; ++t) {
        if (t < context) {
          for (index_t c = 0; c < d; ++c) norm2 += static_cast<double>(h.tokens.key(t, head)[c]) * h.tokens.key(t, head)[c];
        }
        project_out(h.tokens.value(t, head), &h.answers[head * d], d);
      }
      h.key_norms[head] = std::sqrt(norm2 / context);
    }
    return h;
  }

  /// Queries of the workload at `positions` with every head's needle direction removed.
  [[nodiscard]] std::vector<float> blind_queries(const Haystack& h, const LayerKV& kv,
                                                 const std::vector<std::int64_t>& positions, index_t needle,
                                                 std::uint32_t seed) const {
    SyntheticSpec w = spec_.workload;
    w.tokens = kv.tokens;
    std::vector<float> q = make_queries(w, kv, positions, seed, needle);
    const index_t d = w.head_dim, group = w.q_heads / w.kv_heads;
    for (std::size_t row = 0; row < q.size() / d; ++row) {
      const index_t head = static_cast<index_t>(row % w.q_heads) / group;
      project_out(&q[row * d], &h.directions[head * d], d);
    }
    return q;
  }

  /// What one trial feeds a cache besides the tokens (which hold the planted needle).
  struct Trial {
    index_t needle = 0;
    std::vector<float> window;                       ///< [W][q_heads][d] observation queries
    std::vector<std::vector<float>> decode_queries;  ///< one [q_heads][d] per decode step
    std::vector<float> question;                     ///< [q_heads][d]
    std::vector<double> answer;  ///< [q_heads] needle coefficient ⟨o_ref, w⟩ of exact attention
  };

  /// Plants the needle for `depth` into `kv` (a copy of h.tokens) and builds the queries.
  [[nodiscard]] Trial plant(const Haystack& h, LayerKV& kv, double depth) const {
    const SyntheticSpec& w = spec_.workload;
    const index_t d = w.head_dim, heads = w.kv_heads, group = w.q_heads / w.kv_heads;
    const index_t context = h.context;
    Trial trial;
    trial.needle = static_cast<index_t>(std::floor(depth * (context - 1)));
    std::mt19937 rng(h.seed + static_cast<std::uint32_t>(trial.needle) * 31u);
    std::normal_distribution<float> normal;

    for (index_t head = 0; head < heads; ++head) {
      const double a = h.key_norms[head];
      float* k = kv.key(trial.needle, head);
      for (index_t c = 0; c < d; ++c) {
        k[c] = static_cast<float>(a * h.directions[head * d + c] + 0.02 * a / std::sqrt(d) * normal(rng));
      }
      std::copy_n(&h.answers[head * d], d, kv.value(trial.needle, head));
    }

    const index_t window = std::min(spec_.observation_window, context);
    std::vector<std::int64_t> window_positions;
    for (index_t t = context - window; t < context; ++t) window_positions.push_back(t + 1);
    if (window > 0) trial.window = blind_queries(h, kv, window_positions, trial.needle, h.seed + 1);
    for (index_t step = 0; step < spec_.decode_steps; ++step) {
      trial.decode_queries.push_back(
          blind_queries(h, kv, {context + step + 1}, trial.needle, h.seed + 2 + static_cast<std::uint32_t>(step)));
    }

    // The question, per KV head: b·u (plus noise orthogonal to u) with b giving the needle
    // `needle_mass` of the exact attention over every token.
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    trial.question.resize(static_cast<std::size_t>(w.q_heads) * d);
    for (index_t head = 0; head < heads; ++head) {
      const float* u = &h.directions[head * d];
      std::vector<double> projection(static_cast<std::size_t>(kv.tokens));
      for (index_t t = 0; t < kv.tokens; ++t) {
        double dot = 0.0;
        for (index_t c = 0; c < d; ++c) dot += static_cast<double>(u[c]) * kv.key(t, head)[c];
        projection[t] = dot * scale;
      }
      const double b = strength_for_mass(projection, trial.needle, spec_.needle_mass);
      for (index_t g = 0; g < group; ++g) {
        float* q = &trial.question[static_cast<std::size_t>(head * group + g) * d];
        for (index_t c = 0; c < d; ++c) q[c] = static_cast<float>(0.05 * b / std::sqrt(d)) * normal(rng);
        project_out(q, u, d);
        for (index_t c = 0; c < d; ++c) q[c] += static_cast<float>(b * u[c]);
      }
    }
    const std::ptrdiff_t stride = static_cast<std::ptrdiff_t>(heads) * d;
    std::vector<double> reference(static_cast<std::size_t>(d));
    for (index_t qh = 0; qh < w.q_heads; ++qh) {
      const index_t head = qh / group;
      exact_attention_head({kv.keys.data() + head * d, stride, kv.tokens, d},
                           {kv.values.data() + head * d, stride, kv.tokens, d},
                           &trial.question[static_cast<std::size_t>(qh) * d], scale, reference.data());
      double coefficient = 0.0;
      for (index_t c = 0; c < d; ++c) coefficient += reference[c] * h.answers[head * d + c];
      trial.answer.push_back(coefficient);
    }
    return trial;
  }

  /// Puts back the haystack's own token where `plant` put the needle.
  static void remove(const Haystack& h, LayerKV& kv, index_t needle) {
    const std::size_t begin = kv.offset(needle, 0), end = kv.offset(needle + 1, 0);
    std::copy(h.tokens.keys.begin() + static_cast<std::ptrdiff_t>(begin), h.tokens.keys.begin() + static_cast<std::ptrdiff_t>(end),
              kv.keys.begin() + static_cast<std::ptrdiff_t>(begin));
    std::copy(h.tokens.values.begin() + static_cast<std::ptrdiff_t>(begin),
              h.tokens.values.begin() + static_cast<std::ptrdiff_t>(end), kv.values.begin() + static_cast<std::ptrdiff_t>(begin));
  }

  void run_trial(const Policy& policy, const CacheConfig& config, const PolicyInputs& inputs, const Haystack& h,
                 const LayerKV& kv, const Trial& trial, NeedleCell& cell) const {
    const SyntheticSpec& w = spec_.workload;
    const index_t d = w.head_dim, heads = w.kv_heads, group = w.q_heads / w.kv_heads;
    const index_t context = h.context;

    const std::unique_ptr<AnyCache> cache = policy.make({1, w.q_heads, heads, d}, config, inputs);
    const SeqId seq = cache->add_sequence();
    if (spec_.pinned_span > 0) {
      const index_t first = std::max<index_t>(0, trial.needle - spec_.pinned_span / 2);
      cache->pin(seq, first, std::min<index_t>(context - 1, first + spec_.pinned_span - 1));
    }
    const bool detector = cache->certifies_unread();
    // Write-through to a tier for the recall variant: what the evictor drops stays there.
    std::optional<tier::HostTier> host;
    std::optional<tier::RecallStore> store;
    if (spec_.recall_from_tier && detector) {
      host.emplace(std::size_t{1} << 40);  // a bound, not an allocation: nothing is ever dropped
      // Entries of one page each: recall fetches the spans the bound implicates, a page at most.
      store.emplace(*host, "needle", config.page_size);
    }
    if (store && spec_.recall_by_demotion) {
      cache->set_demotion_sink([&store](const DroppedTokens& dropped) { store->demote(dropped); });
    }
    const auto write_through = [&](index_t first, index_t count) {
      if (!store || spec_.recall_by_demotion) return;
      std::vector<std::int64_t> positions(static_cast<std::size_t>(count));
      for (index_t i = 0; i < count; ++i) positions[static_cast<std::size_t>(i)] = first + i;
      const std::size_t begin = kv.offset(first, 0), end = kv.offset(first + count, 0);
      store->write(seq, 0, heads, d, std::span<const float>(kv.keys.data() + begin, end - begin),
                   std::span<const float>(kv.values.data() + begin, end - begin), positions);
    };
    const std::size_t prompt_elements = kv.offset(context, 0);
    cache->prefill(seq, 0, std::span<const float>(kv.keys.data(), prompt_elements),
                   std::span<const float>(kv.values.data(), prompt_elements), trial.window);
    write_through(0, context);
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    std::vector<float> out(trial.question.size());
    const std::size_t kv_row = static_cast<std::size_t>(heads) * d;
    for (index_t step = 0; step < spec_.decode_steps; ++step) {
      const index_t t = context + step;
      cache->append(seq, 0, std::span<const float>(kv.key(t, 0), kv_row), std::span<const float>(kv.value(t, 0), kv_row), t);
      write_through(t, 1);
      cache->attend(seq, 0, std::span<const float>(trial.decode_queries[step]), std::span<float>(out), scale);
    }
    // The question, with the detector's report when the cache can certify what it did not read.
    AttendReport report;
    report.epsilon = spec_.detector_epsilon();
    if (store) {
      if (tier::attend_with_recall(*cache, *store, seq, 0, std::span<const float>(trial.question), std::span<float>(out),
                                   scale, report) > 0) {
        ++cell.tier_recalls;
      }
      cell.bytes_fetched += store->stats().bytes_fetched;
      cell.bytes_written += store->stats().bytes_written;
    } else if (detector) {
      cache->attend_reported(seq, 0, std::span<const float>(trial.question), std::span<float>(out), scale, report);
    } else {
      cache->attend(seq, 0, std::span<const float>(trial.question), std::span<float>(out), scale);
    }

    for (index_t qh = 0; qh < w.q_heads; ++qh) {
      const index_t head = qh / group;
      double c = 0.0;
      for (index_t ch = 0; ch < d; ++ch) {
        c += static_cast<double>(out[static_cast<std::size_t>(qh) * d + ch]) * h.answers[head * d + ch];
      }
      const double error = std::fabs(c - trial.answer[qh]) / std::fabs(trial.answer[qh]);
      cell.worst_error = std::max(cell.worst_error, std::isnan(error) ? INFINITY : error);
      const bool recalled = error <= spec_.tolerance;
      cell.recalled += recalled ? 1 : 0;
      cell.retrieved += c >= (1.0 - spec_.tolerance) * trial.answer[qh] ? 1 : 0;  // answer > 0: p·⟨w, w⟩
      ++cell.trials;
      if (detector) {
        const bool fired = report.heads[static_cast<std::size_t>(qh)].fired(report.epsilon);
        ++cell.detector_trials;
        cell.fired += fired ? 1 : 0;
        if (store) continue;  // recall acted on the fire: a recalled head is no false alarm
        ++cell.detector_scored;
        cell.hits += !recalled && fired ? 1 : 0;
        cell.misses += !recalled && !fired ? 1 : 0;
        cell.false_alarms += recalled && fired ? 1 : 0;
      }
    }
  }

  /// The b ≥ 0 at which softmax(b · projection) gives token `needle` the share `mass`
  /// (bisection: the share grows with b once the needle has the largest projection).
  static double strength_for_mass(const std::vector<double>& projection, index_t needle, double mass) {
    auto share = [&](double b) {
      double top = -INFINITY;
      for (double p : projection) top = std::max(top, b * p);
      double sum = 0.0;
      for (double p : projection) sum += std::exp(b * p - top);
      return std::exp(b * projection[needle] - top) / sum;
    };
    double low = 0.0, high = 1.0;
    for (int i = 0; i < 60 && share(high) < mass; ++i) high *= 2.0;
    KVPACK_CHECK(share(high) >= mass, kInvalidArgument,
                 "needle: no question strength gives the needle the requested attention mass "
                 "(another key projects further along the needle direction)");
    for (int i = 0; i < 30; ++i) {  // 2^-30 of the bracket: far finer than any mass that matters
      const double mid = 0.5 * (low + high);
      (share(mid) < mass ? low : high) = mid;
    }
    return high;
  }

  NeedleSpec spec_;
  std::vector<Haystack> haystacks_;
};

}  // namespace kvpack::inline v0::eval
