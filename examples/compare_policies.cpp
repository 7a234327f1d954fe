/// \file compare_policies.cpp
/// \brief The main job: every kvpack policy on one workload, side by side.
///
/// Default workload: one Llama-3.1-8B layer (32 query heads, 8 KV heads, head_dim 128) holding a
/// 32K-token synthetic context (outlier key channels, RoPE, flat values; see
/// common/synthetic_kv.hpp). For each policy the table shows bits per element measured from
/// KVCache::memory() (everything: pages, scales, slot metadata, fp32 tail, tables), the bytes a
/// 32K sequence takes over all 32 layers, the attention-output error against exact attention on
/// the fp32 inputs, and decode attention speed (encoded bytes read per second, one thread).
///
/// Usage: compare_policies [--context N] [--queries N] [--seed N] [--json FILE]

#include <fmt/core.h>
#include <fmt/os.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "common/synthetic_kv.hpp"
#include "kvpack/kvpack.hpp"

namespace {

using namespace kvpack;

constexpr int kModelLayers = 32;
constexpr int kUsageError = 2;

struct Options {
  index_t context = 32768;
  int queries = 8;
  std::uint32_t seed = 1;
  std::string json_path;
};

struct UsageError {
  std::string message;
};

void print_usage(std::FILE* to) {
  fmt::print(to,
             "usage: compare_policies [--context N] [--queries N] [--seed N] [--json FILE]\n"
             "  --context N   tokens in the synthetic context (default 32768, 32 to 262144)\n"
             "  --queries N   decode queries measured per policy (default 8, 1 to 1000)\n"
             "  --seed N      workload seed (default 1)\n"
             "  --json FILE   also write the rows as JSON to FILE\n");
}

template <class Int>
Int parse_number(std::string_view option, std::string_view text, Int low, Int high) {
  Int value{};
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc{} || end != text.data() + text.size() || value < low || value > high) {
    throw UsageError{fmt::format("{} expects an integer in [{}, {}], got '{}'", option, low, high, text)};
  }
  return value;
}

Options parse(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      print_usage(stdout);
      std::exit(0);
    }
    if (i + 1 >= argc) throw UsageError{fmt::format("{} needs a value", arg)};
    const std::string_view value = argv[++i];
    if (arg == "--context") {
      options.context = parse_number<index_t>(arg, value, 32, 262144);
    } else if (arg == "--queries") {
      options.queries = parse_number<int>(arg, value, 1, 1000);
    } else if (arg == "--seed") {
      options.seed = parse_number<std::uint32_t>(arg, value, 0, 0xFFFFFFFFu);
    } else if (arg == "--json") {
      options.json_path = std::string(value);
    } else {
      throw UsageError{fmt::format("unknown option '{}'", arg)};
    }
  }
  return options;
}

struct Row {
  std::string policy;
  std::string key_codec, value_codec;
  double bits_per_element = 0;     // measured, everything included
  double payload_bits = 0;         // page payload only (the codec's own rate)
  double sequence_bytes = 0;       // one sequence of `context` tokens over 32 layers
  double error_mean = 0, error_p99 = 0;
  double decode_gbps = 0;
  double seconds_per_attend = 0;
};

/// Exact attention on the fp32 inputs, in double: the yardstick every policy is measured against.
std::vector<double> exact_attention(const examples::SyntheticLayer& layer, const examples::SyntheticOptions& o,
                                    const float* query, float scale) {
  const index_t group = o.q_heads / o.kv_heads;
  const std::size_t row = static_cast<std::size_t>(o.kv_heads) * o.head_dim;
  std::vector<double> out(static_cast<std::size_t>(o.q_heads) * o.head_dim, 0.0);
  std::vector<double> scores(o.tokens);
  for (index_t h = 0; h < o.q_heads; ++h) {
    const index_t kv = h / group;
    double top = -INFINITY;
    for (index_t t = 0; t < o.tokens; ++t) {
      const float* k = &layer.keys[t * row + kv * o.head_dim];
      double dot = 0;
      for (index_t c = 0; c < o.head_dim; ++c) dot += static_cast<double>(query[h * o.head_dim + c]) * k[c];
      scores[t] = dot * scale;
      top = std::max(top, scores[t]);
    }
    double sum = 0;
    double* acc = &out[static_cast<std::size_t>(h) * o.head_dim];
    for (index_t t = 0; t < o.tokens; ++t) {
      const double w = std::exp(scores[t] - top);
      sum += w;
      const float* v = &layer.values[t * row + kv * o.head_dim];
      for (index_t c = 0; c < o.head_dim; ++c) acc[c] += w * v[c];
    }
    for (index_t c = 0; c < o.head_dim; ++c) acc[c] /= sum;
  }
  return out;
}

