#pragma once
/// \file checkpoint.hpp
/// \brief Loads and validates a legacy llama2.c checkpoint (the format of stories260K.bin).
///
/// Layout (little-endian): seven int32 — dim, hidden_dim, n_layers, n_heads, n_kv_heads,
/// vocab_size, seq_len (vocab_size < 0: the classifier is stored last, untied) — then float32
/// tensors back to back, matrices row-major [out][in], each per-layer tensor for all layers in a
/// row: embedding [vocab][dim]; attention norm [L][dim]; wq [L][dim][dim]; wk, wv [L][kv_dim][dim];
/// wo [L][dim][dim]; FFN norm [L][dim]; w1 [L][hidden][dim]; w2 [L][dim][hidden];
/// w3 [L][hidden][dim]; final norm [dim]; two legacy RoPE tables [seq_len][head_dim / 2] (unused:
/// RoPE is computed); classifier [vocab][dim] when untied.

#include <fmt/core.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "binary_file.hpp"

namespace llama2c {

/// The checkpoint header.
struct Config {
  int dim = 0;         ///< residual stream width
  int hidden_dim = 0;  ///< FFN width
  int layers = 0;
  int heads = 0;     ///< query heads
  int kv_heads = 0;  ///< key/value heads (GQA: heads is a multiple of it)
  int vocab_size = 0;
  int seq_len = 0;  ///< the context the model was trained for; positions must stay below it

