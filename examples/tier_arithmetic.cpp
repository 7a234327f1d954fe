/// \file tier_arithmetic.cpp
/// \brief For a KV page held in a slower tier, is it cheaper to fetch the page or to recompute its
/// K and V from the tokens? Byte and FLOP arithmetic only; nothing is measured.
///
///   tier_arithmetic [--model NAME] [--format FORMAT] [--page-tokens N] [--context N]
///                   [--bandwidth GBPS] [--compute GFLOPS] [--latency-us US]
///   tier_arithmetic --list
///
/// A "page" here is the transfer unit: `t` tokens of every layer and every KV head (a kvpack cache
/// holds it as layers × kv_heads pages of one stream each). The formulas:
///
///   page bytes  = 2 (K and V) × layers × kv_heads × head_dim × bits/8 × t
///                 (bits = kvpack's codec rate at this head_dim, block scales included, as
///                 kv_calculator)
///   fetch       = latency + page bytes / link bandwidth
///   full        = 2·N·t + 2·2·layers·t·ctx·d_model FLOP
///                 The K/V of layer l need the hidden states entering layer l, i.e. a forward pass
///                 through every earlier layer; for the whole page that is a forward pass through
///                 all layers. N = the layers' weight count (q, k, v, o projections and the gated
///                 MLP; embeddings cost no FLOPs and K/V need no LM head). Attention: scores and
///                 value sums, 2 FLOP per multiply-add each, over the ctx tokens before the page
///                 (their K/V must be resident). This is the conservative count.
///   kv-proj     = 2·2·layers·d_model·kv_dim·t FLOP (kv_dim = kv_heads × head_dim)
///                 Only the K and V projections, from hidden states stored at every layer: the
///                 lower bound. It needs layers × d_model × t stored values, more than the KV
///                 itself for every GQA preset, so it is a floor rather than a way to save memory.
///   recompute   = FLOP / compute throughput (peak, no efficiency loss, weight reads ignored)
///   crossover   = page bytes / (recompute − latency): the link bandwidth above which fetching
///                 is faster; none when the latency alone exceeds the recompute time
///   tokens/s    = t / time, for each path
///
/// Invalid input is reported on stderr with the offending value and exit code 2.

#include <fmt/core.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

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

constexpr std::string_view kProgram = "tier_arithmetic";
constexpr int kUsageError = 2;

constexpr std::int64_t kDefaultPageTokens = 16;
constexpr std::int64_t kDefaultContext = 32768;
constexpr std::string_view kDefaultModel = "Llama-3.1-8B";
constexpr std::string_view kDefaultFormat = "f16";

/// A command-line mistake; main prints it on stderr and exits with kUsageError.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// ---------------------------------------------------------------------------------------------
// Model weights: what the FLOP count needs beyond the attention shape in model_presets.hpp.

/// Hidden and MLP widths of a preset (every preset has a gated MLP: gate, up and down).
struct ModelWidths {
  std::string_view name;  ///< the preset's name, exactly as model_presets.hpp spells it
  index_t d_model = 0;    ///< hidden_size
  index_t ffn = 0;        ///< intermediate_size
};

constexpr std::array<ModelWidths, 6> kWidths{{
    // Each config.json: hidden_size, intermediate_size.
    {"Llama-3.1-8B", 4096, 14336},   // meta-llama/Llama-3.1-8B
    {"Llama-3.1-70B", 8192, 28672},  // meta-llama/Llama-3.1-70B
    {"Llama-2-7B", 4096, 11008},     // meta-llama/Llama-2-7b-hf
    {"Mistral-7B", 4096, 14336},     // mistralai/Mistral-7B-v0.1
    {"Qwen2.5-7B", 3584, 18944},     // Qwen/Qwen2.5-7B
    // karpathy/tinyllamas stories260K checkpoint header: dim 64, hidden_dim 172.
    {"stories260K", 64, 172},
}};

constexpr std::optional<ModelWidths> find_widths(std::string_view name) noexcept {
  for (const ModelWidths& widths : kWidths) {
    if (widths.name == name) return widths;
  }
  return std::nullopt;
}

