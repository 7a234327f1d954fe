/// \file fetch_planner.cpp
/// \brief Fetch a prompt's K/V from a tier, or recompute it? kvpack/tier/fetch_planner.hpp's
/// planner with its inputs measured here: each tier's latency and bandwidth (measure_tier), the
/// bandwidth of restoring a page file into a q8_0 cache (fetch_sequence: parse, checksums, copy
/// the pages into the pool, check them at each PageCheck), and stories260K's prefill per token (the llama2c engine, one
/// thread). Llama-3.1-8B's prefill on this CPU is not run: it is estimated as 2·N FLOP per token
/// at the core's fp32 FMA peak (common/tier_model.hpp), which only makes a recompute look cheaper,
/// and also at an H100-class GPU's peak with the tiers and restore as measured here (a what-if).
///
///   fetch_planner [--model-dir DIR] [--redis-port N] [--context N] [--page-check reencode|finite|structure]
///
/// Prints the measured costs, then per model and tier the crossover (tokens from which fetching
/// wins) and the plan for a prompt of --context tokens, restoring at --page-check.

#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <memory>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <unistd.h>
#include <vector>

#include "common/cli.hpp"
#include "common/formats.hpp"
#include "common/model_presets.hpp"
#include "common/tier_model.hpp"
#include "kvpack/kvpack.hpp"
#include "kvpack/tier.hpp"
#ifdef KVPACK_EXAMPLES_HAVE_REDIS
#include "kvpack/tier/redis_tier.hpp"
#endif
#include "llama2c/checkpoint.hpp"
#include "llama2c/generate.hpp"
#include "llama2c/kv_store.hpp"
#include "llama2c/model_files.hpp"
#include "llama2c/transformer.hpp"

