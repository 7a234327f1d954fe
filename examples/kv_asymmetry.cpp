/// \file kv_asymmetry.cpp
/// \brief The K-versus-V asymmetry experiment (KIVI's ablation): quantize only the keys, only the
///        values, or both, to 4 and 2 bits, keys per channel or per token; report attention-output
///        error on the synthetic Llama-3.1-8B layer and, where the policy can store head_dim 8,
///        teacher-forced loss on stories260K.
///
/// No full-precision residual here (tail 0): every token goes through the quantizer, so the rows
/// differ only in what is quantized and how.
///
/// Usage: kv_asymmetry [--context N] [--queries N] [--seed N] [--model-dir DIR] [--no-model]

#include <fmt/core.h>

#include <optional>
#include <string>
#include <vector>

#include "common/cli.hpp"
#include "kvpack/eval.hpp"
#include "llama2c/checkpoint.hpp"
#include "llama2c/evaluate.hpp"
#include "llama2c/model_files.hpp"
#include "llama2c/tokenizer.hpp"
#include "llama2c/transformer.hpp"

namespace {

using namespace kvpack;
using examples::UsageError;

struct Options {
  index_t context = 8192;
  int queries = 8;
  std::uint32_t seed = 1;
  std::string model_dir = llama2c::default_model_dir().string();
  bool real_model = true;
};

void print_usage(std::FILE* to) {
  fmt::print(to,
             "usage: kv_asymmetry [--context N] [--queries N] [--seed N] [--model-dir DIR] [--no-model]\n"
             "  --context N    tokens of the synthetic layer (default 8192, 64 to 262144)\n"
             "  --queries N    decode queries (default 8)\n"
             "  --seed N       workload seed (default 1)\n"
             "  --model-dir D  stories260K files (default $KVPACK_MODEL_DIR or ../shared/models/stories260K)\n"
             "  --no-model     skip the real-model column\n");
}

Options parse(int argc, char** argv) {
  Options o;
  examples::ArgReader args(argc, argv);
  while (args.next()) {
    if (args.is("--help") || args.is("-h")) {
      print_usage(stdout);
      std::exit(0);
    } else if (args.is("--context")) {
      o.context = args.number<index_t>(64, 262144);
    } else if (args.is("--queries")) {
      o.queries = args.number<int>(1, 1000);
    } else if (args.is("--seed")) {
      o.seed = args.number<std::uint32_t>(0, 0xFFFFFFFFu);
    } else if (args.is("--model-dir")) {
      o.model_dir = llama2c::given_model_dir(args.value());
    } else if (args.is("--no-model")) {
      o.real_model = false;
    } else {
      throw UsageError{fmt::format("unknown option '{}'", args.name())};
    }
  }
  return o;
}

/// The experiment's rows: what is quantized, how, and to how many bits.
std::vector<eval::Policy> asymmetry_policies() {
  using quant::Float;
  using quant::KIVI;
  using quant::KiviPerTokenKeys;
  using quant::Mixed;
  return {
      eval::make_policy<Mixed<KIVI<4>, Float<float>>>("K4 per-channel", "keys only"),
      eval::make_policy<Mixed<KiviPerTokenKeys<4>, Float<float>>>("K4 per-token", "keys only"),
      eval::make_policy<Mixed<Float<float>, KIVI<4>>>("V4 per-token", "values only"),
      eval::make_policy<KIVI<4>>("K4+V4", "KIVI-4"),
      eval::make_policy<Mixed<KIVI<2>, Float<float>>>("K2 per-channel", "keys only"),
      eval::make_policy<Mixed<KiviPerTokenKeys<2>, Float<float>>>("K2 per-token", "keys only"),
      eval::make_policy<Mixed<Float<float>, KIVI<2>>>("V2 per-token", "values only"),
      eval::make_policy<KIVI<2>>("K2+V2", "KIVI-2"),
  };
}

int run(const Options& o) {
  eval::SyntheticSpec spec;
  spec.tokens = o.context;
  spec.seed = o.seed;
  fmt::print("kvpack kv_asymmetry — K versus V (KIVI's ablation), no full-precision residual\n");
  fmt::print("  workload: SYNTHETIC Llama-3.1-8B layer, {} tokens, {} key channels x{}, seed {}; {} queries\n",
             spec.tokens, spec.outlier_channels, spec.outlier_scale, spec.seed, o.queries);
  const eval::LayerKV layer = eval::make_layer(spec);
  const std::vector<float> queries = eval::make_decode_queries(spec, layer, o.queries, spec.seed + 1000);
  const auto exact = eval::exact_outputs(layer, queries, spec.q_heads);

  std::optional<llama2c::Transformer> model;
  std::optional<llama2c::Benchmark> benchmark;
  if (o.real_model) {
    const llama2c::ModelFiles files = llama2c::model_files(o.model_dir);
    if (files.present()) {
      model.emplace(llama2c::load_checkpoint(files.checkpoint));
      const auto tokenizer = llama2c::Tokenizer::load(files.tokenizer, model->config().vocab_size);
      benchmark = llama2c::prepare_benchmark(*model, tokenizer, {});
      fmt::print("  real model: stories260K ({}), {}-token greedy text\n", o.model_dir, benchmark->text.size() - 1);
    } else {
      fmt::print("  real model: skipped — {}\n", llama2c::missing_model_message(files));
    }
  }
  fmt::print("\n{:<16} {:>9} {:>11} {:>11} {:>18}\n", "quantized", "bits/elem", "rel.err", "p99 err",
             benchmark ? "stories loss delta" : "");
  for (const eval::Policy& policy : asymmetry_policies()) {
    const auto cache = policy.make({1, spec.q_heads, spec.kv_heads, spec.head_dim}, {});
    const SeqId seq = cache->add_sequence();
    cache->prefill(seq, 0, std::span<const float>(layer.keys), std::span<const float>(layer.values));
    const eval::Summary error = eval::attention_error(*cache, seq, 0, queries, exact);
    std::string real = "";
    if (benchmark) {
      const llama2c::PolicyResult r = llama2c::evaluate_policy(*model, *benchmark, policy);
      real = r.not_applicable.empty() ? fmt::format("{:+.4f}", r.loss_delta) : "n/a (head_dim 8)";
    }
    fmt::print("{:<16} {:>9.3f} {:>11.3e} {:>11.3e} {:>18}\n", policy.name, cache->memory().bits_per_element(),
               error.mean, error.p99, real);
  }
  fmt::print("\nrel.err: |o - o_exact| / |o_exact| per head against exact attention on the fp32 inputs.\n"
             "Per-channel keys: scale and minimum per channel over 32 tokens; per-token: per token over 32 channels.\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return kvpack::examples::guarded_main("kv_asymmetry", [&] { return parse(argc, argv); }, run, print_usage);
}