/// Every preset has widths, and its query width equals d_model, so the attention term may be
/// written with d_model (it is q_heads × head_dim: the width QKᵀ and P·V multiply over).
constexpr bool widths_cover_presets() noexcept {
  for (const examples::NamedModel& model : examples::models()) {
    const std::optional<ModelWidths> widths = find_widths(model.name);
    if (!widths || widths->d_model != model.shape.q_heads * model.shape.head_dim) return false;
  }
  return true;
}
static_assert(widths_cover_presets(),
              "every model preset needs an entry in kWidths with d_model = q_heads x head_dim");

/// N: weights a forward pass through every layer multiplies by, per token. Per layer: q and o
/// projections (d_model × q_dim each), k and v (d_model × kv_dim each), gate, up and down
/// (d_model × ffn each). Biases (Qwen2.5's q/k/v) and norms are left out: under 0.01 % of N.
double layer_weights(const kvpack::ModelShape& s, const ModelWidths& w) {
  const double d = w.d_model;
  const double q_dim = static_cast<double>(s.q_heads) * s.head_dim;
  const double kv_dim = static_cast<double>(s.kv_heads) * s.head_dim;
  return static_cast<double>(s.layers) * (2.0 * d * q_dim + 2.0 * d * kv_dim + 3.0 * d * w.ffn);
}

// ---------------------------------------------------------------------------------------------
// Formats: the same choices and rates as kv_calculator, straight from kvpack's codecs.

struct FormatRow {
  std::string kvpack_name;  ///< Quantizer::name(), e.g. "f16", "fp8_e4m3fn", "q4_0"
  double bits = 0.0;        ///< mean of the key and value rates, metadata included
  std::string unsupported;  ///< why this head_dim cannot use the format; empty when it can
};

template <class Quantizer>
FormatRow describe(std::string_view requirement, index_t head_dim) {
  const Quantizer quantizer{};
  FormatRow row{Quantizer::name(),
                (quantizer.key.nominal_bits_per_element(head_dim) +
                 quantizer.value.nominal_bits_per_element(head_dim)) /
                    2.0,
                {}};
  // The codecs decide which head_dims they take, as a cache would (default page size).
  const quant::PageGeometry geometry{kvpack::CacheConfig{}.page_size, head_dim};
  try {
    quantizer.key.validate(geometry);
    quantizer.value.validate(geometry);
  } catch (const kvpack::Error& error) {
    row.unsupported = requirement.empty() ? std::string(error.what()) : std::string(requirement);
  }
  return row;
}

struct FormatChoice {
  std::string_view flag;
  FormatRow (*describe)(index_t head_dim);
};

constexpr std::array<FormatChoice, 7> kFormats{{
    {"f16", [](index_t d) { return describe<quant::Float<kvpack::half>>("", d); }},
    {"bf16", [](index_t d) { return describe<quant::Float<kvpack::bfloat16>>("", d); }},
    {"f32", [](index_t d) { return describe<quant::Float<float>>("", d); }},
    {"fp8", [](index_t d) { return describe<quant::FP8<quant::E4M3FN>>("", d); }},
    {"int8", [](index_t d) { return describe<quant::Int8>("head_dim must be even", d); }},
    {"q8_0",
     [](index_t d) { return describe<quant::Q8_0>("head_dim must be a multiple of 32", d); }},
    {"q4_0",
     [](index_t d) { return describe<quant::Q4_0>("head_dim must be a multiple of 32", d); }},
}};

std::string format_choices() {
  std::string out;
  for (const FormatChoice& choice : kFormats) {
    if (!out.empty()) out += "|";
    out += choice.flag;
  }
  return out;
}

