/// \file main.cpp
/// \brief llama2c: runs a llama2.c checkpoint (stories260K) with its attention through a kvpack
///        cache — greedy generation, or a report of every policy against the f32 cache.
///
/// Usage: llama2c [--model-dir DIR] [--policy NAME] [--steps N] [--prompt TEXT] [--page-size N]
///                [--report] [--json FILE]

#include <fmt/core.h>
#include <fmt/format.h>
#include <fmt/os.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "checkpoint.hpp"
#include "common/cli.hpp"
#include "evaluate.hpp"
#include "generate.hpp"
#include "kv_store.hpp"
#include "model_files.hpp"
#include "tokenizer.hpp"
#include "transformer.hpp"

namespace {

using namespace llama2c;

struct Options {
  std::filesystem::path model_dir = default_model_dir();
  std::optional<std::string> policy;  ///< generation: default f32; report: default every policy
  int steps = 256;
  std::string prompt;
  int page_size = 32;
  bool report = false;
  std::string json_path;
  std::string dump_path;  ///< generation: also write the generated text's K/V here
};

using kvpack::examples::UsageError;

std::string policy_names() {
  std::string names;
  for (const kvpack::eval::Policy& policy : kvpack::eval::builtin_policies()) names += (names.empty() ? "" : " ") + policy.name;
  return names;
}

void print_usage(std::FILE* to) {
  fmt::print(to,
             "usage: llama2c [--model-dir DIR] [--policy NAME] [--steps N] [--prompt TEXT] [--page-size N]\n"
             "               [--report] [--json FILE] [--dump-kv FILE]\n"
             "  --model-dir DIR  holds stories260K.bin and tok512.bin (default ${}, else {})\n"
             "  --policy NAME    KV cache policy: {}\n"
             "  --steps N        tokens generated greedily after the prompt (default 256; never stops early;\n"
             "                   the prompt's tokens and N fit in the model's context, 512 for stories260K)\n"
             "  --prompt TEXT    text after BOS (default: none)\n"
             "  --page-size N    tokens per cache page, a multiple of 16 in [16, 256] (default 32)\n"
             "  --report         every policy (or --policy's) against the f32 cache: loss, KL, top-1 agreement,\n"
             "                   first greedy divergence, name recall\n"
             "  --json FILE      with --report, also write the rows as JSON\n"
             "  --dump-kv FILE   without --report, also write the generated text's K/V (f32, post-RoPE) as a\n"
             "                   kvpack K/V dump (compare_policies --kv-dump reads it)\n",
             kModelDirVariable, LLAMA2C_DEFAULT_MODEL_DIR, policy_names());
}

Options parse(int argc, char** argv) {
  Options options;
  kvpack::examples::ArgReader args(argc, argv);
  while (args.next()) {
    if (args.is("--help") || args.is("-h")) {
      print_usage(stdout);
      std::exit(0);
    } else if (args.is("--report")) {
      options.report = true;
    } else if (args.is("--model-dir")) {
      options.model_dir = given_model_dir(args.value());  // named, it must hold the model
    } else if (args.is("--policy")) {
      options.policy = std::string(args.value());
    } else if (args.is("--steps")) {
      options.steps = args.number<int>(0, 1 << 20);
    } else if (args.is("--prompt")) {
      options.prompt = std::string(args.value());
    } else if (args.is("--page-size")) {
      options.page_size = args.number<int>(16, 256);
      if (options.page_size % 16 != 0) {
        throw UsageError{fmt::format("--page-size must be a multiple of 16, got {}", options.page_size)};
      }
    } else if (args.is("--json")) {
      options.json_path = std::string(args.value());
    } else if (args.is("--dump-kv")) {
      options.dump_path = std::string(args.value());
    } else {
      throw UsageError{fmt::format("unknown option '{}'", args.name())};
    }
  }
  if (!options.json_path.empty() && !options.report) throw UsageError{"--json needs --report"};
  if (!options.dump_path.empty() && options.report) throw UsageError{"--dump-kv writes a generation's K/V; drop --report"};
  // BOS alone is never read back (the last token of a generation is not fed), so nothing would be dumped.
  if (!options.dump_path.empty() && options.steps == 0 && options.prompt.empty()) {
    throw UsageError{"--dump-kv needs a token read back: give --steps N > 0 or a --prompt"};
  }
  return options;
}

/// Greedy generation with one policy's cache; the text on stdout, speed and memory on stderr.
void run_generation(const Transformer& model, const Tokenizer& tokenizer, const Options& options,
                    const kvpack::CacheConfig& cache) {
  const kvpack::eval::Policy policy = kvpack::eval::find_policy(options.policy.value_or(kReferencePolicy));
  CacheKvStore kv(policy, model.kv_shape(), cache,
                  policy.needs_inputs ? calibration_inputs(model) : kvpack::eval::PolicyInputs{});
  const std::vector<int> prompt = tokenizer.encode(options.prompt);
  const auto start = std::chrono::steady_clock::now();
  const std::vector<int> tokens = generate(model, kv, prompt, options.steps);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  fmt::print("{}\n", tokenizer.decode(tokens));
  const kvpack::MemoryUsage memory = kv.cache().memory();
  const std::size_t fed = tokens.size() - 1;  // the last generated token is never read back
  fmt::print(stderr,
             "{} prompt + {} generated tokens in {:.3f} s ({:.0f} tokens/s read); {} cache: {} bytes, "
             "{:.2f} bits/element\n",
             prompt.size(), options.steps, seconds, static_cast<double>(fed) / seconds, policy.name, memory.total(),
             memory.bits_per_element());
  if (!options.dump_path.empty()) {
    // The same tokens read into an exact store: its K/V are the model's, in fp32, whatever the policy.
    ExactKvStore exact(model.kv_shape());
    (void)teacher_forced_logits(model, exact, tokens);
    exact.write_dump(options.dump_path);
    fmt::print(stderr, "K/V of {} tokens x {} layers written to {}\n", fed, model.kv_shape().layers, options.dump_path);
  }
}

// Evictors keep this many tokens per KV stream in the report, as compare_policies' real-model
// columns do by default: the built-in 512 hold every sequence stories260K's context allows, so
// at that budget the evictor rows were f16's.
constexpr kvpack::index_t kReportEvictionBudget = 64;

std::string format_divergence(const std::optional<std::size_t>& position) {
  return position ? fmt::format("{}", *position) : std::string("none");
}

void print_report(const Benchmark& benchmark, const BenchmarkOptions& options, const Tokenizer& tokenizer,
                  const std::vector<PolicyResult>& rows) {
  std::string preview = tokenizer.decode(benchmark.text).substr(0, 72);
  for (char& c : preview) c = c == '\n' ? ' ' : c;
  fmt::print("fixed text: BOS + {} greedy tokens with the f32 cache: \"{}...\"\n", options.text_tokens, preview);
  fmt::print("name recall: {} probes (names {}; seeds {}); \"{}\" + {} sampled tokens + \"{}\" + name\n",
             benchmark.probes.size(), fmt::join(options.names, ", "), fmt::join(options.seeds, ", "),
             name_introduction("NAME"), options.continuation_tokens, kNameCue);
  fmt::print(
      "page size {}; loss in nats/token; KL(f32 || policy) in nats, mean over positions; first div. = "
      "first position whose top-1 token differs; kept = tokens an evictor still holds at the end of the text "
      "({} per KV stream)\n\n",
      benchmark.cache.page_size, kReportEvictionBudget);
  fmt::print("{:<10} {:>9} {:>7} {:>7} {:>9} {:>9} {:>7} {:>10} {:>11} {:>8} {:>9} {:>6}\n", "policy", "bits/elem",
             "nominal", "loss", "Δloss", "KL", "top-1", "first div.", "name log p", "Δname", "name top1", "kept");
  for (const PolicyResult& r : rows) {
    if (!r.not_applicable.empty()) {
      fmt::print("{:<10} not applicable: {}\n", r.policy, r.not_applicable);
      continue;
    }
    fmt::print("{:<10} {:>9.3f} {:>7.3f} {:>7.4f} {:>+9.5f} {:>9.2e} {:>6.1f}% {:>10} {:>11.4f} {:>+8.4f} {:>5}/{} "
               "{:>5.1f}%\n",
               r.policy, r.bits_per_element, r.nominal_bits, r.text.loss, r.loss_delta, r.text.kl,
               100.0 * r.text.top1_agreement, format_divergence(r.text.first_divergence), r.name_log_prob,
               r.name_log_prob_delta, r.name_top1, r.name_tokens, 100.0 * r.kept_fraction);
  }
}

std::string json_escape(std::string_view text) {
  std::string out;
  for (char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += fmt::format("\\u{:04x}", static_cast<int>(c));
    } else {
      out += c;
    }
  }
  return out;
}

