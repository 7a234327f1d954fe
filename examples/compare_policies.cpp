/// \file compare_policies.cpp
/// \brief The main job: every kvpack policy on one workload, side by side.
///
/// Default workload: one Llama-3.1-8B layer (32 query heads, 8 KV heads, head_dim 128) holding a
/// 32K-token synthetic context (eval/synthetic.hpp: outlier key channels, RoPE, sinks, recency,
/// flat values), the needle failure case at 2K tokens (eval/needle.hpp; --needle-contexts for more),
/// with the detector's answer for each question, and — when its
/// files are present — the real stories260K model. For each policy: bits per element measured from
/// KVCache::memory(), the bytes of a 32K sequence over 32 layers, attention-output error against
/// exact attention on the fp32 inputs, needle recall per depth, the real model's loss delta, and
/// decode attention speed (encoded bytes read per second, one thread). Evictor policies get the
/// workload's last 32 prompt queries as their observation window, are charged their memory after
/// eviction over every context token, run on stories260K at a budget scaled to its context
/// (--model-budget), and with --pinned also on the needle pinned (EVAL.md §2); on the needle they
/// also run with every token written through to a tier, and again with only what they drop
/// written back, recalled when the certified bound fires (kvpack/tier/recall.hpp;
/// --no-recall-tier skips both).
///
/// Usage: compare_policies --help

#include <fmt/core.h>
#include <fmt/os.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/cli.hpp"
#include "common/pareto_plot.hpp"
#include "common/progress_bar.hpp"
#include "kvpack/eval.hpp"
#include "kvpack/io/replacing_file.hpp"
#include "llama2c/checkpoint.hpp"
#include "llama2c/evaluate.hpp"
#include "llama2c/model_files.hpp"
#include "llama2c/tokenizer.hpp"
#include "llama2c/transformer.hpp"