std::string model_names() {
  std::string out;
  for (const examples::NamedModel& model : examples::models()) {
    if (!out.empty()) out += ", ";
    out += model.name;
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Scenarios: a link to the tier that holds the page, and the compute that would recompute it.

struct Scenario {
  std::string name;
  double bandwidth_gbps = 0.0;  ///< link bandwidth, GB/s (10^9 bytes per second)
  double compute_gflops = 0.0;  ///< recompute throughput, GFLOP/s
  double latency_us = 0.0;      ///< fixed cost per transfer, microseconds
  std::string source;           ///< where the numbers come from
};

// This machine (2 cores of an AMD EPYC Zen 5 VM): README "Measured", BM_StreamRead 1 GiB read,
// and DESIGN.md §4's roofline, fp32 FMA (512-bit) ≈ 137 GMAC/s per core = 274 GFLOP/s.
constexpr double kDramOneThreadGbps = 23.8;
constexpr double kDramTwoThreadsGbps = 46.9;
constexpr double kCpuCoreGflops = 2.0 * 137.0;
// A DRAM page read starts with one miss (~0.1 us); the hardware prefetcher streams the rest.
constexpr double kDramLatencyUs = 0.1;
// Assumptions for a GPU: H100-class bf16 dense peak (H100 SXM and GH200's Hopper: 989 TFLOP/s);
// PCIe 5 x16 ≈ 55 GB/s effective of 64 GB/s raw; NVLink-C2C 450 GB/s per direction (900 GB/s
// total); one DMA transfer's launch and completion ≈ 5 us on either link.
constexpr double kHopperGflops = 989e3;
constexpr double kPcie5Gbps = 55.0;
constexpr double kC2cGbps = 450.0;
constexpr double kGpuLatencyUs = 5.0;

std::vector<Scenario> default_scenarios() {
  return {
      {"dram-1core", kDramOneThreadGbps, kCpuCoreGflops, kDramLatencyUs,
       "this CPU, 1 core: README StreamRead, fp32 FMA peak"},
      {"dram-2core", kDramTwoThreadsGbps, 2.0 * kCpuCoreGflops, kDramLatencyUs,
       "this CPU, 2 cores: README StreamRead, fp32 FMA peak"},
      {"pcie5-h100", kPcie5Gbps, kHopperGflops, kGpuLatencyUs,
       "PCIe 5 x16 effective; H100-class GPU, bf16 dense"},
      {"c2c-gh200", kC2cGbps, kHopperGflops, kGpuLatencyUs,
       "NVLink-C2C per direction; Hopper GPU, bf16 dense"},
  };
}

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
             kProgram, std::string(kProgram.size(), ' '), kDefaultModel, format_choices(),
             kDefaultFormat, kDefaultPageTokens, kDefaultContext);
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

/// A finite decimal number, > 0 (or >= 0 when `zero_ok`), or a UsageError.
double parse_number(std::string_view option, std::string_view text, bool zero_ok) {
  double value = 0.0;
  const char* const end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  const char* const expected = zero_ok ? "a number >= 0" : "a positive number";
  if (ec != std::errc{} || ptr != end || !std::isfinite(value) || value < 0.0 ||
      (!zero_ok && value == 0.0)) {
    throw UsageError(fmt::format("{} expects {}, got '{}'", option, expected, text));
  }
  return value;
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
    } else if (arg == "--format") {
      once(options.format.has_value());
      options.format = std::string(value());
    } else if (arg == "--page-tokens") {
      once(options.page_tokens.has_value());
      options.page_tokens = parse_positive(arg, value());
    } else if (arg == "--context") {
      once(options.context.has_value());
      options.context = parse_positive(arg, value());
    } else if (arg == "--bandwidth") {
      once(options.bandwidth.has_value());
      options.bandwidth = parse_number(arg, value(), /*zero_ok=*/false);
    } else if (arg == "--compute") {
      once(options.compute.has_value());
      options.compute = parse_number(arg, value(), /*zero_ok=*/false);
    } else if (arg == "--latency-us") {
      once(options.latency.has_value());
      options.latency = parse_number(arg, value(), /*zero_ok=*/true);
    } else {
      throw UsageError(fmt::format("unknown argument '{}'", arg));
    }
  }
  return options;
}