void write_json(const std::string& path, const Benchmark& benchmark, const BenchmarkOptions& options,
                const std::vector<PolicyResult>& rows) {
  auto file = fmt::output_file(path);
  file.print(
      "{{\n  \"model\": \"stories260K\",\n  \"page_size\": {},\n  \"text_tokens\": {},\n"
      "  \"continuation_tokens\": {},\n  \"name_probes\": {},\n  \"rows\": [\n",
      benchmark.cache.page_size, options.text_tokens, options.continuation_tokens, benchmark.probes.size());
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const PolicyResult& r = rows[i];
    const char* separator = i + 1 < rows.size() ? "," : "";
    if (!r.not_applicable.empty()) {
      file.print("    {{\"policy\": \"{}\", \"not_applicable\": \"{}\"}}{}\n", json_escape(r.policy),
                 json_escape(r.not_applicable), separator);
      continue;
    }
    file.print(
        "    {{\"policy\": \"{}\", \"bits_per_element\": {:.4f}, \"nominal_bits_per_element\": {:.4f}, "
        "\"loss\": {:.6f}, \"loss_delta\": {:.6g}, \"kl\": {:.6g}, \"top1_agreement\": {:.6f}, "
        "\"first_divergence\": {}, \"name_log_prob\": {:.6f}, \"name_log_prob_delta\": {:.6g}, "
        "\"name_top1\": {}, \"name_tokens\": {}, \"kept_fraction\": {:.4f}}}{}\n",
        json_escape(r.policy), r.bits_per_element, r.nominal_bits, r.text.loss, r.loss_delta, r.text.kl,
        r.text.top1_agreement, r.text.first_divergence ? fmt::format("{}", *r.text.first_divergence) : "null",
        r.name_log_prob, r.name_log_prob_delta, r.name_top1, r.name_tokens, r.kept_fraction, separator);
  }
  file.print("  ]\n}}\n");
}

