#pragma once
/// \file model_presets.hpp
/// \brief Named attention shapes of published models, and the KV-cache size formula the examples
/// use to turn a shape, a storage format and a token count into bytes.
///
/// Every shape is copied from the model's published configuration, cited next to its entry. For
/// Hugging Face checkpoints the fields map as: layers = `num_hidden_layers`, q_heads =
/// `num_attention_heads`, kv_heads = `num_key_value_heads`, head_dim = `head_dim` where the config
/// has it, else `hidden_size / num_attention_heads`.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "kvpack/core/types.hpp"

namespace kvpack::inline v0::examples {

/// A model's attention shape under the name the examples accept for it.
struct NamedModel {
  std::string_view name;    ///< lookup key, matched case-insensitively by find_model
  std::string_view source;  ///< where the shape comes from (Hugging Face repository or README)
  ModelShape shape;
};

namespace detail {

// Kept in one constexpr table so the static_asserts below check every entry at compile time.
inline constexpr std::array<NamedModel, 6> kModels{{
    // meta-llama/Llama-3.1-8B config.json: num_hidden_layers 32, num_attention_heads 32,
    // num_key_value_heads 8, hidden_size 4096 (head_dim 4096 / 32 = 128; later revisions of the
    // config also state "head_dim": 128).
    {"Llama-3.1-8B", "meta-llama/Llama-3.1-8B", ModelShape{32, 32, 8, 128}},
    // meta-llama/Llama-3.1-70B config.json: num_hidden_layers 80, num_attention_heads 64,
    // num_key_value_heads 8, hidden_size 8192 (head_dim 8192 / 64 = 128).
    {"Llama-3.1-70B", "meta-llama/Llama-3.1-70B", ModelShape{80, 64, 8, 128}},
    // meta-llama/Llama-2-7b-hf config.json: num_hidden_layers 32, num_attention_heads 32,
    // num_key_value_heads 32 (multi-head attention: one KV head per query head), hidden_size 4096
    // (head_dim 128).
    {"Llama-2-7B", "meta-llama/Llama-2-7b-hf", ModelShape{32, 32, 32, 128}},
    // mistralai/Mistral-7B-v0.1 config.json: num_hidden_layers 32, num_attention_heads 32,
    // num_key_value_heads 8, hidden_size 4096 (head_dim 128).
    // NOTE: v0.1 also sets "sliding_window": 4096, so an engine that exploits the window keeps at
    // most 4096 tokens per sequence; kv_bytes counts every token, as a full cache stores them.
    {"Mistral-7B", "mistralai/Mistral-7B-v0.1", ModelShape{32, 32, 8, 128}},
    // Qwen/Qwen2.5-7B config.json: num_hidden_layers 28, num_attention_heads 28,
    // num_key_value_heads 4, hidden_size 3584 (head_dim 3584 / 28 = 128).
    {"Qwen2.5-7B", "Qwen/Qwen2.5-7B", ModelShape{28, 28, 4, 128}},
    // karpathy/llama2.c README, "models" table, row 260K (checkpoint karpathy/tinyllamas
    // stories260K; llama.cpp tests use its GGUF, ggml-org/models tinyllamas/stories260K.gguf):
    // dim 64, n_layers 5, n_heads 8, n_kv_heads 4, max context 512 (head_dim 64 / 8 = 8). The
    // checkpoint's own header (seven int32: dim, hidden_dim, n_layers, n_heads, n_kv_heads,
    // vocab_size, seq_len) reads 64, 172, 5, 8, 4, 512, 512.
    {"stories260K", "karpathy/tinyllamas stories260K", ModelShape{5, 8, 4, 8}},
}};

/// ModelShape::validate's rules, in a form a static_assert can evaluate.
constexpr bool consistent(const ModelShape& s) noexcept {
  return s.layers > 0 && s.kv_heads > 0 && s.q_heads > 0 && s.q_heads % s.kv_heads == 0 &&
         s.head_dim > 0;
}

constexpr char ascii_lower(char c) noexcept {
  return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c;
}

/// ASCII case-insensitive equality; model names are ASCII, so no locale is involved.
constexpr bool iequals(std::string_view a, std::string_view b) noexcept {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return ascii_lower(x) == ascii_lower(y);
         });
}

static_assert(std::all_of(kModels.begin(), kModels.end(),
                          [](const NamedModel& m) { return consistent(m.shape); }),
              "every preset must satisfy ModelShape::validate");

}  // namespace detail

/// All presets, in a fixed order (the order `kv_calculator --list` prints).
[[nodiscard]] constexpr std::span<const NamedModel> models() noexcept { return detail::kModels; }

/// The preset called `name`, compared ASCII case-insensitively ("llama-3.1-8b" finds
/// "Llama-3.1-8B"); std::nullopt when no preset has that name.
[[nodiscard]] constexpr std::optional<NamedModel> find_model(std::string_view name) noexcept {
  for (const NamedModel& model : detail::kModels) {
    if (detail::iequals(model.name, name)) return model;
  }
  return std::nullopt;
}

/// "Llama-3.1-8B, Llama-3.1-70B, ...": every preset name, for the unknown-model message.
[[nodiscard]] inline std::string model_names() {
  std::string out;
  for (const NamedModel& model : detail::kModels) {
    if (!out.empty()) out += ", ";
    out += model.name;
  }
  return out;
}

/// Bytes of KV cache for `sequences` sequences of `tokens` tokens each:
/// 2 (K and V) × layers × kv_heads × head_dim × bits_per_element / 8 × tokens × sequences.
///
/// \param shape             the model's attention shape
/// \param bits_per_element  the storage rate, metadata included (a codec's
///                          `nominal_bits_per_element(head_dim)`; the mean of the key and value
///                          rates when they differ)
/// \param tokens            tokens per sequence
/// \param sequences         sequences held at once (the batch)
///
/// The result is the nominal size: a paged cache rounds each sequence up to whole pages and keeps
/// page tables besides. It is a double because real rates are fractional (4.5 bits for q4_0).
/// When the rate is a dyadic fraction, as every kvpack rate is at a power-of-two head_dim (4.5,
/// 8.125, 16), each intermediate is an exact double below 2^53 bytes, so results compare with ==.
[[nodiscard]] constexpr double kv_bytes(const ModelShape& shape, double bits_per_element,
                                        std::int64_t tokens, std::int64_t sequences) noexcept {
  return 2.0 * static_cast<double>(shape.layers) * static_cast<double>(shape.kv_heads) *
         static_cast<double>(shape.head_dim) * (bits_per_element / 8.0) *
         static_cast<double>(tokens) * static_cast<double>(sequences);
}

}  // namespace kvpack::inline v0::examples