namespace {

namespace examples = kvpack::examples;
using namespace kvpack;
using examples::UsageError;
using Clock = std::chrono::steady_clock;

struct Options {
  std::string model_dir = llama2c::default_model_dir().string();
  std::optional<int> redis_port;
  std::int64_t context = 4096;
  PageCheck check = PageCheck::kReencode;
  bool help = false;
};

constexpr const char* kCheckNames[] = {"reencode", "finite", "structure"};

void print_usage(std::FILE* stream) {
  fmt::print(stream,
             "usage: fetch_planner [--model-dir DIR] [--redis-port N] [--context N] [--page-check CHECK]\n"
             "\n"
             "Measures each tier (host memory, disk under the temporary directory, and Redis on\n"
             "127.0.0.1:N when --redis-port is given), restoring a page file into a cache, and\n"
             "stories260K's prefill; prints where fetching a prompt's K/V beats recomputing it.\n"
             "\n"
             "  --model-dir DIR   stories260K files (default $KVPACK_MODEL_DIR or ../shared/models/stories260K)\n"
             "  --redis-port N    also measure a Redis server listening on 127.0.0.1:N\n"
             "  --context N       prompt length the plans are made for (default 4096)\n"
             "  --page-check CHECK  what a restore verifies of each page: reencode (default: decode,\n"
             "                    re-encode, compare), finite (decode), structure (positions only:\n"
             "                    for a tier only kvpack writes)\n");
}

Options parse(int argc, char** argv) {
  Options o;
  examples::ArgReader args(argc, argv);
  while (args.next()) {
    if (args.is("--help") || args.is("-h")) {
      o.help = true;
    } else if (args.is("--model-dir")) {
      o.model_dir = llama2c::given_model_dir(args.value());
    } else if (args.is("--redis-port")) {
      o.redis_port = args.number<int>(1, 65535);
    } else if (args.is("--context")) {
      o.context = args.number<std::int64_t>(1, std::int64_t{1} << 24);
    } else if (args.is("--page-check")) {
      const std::string_view name = args.value();
      const auto found = std::find(std::begin(kCheckNames), std::end(kCheckNames), name);
      if (found == std::end(kCheckNames)) {
        throw UsageError{fmt::format("--page-check: '{}' is not reencode, finite or structure", name)};
      }
      o.check = static_cast<PageCheck>(found - std::begin(kCheckNames));
    } else {
      throw UsageError{fmt::format("unknown argument '{}'", args.name())};
    }
  }
  return o;
}

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

/// Bytes per second of fetch_sequence from a host tier into a q8_0 cache at `check`: one sequence
/// of 1024 tokens at Llama-3.1-8B's KV shape cut to 8 layers (17 MiB of page file); the median of 3.
double measure_restore(PageCheck check) {
  using Cache = KVCache<layout::GQA, quant::Q8_0>;
  constexpr ModelShape shape{8, 32, 8, 128};
  constexpr index_t tokens = 1024;
  Cache source(shape);
  const SeqId seq = source.add_sequence();
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  std::vector<float> rows(static_cast<std::size_t>(tokens) * shape.kv_heads * shape.head_dim);
  for (float& x : rows) x = normal(rng);
  for (index_t layer = 0; layer < shape.layers; ++layer) {
    source.prefill(seq, layer, std::span<const float>(rows), std::span<const float>(rows));
  }
  std::vector<std::int32_t> ids(tokens);
  for (index_t i = 0; i < tokens; ++i) ids[i] = i;
  tier::HostTier host(std::size_t{64} << 20);
  const std::string key = tier::sequence_key(source, ids, "fetch_planner");
  const std::size_t bytes = tier::store_sequence(host, key, source, seq, ids, "fetch_planner");
  Cache target(shape);
  std::vector<double> seconds;
  for (int r = 0; r < 3; ++r) {
    const auto start = Clock::now();
    const std::optional<SeqId> loaded = tier::fetch_sequence(host, key, target, ids, check);
    seconds.push_back(seconds_since(start));
    target.release(*loaded);
  }
  std::sort(seconds.begin(), seconds.end());
  return static_cast<double>(bytes) / seconds[1];
}

/// stories260K's prefill, seconds per token, over its whole context (one thread, fp32, exact KV).
std::optional<double> measure_stories_prefill(const std::string& model_dir, ModelShape& shape) {
  const llama2c::ModelFiles files = llama2c::model_files(model_dir);
  if (!files.present()) return std::nullopt;
  const llama2c::Transformer model(llama2c::load_checkpoint(files.checkpoint));
  shape = model.kv_shape();
  std::vector<int> prompt(static_cast<std::size_t>(model.config().seq_len));
  for (std::size_t i = 0; i < prompt.size(); ++i) prompt[i] = 1 + static_cast<int>(i % 400);
  double best = 1e30;
  for (int r = 0; r < 3; ++r) {
    llama2c::ExactKvStore kv(shape);
    llama2c::Decoder decoder(model, kv);
    const auto start = Clock::now();
    (void)decoder.prefill(prompt);
    best = std::min(best, seconds_since(start));
  }
  return best / static_cast<double>(prompt.size());
}

/// The format a model's K/V pages are planned in: q8_0, or int8 where q8_0 cannot store the
/// model's head_dim (stories260K's 8), as its cache would refuse.
examples::FormatRow page_format(const ModelShape& s) {
  for (const char* name : {"q8_0", "int8"}) {
    examples::FormatRow row = examples::find_format(name)->describe(s.head_dim);
    if (row.unsupported.empty()) return row;
  }
  throw std::runtime_error(fmt::format("neither q8_0 nor int8 stores head_dim {}", s.head_dim));
}

/// Bytes per token of K and V over every layer, metadata included.
double bytes_per_token(const ModelShape& s, const examples::FormatRow& format) {
  return 2.0 * s.layers * s.kv_heads * s.head_dim * format.bits / 8.0;
}

/// Removes a directory tree when it goes out of scope, however the scope ends.
struct RemovedOnExit {
  std::filesystem::path path;
  ~RemovedOnExit() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
};

int run(const Options& o) {
  if (o.help) {
    print_usage(stdout);
    return 0;
  }
  struct MeasuredTier {
    std::string name;
    tier::TierCost cost;
  };
  std::vector<MeasuredTier> tiers;
  {
    tier::HostTier host(std::size_t{64} << 20);
    tiers.push_back({"host", tier::measure_tier(host)});
    const RemovedOnExit directory{std::filesystem::temp_directory_path() /
                                  ("kvpack-fetch-planner-" + std::to_string(::getpid()))};
    tier::DiskTier disk(directory.path);
    tiers.push_back({"disk (page cache)", tier::measure_tier(disk)});
  }
  if (o.redis_port) {
#ifdef KVPACK_EXAMPLES_HAVE_REDIS
    tier::RedisTierOptions options;
    options.port = *o.redis_port;
    tier::RedisTier redis(options);
    tiers.push_back({"redis (loopback)", tier::measure_tier(redis)});
#else
    throw UsageError{"--redis-port: this build has no hiredis (install libhiredis-dev and reconfigure)"};
#endif
  }
  double restores[3] = {};
  for (int c = 0; c < 3; ++c) restores[c] = measure_restore(static_cast<PageCheck>(c));
  const double restore = restores[static_cast<int>(o.check)];

  fmt::print("Fetch a prompt's K/V from a tier, or recompute it? (measured {})\n\n", "on this machine, one thread");
  fmt::print("tier                 latency      bandwidth   (measure_tier: median get of 64 B, of 8 MiB)\n");
  for (const MeasuredTier& t : tiers) {
    fmt::print("{:<20} {:>7.1f} us {:>9.2f} GB/s\n", t.name, t.cost.latency_s * 1e6, t.cost.bytes_per_s / 1e9);
  }
  fmt::print("restore (page file into a q8_0 cache: parse, checksums, copy pages; --page-check):");
  for (int c = 0; c < 3; ++c) fmt::print(" {} {:.3f} GB/s{}", kCheckNames[c], restores[c] / 1e9, c < 2 ? "," : "");
  fmt::print("\nplans below restore at --page-check {}\n\n", kCheckNames[static_cast<int>(o.check)]);

  struct Model {
    std::string name;
    ModelShape shape;
    double prefill_s_per_token;
    std::string how;
  };
  std::vector<Model> models;
  ModelShape stories{};
  if (const std::optional<double> prefill = measure_stories_prefill(o.model_dir, stories)) {
    models.push_back({"stories260K", stories, *prefill, "measured: llama2c prefill of its 512-token context"});
  } else {
    fmt::print("stories260K: model files not found in '{}' (set KVPACK_MODEL_DIR); skipped\n\n", o.model_dir);
  }
  const examples::NamedModel llama = *examples::find_model("Llama-3.1-8B");
  const double flops = 2.0 * examples::layer_weights(llama.shape, examples::widths_of(llama));
  models.push_back({"Llama-3.1-8B", llama.shape, flops / (examples::kCpuCoreGflops * 1e9),
                    fmt::format("estimated: 2 x {:.3g} FLOP at {:.0f} GFLOP/s (one core's fp32 FMA peak)", flops / 2,
                                examples::kCpuCoreGflops)});
  // What if the prefill ran on a GPU while fetching and restoring stayed as measured here.
  models.push_back({"Llama-3.1-8B, GPU prefill", llama.shape, flops / (examples::kHopperGflops * 1e9),
                    fmt::format("estimated: the same FLOP at {:.0f} TFLOP/s (an H100-class GPU's bf16 dense peak)",
                                examples::kHopperGflops / 1e3)});

  for (const Model& m : models) {
    const examples::FormatRow format = page_format(m.shape);
    const double per_token = bytes_per_token(m.shape, format);
    fmt::print("{}: prefill {:.3g} s/token ({}); {} K/V {:.0f} B/token\n", m.name, m.prefill_s_per_token, m.how,
               format.kvpack_name, per_token);
    fmt::print("  {:<20} {:>16} {:>14} {:>14}  plan at {} tokens\n", "tier", "crossover", "fetch", "recompute",
               o.context);
    for (const MeasuredTier& t : tiers) {
      const tier::FetchCosts costs{t.cost, restore, m.prefill_s_per_token};
      const std::optional<double> crossover = tier::crossover_tokens(costs, per_token);
      const tier::FetchPlan plan =
          tier::plan_fetch(costs, static_cast<std::uint64_t>(per_token * static_cast<double>(o.context)),
                           static_cast<std::uint64_t>(o.context));
      fmt::print("  {:<20} {:>16} {:>11.3f} ms {:>11.3f} ms  {}\n", t.name,
                 crossover ? fmt::format("{:.2f} tokens", *crossover) : std::string("never"), plan.fetch_s * 1e3,
                 plan.recompute_s * 1e3, plan.fetch ? "fetch" : "recompute");
    }
    fmt::print("\n");
  }
  fmt::print("crossover = latency / (prefill per token - bytes per token / tier bandwidth - bytes per token / restore "
             "bandwidth): fetching wins for longer prompts; 'never' when moving a token costs more than computing it.\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return examples::guarded_main("fetch_planner", [&] { return parse(argc, argv); }, run, print_usage);
}