template <class Quantizer>
Row measure(std::string policy, const examples::SyntheticOptions& o, const examples::SyntheticLayer& layer,
            const std::vector<float>& queries, int query_count,
            const std::vector<std::vector<double>>& exact, float scale) {
  const ModelShape shape{1, o.q_heads, o.kv_heads, o.head_dim};
  KVCache<layout::GQA, Quantizer> cache(shape);
  const SeqId seq = cache.add_sequence();
  cache.prefill(seq, 0, std::span<const float>(layer.keys), std::span<const float>(layer.values));

  Row row;
  row.policy = std::move(policy);
  row.key_codec = std::string(Quantizer::key_codec::kName);
  row.value_codec = std::string(Quantizer::value_codec::kName);
  const MemoryUsage memory = cache.memory();
  row.bits_per_element = memory.bits_per_element();
  row.payload_bits = 8.0 * memory.page_payload /
                     (static_cast<double>(memory.pages_in_use) * cache.config().page_size * 2 * o.head_dim);
  row.sequence_bytes = static_cast<double>(memory.total() - memory.codec_params) * kModelLayers +
                       static_cast<double>(memory.codec_params) * kModelLayers;

  const std::size_t query_size = static_cast<std::size_t>(o.q_heads) * o.head_dim;
  std::vector<float> out(query_size);
  std::vector<double> errors;
  for (int n = 0; n < query_count; ++n) {
    cache.attend(seq, 0, std::span<const float>(&queries[n * query_size], query_size), std::span<float>(out), scale);
    for (index_t h = 0; h < o.q_heads; ++h) {
      double diff = 0, norm = 0;
      for (index_t c = 0; c < o.head_dim; ++c) {
        const double ref = exact[n][h * o.head_dim + c];
        diff += (out[h * o.head_dim + c] - ref) * (out[h * o.head_dim + c] - ref);
        norm += ref * ref;
      }
      errors.push_back(std::sqrt(diff / norm));
    }
  }
  std::sort(errors.begin(), errors.end());
  double sum = 0;
  for (double e : errors) sum += e;
  row.error_mean = sum / errors.size();
  row.error_p99 = errors[std::min(errors.size() - 1, static_cast<std::size_t>(0.99 * errors.size()))];

  // Speed: the same decode step repeated; bytes read = every page payload plus the fp32 tail.
  const double bytes_read = static_cast<double>(memory.page_payload) + static_cast<double>(memory.tails);
  constexpr int kRepeats = 10;
  const auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < kRepeats; ++r) {
    cache.attend(seq, 0, std::span<const float>(&queries[(r % query_count) * query_size], query_size),
                 std::span<float>(out), scale);
  }
  row.seconds_per_attend = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / kRepeats;
  row.decode_gbps = bytes_read / row.seconds_per_attend / 1e9;
  return row;
}

void write_json(const std::string& path, const examples::SyntheticOptions& o, const std::vector<Row>& rows,
                std::string_view isa) {
  auto file = fmt::output_file(path);
  file.print("{{\n  \"workload\": {{\"kind\": \"synthetic\", \"tokens\": {}, \"q_heads\": {}, \"kv_heads\": {}, "
             "\"head_dim\": {}, \"outlier_channels\": {}, \"outlier_scale\": {}, \"rope_theta\": {}, \"seed\": {}}},\n"
             "  \"isa\": \"{}\",\n  \"rows\": [\n",
             o.tokens, o.q_heads, o.kv_heads, o.head_dim, o.outlier_channels, o.outlier_scale, o.rope_theta, o.seed,
             isa);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    file.print("    {{\"policy\": \"{}\", \"key_codec\": \"{}\", \"value_codec\": \"{}\", \"bits_per_element\": {:.4f}, "
               "\"payload_bits_per_element\": {:.4f}, \"bytes_per_sequence_32_layers\": {:.0f}, "
               "\"attention_rel_error_mean\": {:.6g}, \"attention_rel_error_p99\": {:.6g}, "
               "\"decode_GBps\": {:.3f}, \"seconds_per_attend\": {:.6g}}}{}\n",
               r.policy, r.key_codec, r.value_codec, r.bits_per_element, r.payload_bits, r.sequence_bytes,
               r.error_mean, r.error_p99, r.decode_gbps, r.seconds_per_attend, i + 1 < rows.size() ? "," : "");
  }
  file.print("  ]\n}}\n");
}

