/// \file kv_calculator.cpp
/// \brief How much memory a model's KV cache needs, per sequence and per batch, in each storage
/// format kvpack offers.
///
///   kv_calculator --model NAME --context TOKENS [--batch N] [--format FORMAT]
///   kv_calculator --list
///
/// KV bytes = 2 × layers × kv_heads × head_dim × bits/8 × tokens × sequences, where bits is the
/// rate kvpack's own codec reports for that head_dim (`nominal_bits_per_element`, block scales
/// included), so the figures are those of a kvpack cache, not of an idealised format. Invalid
/// input is reported on stderr with the offending value and exit code 2.

#include <fmt/core.h>

#include <array>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>

#include "common/model_presets.hpp"
#include "kvpack/cache_config.hpp"
#include "kvpack/error.hpp"
#include "kvpack/quant/float.hpp"
#include "kvpack/quant/fp8.hpp"
#include "kvpack/quant/int8.hpp"
#include "kvpack/quant/q4_0.hpp"
#include "kvpack/quant/q8_0.hpp"

namespace {

namespace examples = kvpack::examples;
namespace quant = kvpack::quant;
using kvpack::index_t;

constexpr std::string_view kProgram = "kv_calculator";
constexpr int kUsageError = 2;

/// A command-line mistake; main prints it on stderr and exits with kUsageError.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// One storage format as the calculator reports it for one head_dim.
struct FormatRow {
  std::string kvpack_name;  ///< Quantizer::name(), e.g. "f16", "fp8_e4m3fn", "q4_0"
  double bits = 0.0;        ///< mean of the key and value rates, metadata included
  std::string unsupported;  ///< why this head_dim cannot use the format; empty when it can
};

/// Rates and applicability straight from the quantizer's codecs.
/// \tparam Quantizer  a kvpack quantizer (quant::Float<half>, quant::Q4_0, ...)
/// \param requirement the rule its codecs enforce, printed when they reject `head_dim`
template <class Quantizer>
FormatRow describe(std::string_view requirement, index_t head_dim) {
  const Quantizer quantizer{};
  FormatRow row{Quantizer::name(),
                (quantizer.key.nominal_bits_per_element(head_dim) +
                 quantizer.value.nominal_bits_per_element(head_dim)) /
                    2.0,
                {}};
  // Ask the codecs rather than re-deriving their rules here, so the calculator refuses exactly
  // the shapes a cache would refuse. The page size is the cache's default.
  const quant::PageGeometry geometry{kvpack::CacheConfig{}.page_size, head_dim};
  try {
    quantizer.key.validate(geometry);
    quantizer.value.validate(geometry);
  } catch (const kvpack::Error& error) {
    row.unsupported = requirement.empty() ? std::string(error.what()) : std::string(requirement);
  }
  return row;
}

/// A `--format` value and the quantizer it names.
struct FormatChoice {
  std::string_view flag;
  FormatRow (*describe)(index_t head_dim);
};

// Listed in the order `--format all` prints them.
constexpr std::array<FormatChoice, 7> kFormats{{
    {"f16", [](index_t d) { return describe<quant::Float<kvpack::half>>("", d); }},
    {"bf16", [](index_t d) { return describe<quant::Float<kvpack::bfloat16>>("", d); }},
    {"f32", [](index_t d) { return describe<quant::Float<float>>("", d); }},
    // E4M3FN is the FP8 format vLLM and FlashInfer store KV in; E5M2 has the same 8-bit rate.
    {"fp8", [](index_t d) { return describe<quant::FP8<quant::E4M3FN>>("", d); }},
    {"int8", [](index_t d) { return describe<quant::Int8>("head_dim must be even", d); }},
    {"q8_0",
     [](index_t d) { return describe<quant::Q8_0>("head_dim must be a multiple of 32", d); }},
    {"q4_0",
     [](index_t d) { return describe<quant::Q4_0>("head_dim must be a multiple of 32", d); }},
}};

std::string format_choices() {
  std::string out;
  for (const FormatChoice& choice : kFormats) out += std::string(choice.flag) + "|";
  return out + "all";
}

std::string model_names() {
  std::string out;
  for (const examples::NamedModel& model : examples::models()) {
    if (!out.empty()) out += ", ";
    out += model.name;
  }
  return out;
}

void print_usage(std::FILE* stream) {
  fmt::print(stream,
             "usage: {0} --model NAME --context TOKENS [--batch N] [--format FORMAT]\n"
             "       {0} --list\n"
             "\n"
             "Prints the KV-cache size of a model per sequence and for a batch of sequences,\n"
             "using the bits per element of kvpack's codecs at the model's head_dim.\n"
             "\n"
             "  --model NAME      model preset, case-insensitive (see --list)\n"
             "  --context TOKENS  tokens held per sequence (positive integer)\n"
             "  --batch N         sequences held at once (positive integer, default 1)\n"
             "  --format FORMAT   {1} (default all)\n"
             "  --list            list the model presets and exit\n"
             "  --help            print this help and exit\n"
             "\n"
             "KV bytes = 2 x layers x kv_heads x head_dim x bits/8 x tokens x sequences\n",
             kProgram, format_choices());
}

/// A strictly positive decimal integer, or a UsageError naming the option and the bad text.
std::int64_t parse_positive(std::string_view option, std::string_view text) {
  std::int64_t value = 0;
  const char* const end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (ec == std::errc::result_out_of_range) {
    throw UsageError(fmt::format("{} '{}' is out of range", option, text));
  }
  if (ec != std::errc{} || ptr != end || value <= 0) {
    throw UsageError(fmt::format("{} expects a positive integer, got '{}'", option, text));
  }
  return value;
}

struct Options {
  std::optional<std::string> model;
  std::optional<std::int64_t> context;
  std::optional<std::int64_t> batch;
  std::optional<std::string> format;
  bool list = false;
  bool help = false;
};

/// Parses `--opt VALUE` and `--opt=VALUE`; every mistake is a UsageError naming the bad value.
Options parse(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    std::string_view arg = argv[i];
    std::optional<std::string_view> inline_value;
    if (const auto eq = arg.find('='); arg.starts_with("--") && eq != std::string_view::npos) {
      inline_value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
    }
    const auto flag_only = [&] {
      if (inline_value) throw UsageError(fmt::format("{} takes no value", arg));
    };
    const auto value = [&]() -> std::string_view {
      if (inline_value) return *inline_value;
      // "--model --context 10" is a forgotten value, not a model called "--context".
      if (i + 1 >= argc || std::string_view(argv[i + 1]).starts_with("--")) {
        throw UsageError(fmt::format("{} needs a value", arg));
      }
      return argv[++i];
    };
    const auto once = [&](bool already_set) {
      if (already_set) throw UsageError(fmt::format("{} given more than once", arg));
    };

    if (arg == "--help" || arg == "-h") {
      flag_only();
      options.help = true;
    } else if (arg == "--list") {
      flag_only();
      options.list = true;
    } else if (arg == "--model") {
      once(options.model.has_value());
      options.model = std::string(value());
    } else if (arg == "--context") {
      once(options.context.has_value());
      options.context = parse_positive(arg, value());
    } else if (arg == "--batch") {
      once(options.batch.has_value());
      options.batch = parse_positive(arg, value());
    } else if (arg == "--format") {
      once(options.format.has_value());
      options.format = std::string(value());
    } else {
      throw UsageError(fmt::format("unknown argument '{}'", arg));
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
  if (!options.model) throw UsageError("missing --model NAME (see --list)");
  if (!options.context) throw UsageError("missing --context TOKENS");
  const std::optional<examples::NamedModel> model = examples::find_model(*options.model);
  if (!model) {
    throw UsageError(
        fmt::format("unknown model '{}'; known models: {}", *options.model, model_names()));
  }
  const std::string format = options.format.value_or("all");
  const bool all = format == "all";
  bool known_format = all;
  for (const FormatChoice& choice : kFormats) known_format = known_format || choice.flag == format;
  if (!known_format) {
    throw UsageError(
        fmt::format("unknown format '{}'; expected one of {}", format, format_choices()));
  }

  const kvpack::ModelShape& shape = model->shape;
  const std::int64_t tokens = *options.context;
  const std::int64_t batch = options.batch.value_or(1);
  fmt::print("{} ({}): {} layers, {} query heads, {} KV heads, head_dim {}\n", model->name,
             model->source, shape.layers, shape.q_heads, shape.kv_heads, shape.head_dim);
  fmt::print("{} tokens per sequence, batch of {}\n", tokens, batch);
  fmt::print("KV bytes = 2 x layers x kv_heads x head_dim x bits/8 x tokens x sequences\n\n");

  const std::string batch_header = fmt::format("batch of {}", batch);
  fmt::print("{:<6} {:<11} {:>9}  {:<34} {}\n", "format", "kvpack", "bits/elem", "per sequence",
             batch_header);
  for (const FormatChoice& choice : kFormats) {
    if (!all && choice.flag != format) continue;
    const FormatRow row = choice.describe(shape.head_dim);
    if (!row.unsupported.empty()) {
      fmt::print("{:<6} {:<11} {:>9}  n/a ({})\n", choice.flag, row.kvpack_name, "-",
                 row.unsupported);
      continue;
    }
    fmt::print("{:<6} {:<11} {:>9.3f}  {:<34} {}\n", choice.flag, row.kvpack_name, row.bits,
               describe_bytes(examples::kv_bytes(shape, row.bits, tokens, 1)),
               describe_bytes(examples::kv_bytes(shape, row.bits, tokens, batch)));
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
    fmt::print(stderr, "{}: {}\n", kProgram, error.what());
    fmt::print(stderr, "run '{} --help' for usage\n", kProgram);
    return kUsageError;
  } catch (const std::exception& error) {
    fmt::print(stderr, "{}: error: {}\n", kProgram, error.what());
    return 1;
  }
}