namespace {

using namespace kvpack;
using examples::UsageError;

constexpr int kModelLayers = 32;
constexpr index_t kObservationWindow = 32;  // SnapKV's w: the last prompt queries handed to prefill
constexpr index_t kPinnedSpan = 16;         // the needle's pinned variant: tokens pinned around it
// Evictor budget on stories260K, whose sequences (<= 321 tokens) fit kEvictionBudgetTokens: an
// eighth of its 512-token context, as 512 is an eighth of the 4K needle.
constexpr index_t kModelEvictionBudget = 64;
// Built-in policies the default run leaves out (--policies runs them), to keep it near a minute:
// each prefill-scoring evictor adds ~10 s of observation scoring. On this one-layer workload
// PyramidKV's budget has no layers to slope over (it keeps what SnapKV keeps), and snapkv+q4_0
// only shows that eviction composes with a codec.
constexpr std::string_view kNotByDefault[] = {"pyramidkv", "snapkv+q4_0"};

struct Options {
  index_t context = 32768;
  int queries = 8;
  std::uint32_t seed = 1;
  // One context by default, to keep the run near a minute (4096 added 30 s); --needle-contexts
  // asks for more.
  std::vector<index_t> needle_contexts{2048};
  std::vector<std::string> policies;  // empty: all built-in but kNotByDefault
  bool eviction_matrix = false;       // also every evictor x codec pair (eval::eviction_matrix_policies)
  bool pinned = false;                // the needle's pinned variant for the evictors
  bool recall_tier = true;            // the evictors on the needle with evict-to-tier + recall
  index_t budget = eval::kEvictionBudgetTokens;  // evictors' tokens per KV stream (synthetic, needle)
  index_t model_budget = kModelEvictionBudget;
  std::string kv_dump;  // empty: the synthetic layer
  index_t dump_layer = 0;
  index_t dump_group = 4;  // query heads per KV head for the queries asked of a dump
  double dump_rope_theta = 10000.0;  // how the dump's keys were rotated (llama2c's base)
  std::string json_path, csv_path;
  std::string plot_path = "compare_policies_pareto.png";
  std::string model_dir = llama2c::default_model_dir().string();
  bool real_model = true;
};

void print_usage(std::FILE* to) {
  fmt::print(to,
             "usage: compare_policies [options]\n"
             "  --context N          tokens in the synthetic context (default 32768, 32 to 262144)\n"
             "  --queries N          decode queries measured per policy (default 8, 1 to 1000)\n"
             "  --seed N             workload seed (default 1)\n"
             "  --kv-dump FILE       measure error and speed on real K/V from a kvpack dump (eval/kv_dump.hpp;\n"
             "                       llama2c --dump-kv writes one) instead of the synthetic layer\n"
             "  --dump-layer N       the dump's layer to use (default 0)\n"
             "  --dump-group N       query heads per KV head for the synthetic queries asked of it (default 4)\n"
             "  --dump-rope-theta X  RoPE base the dump's keys were rotated with, adjacent pairs (default 10000,\n"
             "                       llama2c's); pre-RoPE policies (kvquant-*) rotate the keys back with it\n"
             "  --needle-contexts L  comma-separated needle context lengths (default 2048; 'none' skips)\n"
             "  --policies L         comma-separated policy names (default: all built-in but pyramidkv, which\n"
             "                       keeps what snapkv keeps on one layer, and snapkv+q4_0); also\n"
             "                       <evictor>+<codec>: streaming-llm, h2o, snapkv, pyramidkv over q8_0, q4_0, kivi-4\n"
             "  --eviction-matrix    add every evictor x codec pair (4 evictors x f16, q8_0, q4_0, kivi-4)\n"
             "  --pinned             also run the evictors on the needle pinned (first needle context)\n"
             "  --no-recall-tier     skip the evictors on the needle with every token written through to a\n"
             "                       tier (and, again, with what they drop written back) and recalled when\n"
             "                       the certified bound fires (first needle context)\n"
             "  --budget N           evictors' tokens per KV stream on the synthetic layer and the needle\n"
             "                       (default 512; 1 to 262144)\n"
             "  --model-budget N     evictors' tokens per KV stream on stories260K (default 64; 1 to 512)\n"
             "  --model-dir DIR      stories260K files (default $KVPACK_MODEL_DIR or ../shared/models/stories260K)\n"
             "  --no-model           skip the real-model columns\n"
             "  --json FILE          also write the rows as JSON\n"
             "  --csv FILE           also write the rows as CSV\n"
             "  --plot FILE          Pareto plot PNG (default compare_policies_pareto.png; 'none' skips)\n");
}

Options parse(int argc, char** argv) {
  Options o;
  examples::ArgReader args(argc, argv);
  while (args.next()) {
    if (args.is("--help") || args.is("-h")) {
      print_usage(stdout);
      std::exit(0);
    } else if (args.is("--no-model")) {
      o.real_model = false;
    } else if (args.is("--context")) {
      o.context = args.number<index_t>(32, 262144);
    } else if (args.is("--queries")) {
      o.queries = args.number<int>(1, 1000);
    } else if (args.is("--seed")) {
      o.seed = args.number<std::uint32_t>(0, 0xFFFFFFFFu);
    } else if (args.is("--kv-dump")) {
      o.kv_dump = std::string(args.value());
    } else if (args.is("--dump-layer")) {
      o.dump_layer = args.number<index_t>(0, 1 << 20);
    } else if (args.is("--dump-group")) {
      o.dump_group = args.number<index_t>(1, 64);
    } else if (args.is("--dump-rope-theta")) {
      o.dump_rope_theta = args.real(examples::RealBound::kPositive);
      if (o.dump_rope_theta <= 1.0) throw UsageError{"--dump-rope-theta expects a RoPE base > 1"};
    } else if (args.is("--needle-contexts")) {
      o.needle_contexts.clear();
      if (const std::string_view list = args.value(); list != "none") {
        for (const std::string& item : examples::split(list, ',')) {
          o.needle_contexts.push_back(examples::parse_number<index_t>("--needle-contexts", item, 16, 262144));
        }
      }
    } else if (args.is("--policies")) {
      o.policies = examples::split(args.value(), ',');
    } else if (args.is("--eviction-matrix")) {
      o.eviction_matrix = true;
    } else if (args.is("--pinned")) {
      o.pinned = true;
    } else if (args.is("--no-recall-tier")) {
      o.recall_tier = false;
    } else if (args.is("--budget")) {
      o.budget = args.number<index_t>(1, 262144);
    } else if (args.is("--model-budget")) {
      o.model_budget = args.number<index_t>(1, 512);
    } else if (args.is("--model-dir")) {
      o.model_dir = llama2c::given_model_dir(args.value());
    } else if (args.is("--json")) {
      o.json_path = std::string(args.value());
    } else if (args.is("--csv")) {
      o.csv_path = std::string(args.value());
    } else if (args.is("--plot")) {
      const std::string_view path = args.value();
      o.plot_path = path == "none" ? "" : std::string(path);
    } else {
      throw UsageError{fmt::format("unknown option '{}'", args.name())};
    }
  }
  return o;
}

struct Row {
  std::string policy, description;
  std::string not_applicable;   // why the policy cannot store this workload; empty when it ran
  double bits_per_element = 0;  // measured, everything included, per element of the context
  double bits_per_stored_element = 0;  // the same per element still held (EVAL.md §4; evictors differ)
  double payload_bits = 0;      // page payload only (the codec's own rate)
  double sequence_bytes = 0;    // one sequence of `context` tokens over 32 layers
  double kept = 1;              // share of the context's tokens the cache still holds
  index_t budget_tokens = 0;    // the evictor's tokens per KV stream; 0: keeps all
  eval::Summary error;          // attention-output relative error per head
  eval::ReconstructionError reconstruction;  // stored K and V against the fp32 input
  eval::NeedleReport needle;
  std::optional<eval::NeedleReport> pinned_needle;  // evictors: the needle inside a pinned span
  std::optional<eval::NeedleReport> recall_needle;  // evictors: evict-to-tier + bound-driven recall
  std::optional<eval::NeedleReport> demoted_needle;  // the same with write-back (demotion) to the tier
  std::optional<llama2c::PolicyResult> model;  // empty: no model; not_applicable says why it did not run
  index_t model_budget_tokens = 0;  // evictors: tokens per KV stream on the real model (--model-budget)
  std::optional<llama2c::PrefilledResult> model_prefilled;  // evictors: the real model read with a prefill
  double decode_gbps = 0, seconds_per_attend = 0, vs_f16 = 0;
};

/// Attention error, bytes and decode speed of one policy on one layer (synthetic or from a dump).
/// One policy's cache holding the layer, between measuring its error and timing it.
struct LayerCache {
  std::unique_ptr<eval::AnyCache> cache;
  SeqId seq = 0;
};

/// Bytes and attention error of one policy on one layer (synthetic or from a dump); the cache is
/// kept for time_layer.
LayerCache measure_layer(const eval::Policy& policy, const eval::SyntheticSpec& spec,
                         const eval::PolicyInputs& inputs, const eval::LayerKV& layer,
                         const std::vector<float>& window, const std::vector<float>& queries,
                         const std::vector<std::vector<double>>& exact, Row& row) {
  LayerCache held{policy.make({1, spec.q_heads, spec.kv_heads, spec.head_dim}, {}, inputs), 0};
  eval::AnyCache& cache = *held.cache;
  held.seq = cache.add_sequence();
  cache.prefill(held.seq, 0, std::span<const float>(layer.keys), std::span<const float>(layer.values),
                std::span<const float>(window));
  const MemoryUsage memory = cache.memory();
  const eval::MeasuredBits bits =
      eval::measured_bits(memory, static_cast<std::size_t>(cache.config().page_size) * 2 * spec.head_dim);
  // memory() divides by the elements still held; an evictor is charged for every context token.
  index_t live = 0;
  for (index_t s = 0; s < spec.kv_heads; ++s) live += cache.live_tokens(held.seq, 0, s);
  row.kept = static_cast<double>(live) / (static_cast<double>(cache.length(held.seq, 0)) * spec.kv_heads);
  row.budget_tokens = policy.budget_tokens;
  row.bits_per_element = bits.all_in * row.kept;
  row.bits_per_stored_element = bits.all_in;
  row.payload_bits = bits.payload;
  row.sequence_bytes = static_cast<double>(memory.total()) * kModelLayers;
  row.error = eval::attention_error(cache, held.seq, 0, queries, exact);
  row.reconstruction = eval::reconstruction_error(cache, held.seq, 0, layer);
  return held;
}

/// Decode speed of a measured cache, alone on the machine.
void time_layer(const LayerCache& held, const eval::SyntheticSpec& spec, const std::vector<float>& queries,
                std::size_t query_count, Row& row) {
  const eval::AnyCache& cache = *held.cache;
  const SeqId seq = held.seq;
  const MemoryUsage memory = cache.memory();
  const std::size_t query_size = static_cast<std::size_t>(spec.q_heads) * spec.head_dim;
  std::vector<float> out(query_size);
  // Speed: the same decode step repeated; bytes read = every page payload plus the fp32 tail.
  const double bytes_read = static_cast<double>(memory.page_payload) + static_cast<double>(memory.tails);
  // One untimed step (workspace allocation, first touches), then 2 to 10 repeats, stopping after
  // a quarter second: enough for a quick timing of slow kernels.
  cache.attend(seq, 0, std::span<const float>(queries.data(), query_size), std::span<float>(out),
               1.0f / std::sqrt(static_cast<float>(spec.head_dim)));
  const auto start = std::chrono::steady_clock::now();
  int repeats = 0;
  double elapsed = 0.0;
  while (repeats < 2 || (repeats < 10 && elapsed < 0.25)) {
    cache.attend(seq, 0, std::span<const float>(&queries[(repeats % query_count) * query_size], query_size),
                 std::span<float>(out), 1.0f / std::sqrt(static_cast<float>(spec.head_dim)));
    ++repeats;
    elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  row.seconds_per_attend = elapsed / repeats;
  row.decode_gbps = bytes_read / row.seconds_per_attend / 1e9;
}

std::string needle_cell(const Options& o, const Row& r) {
  std::string s;
  for (index_t context : o.needle_contexts) {
    if (!s.empty()) s += ' ';
    s += r.needle.compact(context);
  }
  return s;
}

template <class Field>
std::string model_cell(const Row& r, Field field, const char* format) {
  if (!r.model || !r.model->not_applicable.empty()) return "n/a";
  return fmt::format(fmt::runtime(format), field(*r.model));
}

void print_table(const Options& o, index_t tokens, const std::vector<Row>& rows, bool have_model) {
  std::size_t name_width = 11;  // the matrix's names ("streaming-llm+kivi-4") are longer
  for (const Row& r : rows) name_width = std::max(name_width, r.policy.size());
  fmt::print("{:<{}} {:>9} {:>9} {:>11} {:>8} {:>8} {:>9} {:>9} {:>{}} {:>11} {:>9} {:>8} {:>7}\n", "policy", name_width, "bits/elem",
             "payload", tokens % 1024 == 0 ? fmt::format("{}K seq", tokens / 1024) : fmt::format("{} tok", tokens),
             "K recon", "V recon", "rel.err", "p99 err", "needle recall", 12 * o.needle_contexts.size(), have_model ? "loss delta" : "",
             have_model ? "name logp" : "", "GB/s", "vs f16");
  for (const Row& r : rows) {
    if (!r.not_applicable.empty()) {
      fmt::print("{:<{}} n/a: {}\n", r.policy, name_width, r.not_applicable);
      continue;
    }
    fmt::print("{:<{}} {:>9.3f} {:>9.3f} {:>7.3f} GiB {:>8.2e} {:>8.2e} {:>9.2e} {:>9.2e} {:>{}} {:>11} {:>9} {:>8.2f} {:>6.2f}x\n",
               r.policy, name_width, r.bits_per_element, r.payload_bits, r.sequence_bytes / (1024.0 * 1024 * 1024),
               r.reconstruction.keys, r.reconstruction.values, r.error.mean,
               r.error.p99, needle_cell(o, r), 12 * o.needle_contexts.size(),
               have_model ? model_cell(r, [](const llama2c::PolicyResult& m) { return m.loss_delta; }, "{:+.4f}") : "",
               have_model ? model_cell(r, [](const llama2c::PolicyResult& m) { return m.name_log_prob_delta; }, "{:+.3f}") : "",
               r.decode_gbps, r.vs_f16);
  }
}

/// Budget, kept share, needle retrieval and the pinned variant of each evictor row: the main
/// table's needle column is EVAL.md's strict recall, which an evictor fails even where it kept
/// the needle (the dropped tokens shift the output; eval::NeedleCell).
void print_eviction(const Options& o, index_t tokens, const std::vector<Row>& rows, std::optional<std::size_t> model_tokens,
                    index_t model_context) {
  if (std::none_of(rows.begin(), rows.end(), [](const Row& r) { return r.budget_tokens > 0; })) return;
  const auto share = [](index_t budget, index_t context) {
    return fmt::format("{:.1f} % of {}", 100.0 * std::min<double>(1.0, static_cast<double>(budget) / context), context);
  };
  fmt::print("\neviction (budget = tokens kept per KV stream; bits/elem above = memory after eviction over every "
             "context token):\n");
  for (const Row& r : rows) {
    if (r.budget_tokens == 0 || !r.not_applicable.empty()) continue;
    std::string budget = fmt::format("{} tokens = {}", r.budget_tokens, share(r.budget_tokens, tokens));
    for (index_t context : o.needle_contexts) budget += ", " + share(r.budget_tokens, context);
    fmt::print("  {:<20} {}; kept {:.1f} % of the {}-token layer, {:.3f} bits per kept element\n", r.policy, budget,
               100.0 * r.kept, tokens, r.bits_per_stored_element);
    if (!o.needle_contexts.empty()) {
      std::string retrieved, pinned;
      for (index_t context : o.needle_contexts) {
        retrieved += (retrieved.empty() ? "" : " ") + r.needle.compact(context, true);
        if (r.pinned_needle && context == o.needle_contexts.front()) pinned = r.pinned_needle->compact(context, true);
      }
      fmt::print("  {:<20} needle retrieved {}   pinned: {}\n", "", retrieved,
                 pinned.empty() ? "not run (--pinned)" : pinned);
      const index_t context = o.needle_contexts.front();
      const auto print_recall = [&](const std::optional<eval::NeedleReport>& report, const char* how) {
        if (!report) return;
        int questions = 0, recalls = 0;
        std::uint64_t bytes = 0, written = 0;
        for (const eval::NeedleCell& c : report->cells) {
          ++questions;
          recalls += c.tier_recalls;
          bytes += c.bytes_fetched;
          written += c.bytes_written;
        }
        fmt::print("  {:<20} {}: recall {} (without: {}); recalled on {} of {} questions; {:.2f} MiB written per "
                   "question, {:.2f} MiB fetched per recall ({:.1f} % of what was written)\n",
                   "", how, report->compact(context), r.needle.compact(context), recalls, questions,
                   static_cast<double>(written) / questions / (1 << 20),
                   recalls == 0 ? 0.0 : static_cast<double>(bytes) / recalls / (1 << 20),
                   written == 0 ? 0.0 : 100.0 * static_cast<double>(bytes) / static_cast<double>(written));
      };
      print_recall(r.recall_needle, "write-through + recall");
      print_recall(r.demoted_needle, "write-back + recall   ");
    }
    if (r.model && r.model->not_applicable.empty() && r.model_budget_tokens > 0 && model_tokens) {
      fmt::print("  {:<20} stories260K at {} tokens = {} (its context), {} (its longest sequence): kept {:.1f} % of "
                 "the text\n",
                 "", r.model_budget_tokens, share(r.model_budget_tokens, model_context),
                 share(r.model_budget_tokens, static_cast<index_t>(*model_tokens)), 100.0 * r.model->kept_fraction);
    }
  }
  if (!o.needle_contexts.empty()) {
    fmt::print("needle retrieved: the needle coefficient at least 90 % of exact attention's (kept; strict recall in the "
               "table also fails when dropping other tokens raises it); pinned: the {} tokens around the needle "
               "pinned before prefill ({} tokens).\n",
               kPinnedSpan, o.needle_contexts.front());
  }
  if (model_tokens) {
    fmt::print("stories260K: the evictors' model columns use {} tokens per KV stream (--model-budget); the engine "
               "appends token by token, and SnapKV/PyramidKV decide only at a prefill with observation queries, so "
               "they keep every token there (see 'kept'; the prefill table below is where they evict).\n",
               o.model_budget);
  }
}

/// The evictors on stories260K when each text is a prompt prefilled at once (the observation
/// window: its last queries) and a decoded rest, against the f32 cache read the same way.
void print_prefilled(const std::vector<Row>& rows, const std::optional<llama2c::PrefilledResult>& reference,
                     index_t budget) {
  if (!reference || std::none_of(rows.begin(), rows.end(), [](const Row& r) { return r.model_prefilled.has_value(); })) {
    return;
  }
  fmt::print("\nstories260K with a prefill, evictors at {} tokens per KV stream (--model-budget): the text's first half "
             "and each probe up to its question are one prefill with the last {} queries as the observation window, "
             "the rest is decoded; deltas against the f32 cache read the same way (decode loss {:.4f} nats/token, "
             "name log p {:.3f} / {:.3f}):\n",
             budget, llama2c::Decoder::kObservationWindow, reference->decode_loss, reference->name_question_after,
             reference->name_question_in_window);
  fmt::print("  {:<20} {:>10} {:>16} {:>22} {:>22}\n", "policy", "kept", "decode loss Δ", "name Δ, question after",
             "name Δ, question in window");
  for (const Row& r : rows) {
    if (!r.model_prefilled) continue;
    const llama2c::PrefilledResult& m = *r.model_prefilled;
    if (!m.not_applicable.empty()) {
      fmt::print("  {:<20} n/a: {}\n", r.policy, m.not_applicable);
      continue;
    }
    fmt::print("  {:<20} {:>9.1f}% {:>+16.4f} {:>+22.3f} {:>+22.3f}\n", r.policy, 100.0 * m.kept_fraction,
               m.decode_loss - reference->decode_loss, m.name_question_after - reference->name_question_after,
               m.name_question_in_window - reference->name_question_in_window);
  }
  fmt::print("question after: the prefill ends before \"The dog's name was\", so the window never saw the question; "
             "in window: it ends before \" was\", so the window holds most of it. Kept: share of the text held after "
             "it (evictors keep every decoded token).\n");
}

/// The detector (eval::NeedleSpec::detector_epsilon): per policy that can certify what it did
/// not read, its hit rate over the heads that failed recall and its false-alarm rate over those
/// that recalled, and the share of heads it fired for at each depth.
void print_detector(const Options& o, const std::vector<Row>& rows) {
  if (o.needle_contexts.empty()) return;
  const auto rate = [](double r) { return std::isnan(r) ? std::string("—") : fmt::format("{:.0f} %", 100.0 * r); };
  fmt::print("\nneedle detector (AttendReport for the question, epsilon {:.4f} = tolerance / (1 + tolerance)):\n",
             eval::NeedleSpec{}.detector_epsilon());
  fmt::print("  {:<20} {:>9} {:>12} {:>7} {:>6} {:>6}  recall / fired per depth, per context\n", "policy", "hit rate",
             "false alarm", "misses", "hits", "alarms");
  for (const Row& r : rows) {
    if (!r.not_applicable.empty()) continue;
    const eval::DetectorRates d = r.needle.detector();
    std::string depth_rows;
    for (index_t context : o.needle_contexts) {
      depth_rows += fmt::format("{}{} / {}", depth_rows.empty() ? "" : "   ", r.needle.compact(context),
                                r.needle.compact_fired(context));
    }
    if (!d.ran()) {
      fmt::print("  {:<20} {:>9} {:>12} {:>7} {:>6} {:>6}  {}\n", r.policy, "n/a", "n/a", "", "", "", depth_rows);
      continue;
    }
    fmt::print("  {:<20} {:>9} {:>12} {:>7} {:>6} {:>6}  {}\n", r.policy, rate(d.hit_rate()), rate(d.false_alarm_rate()),
               d.misses, d.hits, d.false_alarms, depth_rows);
  }
  fmt::print("hit rate: heads that failed recall and fired, over those that failed; false alarm: heads that recalled "
             "and fired, over those that recalled ('—': no such head); fired row: '#' every head, digits tenths, '.' "
             "none, '-' no report (an evicting cache without page summaries).\n");
}

/// `text` as a JSON string literal (quotes, backslashes and control characters escaped).
/// `x` formatted by `spec` ("{:.4f}"), or `missing` when it is NaN or infinite: JSON has no
/// such numbers (an error that could not be measured, a needle that did not run).
std::string finite_or(double x, const char* spec, std::string_view missing = "null") {
  return std::isfinite(x) ? fmt::format(fmt::runtime(spec), x) : std::string(missing);
}

std::string json_string(std::string_view text) {
  std::string out = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += fmt::format("\\u{:04x}", static_cast<unsigned>(c));
    } else {
      out += c;
    }
  }
  return out + '"';
}