  [[nodiscard]] int head_dim() const noexcept { return dim / heads; }
  [[nodiscard]] int kv_dim() const noexcept { return kv_heads * head_dim(); }
};

/// The weights of one transformer block.
struct LayerWeights {
  std::vector<float> attention_norm;  ///< [dim]
  std::vector<float> wq;              ///< [dim][dim]
  std::vector<float> wk;              ///< [kv_dim][dim]
  std::vector<float> wv;              ///< [kv_dim][dim]
  std::vector<float> wo;              ///< [dim][dim]
  std::vector<float> ffn_norm;        ///< [dim]
  std::vector<float> w1;              ///< [hidden][dim], the SwiGLU gate
  std::vector<float> w2;              ///< [dim][hidden], down projection
  std::vector<float> w3;              ///< [hidden][dim], up projection
};

struct Checkpoint {
  Config config;
  std::vector<float> token_embedding;  ///< [vocab][dim]
  std::vector<LayerWeights> layers;
  std::vector<float> final_norm;  ///< [dim]
  /// [vocab][dim]; a copy of token_embedding when the checkpoint ties them (32K floats here,
  /// cheaper than a second code path).
  std::vector<float> classifier;
};

/// "dim 64, hidden_dim 172, 5 layers, ..." for messages.
inline std::string describe(const Config& c) {
  return fmt::format("dim {}, hidden_dim {}, {} layers, {} heads, {} KV heads, vocab {}, seq_len {}", c.dim,
                     c.hidden_dim, c.layers, c.heads, c.kv_heads, c.vocab_size, c.seq_len);
}

namespace detail {

inline constexpr std::size_t kHeaderBytes = 7 * sizeof(std::int32_t);

/// Rejects headers no llama model has, before their sizes are multiplied together.
inline void validate_header(const std::filesystem::path& path, const Config& c) {
  constexpr int kLimit = 1 << 20;  // far beyond any llama2.c model; keeps the count of floats in 64 bits
  auto positive = [&](const char* field, int value) {
    if (value <= 0 || value > kLimit) {
      fail_file(path, fmt::format("header field {} = {} is not in [1, {}] (not a llama2.c checkpoint?)", field, value,
                                  kLimit));
    }
  };
  positive("dim", c.dim);
  positive("hidden_dim", c.hidden_dim);
  positive("n_layers", c.layers);
  positive("n_heads", c.heads);
  positive("n_kv_heads", c.kv_heads);
  positive("vocab_size (absolute value)", c.vocab_size);
  positive("seq_len", c.seq_len);
  if (c.dim % c.heads != 0) {
    fail_file(path, fmt::format("dim {} is not a multiple of n_heads {}", c.dim, c.heads));
  }
  if (c.heads % c.kv_heads != 0) {
    fail_file(path, fmt::format("n_heads {} is not a multiple of n_kv_heads {}", c.heads, c.kv_heads));
  }
  if (c.head_dim() % 2 != 0) {
    fail_file(path, fmt::format("head_dim {} is odd; RoPE rotates pairs of channels", c.head_dim()));
  }
}

/// Exact file size the header implies; nullopt when that exceeds 64 bits. With every field at
/// most 2^20 (and kv_dim ≤ dim) the count of floats stays below 2^64, but not always its bytes.
inline std::optional<std::uint64_t> expected_bytes(const Config& c, bool tied_classifier) {
  const std::uint64_t dim = c.dim, hidden = c.hidden_dim, layers = c.layers, kv_dim = c.kv_dim();
  const std::uint64_t vocab = c.vocab_size, rope_tables = static_cast<std::uint64_t>(c.seq_len) * c.head_dim();
  const std::uint64_t per_layer = 2 * dim + 2 * dim * dim + 2 * kv_dim * dim + 3 * hidden * dim;
  const std::uint64_t floats =
      vocab * dim + layers * per_layer + dim + rope_tables + (tied_classifier ? 0 : vocab * dim);
  if (floats > (std::numeric_limits<std::uint64_t>::max() - kHeaderBytes) / sizeof(float)) return std::nullopt;
  return kHeaderBytes + floats * sizeof(float);
}

}  // namespace detail

/// Loads `path`. Throws kvpack::Error naming the file when it cannot be read, its header is
/// inconsistent, its length differs from what the header implies, or a weight is not finite.
inline Checkpoint load_checkpoint(const std::filesystem::path& path) {
  BinaryReader in(path);
  if (in.size() < detail::kHeaderBytes) {
    fail_file(path, fmt::format("file is {} bytes, shorter than the {}-byte llama2.c header", in.size(),
                                detail::kHeaderBytes));
  }
  Checkpoint checkpoint;
  Config& c = checkpoint.config;
  c.dim = in.read_i32("dim");
  c.hidden_dim = in.read_i32("hidden_dim");
  c.layers = in.read_i32("n_layers");
  c.heads = in.read_i32("n_heads");
  c.kv_heads = in.read_i32("n_kv_heads");
  const std::int32_t signed_vocab = in.read_i32("vocab_size");
  c.seq_len = in.read_i32("seq_len");
  const bool tied_classifier = signed_vocab > 0;
  // Negating INT32_MIN would overflow; 0 is as invalid, and validate_header reports both.
  c.vocab_size = signed_vocab == INT32_MIN ? 0 : std::abs(signed_vocab);
  detail::validate_header(path, c);

  const std::optional<std::uint64_t> expected = detail::expected_bytes(c, tied_classifier);
  if (!expected) {
    fail_file(path, fmt::format("a checkpoint with {} would be more than 2^64 bytes (not a llama2.c checkpoint?)",
                                describe(c)));
  }
  if (in.size() != *expected) {
    fail_file(path, fmt::format("file is {} bytes, but a checkpoint with {} ({} classifier) is exactly {} bytes "
                                "(truncated, padded, or not a legacy llama2.c export)",
                                in.size(), describe(c), tied_classifier ? "tied" : "untied", *expected));
  }

  const auto dim = static_cast<std::size_t>(c.dim), hidden = static_cast<std::size_t>(c.hidden_dim);
  const auto kv_dim = static_cast<std::size_t>(c.kv_dim()), vocab = static_cast<std::size_t>(c.vocab_size);
  checkpoint.token_embedding = in.read_finite_floats(vocab * dim, "token embedding");
  checkpoint.layers.resize(static_cast<std::size_t>(c.layers));
  // Each tensor kind is stored for every layer before the next kind begins.
  auto read_per_layer = [&](std::vector<float> LayerWeights::*tensor, std::size_t count, const char* name) {
    for (std::size_t l = 0; l < checkpoint.layers.size(); ++l) {
      checkpoint.layers[l].*tensor = in.read_finite_floats(count, fmt::format("layer {} {}", l, name));
    }
  };
  read_per_layer(&LayerWeights::attention_norm, dim, "attention norm");
  read_per_layer(&LayerWeights::wq, dim * dim, "wq");
  read_per_layer(&LayerWeights::wk, kv_dim * dim, "wk");
  read_per_layer(&LayerWeights::wv, kv_dim * dim, "wv");
  read_per_layer(&LayerWeights::wo, dim * dim, "wo");
  read_per_layer(&LayerWeights::ffn_norm, dim, "FFN norm");
  read_per_layer(&LayerWeights::w1, hidden * dim, "w1");
  read_per_layer(&LayerWeights::w2, dim * hidden, "w2");
  read_per_layer(&LayerWeights::w3, hidden * dim, "w3");
  checkpoint.final_norm = in.read_finite_floats(dim, "final norm");
  in.skip(static_cast<std::size_t>(c.seq_len) * static_cast<std::size_t>(c.head_dim()) * sizeof(float),
          "legacy RoPE tables");
  checkpoint.classifier =
      tied_classifier ? checkpoint.token_embedding : in.read_finite_floats(vocab * dim, "classifier");
  return checkpoint;
}

}  // namespace llama2c