void print_models() {
  fmt::print("{:<14} {:>6} {:>7} {:>8} {:>8} {:>7} {:>6} {:>10}  {}\n", "model", "layers",
             "q_heads", "kv_heads", "head_dim", "d_model", "ffn", "N", "source");
  for (const examples::NamedModel& model : examples::models()) {
    const kvpack::ModelShape& s = model.shape;
    const ModelWidths w = *find_widths(model.name);
    fmt::print("{:<14} {:>6} {:>7} {:>8} {:>8} {:>7} {:>6} {:>10.3e}  {}\n", model.name, s.layers,
               s.q_heads, s.kv_heads, s.head_dim, w.d_model, w.ffn, layer_weights(s, w),
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

std::string describe_bytes(double bytes) {
  constexpr double kKiB = 1024.0;
  constexpr double kMiB = 1024.0 * kKiB;
  if (bytes >= kMiB) return fmt::format("{:.0f} B ({:.3f} MiB)", bytes, bytes / kMiB);
  return fmt::format("{:.0f} B ({:.3f} KiB)", bytes, bytes / kKiB);
}

// ---------------------------------------------------------------------------------------------

int run(const Options& options) {
  const std::string model_name = options.model.value_or(std::string(kDefaultModel));
  const std::optional<examples::NamedModel> model = examples::find_model(model_name);
  if (!model) {
    throw UsageError(
        fmt::format("unknown model '{}'; known models: {}", model_name, model_names()));
  }
  const std::string format = options.format.value_or(std::string(kDefaultFormat));
  const auto choice = std::find_if(kFormats.begin(), kFormats.end(),
                                   [&](const FormatChoice& c) { return c.flag == format; });
  if (choice == kFormats.end()) {
    throw UsageError(
        fmt::format("unknown format '{}'; expected one of {}", format, format_choices()));
  }
  const kvpack::ModelShape& shape = model->shape;
  const FormatRow row = choice->describe(shape.head_dim);
  if (!row.unsupported.empty()) {
    throw UsageError(fmt::format("format {} cannot store {}'s head_dim {}: {}", format, model->name,
                                 shape.head_dim, row.unsupported));
  }
  const ModelWidths widths = *find_widths(model->name);

  const std::int64_t page_tokens = options.page_tokens.value_or(kDefaultPageTokens);
  const std::int64_t context = options.context.value_or(kDefaultContext);
  const double t = static_cast<double>(page_tokens);
  const double ctx = static_cast<double>(context);
  const double layers = shape.layers;
  const double d_model = widths.d_model;
  const double kv_dim = static_cast<double>(shape.kv_heads) * shape.head_dim;
  const double n_weights = layer_weights(shape, widths);

  // page bytes = 2 × layers × kv_heads × head_dim × bits/8 × t
  const double page_bytes = examples::kv_bytes(shape, row.bits, page_tokens, 1);
  // full = 2·N·t (every layer's weights) + 2·2·layers·t·ctx·d_model (scores and value sums)
  const double weight_flops = 2.0 * n_weights * t;
  const double attention_flops = 2.0 * 2.0 * layers * t * ctx * d_model;
  const double full_flops = weight_flops + attention_flops;
  // kv-proj = 2·2·layers·d_model·kv_dim·t (K and V projections from stored hidden states)
  const double proj_flops = 2.0 * 2.0 * layers * d_model * kv_dim * t;
  // What kv-proj presumes is already in fast memory: each layer's input for the page's tokens.
  const double hidden_bytes_16bit = 2.0 * layers * d_model * t;

  std::vector<Scenario> scenarios = default_scenarios();
  if (options.bandwidth || options.compute) {
    scenarios.push_back({"custom", options.bandwidth.value_or(kDramOneThreadGbps),
                         options.compute.value_or(kCpuCoreGflops), kDramLatencyUs,
                         "--bandwidth / --compute; the other from dram-1core"});
  }
  if (options.latency) {
    for (Scenario& s : scenarios) s.latency_us = *options.latency;
  }

  fmt::print("Fetch a KV page from a slower tier, or recompute it? (arithmetic, not measured)\n\n");
  fmt::print("model   {} ({}): {} layers, {} query heads, {} KV heads, head_dim {},\n", model->name,
             model->source, shape.layers, shape.q_heads, shape.kv_heads, shape.head_dim);
  fmt::print("        d_model {}, gated MLP {}; N = {:.4g} layer weights {}\n", widths.d_model,
             widths.ffn, n_weights, "(no embeddings, no LM head)");
  fmt::print("format  {} (kvpack {}): {:.3f} bits per element\n", format, row.kvpack_name,
             row.bits);
  fmt::print("page    t = {} tokens of every layer and KV head; ctx = {} tokens before it\n\n",
             page_tokens, context);

  fmt::print("page bytes = 2 x layers x kv_heads x head_dim x bits/8 x t\n");
  fmt::print("           = 2 x {} x {} x {} x {:.3f}/8 x {} = {}\n", shape.layers, shape.kv_heads,
             shape.head_dim, row.bits, page_tokens, describe_bytes(page_bytes));
  fmt::print("fetch      = latency + page bytes / link bandwidth\n");
  fmt::print("full       = 2 x N x t + 2 x 2 x layers x t x ctx x d_model\n");
  fmt::print("           = {:.4g} + {:.4g} = {:.4g} FLOP\n", weight_flops, attention_flops,
             full_flops);
  fmt::print(
      "             a forward pass through every layer, attending to the ctx earlier\n"
      "             tokens (their KV resident): the conservative count\n");
  fmt::print("kv-proj    = 2 x 2 x layers x d_model x kv_dim x t = {:.4g} FLOP\n", proj_flops);
  fmt::print(
      "             only the K and V projections, from each layer's stored input: the\n"
      "             lower bound; those inputs are {} at 16 bits, {:.2f}x the page\n",
      describe_bytes(hidden_bytes_16bit), hidden_bytes_16bit / page_bytes);
  fmt::print(
      "recompute  = FLOP / peak compute; weight reads ignored (a {}-token forward reads\n"
      "             every weight once: slower than its FLOPs unless batched with more)\n",
      page_tokens);
  fmt::print("crossover  = page bytes / (recompute - latency): fetching is faster above it\n\n");

  fmt::print("scenarios (assumptions):\n");
  for (const Scenario& s : scenarios) {
    fmt::print("  {:<11} {:>5} GB/s {:>7} GFLOP/s {:>5} us  {}\n", s.name, sig(s.bandwidth_gbps),
               sig(s.compute_gflops), sig(s.latency_us), s.source);
  }
  fmt::print("\n");

  struct Result {
    double fetch_us, full_us, proj_us;
  };
  std::vector<Result> results;
  for (const Scenario& s : scenarios) {
    const double flop_per_us = s.compute_gflops * 1e3;
    results.push_back({s.latency_us + page_bytes / (s.bandwidth_gbps * 1e3),
                       full_flops / flop_per_us, proj_flops / flop_per_us});
  }
  const auto winner = [](double fetch_us, double recompute_us) {
    return fetch_us <= recompute_us ? "fetch" : "recompute";
  };
  // Bandwidth (GB/s) at which fetch time equals recompute time.
  const auto crossover = [&](double recompute_us, double latency_us) -> std::string {
    if (recompute_us <= latency_us) return "none";
    return sig(page_bytes / ((recompute_us - latency_us) * 1e3));
  };

  print_trimmed(fmt::format("{:<11} {:>10} {:^25}  {:^21}  {:^27}", "", "", "recompute us",
                            "faster path", "crossover GB/s"));
  fmt::print("{:<11} {:>10} {:>12} {:>12}  {:<10} {:<10}  {:>13} {:>13}\n", "scenario", "fetch us",
             "full", "kv-proj", "full", "kv-proj", "full", "kv-proj");
  for (std::size_t i = 0; i < scenarios.size(); ++i) {
    const Scenario& s = scenarios[i];
    const Result& r = results[i];
    fmt::print("{:<11} {:>10} {:>12} {:>12}  {:<10} {:<10}  {:>13} {:>13}\n", s.name,
               sig(r.fetch_us), sig(r.full_us), sig(r.proj_us), winner(r.fetch_us, r.full_us),
               winner(r.fetch_us, r.proj_us), crossover(r.full_us, s.latency_us),
               crossover(r.proj_us, s.latency_us));
  }
  fmt::print("\n");
  print_trimmed(fmt::format("{:<11} {:>12} {:^25}", "", "", "recompute tokens/s"));
  fmt::print("{:<11} {:>12} {:>12} {:>12}\n", "scenario", "fetch tok/s", "full", "kv-proj");
  for (std::size_t i = 0; i < scenarios.size(); ++i) {
    const Result& r = results[i];
    fmt::print("{:<11} {:>12} {:>12} {:>12}\n", scenarios[i].name, si(t / (r.fetch_us * 1e-6)),
               si(t / (r.full_us * 1e-6)), si(t / (r.proj_us * 1e-6)));
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
    fmt::print(stderr, "{}: {}\n\n", kProgram, error.what());
    print_usage(stderr);
    return kUsageError;
  } catch (const std::exception& error) {
    fmt::print(stderr, "{}: error: {}\n", kProgram, error.what());
    return 1;
  }
}