/// A PrefilledResult as JSON (absolute values; deltas are against model_prefilled_reference).
std::string prefilled_json(const std::optional<llama2c::PrefilledResult>& m) {
  if (!m || !m->not_applicable.empty()) return "null";
  return fmt::format("{{\"kept_fraction\": {:.4f}, \"decode_loss\": {:.6f}, \"name_log_prob_question_after\": {:.6f}, "
                     "\"name_log_prob_question_in_window\": {:.6f}}}",
                     m->kept_fraction, m->decode_loss, m->name_question_after, m->name_question_in_window);
}

/// Appends to `out`; the format is checked at compile time, as fmt::print's.
template <class... T>
void append(std::string& out, fmt::format_string<T...> format, T&&... args) {
  fmt::format_to(std::back_inserter(out), format, std::forward<T>(args)...);
}

/// Writes `text` to `path` whole or not at all (io::ReplacingFile: a temporary beside it, renamed
/// onto it), so a failed write never leaves a truncated file that reads like a result.
void write_whole_file(const std::string& path, const std::string& text) {
  io::ReplacingFile file(path, ErrorCode::kInvalidArgument, "compare_policies: ");
  file.write(std::as_bytes(std::span(text)));
  file.commit();
}

std::string json_text(const Options& o, const eval::SyntheticSpec& spec, const std::vector<Row>& rows,
                      const std::optional<llama2c::PrefilledResult>& prefilled_reference) {
  std::string file;
  // A dump's keys and values are its own: the generator's outliers and RoPE base describe only
  // synthetic ones, and a dump's calibration overlaps the data evaluated.
  const std::string workload =
      o.kv_dump.empty()
          ? fmt::format("\"kind\": \"synthetic\", \"outlier_channels\": {}, \"outlier_scale\": {}, \"rope_theta\": {}",
                        spec.outlier_channels, spec.outlier_scale, spec.rope_theta)
          : fmt::format("\"kind\": \"kv_dump\", \"file\": {}, \"layer\": {}, \"group\": {}, \"rope_theta\": {}, "
                        "\"calibration_overlaps_data\": true",
                        json_string(o.kv_dump), o.dump_layer, o.dump_group, o.dump_rope_theta);
  append(file, "{{\n  \"workload\": {{{}, \"tokens\": {}, \"q_heads\": {}, \"kv_heads\": {}, \"head_dim\": {}, "
               "\"seed\": {}}},\n  \"isa\": \"{}\",\n  \"rows\": [\n",
               workload, spec.tokens, spec.q_heads, spec.kv_heads, spec.head_dim, spec.seed, dispatch::active_cpu_isa());
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    const auto cells = [](const eval::NeedleReport& report) {
      std::string out;
      for (const eval::NeedleCell& c : report.cells) {
        const std::string detector =
            c.detector_trials == 0 ? "null"
                                   : fmt::format("{{\"fired\": {:.4f}, \"hits\": {}, \"misses\": {}, \"false_alarms\": {}}}",
                                                 c.fired_share(), c.hits, c.misses, c.false_alarms);
        out += fmt::format("{}{{\"context\": {}, \"depth\": {:.2f}, \"recall\": {:.4f}, \"retrieved\": {:.4f}, "
                           "\"heads\": {}, \"detector\": {}}}",
                           out.empty() ? "" : ", ", c.context, c.depth, c.recall(), c.retrieval(), c.trials, detector);
      }
      return out;
    };
    const std::string needle = cells(r.needle);
    const std::string pinned = r.pinned_needle ? "[" + cells(*r.pinned_needle) + "]" : "null";
    const auto recall_cells = [](const std::optional<eval::NeedleReport>& report) {
      if (!report) return std::string("null");
      std::string out;
      for (const eval::NeedleCell& c : report->cells) {
        out += fmt::format("{}{{\"depth\": {:.2f}, \"recall\": {:.4f}, \"recalled_from_tier\": {}, "
                           "\"bytes_fetched\": {}, \"bytes_written\": {}}}",
                           out.empty() ? "[" : ", ", c.depth, c.recall(), c.tier_recalls, c.bytes_fetched,
                           c.bytes_written);
      }
      return out + "]";
    };
    const std::string recall = recall_cells(r.recall_needle), demoted = recall_cells(r.demoted_needle);
    const eval::DetectorRates d = r.needle.detector();
    const auto rate = [](double x) { return std::isnan(x) ? std::string("null") : fmt::format("{:.4f}", x); };
    const std::string detector =
        d.ran() ? fmt::format("{{\"hit_rate\": {}, \"false_alarm_rate\": {}, \"hits\": {}, \"misses\": {}, "
                              "\"false_alarms\": {}, \"failed\": {}, \"recalled\": {}}}",
                              rate(d.hit_rate()), rate(d.false_alarm_rate()), d.hits, d.misses, d.false_alarms, d.failed,
                              d.recalled)
                : "null";
    std::string model = "null";
    if (r.model && r.model->not_applicable.empty()) {
      const llama2c::PolicyResult& m = *r.model;
      model = fmt::format("{{\"loss\": {:.6f}, \"loss_delta\": {:.6f}, \"logit_kl\": {:.6g}, \"top1_agreement\": {:.4f}, "
                          "\"first_divergence\": {}, \"name_log_prob\": {:.6f}, \"name_log_prob_delta\": {:.6f}, "
                          "\"budget_tokens\": {}, \"kept_fraction\": {:.4f}, \"prefilled\": {}}}",
                          m.text.loss, m.loss_delta, m.text.kl, m.text.top1_agreement, m.text.first_divergence ? fmt::format("{}", *m.text.first_divergence) : "null",
                          m.name_log_prob, m.name_log_prob_delta,
                          r.model_budget_tokens > 0 ? fmt::format("{}", r.model_budget_tokens) : "null", m.kept_fraction,
                          prefilled_json(r.model_prefilled));
    }
    append(file, "    {{\"policy\": {}, \"description\": {}, \"not_applicable\": {}, \"bits_per_element\": {:.4f}, "
                 "\"bits_per_stored_element\": {:.4f}, \"payload_bits_per_element\": {:.4f}, \"bytes_per_sequence_32_layers\": {:.0f}, "
                 "\"key_reconstruction_rel_error\": {}, \"value_reconstruction_rel_error\": {}, "
                 "\"attention_rel_error_mean\": {}, \"attention_rel_error_p99\": {}, "
                 "\"needle_recall\": {}, \"needle_retrieved\": {}, \"needle\": [{}], \"needle_detector\": {}, "
                 "\"budget_tokens\": {}, \"kept_fraction\": {:.4f}, \"needle_pinned\": {}, \"needle_recall_from_tier\": {}, "
                 "\"needle_recall_by_demotion\": {}, \"real_model\": {}, "
                 "\"decode_GBps\": {:.3f}, \"seconds_per_attend\": {:.6g}, \"speed_vs_f16\": {:.4f}}}{}\n",
                 json_string(r.policy), json_string(r.description),
                 r.not_applicable.empty() ? "null" : json_string(r.not_applicable), r.bits_per_element,
                 r.bits_per_stored_element, r.payload_bits,
                 r.sequence_bytes, finite_or(r.reconstruction.keys, "{:.6g}"), finite_or(r.reconstruction.values, "{:.6g}"),
                 finite_or(r.error.mean, "{:.6g}"), finite_or(r.error.p99, "{:.6g}"),
                 finite_or(r.needle.recall(), "{:.4f}"), finite_or(r.needle.retrieval(), "{:.4f}"), needle, detector,
                 r.budget_tokens > 0 ? fmt::format("{}", r.budget_tokens) : "null", r.kept, pinned, recall, demoted, model,
                 r.decode_gbps, r.seconds_per_attend, r.vs_f16,
                 i + 1 < rows.size() ? "," : "");
  }
  append(file, "  ],\n  \"needle_contexts\": [{}],\n  \"observation_window\": {},\n  \"needle_pinned_span\": {},\n"
               "  \"needle_detector_epsilon\": {:.6f},\n  \"model_eviction_budget_tokens\": {},\n"
               "  \"model_prefilled_reference\": {}\n}}\n",
               fmt::join(o.needle_contexts, ", "), kObservationWindow, o.pinned ? fmt::format("{}", kPinnedSpan) : "null",
               eval::NeedleSpec{}.detector_epsilon(), o.model_budget, prefilled_json(prefilled_reference));
  return file;
}

