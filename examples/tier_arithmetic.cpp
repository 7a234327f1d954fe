/// \file tier_arithmetic.cpp
/// \brief For a KV page held in a slower tier, is it cheaper to fetch the page or to recompute its
/// K and V from the tokens? Byte and FLOP arithmetic only; nothing is measured.
///
///   tier_arithmetic [--model NAME] [--format FORMAT] [--page-tokens N] [--context N]
///                   [--bandwidth GBPS] [--compute GFLOPS] [--latency-us US]
///   tier_arithmetic --list
///
/// This file reads the command line and prints the report; the formulas and the scenarios'
/// assumptions are in common/tier_model.hpp. Invalid input is reported on stderr with the
/// offending value and exit code 2.

#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/cli.hpp"
#include "common/formats.hpp"
#include "common/model_presets.hpp"
#include "common/tier_model.hpp"

namespace {

namespace examples = kvpack::examples;
using examples::UsageError;

constexpr std::string_view kProgram = "tier_arithmetic";

constexpr std::int64_t kDefaultPageTokens = 16;
constexpr std::int64_t kDefaultContext = 32768;
constexpr std::string_view kDefaultModel = "Llama-3.1-8B";
constexpr std::string_view kDefaultFormat = "f16";

// ---------------------------------------------------------------------------------------------
// Command line.

void print_usage(std::FILE* stream) {
  fmt::print(stream,
             "usage: {0} [--model NAME] [--format FORMAT] [--page-tokens N] [--context N]\n"
             "       {1} [--bandwidth GBPS] [--compute GFLOPS] [--latency-us US]\n"
             "       {0} --list\n"
             "\n"
             "For a KV page (N tokens of every layer and KV head) in a slower tier: the time to\n"
             "fetch it over a link against the time to recompute its K and V, per scenario.\n"
             "\n"
             "  --model NAME       model preset, case-insensitive (default {2}; see --list)\n"
             "  --format FORMAT    {3} (default {4})\n"
             "  --page-tokens N    tokens per page (positive integer, default {5})\n"
             "  --context N        tokens before the page, which recomputing attends to\n"
             "                     (positive integer, default {6})\n"
             "  --bandwidth GBPS   add a 'custom' scenario with this link bandwidth (GB/s)\n"
             "  --compute GFLOPS   ... and this compute throughput (GFLOP/s); either one adds\n"
             "                     the row, the other is taken from dram-1core\n"
             "  --latency-us US    per-transfer latency for every scenario (>= 0; default\n"
             "                     0.1 for DRAM, 5 for the GPU links)\n"
             "  --list             list the model presets and exit\n"
             "  --help             print this help and exit\n",
             kProgram, std::string(kProgram.size(), ' '), kDefaultModel, examples::format_names(),
             kDefaultFormat, kDefaultPageTokens, kDefaultContext);
}

struct Options {
  std::optional<std::string> model;
  std::optional<std::string> format;
  std::optional<std::int64_t> page_tokens;
  std::optional<std::int64_t> context;
  std::optional<double> bandwidth;
  std::optional<double> compute;
  std::optional<double> latency;
  bool list = false;
  bool help = false;
};

/// Reads `--opt VALUE` and `--opt=VALUE`; every mistake is a UsageError naming the bad value.
Options parse(int argc, char** argv) {
  Options options;
  examples::ArgReader args(argc, argv);
  while (args.next()) {
    if (args.is("--help") || args.is("-h")) {
      options.help = true;
    } else if (args.is("--list")) {
      options.list = true;
    } else if (args.is("--model")) {
      options.model = std::string(args.value());
    } else if (args.is("--format")) {
      options.format = std::string(args.value());
    } else if (args.is("--page-tokens")) {
      options.page_tokens = args.positive<std::int64_t>();
    } else if (args.is("--context")) {
      options.context = args.positive<std::int64_t>();
    } else if (args.is("--bandwidth")) {
      options.bandwidth = args.real_in(1e-6, 1e9);  // 1 kB/s to 1 EB/s
    } else if (args.is("--compute")) {
      options.compute = args.real_in(1e-6, 1e12);  // 1 kFLOP/s to 1 EFLOP/s
    } else if (args.is("--latency-us")) {
      options.latency = args.real_in(0.0, 1e9);  // up to 1000 s
    } else {
      throw UsageError{fmt::format("unknown argument '{}'", args.name())};
    }
  }
  return options;
}

void print_models() {
  fmt::print("{:<14} {:>6} {:>7} {:>8} {:>8} {:>7} {:>6} {:>10}  {}\n", "model", "layers",
             "q_heads", "kv_heads", "head_dim", "d_model", "ffn", "N", "source");
  for (const examples::NamedModel& model : examples::models()) {
    const kvpack::ModelShape& s = model.shape;
    const examples::ModelWidths w = examples::widths_of(model);
    fmt::print("{:<14} {:>6} {:>7} {:>8} {:>8} {:>7} {:>6} {:>10.3e}  {}\n", model.name, s.layers,
               s.q_heads, s.kv_heads, s.head_dim, w.d_model, w.ffn, examples::layer_weights(s, w),
               model.source);
  }
}

// ---------------------------------------------------------------------------------------------
// Output helpers.

/// About three significant digits in fixed notation: 1817531, 88.2, 8.69, 0.00115.
std::string sig(double x) {
  if (x == 0.0) return "0";
  const int magnitude = static_cast<int>(std::floor(std::log10(std::fabs(x))));
  return fmt::format("{:.{}f}", x, std::max(0, 2 - magnitude));
}

/// A rate with an SI suffix: 1.66M, 181k, 8.80.
std::string si(double x) {
  if (x >= 1e9) return sig(x / 1e9) + "G";
  if (x >= 1e6) return sig(x / 1e6) + "M";
  if (x >= 1e3) return sig(x / 1e3) + "k";
  return sig(x);
}

/// Prints `line` without its trailing spaces (centred column titles leave some).
void print_trimmed(std::string line) {
  line.erase(line.find_last_not_of(' ') + 1);
  fmt::print("{}\n", line);
}

/// "2097152 B (2.000 MiB)": exact bytes, then MiB from 1 MiB up and KiB below. Pages run from
/// KiB to MiB, a unit lower than the whole caches kv_calculator sizes, hence its own scale.
std::string describe_bytes(double bytes) {
  constexpr double kKiB = 1024.0;
  constexpr double kMiB = 1024.0 * kKiB;
  if (bytes >= kMiB) return fmt::format("{:.0f} B ({:.3f} MiB)", bytes, bytes / kMiB);
  return fmt::format("{:.0f} B ({:.3f} KiB)", bytes, bytes / kKiB);
}

// ---------------------------------------------------------------------------------------------
// The report.

/// The command line's choices, checked, looked up and with the defaults filled in.
struct Inputs {
  examples::NamedModel model;
  examples::ModelWidths widths;
  std::string format;
  examples::FormatRow row;  ///< the format's rate at the model's head_dim
  std::int64_t page_tokens = 0;
  std::int64_t context = 0;
};

/// An unknown model or format, or a format that cannot store the model's head_dim, is a
/// UsageError: each is a mistake on the command line.
Inputs resolve(const Options& options) {
  const std::string model_name = options.model.value_or(std::string(kDefaultModel));
  const std::optional<examples::NamedModel> model = examples::find_model(model_name);
  if (!model) {
    throw UsageError{
        fmt::format("unknown model '{}'; known models: {}", model_name, examples::model_names())};
  }
  const std::string format = options.format.value_or(std::string(kDefaultFormat));
  const std::optional<examples::FormatChoice> choice = examples::find_format(format);
  if (!choice) {
    throw UsageError{
        fmt::format("unknown format '{}'; expected one of {}", format, examples::format_names())};
  }
  const kvpack::index_t head_dim = model->shape.head_dim;
  examples::FormatRow row = choice->describe(head_dim);
  if (!row.unsupported.empty()) {
    throw UsageError{fmt::format("format {} cannot store {}'s head_dim {}: {}", format, model->name,
                                 head_dim, row.unsupported)};
  }
  return {*model,
          examples::widths_of(*model),
          format,
          std::move(row),
          options.page_tokens.value_or(kDefaultPageTokens),
          options.context.value_or(kDefaultContext)};
}

/// The default scenarios, plus a 'custom' one when --bandwidth or --compute asks for it, each
/// with --latency-us in place of its own latency when that is given.
std::vector<examples::Scenario> scenarios(const Options& options) {
  std::vector<examples::Scenario> out = examples::default_scenarios();
  if (options.bandwidth || options.compute) {
    out.push_back({"custom", options.bandwidth.value_or(examples::kDramOneThreadGbps),
                   options.compute.value_or(examples::kCpuCoreGflops), examples::kDramLatencyUs,
                   "--bandwidth / --compute; the other from dram-1core"});
  }
  if (options.latency) {
    for (examples::Scenario& s : out) s.latency_us = *options.latency;
  }
  return out;
}

void print_inputs(const Inputs& in, const examples::PageCost& cost) {
  const kvpack::ModelShape& shape = in.model.shape;
  fmt::print("Fetch a KV page from a slower tier, or recompute it? (arithmetic, not measured)\n\n");
  fmt::print("model   {} ({}): {} layers, {} query heads, {} KV heads, head_dim {},\n",
             in.model.name, in.model.source, shape.layers, shape.q_heads, shape.kv_heads,
             shape.head_dim);
  fmt::print("        d_model {}, gated MLP {}; N = {:.4g} layer weights {}\n", in.widths.d_model,
             in.widths.ffn, cost.n_weights, "(no embeddings, no LM head)");
  fmt::print("format  {} (kvpack {}): {:.3f} bits per element\n", in.format, in.row.kvpack_name,
             in.row.bits);
  fmt::print("page    t = {} tokens of every layer and KV head; ctx = {} tokens before it\n\n",
             in.page_tokens, in.context);
}

/// Each formula of tier_model.hpp with this run's numbers in it.
void print_formulas(const Inputs& in, const examples::PageCost& cost) {
  const kvpack::ModelShape& shape = in.model.shape;
  fmt::print("page bytes = 2 x layers x kv_heads x head_dim x bits/8 x t\n");
  fmt::print("           = 2 x {} x {} x {} x {:.3f}/8 x {} = {}\n", shape.layers, shape.kv_heads,
             shape.head_dim, in.row.bits, in.page_tokens, describe_bytes(cost.page_bytes));
  fmt::print("fetch      = latency + page bytes / link bandwidth\n");
  fmt::print("full       = 2 x N x t + 2 x 2 x layers x t x ctx x d_model\n");
  fmt::print("           = {:.4g} + {:.4g} = {:.4g} FLOP\n", cost.weight_flops,
             cost.attention_flops, cost.full_flops);
  fmt::print(
      "             a forward pass through every layer, attending to the ctx earlier\n"
      "             tokens (their KV resident): the conservative count\n");
  fmt::print("kv-proj    = 2 x 2 x layers x d_model x kv_dim x t = {:.4g} FLOP\n", cost.proj_flops);
  fmt::print(
      "             only the K and V projections, from each layer's stored input: the\n"
      "             lower bound; those inputs are {} at 16 bits, {:.2f}x the page\n",
      describe_bytes(cost.hidden_bytes_16bit), cost.hidden_bytes_16bit / cost.page_bytes);
  fmt::print(
      "recompute  = FLOP / peak compute; weight reads ignored (a {}-token forward reads\n"
      "             every weight once: slower than its FLOPs unless batched with more)\n",
      in.page_tokens);
  fmt::print("crossover  = page bytes / (recompute - latency): fetching is faster above it\n\n");
}

void print_scenarios(const std::vector<examples::Scenario>& scenarios) {
  fmt::print("scenarios (assumptions):\n");
  for (const examples::Scenario& s : scenarios) {
    fmt::print("  {:<11} {:>5} GB/s {:>7} GFLOP/s {:>5} us  {}\n", s.name, sig(s.bandwidth_gbps),
               sig(s.compute_gflops), sig(s.latency_us), s.source);
  }
  fmt::print("\n");
}

/// Per scenario: each path's time, the faster path and the crossover bandwidth; then tokens/s.
void print_times(const std::vector<examples::Scenario>& scenarios, const examples::PageCost& cost,
                 std::int64_t page_tokens) {
  std::vector<examples::PathTimes> times;
  for (const examples::Scenario& s : scenarios) times.push_back(examples::path_times(cost, s));
  const auto winner = [](double fetch_us, double recompute_us) {
    return fetch_us <= recompute_us ? "fetch" : "recompute";
  };
  const auto crossover = [&](double recompute_us, double latency_us) -> std::string {
    const std::optional<double> gbps =
        examples::crossover_gbps(cost.page_bytes, recompute_us, latency_us);
    return gbps ? sig(*gbps) : "none";
  };

  print_trimmed(fmt::format("{:<11} {:>10} {:^25}  {:^21}  {:^27}", "", "", "recompute us",
                            "faster path", "crossover GB/s"));
  fmt::print("{:<11} {:>10} {:>12} {:>12}  {:<10} {:<10}  {:>13} {:>13}\n", "scenario", "fetch us",
             "full", "kv-proj", "full", "kv-proj", "full", "kv-proj");
  for (std::size_t i = 0; i < scenarios.size(); ++i) {
    const examples::Scenario& s = scenarios[i];
    const examples::PathTimes& r = times[i];
    fmt::print("{:<11} {:>10} {:>12} {:>12}  {:<10} {:<10}  {:>13} {:>13}\n", s.name,
               sig(r.fetch_us), sig(r.full_us), sig(r.proj_us), winner(r.fetch_us, r.full_us),
               winner(r.fetch_us, r.proj_us), crossover(r.full_us, s.latency_us),
               crossover(r.proj_us, s.latency_us));
  }
  fmt::print("\n");
  const double t = static_cast<double>(page_tokens);
  print_trimmed(fmt::format("{:<11} {:>12} {:^25}", "", "", "recompute tokens/s"));
  fmt::print("{:<11} {:>12} {:>12} {:>12}\n", "scenario", "fetch tok/s", "full", "kv-proj");
  for (std::size_t i = 0; i < scenarios.size(); ++i) {
    const examples::PathTimes& r = times[i];
    fmt::print("{:<11} {:>12} {:>12} {:>12}\n", scenarios[i].name, si(t / (r.fetch_us * 1e-6)),
               si(t / (r.full_us * 1e-6)), si(t / (r.proj_us * 1e-6)));
  }
}

int run(const Options& options) {
  const Inputs in = resolve(options);
  const examples::PageCost cost =
      examples::page_cost(in.model.shape, in.widths, in.row.bits, in.page_tokens, in.context);
  const std::vector<examples::Scenario> all = scenarios(options);
  print_inputs(in, cost);
  print_formulas(in, cost);
  print_scenarios(all);
  print_times(all, cost, in.page_tokens);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options options = parse(argc, argv);
    if (options.help) {
      print_usage(stdout);
      return 0;
    }
    if (options.list) {
      print_models();
      return 0;
    }
    return run(options);
  } catch (const UsageError& error) {
    fmt::print(stderr, "{}: {}\n\n", kProgram, error.message);
    print_usage(stderr);
    return examples::kUsageError;
  } catch (const std::exception& error) {
    fmt::print(stderr, "{}: error: {}\n", kProgram, error.what());
    return 1;
  }
}
