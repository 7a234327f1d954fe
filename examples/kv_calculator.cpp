/// \file kv_calculator.cpp
/// \brief How much memory a model's KV cache needs, per sequence and per batch, in each storage
/// format kvpack offers, and how the reductions compose.
///
///   kv_calculator --model NAME --context TOKENS [--batch N] [--format FORMAT]
///                 [--kv-heads N] [--share-layers K] [--memory GIB]
///   kv_calculator --list
///
/// KV bytes = 2 × cache layers × kv_heads × head_dim × bits/8 × tokens × sequences, where bits is
/// the rate kvpack's own codec reports for that head_dim (`nominal_bits_per_element`, block
/// scales included), so the figures are those of a kvpack cache, not of an idealised format.
/// Each reduction divides one factor: GQA/MQA the KV heads (`--kv-heads`), cross-layer sharing
/// (CLA, YOCO) the layers that keep a cache (⌈layers / K⌉ with `--share-layers K`), the format
/// the bits; the ratio column multiplies them against the model with full multi-head attention
/// (one KV head per query head), a cache per layer and fp16. Invalid input is reported on stderr
/// with the offending value and exit code 2.

#include <fmt/core.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <optional>
#include <string>
#include <string_view>

#include "common/cli.hpp"
#include "common/formats.hpp"
#include "common/model_presets.hpp"

namespace {

namespace examples = kvpack::examples;
using examples::UsageError;

constexpr std::string_view kProgram = "kv_calculator";

/// The `--format` values: every format, or "all" for a row each.
std::string format_choices() { return examples::format_names() + "|all"; }

void print_usage(std::FILE* stream) {
  fmt::print(stream,
             "usage: {0} --model NAME --context TOKENS [--batch N] [--format FORMAT]\n"
             "                     [--kv-heads N] [--share-layers K] [--memory GIB]\n"
             "       {0} --list\n"
             "\n"
             "Prints the KV-cache size of a model per sequence and for a batch of sequences,\n"
             "using the bits per element of kvpack's codecs at the model's head_dim.\n"
             "\n"
             "  --model NAME      model preset, case-insensitive (see --list)\n"
             "  --context TOKENS  tokens held per sequence (positive integer)\n"
             "  --batch N         sequences held at once (positive integer, default 1)\n"
             "  --format FORMAT   {1} (default all)\n"
             "  --kv-heads N      KV heads instead of the preset's (GQA; 1 = MQA; a divisor of the\n"
             "                    query heads, which is MHA)\n"
             "  --share-layers K  K adjacent layers share one cache (CLA-K; the layer count = YOCO)\n"
             "  --memory GIB      also print how many sequences of TOKENS fit in GIB GiB\n"
             "  --list            list the model presets and exit\n"
             "  --help            print this help and exit\n"
             "\n"
             "KV bytes = 2 x cache layers x kv_heads x head_dim x bits/8 x tokens x sequences;\n"
             "'vs MHA f16' is the reduction against one KV head per query head, a cache per\n"
             "layer and fp16\n",
             kProgram, format_choices());
}

struct Options {
  std::optional<std::string> model;
  std::optional<std::int64_t> context;
  std::optional<std::int64_t> batch;
  std::optional<std::string> format;
  std::optional<int> kv_heads;
  std::optional<int> share_layers;
  std::optional<double> memory_gib;
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
    } else if (args.is("--context")) {
      options.context = args.positive<std::int64_t>();
    } else if (args.is("--batch")) {
      options.batch = args.positive<std::int64_t>();
    } else if (args.is("--format")) {
      options.format = std::string(args.value());
    } else if (args.is("--kv-heads")) {
      options.kv_heads = args.positive<int>();
    } else if (args.is("--share-layers")) {
      options.share_layers = args.positive<int>();
    } else if (args.is("--memory")) {
      options.memory_gib = args.real_in(1e-9, 1e9);  // a byte to an exbibyte
    } else {
      throw UsageError{fmt::format("unknown argument '{}'", args.name())};
    }
  }
  return options;
}

void print_models() {
  fmt::print("{:<14} {:>6} {:>7} {:>8} {:>8}  {}\n", "model", "layers", "q_heads", "kv_heads",
             "head_dim", "source");
  for (const examples::NamedModel& model : examples::models()) {
    const kvpack::ModelShape& s = model.shape;
    fmt::print("{:<14} {:>6} {:>7} {:>8} {:>8}  {}\n", model.name, s.layers, s.q_heads, s.kv_heads,
               s.head_dim, model.source);
  }
}