std::string csv_text(const std::vector<Row>& rows) {
  std::string file;
  append(file, "policy,bits_per_element,payload_bits_per_element,bytes_per_sequence_32_layers,"
               "key_reconstruction_rel_error,value_reconstruction_rel_error,attention_rel_error_mean,"
               "attention_rel_error_p99,needle_recall,real_model_loss_delta,real_model_logit_kl,decode_GBps,speed_vs_f16,"
               "budget_tokens,kept_fraction,needle_retrieved,bits_per_stored_element\n");
  for (const Row& r : rows) {
    if (!r.not_applicable.empty()) continue;  // the table and the JSON say why
    // Errors that could not be measured and a needle that did not run are empty fields.
    append(file, "{},{:.4f},{:.4f},{:.0f},{},{},{},{},{},{},{},{:.3f},{:.4f},{},{:.4f},{},{:.4f}\n", r.policy,
                 r.bits_per_element, r.payload_bits, r.sequence_bytes, finite_or(r.reconstruction.keys, "{:.6g}", ""),
                 finite_or(r.reconstruction.values, "{:.6g}", ""), finite_or(r.error.mean, "{:.6g}", ""),
                 finite_or(r.error.p99, "{:.6g}", ""), finite_or(r.needle.recall(), "{:.4f}", ""),
                 model_cell(r, [](const llama2c::PolicyResult& m) { return m.loss_delta; }, "{:.6f}"),
                 model_cell(r, [](const llama2c::PolicyResult& m) { return m.text.kl; }, "{:.6g}"),
                 r.decode_gbps, r.vs_f16, r.budget_tokens, r.kept, finite_or(r.needle.retrieval(), "{:.4f}", ""),
                 r.bits_per_stored_element);
  }
  return file;
}

