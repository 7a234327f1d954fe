#pragma once
/// \file mla.hpp
/// \brief layout::MLA: multi-head latent attention (DeepSeek-V2/V3), decoded in absorbed form.
///
/// Per layer and token the cache holds one latent c (latent_dim, 512 in DeepSeek-V2) and one
/// decoupled RoPE key k^R (rope_dim, 64), shared by every query head: one stream per layer. With
/// the up-projections absorbed into the query and the output (ALGORITHMS.md §11.2), query head i
/// brings [W_UKᵢᵀ q^C_i ; q^R_i] (latent_dim + rope_dim) and scores token j by
/// q_lat·c_j + q_rope·k^R_j; its output Σ_j p_ij c_j stays in latent space (latent_dim), for
/// the engine to multiply by W_UV·W_O. So decode reads the latent once for all heads, like MQA.
///
/// In the cache, the key plane holds k^R (key_dim = rope_dim) and the value plane holds c
/// (value_dim = latent_dim): the latent is stored once and read as both key and value. Prefill
/// and append take keys [T][rope_dim] and values [T][latent_dim]; attend takes queries
/// [q_heads][latent_dim + rope_dim] and writes [q_heads][latent_dim]. ModelShape.head_dim is the
/// model's per-head width before absorption; the cache does not use it.

#include <string_view>

#include "kvpack/error.hpp"
#include "kvpack/layout/layout_concepts.hpp"

namespace kvpack::inline v0::layout {

struct MLA {
  static constexpr std::string_view kName = "mla";
  /// attend scores the value plane too: keys for scoring are [value plane ; key plane].
  static constexpr bool kScoresLatent = true;

  /// The widest latent or rope row: what a page file holds (io::PageFileLimits), and small
  /// enough that query_dim and the kernels' row widths cannot overflow.
  static constexpr index_t kMaxDim = 16384;

  index_t latent_dim = 512;  ///< kv_lora_rank
  index_t rope_dim = 64;     ///< qk_rope_head_dim

  void validate(const ModelShape& shape) const {
    shape.validate();
    KVPACK_CHECK(shape.kv_heads == 1, kInvalidConfig,
                 detail::message("layout::MLA keeps one latent stream per layer, shared by every query head: "
                                 "ModelShape.kv_heads must be 1, got ", shape.kv_heads));
    KVPACK_CHECK(latent_dim > 0 && rope_dim > 0 && latent_dim <= kMaxDim && rope_dim <= kMaxDim, kInvalidConfig,
                 detail::message("layout::MLA needs latent_dim and rope_dim in [1, ", kMaxDim, "], got ", latent_dim,
                                 " and ", rope_dim));
  }
  [[nodiscard]] index_t streams(const ModelShape&) const noexcept { return 1; }
  [[nodiscard]] index_t stream_of_query_head(const ModelShape&, index_t) const noexcept { return 0; }
  [[nodiscard]] index_t key_dim(const ModelShape&) const noexcept { return rope_dim; }
  [[nodiscard]] index_t value_dim(const ModelShape&) const noexcept { return latent_dim; }
  /// Floats per query head that attend takes: the absorbed latent query, then the RoPE query.
  [[nodiscard]] index_t query_dim(const ModelShape&) const noexcept { return latent_dim + rope_dim; }

  friend constexpr bool operator==(const MLA&, const MLA&) = default;
};
static_assert(Layout<MLA>);

}  // namespace kvpack::inline v0::layout