/// "4294967296 B (4.000 GiB)": exact bytes, then GiB from 1 GiB up and MiB below.
std::string describe_bytes(double bytes) {
  constexpr double kMiB = 1024.0 * 1024.0;
  constexpr double kGiB = 1024.0 * kMiB;
  if (bytes >= kGiB) return fmt::format("{:.0f} B ({:.3f} GiB)", bytes, bytes / kGiB);
  return fmt::format("{:.0f} B ({:.3f} MiB)", bytes, bytes / kMiB);
}

int run(const Options& options) {
  if (!options.model) throw UsageError{"missing --model NAME (see --list)"};
  if (!options.context) throw UsageError{"missing --context TOKENS"};
  const std::optional<examples::NamedModel> model = examples::find_model(*options.model);
  if (!model) {
    throw UsageError{fmt::format("unknown model '{}'; known models: {}", *options.model,
                                 examples::model_names())};
  }
  const std::string format = options.format.value_or("all");
  const bool all = format == "all";
  if (!all && !examples::find_format(format)) {
    throw UsageError{
        fmt::format("unknown format '{}'; expected one of {}", format, format_choices())};
  }

  const kvpack::ModelShape& preset = model->shape;
  kvpack::ModelShape shape = preset;
  if (options.kv_heads) {
    if (preset.q_heads % *options.kv_heads != 0) {
      throw UsageError{fmt::format("--kv-heads {} does not divide the {} query heads of {}", *options.kv_heads,
                                   preset.q_heads, model->name)};
    }
    shape.kv_heads = *options.kv_heads;
  }
  const int share = options.share_layers.value_or(1);
  if (share > preset.layers) {
    throw UsageError{fmt::format("--share-layers {} exceeds the {} layers of {} (use {} for one shared cache)", share,
                                 preset.layers, model->name, preset.layers)};
  }
  // Cross-layer sharing: only the first layer of each group of `share` keeps a cache.
  shape.layers = (preset.layers + share - 1) / share;
  kvpack::ModelShape mha = preset;
  mha.kv_heads = preset.q_heads;
  const std::int64_t tokens = *options.context;
  const std::int64_t batch = options.batch.value_or(1);
  fmt::print("{} ({}): {} layers, {} query heads, {} KV heads, head_dim {}\n", model->name,
             model->source, preset.layers, preset.q_heads, preset.kv_heads, preset.head_dim);
  fmt::print("as configured: {} KV heads{}, {} layers keeping a cache{}\n", shape.kv_heads,
             shape.kv_heads == 1 ? " (MQA)" : shape.kv_heads == preset.q_heads ? " (MHA)" : " (GQA)", shape.layers,
             share > 1 ? fmt::format(" (groups of {} layers share one)", share) : std::string());
  fmt::print("{} tokens per sequence, batch of {}\n", tokens, batch);
  fmt::print("KV bytes = 2 x cache layers x kv_heads x head_dim x bits/8 x tokens x sequences\n\n");

  const double mha_f16 = examples::kv_bytes(mha, 16.0, tokens, 1);
  const std::string batch_header = fmt::format("batch of {}", batch);
  const std::string fit_header = options.memory_gib ? fmt::format("fit in {:g} GiB", *options.memory_gib) : "";
  fmt::print("{:<6} {:<11} {:>9}  {:<34} {:<34} {:>10} {}\n", "format", "kvpack", "bits/elem", "per sequence",
             batch_header, "vs MHA f16", fit_header);
  for (const examples::FormatChoice& choice : examples::formats()) {
    if (!all && choice.flag != format) continue;
    const examples::FormatRow row = choice.describe(shape.head_dim);
    if (!row.unsupported.empty()) {
      fmt::print("{:<6} {:<11} {:>9}  n/a ({})\n", choice.flag, row.kvpack_name, "-",
                 row.unsupported);
      continue;
    }
    const double per_sequence = examples::kv_bytes(shape, row.bits, tokens, 1);
    const std::string fit =
        options.memory_gib
            ? fmt::format("{:.0f} sequences", std::floor(*options.memory_gib * 1024.0 * 1024.0 * 1024.0 / per_sequence))
            : std::string();
    fmt::print("{:<6} {:<11} {:>9.3f}  {:<34} {:<34} {:>9.1f}x {}\n", choice.flag, row.kvpack_name, row.bits,
               describe_bytes(per_sequence), describe_bytes(examples::kv_bytes(shape, row.bits, tokens, batch)),
               mha_f16 / per_sequence, fit);
  }
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
    fmt::print(stderr, "{}: {}\n", kProgram, error.message);
    fmt::print(stderr, "run '{} --help' for usage\n", kProgram);
    return examples::kUsageError;
  } catch (const std::exception& error) {
    fmt::print(stderr, "{}: error: {}\n", kProgram, error.what());
    return 1;
  }
}