/// Refuses, before any work, a --budget some selected evictor cannot keep (SnapKV's window,
/// StreamingLLM's sinks), needle contexts the needle suite refuses or an output file in a
/// directory that does not exist: the error phase marks such a policy n/a, but the others would
/// end the run minutes in, with nothing written.
void check_settings(const Options& o, const std::vector<eval::Policy>& policies, const eval::SyntheticSpec& spec,
                    const eval::PolicyInputs& inputs) {
  for (const eval::Policy& policy : policies) {
    if (policy.budget_tokens == 0) continue;
    try {
      (void)policy.make({1, spec.q_heads, spec.kv_heads, spec.head_dim}, {}, inputs);
    } catch (const kvpack::Error& e) {
      throw UsageError{fmt::format("--budget {}: policy {} refuses it: {}", o.budget, policy.name, e.what())};
    }
  }
  for (const std::string* path : {&o.json_path, &o.csv_path, &o.plot_path}) {
    if (path->empty()) continue;
    const std::filesystem::path directory = std::filesystem::absolute(*path).parent_path();
    if (!std::filesystem::is_directory(directory)) {
      throw UsageError{fmt::format("{}: the directory {} does not exist", *path, directory.string())};
    }
  }
  if (!o.needle_contexts.empty()) {
    eval::NeedleSpec needle;
    needle.contexts = o.needle_contexts;
    try {
      needle.validate();
    } catch (const kvpack::Error& e) {
      throw UsageError{fmt::format("--needle-contexts: {}", e.what())};
    }
  }
}

