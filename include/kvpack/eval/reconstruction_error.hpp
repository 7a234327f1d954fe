#pragma once
/// \file reconstruction_error.hpp
/// \brief How far the keys and values a cache stores are from the fp32 ones it was given: the
///        codec's error before attention mixes it.

#include <cmath>
#include <limits>

#include "kvpack/error.hpp"
#include "kvpack/eval/policies.hpp"
#include "kvpack/eval/synthetic.hpp"

namespace kvpack::inline v0::eval {

/// Relative errors ‖x̂ − x‖₂ / ‖x‖₂ over every stored element of a layer (all KV heads).
struct ReconstructionError {
  double keys = 0.0;
  double values = 0.0;
};

/// Compares what `cache` stores for layer `layer` of `seq` (read_back: decoded pages and fp32
/// rows, pre-RoPE keys rotated back to their positions) with `input`, the K/V the layer was
/// prefilled with from position 0. Tokens a policy dropped are not counted: their loss shows in
/// the attention error, not here.
inline ReconstructionError reconstruction_error(const AnyCache& cache, SeqId seq, index_t layer, const LayerKV& input) {
  KVPACK_CHECK(cache.shape().kv_heads == input.kv_heads && cache.shape().head_dim == input.head_dim, kInvalidArgument,
               ::kvpack::detail::message("reconstruction_error: the cache holds ", cache.shape().kv_heads, " KV heads of ",
                                         cache.shape().head_dim, " channels, the input ", input.kv_heads, " of ",
                                         input.head_dim));
  double key_error = 0.0, key_norm = 0.0, value_error = 0.0, value_norm = 0.0;
  const index_t d = input.head_dim;
  for (index_t h = 0; h < input.kv_heads; ++h) {
    const StoredTokens stored = cache.read_back(seq, layer, h);
    for (index_t i = 0; i < stored.size(); ++i) {
      const index_t t = stored.positions[i];
      KVPACK_CHECK(t >= 0 && t < input.tokens, kInvalidArgument,
                   ::kvpack::detail::message("reconstruction_error: stored position ", t, " is not a token of the input (",
                                             input.tokens, " tokens from position 0)"));
      for (index_t c = 0; c < d; ++c) {
        const double k = input.key(t, h)[c], v = input.value(t, h)[c];
        const double dk = stored.keys[static_cast<std::size_t>(i) * d + c] - k;
        const double dv = stored.values[static_cast<std::size_t>(i) * d + c] - v;
        key_error += dk * dk;
        key_norm += k * k;
        value_error += dv * dv;
        value_norm += v * v;
      }
    }
  }
  // As relative_error: 0 when both are zero, +inf when only the input is (not an absolute
  // error in a column of relative ones).
  const auto relative = [](double error, double norm) {
    if (norm > 0.0) return std::sqrt(error / norm);
    return error == 0.0 ? 0.0 : std::numeric_limits<double>::infinity();
  };
  return {relative(key_error, key_norm), relative(value_error, value_norm)};
}

}  // namespace kvpack::inline v0::eval