int run(const Options& options) {
  examples::SyntheticOptions o;
  o.tokens = options.context;
  o.seed = options.seed;
  const float scale = 1.0f / std::sqrt(static_cast<float>(o.head_dim));
  fmt::print("kvpack compare_policies — workload: SYNTHETIC (not a real model's cache)\n");
  fmt::print("  one Llama-3.1-8B layer: {} query heads, {} KV heads, head_dim {}; {} tokens; "
             "{} key channels x{} (outliers); RoPE theta {}; seed {}\n",
             o.q_heads, o.kv_heads, o.head_dim, o.tokens, o.outlier_channels, o.outlier_scale, o.rope_theta, o.seed);
  fmt::print("  kernels: {} (KVPACK_ISA overrides); decode speed is one thread, one layer, data in memory\n\n",
             dispatch::active_cpu_isa());
  const auto layer = examples::make_synthetic_layer(o);
  const auto queries = examples::make_synthetic_queries(o, layer, options.queries);
  std::vector<std::vector<double>> exact;
  for (int n = 0; n < options.queries; ++n) {
    exact.push_back(exact_attention(layer, o, &queries[static_cast<std::size_t>(n) * o.q_heads * o.head_dim], scale));
  }

  std::vector<Row> rows;
  auto add = [&](auto quantizer, const char* policy) {
    using Q = decltype(quantizer);
    rows.push_back(measure<Q>(policy, o, layer, queries, options.queries, exact, scale));
  };
  add(quant::Float<float>{}, "Float<f32>");
  add(quant::Float<half>{}, "Float<f16>");
  add(quant::Float<bfloat16>{}, "Float<bf16>");
  add(quant::FP8<quant::E4M3FN>{}, "FP8<E4M3FN>");
  add(quant::FP8<quant::E5M2>{}, "FP8<E5M2>");
  add(quant::Int8{}, "Int8");
  add(quant::Q8_0{}, "Q8_0");
  add(quant::Q4_0{}, "Q4_0");
  add(quant::Mixed<quant::Q8_0, quant::Q4_0>{}, "Mixed<Q8_0,Q4_0>");

  const double fp16_seconds = rows[1].seconds_per_attend;
  fmt::print("{:<18} {:>9} {:>9} {:>14} {:>11} {:>11} {:>9} {:>9}\n", "policy", "bits/elem", "payload",
             "32K seq, 32 L", "rel.err", "p99 err", "GB/s", "vs f16");
  for (const Row& r : rows) {
    fmt::print("{:<18} {:>9.3f} {:>9.3f} {:>10.3f} GiB {:>11.3e} {:>11.3e} {:>9.2f} {:>8.2f}x\n", r.policy,
               r.bits_per_element, r.payload_bits, r.sequence_bytes / (1024.0 * 1024 * 1024), r.error_mean,
               r.error_p99, r.decode_gbps, fp16_seconds / r.seconds_per_attend);
  }
  fmt::print("\nbits/elem: all bytes memory() reports (pages, scales, slot positions, fp32 tail, tables) per "
             "stored K/V element;\npayload: the encoded pages alone. rel.err: |o - o_exact| / |o_exact| per head "
             "vs exact attention on the fp32 inputs (mean, p99).\n");
  if (!options.json_path.empty()) {
    write_json(options.json_path, o, rows, dispatch::active_cpu_isa());
    fmt::print("rows written to {}\n", options.json_path);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const UsageError& e) {
    fmt::print(stderr, "compare_policies: {}\n", e.message);
    print_usage(stderr);
    return kUsageError;
  } catch (const std::exception& e) {
    fmt::print(stderr, "compare_policies: {}\n", e.what());
    return 1;
  }
}