int run(const Options& o) {
  std::vector<eval::Policy> policies;
  if (o.policies.empty()) {
    for (eval::Policy& policy : eval::builtin_policies()) {
      if (std::find(std::begin(kNotByDefault), std::end(kNotByDefault), policy.name) == std::end(kNotByDefault)) {
        policies.push_back(std::move(policy));
      }
    }
  } else {
    for (const std::string& name : o.policies) policies.push_back(eval::find_policy(name));
  }
  if (o.eviction_matrix) {
    for (eval::Policy& policy : eval::eviction_matrix_policies()) {
      const auto same = [&](const eval::Policy& p) { return p.name == policy.name; };
      if (std::none_of(policies.begin(), policies.end(), same)) policies.push_back(std::move(policy));
    }
  }
  if (o.budget != eval::kEvictionBudgetTokens) {
    for (eval::Policy& policy : policies) {
      if (policy.with_budget) policy = policy.with_budget(o.budget);
    }
  }
  // Wall time of each phase, printed at the end (the default run is meant to take about a minute).
  std::vector<std::pair<std::string, double>> phases;
  auto phase_start = std::chrono::steady_clock::now();
  const auto end_phase = [&](std::string name) {
    const auto now = std::chrono::steady_clock::now();
    phases.emplace_back(std::move(name), std::chrono::duration<double>(now - phase_start).count());
    phase_start = now;
  };
  eval::SyntheticSpec spec;
  spec.tokens = o.context;
  spec.seed = o.seed;
  eval::LayerKV layer;
  if (o.kv_dump.empty()) {
    fmt::print("kvpack compare_policies — workload: SYNTHETIC (not a real model's cache), seed {}\n", spec.seed);
    fmt::print("  one Llama-3.1-8B layer: {} query heads, {} KV heads, head_dim {}; {} tokens; {} key channels x{} "
               "(outliers); RoPE theta {}; {} sinks, recency, {} content matches per query\n",
               spec.q_heads, spec.kv_heads, spec.head_dim, spec.tokens, spec.outlier_channels, spec.outlier_scale,
               spec.rope_theta, spec.sink_tokens, spec.content_matches);
    layer = eval::make_layer(spec);
  } else {
    eval::KVDumpReader reader(o.kv_dump);
    layer = reader.read_layer(o.dump_layer);
    spec.tokens = layer.tokens;
    spec.kv_heads = layer.kv_heads;
    spec.head_dim = layer.head_dim;
    spec.q_heads = layer.kv_heads * o.dump_group;
    spec.outlier_channels = std::min<int>(spec.outlier_channels, static_cast<int>(spec.head_dim / 2));
    fmt::print("kvpack compare_policies — workload: K/V dump {} layer {} (real keys and values; SYNTHETIC queries: "
               "sinks and content matches, seed {})\n",
               o.kv_dump, o.dump_layer, spec.seed);
    fmt::print("  {} tokens, {} KV heads x {} query heads each, head_dim {}\n", spec.tokens, spec.kv_heads,
               o.dump_group, spec.head_dim);
  }
  fmt::print("  kernels: {} (KVPACK_ISA overrides); decode speed is one thread, one layer, data in memory\n",
             dispatch::active_cpu_isa());
  // Offline-calibrated policies (kvquant-*): another sample of the synthetic generator, or for a
  // dump (one text only) its first quarter — flagged, since that overlaps the evaluated data.
  eval::PolicyInputs inputs;
  if (o.kv_dump.empty()) {
    inputs = eval::synthetic_policy_inputs(spec);
    fmt::print("  calibration (kvquant-*): 2048 tokens from seed {} of the same generator\n\n", spec.seed + 0x51ED);
  } else {
    RopeSpec rope;
    rope.theta = o.dump_rope_theta;
    eval::LayerKV sample = layer;
    sample.tokens = std::max<index_t>(2, layer.tokens / 4);
    sample.keys.resize(sample.offset(sample.tokens, 0));
    sample.values.resize(sample.keys.size());
    inputs = {rope, std::make_shared<const std::vector<eval::LayerKV>>(std::vector<eval::LayerKV>{sample})};
    fmt::print("  calibration (kvquant-*): the dump's first {} tokens (overlaps the evaluated data)\n\n", sample.tokens);
  }
  check_settings(o, policies, spec, inputs);

  std::vector<Row> rows(policies.size());
  {
    const std::vector<float> queries = eval::make_decode_queries(spec, layer, o.queries, spec.seed + 1000);
    // The observation window: the prompt's last queries, each asked after its own token.
    std::vector<std::int64_t> window_positions;
    for (index_t t = std::max<index_t>(0, spec.tokens - kObservationWindow); t < spec.tokens; ++t) {
      window_positions.push_back(t + 1);
    }
    const std::vector<float> window = eval::make_queries(spec, layer, window_positions, spec.seed + 2000);
    const std::vector<std::vector<double>> exact = eval::exact_outputs(layer, queries, spec.q_heads);
    // Bytes and error on both cores (each policy owns its cache; ~2 GB held at once), then every
    // speed measured alone, one policy after the other. The caches are freed only after the last
    // timing: freeing hundreds of MB between timings halved the next policy's measured speed.
    std::vector<LayerCache> held(policies.size());
    {
      examples::ProgressBar bar("attention error", static_cast<int>(policies.size()));
      std::mutex progress;
      int done = 0;
      ThreadPool pool(2);
      end_phase("setup");
      pool(static_cast<index_t>(policies.size()), [&](index_t p) {
        rows[p].policy = policies[p].name;
        rows[p].description = policies[p].description;
        try {
          held[p] = measure_layer(policies[p], spec, inputs, layer, window, queries, exact, rows[p]);
        } catch (const kvpack::Error& e) {  // e.g. a 32-channel block codec on a dump with head_dim 8
          rows[p].not_applicable = e.what();
        }
        const std::lock_guard lock(progress);
        bar.update(++done);
      });
    }
    end_phase("attention error");
    examples::ProgressBar bar("decode speed", static_cast<int>(policies.size()));
    for (std::size_t p = 0; p < policies.size(); ++p) {
      if (held[p].cache) time_layer(held[p], spec, queries, static_cast<std::size_t>(o.queries), rows[p]);
      bar.update(static_cast<int>(p + 1));
    }
    end_phase("decode speed");
  }
  const auto f16 = std::find_if(rows.begin(), rows.end(), [](const Row& r) { return r.policy == "f16"; });
  for (Row& r : rows) {
    if (f16 != rows.end() && r.seconds_per_attend > 0) r.vs_f16 = f16->seconds_per_attend / r.seconds_per_attend;
  }

  if (!o.needle_contexts.empty()) {
    eval::NeedleSpec needle;  // always the synthetic Llama-3.1-8B shape: a dump has no needle
    needle.workload.seed = o.seed;
    needle.contexts = o.needle_contexts;
    const eval::NeedleSuite suite(needle);
    examples::ProgressBar trials("needle trials", static_cast<int>(needle.contexts.size() * needle.depths.size()));
    // The trials' policies run on both cores: each owns its cache, so results do not change.
    ThreadPool pool(2);
    const auto reports = suite.run(policies, {}, [&](int done, int) { trials.update(done); },
                                   [&](index_t count, const std::function<void(index_t)>& task) { pool(count, task); });
    for (std::size_t p = 0; p < policies.size(); ++p) rows[p].needle = reports[p];
    end_phase("needle");
    // The pinned variant (--pinned), for the policies that can drop the needle, at the first
    // context only: the evictors' observation scoring makes each trial several times an f16 one.
    std::vector<eval::Policy> evictors;
    std::vector<std::size_t> evictor_rows;
    for (std::size_t p = 0; p < policies.size(); ++p) {
      if (policies[p].budget_tokens > 0) evictors.push_back(policies[p]), evictor_rows.push_back(p);
    }
    // The evictors on `spec`, at the first context; each report goes to its row's `field`.
    const auto run_evictors = [&](const eval::NeedleSpec& spec, const char* phase,
                                  std::optional<eval::NeedleReport> Row::*field) {
      const eval::NeedleSuite variant(spec);
      examples::ProgressBar progress(phase, static_cast<int>(spec.contexts.size() * spec.depths.size()));
      const auto reports = variant.run(evictors, {}, [&](int done, int) { progress.update(done); },
                                       [&](index_t count, const std::function<void(index_t)>& task) { pool(count, task); });
      for (std::size_t e = 0; e < evictors.size(); ++e) rows[evictor_rows[e]].*field = reports[e];
      end_phase(phase);
    };
    needle.contexts = {o.needle_contexts.front()};
    if (o.pinned && !evictors.empty()) {
      needle.pinned_span = kPinnedSpan;
      run_evictors(needle, "needle, pinned", &Row::pinned_needle);
      needle.pinned_span = 0;
    }
    if (o.recall_tier && !evictors.empty()) {
      needle.recall_from_tier = true;
      run_evictors(needle, "needle, recall", &Row::recall_needle);
      // Write-back: only what the evictors drop goes to the tier, when they drop it.
      needle.recall_by_demotion = true;
      run_evictors(needle, "needle, write-back", &Row::demoted_needle);
    }
  }

  bool have_model = false;
  std::optional<std::size_t> model_tokens;  // the real model's longest sequence
  index_t model_context = 0;                // the context stories260K was trained for
  std::optional<llama2c::PrefilledResult> prefilled_reference;  // f32, read with a prefill
  std::string model_status;
  if (o.real_model) {
    const llama2c::ModelFiles files = llama2c::model_files(o.model_dir);
    if (files.present()) {
      const llama2c::Transformer model(llama2c::load_checkpoint(files.checkpoint));
      const llama2c::Tokenizer tokenizer = llama2c::Tokenizer::load(files.tokenizer, model.config().vocab_size);
      examples::ProgressBar bar("stories260K", static_cast<int>(policies.size()) + 1);
      const llama2c::Benchmark benchmark = llama2c::prepare_benchmark(model, tokenizer, {});
      bar.update(1);
      model_tokens = benchmark.text.size();
      for (const auto& probe : benchmark.probes) model_tokens = std::max(*model_tokens, probe.tokens.size());
      for (std::size_t p = 0; p < policies.size(); ++p) {
        // An evictor at its synthetic budget would keep every token of these short texts: it
        // runs here at the model's budget (--model-budget).
        const bool evicts = policies[p].with_budget && policies[p].budget_tokens > 0;
        rows[p].model = llama2c::evaluate_policy(model, benchmark,
                                                 evicts ? policies[p].with_budget(o.model_budget) : policies[p]);
        if (evicts) {
          rows[p].model_budget_tokens = o.model_budget;
          rows[p].model_prefilled = llama2c::evaluate_prefilled(model, benchmark, policies[p].with_budget(o.model_budget));
          if (!prefilled_reference) {
            prefilled_reference =
                llama2c::evaluate_prefilled(model, benchmark, eval::find_policy(llama2c::kReferencePolicy));
          }
        }
        bar.update(static_cast<int>(p + 2));
      }
      model_context = model.config().seq_len;
      have_model = true;
      model_status = fmt::format("real model: stories260K from {}, {}-token greedy text, {} name probes "
                                 "(head_dim 8: 'n/a' = the policy cannot store it)",
                                 o.model_dir, benchmark.text.size() - 1, benchmark.probes.size());
    } else {
      model_status = "real model: skipped — " + llama2c::missing_model_message(files);
    }
    end_phase("stories260K");
  }

  print_table(o, spec.tokens, rows, have_model);
  fmt::print("\nbits/elem: all bytes memory() reports (pages, scales, slot positions, fp32 tail, tables) per K/V "
             "element of the context (for evictors: after eviction, per kept element in the eviction list below, "
             "as EVAL.md §4 counts); payload: the encoded pages alone.\n"
             "K recon, V recon: |x_stored - x| / |x| over every stored (for evictors: kept) key and value element vs "
             "the fp32 inputs.\n"
             "rel.err: |o - o_exact| / |o_exact| per head vs exact attention on the fp32 inputs (mean, p99).\n"
             "GB/s: every page's bytes (and the tail) over the time of one attend; quest reads only its budget's pages, "
             "so its GB/s is not a bandwidth: its 'vs f16' is the speed-up.\n");
  if (!o.needle_contexts.empty()) {
    fmt::print("needle recall: one character per depth 0%..100% for each context ({}): '#' recalled by every head, "
               "'0'-'9' tenths, '.' none (synthetic).\n",
               fmt::join(o.needle_contexts, ", "));
  }
  fmt::print("{}\n", model_status.empty() ? "real model: off (--no-model)" : model_status);
  fmt::print("prefill: every policy gets the workload's last {} prompt queries as its observation window (synthetic "
             "queries; SnapKV and H2O score tokens with them, the others ignore them).\n",
             kObservationWindow);
  if (have_model) {
    fmt::print("loss delta: teacher-forced loss (nats/token) minus the f32 cache's; name logp: change in log p(name) "
               "at its later mention (0 = as well recalled as f32).\n");
  }

  print_eviction(o, spec.tokens, rows, model_tokens, model_context);
  print_prefilled(rows, prefilled_reference, o.model_budget);
  print_detector(o, rows);

  if (!o.json_path.empty()) {
    write_whole_file(o.json_path, json_text(o, spec, rows, prefilled_reference));
    fmt::print("rows written to {}\n", o.json_path);
  }
  if (!o.csv_path.empty()) {
    write_whole_file(o.csv_path, csv_text(rows));
    fmt::print("rows written to {}\n", o.csv_path);
  }
  end_phase("tables");
  if (!o.plot_path.empty()) {
    std::vector<examples::ParetoPoint> points;
    for (const Row& r : rows) {
      if (r.not_applicable.empty()) points.push_back({r.policy, r.bits_per_element, r.error.mean});
    }
    std::string why;
    if (examples::write_pareto_plot(o.plot_path,
                                    o.kv_dump.empty()
                                        ? fmt::format("kvpack policies on the synthetic Llama-3.1-8B layer ({} tokens)", spec.tokens)
                                        : fmt::format("kvpack policies on {} layer {}", o.kv_dump, o.dump_layer),
                                    "attention-output relative error (mean)", points, why)) {
      fmt::print("Pareto plot written to {}\n", o.plot_path);
    } else {
      fmt::print(stderr, "compare_policies: no plot: {}\n", why);
    }
    end_phase("plot");
  }
  std::string times;
  double total = 0.0;
  for (const auto& [name, seconds] : phases) {
    times += fmt::format("{}{} {:.1f} s", times.empty() ? "" : ", ", name, seconds);
    total += seconds;
  }
  fmt::print("wall time: {:.1f} s ({})\n", total, times);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return kvpack::examples::guarded_main("compare_policies", [&] { return parse(argc, argv); }, run, print_usage);
}