void run_report(const Transformer& model, const Tokenizer& tokenizer, const Options& options,
                const kvpack::CacheConfig& cache) {
  BenchmarkOptions benchmark_options;
  benchmark_options.cache = cache;
  std::vector<kvpack::eval::Policy> policies;
  if (options.policy) {
    policies.push_back(kvpack::eval::find_policy(*options.policy));
  } else {
    policies = kvpack::eval::builtin_policies();
  }
  for (kvpack::eval::Policy& policy : policies) {
    if (policy.with_budget) policy = policy.with_budget(kReportEvictionBudget);
  }
  const Benchmark benchmark = prepare_benchmark(model, tokenizer, benchmark_options);
  std::vector<PolicyResult> rows;
  for (const kvpack::eval::Policy& policy : policies) rows.push_back(evaluate_policy(model, benchmark, policy));
  print_report(benchmark, benchmark_options, tokenizer, rows);
  if (!options.json_path.empty()) write_json(options.json_path, benchmark, benchmark_options, rows);
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  try {
    options = parse(argc, argv);
  } catch (const UsageError& error) {
    fmt::print(stderr, "llama2c: {}\n", error.message);
    print_usage(stderr);
    return kvpack::examples::kUsageError;
  }
  const ModelFiles files = model_files(options.model_dir);
  if (!files.present()) {
    fmt::print(stderr, "llama2c: {}\n", missing_model_message(files));
    return kExitModelMissing;
  }
  try {
    Checkpoint checkpoint = load_checkpoint(files.checkpoint);
    const Tokenizer tokenizer = Tokenizer::load(files.tokenizer, checkpoint.config.vocab_size);
    const Transformer model(std::move(checkpoint));
    kvpack::CacheConfig cache;
    cache.page_size = options.page_size;
    fmt::print(stderr, "llama2c: {} ({})\n", files.checkpoint.string(), describe(model.config()));
    if (options.report) {
      run_report(model, tokenizer, options, cache);
    } else {
      run_generation(model, tokenizer, options, cache);
    }
  } catch (const std::exception& error) {
    fmt::print(stderr, "llama2c: {}\n", error.what());
    return 1;
  }
  return 0;
}
