#pragma once
/// \file tier_model.hpp
/// \brief The arithmetic behind tier_arithmetic: for a KV page held in a slower tier, the time to
/// fetch it over a link against the time to recompute its K and V from the tokens. Byte and FLOP
/// counts only; nothing is measured.
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

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "model_presets.hpp"

namespace kvpack::inline v0::examples {

// ---------------------------------------------------------------------------------------------
// Model weights: what the FLOP count needs beyond the attention shape in model_presets.hpp.

/// Hidden and MLP widths of a preset (every preset has a gated MLP: gate, up and down).
struct ModelWidths {
  std::string_view name;  ///< the preset's name, exactly as model_presets.hpp spells it
  index_t d_model = 0;    ///< hidden_size
  index_t ffn = 0;        ///< intermediate_size
};

namespace detail {

inline constexpr std::array<ModelWidths, 6> kWidths{{
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
  for (const NamedModel& model : models()) {
    const std::optional<ModelWidths> widths = find_widths(model.name);
    if (!widths || widths->d_model != model.shape.q_heads * model.shape.head_dim) return false;
  }
  return true;
}
static_assert(widths_cover_presets(),
              "every model preset needs an entry in kWidths with d_model = q_heads x head_dim");

}  // namespace detail

/// The widths of a preset; the static_assert above guarantees every preset has them.
[[nodiscard]] constexpr ModelWidths widths_of(const NamedModel& model) noexcept {
  return *detail::find_widths(model.name);
}

/// N: weights a forward pass through every layer multiplies by, per token. Per layer: q and o
/// projections (d_model × q_dim each), k and v (d_model × kv_dim each), gate, up and down
/// (d_model × ffn each). Biases (Qwen2.5's q/k/v) and norms are left out: under 0.01 % of N.
[[nodiscard]] inline double layer_weights(const ModelShape& s, const ModelWidths& w) noexcept {
  const double d = w.d_model;
  const double q_dim = static_cast<double>(s.q_heads) * s.head_dim;
  const double kv_dim = static_cast<double>(s.kv_heads) * s.head_dim;
  return static_cast<double>(s.layers) * (2.0 * d * q_dim + 2.0 * d * kv_dim + 3.0 * d * w.ffn);
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
inline constexpr double kDramOneThreadGbps = 26.0;
inline constexpr double kDramTwoThreadsGbps = 49.7;
inline constexpr double kCpuCoreGflops = 2.0 * 137.0;
// A DRAM page read starts with one miss (~0.1 us); the hardware prefetcher streams the rest.
inline constexpr double kDramLatencyUs = 0.1;
// Assumptions for a GPU: H100-class bf16 dense peak (H100 SXM and GH200's Hopper: 989 TFLOP/s);
// PCIe 5 x16 ≈ 55 GB/s effective of 64 GB/s raw; NVLink-C2C 450 GB/s per direction (900 GB/s
// total); one DMA transfer's launch and completion ≈ 5 us on either link.
inline constexpr double kHopperGflops = 989e3;
inline constexpr double kPcie5Gbps = 55.0;
inline constexpr double kC2cGbps = 450.0;
inline constexpr double kGpuLatencyUs = 5.0;

[[nodiscard]] inline std::vector<Scenario> default_scenarios() {
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
// The page's bytes and FLOPs, and each path's time under a scenario.

/// What one page costs to move and to recompute; each field is one of the formulas above.
struct PageCost {
  double page_bytes = 0.0;       ///< 2 × layers × kv_heads × head_dim × bits/8 × t
  double n_weights = 0.0;        ///< N, from layer_weights
  double weight_flops = 0.0;     ///< 2·N·t: every layer's weights
  double attention_flops = 0.0;  ///< 2·2·layers·t·ctx·d_model: scores and value sums
  double full_flops = 0.0;       ///< weight_flops + attention_flops
  double proj_flops = 0.0;       ///< 2·2·layers·d_model·kv_dim·t: K and V projections only
  /// What kv-proj presumes is already in fast memory: each layer's input for the page's tokens,
  /// at 16 bits.
  double hidden_bytes_16bit = 0.0;
};

/// \param bits         the format's bits per element at shape.head_dim (FormatRow::bits)
/// \param page_tokens  t, tokens per page
/// \param context      ctx, tokens before the page that recomputing attends to
[[nodiscard]] inline PageCost page_cost(const ModelShape& shape, const ModelWidths& widths,
                                        double bits, std::int64_t page_tokens,
                                        std::int64_t context) noexcept {
  const double t = static_cast<double>(page_tokens);
  const double ctx = static_cast<double>(context);
  const double layers = shape.layers;
  const double d_model = widths.d_model;
  const double kv_dim = static_cast<double>(shape.kv_heads) * shape.head_dim;
  PageCost cost;
  cost.page_bytes = kv_bytes(shape, bits, page_tokens, 1);
  cost.n_weights = layer_weights(shape, widths);
  cost.weight_flops = 2.0 * cost.n_weights * t;
  cost.attention_flops = 2.0 * 2.0 * layers * t * ctx * d_model;
  cost.full_flops = cost.weight_flops + cost.attention_flops;
  cost.proj_flops = 2.0 * 2.0 * layers * d_model * kv_dim * t;
  cost.hidden_bytes_16bit = 2.0 * layers * d_model * t;
  return cost;
}

/// Microseconds for each way of getting the page back under one scenario.
struct PathTimes {
  double fetch_us = 0.0;  ///< latency + page bytes / bandwidth
  double full_us = 0.0;   ///< full recompute at peak compute
  double proj_us = 0.0;   ///< K/V projections only, at peak compute
};

[[nodiscard]] inline PathTimes path_times(const PageCost& cost, const Scenario& s) noexcept {
  const double flop_per_us = s.compute_gflops * 1e3;
  return {s.latency_us + cost.page_bytes / (s.bandwidth_gbps * 1e3), cost.full_flops / flop_per_us,
          cost.proj_flops / flop_per_us};
}

/// The link bandwidth (GB/s) at which fetching takes as long as recomputing; std::nullopt when
/// the latency alone is at least the recompute time, so no bandwidth makes fetching faster.
[[nodiscard]] inline std::optional<double> crossover_gbps(double page_bytes, double recompute_us,
                                                          double latency_us) noexcept {
  if (recompute_us <= latency_us) return std::nullopt;
  return page_bytes / ((recompute_us - latency_us) * 1e3);
}

}  // namespace kvpack::inline v0::examples
